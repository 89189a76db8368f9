// `outcore_with_test_hooks` (built with the tests only): the hooks from the environment.
#include <cstdlib>

#include "tools/outcore/test_hooks.hpp"

namespace outcore::cli {
namespace {

TestHooks from_environment() {
  TestHooks h;
  if (const char* b = std::getenv("OUTCORE_TEST_CKPT_CRASH_AFTER_BYTES")) {
    h.ckpt_crash_after_bytes = std::strtoull(b, nullptr, 10);
  }
  if (const char* at = std::getenv("OUTCORE_TEST_CKPT_CRASH_AT")) h.ckpt_crash_at = at;
  if (const char* ms = std::getenv("OUTCORE_TEST_EXPORT_PIECE_DELAY_MS")) {
    h.export_piece_delay = std::chrono::milliseconds(std::strtol(ms, nullptr, 10));
  }
  if (const char* log = std::getenv("OUTCORE_TEST_EXPORT_PIECE_LOG")) h.export_piece_log = log;
  if (const char* ms = std::getenv("OUTCORE_TEST_START_DELAY_MS"))
    h.start_delay = std::chrono::milliseconds(std::strtol(ms, nullptr, 10));
  if (const char* log = std::getenv("OUTCORE_TEST_START_LOG")) h.start_log = log;
  if (const char* ms = std::getenv("OUTCORE_TEST_STOP_DELAY_MS"))
    h.stop_delay = std::chrono::milliseconds(std::strtol(ms, nullptr, 10));
  if (const char* b = std::getenv("OUTCORE_TEST_SAVE_FREE_BYTES"))
    h.save_free_bytes = std::strtoull(b, nullptr, 10);
  return h;
}

}  // namespace

const TestHooks& test_hooks() {
  static const TestHooks hooks = from_environment();
  return hooks;
}

}  // namespace outcore::cli
