// Executor: static, cache-line-respecting chunking of a range over a oneTBB task_arena.
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <string>
#include <thread>

#include "common/error.hpp"
#include "cpu_adam/cpu_adam.hpp"

namespace outcore::cpu_adam {

struct Executor::Arena {
  explicit Arena(int threads) : arena(threads) { arena.initialize(); }
  tbb::task_arena arena;
};

Executor::Executor(unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  if (threads > kMaxThreads) {
    throw InvalidArgument("cpu_adam::Executor: " + std::to_string(threads) +
                          " threads requested, at most " + std::to_string(kMaxThreads) +
                          " allowed");
  }
  threads_ = threads;
  if (threads > 1) arena_ = std::make_unique<Arena>(static_cast<int>(threads));
}

Executor::~Executor() = default;
Executor::Executor(Executor&&) noexcept = default;
Executor& Executor::operator=(Executor&&) noexcept = default;

void Executor::run_chunks(size_t n, size_t grain, size_t min_parallel, ChunkFn fn,
                          void* ctx) const {
  if (n == 0) return;
  if (!arena_ || threads_ <= 1 || n < min_parallel || n <= grain) {
    fn(ctx, 0, 0, n);
    return;
  }
  const size_t grains = (n + grain - 1) / grain;
  const size_t per = (grains + threads_ - 1) / threads_ * grain;  // elements per chunk
  const size_t chunks = (n + per - 1) / per;
  arena_->arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, chunks, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          for (size_t k = r.begin(); k != r.end(); ++k) {
            fn(ctx, k, k * per, std::min(n, (k + 1) * per));
          }
        },
        tbb::static_partitioner());
  });
}

}  // namespace outcore::cpu_adam
