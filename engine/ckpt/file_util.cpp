#include "engine/ckpt/file_util.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>

#include "common/error.hpp"
#include "common/open_file.hpp"
#include "common/unique_fd.hpp"

namespace outcore::ckpt {
void write_file_durably(const std::filesystem::path& path, std::string_view data) {
  // A new file only: whatever is at the path (a link, a file of someone else's) is never
  // written through, truncated or removed.
  UniqueFd f(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (f.get() < 0) throw IoError(path.string(), errno, "create");
  try {
    size_t off = 0;
    while (off < data.size()) {
      const ssize_t n = ::write(f.get(), data.data() + off, data.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0)
        throw IoError(path.string(), off, data.size() - off, n < 0 ? errno : EIO, "write");
      off += static_cast<size_t>(n);
    }
    if (::fsync(f.get()) != 0) throw IoError(path.string(), errno, "fsync");
    if (f.close() != 0) throw IoError(path.string(), errno, "close");
  } catch (...) {
    ::unlink(path.c_str());  // a partial file is no file of ours to leave (a full disk)
    throw;
  }
}

void rename_durably(const std::filesystem::path& from, const std::filesystem::path& to,
                    const std::filesystem::path& dir) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw IoError(from.string(), errno, fmt::format("rename to {}", to.string()));
  fsync_directory(dir);
}

bool exchange_entries(const std::filesystem::path& a, const std::filesystem::path& b) {
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) != 0) {
    if (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) return false;
    throw IoError(a.string(), errno, fmt::format("exchange with {}", b.string()));
  }
  return true;
}

std::string read_small_file(const std::filesystem::path& path, size_t limit) {
  UniqueFd f;
  try {
    f.reset(open_for_reading(path.string(), "checkpoint file"));
  } catch (const InvalidArgument& e) {  // a FIFO, a directory, ...: not what was saved
    throw CorruptData(e.what());
  } catch (const IoError& e) {  // a file of the checkpoint that is gone: as verify() says it
    if (e.error_number() == ENOENT) throw CorruptData(fmt::format("{}: missing", path.string()));
    throw;
  }
  return read_small_fd(f.get(), path, limit);
}

std::string read_small_fd(int fd, const std::filesystem::path& path, size_t limit) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw IoError(path.string(), errno, "stat");
  if (static_cast<uint64_t>(st.st_size) > limit)
    throw CorruptData(
        fmt::format("{}: {} bytes, more than the {} expected", path.string(), st.st_size, limit));
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t off = 0;
  while (off < out.size()) {
    const ssize_t n = ::pread(fd, out.data() + off, out.size() - off, static_cast<off_t>(off));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(path.string(), off, out.size() - off, errno, "read");
    if (n == 0) break;
    off += static_cast<size_t>(n);
  }
  out.resize(off);
  return out;
}

std::string read_latest_tag(const std::filesystem::path& latest) {
  std::string tag = read_small_file(latest, 4096);
  while (!tag.empty() && (tag.back() == '\n' || tag.back() == '\r' || tag.back() == ' '))
    tag.pop_back();
  // A tag is a directory name in the save directory: no separator, no control character. A bad
  // one is shown escaped (control characters and any byte above ASCII), never written to the
  // terminal as it is.
  auto control = [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; };
  const bool bad = tag.empty() || tag == "." || tag == ".." ||
                   tag.find_first_of("/ ") != std::string::npos ||
                   std::any_of(tag.begin(), tag.end(), control);
  if (bad) {
    std::string shown;
    for (const char c : tag.substr(0, 64))
      shown += control(c) || c == '"' || c == '\\' || static_cast<unsigned char>(c) >= 0x80
                   ? fmt::format("\\x{:02x}", static_cast<unsigned char>(c))
                   : std::string(1, c);
    throw CorruptData(fmt::format("{}: does not name a checkpoint (\"{}{}\")", latest.string(),
                                  shown, tag.size() > 64 ? "..." : ""));
  }
  return tag;
}

}  // namespace outcore::ckpt
