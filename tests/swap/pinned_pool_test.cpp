// PinnedPool: alignment, the hard budget (checked by the pool's own peak counter under
// concurrency), blocking / timeout / try, fragmentation and coalescing, hooks, lease lifetime.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "swap/swap.hpp"

namespace outcore::swap {
namespace {

using namespace std::chrono_literals;
constexpr size_t kMiB = 1 << 20;

TEST(PinnedPool, LeasesAreAlignedAndCountedAtCapacity) {
  PinnedPool pool({.budget_bytes = kMiB});
  EXPECT_EQ(pool.budget_bytes(), kMiB);
  PinnedBuffer a = pool.acquire(1);
  PinnedBuffer b = pool.acquire(4097);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % 4096, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % 4096, 0u);
  EXPECT_EQ(a.size(), 1u);
  EXPECT_EQ(b.capacity(), 8192u);
  EXPECT_EQ(pool.in_use_bytes(), 4096u + 8192u);
  EXPECT_EQ(pool.leases(), 2u);
  std::memset(b.data(), 0x5a, b.capacity());  // whole capacity is ours
  a.reset();
  EXPECT_FALSE(a.valid());
  EXPECT_EQ(pool.in_use_bytes(), 8192u);
  b = PinnedBuffer();
  EXPECT_EQ(pool.in_use_bytes(), 0u);
  EXPECT_EQ(pool.peak_bytes(), 4096u + 8192u);
}

TEST(PinnedPool, RequestLargerThanBudgetFailsAtOnceNamingBoth) {
  PinnedPool pool({.budget_bytes = kMiB});
  try {
    pool.acquire(kMiB + 1, std::chrono::hours(1));  // must not wait an hour
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(std::to_string(kMiB + 1)), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(kMiB)), std::string::npos) << msg;
  }
  EXPECT_THROW(pool.try_acquire(2 * kMiB), OutOfMemory);
  EXPECT_THROW(pool.acquire(0), InvalidArgument);
  EXPECT_EQ(pool.peak_bytes(), 0u);
}

TEST(PinnedPool, ZeroBudgetIsInvalid) {
  EXPECT_THROW(PinnedPool({.budget_bytes = 0}), InvalidArgument);
}

TEST(PinnedPool, TryAcquireAndTimeoutWhenExhausted) {
  PinnedPool pool({.budget_bytes = 64 * 1024});
  PinnedBuffer all = pool.acquire(64 * 1024);
  EXPECT_FALSE(pool.try_acquire(4096).has_value());
  try {
    pool.acquire(4096, 20ms);
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("65536"), std::string::npos) << e.what();
  }
  all.reset();
  EXPECT_TRUE(pool.try_acquire(4096).has_value());
}

TEST(PinnedPool, AcquireWaitsForARelease) {
  PinnedPool pool({.budget_bytes = 64 * 1024});
  PinnedBuffer held = pool.acquire(48 * 1024);
  std::atomic<bool> released{false};
  std::thread t([&] {
    std::this_thread::sleep_for(30ms);
    released = true;
    held.reset();
  });
  PinnedBuffer got = pool.acquire(32 * 1024, 10s);
  EXPECT_TRUE(released.load());
  EXPECT_TRUE(got.valid());
  t.join();
  EXPECT_LE(pool.peak_bytes(), pool.budget_bytes());
}

TEST(PinnedPool, FragmentedSpaceCoalescesOnRelease) {
  PinnedPool pool({.budget_bytes = 4 * 4096});
  std::vector<PinnedBuffer> q;
  for (int i = 0; i < 4; ++i) q.push_back(pool.acquire(4096));
  q[0].reset();
  q[2].reset();  // 8 KiB free, but not contiguous
  EXPECT_FALSE(pool.try_acquire(8192).has_value());
  q[1].reset();  // [0, 12 KiB) free now
  auto big = pool.try_acquire(12288);
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(pool.in_use_bytes(), 16384u);
}

TEST(PinnedPool, ConcurrentLeasesStayWithinBudgetAndNeverOverlap) {
  const size_t budget = 256 * 1024;
  PinnedPool pool({.budget_bytes = budget});
  std::atomic<int> overlaps{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 300; ++i) {
        size_t bytes = 1 + rng() % (96 * 1024);
        PinnedBuffer b = pool.acquire(bytes, 30s);
        std::memset(b.data(), t + 1, b.capacity());
        std::this_thread::yield();
        for (size_t j = 0; j < b.capacity(); j += 512) {
          if (static_cast<int>(b.data()[j]) != t + 1) ++overlaps;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(overlaps.load(), 0);
  EXPECT_LE(pool.peak_bytes(), budget);
  EXPECT_GT(pool.peak_bytes(), 96u * 1024);  // they really did share it
  EXPECT_EQ(pool.in_use_bytes(), 0u);
  EXPECT_EQ(pool.leases(), 0u);
}

TEST(PinnedPool, RegistrationHookSeesTheRegionOnceEachWay) {
  int registered = 0, unregistered = 0;
  std::span<std::byte> seen;
  {
    PinnedPoolOptions o{.budget_bytes = 3 * 4096 + 1};
    o.hook.on_register = [&](std::span<std::byte> r) {
      ++registered;
      seen = r;
    };
    o.hook.on_unregister = [&](std::span<std::byte> r) {
      ++unregistered;
      EXPECT_EQ(r.data(), seen.data());
    };
    PinnedPool pool(o);
    EXPECT_EQ(registered, 1);
    EXPECT_EQ(seen.data(), pool.region().data());
    EXPECT_EQ(seen.size(), 4u * 4096);
    PinnedBuffer b = pool.acquire(100);
    EXPECT_GE(b.data(), seen.data());
  }
  EXPECT_EQ(unregistered, 1);
}

TEST(PinnedPool, FailingRegistrationFailsConstruction) {
  PinnedPoolOptions o{.budget_bytes = 4096};
  o.hook.on_register = [](std::span<std::byte>) { throw Error("cudaHostRegister failed"); };
  EXPECT_THROW(PinnedPool p(o), Error);
}

TEST(PinnedPool, LeaseMayOutliveThePool) {
  int unregistered = 0;
  PinnedBuffer survivor;
  {
    PinnedPoolOptions o{.budget_bytes = 8192};
    o.hook.on_register = [](std::span<std::byte>) {};
    o.hook.on_unregister = [&](std::span<std::byte>) { ++unregistered; };
    PinnedPool pool(o);
    survivor = pool.acquire(8192);
  }
  EXPECT_EQ(unregistered, 0);  // memory still leased
  std::memset(survivor.data(), 1, survivor.capacity());
  survivor.reset();
  EXPECT_EQ(unregistered, 1);
}

TEST(PinnedPool, LocksWhenAllowed) {
  PinnedPool pool({.budget_bytes = 64 * 1024, .lock = true});
  PinnedPool unlocked({.budget_bytes = 4096, .lock = false});
  EXPECT_FALSE(unlocked.locked());
  if (!pool.locked()) GTEST_SKIP() << "mlock refused here (RLIMIT_MEMLOCK); the pool fell back";
  SUCCEED();
}

}  // namespace
}  // namespace outcore::swap
