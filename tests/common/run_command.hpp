// Runs a shell command for a test, returning its exit status (-1 when it did not exit
// normally) and appending its stdout and stderr to `output`.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <memory>
#include <string>

namespace outcore::testing {

inline int run_command(const std::string& cmd, std::string& output) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen((cmd + " 2>&1").c_str(), "r"), pclose);
  if (!pipe) return -1;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe.get())) > 0) output.append(buf.data(), n);
  const int status = pclose(pipe.release());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace outcore::testing
