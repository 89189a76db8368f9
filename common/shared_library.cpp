#include "common/shared_library.hpp"

#include <dlfcn.h>

#include <utility>

#include "common/error.hpp"

namespace outcore {

SharedLibrary SharedLibrary::open(const std::string& what,
                                  const std::vector<std::string>& candidates) {
  std::string reasons;
  for (const std::string& candidate : candidates) {
    if (candidate.empty()) continue;
    if (void* handle = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL))
      return SharedLibrary(handle, candidate);
    const char* reason = ::dlerror();
    reasons += "\n  " + candidate + ": " + (reason != nullptr ? reason : "not loaded");
  }
  throw Error("cannot load " + what + ", tried:" + reasons +
              "\n(its directory must be in the library path: LD_LIBRARY_PATH or ldconfig)");
}

void* SharedLibrary::address(const char* name) const {
  ::dlerror();
  void* p = ::dlsym(handle_, name);
  if (p == nullptr) {
    const char* reason = ::dlerror();
    throw Error("symbol " + std::string(name) + " not found in " + path_ + ": " +
                (reason != nullptr ? reason : "a null address"));
  }
  return p;
}

std::string SharedLibrary::directory_of(const void* address) {
  Dl_info info{};
  if (::dladdr(address, &info) == 0 || info.dli_fname == nullptr) return {};
  const std::string file = info.dli_fname;
  const size_t slash = file.rfind('/');
  return slash == std::string::npos ? std::string() : file.substr(0, slash);
}

}  // namespace outcore
