#include "common/cleanup.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <mutex>
#include <optional>
#include <vector>

#include "common/open_file.hpp"

namespace outcore::cleanup {
namespace {

struct Entry {
  std::string path;
  bool directory = false;
  Scope scope = Scope::kData;
  bool tree = false;           // a directory removed with everything in it
  std::optional<FileId> id{};  // removed only while the file at `path` is this one
};

// Never destroyed: a removal may run from an atexit handler registered before these were made
// (static objects made later are destroyed before it runs).
std::mutex& registry_mutex() {
  static auto* m = new std::mutex;
  return *m;
}

std::vector<Entry>& registry() {
  static auto* entries = new std::vector<Entry>;
  return *entries;
}

}  // namespace

void register_path(const std::string& path, bool directory, Scope scope) {
  std::lock_guard lock(registry_mutex());
  registry().push_back({.path = path, .directory = directory, .scope = scope});
}

void register_file(const std::string& path, int fd, Scope scope) {
  std::lock_guard lock(registry_mutex());
  Entry e{.path = path, .scope = scope};
  FileId id;
  if (file_id_of(fd, id)) e.id = id;
  registry().push_back(std::move(e));
}

void register_tree(const std::string& path, Scope scope) {
  std::lock_guard lock(registry_mutex());
  registry().push_back({.path = path, .directory = true, .scope = scope, .tree = true});
}

bool unregister_path(const std::string& path) {
  std::lock_guard lock(registry_mutex());
  std::vector<Entry>& r = registry();
  const auto it =
      std::find_if(r.rbegin(), r.rend(), [&](const Entry& e) { return e.path == path; });
  if (it == r.rend()) return false;
  r.erase(std::next(it).base());
  return true;
}

size_t remove_registered_files(Scope scope) {
  std::lock_guard lock(registry_mutex());
  std::vector<Entry>& r = registry();
  auto taken = [&](const Entry& e) { return scope == Scope::kAll || e.scope == Scope::kData; };
  size_t removed = 0;
  // The data first, then the other files newest first: a lock (taken before the files made
  // under it) goes after them (the empty directories last).
  auto remove = [&](Entry& e) {
    if (e.id ? unlink_if_same(e.path, *e.id) : ::unlink(e.path.c_str()) == 0) ++removed;
    e.path.clear();  // forgotten: removed, gone, or another file now
  };
  for (Entry& e : r)
    if (taken(e) && !e.directory && e.scope == Scope::kData) remove(e);
  for (auto it = r.rbegin(); it != r.rend(); ++it)
    if (taken(*it) && !it->directory && !it->path.empty()) remove(*it);
  for (auto it = r.rbegin(); it != r.rend(); ++it)
    if (taken(*it) && it->tree) {
      std::error_code ec;
      if (std::filesystem::remove_all(it->path, ec) > 0) ++removed;
      it->path.clear();
    }
  // Newest first; a directory that is not empty yet (a lock a working process keeps in it)
  // stays registered for a later, wider removal.
  for (auto it = r.rbegin(); it != r.rend(); ++it)
    if (taken(*it) && it->directory && !it->path.empty() &&
        (::rmdir(it->path.c_str()) == 0 || errno == ENOENT))
      it->path.clear();
  std::erase_if(r, [](const Entry& e) { return e.path.empty(); });
  return removed;
}

}  // namespace outcore::cleanup
