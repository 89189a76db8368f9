// tools/outcore: long work that stops cleanly on a signal (train, demo, export, tokenize).
//
// For the lifetime of a StopSignals, the first SIGINT, SIGTERM or SIGHUP (and SIGUSR1 with
// `mpirun_stop`) sets stop_flag() and writes the notice, if any, to stderr. The same signal
// again within 250 ms of its first is that first one delivered twice (coreutils `timeout` and a
// terminal both send one Ctrl-C; a closed terminal's SIGHUP comes from the kernel and the shell)
// and changes nothing. Later, the same signal again ends the process at once, by that signal,
// after a watcher thread (one per process) has removed the files registered for cleanup
// (common/cleanup.hpp: the swap files and their directories' locks), which a signal handler
// cannot do safely; signals in the second after that are ignored while the removal runs, and
// one after it ends the process even if the removal hangs. A different signal after the first
// is a first one too (a launcher may forward one Ctrl-C as two signals). A signal the process
// was started with ignored (nohup's SIGHUP) stays ignored. With `ignore_sigpipe`, SIGPIPE is
// ignored (output to a closed pipe fails with EPIPE instead of killing the process).
// Construction clears the flag (then sets it for a signal catch_early_stop caught); destruction
// restores the previous actions.
//
// Threading: one StopSignals at a time in a process, made and destroyed on one thread; the flag
// may be read from any thread.
#pragma once

#include <signal.h>

#include <array>
#include <atomic>

namespace outcore::cli {

// The process's stop request, set by the handler of a live StopSignals.
std::atomic<bool>& stop_flag();

// In a process mpirun started: SIGUSR1 (mpirun's forwarded stop, whose default action would end
// the process) is caught from now on and taken by the first StopSignals with mpirun_stop as its
// first stop signal. Call at the start of main. (A SIGUSR1 before main runs, while the process
// is loaded or re-executed, still ends it by its default action.) Also notes the process's parent
// (end_with_launcher's launcher).
void catch_early_mpirun_stop();

// At the start of a long-running command (train, demo, export, tokenize): the first SIGINT,
// SIGTERM or SIGHUP before its StopSignals is made is taken by that StopSignals as its first
// (the command stops at its first check for a stop, exit 130, its notice written then); the same
// signal again (not the same press delivered twice, as above) ends the process by it, another
// one counts as a first too; one ignored at start stays ignored. Without it, such a signal
// ended the process by its default action (exit 143 for SIGTERM) while the command was still
// reading its inputs.
void catch_early_stop();

// The signal end_with_launcher asks the kernel for when the launcher dies: a real-time signal no
// library of the process uses.
inline int launcher_gone_signal() { return SIGRTMIN + 4; }

// In a data-parallel rank (call once, on the main thread; the launcher is the parent the process
// had when catch_early_mpirun_stop ran at the start of main, else its parent now): when
// the launcher dies (mpirun killed, or ended by a second Ctrl-C), the process ends at once as by
// a second stop signal: nothing supervises it any more, and killing mpirun is how a user aborts a
// job. The watcher removes the files registered for cleanup (the last completed checkpoint is
// kept), then the process ends by SIGTERM. The kernel sends the parent-death signal once for each
// thread of a multithreaded launcher as they end, so it is launcher_gone_signal(), whose repeats
// are ignored, and not SIGTERM, whose repeats would count as a second and a third stop (the third
// ending the process before its files went). Returns false when the kernel refused the request
// (then the rank outlives its launcher as any process would).
bool end_with_launcher();

class StopSignals {
 public:
  struct Options {
    // Written to stderr by the first signal (async-signal-safe: write(2)); null: nothing.
    // Must outlive the object (a string literal).
    const char* notice = nullptr;
    // SIGUSR1 too: what OpenMPI's mpirun forwards to every rank (it answers SIGINT and SIGTERM
    // by sending SIGTERM and, seconds later, SIGKILL), so `kill -USR1 <mpirun>` stops a job.
    bool mpirun_stop = false;
    bool ignore_sigpipe = false;
  };
  explicit StopSignals(Options options);
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  static constexpr std::array<int, 4> kSignals = {SIGINT, SIGTERM, SIGHUP, SIGUSR1};
  size_t count_ = 3;        // of kSignals handled
  unsigned installed_ = 0;  // bit i: kSignals[i]'s handler set here (not ignored at start)
  bool ignore_sigpipe_ = false;
  std::array<struct sigaction, 4> old_{};
  struct sigaction old_pipe_ {};
};

}  // namespace outcore::cli
