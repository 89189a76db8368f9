// A command-line value as a number: from_chars over the whole text, and, where it fails, what
// was wrong in words (a number beyond the type's range is said to be, not called no number).
#pragma once

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

namespace outcore::cli {

// Parses all of `text` into `value`: "" when it is one, else what the value must be ("allowed:
// a whole number from -9223372036854775808 to 9223372036854775807", "allowed: a finite
// number", ...), for the message that names the flag and quotes the text.
template <typename T>
std::string parse_number_arg(const std::string& text, T& value) {
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if constexpr (std::is_integral_v<T>) {
    if (ec == std::errc::result_out_of_range)
      return fmt::format("allowed: a whole number from {} to {}", std::numeric_limits<T>::min(),
                         std::numeric_limits<T>::max());
    if (ec != std::errc() || ptr != end) {
      double d = 0;
      const auto [dptr, dec] = std::from_chars(text.data(), end, d);
      if (dec == std::errc() && dptr == end)  // 1e3, 2.5: a number, not a whole one
        return "allowed: a whole number (no fraction, no exponent)";
      return "allowed: a number";
    }
  } else {
    if (ec == std::errc::result_out_of_range) return "allowed: a number within a double's range";
    if (ec != std::errc() || ptr != end) return "allowed: a number";
    if (!std::isfinite(value)) return "allowed: a finite number";
  }
  return "";
}

}  // namespace outcore::cli
