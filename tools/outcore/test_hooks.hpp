// Faults and delays the command-line tests inject into `outcore`, so that they can kill a
// checkpoint save or signal an export at a chosen point. Two implementations: the shipped
// `outcore` links test_hooks_none.cpp (every hook off); the test-only binary
// `outcore_with_test_hooks` links test_hooks_env.cpp, which reads them from the environment.
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

namespace outcore::cli {

struct TestHooks {
  // Kill the process with SIGKILL after a checkpoint save wrote this many data bytes (0: never;
  // OUTCORE_TEST_CKPT_CRASH_AFTER_BYTES), or at a named point of the save ("before-rename",
  // "before-latest", "after-latest"; empty: never; OUTCORE_TEST_CKPT_CRASH_AT). Passed to
  // ckpt::WriterOptions.
  uint64_t ckpt_crash_after_bytes = 0;
  std::string ckpt_crash_at;
  // Sleep before `outcore export` reads each piece, after its check for a stop (0: never;
  // OUTCORE_TEST_EXPORT_PIECE_DELAY_MS). With a delay, a file that gets one line per piece
  // between the check and the sleep (empty: none; OUTCORE_TEST_EXPORT_PIECE_LOG): a signal sent
  // after a line appears reaches the export during that piece's sleep.
  std::chrono::milliseconds export_piece_delay{0};
  // The free bytes a checkpoint save sees on its filesystem (unset: statvfs's;
  // OUTCORE_TEST_SAVE_FREE_BYTES). Passed to ckpt::WriterOptions.
  std::optional<uint64_t> save_free_bytes;
  std::string export_piece_log;
  // Sleep at the start of `outcore train` and `outcore export`, once early signals are caught
  // (0: never; OUTCORE_TEST_START_DELAY_MS), after writing a line to a file (empty: none;
  // OUTCORE_TEST_START_LOG): a signal sent once the line appears arrives while the command is
  // reading its inputs.
  std::chrono::milliseconds start_delay{0};
  std::string start_log;
  // Sleep when `outcore train` has stopped on a signal, before it removes its swap files (0:
  // never; OUTCORE_TEST_STOP_DELAY_MS): a second signal then finds the run still stopping.
  std::chrono::milliseconds stop_delay{0};
};

// The hooks of this process, read once on first call. Thread-safe.
const TestHooks& test_hooks();

// The start_delay hook: the line, then the sleep (nothing when it is off).
inline void start_delay_hook() {
  const TestHooks& h = test_hooks();
  if (h.start_delay.count() <= 0) return;
  if (!h.start_log.empty()) std::ofstream(h.start_log) << "started\n" << std::flush;
  std::this_thread::sleep_for(h.start_delay);
}

}  // namespace outcore::cli
