// StopSignals: the one signal handler of the long-running commands.
#include "tools/outcore/stop_signals.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/cleanup.hpp"

namespace outcore::cli {
namespace {

std::atomic<bool> g_stop{false};
std::atomic<int> g_signals{0};  // signals received since the StopSignals was made
std::atomic<const char*> g_notice{nullptr};
std::atomic<int> g_wake{-1};  // write end of the watcher's pipe
static_assert(std::atomic<bool>::is_always_lock_free);
static_assert(std::atomic<int>::is_always_lock_free);
static_assert(std::atomic<const char*>::is_always_lock_free);

extern "C" void on_stop_signal(int sig) {
  // Async-signal-safe only: atomic loads and stores, strlen and write(2).
  const int saved_errno = errno;
  if (g_signals.fetch_add(1, std::memory_order_relaxed) == 0) {
    g_stop.store(true, std::memory_order_relaxed);
    if (const char* notice = g_notice.load(std::memory_order_relaxed)) {
      ssize_t ignored = ::write(STDERR_FILENO, notice, std::strlen(notice));
      (void)ignored;
    }
  } else if (const int fd = g_wake.load(std::memory_order_relaxed); fd >= 0) {
    // A second signal: the watcher removes the registered files and ends the process by it.
    const unsigned char s = static_cast<unsigned char>(sig);
    ssize_t ignored = ::write(fd, &s, 1);
    (void)ignored;
  }
  errno = saved_errno;
}

}  // namespace

std::atomic<bool>& stop_flag() { return g_stop; }

StopSignals::StopSignals(Options options)
    : count_(options.mpirun_stop ? 4 : 3), ignore_sigpipe_(options.ignore_sigpipe) {
  g_stop.store(false);
  g_signals.store(0);
  g_notice.store(options.notice);
  if (::pipe2(wake_, O_CLOEXEC) == 0) {
    g_wake.store(wake_[1]);
    watcher_ = std::thread([fd = wake_[0]] {
      unsigned char sig = 0;
      ssize_t n;
      while ((n = ::read(fd, &sig, 1)) < 0 && errno == EINTR) {
      }
      if (n != 1 || sig == 0) return;  // the StopSignals goes
      cleanup::remove_registered_files();
      ::signal(sig, SIG_DFL);
      ::raise(sig);
      ::_exit(128 + sig);  // the signal was blocked here
    });
  } else {
    wake_[0] = wake_[1] = -1;  // no watcher: a second signal ends the process at once
  }
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | (watcher_.joinable() ? 0 : SA_RESETHAND);
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
  g_wake.store(-1);
  if (watcher_.joinable()) {
    const unsigned char stop = 0;
    ssize_t ignored = ::write(wake_[1], &stop, 1);
    (void)ignored;
    watcher_.join();
  }
  for (const int fd : wake_)
    if (fd >= 0) ::close(fd);
}

}  // namespace outcore::cli
