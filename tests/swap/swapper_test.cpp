// Swapper: round trips of many sizes, concurrent swaps, CRC32C catching a flipped byte (and
// the switch that turns it off), misuse, and injected I/O errors.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <thread>

#include "swap/swap.hpp"
#include "tests/swap/test_util.hpp"

namespace outcore::swap {
namespace {

using test::TempDir;

const std::vector<uint64_t> kSizes = {
    1,      3,           4095, 4096, 4097, 65536 + 5, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 12345,
    200000, 8 * 4096 - 1};

std::vector<SwapFileSpec> sized_plan(const std::vector<uint64_t>& sizes) {
  SwapFileSpec f{.unit = 2, .kind = SwapKind::kParam, .tensors = {}};
  for (size_t i = 0; i < sizes.size(); ++i) f.tensors.push_back({fmt::format("t{}", i), sizes[i]});
  return {f};
}

// A swap space + engine (+ optional fault injection) + swapper over `plan`.
struct Rig {
  TempDir dir;
  std::shared_ptr<aio::FaultInjectingBackend> faults;
  std::unique_ptr<SwapSpace> space;
  std::unique_ptr<aio::Engine> engine;
  std::unique_ptr<Swapper> swapper;

  Rig(std::vector<SwapFileSpec> plan, SwapperOptions so = {}, unsigned threads = 2) {
    space = std::make_unique<SwapSpace>(SwapSpaceOptions{.nvme_path = dir.path()}, plan);
    faults = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
    engine = std::make_unique<aio::Engine>(
        aio::Options{.block_size = 256 * 1024, .queue_depth = 16, .thread_count = threads}, faults);
    swapper = std::make_unique<Swapper>(*space, *engine, so);
  }
};

TEST(Swapper, RoundTripsManySizes) {
  for (bool verify : {true, false}) {
    Rig rig(sized_plan(kSizes), {.verify_checksums = verify, .checksum_block_bytes = 64 * 1024});
    std::vector<AlignedBuffer> out, in;
    std::vector<SwapTicket> tickets;
    for (size_t i = 0; i < kSizes.size(); ++i) {
      out.emplace_back(kSizes[i]);
      test::fill_random({out[i].data(), kSizes[i]}, 100 + i);
      tickets.push_back(
          rig.swapper->swap_out({2, SwapKind::kParam, uint32_t(i)}, {out[i].data(), kSizes[i]}));
    }
    for (SwapTicket t : tickets) rig.swapper->wait(t);
    tickets.clear();
    for (size_t i = 0; i < kSizes.size(); ++i) {
      in.emplace_back(kSizes[i]);
      tickets.push_back(
          rig.swapper->swap_in({2, SwapKind::kParam, uint32_t(i)}, {in[i].data(), kSizes[i]}));
    }
    for (size_t i = 0; i < kSizes.size(); ++i) {
      rig.swapper->wait(tickets[i]);
      ASSERT_EQ(std::memcmp(in[i].data(), out[i].data(), kSizes[i]), 0)
          << "size " << kSizes[i] << " verify " << verify;
    }
    SwapperStats s = rig.swapper->stats();
    EXPECT_EQ(s.swaps_in, kSizes.size());
    EXPECT_EQ(s.swaps_out, kSizes.size());
    EXPECT_EQ(s.checksum_seconds > 0, verify);
  }
}

TEST(Swapper, OverwriteReplacesDataAndChecksums) {
  Rig rig(sized_plan({300000}));
  TensorId id{2, SwapKind::kParam, 0};
  AlignedBuffer a(300000), b(300000), in(300000);
  test::fill_random({a.data(), a.size()}, 1);
  test::fill_random({b.data(), b.size()}, 2);
  rig.swapper->write(id, {a.data(), a.size()});
  rig.swapper->write(id, {b.data(), b.size()});
  rig.swapper->read(id, {in.data(), in.size()});
  EXPECT_EQ(std::memcmp(in.data(), b.data(), b.size()), 0);
}

TEST(Swapper, ConcurrentSwapsFromManyThreads) {
  constexpr int kThreads = 6, kPerThread = 4, kRounds = 5;
  std::vector<uint64_t> sizes;
  for (int i = 0; i < kThreads * kPerThread; ++i) sizes.push_back(50000 + 37777 * i);
  Rig rig(sized_plan(sizes), {.checksum_block_bytes = 16384}, 3);
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        std::vector<AlignedBuffer> out, in;
        std::vector<SwapTicket> tk;
        for (int i = 0; i < kPerThread; ++i) {
          uint32_t idx = t * kPerThread + i;
          out.emplace_back(sizes[idx]);
          test::fill_random({out.back().data(), sizes[idx]}, idx * 1000 + r);
          tk.push_back(
              rig.swapper->swap_out({2, SwapKind::kParam, idx}, {out.back().data(), sizes[idx]}));
        }
        for (SwapTicket x : tk) rig.swapper->wait(x);
        tk.clear();
        for (int i = 0; i < kPerThread; ++i) {
          uint32_t idx = t * kPerThread + i;
          in.emplace_back(sizes[idx]);
          tk.push_back(
              rig.swapper->swap_in({2, SwapKind::kParam, idx}, {in.back().data(), sizes[idx]}));
        }
        for (int i = 0; i < kPerThread; ++i) {
          rig.swapper->wait(tk[i]);
          if (std::memcmp(in[i].data(), out[i].data(), out[i].size()) != 0) ++mismatches;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(rig.swapper->stats().swaps_in, uint64_t(kThreads * kPerThread * kRounds));
}

TEST(Swapper, FlippedByteIsCorruptDataNamingFileAndOffset) {
  const uint64_t bytes = 1'000'000;
  Rig rig(sized_plan({5000, bytes}), {.checksum_block_bytes = 64 * 1024});
  TensorId id{2, SwapKind::kParam, 1};
  AlignedBuffer out(bytes), in(bytes);
  test::fill_random({out.data(), bytes}, 9);
  rig.swapper->write(id, {out.data(), bytes});
  const TensorInfo& info = rig.space->info(id);
  const uint64_t flip_at = 3 * 65536 + 1234;  // inside block 3 of the tensor
  test::flip_byte(rig.space->file_path(2, SwapKind::kParam), info.offset + flip_at);
  try {
    rig.swapper->read(id, {in.data(), bytes});
    FAIL() << "expected CorruptData";
  } catch (const CorruptData& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(rig.space->file_path(2, SwapKind::kParam).string()), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("offset " + std::to_string(info.offset + 3 * 65536) + " "),
              std::string::npos)
        << msg;
  }
  // The tensor is still readable with checksums off: the switch really skips verification.
  aio::Engine engine({.block_size = 256 * 1024});
  Swapper unchecked(*rig.space, engine, {.verify_checksums = false});
  unchecked.write(id, {out.data(), bytes});
  test::flip_byte(rig.space->file_path(2, SwapKind::kParam), info.offset + flip_at);
  EXPECT_NO_THROW(unchecked.read(id, {in.data(), bytes}));
  EXPECT_NE(std::memcmp(in.data(), out.data(), bytes), 0);
  EXPECT_EQ(static_cast<uint8_t>(in.data()[flip_at]) ^ static_cast<uint8_t>(out.data()[flip_at]),
            1);
}

TEST(Swapper, FlippedByteInTheLastShortBlockIsCaught) {
  const uint64_t bytes = 4096 * 3 + 100;  // last block is 100 bytes of a 4 KiB slot
  Rig rig(sized_plan({bytes}), {.checksum_block_bytes = 4096});
  TensorId id{2, SwapKind::kParam, 0};
  AlignedBuffer out(bytes), in(bytes);
  test::fill_random({out.data(), bytes}, 3);
  rig.swapper->write(id, {out.data(), bytes});
  test::flip_byte(rig.space->file_path(2, SwapKind::kParam),
                  rig.space->info(id).offset + bytes - 1);
  EXPECT_THROW(rig.swapper->read(id, {in.data(), bytes}), CorruptData);
}

TEST(Swapper, MisuseIsInvalidArgument) {
  Rig rig(sized_plan({8192, 100}));
  TensorId id{2, SwapKind::kParam, 0};
  AlignedBuffer buf(8192 + 4096);
  EXPECT_THROW(rig.swapper->swap_in(id, {buf.data(), 8192}), InvalidArgument);       // no data yet
  EXPECT_THROW(rig.swapper->swap_out(id, {buf.data(), 4096}), InvalidArgument);      // wrong size
  EXPECT_THROW(rig.swapper->swap_out(id, {buf.data() + 8, 8192}), InvalidArgument);  // aligned?
  EXPECT_THROW(rig.swapper->swap_out({2, SwapKind::kGrad, 0}, {buf.data(), 8192}), InvalidArgument);
  EXPECT_THROW(rig.swapper->wait(SwapTicket()), InvalidArgument);
  EXPECT_FALSE(rig.swapper->has_data(id));

  // A second operation on a tensor with a write in flight is refused (the write is delayed so
  // it is certainly still in flight).
  rig.faults->add_fault({.kind = aio::Fault::Kind::kDelay,
                         .nth = 1,
                         .every = 1,
                         .delay = std::chrono::microseconds(200'000)});
  SwapTicket w = rig.swapper->swap_out(id, {buf.data(), 8192});
  EXPECT_THROW(rig.swapper->swap_out(id, {buf.data(), 8192}), InvalidArgument);
  EXPECT_THROW(rig.swapper->swap_in(id, {buf.data(), 8192}), InvalidArgument);
  rig.swapper->wait(w);
  EXPECT_THROW(rig.swapper->wait(w), InvalidArgument);  // already waited
  rig.faults->clear_faults();
  EXPECT_TRUE(rig.swapper->has_data(id));
  SwapTicket r1 = rig.swapper->swap_in(id, {buf.data(), 8192});
  AlignedBuffer other(8192);
  SwapTicket r2 = rig.swapper->swap_in(id, {other.data(), 8192});  // two readers are fine
  rig.swapper->wait(r1);
  rig.swapper->wait(r2);
}

TEST(Swapper, FailedWriteLeavesTheTensorWithoutData) {
  Rig rig(sized_plan({100000}));
  TensorId id{2, SwapKind::kParam, 0};
  AlignedBuffer buf(100000);
  rig.swapper->write(id, {buf.data(), buf.size()});
  rig.faults->add_fault({.kind = aio::Fault::Kind::kEio, .nth = 2, .direction = 1});  // 2nd write
  try {
    rig.swapper->write(id, {buf.data(), buf.size()});
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), EIO);
    EXPECT_NE(std::string(e.what()).find("param/2.bin"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(rig.swapper->has_data(id));
  EXPECT_THROW(rig.swapper->swap_in(id, {buf.data(), buf.size()}), InvalidArgument);
  rig.swapper->write(id, {buf.data(), buf.size()});  // a new write makes it readable again
  EXPECT_NO_THROW(rig.swapper->read(id, {buf.data(), buf.size()}));
}

TEST(Swapper, ReadErrorIsIoErrorAndDataSurvives) {
  Rig rig(sized_plan({100000}));
  TensorId id{2, SwapKind::kParam, 0};
  AlignedBuffer out(100000), in(100000);
  test::fill_random({out.data(), out.size()}, 5);
  rig.swapper->write(id, {out.data(), out.size()});
  rig.faults->add_fault({.kind = aio::Fault::Kind::kEio, .nth = 1, .direction = 0});
  EXPECT_THROW(rig.swapper->read(id, {in.data(), in.size()}), IoError);
  rig.swapper->read(id, {in.data(), in.size()});
  EXPECT_EQ(std::memcmp(in.data(), out.data(), out.size()), 0);
}

TEST(Swapper, ShortTransfersAreCompletedNotCorrupted) {
  Rig rig(sized_plan({1 << 20}));
  TensorId id{2, SwapKind::kParam, 0};
  AlignedBuffer out(1 << 20), in(1 << 20);
  test::fill_random({out.data(), out.size()}, 6);
  rig.faults->add_fault({.kind = aio::Fault::Kind::kShort, .nth = 1, .every = 2});
  rig.swapper->write(id, {out.data(), out.size()});
  rig.swapper->read(id, {in.data(), in.size()});
  EXPECT_EQ(std::memcmp(in.data(), out.data(), out.size()), 0);
  EXPECT_GT(rig.faults->faults_fired(), 0u);
}

}  // namespace
}  // namespace outcore::swap
