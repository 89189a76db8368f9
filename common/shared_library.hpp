// SharedLibrary: a library loaded at run time (dlopen) where a caller first needs it, so that a
// process which never uses it neither maps nor initialises it (cuBLASLt: about 147 MiB resident
// per process once loaded, on machines without a GPU too).
//
// open() tries each candidate path or file name in order (a bare name is searched for as
// dlopen(3) does: the caller's RUNPATH, LD_LIBRARY_PATH, the loader's cache) and keeps the first
// that loads; it throws outcore::Error naming `what`, every candidate and the loader's reason
// when none does. symbol() throws naming the symbol and the library. The library stays loaded
// for the life of the process (a dlclose would leave dangling pointers in whatever it gave out).
//
// Thread-safe: open() and symbol() may be called from any thread.
#pragma once

#include <string>
#include <vector>

namespace outcore {

class SharedLibrary {
 public:
  static SharedLibrary open(const std::string& what, const std::vector<std::string>& candidates);

  // The address of `name` in the library, as T (a function pointer type).
  template <class T>
  T symbol(const char* name) const {
    return reinterpret_cast<T>(address(name));
  }
  const std::string& path() const { return path_; }

  // The directory of the loaded object that holds `address` (a function of a library linked at
  // build time, to find a sibling library in the same directory), or "" when unknown.
  static std::string directory_of(const void* address);

 private:
  SharedLibrary(void* handle, std::string path) : handle_(handle), path_(std::move(path)) {}
  void* address(const char* name) const;

  void* handle_ = nullptr;
  std::string path_;
};

}  // namespace outcore
