// aio::Engine on the real io_uring backend (and the sync reference): round trips, concurrency,
// alignment rules, tickets, end of file, ENOSPC, registration and stats.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "aio/aio.hpp"
#include "common/aligned_buffer.hpp"
#include "tests/aio/test_util.hpp"

namespace outcore::aio {
namespace {

using test::checksum;
using test::fill_random;
using test::TempDir;

struct Config {
  const char* name;
  Options opt;
  bool sync_backend = false;
};

std::shared_ptr<IoBackend> backend_for(const Config& c) {
  return c.sync_backend ? std::shared_ptr<IoBackend>(make_sync_backend()) : nullptr;
}

class AioRoundTrip : public ::testing::TestWithParam<Config> {};

// Random aligned spans written at random offsets, read back into another buffer.
TEST_P(AioRoundTrip, RandomSizesAndOffsetsSurviveWriteThenRead) {
  TempDir dir;
  File f = File::open(dir / "data.bin", kCreateRw);
  constexpr size_t kFile = 8 << 20;
  f.preallocate(kFile);
  Engine engine(GetParam().opt, backend_for(GetParam()));
  AlignedBuffer out(kFile), in(kFile);
  std::mt19937_64 rng(42);
  for (int iter = 0; iter < 24; ++iter) {
    size_t pages = 1 + rng() % 600;
    size_t len = pages * kIoAlignment;
    size_t off = (rng() % (kFile / kIoAlignment - pages + 1)) * kIoAlignment;
    auto src = std::span(out.data(), len);
    auto dst = std::span(in.data(), len);
    fill_random(src, rng());
    std::memset(dst.data(), 0, len);
    engine.write(f, off, src);
    Ticket t = engine.submit_read(f, off, dst);
    engine.wait(t);
    ASSERT_EQ(checksum(dst), checksum(src)) << "iteration " << iter << " offset " << off;
  }
  Stats s = engine.stats();
  EXPECT_EQ(s.read.errors + s.write.errors, 0u);
  EXPECT_EQ(s.read.tickets, 24u);
  EXPECT_EQ(s.write.tickets, 24u);
  EXPECT_EQ(s.read.bytes, s.write.bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Options, AioRoundTrip,
    ::testing::Values(Config{"defaults", Options{}},
                      Config{"small_blocks_qd32", Options{.block_size = 4096, .queue_depth = 32}},
                      Config{"qd1", Options{.block_size = 65536, .queue_depth = 1}},
                      Config{"threads3",
                             Options{.block_size = 65536, .queue_depth = 4, .thread_count = 3}},
                      Config{"single_submit",
                             Options{.block_size = 16384, .queue_depth = 8, .single_submit = true}},
                      Config{"batches", Options{.block_size = 16384,
                                                .queue_depth = 8,
                                                .thread_count = 2,
                                                .overlap_events = false}},
                      Config{"sync_backend", Options{.block_size = 65536, .queue_depth = 8}, true}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(AioEngine, BufferedFileAcceptsAnyAlignment) {
  TempDir dir;
  OpenOptions o = kCreateRw;
  o.direct = false;
  File f = File::open(dir / "b.bin", o);
  Engine engine(Options{.block_size = 8192, .queue_depth = 4, .thread_count = 2});
  std::vector<std::byte> out(100003), in(100003);
  fill_random(out, 9);
  engine.write(f, 777, std::span(out).subspan(1));
  engine.read(f, 777, std::span(in).subspan(1));
  EXPECT_EQ(checksum(std::span(in).subspan(1)), checksum(std::span(out).subspan(1)));
}

TEST(AioEngine, ZeroLengthCompletesAtOnce) {
  TempDir dir;
  File f = File::open(dir / "z.bin", kCreateRw);
  Engine engine(Options{});
  Ticket t = engine.submit_read(f, 0, {});
  EXPECT_TRUE(engine.is_done(t));
  engine.wait(t);
}

TEST(AioEngine, MisalignedDirectRequestsAreRefusedAndNothingIsQueued) {
  TempDir dir;
  File f = File::open(dir / "m.bin", kCreateRw);
  if (!f.direct()) GTEST_SKIP() << "O_DIRECT not available on the build tree's filesystem";
  f.preallocate(1 << 20);
  Engine engine(Options{});
  AlignedBuffer buf(1 << 16);
  auto aligned = std::span(buf.data(), 8192);
  struct Case {
    uint64_t offset;
    std::span<std::byte> span;
  };
  for (Case c : {Case{512, aligned}, Case{0, std::span(buf.data(), 1000)},
                 Case{0, std::span(buf.data() + 8, 4096)}}) {
    try {
      engine.submit_read(f, c.offset, c.span);
      ADD_FAILURE() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(f.path()), std::string::npos) << msg;
      EXPECT_NE(msg.find("4096"), std::string::npos) << msg;
      EXPECT_NE(msg.find("offset " + std::to_string(c.offset)), std::string::npos) << msg;
    }
    EXPECT_THROW(engine.submit_write(f, c.offset, c.span), InvalidArgument);
  }
  engine.wait_all();
  EXPECT_EQ(engine.stats().read.requests + engine.stats().write.requests, 0u);
}

TEST(AioEngine, ClosedFileIsRefused) {
  File closed;
  Engine engine(Options{});
  AlignedBuffer buf(4096);
  EXPECT_THROW(engine.submit_read(closed, 0, std::span(buf.data(), 4096)), InvalidArgument);
}

TEST(AioEngine, InvalidAndAlreadyWaitedTicketsAreRefused) {
  TempDir dir;
  File f = File::open(dir / "t.bin", kCreateRw);
  f.preallocate(4096);
  Engine engine(Options{});
  AlignedBuffer buf(4096);
  EXPECT_THROW(engine.wait(Ticket{}), InvalidArgument);
  Ticket t = engine.submit_read(f, 0, std::span(buf.data(), 4096));
  engine.wait(t);
  EXPECT_THROW(engine.wait(t), InvalidArgument);
  EXPECT_THROW(engine.is_done(t), InvalidArgument);
  // The slot is reused by the next ticket; the stale one stays invalid.
  Ticket u = engine.submit_read(f, 0, std::span(buf.data(), 4096));
  EXPECT_NE(u, t);
  EXPECT_THROW(engine.wait(t), InvalidArgument);
  engine.wait(u);
}

TEST(AioEngine, ReadPastEndOfFileNamesTheMissingRange) {
  TempDir dir;
  File f = File::open(dir / "short.bin", kCreateRw);
  f.preallocate(8192);
  Engine engine(Options{.block_size = 4096});
  AlignedBuffer buf(16384);
  try {
    engine.read(f, 0, std::span(buf.data(), 16384));
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.file(), f.path());
    EXPECT_EQ(e.offset(), 8192u);
    EXPECT_EQ(e.length(), 4096u);
    EXPECT_EQ(e.error_number(), EIO);
    EXPECT_NE(std::string(e.what()).find("end of file"), std::string::npos) << e.what();
  }
}

TEST(AioEngine, WriteToFullDeviceReportsEnospc) {
  // /dev/full fails every write with ENOSPC: a real full "disk" without filling one.
  File f;
  try {
    f = File::open("/dev/full", {.access = Access::kWrite});
  } catch (const IoError& e) {
    GTEST_SKIP() << "cannot open /dev/full: " << e.what();
  }
  Engine engine(Options{.block_size = 4096, .queue_depth = 4});
  AlignedBuffer buf(3 * 4096);
  Ticket t = engine.submit_write(f, 0, std::span<const std::byte>(buf.data(), buf.size()));
  try {
    engine.wait(t);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC);
    EXPECT_EQ(e.file(), "/dev/full");
    EXPECT_EQ(e.offset(), 0u);
    EXPECT_EQ(e.length(), 4096u);
  }
}

TEST(AioEngine, ConcurrentTicketsFromSeveralThreads) {
  TempDir dir;
  File f = File::open(dir / "c.bin", kCreateRw);
  constexpr int kThreads = 4;
  constexpr int kPerThread = 40;
  constexpr size_t kChunk = 64 << 10;
  f.preallocate(kThreads * kPerThread * kChunk);
  Engine engine(Options{.block_size = 16384, .queue_depth = 16, .thread_count = 3});
  AlignedBuffer out(kThreads * kPerThread * kChunk), in(out.size());
  fill_random(std::span(out.data(), out.size()), 5);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<Ticket> tickets;
      for (int i = 0; i < kPerThread; ++i) {
        size_t off = (size_t(t) * kPerThread + i) * kChunk;
        tickets.push_back(
            engine.submit_write(f, off, std::span<const std::byte>(out.data() + off, kChunk)));
      }
      for (Ticket k : tickets) engine.wait(k);
      tickets.clear();
      for (int i = kPerThread - 1; i >= 0; --i) {
        size_t off = (size_t(t) * kPerThread + i) * kChunk;
        tickets.push_back(engine.submit_read(f, off, std::span(in.data() + off, kChunk)));
      }
      for (Ticket k : tickets) {
        if (!engine.is_done(k)) std::this_thread::yield();
        engine.wait(k);
      }
      for (int i = 0; i < kPerThread; ++i) {
        size_t off = (size_t(t) * kPerThread + i) * kChunk;
        if (std::memcmp(in.data() + off, out.data() + off, kChunk) != 0) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  Stats s = engine.stats();
  EXPECT_EQ(s.write.tickets, uint64_t{kThreads * kPerThread});
  EXPECT_EQ(s.read.bytes, out.size());
}

TEST(AioEngine, WaitAllConsumesEveryOutstandingTicket) {
  TempDir dir;
  File f = File::open(dir / "w.bin", kCreateRw);
  f.preallocate(1 << 20);
  Engine engine(Options{.block_size = 65536, .queue_depth = 4, .thread_count = 2});
  AlignedBuffer buf(1 << 20);
  std::vector<Ticket> tickets;
  for (int i = 0; i < 16; ++i) {
    tickets.push_back(engine.submit_read(f, i * 65536, std::span(buf.data() + i * 65536, 65536)));
  }
  engine.wait_all();
  for (Ticket t : tickets) EXPECT_THROW(engine.wait(t), InvalidArgument);
  engine.wait_all();  // nothing outstanding
}

// A backend whose requests complete only when the test allows it, logging the direction of
// each request as it is prepared ('r' / 'w'); transfers are done with pread/pwrite at
// completion time.
struct GatedBackend final : IoBackend {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::string log;       // GUARDED_BY(mu)
    uint64_t permits = 0;  // completions still allowed, GUARDED_BY(mu)
  };
  struct Queue final : IoQueue {
    explicit Queue(std::shared_ptr<State> st) : st_(std::move(st)) {}
    bool prepare(const IoRequest& r) override {
      std::lock_guard lock(st_->mu);
      st_->log.push_back(r.write ? 'w' : 'r');
      submitted_.push_back(r);
      ++unsubmitted_;
      st_->cv.notify_all();
      return true;
    }
    int submit() override { return std::exchange(unsubmitted_, 0); }
    int reap(std::span<IoCompletion> out, std::chrono::nanoseconds) override {
      std::unique_lock lock(st_->mu);
      st_->cv.wait(lock, [&] { return st_->permits > 0; });
      size_t n = std::min<size_t>({out.size(), submitted_.size(), st_->permits});
      for (size_t i = 0; i < n; ++i) {
        const IoRequest& r = submitted_[i];
        ssize_t rc = r.write ? ::pwrite(r.fd, r.buf, r.len, static_cast<off_t>(r.offset))
                             : ::pread(r.fd, r.buf, r.len, static_cast<off_t>(r.offset));
        out[i] = {r.user_data, rc < 0 ? -errno : static_cast<int32_t>(rc)};
      }
      submitted_.erase(submitted_.begin(), submitted_.begin() + static_cast<std::ptrdiff_t>(n));
      st_->permits -= n;
      return static_cast<int>(n);
    }
    std::shared_ptr<State> st_;
    std::vector<IoRequest> submitted_;
    int unsubmitted_ = 0;
  };
  std::unique_ptr<IoQueue> make_queue(unsigned) override { return std::make_unique<Queue>(st); }
  std::string name() const override { return "gated"; }
  std::shared_ptr<State> st = std::make_shared<State>();
};

// A read queued behind a long write shares the queue with it: once a request completes, the
// thread issues the read's requests alongside the write's remaining ones instead of after them.
TEST(AioEngine, ReadQueuedBehindALongWriteIsIssuedBeforeTheWriteEnds) {
  constexpr size_t kBlock = 4096;
  TempDir dir;
  File f = File::open(dir / "rw.bin", kCreateRw);
  f.preallocate(32 * kBlock);
  AlignedBuffer out(16 * kBlock), in(2 * kBlock), want(2 * kBlock);
  fill_random(std::span(out.data(), out.size()), 5);
  fill_random(std::span(want.data(), want.size()), 6);
  {
    Engine plain(Options{.block_size = kBlock});
    plain.write(f, 16 * kBlock, std::span<const std::byte>(want.data(), want.size()));
  }
  auto backend = std::make_shared<GatedBackend>();
  auto st = backend->st;
  Engine engine(Options{.block_size = kBlock, .queue_depth = 4, .thread_count = 1}, backend);
  Ticket w = engine.submit_write(f, 0, std::span<const std::byte>(out.data(), out.size()));
  {
    std::unique_lock lock(st->mu);
    st->cv.wait(lock, [&] { return st->log.size() == 4; });  // the queue is full of writes
  }
  Ticket r = engine.submit_read(f, 16 * kBlock, std::span(in.data(), in.size()));
  {
    std::lock_guard lock(st->mu);
    st->permits = 1000;
  }
  st->cv.notify_all();
  engine.wait(r);
  engine.wait(w);
  const std::string log = [&] {
    std::lock_guard lock(st->mu);
    return st->log;
  }();
  ASSERT_EQ(log.size(), 18u) << log;
  EXPECT_LT(log.find('r'), log.rfind('w')) << log;  // FIFO issue order would give 16 w, then r
  EXPECT_EQ(checksum(std::span(in.data(), in.size())),
            checksum(std::span(want.data(), want.size())));
}

TEST(AioEngine, DestructorWaitsForRequestsInFlight) {
  TempDir dir;
  File f = File::open(dir / "d.bin", kCreateRw);
  f.preallocate(4 << 20);
  AlignedBuffer buf(4 << 20);
  fill_random(std::span(buf.data(), buf.size()), 11);
  {
    Engine engine(Options{.block_size = 65536, .queue_depth = 8});
    engine.submit_write(f, 0, std::span<const std::byte>(buf.data(), buf.size()));
  }  // must not return before the write is done
  AlignedBuffer in(4 << 20);
  Engine engine(Options{});
  engine.read(f, 0, std::span(in.data(), in.size()));
  EXPECT_EQ(checksum(std::span(in.data(), in.size())), checksum(std::span(buf.data(), buf.size())));
}

TEST(AioEngine, RegisteredBuffersAndFilesRoundTrip) {
  TempDir dir;
  File f = File::open(dir / "r.bin", kCreateRw);
  f.preallocate(2 << 20);
  Engine engine(Options{.block_size = 65536, .queue_depth = 8, .thread_count = 2});
  AlignedBuffer pool(2 << 20);
  std::span<std::byte> bufs[] = {std::span(pool.data(), pool.size())};
  if (!engine.register_buffers(bufs)) GTEST_SKIP() << "the kernel refused to register buffers";
  EXPECT_TRUE(engine.stats().registered_buffers);
  EXPECT_TRUE(engine.register_file(f));
  AlignedBuffer unregistered(1 << 20);
  fill_random(std::span(pool.data(), 1 << 20), 21);
  engine.write(f, 0, std::span<const std::byte>(pool.data(), 1 << 20));
  engine.read(f, 0, std::span(pool.data() + (1 << 20), 1 << 20));  // fixed buffer
  engine.read(f, 0, std::span(unregistered.data(), 1 << 20));      // plain buffer
  uint64_t want = checksum(std::span(pool.data(), 1 << 20));
  EXPECT_EQ(checksum(std::span(pool.data() + (1 << 20), 1 << 20)), want);
  EXPECT_EQ(checksum(std::span(unregistered.data(), 1 << 20)), want);
  engine.unregister_file(f);
  engine.unregister_buffers();
  EXPECT_FALSE(engine.stats().registered_buffers);
  engine.read(f, 0, std::span(unregistered.data(), 1 << 20));
  EXPECT_EQ(checksum(std::span(unregistered.data(), 1 << 20)), want);
}

TEST(AioEngine, StatsCountRequestsBytesAndLatencyPerDirection) {
  TempDir dir;
  File f = File::open(dir / "s.bin", kCreateRw);
  Engine engine(Options{.block_size = 65536, .queue_depth = 4});
  AlignedBuffer buf(10 * 65536);
  engine.write(f, 0, std::span<const std::byte>(buf.data(), buf.size()));
  engine.read(f, 0, std::span(buf.data(), 3 * 65536));
  Stats s = engine.stats();
  EXPECT_EQ(s.backend, resolve_backend().name());  // io_uring unless the kernel refuses it
  EXPECT_EQ(s.write.requests, 10u);
  EXPECT_EQ(s.write.bytes, 10u * 65536);
  EXPECT_EQ(s.write.latency.count(), 10u);
  EXPECT_EQ(s.write.tickets, 1u);
  EXPECT_EQ(s.read.requests, 3u);
  EXPECT_EQ(s.read.bytes, 3u * 65536);
  EXPECT_EQ(s.read.latency.count(), 3u);
  EXPECT_GE(s.write.latency.percentile_us(0.99), s.write.latency.percentile_us(0.5));
  engine.reset_stats();
  s = engine.stats();
  EXPECT_EQ(s.write.requests + s.read.requests + s.read.tickets + s.read.latency.count(), 0u);
}

TEST(AioEngine, BadOptionsNameTheField) {
  auto message = [](Options o) {
    try {
      Engine e(o);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({.block_size = 1000}).find("aio.block_size"), std::string::npos);
  EXPECT_NE(message({.queue_depth = 0}).find("aio.queue_depth"), std::string::npos);
  EXPECT_NE(message({.thread_count = 0}).find("aio.thread_count"), std::string::npos);
}

}  // namespace
}  // namespace outcore::aio
