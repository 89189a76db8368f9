// StopSignals: the one signal handler of the long-running commands.
#include "tools/outcore/stop_signals.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <system_error>
#include <thread>

#include "common/cleanup.hpp"

namespace outcore::cli {
namespace {

std::atomic<bool> g_stop{false};
// Set by the SIGUSR1 that catch_early_mpirun_stop's handler caught before a StopSignals was made.
std::atomic<bool> g_early_stop{false};
// Bit s - 1: signal s caught by catch_early_stop's handler since the last StopSignals took them.
std::atomic<unsigned> g_early_seen{0};
std::atomic<unsigned> g_seen{0};  // bit s - 1: signal s received since the StopSignals was made
std::atomic<const char*> g_notice{nullptr};
std::atomic<bool> g_launcher_gone{false};  // end_with_launcher's signal came
// One press of Ctrl-C can reach the process twice within milliseconds (coreutils `timeout`
// forwards the terminal's SIGINT, which reaches the process too; a closed terminal's SIGHUP
// comes from the kernel and again from the shell): a repeat of a signal within this of its first
// is that same one.
constexpr int64_t kSamePressNs = 250'000'000;
// After the second, while the watcher removes the files, further signals are ignored for this
// long; one after it ends the process at once (the removal hangs on a stalled drive).
constexpr int64_t kRemovalGraceNs = 1'000'000'000;
std::array<std::atomic<int64_t>, 65> g_first_ns{};  // per signal: when its first came
std::atomic<int64_t> g_abort_ns{0};                 // when the second came (0: not yet)
static_assert(std::atomic<int64_t>::is_always_lock_free);

// CLOCK_MONOTONIC in nanoseconds (async-signal-safe).
int64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

// Whether `sig`, seen before, repeats its first within kSamePressNs (the same press delivered
// twice). A first whose time is not stored yet (its handler runs on another thread now) is the
// same press too.
bool same_press(int sig, int64_t now) {
  const int64_t first = g_first_ns[sig].load(std::memory_order_relaxed);
  return first == 0 || now - first < kSamePressNs;
}

// The process's parent when main began (0: not taken): the launcher, for end_with_launcher.
std::atomic<pid_t> g_parent_at_start{0};

// The stop signals the process was started with ignored (nohup's SIGHUP, a script's background
// job's SIGINT): they stay ignored. Bit s - 1 for signal s; taken before any handler is set.
unsigned ignored_at_start() {
  static const unsigned mask = [] {
    unsigned m = 0;
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1}) {
      struct sigaction old {};
      if (::sigaction(sig, nullptr, &old) == 0 && (old.sa_flags & SA_SIGINFO) == 0 &&
          old.sa_handler == SIG_IGN)
        m |= 1u << (sig - 1);
    }
    return m;
  }();
  return mask;
}
bool ignored(int sig) { return (ignored_at_start() & (1u << (sig - 1))) != 0; }
// Write end of the watcher's pipe (-1 without one). The pipe and the watcher live as long as the
// process: a handler still running on another thread never writes to a closed descriptor.
std::atomic<int> g_wake{-1};
static_assert(std::atomic<bool>::is_always_lock_free);
static_assert(std::atomic<unsigned>::is_always_lock_free);
static_assert(std::atomic<int>::is_always_lock_free);
static_assert(std::atomic<const char*>::is_always_lock_free);

// Ends the process by `sig` now (async-signal-safe).
void die_by(int sig) {
  ::signal(sig, SIG_DFL);
  // Inside its own handler the signal is blocked: unblocked, the raise ends the process now.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  ::raise(sig);
  ::_exit(128 + sig);  // only if `sig` is blocked
}

extern "C" void on_stop_signal(int sig) {
  // Async-signal-safe only: atomics, clock_gettime, strlen, write(2), signal(2), raise(3).
  const int saved_errno = errno;
  const int64_t now = now_ns();
  const unsigned bit = 1u << (sig - 1);
  if ((g_seen.fetch_or(bit, std::memory_order_relaxed) & bit) == 0) {
    // This signal's first: stop after the step in progress.
    g_first_ns[sig].store(now, std::memory_order_relaxed);
    g_stop.store(true, std::memory_order_relaxed);
    if (const char* notice = g_notice.load(std::memory_order_relaxed)) {
      ssize_t ignored = ::write(STDERR_FILENO, notice, std::strlen(notice));
      (void)ignored;
    }
    errno = saved_errno;
    return;
  }
  if (same_press(sig, now)) {  // its first again: nothing more
    errno = saved_errno;
    return;
  }
  int64_t second = 0;
  if (g_abort_ns.compare_exchange_strong(second, now, std::memory_order_relaxed)) {
    // Its second: the watcher removes the files registered for cleanup, then ends the process
    // by it.
    const int fd = g_wake.load(std::memory_order_relaxed);
    const unsigned char s = static_cast<unsigned char>(sig);
    if (fd < 0 || ::write(fd, &s, 1) != 1) die_by(sig);
  } else if (now - second >= kRemovalGraceNs) {
    die_by(sig);  // a third while the removal still runs: at once
  }
  errno = saved_errno;
}

extern "C" void on_launcher_gone(int) {
  // Async-signal-safe only: atomics, write(2), and die_by. Its repeats do nothing.
  const int saved_errno = errno;
  if (!g_launcher_gone.exchange(true, std::memory_order_relaxed)) {
    g_stop.store(true, std::memory_order_relaxed);
    const int fd = g_wake.load(std::memory_order_relaxed);
    const unsigned char s = SIGTERM;
    if (fd < 0 || ::write(fd, &s, 1) != 1) die_by(SIGTERM);
  }
  errno = saved_errno;
}

// Starts the watcher once per process; false when it cannot run (then a second signal ends the
// process without the removal).
bool start_watcher() {
  static std::once_flag once;
  std::call_once(once, [] {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return;
    try {
      std::thread([fd = fds[0]] {
        for (;;) {
          unsigned char sig = 0;
          const ssize_t n = ::read(fd, &sig, 1);
          if (n < 0 && errno == EINTR) continue;
          if (n != 1) return;
          if (sig == 0 || sig >= NSIG) continue;  // only the handlers write here
          cleanup::remove_registered_files();
          die_by(sig);
        }
      }).detach();
    } catch (const std::system_error&) {
      ::close(fds[0]);
      ::close(fds[1]);
      return;
    }
    g_wake.store(fds[1]);
  });
  return g_wake.load() >= 0;
}

}  // namespace

std::atomic<bool>& stop_flag() { return g_stop; }

void catch_early_mpirun_stop() {
  ignored_at_start();  // taken before any handler is set
  g_parent_at_start.store(::getppid());
  if (std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr || ignored(SIGUSR1)) return;
  struct sigaction sa {};
  sa.sa_handler = [](int) { g_early_stop.store(true); };
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGUSR1, &sa, nullptr);
}

void catch_early_stop() {
  struct sigaction sa {};
  sa.sa_handler = [](int sig) {
    // Async-signal-safe: atomics, clock_gettime, and die_by for the same signal again (not
    // for the same press delivered twice).
    const int64_t now = now_ns();
    const unsigned bit = 1u << (sig - 1);
    if ((g_early_seen.fetch_or(bit, std::memory_order_relaxed) & bit) == 0)
      g_first_ns[sig].store(now, std::memory_order_relaxed);
    else if (!same_press(sig, now))
      die_by(sig);
  };
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM, SIGHUP})
    if (!ignored(sig)) ::sigaction(sig, &sa, nullptr);
}

bool end_with_launcher() {
  start_watcher();
  const int sig = launcher_gone_signal();
  struct sigaction sa {};
  sa.sa_handler = on_launcher_gone;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (::sigaction(sig, &sa, nullptr) != 0) return false;
  const pid_t at_start = g_parent_at_start.load();
  const pid_t launcher = at_start != 0 ? at_start : ::getppid();
  if (::prctl(PR_SET_PDEATHSIG, sig) != 0) return false;
  if (::getppid() != launcher) ::raise(sig);  // it died before the request took
  return true;
}

StopSignals::StopSignals(Options options)
    : count_(options.mpirun_stop ? 4 : 3), ignore_sigpipe_(options.ignore_sigpipe) {
  g_stop.store(false);
  g_seen.store(0);
  // A first of this one's is timed afresh (one catch_early_stop caught keeps its time).
  const unsigned early_seen = g_early_seen.load();
  for (int sig : kSignals)
    if ((early_seen & (1u << (sig - 1))) == 0) g_first_ns[sig].store(0);
  g_notice.store(options.notice);
  start_watcher();
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (size_t i = 0; i < count_; ++i)
    if (!ignored(kSignals[i]) && ::sigaction(kSignals[i], &sa, &old_[i]) == 0)
      installed_ |= 1u << i;
  // A stop mpirun forwarded before this was made (catch_early_mpirun_stop) is this one's first
  // (taken once the handlers are in place, so that none arrives unseen in between).
  if (options.mpirun_stop && g_early_stop.exchange(false)) g_stop.store(true);
  if (ignore_sigpipe_) {
    struct sigaction ign {};
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    ::sigaction(SIGPIPE, &ign, &old_pipe_);
  }
  // Signals catch_early_stop caught, up to the handlers above taking over, are firsts here
  // (taken after the handlers are in place, so that none arrives unseen in between).
  if (const unsigned early = g_early_seen.exchange(0); early != 0) {
    g_seen.fetch_or(early);
    g_stop.store(true);
    if (options.notice != nullptr) {
      ssize_t ignored = ::write(STDERR_FILENO, options.notice, std::strlen(options.notice));
      (void)ignored;
    }
  }
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < count_; ++i)
    if ((installed_ & (1u << i)) != 0) ::sigaction(kSignals[i], &old_[i], nullptr);
  if (ignore_sigpipe_) ::sigaction(SIGPIPE, &old_pipe_, nullptr);
  g_notice.store(nullptr);
}

}  // namespace outcore::cli
