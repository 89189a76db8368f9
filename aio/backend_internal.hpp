// Internal to aio/: a seam over the io_uring probe behind resolve_backend(), so tests can
// simulate a host where io_uring cannot be used (kernel.io_uring_disabled, a seccomp filter,
// an old kernel) on one where it can.
#pragma once

namespace outcore::aio::internal {

// Returns 0 if an io_uring can be created, or -errno from io_uring_queue_init.
using ProbeFunction = int (*)();

// Replaces the probe used by the next decision of resolve_backend(); nullptr restores the real
// one. Returns the previous function. Test-only.
ProbeFunction set_io_uring_probe_for_testing(ProbeFunction fn);

// Forgets the process-wide decision, so the next resolve_backend() decides again from the
// request recorded by request_backend() (which is kept) and probes again. Test-only. REQUIRES: no
// resolve_backend() or Engine construction runs concurrently.
void reset_backend_choice_for_testing();

}  // namespace outcore::aio::internal
