// StopSignals: the one signal handler of the long-running commands.
#include "tools/outcore/stop_signals.hpp"

#include <unistd.h>

#include <cstring>

namespace outcore::cli {
namespace {

std::atomic<bool> g_stop{false};
std::atomic<const char*> g_notice{nullptr};
static_assert(std::atomic<bool>::is_always_lock_free);
static_assert(std::atomic<const char*>::is_always_lock_free);

extern "C" void on_stop_signal(int) {
  // Async-signal-safe only: atomic loads and stores, strlen and write(2). SA_RESETHAND has
  // restored the default action, so a second signal ends the process at once.
  g_stop.store(true, std::memory_order_relaxed);
  if (const char* notice = g_notice.load(std::memory_order_relaxed)) {
    ssize_t ignored = ::write(STDERR_FILENO, notice, std::strlen(notice));
    (void)ignored;
  }
}

}  // namespace

std::atomic<bool>& stop_flag() { return g_stop; }

StopSignals::StopSignals(Options options)
    : count_(options.mpirun_stop ? 4 : 3), ignore_sigpipe_(options.ignore_sigpipe) {
  g_stop.store(false);
  g_notice.store(options.notice);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND | SA_RESTART;
  for (size_t i = 0; i < count_; ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
  if (ignore_sigpipe_) {
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    ::sigaction(SIGPIPE, &ign, &old_pipe_);
  }
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < count_; ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
  if (ignore_sigpipe_) ::sigaction(SIGPIPE, &old_pipe_, nullptr);
  g_notice.store(nullptr);
}

}  // namespace outcore::cli
