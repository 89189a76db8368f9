// aio::Engine under injected faults: each fault reaches the ticket it belongs to, with the
// right range and errno, without a hang, and leaves nothing behind. Faults wrap the default
// backend (io_uring, or sync where io_uring cannot be used) unless a test names one.
#include <gtest/gtest.h>

#include <thread>

#include "aio/aio.hpp"
#include "common/aligned_buffer.hpp"
#include "tests/aio/test_util.hpp"

namespace outcore::aio {
namespace {

using test::checksum;
using test::fill_random;
using test::TempDir;

constexpr size_t kBlock = 4096;

struct Rig {
  TempDir dir;
  File file;
  std::shared_ptr<FaultInjectingBackend> faults;
  std::unique_ptr<Engine> engine;
  AlignedBuffer data;

  Rig(Options opt, size_t bytes, bool sync = false) : data(bytes) {
    file = File::open(dir / "f.bin", kCreateRw);
    file.preallocate(bytes);
    faults = std::make_shared<FaultInjectingBackend>(sync ? make_sync_backend()
                                                          : make_default_backend());
    engine = std::make_unique<Engine>(opt, faults);
    fill_random(std::span(data.data(), bytes), 99);
  }
  std::span<std::byte> span(size_t off, size_t len) { return {data.data() + off, len}; }
};

// With one thread, requests are numbered in submission order: ticket k of 4-block spans
// holds requests 4k+1 .. 4k+4.
TEST(AioFaults, EioOnNthRequestReachesItsTicketOnly) {
  Rig rig(Options{.block_size = kBlock, .queue_depth = 4}, 20 * kBlock);
  rig.faults->add_fault({.kind = Fault::Kind::kEio, .nth = 10});
  std::vector<Ticket> tickets;
  for (int k = 0; k < 5; ++k) {
    tickets.push_back(
        rig.engine->submit_write(rig.file, k * 4 * kBlock, rig.span(k * 4 * kBlock, 4 * kBlock)));
  }
  for (int k = 0; k < 5; ++k) {
    if (k != 2) {
      EXPECT_NO_THROW(rig.engine->wait(tickets[k])) << "ticket " << k;
      continue;
    }
    try {
      rig.engine->wait(tickets[k]);
      ADD_FAILURE() << "expected IoError on ticket 2";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_number(), EIO);
      EXPECT_EQ(e.file(), rig.file.path());
      EXPECT_EQ(e.offset(), 9 * kBlock);  // request 10 = ticket 2's second block
      EXPECT_EQ(e.length(), kBlock);
      EXPECT_NE(std::string(e.what()).find("write"), std::string::npos);
    }
  }
  EXPECT_EQ(rig.faults->faults_fired(), 1u);
  EXPECT_EQ(rig.engine->stats().write.errors, 1u);
}

TEST(AioFaults, InjectedEnospcOnWriteIsReported) {
  Rig rig(Options{.block_size = kBlock, .queue_depth = 8, .thread_count = 2}, 16 * kBlock);
  rig.faults->add_fault({.kind = Fault::Kind::kEnospc, .nth = 3, .direction = 1});
  try {
    rig.engine->write(rig.file, 0, rig.span(0, 16 * kBlock));
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC);
    EXPECT_EQ(e.length(), kBlock);
    EXPECT_EQ(e.offset() % kBlock, 0u);
  }
  // Reads are not counted by a write-only fault and still work.
  AlignedBuffer in(16 * kBlock);
  rig.engine->read(rig.file, 0, std::span(in.data(), in.size()));
}

class AioShortTransfers : public ::testing::TestWithParam<bool> {};

TEST_P(AioShortTransfers, AreFinishedByResubmittingTheRest) {
  bool sync = GetParam();
  if (!sync && resolve_backend().kind != BackendKind::kIoUring) {
    GTEST_SKIP() << "io_uring is not used here: " << resolve_backend().fallback_reason;
  }
  Rig rig(Options{.block_size = 8 * kBlock, .queue_depth = 4, .thread_count = 2}, 64 * 8 * kBlock,
          sync);
  rig.faults->add_fault({.kind = Fault::Kind::kShort, .nth = 1, .every = 3});
  rig.engine->write(rig.file, 0, rig.span(0, rig.data.size()));
  AlignedBuffer in(rig.data.size());
  rig.engine->read(rig.file, 0, std::span(in.data(), in.size()));
  EXPECT_EQ(checksum(std::span(in.data(), in.size())), checksum(rig.span(0, rig.data.size())));
  Stats s = rig.engine->stats();
  EXPECT_GT(s.write.resubmits, 0u);
  EXPECT_GT(s.read.resubmits, 0u);
  EXPECT_EQ(s.write.errors + s.read.errors, 0u);
  EXPECT_EQ(s.write.bytes, rig.data.size());
  EXPECT_EQ(s.read.bytes, rig.data.size());
}

INSTANTIATE_TEST_SUITE_P(Backends, AioShortTransfers, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "sync" : "io_uring"; });

TEST(AioFaults, OddShortTransferOnBufferedFileIsFinished) {
  TempDir dir;
  OpenOptions o = kCreateRw;
  o.direct = false;
  File f = File::open(dir / "b.bin", o);
  auto faults = std::make_shared<FaultInjectingBackend>(make_default_backend());
  faults->add_fault({.kind = Fault::Kind::kShort, .nth = 1, .every = 1, .short_bytes = 1000});
  Engine engine(Options{.block_size = 4096, .queue_depth = 2}, faults);
  std::vector<std::byte> out(50000), in(50000);
  fill_random(out, 1);
  engine.write(f, 3, out);
  faults->clear_faults();
  engine.read(f, 3, in);
  EXPECT_EQ(checksum(in), checksum(out));
}

TEST(AioFaults, ZeroByteReadIsEndOfFile) {
  Rig rig(Options{.block_size = kBlock, .queue_depth = 2}, 8 * kBlock);
  rig.faults->add_fault({.kind = Fault::Kind::kZero, .nth = 5, .direction = 0});
  try {
    rig.engine->read(rig.file, 0, rig.span(0, 8 * kBlock));
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.offset(), 4 * kBlock);
    EXPECT_NE(std::string(e.what()).find("end of file"), std::string::npos);
  }
}

TEST(AioFaults, DelayedCompletionsArriveOutOfOrderAndDataIsIntact) {
  for (bool overlap : {true, false}) {
    Rig rig(Options{.block_size = kBlock, .queue_depth = 8, .overlap_events = overlap},
            64 * kBlock);
    rig.faults->add_fault({.kind = Fault::Kind::kDelay,
                           .nth = 2,
                           .every = 5,
                           .delay = std::chrono::microseconds(3000)});
    std::vector<Ticket> tickets;
    for (int k = 0; k < 16; ++k) {
      tickets.push_back(
          rig.engine->submit_write(rig.file, k * 4 * kBlock, rig.span(k * 4 * kBlock, 4 * kBlock)));
    }
    for (Ticket t : tickets) rig.engine->wait(t);
    AlignedBuffer in(64 * kBlock);
    rig.engine->read(rig.file, 0, std::span(in.data(), in.size()));
    EXPECT_EQ(checksum(std::span(in.data(), in.size())), checksum(rig.span(0, 64 * kBlock)));
    EXPECT_GT(rig.faults->faults_fired(), 5u);
  }
}

// Many tickets from several threads over several I/O threads, every 7th request failing:
// each ticket either succeeds with correct data or fails inside its own range.
TEST(AioFaults, ManyThreadsEveryFailureStaysWithItsTicketAndNothingLeaks) {
  int fds_before = test::open_fd_count();
  {
    constexpr int kThreads = 4, kPerThread = 30;
    constexpr size_t kSpan = 6 * kBlock;
    Rig rig(Options{.block_size = kBlock, .queue_depth = 8, .thread_count = 3},
            kThreads * kPerThread * kSpan);
    rig.faults->add_fault({.kind = Fault::Kind::kEio, .nth = 7, .every = 7});
    rig.faults->add_fault({.kind = Fault::Kind::kShort, .nth = 2, .every = 11});
    rig.faults->add_fault({.kind = Fault::Kind::kDelay,
                           .nth = 3,
                           .every = 13,
                           .delay = std::chrono::microseconds(500)});
    std::atomic<int> failed{0}, misplaced{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::vector<std::pair<Ticket, size_t>> tickets;
        for (int i = 0; i < kPerThread; ++i) {
          size_t off = (size_t(t) * kPerThread + i) * kSpan;
          tickets.emplace_back(rig.engine->submit_write(rig.file, off, rig.span(off, kSpan)), off);
        }
        for (auto [ticket, off] : tickets) {
          try {
            rig.engine->wait(ticket);
          } catch (const IoError& e) {
            ++failed;
            if (e.offset() < off || e.offset() + e.length() > off + kSpan ||
                e.error_number() != EIO) {
              ++misplaced;
            }
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_GT(failed.load(), 0);
    EXPECT_EQ(misplaced.load(), 0);
    Stats s = rig.engine->stats();
    EXPECT_EQ(s.write.tickets, uint64_t{kThreads * kPerThread});
    EXPECT_GE(s.write.errors, uint64_t(failed.load()));  // a ticket may fail in several slices
    // After the faults are gone the same engine works.
    rig.faults->clear_faults();
    rig.engine->write(rig.file, 0, rig.span(0, rig.data.size()));
    AlignedBuffer in(rig.data.size());
    rig.engine->read(rig.file, 0, std::span(in.data(), in.size()));
    EXPECT_EQ(checksum(std::span(in.data(), in.size())), checksum(rig.span(0, rig.data.size())));
  }
  EXPECT_EQ(test::open_fd_count(), fds_before);  // rings and files all closed
}

TEST(AioFaults, WaitAllReportsTheEarliestFailureAndCountsTheOthers) {
  Rig rig(Options{.block_size = kBlock, .queue_depth = 4}, 12 * kBlock);
  rig.faults->add_fault({.kind = Fault::Kind::kEio, .nth = 5});
  rig.faults->add_fault({.kind = Fault::Kind::kEio, .nth = 9});
  std::vector<Ticket> tickets;
  for (int k = 0; k < 3; ++k) {
    tickets.push_back(
        rig.engine->submit_read(rig.file, k * 4 * kBlock, rig.span(k * 4 * kBlock, 4 * kBlock)));
  }
  try {
    rig.engine->wait_all();
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.offset(), 4 * kBlock);
    EXPECT_NE(std::string(e.what()).find("1 more failed"), std::string::npos) << e.what();
  }
  for (Ticket t : tickets) EXPECT_THROW(rig.engine->wait(t), InvalidArgument);
  rig.engine->wait_all();
}

TEST(AioFaults, EngineDestroyedWithUnwaitedFailuresDoesNotHang) {
  Rig rig(Options{.block_size = kBlock, .queue_depth = 4, .thread_count = 2}, 32 * kBlock);
  rig.faults->add_fault({.kind = Fault::Kind::kEio, .nth = 1, .every = 2});
  for (int k = 0; k < 8; ++k) {
    rig.engine->submit_write(rig.file, k * 4 * kBlock, rig.span(k * 4 * kBlock, 4 * kBlock));
  }
  rig.engine.reset();  // logs the failures, returns once everything completed
  SUCCEED();
}

}  // namespace
}  // namespace outcore::aio
