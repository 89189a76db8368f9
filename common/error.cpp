#include "common/error.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

namespace outcore {

std::string errno_string(int err) { return fmt::format("{} (errno {})", std::strerror(err), err); }

IoError::IoError(std::string file, uint64_t offset, uint64_t length, int err, const std::string& op)
    : Error(fmt::format("{} failed on {} at offset {} length {}: {}", op, file, offset, length,
                        errno_string(err))),
      file_(std::move(file)),
      offset_(offset),
      length_(length),
      errno_(err) {}

IoError::IoError(std::string file, int err, const std::string& op)
    : Error(fmt::format("{} failed on {}: {}", op, file, errno_string(err))),
      file_(std::move(file)),
      errno_(err) {}

PathBusy::PathBusy(std::string file, const std::string& op)
    : IoError(std::move(file), EWOULDBLOCK, op) {}

}  // namespace outcore
