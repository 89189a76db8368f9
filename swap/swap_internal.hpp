// Internal to swap/ and its tests: a seam into the swap-directory lock, so the race between a
// run releasing the lock and two others taking it can be reproduced deterministically.
#pragma once

#include <functional>

namespace outcore::swap::internal {

// Called once by the next swap-directory lock attempt, after it has opened the lock file and
// before it flocks it (then cleared). Tests only; not thread-safe.
void set_lock_open_hook(std::function<void()> hook);

}  // namespace outcore::swap::internal
