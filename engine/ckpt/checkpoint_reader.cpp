// Reading checkpoints: open (manifest), verify (sizes and CRCs), re-slicing reads.
#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "common/unique_fd.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/file_util.hpp"

namespace fs = std::filesystem;

namespace outcore::ckpt {
namespace {

constexpr uint64_t kChunk = 16ull << 20;  // bounce reads in pieces of this size

// The size of open file `fd` (`path` names it in errors).
uint64_t file_size_of(int fd, const fs::path& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw IoError(path.string(), errno, "stat");
  return static_cast<uint64_t>(st.st_size);
}

// When open file `fd` was last written, and its size (`path` names it in errors).
struct WriteStamp {
  int64_t sec = 0, nsec = 0;
  uint64_t size = 0;
  bool operator==(const WriteStamp&) const = default;
};
WriteStamp write_stamp_of(int fd, const fs::path& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw IoError(path.string(), errno, "stat");
  return {st.st_mtim.tv_sec, st.st_mtim.tv_nsec, static_cast<uint64_t>(st.st_size)};
}

// The checkpoint global_step<N> of `dir` with the largest N, or an empty path when it holds none.
fs::path newest_checkpoint(const fs::path& dir) {
  const auto found = checkpoints_in(dir);
  const auto newest = std::max_element(found.begin(), found.end());
  return newest == found.end() ? fs::path() : newest->second;
}

// `message` as a warning, once per process for `dir` (a resume opens its checkpoint more than
// once).
void warn_once(const fs::path& dir, const std::string& message) {
  static std::mutex mu;
  static std::set<std::string> warned;
  std::lock_guard lock(mu);
  std::error_code ec;
  const fs::path absolute = fs::absolute(dir, ec);
  if (warned.insert((ec ? dir : absolute).lexically_normal().string() + "\n" + message).second)
    log::warn("{}", message);
}

// The entries of save directory `dir` that a save in progress or interrupted leaves (`<tag>.tmp`,
// unfinished, or `<tag>.old`, a checkpoint being replaced or removed; each holding the save's
// marker) but `read`, by name, comma-separated; empty when none. Only the next run that saves
// into `dir` removes them (SaveDir): readers name them.
std::string save_leftovers(const fs::path& dir, const std::string& read = {}) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name != read && (name.ends_with(".tmp") || name.ends_with(".old")) &&
        step_of_tag(name.substr(0, name.size() - 4)) >= 0 &&
        fs::exists(e.path() / kSaveMarkerName, ec))
      names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  std::string text;
  for (const std::string& n : names) text += (text.empty() ? "" : ", ") + n;
  return text;
}

}  // namespace

struct Checkpoint::Impl {
  fs::path dir;
  Manifest manifest;
  ReaderOptions options;
  std::unique_ptr<aio::Engine> engine;
  mutable std::mutex mu;
  // Every file of the manifest, opened by open(): what is read is what was opened, whatever
  // happens to the directory afterwards (another run's save prunes or replaces it).
  std::map<std::string, aio::File> open_files;  // data files
  // When each data file was last written, as open_all found it. verify() checks the bytes
  // read after that; a data file written since (its modification time or size changed) is not
  // what verify() checked, and read_slab refuses what it read from it.
  std::map<std::string, WriteStamp> opened_stamps;
  std::map<std::string, UniqueFd> text_files;  // the others
  mutable AlignedBuffer bounce;
  mutable uint64_t bytes_read = 0;

  // Opens every file of the manifest. CorruptData naming a file that is missing or not a
  // regular file, or a data file that is not its size.
  void open_all() {
    for (const FileInfo& fi : manifest.files) {
      const fs::path p = dir / fi.path;
      try {
        if (fi.segments.empty()) {
          text_files.emplace(fi.path, UniqueFd(open_for_reading(p.string(), "checkpoint file")));
          continue;
        }
        aio::File f = aio::File::open(p, {.access = aio::Access::kRead, .direct = true});
        struct stat st {};
        if (::fstat(f.fd(), &st) != 0) throw IoError(p.string(), errno, "stat");
        if (!S_ISREG(st.st_mode)) throw InvalidArgument(p.string());
        if (f.size() != fi.bytes)
          throw CorruptData(
              fmt::format("{}: size: expected {} bytes, actual {} (truncated or "
                          "replaced)",
                          p.string(), fi.bytes, f.size()));
        opened_stamps.emplace(fi.path, write_stamp_of(f.fd(), p));
        open_files.emplace(fi.path, std::move(f));
      } catch (const InvalidArgument&) {  // a FIFO, a directory, a device: not what was saved
        throw CorruptData(fmt::format("{}: not a regular file (replaced)", p.string()));
      } catch (const IoError& e) {
        if (e.error_number() == ENOENT || e.error_number() == ENOTDIR)  // rank<r> gone or a file
          throw CorruptData(fmt::format("{}: missing", p.string()));
        throw;
      }
    }
  }

  const aio::File& file(const FileInfo& fi) const { return open_files.at(fi.path); }

  // Every data file's header (its first 4 KiB: magic, version, rank, tag) against the
  // manifest: a file of another rank or another save put in its place is refused when the
  // checkpoint is opened, verified or not (the CRCs, which cover the header, catch it too, but
  // only where verify() runs).
  void check_headers() {
    AlignedBuffer header(kAlign);
    for (const FileInfo& fi : manifest.files) {
      if (fi.segments.empty()) continue;
      const std::string p = (dir / fi.path).string();
      engine->read(file(fi), 0, {header.data(), kAlign});
      uint32_t version = 0;
      int32_t rank = 0;
      std::memcpy(&version, header.data() + kHeaderVersionAt, 4);
      std::memcpy(&rank, header.data() + kHeaderRankAt, 4);
      if (std::memcmp(header.data(), kDataFileMagic, 8) != 0 || version != kFormatVersion)
        throw CorruptData(fmt::format("{}: not an outcore checkpoint data file of version {}", p,
                                      kFormatVersion));
      const char* tag_field = reinterpret_cast<const char*>(header.data()) + kHeaderTagAt;
      const std::string tag(tag_field, strnlen(tag_field, kHeaderTagMax));
      if (rank != fi.rank || tag != manifest.tag.substr(0, kHeaderTagMax))
        throw CorruptData(fmt::format(
            "{}: rank {}'s file of {}, where the manifest lists rank {}'s of {} (a file of "
            "another rank or checkpoint put in its place)",
            p, rank, tag, fi.rank, manifest.tag));
    }
  }

  // CorruptData when data file `fi` was written since it was opened: what was read from it may
  // be neither what was saved nor what verify() checked.
  void check_unwritten(const FileInfo& fi) const {
    const fs::path p = dir / fi.path;
    if (write_stamp_of(file(fi).fd(), p) != opened_stamps.at(fi.path))
      throw CorruptData(fmt::format(
          "{}: written while the checkpoint was read (its modification time or size changed "
          "since it was opened and checked): what was read from it is not used",
          p.string()));
  }

  // A text file of the manifest, whole (at most its manifest size: CorruptData beyond).
  std::string text(const FileInfo& fi) const {
    const auto it = text_files.find(fi.path);
    if (it == text_files.end())
      throw CorruptData(fmt::format("{}: a data file of the checkpoint, not a text file",
                                    (dir / fi.path).string()));
    return read_small_fd(it->second.get(), dir / fi.path, fi.bytes);
  }

  // Reads bytes [off, off + len) of a data file into dst, through the bounce buffer when the
  // request is not 4 KiB aligned.
  void read_bytes(const FileInfo& fi, uint64_t off, uint64_t len, std::byte* dst) const {
    const aio::File& f = file(fi);
    bytes_read += len;
    if (aligned(off) && aligned(len) && aligned(reinterpret_cast<uintptr_t>(dst))) {
      engine->read(f, off, {dst, len});
      return;
    }
    if (bounce.size() < kChunk + kAlign) bounce = AlignedBuffer(kChunk + kAlign);
    while (len > 0) {
      const uint64_t a = align_down(off);
      const uint64_t piece = std::min<uint64_t>(len, kChunk - (off - a));
      const uint64_t span_len = std::min<uint64_t>(align_up(off + piece) - a, fi.bytes - a);
      engine->read(f, a, {bounce.data(), span_len});
      std::memcpy(dst, bounce.data() + (off - a), piece);
      off += piece;
      dst += piece;
      len -= piece;
    }
  }
};

Checkpoint::Checkpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Checkpoint::~Checkpoint() = default;
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;

namespace {

// The checkpoint directory `path` names: itself, the one its `latest` names (`tag` set to it), or
// its newest (a save directory without `latest`); each with the warnings a reader gives there.
fs::path resolve_checkpoint(const fs::path& path, std::string& tag_named) {
  tag_named.clear();
  fs::path dir = path;
  if (!fs::exists(path / kManifestName)) {
    if (!fs::exists(path / kLatestName)) {
      if (!fs::exists(path))
        throw InvalidArgument(
            fmt::format("checkpoint {}: no such file or directory", path.string()));
      dir = newest_checkpoint(path);
      if (dir.empty()) {
        const std::string leftovers = save_leftovers(path);
        throw InvalidArgument(fmt::format(
            "{} is neither a checkpoint (no {}) nor a save directory (no {}){}", path.string(),
            kManifestName, kLatestName,
            leftovers.empty() ? ""
                              : fmt::format(": it holds only what a save in progress or "
                                            "interrupted leaves ({})",
                                            leftovers)));
      }
      warn_once(path, fmt::format("{}: no {} file (a save stopped before naming its checkpoint, "
                                  "or the file was removed): reading {}, the newest checkpoint "
                                  "there",
                                  path.string(), kLatestName, dir.filename().string()));
    } else {
      const std::string tag = read_latest_tag(path / kLatestName);
      tag_named = tag;
      dir = path / tag;
      const fs::path moved = path / (tag + ".old");
      std::error_code ec;
      if (fs::symlink_status(dir, ec).type() == fs::file_type::not_found &&
          is_checkpoint_dir(moved) && fs::exists(moved / kSaveMarkerName, ec)) {
        // A save that replaced the checkpoint by two renames (a filesystem that cannot exchange
        // two directories) was killed between them: the checkpoint is whole under its .old name,
        // where it is read; the next run that saves into the directory puts it back.
        warn_once(path,
                  fmt::format("{} names {}, which a save killed while replacing it left as "
                              "{}: reading it there (the next run that saves into {} puts "
                              "it back)",
                              (path / kLatestName).string(), tag, moved.string(), path.string()));
        dir = moved;
      } else if (!fs::exists(dir / kManifestName)) {
        // The checkpoints still there are named: resuming one of them is the way on.
        std::vector<std::pair<int64_t, fs::path>> others = checkpoints_in(path);
        std::sort(others.begin(), others.end());
        throw CorruptData(fmt::format(
            "{}: names checkpoint {}, which has no {}{}", (path / kLatestName).string(), tag,
            kManifestName,
            others.empty()
                ? std::string(" (and the directory holds no other checkpoint)")
                : fmt::format("; the newest checkpoint there is {}: resume it with --resume {}",
                              others.back().second.filename().string(),
                              others.back().second.string())));
      }
    }
    const std::string leftovers = save_leftovers(path, dir.filename().string());
    if (!leftovers.empty())
      warn_once(path, fmt::format("{}: {}: what a save in progress or interrupted leaves (an "
                                  "unfinished checkpoint, or one being replaced or removed), "
                                  "removed by the next run that saves into it",
                                  path.string(), leftovers));
  }
  return dir;
}

// The identity of directory `dir` (device and inode), or {0, 0} when there is none.
std::pair<dev_t, ino_t> identity(const fs::path& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return {0, 0};
  return {st.st_dev, st.st_ino};
}

}  // namespace

Checkpoint Checkpoint::open(const fs::path& path, ReaderOptions options) {
  // A save directory's checkpoint can be pruned or replaced by a run saving there between the
  // read of `latest` and the opening of its files: read `latest` again then, a few times. A
  // checkpoint replaced while it was opened (another directory at its name after its files were
  // open than before its manifest was read: the manifest and the files may be of two saves) is
  // opened again. Once open, every file is held (Impl::open_all).
  constexpr int kAttempts = 8;
  auto latest_now = [&path]() -> std::string {
    try {
      return read_latest_tag(path / kLatestName);
    } catch (const std::exception&) {
      return "";
    }
  };
  constexpr std::pair<dev_t, ino_t> kNone{0, 0};
  for (int attempt = 1;; ++attempt) {
    std::string tag;
    fs::path dir;
    std::pair<dev_t, ino_t> was = kNone;
    try {
      dir = resolve_checkpoint(path, tag);
      was = identity(dir);
      if (options.before_files_open) options.before_files_open(dir);
      Checkpoint ck = open_dir(dir, options);
      if (identity(dir) == was || attempt == kAttempts) return ck;
    } catch (const CorruptData&) {
      // Retried only where what `path` names changed: `latest` names another checkpoint, the
      // directory read is another one or gone, or it was a `<tag>.old` (a replacement by two
      // renames, whose removal may have begun).
      const bool moved = !tag.empty() && ((was != kNone && identity(dir) != was) ||
                                          latest_now() != tag || dir.filename().string() != tag);
      if (!moved || attempt == kAttempts) throw;
    }
    log::debug("{}: {} was removed or replaced while it was opened: opening it again",
               path.string(), dir.string());
  }
}

Checkpoint Checkpoint::open_dir(const fs::path& dir, const ReaderOptions& options) {
  // A save stopped before it was complete (<tag>.tmp/ with its marker): never reported saved,
  // never resumed from. (A committed checkpoint may hold the marker too, written there by a
  // removal or replacement stopped half-way; it was saved, and still is.)
  fs::path named = dir.lexically_normal();  // "x.tmp/" and "x.tmp/." name x.tmp
  if (!named.has_filename()) named = named.parent_path();
  if (std::error_code ec; !options.unfinished_save && named.filename().string().ends_with(".tmp") &&
                          fs::exists(dir / kSaveMarkerName, ec))
    throw InvalidArgument(fmt::format(
        "{}: an unfinished save (it holds {}): never reported saved; resume from the save "
        "directory, whose latest names a complete checkpoint",
        dir.string(), kSaveMarkerName));
  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  impl->options = options;
  const fs::path mpath = dir / kManifestName;
  impl->manifest = parse_manifest(read_small_file(mpath, 64ull << 20), mpath.string());
  // A checkpoint under another step's name (renamed by hand) would be resumed as that step and
  // then saved over: refused.
  const std::string name = dir.filename().string();
  if (step_of_tag(name) >= 0 && name != impl->manifest.tag)
    throw CorruptData(fmt::format(
        "{}: the checkpoint of {} (step {}) under the name {}: a checkpoint renamed? Give it back "
        "its name, or resume it as a copy outside the save directory",
        mpath.string(), impl->manifest.tag, impl->manifest.step, name));
  impl->open_all();
  impl->engine = std::make_unique<aio::Engine>(impl->options.aio, impl->options.backend);
  impl->check_headers();
  return Checkpoint(std::move(impl));
}

const Manifest& Checkpoint::manifest() const { return impl_->manifest; }
const fs::path& Checkpoint::dir() const { return impl_->dir; }
uint64_t Checkpoint::bytes_read() const {
  std::lock_guard lock(impl_->mu);
  return impl_->bytes_read;
}

DType Checkpoint::array_dtype(ArrayKind array) const {
  return array == ArrayKind::kParams ? impl_->manifest.param_dtype : DType::F32;
}

void Checkpoint::verify(const std::function<bool()>& stop) const {
  std::lock_guard lock(impl_->mu);
  const Impl& m = *impl_;
  std::vector<AlignedBuffer> buf;
  for (size_t i = 0; i < kVerifyBuffers; ++i) buf.emplace_back(kVerifyChunkBytes);
  auto stopped = [&] {
    if (stop && stop()) throw Interrupted("checkpoint check interrupted by a signal");
  };
  for (const FileInfo& fi : m.manifest.files) {
    stopped();
    // The files opened by open() (each a regular file; the data files of their sizes then).
    const fs::path p = m.dir / fi.path;
    uint32_t crc = 0;
    const uint64_t size =
        fi.segments.empty() ? file_size_of(m.text_files.at(fi.path).get(), p) : m.file(fi).size();
    if (size != fi.bytes)
      throw CorruptData(
          fmt::format("{}: size: expected {} bytes, actual {} (truncated or "
                      "replaced)",
                      p.string(), fi.bytes, size));
    if (fi.segments.empty()) {
      const std::string text = m.text(fi);
      crc = crc32c(std::as_bytes(std::span(text.data(), text.size())));
    } else {
      // A ring of kVerifyBuffers chunks: all but the one being summed are being read.
      const aio::File& f = m.file(fi);
      std::deque<std::pair<aio::Ticket, uint64_t>> inflight;  // ticket, length; in file order
      uint64_t off = 0;
      size_t next_buf = 0;
      auto start = [&] {
        const uint64_t len = std::min(kVerifyChunkBytes, size - off);
        inflight.emplace_back(
            m.engine->submit_read(f, off, {buf[next_buf % kVerifyBuffers].data(), len}), len);
        off += len;
        ++next_buf;
      };
      size_t done_buf = 0;
      try {
        while (off < size && inflight.size() < kVerifyBuffers - 1) start();
        while (!inflight.empty()) {
          const auto [ticket, len] = inflight.front();
          inflight.pop_front();
          m.engine->wait(ticket);
          stopped();
          if (off < size) start();
          crc = crc32c({buf[done_buf++ % kVerifyBuffers].data(), len}, crc);
        }
      } catch (...) {
        // A stop, a failed read or submission: the reads still in flight land before their
        // buffers go (their own errors do not matter then).
        for (const auto& [t, l] : inflight) {
          try {
            m.engine->wait(t);
          } catch (const std::exception&) {
          }
        }
        throw;
      }
      m.bytes_read += size;
    }
    if (crc != fi.crc32c)
      throw CorruptData(fmt::format("{}: CRC32C mismatch: expected {:08x}, actual {:08x}",
                                    p.string(), fi.crc32c, crc));
  }
}

std::string Checkpoint::read_text(std::string_view rel_path) const {
  const FileInfo* fi = impl_->manifest.find(rel_path);
  const fs::path p = impl_->dir / std::string(rel_path);
  if (fi == nullptr)
    throw CorruptData(fmt::format("{}: not listed in the checkpoint's manifest", p.string()));
  std::string text = impl_->text(*fi);
  if (text.size() != fi->bytes)
    throw CorruptData(
        fmt::format("{}: size: expected {} bytes, actual {}", p.string(), fi->bytes, text.size()));
  const uint32_t crc = crc32c(std::as_bytes(std::span(text.data(), text.size())));
  if (crc != fi->crc32c)
    throw CorruptData(fmt::format("{}: CRC32C mismatch: expected {:08x}, actual {:08x}", p.string(),
                                  fi->crc32c, crc));
  return text;
}

void Checkpoint::read_slab(int unit, ArrayKind array, uint64_t begin, uint64_t count,
                           std::span<std::byte> out) const {
  std::lock_guard lock(impl_->mu);
  const Manifest& man = impl_->manifest;
  if (unit < 0 || static_cast<size_t>(unit) >= man.units.size())
    throw InvalidArgument(fmt::format("checkpoint: unit {} of {}", unit, man.units.size()));
  const DType dt = array == ArrayKind::kParams ? man.param_dtype : DType::F32;
  const size_t esz = dtype_size(dt);
  if (out.size() != count * esz)
    throw InvalidArgument(fmt::format("checkpoint: read_slab of {} elements needs {} bytes, got {}",
                                      count, count * esz, out.size()));
  std::memset(out.data(), 0, out.size());
  const uint64_t numel = man.units[unit].numel;
  const uint64_t end = std::min(begin + count, numel);  // padding stays zero
  for (const FileInfo& fi : man.files) {
    bool read_from_file = false;
    for (const Segment& s : fi.segments) {
      if (s.unit != unit || s.array != array) continue;
      if (s.dtype != dt)
        throw CorruptData(fmt::format("{}: unit {} {} stored as {}, expected {}",
                                      (impl_->dir / fi.path).string(), unit, array_name(array),
                                      dtype_name(s.dtype), dtype_name(dt)));
      const uint64_t lo = std::max(begin, s.slab_begin);
      const uint64_t hi = std::min(end, s.slab_begin + s.count);
      if (lo >= hi) continue;
      impl_->read_bytes(fi, s.offset + (lo - s.slab_begin) * esz, (hi - lo) * esz,
                        out.data() + (lo - begin) * esz);
      read_from_file = true;
    }
    // After the reads: a write before them changed the stamp.
    if (read_from_file) impl_->check_unwritten(fi);
  }
}

}  // namespace outcore::ckpt
