#include "common/open_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <filesystem>

#include "common/error.hpp"
#include "common/log.hpp"

namespace outcore {

void open_missing_standard_streams() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    // The lowest free number: `fd` itself, since those below it are open by now.
    const int opened = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    if (opened >= 0 && opened != fd) {
      ::dup2(opened, fd);
      ::close(opened);
    }
  }
}

const char* file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "a special file";
}

bool same_file(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  struct stat sa {};
  struct stat sb {};
  const bool a_exists = ::stat(a.c_str(), &sa) == 0;
  const bool b_exists = ::stat(b.c_str(), &sb) == 0;
  if (a_exists && b_exists) return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  if (a_exists != b_exists) return false;
  const std::string ra = resolved_path(a);
  return !ra.empty() && ra == resolved_path(b);
}

void check_derived_name_fits(const std::string& path, std::string_view suffix,
                             std::string_view what) {
  namespace fs = std::filesystem;
  const fs::path at(resolve_links(path));
  const std::string name = at.filename().string();
  if (name.empty() || name == "." || name == "..") return;
  fs::path dir = at.parent_path().empty() ? fs::path(".") : at.parent_path();
  std::error_code ec;
  while (!fs::is_directory(dir, ec) && dir.has_relative_path()) dir = dir.parent_path();
  const long asked = ::pathconf(dir.empty() ? "." : dir.c_str(), _PC_NAME_MAX);
  const size_t limit = asked > 0 ? static_cast<size_t>(asked) : 255;
  if (name.size() + suffix.size() <= limit) return;
  throw InvalidArgument(fmt::format(
      "{} {}: a name of {} bytes, and outcore writes it through names up to {} bytes longer "
      "(<name>{}, with a process id): this filesystem's names are at most {} bytes. Give a name "
      "of at most {} bytes",
      what, path, name.size(), suffix.size(), suffix, limit, limit - suffix.size()));
}

bool file_id_of(const std::string& path, FileId& id) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return false;
  id = {st.st_dev, st.st_ino};
  return true;
}

bool file_id_of(int fd, FileId& id) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return false;
  id = {st.st_dev, st.st_ino};
  return true;
}

bool unlink_if_same(const std::string& path, const FileId& id) {
  FileId now;
  return file_id_of(path, now) && now == id && ::unlink(path.c_str()) == 0;
}

std::string resolve_links(const std::string& path) {
  std::string at = path;
  for (int hop = 0; hop < 40; ++hop) {
    struct stat st {};
    if (::lstat(at.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return at;
    std::string to(PATH_MAX, '\0');
    const ssize_t n = ::readlink(at.c_str(), to.data(), to.size());
    if (n <= 0 || static_cast<size_t>(n) >= to.size()) return at;
    to.resize(static_cast<size_t>(n));
    if (to.front() != '/') {
      const size_t slash = at.rfind('/');
      to = (slash == std::string::npos ? std::string() : at.substr(0, slash + 1)) + to;
    }
    at = std::move(to);
  }
  return at;
}

std::string resolved_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path a = fs::absolute(path, ec);
  while (!ec && a.has_relative_path() && (!a.has_filename() || a.filename() == "."))
    a = a.parent_path();
  if (!ec) a = fs::weakly_canonical(a, ec);
  return ec ? std::string() : a.string();
}

std::string path_within(const std::string& path, const std::string& dir) {
  const std::string p = resolved_path(path);
  const std::string d = resolved_path(dir);
  if (p.empty() || d.empty()) return {};
  const std::filesystem::path rel = std::filesystem::path(p).lexically_relative(d);
  if (rel.empty() || *rel.begin() == "..") return {};
  return rel.string();
}

void remove_killed_temporaries(const std::string& target, std::string_view what,
                               const std::function<bool(int fd)>& ours) {
  namespace fs = std::filesystem;
  const fs::path at(target);
  const fs::path dir = at.parent_path().empty() ? fs::path(".") : at.parent_path();
  const std::string head = at.filename().string() + ".tmp-";
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(head)) continue;
    const std::string_view rest = std::string_view(name).substr(head.size());
    const std::string_view digits = rest.substr(0, rest.find('-'));
    const std::string_view k =
        digits.size() < rest.size() ? rest.substr(digits.size() + 1) : std::string_view();
    if (digits.empty() || digits.size() > 9 || digits.front() == '0' ||
        digits.find_first_not_of("0123456789") != std::string_view::npos ||
        (digits.size() < rest.size() &&
         (k.empty() || k.find_first_not_of("0123456789") != std::string_view::npos)))
      continue;
    const auto pid = static_cast<pid_t>(std::stol(std::string(digits)));
    if (pid != ::getpid() && (::kill(pid, 0) == 0 || errno != ESRCH)) continue;  // may still run
    const std::string path = it->path().string();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;  // a link, or gone
    struct stat st {};
    const bool remove =
        ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_nlink == 1 && ours(fd);
    FileId id{st.st_dev, st.st_ino};
    ::close(fd);
    if (remove && unlink_if_same(path, id))
      log::warn("removed {}, a {} left by a process that was killed while writing {}", path, what,
                target);
  }
}

bool empty_or_begins_with(int fd, std::string_view head) {
  std::string text(head.size(), '\0');
  const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
  if (n == 0) return true;
  return n == static_cast<ssize_t>(head.size()) && text == head;
}

mode_t creation_umask() {
  std::FILE* f = std::fopen("/proc/self/status", "re");
  if (f == nullptr) return 022;
  char line[256];
  mode_t mask = 022;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned value = 0;
    if (std::sscanf(line, "Umask: %o", &value) == 1) {
      mask = static_cast<mode_t>(value & 0777);
      break;
    }
  }
  std::fclose(f);
  return mask;
}

int open_for_reading(const std::string& path, const char* what, int extra_flags,
                     bool allow_block_device) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | extra_flags);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) throw IoError(path, errno, fmt::format("open {}", what));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError(path, err, fmt::format("stat {}", what));
  }
  if (!S_ISREG(st.st_mode) && !(allow_block_device && S_ISBLK(st.st_mode))) {
    ::close(fd);
    throw InvalidArgument(
        fmt::format("{} {}: is {}, not a regular file", what, path, file_kind(st.st_mode)));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError(path, err, fmt::format("fcntl {}", what));
  }
  return fd;
}

std::string read_whole_file(const std::string& path, const char* what, size_t limit) {
  const int fd = open_for_reading(path, what);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  std::string out;
  char buf[65536];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(path, out.size(), sizeof buf, errno, fmt::format("read {}", what));
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > limit)
      throw CorruptData(fmt::format("{} {}: more than the {} bytes expected", what, path, limit));
  }
  return out;
}

void fsync_directory(const std::string& dir_in) {
  const std::string dir = dir_in.empty() ? std::string(".") : dir_in;
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw IoError(dir, errno, "open directory to fsync");
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw IoError(dir, err, "fsync directory");
}

void fsync_parent_directory(const std::string& path) {
  fsync_directory(std::filesystem::path(path).parent_path().string());
}

}  // namespace outcore
