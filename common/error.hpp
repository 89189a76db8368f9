// Errors thrown by every outcore library. Each carries what went wrong and where (a path,
// an offset, a JSON path, an errno), so `main` can print one line a user can act on.
#pragma once

#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace outcore {

// Base of all outcore errors. what() is the complete, user-facing message.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// A configuration file or model config that is malformed or holds an impossible value.
// `path` is the JSON path of the offending key ("zero_optimization.stage"), or empty.
class ConfigError : public Error {
 public:
  ConfigError(std::string json_path, const std::string& msg)
      : Error(json_path.empty() ? msg : json_path + ": " + msg), json_path_(std::move(json_path)) {}
  const std::string& json_path() const { return json_path_; }

 private:
  std::string json_path_;
};

// An I/O operation failed. Names the file, the byte offset and length, and errno.
class IoError : public Error {
 public:
  IoError(std::string file, uint64_t offset, uint64_t length, int err, const std::string& op);
  IoError(std::string file, int err, const std::string& op);  // no offset (open, fallocate...)
  const std::string& file() const { return file_; }
  uint64_t offset() const { return offset_; }
  uint64_t length() const { return length_; }
  int error_number() const { return errno_; }

 private:
  std::string file_;
  uint64_t offset_ = 0;
  uint64_t length_ = 0;
  int errno_ = 0;
};

// A path another process holds: its lock (a save directory's, a swap directory's, a metrics
// file's) is taken. errno EWOULDBLOCK. The user's to change, as bad input is (exit 2), where an
// IoError of the same errno from a drive (EAGAIN after retries) is a failure (exit 1).
class PathBusy : public IoError {
 public:
  PathBusy(std::string file, const std::string& op);
};

// A memory budget (device allocator, pinned pool, host RAM) cannot satisfy a request.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// Data read back does not match what was written (checksum mismatch, bad magic, truncated).
class CorruptData : public Error {
 public:
  using Error::Error;
};

// The caller asked for something invalid (wrong sizes, misaligned buffer, bad argument).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// Long work (setup, initialisation) was asked to stop (Ctrl-C) before it finished; nothing it
// made is left behind.
class Interrupted : public Error {
 public:
  using Error::Error;
};

// Formats "strerror(err) (errno N)".
std::string errno_string(int err);

}  // namespace outcore
