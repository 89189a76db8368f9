// The host side of `outcore doctor` (see doctor.hpp).
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <sys/resource.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "aio/aio.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "engine/device/cpu/bf16_gemm.hpp"
#include "engine/zero/geometry.hpp"
#include "engine/zero/plan.hpp"
#include "tools/blas/blas_kernels.hpp"
#include "tools/outcore/doctor.hpp"
#include "tools/outcore/swap_path.hpp"

namespace outcore::cli::doctor {
namespace {

std::string gib(double bytes) { return fmt::format("{:.1f} GiB", bytes / double(1ull << 30)); }

Line cpu_line() {
  const cpu_adam::Isa best = cpu_adam::detect_isa(), used = cpu_adam::active_isa();
  Line l{"cpu", Verdict::kOk, ""};
  l.detail = fmt::format("{} hardware threads; best ISA {}; CPU Adam kernel {}",
                         std::thread::hardware_concurrency(), cpu_adam::isa_name(best),
                         cpu_adam::isa_name(used));
  if (used != best) {
    l.verdict = Verdict::kWarn;
    l.detail += " (OUTCORE_CPU_ADAM_ISA chose a slower kernel than the CPU supports)";
  } else if (best == cpu_adam::Isa::kAvx2) {
    l.detail += " (no AVX-512: Adam runs at half the vector width)";
  } else if (best == cpu_adam::Isa::kScalar) {
    l.verdict = Verdict::kWarn;
    l.detail += " (no AVX2: Adam runs one element at a time, several times slower)";
  }
  return l;
}

Line io_uring_line() {
  try {
    const aio::BackendChoice c = aio::resolve_backend();
    if (c.kind == aio::BackendKind::kIoUring)
      return {"io_uring", Verdict::kOk, "io_uring rings can be created"};
    return {"io_uring", Verdict::kWarn,
            (c.forced ? "sync backend forced by " + c.forced_by
                      : "unavailable, NVMe traffic uses the pread/pwrite thread pool: " +
                            c.fallback_reason)};
  } catch (const std::exception& e) {
    return {"io_uring", Verdict::kFail, e.what()};
  }
}

// Writes and reads back one 4 KiB block with O_DIRECT in a scratch file under dir.
// Writes and reads back one 4 KiB block with O_DIRECT in a file of its own in `dir` (created
// exclusively, never through a link, removed after): empty when that works, else why not.
// `no_space` is set when the write failed for want of space.
std::string try_o_direct(const std::string& dir, bool& no_space) {
  no_space = false;
  std::string path;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 16; ++attempt) {
    path = fmt::format("{}/.outcore_doctor_{}_{}", dir, getpid(), attempt);
    fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST)
      return fmt::format("cannot create a file: {}", std::strerror(errno));
  }
  if (fd < 0) return "cannot create a file: every name tried exists";
  void* buf = nullptr;
  std::string err;
  if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_DIRECT) != 0) {
    err = fmt::format("O_DIRECT refused: {}", std::strerror(errno));
  } else if (posix_memalign(&buf, 4096, 4096) != 0) {
    err = "no memory for a 4 KiB buffer";
  } else {
    std::memset(buf, 0x5a, 4096);
    if (pwrite(fd, buf, 4096, 0) != 4096) {
      no_space = errno == ENOSPC || errno == EDQUOT;
      err = fmt::format("O_DIRECT write failed: {}", std::strerror(errno));
    } else if (pread(fd, buf, 4096, 0) != 4096) {
      err = fmt::format("O_DIRECT read failed: {}", std::strerror(errno));
    }
  }
  std::free(buf);
  close(fd);
  unlink(path.c_str());  // created above, exclusively: this run's own file
  return err;
}

// Free space under which the swap path is warned about (1 GiB).
constexpr double kNvmeFewBytes = double(uint64_t{1} << 30);

// A swap path that does not exist yet is checked in its nearest existing ancestor, where
// training creates it, with a warning (an unmounted drive's path is created on the filesystem
// above it).
Line nvme_line(const std::string& path) {
  namespace fs = std::filesystem;
  Line l{"nvme path", Verdict::kOk, ""};
  const ExistingPart part = nearest_existing_part(path);
  const fs::path& at = part.path;
  const std::string dir = at.string();
  // The part's own type, then what its links lead to (a loop of links fails the second).
  std::error_code followed;
  const fs::file_type type = fs::status(at, followed).type();
  if (part.type == fs::file_type::none || part.type == fs::file_type::unknown || followed)
    return {"nvme path", Verdict::kFail,
            fmt::format("{}: cannot be looked at: {}", dir,
                        part.error ? part.error.message()
                        : followed ? followed.message()
                                   : std::string("unknown file type"))};
  std::error_code ec;
  const bool exists = dir == fs::absolute(path, ec).string();
  if (type != fs::file_type::directory)
    return {"nvme path", Verdict::kFail,
            exists ? path + ": not a directory (swap files need one)"
                   : fmt::format("{}: cannot be created: {} is not a directory", path, dir)};
  const std::string created = exists ? "" : path + ": does not exist yet; training creates it, in ";
  if (!exists) l.verdict = Verdict::kWarn;
  if (access(dir.c_str(), W_OK) != 0)
    return {"nvme path", Verdict::kFail,
            fmt::format("{}: not writable: {}", dir, std::strerror(errno))};
  struct statvfs st {};
  if (statvfs(dir.c_str(), &st) != 0)
    return {"nvme path", Verdict::kFail,
            fmt::format("{}: statvfs failed: {}", dir, std::strerror(errno))};
  const double avail = double(st.f_bavail) * double(st.f_frsize);
  const double total = double(st.f_blocks) * double(st.f_frsize);
  // A filesystem of no blocks at all (proc, sysfs, cgroup): no place for files, however full.
  if (st.f_blocks == 0)
    return {"nvme path", Verdict::kFail,
            fmt::format("{}{}: a filesystem without storage (such as /proc or /sys): swap files "
                        "need a directory on a drive",
                        created, dir)};
  bool no_space = false;
  const std::string odirect = try_o_direct(dir, no_space);
  l.detail = fmt::format("{}{}: {} free of {}; ", created, dir, gib(avail), gib(total));
  if (no_space || st.f_bavail == 0) {
    l.verdict = Verdict::kFail;
    l.detail += "no space left for swap files" + (odirect.empty() ? "" : " (" + odirect + ")");
  } else if (odirect.empty()) {
    l.detail += "O_DIRECT works";
  } else {
    l.verdict = Verdict::kWarn;
    l.detail += odirect + " (swap files fall back to buffered I/O through the page cache)";
  }
  // A filesystem in memory: the swap files would take the host memory they are there to spare.
  struct statfs fs_info {};
  if (l.verdict != Verdict::kFail && ::statfs(dir.c_str(), &fs_info) == 0 &&
      (fs_info.f_type == TMPFS_MAGIC || fs_info.f_type == RAMFS_MAGIC)) {
    l.verdict = Verdict::kWarn;
    l.detail += fmt::format(
        "; a filesystem in memory ({}): swap files there take host memory, which the host "
        "memory line does not count; give a directory on a drive",
        fs_info.f_type == TMPFS_MAGIC ? "tmpfs" : "ramfs");
  }
  // Room for the swap files of a small model at most: said, with where a config's figure is.
  if (l.verdict != Verdict::kFail && avail < kNvmeFewBytes) {
    l.verdict = Verdict::kWarn;
    l.detail += fmt::format(
        "; under {} free: room for the swap files of a small model only "
        "(`outcore estimate` gives a config's nvme bytes)",
        gib(kNvmeFewBytes));
  }
  return l;
}

// Whether this process holds CAP_IPC_LOCK (bit 14 of CapEff in /proc/self/status): mlock is
// then not bound by RLIMIT_MEMLOCK (as root, usually).
bool has_cap_ipc_lock() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (!line.starts_with("CapEff:")) continue;
    try {
      return ((std::stoull(line.substr(7), nullptr, 16) >> 14) & 1) != 0;
    } catch (const std::exception&) {
      return false;
    }
  }
  return false;
}

Line memlock_line(uint64_t pinned_bytes) {
  // No limit or capability makes a pool larger than the host's memory lockable.
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0 &&
      pinned_bytes > static_cast<uint64_t>(pages) * static_cast<uint64_t>(page))
    return {
        "locked memory", Verdict::kFail,
        fmt::format(
            "pinned pool {} is larger than this host's memory {}", zero::format_bytes(pinned_bytes),
            zero::format_bytes(static_cast<uint64_t>(pages) * static_cast<uint64_t>(page)))};
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0)
    return {"locked memory", Verdict::kWarn,
            fmt::format("getrlimit failed: {}", std::strerror(errno))};
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < pinned_bytes && has_cap_ipc_lock())
    return {"locked memory", Verdict::kOk,
            fmt::format("CAP_IPC_LOCK: the pinned pool can be locked whatever RLIMIT_MEMLOCK "
                        "({}) says",
                        zero::format_bytes(rl.rlim_cur))};
  if (rl.rlim_cur == RLIM_INFINITY)
    return {"locked memory", Verdict::kOk,
            "RLIMIT_MEMLOCK unlimited: the pinned pool can be locked"};
  if (rl.rlim_cur >= pinned_bytes)
    return {"locked memory", Verdict::kOk,
            fmt::format("RLIMIT_MEMLOCK {} >= pinned pool {}", zero::format_bytes(rl.rlim_cur),
                        zero::format_bytes(pinned_bytes))};
  return {"locked memory", Verdict::kWarn,
          fmt::format("RLIMIT_MEMLOCK {} < pinned pool {}: the pool stays pageable (slower "
                      "copies); raise it with `ulimit -l unlimited` or limits.conf memlock",
                      zero::format_bytes(rl.rlim_cur), zero::format_bytes(pinned_bytes))};
}

// The host memory a run can take, as train and estimate check a plan's host memory against it:
// MemAvailable, or what this process's memory cgroup leaves where that is less (a container).
Line host_memory_line() {
  const zero::detail::HostMemory m = zero::detail::host_memory_available();
  if (m.bytes == 0)
    return {"host memory", Verdict::kWarn,
            "MemAvailable unknown (no /proc/meminfo): plans are not checked against host memory"};
  // An address-space limit counts what threads map, not what they use: worth knowing first.
  return {"host memory", m.by.starts_with("ulimit -v") ? Verdict::kWarn : Verdict::kOk,
          fmt::format("{} available ({})", zero::format_bytes(m.bytes), m.by)};
}

// The OpenBLAS kernels the model's CPU GEMMs run (see tools/blas/blas_kernels.hpp).
Line blas_line() {
  using tools::better_blas_kernels, tools::blas_kernel_name, tools::cpu_vector_features;
  const std::string name = blas_kernel_name();
  Line l{"blas", Verdict::kOk, "OpenBLAS kernels " + name};
  const char* chosen = std::getenv("OPENBLAS_CORETYPE");
  if (better_blas_kernels(name, cpu_vector_features())) {
    l.verdict = Verdict::kWarn;
    l.detail += " (slower than this CPU allows: unset OPENBLAS_CORETYPE and outcore picks)";
  } else if (chosen != nullptr) {
    l.detail += fmt::format(" (OPENBLAS_CORETYPE={})", chosen);
  }
  return l;
}

// How the CPU backend runs bf16 compute's GEMMs (engine/device/cpu/bf16_gemm.hpp): the path,
// the threads of the larger ones, and how idle OpenMP threads wait (passive for a rank among
// several on this node: tools/blas/blas_kernels.hpp).
Line bf16_gemm_line() {
  const std::string path = device::cpu::bf16_gemm_path();
  if (!path.starts_with("oneDNN"))
    return {"bf16 gemm", Verdict::kOk,
            path + " (this CPU has no bf16 dot products; ONEDNN_MAX_CPU_ISA may cap them)"};
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  return {"bf16 gemm", Verdict::kOk,
          fmt::format("{}, {} threads from 2^25 FLOPs, OpenMP waiting {}", path,
                      device::cpu::bf16_gemm_threads(), policy != nullptr ? policy : "default")};
}

}  // namespace

std::vector<Line> host_checks(const Options& o) {
  std::vector<Line> lines{cpu_line(), blas_line(), bf16_gemm_line(), io_uring_line()};
  if (!o.nvme_path.empty()) lines.push_back(nvme_line(o.nvme_path));
  lines.push_back(host_memory_line());
  lines.push_back(memlock_line(o.pinned_bytes));
  return lines;
}

}  // namespace outcore::cli::doctor
