// HostLane (engine/zero/host_lane.hpp): tasks run in order on the lane's thread; the first error
// is kept with its type, later tasks are skipped, and every wait rethrows it.
#include "engine/zero/host_lane.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "common/error.hpp"

namespace outcore::zero::detail {
namespace {

TEST(HostLane, RunsTasksInOrderOffTheCallersThread) {
  HostLane lane("test-lane");
  std::vector<int> order;
  std::thread::id ran_on;
  uint64_t last = 0;
  for (int i = 0; i < 100; ++i)
    last = lane.post([&order, &ran_on, i] {
      if (i == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      order.push_back(i);
      ran_on = std::this_thread::get_id();
    });
  EXPECT_EQ(last, 100u);
  lane.wait_for(last);
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

TEST(HostLane, WaitForReturnsOnceThatTaskRan) {
  HostLane lane("test-lane");
  std::atomic<bool> release{false}, second{false};
  const uint64_t first = lane.post([&] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  lane.post([&] { second.store(true); });
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    release.store(true);
  });
  lane.wait_for(first);
  t.join();
  lane.wait();
  EXPECT_TRUE(second.load());
}

TEST(HostLane, FirstErrorKeepsItsTypeAndSkipsLaterTasks) {
  HostLane lane("test-lane");
  std::atomic<int> ran{0};
  lane.post([&] { ++ran; });
  const uint64_t failing = lane.post([] { throw IoError("/swap/grad/3.bin", EIO, "write"); });
  lane.post([] { throw InvalidArgument("second error"); });
  const uint64_t after = lane.post([&] { ++ran; });
  try {
    lane.wait_for(after);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), EIO);
    EXPECT_NE(std::string(e.what()).find("/swap/grad/3.bin"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ran.load(), 1);
  EXPECT_THROW(lane.wait_for(failing), IoError);
  EXPECT_THROW(lane.wait(), IoError);
}

TEST(HostLane, DestructorRunsWhatWasPosted) {
  std::atomic<int> ran{0};
  {
    HostLane lane("test-lane");
    for (int i = 0; i < 10; ++i)
      lane.post([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ++ran;
      });
  }
  EXPECT_EQ(ran.load(), 10);
}

}  // namespace
}  // namespace outcore::zero::detail
