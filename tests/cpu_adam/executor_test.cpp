// Executor: chunking contract, thread limits, and no heap allocation inside a kernel call.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <new>
#include <set>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "test_util.hpp"

// Counts operator new calls made while g_counting is set (replaces the global allocator for
// this test binary; behaviour is otherwise unchanged).
static std::atomic<bool> g_counting{false};
static std::atomic<long> g_allocations{0};

// The replacement pairs malloc with free on purpose.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

void* operator new(std::size_t size) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace outcore::cpu_adam {
namespace {

struct Chunk {
  size_t k, begin, end;
  bool operator<(const Chunk& o) const { return begin < o.begin; }
};

std::vector<Chunk> chunks_of(const Executor& ex, size_t n, size_t grain, size_t min_parallel) {
  std::mutex mu;
  std::vector<Chunk> out;
  ex.for_chunks(n, grain, min_parallel, [&](size_t k, size_t b, size_t e) {
    std::lock_guard<std::mutex> lock(mu);
    out.push_back({k, b, e});
  });
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Executor, ChunksCoverTheRangeOnceOnGrainBoundaries) {
  for (unsigned threads : {1u, 2u, 3u, 8u}) {
    const Executor ex(threads);
    for (size_t n : {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{1000}, size_t{100003}}) {
      SCOPED_TRACE("threads=" + std::to_string(threads) + " n=" + std::to_string(n));
      const auto chunks = chunks_of(ex, n, 64, 0);
      ASSERT_FALSE(chunks.empty());
      EXPECT_LE(chunks.size(), threads);
      size_t next = 0;
      std::set<size_t> ids;
      for (const Chunk& c : chunks) {
        EXPECT_EQ(c.begin, next);
        EXPECT_LT(c.begin, c.end);
        EXPECT_EQ(c.begin % 64, 0u);
        EXPECT_LT(c.k, threads);
        ids.insert(c.k);
        next = c.end;
      }
      EXPECT_EQ(next, n);
      EXPECT_EQ(ids.size(), chunks.size());
    }
  }
}

TEST(Executor, SmallRangesRunOnTheCallingThreadAsOneChunk) {
  const Executor ex(2);
  const auto caller = std::this_thread::get_id();
  int calls = 0;
  ex.for_chunks(1000, 64, 4096, [&](size_t k, size_t b, size_t e) {
    ++calls;
    EXPECT_EQ(std::this_thread::get_id(), caller);
    EXPECT_EQ(k, 0u);
    EXPECT_EQ(b, 0u);
    EXPECT_EQ(e, 1000u);
  });
  EXPECT_EQ(calls, 1);
  ex.for_chunks(0, 64, 0, [&](size_t, size_t, size_t) { ++calls; });
  EXPECT_EQ(calls, 1);
}

TEST(Executor, UsesSeveralThreadsForLargeRanges) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "needs 2 hardware threads";
  const Executor ex(2);
  std::mutex mu;
  std::set<std::thread::id> seen;
  // Each chunk waits briefly for the other so that one thread cannot run both.
  std::atomic<int> arrived{0};
  ex.for_chunks(1 << 20, 64, 0, [&](size_t, size_t, size_t) {
    arrived.fetch_add(1);
    for (int spin = 0; spin < 2000000 && arrived.load() < 2; ++spin) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mu);
    seen.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(seen.size(), 2u);
}

TEST(Executor, ThreadCountLimits) {
  EXPECT_EQ(Executor(0).threads(), std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_EQ(Executor(3).threads(), 3u);
  EXPECT_THROW(Executor(Executor::kMaxThreads + 1), InvalidArgument);
  Executor a(2);
  Executor b(std::move(a));
  EXPECT_EQ(b.threads(), 2u);
}

TEST(Executor, KernelCallsDoNotAllocate) {
  constexpr size_t n = 300000;
  std::vector<float> p(n, 1.0f), g(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
  std::vector<uint16_t> out(n);
  const Executor two(2);
  for (const Executor* ex : {static_cast<const Executor*>(nullptr), &two}) {
    AdamParams hp;
    adam_step(hp, n, p.data(), {g.data(), DType::F32}, m.data(), v.data(), {}, ex);  // warm up
    g_allocations = 0;
    g_counting = true;
    for (uint64_t t = 2; t < 5; ++t) {
      hp.step = t;
      adam_step(hp, n, p.data(), {g.data(), DType::F32}, m.data(), v.data(),
                {out.data(), DType::BF16}, ex);
      (void)sum_of_squares(g.data(), DType::F32, n, ex);
      (void)has_inf_or_nan(g.data(), DType::F32, n, ex);
      scale_in_place(g.data(), DType::F32, n, 1.0f, ex);
    }
    g_counting = false;
    EXPECT_EQ(g_allocations.load(), 0) << (ex ? "two threads" : "calling thread");
  }
}

}  // namespace
}  // namespace outcore::cpu_adam
