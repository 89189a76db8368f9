// Where a benchmark writes under a directory the user names: only in what it made there.
//
// ScratchDir: a new directory "<parent>/<stem>.XXXXXX" (mkdtemp), removed whole when the object
// goes. open_unlinked_scratch_file: a new file under a unique name, unlinked as soon as it is
// open, so that nothing is left however the process ends. Neither reads, writes, follows or
// removes anything else under the directory the user named (a user's file at any name is kept).
// Swap files a benchmark makes there go through swap::SwapSpace's rules (its outcore_swap/ tree,
// locked; only swap files removed).
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>

#include "aio/aio.hpp"
#include "common/error.hpp"

namespace outcore::bench {

class ScratchDir {
 public:
  // Creates `parent` (and its parents) when missing, then the scratch directory in it.
  // Throws IoError naming the directory that could not be made.
  ScratchDir(const std::filesystem::path& parent, std::string_view stem) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) throw IoError(parent.string(), ec.value(), "create the benchmark's directory");
    std::string name = (parent / (std::string(stem) + ".XXXXXX")).string();
    if (::mkdtemp(name.data()) == nullptr)
      throw IoError(parent.string(), errno, "create a scratch directory");
    path_ = name;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A new file in `dir` named "<stem>.<pid>[-k].tmp" (never one that exists), created
// exclusively, opened again with `options` (O_DIRECT where they ask and the filesystem allows
// it), and unlinked at once: it is used through the returned File only. Throws IoError.
inline aio::File open_unlinked_scratch_file(const std::filesystem::path& dir, std::string_view stem,
                                            aio::OpenOptions options) {
  options.create = options.exclusive = options.truncate = false;
  for (int k = 0;; ++k) {
    const std::filesystem::path path =
        dir / fmt::format("{}.{}{}.tmp", stem, ::getpid(), k > 0 ? fmt::format("-{}", k) : "");
    try {  // created buffered: a refused O_DIRECT must not leave a file behind each attempt
      aio::File::open(
          path,
          {.access = aio::Access::kWrite, .create = true, .exclusive = true, .direct = false});
    } catch (const IoError& e) {
      if (e.error_number() != EEXIST || k == 100) throw;
      continue;
    }
    try {
      aio::File file = aio::File::open(path, options);
      ::unlink(path.c_str());
      return file;
    } catch (...) {
      ::unlink(path.c_str());
      throw;
    }
  }
}

// A benchmark's main: `run(argc, argv)`, an exception ending it with one line on stderr naming
// `name` and exit 1 (caught, so that the stack unwinds and a ScratchDir goes).
inline int main_removing_scratch(const char* name, int (*run)(int, char**), int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace outcore::bench
