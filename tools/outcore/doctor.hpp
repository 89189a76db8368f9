// `outcore doctor`: checks whether this machine can train, one line per check. Internal to the
// outcore tool.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace outcore::cli::doctor {

// ok: ready; warn: works, slower or degraded (the detail says how); fail: training as asked
// cannot work (doctor exits 1); none: the thing is absent and not needed (no GPU).
enum class Verdict { kOk, kWarn, kFail, kNone };

struct Line {
  std::string check;  // "cpu", "io_uring", "nvme path", "gpu 0", "kernel rmsnorm", ...
  Verdict verdict = Verdict::kOk;
  std::string detail;  // what was found, and for warn/fail what to do about it
};

struct Options {
  std::string nvme_path;      // swap directory to check; empty = not checked
  uint64_t pinned_bytes = 0;  // pinned pool size the locked-memory limit is compared with
};

// CPU ISA and CPU Adam kernel, OpenBLAS kernels, io_uring, O_DIRECT and free space on nvme_path,
// RLIMIT_MEMLOCK.
std::vector<Line> host_checks(const Options& options);

// Each GPU (name, memory, compute capability, driver), then on GPU 0 each CUDA kernel against
// the host kernels on random data, a GEMM's TFLOPS, pinned H2D/D2H GB/s, and NCCL all-reduce
// among the local GPUs. A single `none` line when there is no GPU or no CUDA in this build.
std::vector<Line> gpu_checks();

}  // namespace outcore::cli::doctor
