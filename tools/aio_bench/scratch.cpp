#include "tools/aio_bench/scratch.hpp"

#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <random>

#include "common/open_file.hpp"
#include "tools/aio_bench/measure.hpp"
#include "tools/aio_bench/sizes.hpp"

namespace outcore::aio_bench {
namespace fs = std::filesystem;
namespace {

volatile sig_atomic_t g_signal = 0;
// Signals received: two arriving at once on two threads still count as a first and a second.
std::atomic<int> g_received{0};
static_assert(std::atomic<int>::is_always_lock_free, "used in a signal handler");
// The benchmark file's path while one exists, for a second signal to remove (unlink(2) is
// async-signal-safe; a std::string is not).
volatile char g_scratch[4096] = {};
// ... and its identity: a file moved to that name since is someone else's, and kept.
volatile dev_t g_scratch_dev = 0;
volatile ino_t g_scratch_ino = 0;

// The first signal asks the measurements to stop (they unwind and the file goes with its
// owner); a second removes the file at once and ends the process by that signal.
extern "C" void on_signal(int sig) {
  if (g_received.fetch_add(1) == 0) {
    g_signal = sig;
    return;
  }
  struct stat st {};  // stat(2) and unlink(2) are async-signal-safe
  if (g_scratch[0] != '\0' && ::stat(const_cast<const char*>(g_scratch), &st) == 0 &&
      st.st_dev == g_scratch_dev && st.st_ino == g_scratch_ino)
    ::unlink(const_cast<const char*>(g_scratch));
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace

aio::BackendChoice backend_for_run() {
  try {
    return aio::resolve_backend();
  } catch (const ConfigError& e) {
    throw UsageError(e.what());
  }
}

std::string describe_backend(const aio::BackendChoice& b) {
  if (b.forced) return b.name() + " (forced by " + b.forced_by + ")";
  if (!b.fallback_reason.empty()) return b.name() + " (fallback: " + b.fallback_reason + ")";
  return b.name();
}

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction old {};
    // A signal ignored at start (SIGHUP under nohup) stays ignored.
    if (sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    sigaction(sig, &sa, nullptr);
  }
}

bool stop_requested() { return g_signal != 0; }
int stop_signal() { return g_signal; }

void check_directory(const fs::path& dir, uint64_t need) {
  std::error_code ec;
  auto st = fs::status(dir, ec);
  if (!fs::exists(st)) throw UsageError(fmt::format("--path {}: no such directory", dir.string()));
  if (!fs::is_directory(st)) {
    throw UsageError(fmt::format("--path {}: not a directory", dir.string()));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    throw UsageError(fmt::format("--path {}: no permission to create files there ({})",
                                 dir.string(), errno_string(errno)));
  }
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) == 0) {
    uint64_t avail = uint64_t{vfs.f_bavail} * vfs.f_frsize;
    if (avail < need) {
      throw UsageError(
          fmt::format("--path {}: not enough free space for the {} benchmark file ({} available); "
                      "choose a smaller --file-size",
                      dir.string(), format_size(need), format_size(avail / 4096 * 4096)));
    }
  }
}

ScratchFile::ScratchFile(const fs::path& dir, const std::string& stem, uint64_t size) {
  // A name of its own: "<stem>.<pid>[-k].dat", never one that exists (a user's file is kept).
  for (int k = 0;; ++k) {
    path_ = dir / (fmt::format("{}.{}", stem, ::getpid()) + (k > 0 ? fmt::format("-{}", k) : "") +
                   ".dat");
    try {
      file_ = aio::File::open(
          path_, {.access = aio::Access::kReadWrite, .create = true, .exclusive = true});
      break;
    } catch (const IoError& e) {
      if (e.error_number() == EEXIST && k < 100) continue;
      int err = e.error_number();
      if (err == EACCES || err == EPERM || err == EROFS) {
        throw UsageError(fmt::format("--path {}: cannot create files there ({})", dir.string(),
                                     errno_string(err)));
      }
      throw;
    }
  }
  created_ = true;
  (void)file_id_of(file_.fd(), id_);  // unknown (0, 0): never matches, never removed
  g_scratch_dev = id_.dev;
  g_scratch_ino = id_.ino;
  if (path_.native().size() < sizeof g_scratch) {
    g_scratch[0] = '\0';
    const std::string& name = path_.native();
    for (size_t i = 1; i <= name.size(); ++i) g_scratch[i] = name.c_str()[i];
    std::atomic_signal_fence(std::memory_order_seq_cst);
    g_scratch[0] = name[0];  // the path is whole before the handler can see it
  }
  try {
    file_.preallocate(size);
  } catch (const IoError& e) {
    int err = e.error_number();
    g_scratch[0] = '\0';
    (void)unlink_if_same(path_.string(), id_);
    created_ = false;
    if (err == ENOSPC || err == EDQUOT || err == EFBIG) {
      throw UsageError(fmt::format("--path {}: no room for a {} file ({})", dir.string(),
                                   format_size(size), errno_string(err)));
    }
    throw;
  }
}

ScratchFile::~ScratchFile() {
  if (!created_) return;
  g_scratch[0] = '\0';
  (void)unlink_if_same(path_.string(), id_);  // a file moved to its name since is kept
}

void fill_file(const aio::File& file, std::span<std::byte> buffer, uint64_t size) {
  std::mt19937_64 rng(1234);
  for (size_t i = 0; i + 8 <= buffer.size(); i += 8) {
    uint64_t v = rng();
    std::memcpy(buffer.data() + i, &v, 8);
  }
  Workload w{.write = true, .file_size = size, .seconds = 0, .register_buffer = false};
  measure_engine(file, buffer, aio::Options{.queue_depth = 32}, w, stop_requested);
  file.size();
}

}  // namespace outcore::aio_bench
