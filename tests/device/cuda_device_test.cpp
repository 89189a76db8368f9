// probe() everywhere; CudaDevice where the runtime reports a GPU (skipped otherwise).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "engine/device/device.hpp"

namespace outcore::device {
namespace {

TEST(Probe, AnswersWithoutThrowingAndExplainsAbsence) {
  ProbeResult p = probe();
  if (!p.available) {
    EXPECT_TRUE(p.gpus.empty());
    EXPECT_FALSE(p.reason.empty());
    EXPECT_EQ(p.summary().rfind("no GPU: ", 0), 0u) << p.summary();
    EXPECT_THROW(make_cuda_device(), InvalidArgument);
  } else {
    ASSERT_FALSE(p.gpus.empty());
    EXPECT_FALSE(p.gpus[0].name.empty());
    EXPECT_GT(p.gpus[0].total_memory_bytes, 0u);
    EXPECT_GE(p.gpus[0].compute_capability_major, 1);
    EXPECT_NE(p.summary().find("cuda:0"), std::string::npos);
  }
  if (!cuda_compiled()) {
    EXPECT_FALSE(p.available);
  }
}

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ProbeResult p = probe();
    if (!p.available) GTEST_SKIP() << p.summary();
  }
};

TEST_F(CudaDeviceTest, CopiesRoundTripOnStreams) {
  auto dev = make_cuda_device();
  EXPECT_FALSE(dev->host_accessible());
  auto s = dev->create_stream("copy");
  std::vector<float> host(1 << 20), back(1 << 20, -1.0f);
  std::iota(host.begin(), host.end(), 0.25f);
  DeviceBuffer a = dev->alloc(host.size() * 4, "a"), b = dev->alloc(host.size() * 4, "b");
  s->copy_h2d(a.data(), host.data(), host.size() * 4);
  s->copy_d2d(b.data(), a.data(), host.size() * 4);
  s->copy_d2h(back.data(), b.data(), host.size() * 4);
  s->synchronize();
  EXPECT_EQ(back, host);
}

TEST_F(CudaDeviceTest, BudgetIsEnforcedAndPeakTracked) {
  auto dev = make_cuda_device(CudaDeviceOptions{.ordinal = 0, .memory_budget_bytes = 8 << 20});
  DeviceBuffer a = dev->alloc(6 << 20, "a");
  EXPECT_THROW(dev->alloc(4 << 20, "b"), OutOfMemory);
  a.reset();
  EXPECT_EQ(dev->memory_stats().peak_bytes, 6u << 20);
  EXPECT_EQ(dev->memory_stats().in_use_bytes, 0u);
}

TEST_F(CudaDeviceTest, EventsOrderStreamsAndHostFunctionsRun) {
  auto dev = make_cuda_device();
  auto s1 = dev->create_stream("s1"), s2 = dev->create_stream("s2");
  auto ev = dev->create_event();
  std::vector<int> host(1 << 22, 7), back(1 << 22, 0);
  DeviceBuffer d = dev->alloc(host.size() * 4, "d");
  s1->copy_h2d(d.data(), host.data(), host.size() * 4);
  s1->record(*ev);
  s2->wait(*ev);
  s2->copy_d2h(back.data(), d.data(), host.size() * 4);
  bool ran = false;
  s2->enqueue([&] { ran = true; });
  s2->synchronize();
  EXPECT_TRUE(ran);
  EXPECT_EQ(back, host);
  EXPECT_TRUE(ev->query());
}

TEST_F(CudaDeviceTest, HostFunctionErrorsSurfaceAtSynchronize) {
  auto dev = make_cuda_device();
  auto s = dev->create_stream("s");
  s->enqueue([] { throw InvalidArgument("host function failed"); });
  EXPECT_THROW(s->synchronize(), InvalidArgument);
  // The device's synchronize finds it too (the first error of a live stream), and a device
  // whose failed stream is gone has none.
  EXPECT_THROW(dev->synchronize(), InvalidArgument);
  s.reset();
  EXPECT_NO_THROW(dev->synchronize());
}

// An error of a host function travels as on CpuDevice: events recorded after it rethrow it, a
// stream that waits on such an event skips its later host functions and rethrows it at
// synchronize(), and an event recorded before the failure stays clean.
TEST_F(CudaDeviceTest, HostFunctionErrorsTravelThroughEventsAndWaits) {
  auto dev = make_cuda_device();
  auto fetch = dev->create_stream("fetch"), compute = dev->create_stream("compute");
  auto before = dev->create_event(), after = dev->create_event();
  fetch->enqueue([] {});
  fetch->record(*before);
  fetch->enqueue([] { throw IoError("param/3.bin", 4096, 8192, EIO, "read"); });
  fetch->record(*after);
  compute->wait(*after);
  bool ran = false;
  compute->enqueue([&] { ran = true; });
  EXPECT_NO_THROW(before->synchronize());
  try {
    after->synchronize();
    ADD_FAILURE() << "the event recorded after the failure did not carry it";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("param/3.bin"), std::string::npos) << e.what();
  }
  EXPECT_THROW(compute->synchronize(), IoError);
  EXPECT_FALSE(ran) << "work after a wait on a failed stream ran";
  EXPECT_THROW(fetch->synchronize(), IoError);
}

// Work enqueued after a host function waits for it: the copy reads what the function wrote
// after the copy was enqueued, and the copy back sees it; a later function runs after it.
TEST_F(CudaDeviceTest, HostFunctionsGateLaterWorkOnTheirStream) {
  auto dev = make_cuda_device();
  auto s = dev->create_stream("s");
  // Page-aligned buffers of their own (two vectors could share a page, which CUDA registers
  // once), registered (pinned), so the copies are asynchronous and only the stream orders them.
  constexpr size_t kBytes = 4 << 20;
  AlignedBuffer host_buf(kBytes), back_buf(kBytes);
  const std::span<int> host = host_buf.as<int>(), back = back_buf.as<int>();
  std::fill(host.begin(), host.end(), 1);
  dev->register_host(host.data(), kBytes);
  dev->register_host(back.data(), kBytes);
  DeviceBuffer d = dev->alloc(kBytes, "d");
  std::vector<int> order;
  for (int round = 0; round < 20; ++round) {
    s->enqueue([&, round] {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::fill(host.begin(), host.end(), round + 2);
      order.push_back(round);
    });
    s->copy_h2d(d.data(), host.data(), kBytes);
    s->copy_d2h(back.data(), d.data(), kBytes);
    s->synchronize();
    ASSERT_TRUE(std::equal(back.begin(), back.end(), host.begin())) << "round " << round;
  }
  EXPECT_EQ(order.size(), 20u);
  EXPECT_TRUE(std::is_sorted(order.begin(), order.end()));
  dev->unregister_host(host.data());
  dev->unregister_host(back.data());
}

// A stream-ordered free on the GPU: the bytes leave the count at once, the memory stays the
// stream's until the event after its last use completes (a copy from it still reads its
// values), an allocation with room beside it gets other memory, and one that needs it waits
// for that work.
TEST_F(CudaDeviceTest, ReleaseAfterKeepsTheMemoryUntilItsReadersHaveRun) {
  auto dev = make_cuda_device(CudaDeviceOptions{.ordinal = 0, .memory_budget_bytes = 8 << 20});
  auto s = dev->create_stream("compute");
  std::vector<int> host(1 << 20, 5), back(1 << 20, 0);
  dev->register_host(back.data(), back.size() * 4);
  DeviceBuffer a = dev->alloc(host.size() * 4, "a");  // 4 MiB
  s->copy_h2d(a.data(), host.data(), host.size() * 4);
  s->synchronize();
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  s->enqueue([gate] { gate.wait(); });  // holds the copy below back
  s->copy_d2h(back.data(), a.data(), host.size() * 4);
  auto done = dev->create_event();
  s->record(*done);
  const void* const p = a.data();
  dev->release_after(std::move(a), std::move(done));
  EXPECT_EQ(dev->memory_stats().in_use_bytes, 0u);
  EXPECT_EQ(dev->memory_stats().deferred_bytes, 4u << 20);
  DeviceBuffer b = dev->alloc(2 << 20, "beside it");
  EXPECT_NE(b.data(), p);
  std::atomic<bool> opened{false};
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    opened = true;
    go.set_value();
  });
  // 2 in use + 4 released + 4 asked of 8 MiB: waits for the copy, and may be given its memory.
  DeviceBuffer c = dev->alloc(4 << 20, "needs its memory");
  EXPECT_TRUE(opened.load());
  // Written at once on another stream: were the released memory handed out before the copy
  // had read it, the copy would read these bytes.
  auto other = dev->create_stream("other");
  other->memset(c.data(), 0xFF, 4 << 20);
  other->synchronize();
  opener.join();
  s->synchronize();
  EXPECT_EQ(back, host);  // the copy read the released buffer's values
  EXPECT_EQ(dev->memory_stats().deferred_bytes, 0u);
  EXPECT_EQ(dev->memory_stats().in_use_bytes, 6u << 20);
  dev->unregister_host(back.data());
}

}  // namespace
}  // namespace outcore::device
