// SwapSpace: the per-rank swap directory tree, preallocated files with headers, cleanup.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <system_error>
#include <thread>
#include <utility>

#include "common/cleanup.hpp"
#include "common/lock_file.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "swap/swap.hpp"
#include "swap/swap_file_format.hpp"

namespace outcore::swap {

std::string_view swap_kind_name(SwapKind kind) {
  switch (kind) {
    case SwapKind::kParam:
      return "param";
    case SwapKind::kGrad:
      return "grad";
    case SwapKind::kOptimizer:
      return "optimizer";
  }
  return "unknown";
}

namespace {

namespace fs = std::filesystem;

uint64_t file_key(uint32_t unit, SwapKind kind) {
  return (static_cast<uint64_t>(unit) << 8) | static_cast<uint64_t>(kind);
}

uint64_t file_bytes(const SwapFileSpec& f) {
  uint64_t n = format::header_bytes(f.tensors.size());
  for (const TensorSpec& t : f.tensors) n += align_up(t.bytes, kIoAlignment);
  return n;
}

void validate_plan(std::span<const SwapFileSpec> files) {
  std::set<uint64_t> seen;
  for (const SwapFileSpec& f : files) {
    std::string where =
        fmt::format("swap plan: file (unit {}, kind {})", f.unit, swap_kind_name(f.kind));
    if (static_cast<uint8_t>(f.kind) > static_cast<uint8_t>(SwapKind::kOptimizer)) {
      throw InvalidArgument(fmt::format("swap plan: file of unit {} has an unknown kind {}", f.unit,
                                        static_cast<int>(f.kind)));
    }
    if (!seen.insert(file_key(f.unit, f.kind)).second) {
      throw InvalidArgument(where + " appears twice");
    }
    if (f.tensors.empty()) throw InvalidArgument(where + " has no tensors");
    std::set<std::string_view> names;
    for (const TensorSpec& t : f.tensors) {
      if (t.name.empty() || t.name.size() > format::kMaxNameBytes ||
          t.name.find('\0') != std::string::npos) {
        throw InvalidArgument(fmt::format("{}: tensor name '{}' must be 1..{} bytes without NUL",
                                          where, t.name, format::kMaxNameBytes));
      }
      if (!names.insert(t.name).second) {
        throw InvalidArgument(fmt::format("{}: tensor name '{}' appears twice", where, t.name));
      }
      if (t.bytes == 0) {
        throw InvalidArgument(fmt::format("{}: tensor '{}' has 0 bytes", where, t.name));
      }
    }
  }
}

// What a swap directory's .lock holds: a file there holding anything else is a user's, locked
// but never written or removed (LockFile's ownership rule).
constexpr std::string_view kLockMarker = "outcore swap directory lock\n";

uint64_t random_nonce() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

}  // namespace

struct SwapSpace::Impl {
  struct FileEntry {
    SwapFileSpec spec;
    fs::path path;
    aio::File file;
    std::vector<TensorInfo> tensors;
    bool created = false;
    std::optional<FileId> id;  // of the file created (removed only while it is there)
  };

  SwapSpaceOptions options;
  fs::path root;
  std::vector<fs::path> dirs;  // outcore_swap/, rank<r>/, kind dirs; removed in reverse if empty
  // <kind dir>/.lock of each kind held, so that another SwapSpace of this rank and kind
  // cannot delete this one's files as stale (LockFile: unlinked when released).
  std::vector<std::unique_ptr<LockFile>> locks;
  std::vector<FileEntry> files;
  std::map<uint64_t, size_t> index;  // file_key -> files[i]
  uint64_t total = 0;
  uint64_t nonce = random_nonce();

  ~Impl() {
    for (FileEntry& f : files) {
      try {
        f.file.close();
      } catch (const std::exception& e) {
        log::warn("swap: {}", e.what());
      }
      if (!f.created) continue;
      // Unlinked before it is unregistered (a signal in between must not leave the file): the
      // directory's lock, still held, keeps any other run from creating one of that name. A
      // file put at its name since (a user's output written over it) is not this run's.
      FileId now;
      if (f.id && file_id_of(f.path.string(), now) && !(now == *f.id))
        log::warn(
            "swap: {} is no longer this run's swap file (another file was put at its name "
            "while the run worked): left as it is",
            f.path.string());
      else if (::unlink(f.path.c_str()) != 0 && errno != ENOENT)
        log::warn("swap: cannot remove {}: {}", f.path.string(), errno_string(errno));
      cleanup::unregister_path(f.path.string());
    }
    locks.clear();  // removes the .lock files
    for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
      ::rmdir(it->c_str());  // fails harmlessly when not empty (other kinds, other ranks)
      cleanup::unregister_path(it->string());
    }
  }

  void ensure_dir(const fs::path& dir) {
    std::error_code ec;
    fs::create_directory(dir, ec);  // an existing directory is fine
    // EEXIST with something else of that name there: the user's, kept. With nothing there, a
    // directory went between mkdir and its check (make_and_lock retries on that).
    std::error_code ec2;
    if (ec && ec.value() == EEXIST &&
        fs::symlink_status(dir, ec2).type() != fs::file_type::not_found &&
        !fs::is_directory(dir, ec2))
      throw InvalidArgument(
          fmt::format("swap path {}: exists and is not a directory, where outcore creates its swap "
                      "directory: move it away or choose another nvme_path",
                      dir.string()));
    if (ec) throw IoError(dir.string(), ec.value(), "create swap directory");
    if (std::find(dirs.begin(), dirs.end(), dir) != dirs.end()) return;
    dirs.push_back(dir);
    cleanup::register_path(dir.string(), /*directory=*/true);
  }

  // outcore_swap/rank<r>/<kind>/ created and locked. Another SwapSpace on the same nvme_path
  // (another rank's, another run's) removes those of its directories it leaves empty when it
  // goes; when that happens between a creation here and the lock, they are created again. A
  // lock another run holds for a moment (clear_unheld: a kind that run does not use) is waited
  // for, up to a second; one held longer is a live run's.
  void make_and_lock(const fs::path& top, const fs::path& dir) {
    for (int attempt = 0, busy = 0;; ++attempt) {
      try {
        ensure_dir(top);
        ensure_dir(root);
        ensure_dir(dir);
        locks.push_back(std::make_unique<LockFile>(
            dir / ".lock",
            "lock swap directory (another run, or this rank's other swap space of this kind, "
            "is using it: give each run its own nvme_path)",
            kLockMarker, /*register_cleanup=*/true));
        return;
      } catch (const PathBusy&) {
        if (++busy == 20) throw;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      } catch (const IoError& e) {
        // ENOENT: a parent went; EEXIST: mkdir found one that went before it could be checked.
        if ((e.error_number() != ENOENT && e.error_number() != EEXIST) || attempt == 100) throw;
      }
    }
  }

  // A file a SwapSpace made: it starts with the swap header, or is empty (left between its
  // creation and its header, which is written before the file is preallocated). Anything else,
  // a file of zeros included, may be a user's.
  static bool is_swap_file(const fs::path& p) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) return false;
    char head[sizeof format::kMagic];
    const ssize_t n = ::pread(fd, head, sizeof head, 0);
    ::close(fd);
    return n == 0 || (n == static_cast<ssize_t>(sizeof head) &&
                      std::memcmp(head, format::kMagic, sizeof head) == 0);
  }

  void clear_stale(const fs::path& dir) {
    size_t removed = 0;
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
      // Only what a SwapSpace makes: a regular file named <unit>.bin that is a swap file.
      // Anything else is left (a file at a name a swap file needs then stops the run).
      const std::string stem = e.path().stem().string();
      if (e.path().extension() != ".bin" || stem.empty() ||
          stem.find_first_not_of("0123456789") != std::string::npos ||
          fs::symlink_status(e.path()).type() != fs::file_type::regular || !is_swap_file(e.path()))
        continue;
      if (::unlink(e.path().c_str()) != 0) {
        throw IoError(e.path().string(), errno, "remove stale swap file");
      }
      ++removed;
    }
    if (ec) throw IoError(dir.string(), ec.value(), "list swap directory");
    if (removed != 0) {
      log::warn("swap: removed {} stale swap file(s) from an earlier run in {}", removed,
                dir.string());
    }
  }

  // The stale swap files of ranks >= world_size under `top` (outcore_swap/): those of each
  // rank<N>/<kind>/ whose lock this run can take (a live run's is left alone), removed as
  // clear_stale removes this rank's; the directories left empty go too. Another rank's
  // leftovers never fail the run: a failure is a warning.
  void clear_ranks_beyond(const fs::path& top, int world_size) {
    std::error_code ec;
    auto is_dir = [](const fs::path& p) {
      std::error_code e;
      return fs::symlink_status(p, e).type() == fs::file_type::directory;
    };
    for (auto it = fs::directory_iterator(top, ec); !ec && it != fs::end(it); it.increment(ec)) {
      const fs::path rank_dir = it->path();
      const std::string name = rank_dir.filename().string();
      if (name.size() <= 4 || name.size() > 10 || name.compare(0, 4, "rank") != 0 ||
          name.find_first_not_of("0123456789", 4) != std::string::npos ||
          std::stoll(name.substr(4)) < world_size || !is_dir(rank_dir))
        continue;
      for (SwapKind kind : {SwapKind::kParam, SwapKind::kGrad, SwapKind::kOptimizer})
        clear_unheld(rank_dir / swap_kind_name(kind));
      ::rmdir(rank_dir.c_str());
    }
  }

  // The stale swap files of kind directory `dir` that no live run holds (its lock can be
  // taken), removed as clear_stale removes them, and the directory when left empty. A failure
  // is a warning: these files are not this run's.
  void clear_unheld(const fs::path& dir) {
    std::error_code ec;
    if (fs::symlink_status(dir, ec).type() != fs::file_type::directory) return;
    try {
      LockFile lock(dir / ".lock", "lock a swap directory this run does not use", kLockMarker);
      clear_stale(dir);
      lock.release();
      ::rmdir(dir.c_str());  // fails harmlessly when something else is there
    } catch (const PathBusy&) {
      // a live run's (or this process's other swap space's): its files are in use
    } catch (const std::exception& e) {
      log::warn("swap: {}", e.what());
    }
  }

  void check_free_space(const fs::path& dir, uint64_t needed) {
    struct statvfs st {};
    if (::statvfs(dir.c_str(), &st) != 0) throw IoError(dir.string(), errno, "statvfs");
    uint64_t free_bytes = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
    if (needed > free_bytes) throw_no_space(dir, needed, free_bytes);
  }

  [[noreturn]] static void throw_no_space(const fs::path& dir, uint64_t needed,
                                          uint64_t free_bytes) {
    throw IoError(
        dir.string(), ENOSPC,
        fmt::format("preallocate swap space ({} bytes needed, {} bytes free)", needed, free_bytes));
  }

  void write_header(FileEntry& f) {
    const uint64_t hbytes = format::header_bytes(f.tensors.size());
    AlignedBuffer buf(hbytes);
    std::span<std::byte> h(buf.data(), hbytes);
    std::memcpy(h.data(), format::kMagic, sizeof format::kMagic);
    format::put<uint32_t>(h, format::Preamble::kVersionAt, format::kVersion);
    format::put<uint32_t>(h, format::Preamble::kKindAt, static_cast<uint32_t>(f.spec.kind));
    format::put<uint32_t>(h, format::Preamble::kUnitAt, f.spec.unit);
    format::put<uint32_t>(h, format::Preamble::kCountAt, static_cast<uint32_t>(f.tensors.size()));
    format::put<uint64_t>(h, format::Preamble::kNonceAt, nonce);
    format::put<uint64_t>(h, format::Preamble::kFileBytesAt, file_bytes(f.spec));
    for (size_t i = 0; i < f.tensors.size(); ++i) {
      size_t at = format::kPreambleBytes + i * format::kEntryBytes;
      std::memcpy(h.data() + at + format::Entry::kNameAt, f.tensors[i].name.data(),
                  f.tensors[i].name.size());
      format::put<uint64_t>(h, at + format::Entry::kOffsetAt, f.tensors[i].offset);
      format::put<uint64_t>(h, at + format::Entry::kBytesAt, f.tensors[i].bytes);
    }
    size_t done = 0;
    while (done < hbytes) {
      ssize_t n = ::pwrite(f.file.fd(), h.data() + done, hbytes - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        throw IoError(f.path.string(), done, hbytes - done, n < 0 ? errno : EIO,
                      "write swap header");
      }
      done += static_cast<size_t>(n);
    }
  }

  void create_file(FileEntry& f, const fs::path& dir, uint64_t needed) {
    try {
      f.file = aio::File::open(f.path, {.access = aio::Access::kReadWrite,
                                        .create = true,
                                        .exclusive = true,
                                        .direct = options.direct});
    } catch (const IoError& e) {
      if (e.error_number() != EEXIST) throw;
      // Bad input: the swap path holds someone's file where this run's swap file goes.
      throw InvalidArgument(fmt::format(
          "{}: exists and is not an outcore swap file (no swap header; a run of an earlier "
          "version killed while starting leaves one of zeros), and a swap file of this run "
          "needs its name: move it away or choose another nvme_path",
          f.path.string()));
    }
    f.created = true;
    if (FileId id; file_id_of(f.file.fd(), id)) f.id = id;
    cleanup::register_file(f.path.string(), f.file.fd());
    // The header first: a file left by a run killed here is empty or starts with it, and only
    // such a file is taken for a stale swap file (is_swap_file).
    write_header(f);
    try {
      f.file.preallocate(file_bytes(f.spec));
    } catch (const IoError& e) {
      if (e.error_number() != ENOSPC) throw;
      struct statvfs st {};
      uint64_t free_bytes =
          ::statvfs(dir.c_str(), &st) == 0 ? static_cast<uint64_t>(st.f_bavail) * st.f_frsize : 0;
      throw_no_space(f.path, needed, free_bytes);
    }
  }
};

uint64_t SwapSpace::bytes_needed(std::span<const SwapFileSpec> files) {
  uint64_t n = 0;
  for (const SwapFileSpec& f : files) n += file_bytes(f);
  return n;
}

uint64_t SwapSpace::tree_bytes_needed(std::span<const SwapFileSpec> files) {
  constexpr uint64_t kBlock = 4096;
  constexpr uint64_t kEntryBytes = 32;  // a directory entry of "<unit>.bin" (ext4: 8 + name)
  if (files.empty()) return 0;
  std::map<SwapKind, uint64_t> per_kind;
  for (const SwapFileSpec& f : files) ++per_kind[f.kind];
  uint64_t n = 2 * kBlock;  // outcore_swap/ and rank<r>/
  for (const auto& [kind, count] : per_kind)
    n += align_up((count + 3) * kEntryBytes, kBlock) + kBlock;  // the directory, its .lock
  return n;
}

SwapSpace::SwapSpace(const SwapSpaceOptions& options, std::span<const SwapFileSpec> files) {
  validate_plan(files);
  if (options.rank < 0) throw InvalidArgument(fmt::format("swap: rank {} < 0", options.rank));
  auto impl = std::make_unique<Impl>();  // its destructor undoes everything on failure
  impl->options = options;
  std::error_code ec;
  if (!fs::is_directory(options.nvme_path, ec)) {
    throw IoError(options.nvme_path.string(), ec ? ec.value() : ENOENT,
                  "swap nvme_path is not a directory");
  }
  fs::path top = options.nvme_path / kSwapTreeName;
  impl->root = top / fmt::format("rank{}", options.rank);
  std::set<SwapKind> kinds;
  for (const SwapFileSpec& f : files) kinds.insert(f.kind);
  if (kinds.empty()) {
    // As make_and_lock does, without a lock: another SwapSpace on the same nvme_path may
    // remove the directories it leaves empty meanwhile.
    for (int attempt = 0;; ++attempt) {
      try {
        impl->ensure_dir(top);
        impl->ensure_dir(impl->root);
        break;
      } catch (const IoError& e) {
        if ((e.error_number() != ENOENT && e.error_number() != EEXIST) || attempt == 100) throw;
      }
    }
  }
  for (SwapKind k : kinds) {
    fs::path dir = impl->root / swap_kind_name(k);
    impl->make_and_lock(top, dir);
    impl->clear_stale(dir);
  }
  // The kinds this run keeps elsewhere or not at all (gradients in host memory now, on NVMe
  // before): an earlier run's files there are stale too.
  for (SwapKind k : {SwapKind::kParam, SwapKind::kGrad, SwapKind::kOptimizer})
    if (!kinds.contains(k)) impl->clear_unheld(impl->root / swap_kind_name(k));
  if (options.rank == 0 && options.world_size > 0)
    impl->clear_ranks_beyond(top, options.world_size);
  impl->total = bytes_needed(files);
  if (!files.empty()) impl->check_free_space(impl->root, impl->total);

  impl->files.reserve(files.size());
  for (const SwapFileSpec& spec : files) {
    Impl::FileEntry& f = impl->files.emplace_back();
    f.spec = spec;
    f.path = impl->root / swap_kind_name(spec.kind) / fmt::format("{}.bin", spec.unit);
    uint64_t off = format::header_bytes(spec.tensors.size());
    for (const TensorSpec& t : spec.tensors) {
      f.tensors.push_back({t.name, off, t.bytes});
      off += align_up(t.bytes, kIoAlignment);
    }
    impl->index.emplace(file_key(spec.unit, spec.kind), impl->files.size() - 1);
    impl->create_file(f, impl->root, impl->total);
  }
  impl_ = std::move(impl);
}

SwapSpace::~SwapSpace() = default;

std::optional<fs::path> swap_tree_holding(const fs::path& path) {
  std::error_code ec;
  const fs::path abs = fs::absolute(path, ec).lexically_normal();
  if (ec) return std::nullopt;
  fs::path at;
  for (auto it = abs.begin(); it != abs.end(); ++it) {
    at /= *it;
    // A directory of that name holding the path (not the path itself: nvme_path may end in it).
    if (*it == kSwapTreeName && std::next(it) != abs.end() && !std::next(it)->empty()) return at;
  }
  return std::nullopt;
}

TensorId SwapSpace::find(uint32_t unit, SwapKind kind, std::string_view name) const {
  auto it = impl_->index.find(file_key(unit, kind));
  if (it != impl_->index.end()) {
    const auto& tensors = impl_->files[it->second].tensors;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].name == name) return {unit, kind, static_cast<uint32_t>(i)};
    }
  }
  throw InvalidArgument(fmt::format("swap: no tensor '{}' in the {} file of unit {}", name,
                                    swap_kind_name(kind), unit));
}

size_t SwapSpace::tensor_count(uint32_t unit, SwapKind kind) const {
  auto it = impl_->index.find(file_key(unit, kind));
  return it == impl_->index.end() ? 0 : impl_->files[it->second].tensors.size();
}

namespace {

[[noreturn]] void throw_unknown(TensorId id) {
  throw InvalidArgument(fmt::format("swap: unknown tensor (unit {}, kind {}, index {})", id.unit,
                                    swap_kind_name(id.kind), id.index));
}

}  // namespace

const TensorInfo& SwapSpace::info(TensorId id) const {
  auto it = impl_->index.find(file_key(id.unit, id.kind));
  if (it == impl_->index.end()) throw_unknown(id);
  const auto& tensors = impl_->files[it->second].tensors;
  if (id.index >= tensors.size()) throw_unknown(id);
  return tensors[id.index];
}

const aio::File& SwapSpace::file(TensorId id) const {
  info(id);  // validates
  return impl_->files[impl_->index.at(file_key(id.unit, id.kind))].file;
}

std::filesystem::path SwapSpace::file_path(uint32_t unit, SwapKind kind) const {
  return impl_->root / swap_kind_name(kind) / fmt::format("{}.bin", unit);
}

const std::filesystem::path& SwapSpace::root() const { return impl_->root; }

uint64_t SwapSpace::total_bytes() const { return impl_->total; }

}  // namespace outcore::swap
