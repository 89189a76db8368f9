// What kind of JSON-lines file an open file is, from its first line: how a command that writes a
// log or metrics file tells its own earlier file (which it may replace) from a user's (which it
// must not). Header-only; the users link nlohmann_json.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace outcore {

// Whether the open regular file `fd` is empty, or its first line (read from offset 0, at most
// 16 MiB of it: a metrics file's start record holds the model's and the run's configs) is a JSON
// object whose string member `key` is one of `values`. A line longer than that, a file without a
// newline, a read error or something other than a regular file: false.
inline bool first_json_line_is(int fd, std::string_view key,
                               std::initializer_list<std::string_view> values) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return false;
  if (st.st_size == 0) return true;
  std::string head(static_cast<size_t>(std::min<off_t>(st.st_size, off_t{1} << 24)), '\0');
  const ssize_t n = ::pread(fd, head.data(), head.size(), 0);
  if (n <= 0) return false;
  const size_t eol = std::string_view(head.data(), static_cast<size_t>(n)).find('\n');
  if (eol == std::string::npos) return false;
  head.resize(eol);
  const nlohmann::json first = nlohmann::json::parse(head, nullptr, /*allow_exceptions=*/false);
  if (!first.is_object()) return false;
  const auto it = first.find(key);
  if (it == first.end() || !it->is_string()) return false;
  const std::string& value = it->get_ref<const std::string&>();
  return std::find(values.begin(), values.end(), value) != values.end();
}

}  // namespace outcore
