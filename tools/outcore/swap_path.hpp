// Where a swap directory lies on this machine, for the commands that look at one before training
// makes it (`outcore estimate`, `outcore doctor`).
#pragma once

#include <filesystem>
#include <string>
#include <system_error>

namespace outcore::cli {

// The nearest part of `path` that is there: the path itself, or the nearest ancestor where
// training would create it. `type` is that part's own (a link, even one to nowhere, is there);
// none or unknown where it could not be looked at (no permission, a loop of links: `error` says
// why), which stops the walk as it would stop training's creation.
struct ExistingPart {
  std::filesystem::path path;
  std::filesystem::file_type type = std::filesystem::file_type::none;
  std::error_code error;
};

inline ExistingPart nearest_existing_part(const std::string& path) {
  namespace fs = std::filesystem;
  ExistingPart p;
  p.path = fs::absolute(path, p.error);
  while ((p.type = fs::symlink_status(p.path, p.error).type()) == fs::file_type::not_found &&
         p.path != p.path.parent_path())
    p.path = p.path.parent_path();
  return p;
}

}  // namespace outcore::cli
