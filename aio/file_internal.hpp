// Internal to aio/: seams over open(2) and fallocate(2) so tests can simulate a filesystem
// that refuses O_DIRECT (tmpfs accepts it on kernels >= 6.6) or a full disk.
#pragma once

#include <sys/types.h>

namespace outcore::aio::internal {

using OpenFunction = int (*)(const char* path, int flags, mode_t mode);

// Replaces the open(2) used by File::open; nullptr restores the real one. Returns the
// previous function. Test-only; not thread-safe with concurrent File::open.
OpenFunction set_open_function_for_testing(OpenFunction fn);

using FallocateFunction = int (*)(int fd, int mode, off_t offset, off_t len);

// Replaces the fallocate(2) used by File::preallocate (to simulate ENOSPC or EOPNOTSUPP
// without filling a disk); nullptr restores the real one. Returns the previous function.
FallocateFunction set_fallocate_function_for_testing(FallocateFunction fn);

// Forgets which filesystems have already been warned about (so a test can see the warning).
void reset_fallback_warnings_for_testing();

}  // namespace outcore::aio::internal
