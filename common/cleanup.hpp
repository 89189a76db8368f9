// Files a process must not leave behind even when it is about to be killed.
//
// Owners (the swap tier, lock files, staged outputs, a checkpoint save's temporary) register the
// files and directories they create and unregister them when they remove them the normal way. A
// process ending at once (a second Ctrl-C, a failed rank) calls
// remove_registered_files(Scope::kAll), which removes the data before the locks. A data-parallel
// rank told to stop calls remove_registered_files(Scope::kData) from a watcher thread at once,
// because the job launcher kills the ranks shortly after (OpenMPI's mpirun sends SIGTERM, then
// SIGKILL), while the rank may still finish its step and save: that removes the swap files
// (unlinking a file that is still open is harmless to its user: the descriptors stay valid
// until closed) but no lock, which would let another run take the directory while this one
// still works in it.
//
// Thread-safe; not async-signal-safe (call it from a thread, not from a signal handler).
#pragma once

#include <cstdint>
#include <string>

namespace outcore::cleanup {

// What a removal takes: kData the files whose removal leaves a working process working (swap
// files, empty directories), kAll these and the rest (locks, staged outputs).
enum class Scope : uint8_t { kData, kAll };

// Remember `path` (a file, or with `directory` an empty-when-done directory), to be removed by
// a removal of `scope` or wider.
void register_path(const std::string& path, bool directory = false, Scope scope = Scope::kData);
// Remember directory `path` and everything in it (a process's own scratch directory, which
// nothing else writes into), to be removed whole by a removal of `scope` or wider, after the
// files and before the empty directories.
void register_tree(const std::string& path, Scope scope = Scope::kAll);
// register_path for a file this process made and holds open as `fd`: a removal unlinks it only
// while the file at `path` is still that one.
void register_file(const std::string& path, int fd, Scope scope = Scope::kData);
// Forget `path` (its owner removed it, or will): false when it was not registered (a removal
// took it).
bool unregister_path(const std::string& path);
// Unlinks every registered file of `scope` (kAll: every one), removes its trees, then the
// registered directories of it that are empty, newest first, and forgets them. Returns the
// number of files and trees removed.
size_t remove_registered_files(Scope scope = Scope::kAll);

}  // namespace outcore::cleanup
