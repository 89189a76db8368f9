// CpuDevice: budgeted allocator, stream ordering, events between streams, overlap, errors.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <numeric>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/device.hpp"
#include "engine/device/profiling_backend.hpp"

namespace outcore::device {
namespace {

constexpr uint64_t kMiB = 1 << 20;

TEST(CpuDeviceMemory, ChargesWholePagesAndAlignsThem) {
  CpuDevice dev;
  DeviceBuffer a = dev.alloc(1, "one byte");
  DeviceBuffer b = dev.alloc(4097, "a page and a byte");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % kAllocGranularity, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % kAllocGranularity, 0u);
  EXPECT_EQ(a.size(), 1u);
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 3 * 4096u);
  EXPECT_EQ(dev.memory_stats().live_allocations, 2u);
  EXPECT_EQ(charged_bytes(0), 0u);
  EXPECT_EQ(charged_bytes(4096), 4096u);
}

TEST(CpuDeviceMemory, ZeroBytesGivesAnEmptyBufferAndChargesNothing) {
  CpuDevice dev(CpuDeviceOptions{.memory_budget_bytes = 4096});
  DeviceBuffer a = dev.alloc(0, "nothing");
  EXPECT_FALSE(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 0u);
}

TEST(CpuDeviceMemory, OverBudgetThrowsNamingRequestUseAndBudget) {
  CpuDevice dev(CpuDeviceOptions{.memory_budget_bytes = 8 * kMiB});
  DeviceBuffer a = dev.alloc(6 * kMiB, "unit 3 params");
  try {
    dev.alloc(3 * kMiB, "unit 4 params");
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("unit 4 params"), std::string::npos) << msg;
    EXPECT_NE(msg.find("3145728 bytes"), std::string::npos) << msg;  // the request
    EXPECT_NE(msg.find("6291456 bytes"), std::string::npos) << msg;  // in use
    EXPECT_NE(msg.find("8388608 bytes"), std::string::npos) << msg;  // budget
  }
  // The failed request left the counters untouched, and an exact fit still works.
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 6 * kMiB);
  DeviceBuffer b = dev.alloc(2 * kMiB, "exact fit");
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 8 * kMiB);
}

TEST(CpuDeviceMemory, PeakIsTrackedAcrossFreesAndReset) {
  CpuDevice dev;
  {
    DeviceBuffer a = dev.alloc(3 * kMiB, "a");
    DeviceBuffer b = dev.alloc(2 * kMiB, "b");
  }
  MemoryStats s = dev.memory_stats();
  EXPECT_EQ(s.in_use_bytes, 0u);
  EXPECT_EQ(s.peak_bytes, 5 * kMiB);
  EXPECT_EQ(s.total_allocations, 2u);
  EXPECT_EQ(s.live_allocations, 0u);
  DeviceBuffer c = dev.alloc(kMiB, "c");
  dev.reset_peak();
  EXPECT_EQ(dev.memory_stats().peak_bytes, kMiB);
}

TEST(CpuDeviceMemory, BuffersAreMoveOnlyAndFreeOnce) {
  CpuDevice dev(CpuDeviceOptions{.memory_budget_bytes = 2 * kMiB});
  DeviceBuffer a = dev.alloc(kMiB, "a");
  void* p = a.data();
  DeviceBuffer b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.data(), p);
  DeviceBuffer c = dev.alloc(kMiB, "c");
  c = std::move(b);  // frees c's old memory
  EXPECT_EQ(dev.memory_stats().in_use_bytes, kMiB);
  c.reset();
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 0u);
  EXPECT_EQ(dev.memory_stats().live_allocations, 0u);
}

// Freed blocks are kept for the next allocation of the same size (no fresh pages from the
// kernel), up to the cache limit, and the budget counts live buffers only.
TEST(CpuDeviceMemory, FreedBlocksAreReusedBySizeWithinTheCacheLimit) {
  CpuDevice dev(CpuDeviceOptions{.memory_budget_bytes = 8 * kMiB, .cache_bytes = 4 * kMiB});
  void* p = nullptr;
  {
    DeviceBuffer a = dev.alloc(3 * kMiB, "a");
    p = a.data();
  }
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 0u);
  DeviceBuffer b = dev.alloc(3 * kMiB, "b");
  EXPECT_EQ(b.data(), p);  // the same block
  // The cache is not charged: the whole budget is still there for live buffers.
  DeviceBuffer c = dev.alloc(5 * kMiB, "c");
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 8 * kMiB);
  c.reset();  // larger than the cache limit: freed at once
  b.reset();  // kept
  DeviceBuffer d = dev.alloc(3 * kMiB, "d");
  EXPECT_EQ(d.data(), p);
}

// The cache never makes the device hold more than its peak of live bytes: blocks of sizes no
// longer asked for are given back when a new size needs the room.
TEST(CpuDeviceMemory, CachedPlusLiveStaysWithinThePeak) {
  CpuDevice dev(CpuDeviceOptions{.cache_bytes = 64 * kMiB});
  {
    DeviceBuffer x = dev.alloc(2 * kMiB, "x");
    DeviceBuffer y = dev.alloc(kMiB, "y");
  }
  EXPECT_EQ(dev.cached_bytes(), 3 * kMiB);    // peak 3 MiB, both kept
  DeviceBuffer z = dev.alloc(3 * kMiB, "z");  // a new size: both given back
  EXPECT_EQ(dev.cached_bytes(), 0u);
  DeviceBuffer w = dev.alloc(kMiB, "w");  // peak 4 MiB now
  z.reset();                              // kept: 1 MiB live + 3 MiB cached = the peak
  EXPECT_EQ(dev.cached_bytes(), 3 * kMiB);
  {
    DeviceBuffer v = dev.alloc(2 * kMiB, "v");  // 3 live + 3 cached > 4: z's block goes
    EXPECT_EQ(dev.cached_bytes(), 0u);
  }
  EXPECT_EQ(dev.cached_bytes(), 2 * kMiB);
}

// A stream-ordered free: the buffer leaves the budget's count at once, and its memory stays
// the work's until the event recorded after that work has completed (a block the cache holds
// is not handed out before, and a discrete device's mapping stays for the stream to use).
TEST(CpuDeviceMemory, ReleaseAfterKeepsTheMemoryUntilTheWorkBeforeItsEventHasRun) {
  for (const bool discrete : {false, true}) {
    SCOPED_TRACE(discrete ? "discrete" : "host-accessible");
    CpuDevice dev(CpuDeviceOptions{
        .memory_budget_bytes = 8 * kMiB, .discrete = discrete, .cache_bytes = 8 * kMiB});
    auto s = dev.create_stream("compute");
    DeviceBuffer a = dev.alloc(3 * kMiB, "a");
    void* const p = a.data();
    std::promise<void> go;
    std::shared_future<void> gate = go.get_future().share();
    std::atomic<bool> wrote{false};
    s->enqueue([&dev, p, gate, &wrote] {
      gate.wait();
      std::memset(dev.host_view(p), 7, 3 * kMiB);  // faults if the mapping were gone
      wrote = true;
    });
    auto done = dev.create_event();
    s->record(*done);
    dev.release_after(std::move(a), std::move(done));
    EXPECT_FALSE(a);
    MemoryStats st = dev.memory_stats();
    EXPECT_EQ(st.in_use_bytes, 0u);
    EXPECT_EQ(st.live_allocations, 0u);
    EXPECT_EQ(st.deferred_bytes, 3 * kMiB);
    // Room beside the deferred bytes: no wait, and not the block the work still writes.
    DeviceBuffer b = dev.alloc(3 * kMiB, "b");
    EXPECT_NE(b.data(), p);
    EXPECT_FALSE(wrote.load());
    go.set_value();
    s->synchronize();
    EXPECT_TRUE(wrote.load());
    dev.synchronize();  // frees what has finished
    EXPECT_EQ(dev.memory_stats().deferred_bytes, 0u);
    EXPECT_EQ(dev.memory_stats().in_use_bytes, 3 * kMiB);
    if (!discrete) {
      DeviceBuffer c = dev.alloc(3 * kMiB, "c");
      EXPECT_EQ(c.data(), p);  // cached once free
    }
  }
}

// An allocation that needs the memory of a released buffer whose work is still running waits
// for that work (the budget holds the deferred bytes too); one that fits beside them does not.
TEST(CpuDeviceMemory, AnAllocationThatNeedsDeferredMemoryWaitsForItsWork) {
  CpuDevice dev(CpuDeviceOptions{.memory_budget_bytes = 4 * kMiB, .discrete = true});
  auto s = dev.create_stream("compute");
  DeviceBuffer a = dev.alloc(3 * kMiB, "a");
  std::atomic<bool> finished{false};
  // Slow work, so that an allocation that did not wait for it would return first.
  s->enqueue([&finished] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    finished = true;
  });
  auto done = dev.create_event();
  s->record(*done);
  dev.release_after(std::move(a), std::move(done));
  DeviceBuffer small = dev.alloc(kMiB, "fits beside it");
  DeviceBuffer big = dev.alloc(3 * kMiB, "needs its memory");
  EXPECT_TRUE(finished.load());
  EXPECT_EQ(dev.memory_stats().deferred_bytes, 0u);
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 4 * kMiB);
  EXPECT_EQ(dev.memory_stats().peak_bytes, 4 * kMiB);
}

// Work that failed before the event does not keep the memory: it is freed, and the error stays
// the stream's to report. Bad calls are refused without touching the buffer.
TEST(CpuDeviceMemory, ReleaseAfterAFailedStreamFreesAndRefusesBadCalls) {
  CpuDevice dev(CpuDeviceOptions{.memory_budget_bytes = 4 * kMiB, .discrete = true});
  auto s = dev.create_stream("compute");
  DeviceBuffer a = dev.alloc(3 * kMiB, "a");
  s->enqueue([] { throw IoError("unit.bin", 5, "read"); });
  auto done = dev.create_event();
  s->record(*done);
  dev.release_after(std::move(a), std::move(done));
  DeviceBuffer b = dev.alloc(3 * kMiB, "b");  // waits for the failed work: no throw
  EXPECT_EQ(dev.memory_stats().deferred_bytes, 0u);
  EXPECT_THROW(s->synchronize(), IoError);

  EXPECT_THROW(dev.release_after(std::move(b), nullptr), InvalidArgument);
  EXPECT_TRUE(b);
  CpuDevice other;
  EXPECT_THROW(other.release_after(std::move(b), other.create_event()), InvalidArgument);
  EXPECT_TRUE(b);
  dev.release_after(DeviceBuffer{}, dev.create_event());  // empty: nothing
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 3 * kMiB);
}

TEST(CpuDeviceStream, RunsItemsInEnqueueOrder) {
  CpuDevice dev;
  auto s = dev.create_stream("ordered");
  std::vector<int> seen;
  for (int i = 0; i < 200; ++i) s->enqueue([&seen, i] { seen.push_back(i); });
  s->synchronize();
  std::vector<int> want(200);
  std::iota(want.begin(), want.end(), 0);
  EXPECT_EQ(seen, want);
}

TEST(CpuDeviceStream, CopiesRoundTripThroughDeviceMemory) {
  CpuDevice dev;
  auto s = dev.create_stream("copy");
  std::vector<float> host(10000), back(10000, -1.0f);
  std::iota(host.begin(), host.end(), 0.5f);
  DeviceBuffer d1 = dev.alloc(host.size() * 4, "d1"), d2 = dev.alloc(host.size() * 4, "d2");
  s->copy_h2d(d1.data(), host.data(), host.size() * 4);
  s->copy_d2d(d2.data(), d1.data(), host.size() * 4);
  s->memset(d1.data(), 0, host.size() * 4);
  s->copy_d2h(back.data(), d2.data(), host.size() * 4);
  s->synchronize();
  EXPECT_EQ(back, host);
  EXPECT_EQ(d1.as<float>()[1234], 0.0f);
}

TEST(CpuDeviceStream, NullPointerWithBytesIsRejected) {
  CpuDevice dev;
  auto s = dev.create_stream("bad");
  float x = 0;
  EXPECT_THROW(s->copy_h2d(nullptr, &x, 4), InvalidArgument);
  EXPECT_THROW(s->copy_d2h(&x, nullptr, 4), InvalidArgument);
  EXPECT_NO_THROW(s->copy_d2d(nullptr, nullptr, 0));
  EXPECT_THROW(s->enqueue({}), InvalidArgument);
}

TEST(CpuDeviceEvent, WaitOrdersWorkAcrossStreams) {
  CpuDevice dev;
  auto producer = dev.create_stream("producer");
  auto consumer = dev.create_stream("consumer");
  auto ev = dev.create_event();
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<int> value{0};
  std::atomic<int> observed{-1};
  producer->enqueue([gate] { gate.wait(); });
  producer->enqueue([&] { value = 42; });
  producer->record(*ev);
  consumer->wait(*ev);
  consumer->enqueue([&] { observed = value.load(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(ev->query());
  EXPECT_EQ(observed.load(), -1);  // the consumer is held back by the event
  release.set_value();
  consumer->synchronize();
  EXPECT_EQ(observed.load(), 42);
  EXPECT_TRUE(ev->query());
}

TEST(CpuDeviceEvent, NeverRecordedIsCompleteAndHostSyncBlocksUntilMarker) {
  CpuDevice dev;
  auto ev = dev.create_event();
  EXPECT_TRUE(ev->query());
  ev->synchronize();  // returns at once
  auto s = dev.create_stream("s");
  std::atomic<bool> ran{false};
  s->enqueue([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ran = true;
  });
  s->record(*ev);
  ev->synchronize();
  EXPECT_TRUE(ran.load());
}

TEST(CpuDeviceStream, StreamsRunConcurrentlySoCopiesOverlapCompute) {
  // The compute item can only finish if the copy stream runs while it is still running.
  CpuDevice dev;
  auto compute = dev.create_stream("compute");
  auto copy = dev.create_stream("copy");
  std::promise<void> copy_ran;
  std::future<void> copy_done = copy_ran.get_future();
  std::atomic<bool> overlapped{false};
  compute->enqueue([&] {
    overlapped = copy_done.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  });
  copy->enqueue([&] { copy_ran.set_value(); });
  dev.synchronize();
  EXPECT_TRUE(overlapped.load());
}

TEST(CpuDeviceStream, FirstErrorSkipsLaterWorkAndReachesSyncAndEvents) {
  CpuDevice dev;
  auto s = dev.create_stream("failing");
  auto other = dev.create_stream("dependent");
  auto ev = dev.create_event();
  std::atomic<bool> later_ran{false}, dependent_ran{false};
  s->enqueue([] { throw InvalidArgument("bad kernel argument"); });
  s->enqueue([&] { later_ran = true; });
  s->record(*ev);
  other->wait(*ev);
  other->enqueue([&] { dependent_ran = true; });
  EXPECT_THROW(ev->synchronize(), InvalidArgument);
  EXPECT_THROW(s->synchronize(), InvalidArgument);
  EXPECT_THROW(other->synchronize(), InvalidArgument);
  EXPECT_FALSE(later_ran.load());
  EXPECT_FALSE(dependent_ran.load());
  EXPECT_THROW(dev.synchronize(), Error);
}

TEST(CpuDeviceStream, ForeignExceptionsBecomeOutcoreErrorsNamingTheStream) {
  CpuDevice dev;
  auto s = dev.create_stream("compute-7");
  s->enqueue([] { throw std::runtime_error("boom"); });
  try {
    s->synchronize();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("compute-7"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("boom"), std::string::npos);
  }
}

TEST(CpuDeviceStream, DestructorDrainsQueuedWork) {
  CpuDevice dev;
  std::atomic<int> n{0};
  {
    auto s = dev.create_stream("drain");
    for (int i = 0; i < 50; ++i) s->enqueue([&] { ++n; });
  }
  EXPECT_EQ(n.load(), 50);
}

// The copy rate benchmarks and `outcore estimate` set the PCIe bound with: a positive rate on
// a discrete device (every byte through a stream copy), its memory handed back, bad arguments
// refused.
TEST(CopyRate, MeasuresRoundTripsAndReturnsItsMemory) {
  CpuDevice dev({.discrete = true});
  const double rate = copy_bytes_per_second(dev, size_t{1} << 20, 2);
  EXPECT_GT(rate, 0.0);
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 0u);
  EXPECT_EQ(dev.memory_stats().peak_bytes, uint64_t{1} << 20);
  EXPECT_THROW(copy_bytes_per_second(dev, 0, 1), InvalidArgument);
  EXPECT_THROW(copy_bytes_per_second(dev, 4096, 0), InvalidArgument);
}

// The attention rate `outcore estimate` and the benchmarks use: a warm-up and `reps` timed
// forward + backward runs on the backend given, the model's FLOPs per run, its memory handed
// back, shapes the model never makes refused.
TEST(AttentionRate, RunsForwardAndBackwardOnTheBackendAndCountsTheModelsFlops) {
  CpuDevice dev({.discrete = true});
  ProfilingBackend profiled(make_cpu_backend(dev));
  const ComputeBackend::Attention a{.B = 2,
                                    .T = 48,
                                    .nh = 4,
                                    .nkv = 2,
                                    .hd = 16,
                                    .block = 32,
                                    .scale = 0.25f,
                                    .dtype = DType::BF16};
  const double rate = attention_flops(dev, profiled, a, 2);
  EXPECT_GT(rate, 0.0);
  EXPECT_TRUE(std::isfinite(rate));
  int64_t forward = 0, backward = 0;
  for (const ProfilingBackend::Row& r : profiled.rows()) {
    if (r.op.rfind("attention_forward", 0) == 0) forward += r.calls;
    if (r.op.rfind("attention_backward", 0) == 0) backward += r.calls;
  }
  EXPECT_EQ(forward, 3);
  EXPECT_EQ(backward, 3);
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 0u);
  // 2 sequences x 4 heads x 48 * 49 / 2 causal pairs, 4 * 16 FLOPs each forward, 3x to train.
  EXPECT_DOUBLE_EQ(attention_train_flops(a), 3.0 * 4 * 16 * 2 * 4 * (48.0 * 49 / 2));
  ComputeBackend::Attention bad = a;
  bad.nh = 3;
  EXPECT_THROW(attention_flops(dev, profiled, bad, 1), InvalidArgument);
  bad = a;
  bad.dtype = DType::F16;
  EXPECT_THROW(attention_flops(dev, profiled, bad, 1), InvalidArgument);
  EXPECT_THROW(attention_flops(dev, profiled, a, 0), InvalidArgument);
}

}  // namespace
}  // namespace outcore::device
