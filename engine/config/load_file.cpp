// load_config_file: a config file read with a bounded size; only regular files are read.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <string_view>

#include "common/open_file.hpp"
#include "common/unique_fd.hpp"
#include "engine/config/config.hpp"

namespace outcore::config {
namespace {

[[noreturn]] void refuse(const std::string& path, std::string message) {
  throw ConfigValidationError(path, {{"", std::move(message)}});
}

std::string limit_mib() { return std::to_string(kMaxConfigBytes >> 20) + " MiB"; }

}  // namespace

ParsedConfig load_config_file(const std::string& path, bool log_warnings) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (fd.get() < 0) refuse(path, "cannot open the config file: " + errno_string(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    refuse(path, "cannot stat the config file: " + errno_string(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    refuse(path, "is " + std::string(file_kind(st.st_mode)) +
                     ", not a regular file; allowed: a regular file of at most " + limit_mib());
  }
  if (static_cast<uint64_t>(st.st_size) > kMaxConfigBytes) {
    refuse(path, "the config file is " + std::to_string(st.st_size) + " bytes; allowed: at most " +
                     limit_mib());
  }
  std::string text;
  text.reserve(static_cast<size_t>(st.st_size));
  char buf[65536];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) refuse(path, "cannot read the config file: " + errno_string(errno));
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
    // A regular file can still grow while it is read, or never end (some /proc files).
    if (text.size() > kMaxConfigBytes) {
      refuse(path, "the config file holds more than " + limit_mib() + "; allowed: at most " +
                       limit_mib());
    }
  }
  return parse_config(text, path, log_warnings);
}

}  // namespace outcore::config
