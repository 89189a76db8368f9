// Files a process must not leave behind even when it is about to be killed.
//
// Owners (the swap tier) register the files and directories they create and unregister them
// when they remove them the normal way. remove_registered_files() unlinks whatever is still
// registered; a data-parallel rank calls it from a watcher thread as soon as it is told to
// stop, because the job launcher kills the ranks shortly after (OpenMPI's mpirun sends
// SIGTERM, then SIGKILL). Unlinking a file that is still open is harmless to its user: the
// descriptors stay valid until closed, so a rank that does get to stop cleanly still works.
//
// Thread-safe; not async-signal-safe (call it from a thread, not from a signal handler).
#pragma once

#include <string>

namespace outcore::cleanup {

// Remember `path` (a file, or with `directory` an empty-when-done directory).
void register_path(const std::string& path, bool directory = false);
// Forget `path` (its owner removed it, or will).
void unregister_path(const std::string& path);
// Unlinks every registered file, then removes the registered directories that are empty,
// newest first, and forgets them all. Returns the number of files unlinked.
size_t remove_registered_files();

}  // namespace outcore::cleanup
