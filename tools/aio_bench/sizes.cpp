#include "tools/aio_bench/sizes.hpp"

#include <cctype>
#include <charconv>

namespace outcore::aio_bench {

std::optional<uint64_t> parse_size(std::string_view text) {
  uint64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end == text.data() || value == 0) return std::nullopt;
  std::string unit;
  for (const char* p = end; p != text.data() + text.size(); ++p) {
    unit += static_cast<char>(std::toupper(static_cast<unsigned char>(*p)));
  }
  int shift = 0;
  if (unit.empty() || unit == "B") {
    shift = 0;
  } else if (unit == "K" || unit == "KB" || unit == "KIB") {
    shift = 10;
  } else if (unit == "M" || unit == "MB" || unit == "MIB") {
    shift = 20;
  } else if (unit == "G" || unit == "GB" || unit == "GIB") {
    shift = 30;
  } else if (unit == "T" || unit == "TB" || unit == "TIB") {
    shift = 40;
  } else {
    return std::nullopt;
  }
  if (shift > 0 && value > (UINT64_MAX >> shift)) return std::nullopt;
  return value << shift;
}

std::string format_size(uint64_t bytes) {
  const char* units[] = {"", "K", "M", "G", "T"};
  int u = 0;
  while (u < 4 && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    ++u;
  }
  return std::to_string(bytes) + units[u];
}

}  // namespace outcore::aio_bench
