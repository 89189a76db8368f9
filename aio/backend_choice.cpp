// resolve_backend: the process-wide choice between io_uring and the synchronous fallback,
// made once from the request recorded by request_backend() and one io_uring probe.
#include <fmt/format.h>
#include <liburing.h>
#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <exception>
#include <fstream>
#include <mutex>
#include <optional>
#include <system_error>

#include "aio/aio.hpp"
#include "aio/backend_internal.hpp"
#include "common/log.hpp"

namespace outcore::aio {
namespace {

// What request_backend() names when its caller gave no source.
constexpr const char* kDefaultSource = "aio::request_backend";

int probe_io_uring() {
  io_uring ring{};
  int rc = io_uring_queue_init(1, &ring, 0);
  if (rc == 0) io_uring_queue_exit(&ring);
  return rc;
}

std::atomic<internal::ProbeFunction> g_probe{&probe_io_uring};

struct Request {
  std::string value;   // "io_uring", "sync" or empty (automatic); validated by decide()
  std::string source;  // quoted in messages; never empty
};

struct Decision {
  BackendChoice choice;
  std::exception_ptr error;  // set instead of choice when the decision is an error
};

std::mutex g_mu;
Request g_request{"", kDefaultSource};  // guarded by g_mu
std::optional<Decision> g_decision;     // guarded by g_mu

// A fork waits until no thread holds g_mu (a thread may hold it through the probe), and the
// child starts with it free: held at the fork, it would stay locked in the child forever.
[[maybe_unused]] const int g_fork_handlers = [] {
  const int rc =
      ::pthread_atfork([] { g_mu.lock(); }, [] { g_mu.unlock(); }, [] { g_mu.unlock(); });
  if (rc != 0) throw std::system_error(rc, std::generic_category(), "aio: pthread_atfork");
  return rc;
}();

const char* errno_name(int err) {
  switch (err) {
    case EPERM:
      return "EPERM";
    case EACCES:
      return "EACCES";
    case ENOSYS:
      return "ENOSYS";
    case ENOMEM:
      return "ENOMEM";
    case EINVAL:
      return "EINVAL";
    case EMFILE:
      return "EMFILE";
    case ENFILE:
      return "ENFILE";
    default:
      return nullptr;
  }
}

// The value of sysctl kernel.io_uring_disabled (0, 1, 2), or -1 where the kernel has none.
int io_uring_disabled_sysctl() {
  std::ifstream in("/proc/sys/kernel/io_uring_disabled");
  int value = -1;
  return in >> value ? value : -1;
}

std::string permission_cause() {
  switch (io_uring_disabled_sysctl()) {
    case 2:
      return "io_uring is disabled for every process (sysctl kernel.io_uring_disabled = 2)";
    case 1:
      return "io_uring is allowed only to processes with CAP_SYS_ADMIN or in the group "
             "kernel.io_uring_group (sysctl kernel.io_uring_disabled = 1)";
    default:
      return "a seccomp filter refuses io_uring_setup (container runtimes' default profiles "
             "do; allow io_uring_setup, io_uring_enter and io_uring_register)";
  }
}

// "io_uring_queue_init failed with EPERM, Operation not permitted (errno 1): <meaning>".
std::string probe_failure_cause(int err) {
  const char* name = errno_name(err);
  std::string what =
      fmt::format("io_uring_queue_init failed with {}{}",
                  name != nullptr ? std::string(name) + ", " : "", errno_string(err));
  switch (err) {
    case EPERM:
    case EACCES:
      return what + ": " + permission_cause();
    case ENOSYS:
      return what +
             ": the kernel has no io_uring (older than 5.1, or built without CONFIG_IO_URING), "
             "or a seccomp filter hides io_uring_setup";
    case ENOMEM:
      return what +
             ": the ring's memory cannot be locked (kernels before 5.12 count it against "
             "RLIMIT_MEMLOCK; raise ulimit -l)";
    case EMFILE:
    case ENFILE:
      return what + ": no file descriptor is left for the ring";
    default:
      return what;
  }
}

void warn_fallback(const std::string& cause, const std::string& source) {
  log::warn(
      "aio: io_uring cannot be used ({}); falling back to synchronous pread/pwrite. Cost: no "
      "asynchronous queue depth, each I/O thread does one request at a time (aio.queue_depth "
      "has no effect), so swap I/O is slower; raise aio.intra_op_parallelism (thread_count) to "
      "keep more requests in flight. {}=sync selects this backend without this warning.",
      cause, source);
}

Decision chosen(BackendKind kind, const std::string& forced_by, std::string fallback_reason = "") {
  Decision d;
  d.choice.kind = kind;
  d.choice.forced = !forced_by.empty();
  d.choice.forced_by = forced_by;
  d.choice.fallback_reason = std::move(fallback_reason);
  return d;
}

Decision refused(const std::string& message) {
  Decision d;
  d.error = std::make_exception_ptr(ConfigError("", message));
  return d;
}

// REQUIRES: g_mu held.
Decision decide() {
  const std::string& value = g_request.value;
  const std::string& source = g_request.source;
  if (value == "sync") return chosen(BackendKind::kSync, source);
  if (!value.empty() && value != "io_uring") {
    return refused(fmt::format(
        "{}={}: not a backend (allowed values: io_uring, sync; unset chooses io_uring where the "
        "kernel allows it, else sync)",
        source, value));
  }
  int rc = g_probe.load()();
  if (rc == 0) return chosen(BackendKind::kIoUring, value.empty() ? "" : source);
  std::string cause = probe_failure_cause(-rc);
  if (!value.empty()) {
    return refused(fmt::format("{}=io_uring, but io_uring cannot be used: {}", source, cause));
  }
  warn_fallback(cause, source);
  return chosen(BackendKind::kSync, "", cause);
}

}  // namespace

std::string BackendChoice::name() const { return kind == BackendKind::kSync ? "sync" : "io_uring"; }

void request_backend(std::string value, std::string source) {
  std::lock_guard lock(g_mu);
  g_request.value = std::move(value);
  g_request.source = source.empty() ? kDefaultSource : std::move(source);
}

BackendChoice resolve_backend() {
  std::lock_guard lock(g_mu);
  if (!g_decision) g_decision = decide();
  if (g_decision->error) std::rethrow_exception(g_decision->error);
  return g_decision->choice;
}

std::unique_ptr<IoBackend> make_default_backend() {
  return resolve_backend().kind == BackendKind::kSync ? make_sync_backend()
                                                      : make_io_uring_backend();
}

namespace internal {

ProbeFunction set_io_uring_probe_for_testing(ProbeFunction fn) {
  return g_probe.exchange(fn != nullptr ? fn : &probe_io_uring);
}

void reset_backend_choice_for_testing() {
  std::lock_guard lock(g_mu);
  g_decision.reset();
}

}  // namespace internal
}  // namespace outcore::aio
