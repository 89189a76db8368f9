// Comm: LocalComm's collectives and argument checks, ThreadComm (ranks as threads, for tests)
// at three ranks, and MpiComm at two ranks under mpirun.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "engine/comm/local_comm.hpp"
#include "tests/comm/collective_checks.hpp"
#include "tests/comm/thread_comm.hpp"
#include "tests/common/run_command.hpp"

namespace outcore::comm {
namespace {

TEST(LocalComm, IsAWorldOfOne) {
  LocalComm c;
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.world_size(), 1);
  EXPECT_EQ(c.name(), "local");
}

TEST(LocalComm, PassesTheSharedCollectiveChecks) {
  LocalComm c;
  auto failures = testing::check_all_collectives(c);
  for (const auto& f : failures) ADD_FAILURE() << f;
}

// The helper that runs several ranks in one process (tests/comm/thread_comm.hpp) passes the
// checks every Comm passes, at three ranks; a rank that fails breaks the group instead of
// leaving the others waiting.
TEST(ThreadComm, PassesTheSharedCollectiveChecksAtThreeRanks) {
  auto group = std::make_shared<testing::ThreadGroup>(3);
  std::vector<std::vector<std::string>> failures(3);
  std::vector<uint64_t> sent(3);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 3; ++r)
    ranks.emplace_back([&, r] {
      testing::ThreadComm c(group, r);
      failures[r] = testing::check_all_collectives(c);
      sent[r] = c.traffic().total();
    });
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < 3; ++r) {
    for (const auto& f : failures[r]) ADD_FAILURE() << "rank " << r << ": " << f;
    EXPECT_GT(sent[r], 0u) << "rank " << r;
  }
}

TEST(ThreadComm, ARankThatAbortsBreaksTheGroup) {
  auto group = std::make_shared<testing::ThreadGroup>(2);
  std::string error;
  std::thread waiting([&] {
    testing::ThreadComm c(group, 0);
    std::vector<float> x(4, 1.0f);
    try {
      c.all_reduce(x, ReduceOp::kSum);
    } catch (const Error& e) {
      error = e.what();
    }
  });
  testing::ThreadComm(group, 1).abort(1);
  waiting.join();
  EXPECT_NE(error.find("all_reduce: another rank failed"), std::string::npos) << error;
}

TEST(LocalComm, AllGatherCopiesTheShardIntoTheFullBuffer) {
  LocalComm c;
  std::vector<float> send{1, 2, 3}, recv(3, 0.f);
  c.all_gather(send, recv);
  EXPECT_EQ(recv, send);
  EXPECT_NE(recv.data(), send.data());
}

TEST(LocalComm, ReduceScatterCopiesThisRanksShard) {
  LocalComm c;
  std::vector<float> send{4, 5}, recv(2, 0.f);
  c.reduce_scatter(send, recv, ReduceOp::kSum);
  EXPECT_EQ(recv, send);
}

TEST(LocalComm, AllReduceAndBroadcastLeaveDataUnchanged) {
  LocalComm c;
  std::vector<float> f{1.5f, -2.f};
  std::vector<double> d{3.25};
  c.all_reduce(std::span<float>(f), ReduceOp::kSum);
  c.all_reduce(std::span<double>(d), ReduceOp::kMax);
  c.broadcast(f, 0);
  EXPECT_EQ(f, (std::vector<float>{1.5f, -2.f}));
  EXPECT_EQ(d[0], 3.25);
}

TEST(LocalComm, SizeMismatchNamesTheCollectiveAndSizes) {
  LocalComm c;
  std::vector<float> send(3), recv(4);
  try {
    c.all_gather(send, recv);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("all_gather"), std::string::npos) << msg;
    EXPECT_NE(msg.find("16 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("12 bytes"), std::string::npos) << msg;
  }
}

TEST(LocalComm, PartialOverlapIsRejected) {
  LocalComm c;
  std::vector<float> buf(8);
  EXPECT_THROW(c.reduce_scatter(std::span<const float>(buf.data(), 4),
                                std::span<float>(buf.data() + 2, 4), ReduceOp::kSum),
               InvalidArgument);
}

#ifdef OUTCORE_COMM_MPI_WORKER
using outcore::testing::run_command;
#endif

TEST(MpiComm, TwoRanksUnderMpirun) {
#ifndef OUTCORE_COMM_MPI_WORKER
  GTEST_SKIP() << "built without OpenMPI (OUTCORE_HAVE_MPI off)";
#else
  std::string probe;
  if (run_command("command -v mpirun", probe) != 0) GTEST_SKIP() << "mpirun not found";
  std::string output;
  int rc = run_command(fmt::format("timeout 120 mpirun --allow-run-as-root --oversubscribe "
                                   "-np 2 {}",
                                   OUTCORE_COMM_MPI_WORKER),
                       output);
  // mpirun that cannot start processes here (no slots, refused as root, no transport) is a
  // missing capability, not a Comm failure: the worker's start line tells them apart.
  bool started = output.find("comm_mpi_worker: rank 0 of 2 started") != std::string::npos &&
                 output.find("comm_mpi_worker: rank 1 of 2 started") != std::string::npos;
  if (!started) GTEST_SKIP() << "mpirun could not start 2 ranks (rc " << rc << "):\n" << output;
  EXPECT_EQ(rc, 0) << output;
  EXPECT_NE(output.find("comm_mpi_worker: rank 0 passed"), std::string::npos) << output;
  EXPECT_NE(output.find("comm_mpi_worker: rank 1 passed"), std::string::npos) << output;
#endif
}

}  // namespace
}  // namespace outcore::comm
