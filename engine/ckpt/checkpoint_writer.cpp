// Writing checkpoints: the save directory (lock, leftovers, latest, pruning) and the streaming,
// atomic CheckpointWriter.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <map>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/file_util.hpp"

namespace fs = std::filesystem;

namespace outcore::ckpt {
namespace {

constexpr uint64_t kAlign = kIoAlignment;

uint64_t align_up(uint64_t n) { return outcore::align_up(n, kAlign); }

[[noreturn]] void crash_now(const char* where) {
  log::warn("checkpoint: simulated crash ({})", where);
  ::raise(SIGKILL);
  std::abort();
}

// Parses "global_step<N>" to N, or -1.
int64_t step_of_tag(const std::string& name) {
  constexpr std::string_view prefix = "global_step";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return -1;
  int64_t v = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (INT64_MAX - 9) / 10) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

}  // namespace

// ---- SaveDir --------------------------------------------------------------------------------

SaveDir::SaveDir(fs::path dir, int keep, bool primary)
    : dir_(std::move(dir)), keep_(keep), primary_(primary) {
  if (keep_ < 0) throw InvalidArgument(fmt::format("--keep must be >= 0, got {}", keep_));
  std::error_code ec;
  if (fs::exists(dir_, ec) && !fs::is_directory(dir_, ec))
    throw InvalidArgument(
        fmt::format("save directory {}: exists and is not a directory", dir_.string()));
  fs::create_directories(dir_, ec);
  if (ec) throw IoError(dir_.string(), ec.value(), "create checkpoint directory");
  if (!primary_) return;
  const fs::path lock = dir_ / ".lock";
  lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd_ < 0) throw IoError(lock.string(), errno, "open checkpoint lock");
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(lock_fd_);
    lock_fd_ = -1;
    throw IoError(lock.string(), err, "lock checkpoint directory (is another run saving into it?)");
  }
  // Leftovers of an interrupted save: never valid, since a save is valid only once renamed.
  for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
    const std::string name = e.path().filename().string();
    const bool tmp = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0;
    const bool old = name.size() > 4 && name.compare(name.size() - 4, 4, ".old") == 0;
    if (!tmp && !old) continue;
    log::warn("checkpoint: removing {} left by an interrupted save", e.path().string());
    fs::remove_all(e.path(), ec);
    if (ec) throw IoError(e.path().string(), ec.value(), "remove leftover of an interrupted save");
  }
}

SaveDir::~SaveDir() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // the lock file stays: unlinking it races a new run
}

std::optional<std::string> SaveDir::latest() const {
  const fs::path p = dir_ / kLatestName;
  if (!fs::exists(p)) return std::nullopt;
  return read_latest_tag(p);
}

void SaveDir::set_latest(const std::string& tag, const WriterOptions& hooks) {
  if (hooks.crash_at == "before-latest") crash_now("before-latest");
  const fs::path tmp = dir_ / (std::string(kLatestName) + ".tmp");
  write_file_durably(tmp, tag + "\n");
  rename_durably(tmp, dir_ / kLatestName, dir_);
  if (hooks.crash_at == "after-latest") crash_now("after-latest");
}

void SaveDir::prune() {
  if (keep_ <= 0 || !primary_) return;
  const std::optional<std::string> current = latest();
  std::vector<std::pair<int64_t, fs::path>> found;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
    const int64_t step = step_of_tag(e.path().filename().string());
    if (step >= 0 && e.is_directory()) found.push_back({step, e.path()});
  }
  std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (size_t i = static_cast<size_t>(keep_); i < found.size(); ++i) {
    if (current && found[i].second.filename() == *current) continue;
    std::error_code ec;
    fs::remove_all(found[i].second, ec);
    if (ec)
      log::warn("checkpoint: cannot remove old checkpoint {}: {}", found[i].second.string(),
                ec.message());
  }
}

// ---- CheckpointWriter -----------------------------------------------------------------------

struct CheckpointWriter::Impl {
  struct DataFile {
    FileInfo info;
    std::string kind;
    aio::File file;
    uint32_t crc = 0;
    size_t next_stage = 0, next_submit = 0;
  };
  struct Slot {
    AlignedBuffer buf;
    std::optional<aio::Ticket> ticket;
    int file = -1, seg = -1;
    uint64_t bytes = 0;
  };

  Impl(SaveDir& d, const std::string& t, WriterOptions o, size_t n)
      : dir(d), tag(t), tmp(d.path() / (t + ".tmp")), options(std::move(o)), slot_count(n) {}

  void wait_slot(Slot& s) {
    if (!s.ticket) return;
    aio::Ticket t = *s.ticket;
    s.ticket.reset();
    engine->wait(t);
    written += s.bytes;
  }
  void wait_all_slots() {
    for (Slot& s : slots) wait_slot(s);
  }

  SaveDir& dir;
  std::string tag;
  fs::path tmp;
  WriterOptions options;
  size_t slot_count;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  std::vector<std::pair<std::string, std::string>> texts;
  // Declared before the engine: the engine's destructor waits for writes from these buffers
  // and files, so they must outlive it.
  std::vector<DataFile> files;
  std::vector<Slot> slots;
  std::map<std::pair<int, int>, size_t> staged;  // (file, seg) -> slot
  size_t next_slot = 0;
  std::unique_ptr<aio::Engine> engine;
  uint64_t submitted = 0, written = 0;
  bool prepared = false, committed = false;
};

CheckpointWriter::CheckpointWriter(SaveDir& dir, std::string tag, WriterOptions options,
                                   size_t staging_slots)
    : tag_(std::move(tag)) {
  if (tag_.empty() || tag_.find('/') != std::string::npos || tag_ == "." || tag_ == "..")
    throw InvalidArgument(fmt::format("checkpoint tag \"{}\" is not a directory name", tag_));
  if (staging_slots < 2) throw InvalidArgument("checkpoint writer: staging_slots must be >= 2");
  impl_ = std::make_unique<Impl>(dir, tag_, std::move(options), staging_slots);
}

CheckpointWriter::~CheckpointWriter() {
  if (!impl_ || impl_->committed) return;
  try {
    impl_->engine.reset();  // waits for in-flight writes before buffers and files go
  } catch (const std::exception& e) {
    log::warn("checkpoint: {}", e.what());
  }
  std::error_code ec;
  fs::remove_all(impl_->tmp, ec);
}

void CheckpointWriter::add_text_file(std::string rel_path, std::string text) {
  if (impl_->prepared) throw InvalidArgument("checkpoint writer: add_text_file after prepare()");
  impl_->texts.emplace_back(std::move(rel_path), std::move(text));
}

int CheckpointWriter::add_data_file(std::string rel_path, int rank, std::string_view kind,
                                    std::vector<Segment> segments) {
  if (impl_->prepared) throw InvalidArgument("checkpoint writer: add_data_file after prepare()");
  Impl::DataFile f;
  f.info.path = std::move(rel_path);
  f.info.rank = rank;
  f.kind = kind;
  uint64_t off = kAlign;  // the header
  for (Segment& s : segments) {
    s.offset = off;
    off += align_up(s.bytes());
  }
  f.info.bytes = off;
  f.info.segments = std::move(segments);
  impl_->files.push_back(std::move(f));
  return static_cast<int>(impl_->files.size() - 1);
}

void CheckpointWriter::prepare() {
  Impl& m = *impl_;
  if (m.prepared) throw InvalidArgument("checkpoint writer: prepare() twice");
  const SaveGroup* group = m.options.group;
  const bool lead = group == nullptr || group->rank == 0;
  std::error_code ec;
  if (lead) fs::remove_all(m.tmp, ec);
  uint64_t need = 0, max_seg = 0;
  for (const auto& [p, t] : m.texts) need += t.size() + kAlign;
  for (const Impl::DataFile& f : m.files) {
    need += f.info.bytes;
    for (const Segment& s : f.info.segments) max_seg = std::max(max_seg, align_up(s.bytes()));
  }
  struct statvfs sv {};
  if (::statvfs(m.dir.path().c_str(), &sv) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
    if (free_bytes < need)
      throw IoError(m.dir.path().string(), ENOSPC,
                    fmt::format("save checkpoint {} ({} bytes needed, {} bytes free)", m.tag, need,
                                free_bytes));
  }
  if (lead) {
    fs::create_directories(m.tmp, ec);
    if (ec) throw IoError(m.tmp.string(), ec.value(), "create checkpoint directory");
  }
  if (group != nullptr) group->barrier();  // <tag>.tmp exists, fresh, before any rank writes
  m.engine = std::make_unique<aio::Engine>(m.options.aio, m.options.backend);
  AlignedBuffer header(kAlign);
  for (Impl::DataFile& f : m.files) {
    const fs::path p = m.tmp / f.info.path;
    fs::create_directories(p.parent_path(), ec);
    if (ec) throw IoError(p.parent_path().string(), ec.value(), "create checkpoint directory");
    f.file = aio::File::open(p, {.access = aio::Access::kWrite,
                                 .create = true,
                                 .truncate = true,
                                 .exclusive = true,
                                 .direct = true});
    f.file.preallocate(f.info.bytes);
    std::memset(header.data(), 0, kAlign);
    std::memcpy(header.data(), kDataFileMagic, 8);
    const uint32_t version = kFormatVersion;
    const int32_t rank = f.info.rank;
    std::memcpy(header.data() + 8, &version, 4);
    std::memcpy(header.data() + 12, &rank, 4);
    std::memcpy(header.data() + 16, f.kind.data(), std::min<size_t>(f.kind.size(), 15));
    std::memcpy(header.data() + 32, m.tag.data(), std::min<size_t>(m.tag.size(), 95));
    m.engine->write(f.file, 0, {header.data(), kAlign});
    f.crc = crc32c({header.data(), kAlign});
  }
  log::debug("checkpoint {}: prepared {} data files ({} bytes) in {:.3f} s", m.tag, m.files.size(),
             need, std::chrono::duration<double>(std::chrono::steady_clock::now() - m.t0).count());
  m.slots.resize(m.slot_count);
  for (Impl::Slot& s : m.slots) s.buf = AlignedBuffer(std::max<uint64_t>(max_seg, kAlign));
  m.prepared = true;
}

std::span<std::byte> CheckpointWriter::stage(int file, int seg) {
  Impl& m = *impl_;
  if (!m.prepared) throw InvalidArgument("checkpoint writer: stage() before prepare()");
  Impl::DataFile& f = m.files.at(static_cast<size_t>(file));
  if (static_cast<size_t>(seg) != f.next_stage ||
      static_cast<size_t>(seg) >= f.info.segments.size())
    throw InvalidArgument(
        fmt::format("checkpoint writer: {}: segment {} staged out of order "
                    "(next is {})",
                    f.info.path, seg, f.next_stage));
  const size_t si = m.next_slot++ % m.slots.size();
  Impl::Slot& s = m.slots[si];
  m.wait_slot(s);
  if (s.file >= 0 && m.staged.count({s.file, s.seg}))
    throw InvalidArgument("checkpoint writer: more segments staged than staging slots");
  const Segment& sg = f.info.segments[static_cast<size_t>(seg)];
  const uint64_t bytes = sg.bytes();
  std::memset(s.buf.data() + bytes, 0, align_up(bytes) - bytes);
  s.file = file;
  s.seg = seg;
  s.bytes = align_up(bytes);
  m.staged[{file, seg}] = si;
  ++f.next_stage;
  return {s.buf.data(), bytes};
}

void CheckpointWriter::submit(int file, int seg) {
  Impl& m = *impl_;
  auto it = m.staged.find({file, seg});
  Impl::DataFile& f = m.files.at(static_cast<size_t>(file));
  if (it == m.staged.end() || static_cast<size_t>(seg) != f.next_submit)
    throw InvalidArgument(
        fmt::format("checkpoint writer: {}: segment {} submitted out of order", f.info.path, seg));
  Impl::Slot& s = m.slots[it->second];
  m.staged.erase(it);
  const Segment& sg = f.info.segments[static_cast<size_t>(seg)];
  std::span<const std::byte> data{s.buf.data(), s.bytes};
  f.crc = crc32c(data, f.crc);
  s.ticket = m.engine->submit_write(f.file, sg.offset, data);
  ++f.next_submit;
  m.submitted += s.bytes;
  if (m.options.crash_after_bytes != 0 && m.submitted >= m.options.crash_after_bytes) {
    m.wait_all_slots();
    crash_now("after bytes");
  }
}

SaveResult CheckpointWriter::commit(Manifest manifest) {
  Impl& m = *impl_;
  if (!m.prepared) prepare();
  if (!m.staged.empty())
    throw InvalidArgument("checkpoint writer: commit() with staged segments not submitted");
  m.wait_all_slots();
  const auto tw = std::chrono::steady_clock::now();
  log::debug("checkpoint {}: data written after {:.3f} s", m.tag,
             std::chrono::duration<double>(tw - m.t0).count());
  manifest.tag = m.tag;
  manifest.files.clear();
  const SaveGroup* group = m.options.group;
  const bool lead = group == nullptr || group->rank == 0;
  uint64_t total = 0;
  for (const auto& [rel, text] : m.texts) {
    write_file_durably(m.tmp / rel, text);
    FileInfo fi;
    fi.path = rel;
    fi.bytes = text.size();
    fi.crc32c = crc32c(std::as_bytes(std::span(text.data(), text.size())));
    total += fi.bytes;
    manifest.files.push_back(std::move(fi));
  }
  for (Impl::DataFile& f : m.files) {
    if (f.next_submit != f.info.segments.size())
      throw InvalidArgument(fmt::format("checkpoint writer: {}: {} of {} segments written",
                                        f.info.path, f.next_submit, f.info.segments.size()));
    f.file.fdatasync();
    f.file.close();
    f.info.crc32c = f.crc;
    total += f.info.bytes;
    manifest.files.push_back(f.info);
  }
  log::debug("checkpoint {}: data files synced after {:.3f} s", m.tag,
             std::chrono::duration<double>(std::chrono::steady_clock::now() - m.t0).count());
  const fs::path final_dir = m.dir.path() / m.tag;
  if (group != nullptr) {
    // Every rank's data files into rank 0's manifest, then rank 0 commits while the others
    // wait for it: a checkpoint exists for all ranks or for none.
    const std::vector<std::string> all = group->all_gather(manifest.to_json().dump());
    if (!lead) {
      group->barrier();
      m.committed = true;
      SaveResult r;
      r.tag = m.tag;
      r.path = final_dir;
      r.bytes = total;
      r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - m.t0).count();
      r.write_seconds = std::chrono::duration<double>(tw - m.t0).count();
      return r;
    }
    manifest.files.clear();
    for (const auto& [rel, text] : m.texts) {
      FileInfo fi;
      fi.path = rel;
      fi.bytes = text.size();
      fi.crc32c = crc32c(std::as_bytes(std::span(text.data(), text.size())));
      manifest.files.push_back(std::move(fi));
    }
    for (size_t r = 0; r < all.size(); ++r) {
      const std::string source = fmt::format("rank {}'s files of checkpoint {}", r, m.tag);
      const Manifest theirs = Manifest::from_json(nlohmann::json::parse(all[r]), source);
      for (const FileInfo& f : theirs.files) {
        if (f.rank < 0) continue;  // text files: rank 0's, added above
        if (r != 0) total += f.bytes;
        manifest.files.push_back(f);
      }
    }
  }
  const std::string text = manifest_text(manifest);
  write_file_durably(m.tmp / kManifestName, text);
  total += text.size();
  // Directories: every subdirectory, then the checkpoint directory itself.
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(m.tmp))
    if (e.is_directory()) fsync_dir(e.path());
  fsync_dir(m.tmp);
  if (m.options.crash_at == "before-rename") crash_now("before-rename");

  const fs::path old = m.dir.path() / (m.tag + ".old");
  std::error_code ec;
  if (fs::exists(final_dir)) {
    fs::remove_all(old, ec);
    rename_durably(final_dir, old, m.dir.path());
  }
  rename_durably(m.tmp, final_dir, m.dir.path());
  m.committed = true;
  fs::remove_all(old, ec);
  m.dir.set_latest(m.tag, m.options);
  m.dir.prune();
  if (group != nullptr) group->barrier();  // the other ranks return once it is committed

  SaveResult r;
  r.tag = m.tag;
  r.path = final_dir;
  r.bytes = total;
  const auto now = std::chrono::steady_clock::now();
  r.seconds = std::chrono::duration<double>(now - m.t0).count();
  r.write_seconds = std::chrono::duration<double>(tw - m.t0).count();
  return r;
}

}  // namespace outcore::ckpt
