// Byte sizes on the command line: "4096", "128K", "1M", "4GiB" (binary units).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace outcore::aio_bench {

// Parses a size; nullopt when malformed, zero or overflowing.
std::optional<uint64_t> parse_size(std::string_view text);
// "128K", "1M", "4G", or plain bytes when not a whole unit.
std::string format_size(uint64_t bytes);

}  // namespace outcore::aio_bench
