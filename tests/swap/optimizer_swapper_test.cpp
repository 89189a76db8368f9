// OptimizerSwapper: the NVMe-streamed step is bit-identical to cpu_adam in memory (several
// steps, sub-group sizes that do not divide the unit, every pipeline mode and buffer count);
// the pool budget holds; an injected EIO or a corrupt block fails the step, uncounted; misuse.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "common/error.hpp"
#include "swap/swap.hpp"
#include "tests/swap/test_util.hpp"

namespace outcore::swap {
namespace {

using test::TempDir;

cpu_adam::AdamParams hyper(uint64_t step) {
  cpu_adam::AdamParams hp;
  hp.lr = 1e-2;
  hp.weight_decay = 0.01;
  hp.step = step;
  hp.grad_scale = 1.0 / 1024;  // gradients arrive scaled by a loss scale of 1024
  return hp;
}

// In-memory reference: the same cpu_adam step over the whole unit.
struct Reference {
  std::vector<float> master, m, v;
  explicit Reference(std::vector<float> init)
      : master(std::move(init)), m(master.size(), 0.0f), v(master.size(), 0.0f) {}
  std::vector<uint16_t> step(const std::vector<float>& g, const cpu_adam::AdamParams& hp,
                             DType dt) {
    std::vector<uint16_t> out(master.size());
    cpu_adam::adam_step(hp, master.size(), master.data(), {g.data(), DType::F32}, m.data(),
                        v.data(), {out.data(), dt});
    return out;
  }
};

struct OptimizerRig {
  TempDir dir;
  std::shared_ptr<aio::FaultInjectingBackend> faults;
  std::unique_ptr<SwapSpace> space;
  std::unique_ptr<aio::Engine> engine;
  std::unique_ptr<Swapper> swapper;
  std::unique_ptr<PinnedPool> pool;
  std::unique_ptr<OptimizerSwapper> opt;

  OptimizerRig(std::vector<std::pair<uint32_t, uint64_t>> units, OptimizerSwapperOptions oo,
               size_t pool_bytes = 64 << 20, const cpu_adam::Executor* ex = nullptr) {
    std::vector<SwapFileSpec> plan;
    for (auto [u, n] : units)
      plan.push_back(
          optimizer_file_spec(u, n, oo.sub_group_size, oo.moments, oo.spare_copy ? 2 : 1));
    space = std::make_unique<SwapSpace>(SwapSpaceOptions{.nvme_path = dir.path()}, plan);
    faults = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
    // One request per sub-group read/write in these tests (block_size >= every sub-group).
    engine = std::make_unique<aio::Engine>(
        aio::Options{.block_size = 4 << 20, .queue_depth = 8, .thread_count = 1}, faults);
    swapper = std::make_unique<Swapper>(*space, *engine,
                                        SwapperOptions{.checksum_block_bytes = 16384}, ex);
    pool = std::make_unique<PinnedPool>(PinnedPoolOptions{.budget_bytes = pool_bytes});
    opt = std::make_unique<OptimizerSwapper>(*swapper, *pool, oo, ex);
  }
};

std::vector<float> random_floats(size_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
  test::fill_random(std::span<float>(v), seed, -scale, scale);
  return v;
}

struct Mode {
  uint64_t sub_group;
  unsigned buffers;
  bool pread, pwrite;
};

// bf16 moments: sub-groups [fp32 master | bf16 m | bf16 v] (8 B per element on disk and per
// step each way, against 12), stepped bit-identically to cpu_adam's bf16-moment step in
// memory; read_state widens them exactly, and a visit/fill round trip is lossless.
TEST(OptimizerSwapper, Bf16MomentsStepBitIdenticallyInTwoThirdsOfTheBytes) {
  const uint64_t numel = 3 * 8192 + 100;  // the last sub-group is short and unaligned
  const OptimizerSwapperOptions oo{.sub_group_size = 8192,
                                   .buffer_count = 3,
                                   .pipeline_read = true,
                                   .pipeline_write = true,
                                   .moments = DType::BF16};
  const SwapFileSpec f32 = optimizer_file_spec(0, 8192, 8192);
  const SwapFileSpec b16 = optimizer_file_spec(0, 8192, 8192, DType::BF16);
  EXPECT_EQ(f32.tensors[0].bytes, 12u * 8192);
  EXPECT_EQ(b16.tensors[0].bytes, 8u * 8192);
  EXPECT_THROW(optimizer_file_spec(0, 8192, 8192, DType::F16), InvalidArgument);
  OptimizerRig rig({{0, numel}}, oo);
  auto init = random_floats(numel, 1);
  std::vector<float> master = init;
  std::vector<uint16_t> m(numel, 0), v(numel, 0);
  rig.opt->init_state(0, init);
  for (uint64_t s = 1; s <= 3; ++s) {
    auto g = random_floats(numel, 100 + s, 1000.0f);
    std::vector<uint16_t> out(numel), want(numel);
    rig.opt->step(0, g, hyper(s), {out.data(), DType::BF16});
    cpu_adam::adam_step(hyper(s), numel, master.data(), {g.data(), DType::F32},
                        {m.data(), v.data(), DType::BF16}, {want.data(), DType::BF16});
    ASSERT_EQ(out, want) << "step " << s;
    const OptimizerStepStats st = rig.opt->last_step_stats();
    // The short last sub-group's master and exp_avg parts are padded to 4 KiB each.
    EXPECT_EQ(st.bytes_read, 3 * 8u * 8192 + 2 * 4096 + 2 * 100);
    EXPECT_EQ(st.bytes_written, st.bytes_read);
  }
  std::vector<float> rm(numel), rv(numel), rmaster(numel);
  rig.opt->read_state(0, rmaster, rm, rv);
  EXPECT_EQ(std::memcmp(rmaster.data(), master.data(), numel * 4), 0);
  for (uint64_t i = 0; i < numel; ++i) {
    ASSERT_EQ(rm[i], bf16_to_fp32(m[i])) << i;
    ASSERT_EQ(rv[i], bf16_to_fp32(v[i])) << i;
  }
  // Saved through visit_state and restored through fill_state: the same bits.
  std::vector<float> sm(numel), sv(numel), smaster(numel);
  rig.opt->visit_state(
      0, numel, [&](uint64_t first, uint64_t n, const float* p, const float* a, const float* b) {
        std::memcpy(smaster.data() + first, p, n * 4);
        std::memcpy(sm.data() + first, a, n * 4);
        std::memcpy(sv.data() + first, b, n * 4);
      });
  EXPECT_EQ(sm, rm);
  rig.opt->fill_state(
      0, numel,
      [&](uint64_t first, uint64_t n, float* p, float* a, float* b) {
        std::memcpy(p, smaster.data() + first, n * 4);
        std::memcpy(a, sm.data() + first, n * 4);
        std::memcpy(b, sv.data() + first, n * 4);
      },
      3);
  std::vector<float> fm(numel), fv(numel), fmaster(numel);
  rig.opt->read_state(0, fmaster, fm, fv);
  EXPECT_EQ(fm, rm);
  EXPECT_EQ(fv, rv);
  EXPECT_EQ(fmaster, rmaster);
}

TEST(OptimizerSwapper, StepIsBitIdenticalToInMemoryAdam) {
  const uint64_t numel = 100'003;
  const std::vector<Mode> modes = {
      {7'777, 4, true, true},  {7'777, 3, true, true},     {7'777, 2, true, true},
      {7'777, 1, true, true},  {7'777, 4, false, false},   {7'777, 3, true, false},
      {7'777, 3, false, true}, {4'096, 5, true, true},     {30'001, 3, true, true},
      {numel, 2, true, true},  {1 << 20, 3, false, false}, {1'000, 8, true, true},
  };
  cpu_adam::Executor two(2);
  for (const Mode& md : modes) {
    SCOPED_TRACE(::testing::Message() << "sub_group " << md.sub_group << " buffers " << md.buffers
                                      << " read " << md.pread << " write " << md.pwrite);
    OptimizerRig rig({{0, numel}},
                     {.sub_group_size = md.sub_group,
                      .buffer_count = md.buffers,
                      .pipeline_read = md.pread,
                      .pipeline_write = md.pwrite},
                     64 << 20, &two);
    auto init = random_floats(numel, 1);
    Reference ref(init);
    rig.opt->init_state(0, init);
    for (uint64_t s = 1; s <= 3; ++s) {
      auto g = random_floats(numel, 100 + s, 1000.0f);
      std::vector<uint16_t> out(numel);
      rig.opt->step(0, g, hyper(s), {out.data(), DType::BF16});
      auto want = ref.step(g, hyper(s), DType::BF16);
      ASSERT_EQ(out, want) << "step " << s;
      EXPECT_EQ(rig.opt->steps_done(0), s);
    }
    std::vector<float> master(numel), m(numel), v(numel);
    rig.opt->read_state(0, master, m, v);
    EXPECT_EQ(std::memcmp(master.data(), ref.master.data(), numel * 4), 0);
    EXPECT_EQ(std::memcmp(m.data(), ref.m.data(), numel * 4), 0);
    EXPECT_EQ(std::memcmp(v.data(), ref.v.data(), numel * 4), 0);
    OptimizerStepStats st = rig.opt->last_step_stats();
    EXPECT_EQ(st.sub_groups, (numel + md.sub_group - 1) / md.sub_group);
    EXPECT_EQ(st.bytes_read, st.bytes_written);
    EXPECT_GE(st.bytes_read, numel * 12);
    EXPECT_LE(rig.pool->peak_bytes(), rig.pool->budget_bytes());
    EXPECT_EQ(rig.pool->in_use_bytes(), 0u);
  }
}

TEST(OptimizerSwapper, Fp16AndFp32OutputsAndNoOutput) {
  const uint64_t numel = 12'345;
  OptimizerRig rig(
      {{3, numel}},
      {.sub_group_size = 1'000, .buffer_count = 3, .pipeline_read = true, .pipeline_write = true});
  auto init = random_floats(numel, 2);
  Reference ref(init);
  rig.opt->init_state(3, init);
  auto g1 = random_floats(numel, 11, 100.0f);
  std::vector<uint16_t> h(numel);
  rig.opt->step(3, g1, hyper(1), {h.data(), DType::F16});
  EXPECT_EQ(h, ref.step(g1, hyper(1), DType::F16));
  auto g2 = random_floats(numel, 12, 100.0f);
  std::vector<float> f(numel);
  rig.opt->step(3, g2, hyper(2), {f.data(), DType::F32});  // the master values themselves
  ref.step(g2, hyper(2), DType::BF16);
  EXPECT_EQ(std::memcmp(f.data(), ref.master.data(), numel * 4), 0);
  auto g3 = random_floats(numel, 13, 100.0f);
  rig.opt->step(3, g3, hyper(3));
  ref.step(g3, hyper(3), DType::BF16);
  std::vector<float> master(numel);
  rig.opt->read_master(3, master);
  EXPECT_EQ(std::memcmp(master.data(), ref.master.data(), numel * 4), 0);
}

TEST(OptimizerSwapper, LoadStateRoundTripsAndResumes) {
  const uint64_t numel = 5'000;
  OptimizerRig rig({{1, numel}}, {.sub_group_size = 1'024, .buffer_count = 2});
  auto p = random_floats(numel, 1), m = random_floats(numel, 2, 0.1f),
       v = random_floats(numel, 3, 0.1f);
  for (float& x : v) x = std::abs(x);
  rig.opt->load_state(1, p, m, v, 41);
  EXPECT_EQ(rig.opt->steps_done(1), 41u);
  std::vector<float> p2(numel), m2(numel), v2(numel);
  rig.opt->read_state(1, p2, m2, v2);
  EXPECT_EQ(p2, p);
  EXPECT_EQ(m2, m);
  EXPECT_EQ(v2, v);
  Reference ref(p);
  ref.m = m;
  ref.v = v;
  auto g = random_floats(numel, 4);
  std::vector<uint16_t> out(numel);
  rig.opt->step(1, g, hyper(42), {out.data(), DType::BF16});
  EXPECT_EQ(out, ref.step(g, hyper(42), DType::BF16));
  EXPECT_EQ(rig.opt->steps_done(1), 42u);
}

TEST(OptimizerSwapper, VisitAndFillStreamEverySubGroupInOrder) {
  const uint64_t numel = 5'000;
  OptimizerRig rig({{2, numel}}, {.sub_group_size = 1'024, .buffer_count = 3});
  auto p = random_floats(numel, 5), m = random_floats(numel, 6), v = random_floats(numel, 7);
  std::vector<uint64_t> firsts;
  rig.opt->fill_state(
      2, numel,
      [&](uint64_t first, uint64_t n, float* a, float* b, float* c) {
        firsts.push_back(first);
        EXPECT_EQ(n, std::min<uint64_t>(1'024, numel - first));
        EXPECT_EQ(b[0], 0.0f);  // moments start zeroed
        std::memcpy(a, p.data() + first, n * 4);
        std::memcpy(b, m.data() + first, n * 4);
        std::memcpy(c, v.data() + first, n * 4);
      },
      9);
  EXPECT_EQ(firsts, (std::vector<uint64_t>{0, 1024, 2048, 3072, 4096}));
  EXPECT_EQ(rig.opt->steps_done(2), 9u);
  std::vector<float> p2(numel), m2(numel), v2(numel);
  uint64_t expect_first = 0;
  rig.opt->visit_state(
      2, numel, [&](uint64_t first, uint64_t n, const float* a, const float* b, const float* c) {
        EXPECT_EQ(first, expect_first);
        expect_first += n;
        std::memcpy(p2.data() + first, a, n * 4);
        std::memcpy(m2.data() + first, b, n * 4);
        std::memcpy(v2.data() + first, c, n * 4);
      });
  EXPECT_EQ(expect_first, numel);
  EXPECT_EQ(p2, p);
  EXPECT_EQ(m2, m);
  EXPECT_EQ(v2, v);
  // A fill that throws leaves the unit uninitialised, never half-loaded and usable.
  EXPECT_THROW(rig.opt->fill_state(
                   2, numel,
                   [&](uint64_t first, uint64_t, float*, float*, float*) {
                     if (first >= 2048) throw CorruptData("bad checkpoint");
                   },
                   9),
               CorruptData);
  EXPECT_THROW(rig.opt->read_state(2, p2, m2, v2), InvalidArgument);
}

TEST(OptimizerSwapper, PoolBudgetHoldsWithConcurrentUnits) {
  const uint64_t numel = 40'000, sg = 4'000;
  const size_t slot = 3 * align_up(sg * 4, 4096);
  const unsigned buffers = 3;
  // Room for one unit's buffers at a time: the second step waits for the first's.
  OptimizerRig rig({{0, numel}, {1, numel}},
                   {.sub_group_size = sg,
                    .buffer_count = buffers,
                    .pipeline_read = true,
                    .pipeline_write = true},
                   buffers * slot + slot);
  std::vector<Reference> refs;
  for (uint32_t u = 0; u < 2; ++u) {
    auto init = random_floats(numel, 10 + u);
    refs.emplace_back(init);
    rig.opt->init_state(u, init);
  }
  std::vector<std::thread> threads;
  std::vector<std::vector<uint16_t>> outs(2, std::vector<uint16_t>(numel));
  std::vector<std::vector<float>> grads = {random_floats(numel, 20), random_floats(numel, 21)};
  for (uint32_t u = 0; u < 2; ++u) {
    threads.emplace_back([&, u] {
      for (uint64_t s = 1; s <= 4; ++s)
        rig.opt->step(u, grads[u], hyper(s), {outs[u].data(), DType::BF16});
    });
  }
  for (auto& t : threads) t.join();
  for (uint32_t u = 0; u < 2; ++u) {
    std::vector<uint16_t> want;
    for (uint64_t s = 1; s <= 4; ++s) want = refs[u].step(grads[u], hyper(s), DType::BF16);
    EXPECT_EQ(outs[u], want) << "unit " << u;
    EXPECT_EQ(rig.opt->steps_done(u), 4u);
  }
  EXPECT_EQ(rig.pool->peak_bytes(), buffers * slot);  // one lease at a time, never two
  EXPECT_LE(rig.pool->peak_bytes(), rig.pool->budget_bytes());
}

TEST(OptimizerSwapper, BuffersLargerThanThePoolFailAtOnce) {
  OptimizerRig rig({{0, 100'000}}, {.sub_group_size = 50'000, .buffer_count = 4}, 1 << 20);
  auto init = random_floats(100'000, 1);
  try {
    rig.opt->init_state(0, init);
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(1 << 20)), std::string::npos) << e.what();
  }
}

// Sub-group count 10; each sub-group is one read and one write request.
constexpr uint64_t kNumel = 10'000, kSg = 1'000;
// The fault backend counts requests from its creation: init_state writes 10 sub-groups, the
// first step reads and writes 10.
constexpr uint64_t kReadsBefore = 10, kWritesBefore = 20;

struct FaultCase {
  const char* name;
  aio::Fault fault;
  bool expect_poisoned;
};

TEST(OptimizerSwapper, InjectedEioFailsTheStepWhichIsNotCounted) {
  const std::vector<FaultCase> cases = {
      {"4th read", {.kind = aio::Fault::Kind::kEio, .nth = kReadsBefore + 4, .direction = 0}, true},
      {"3rd write",
       {.kind = aio::Fault::Kind::kEio, .nth = kWritesBefore + 3, .direction = 1},
       true},
      {"1st read",
       {.kind = aio::Fault::Kind::kEio, .nth = kReadsBefore + 1, .direction = 0},
       false},
  };
  for (const FaultCase& c : cases) {
    SCOPED_TRACE(c.name);
    OptimizerRig rig(
        {{0, kNumel}},
        {.sub_group_size = kSg, .buffer_count = 3, .pipeline_read = true, .pipeline_write = true});
    auto init = random_floats(kNumel, 1);
    Reference ref(init);
    rig.opt->init_state(0, init);
    auto g1 = random_floats(kNumel, 2);
    std::vector<uint16_t> out(kNumel);
    rig.opt->step(0, g1, hyper(1), {out.data(), DType::BF16});
    ref.step(g1, hyper(1), DType::BF16);

    ASSERT_EQ(rig.faults->requests_seen(), kReadsBefore + kWritesBefore);
    rig.faults->add_fault(c.fault);
    auto g2 = random_floats(kNumel, 3);
    try {
      rig.opt->step(0, g2, hyper(2), {out.data(), DType::BF16});
      FAIL() << "expected IoError";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_number(), EIO);
      EXPECT_NE(std::string(e.what()).find("optimizer/0.bin"), std::string::npos) << e.what();
    }
    rig.faults->clear_faults();
    EXPECT_EQ(rig.faults->faults_fired(), 1u);
    EXPECT_EQ(rig.opt->steps_done(0), 1u);    // not counted
    EXPECT_EQ(rig.pool->in_use_bytes(), 0u);  // buffers returned after all I/O drained
    EXPECT_EQ(rig.opt->poisoned(0), c.expect_poisoned);
    if (c.expect_poisoned) {
      // Mixed state is never used silently.
      EXPECT_THROW(rig.opt->step(0, g2, hyper(2), {out.data(), DType::BF16}), InvalidArgument);
      std::vector<float> master(kNumel);
      EXPECT_THROW(rig.opt->read_master(0, master), InvalidArgument);
      rig.opt->init_state(0, ref.master);  // e.g. restored from a checkpoint
      ref.m.assign(kNumel, 0.0f);
      ref.v.assign(kNumel, 0.0f);
      EXPECT_FALSE(rig.opt->poisoned(0));
    }
    // The state is intact (or restored): the retried step matches the reference.
    rig.opt->step(0, g2, hyper(2), {out.data(), DType::BF16});
    EXPECT_EQ(out, ref.step(g2, hyper(2), DType::BF16));
  }
}

// init_state_async returns with its last writes (buffer_count sub-groups) in flight, their
// ring still leased; the next call on any unit finishes them first, and the state read back
// and stepped is the one given. A failed write among them surfaces at flush() naming the file,
// and the unit stays uninitialised until it is initialised again.
TEST(OptimizerSwapper, InitStateAsyncLeavesTheLastWritesInFlightUntilTheNextCall) {
  const OptimizerSwapperOptions oo{
      .sub_group_size = kSg, .buffer_count = 3, .pipeline_read = true, .pipeline_write = true};
  {
    OptimizerRig rig({{0, kNumel}, {1, kNumel}}, oo);
    const auto init0 = random_floats(kNumel, 1), init1 = random_floats(kNumel, 2);
    rig.opt->init_state_async(0, init0);
    EXPECT_GT(rig.pool->in_use_bytes(), 0u);  // the ring of the writes still in flight
    rig.opt->init_state_async(1, init1);
    std::vector<float> got(kNumel);
    rig.opt->read_master(0, got);
    EXPECT_EQ(got, init0);
    rig.opt->read_master(1, got);
    EXPECT_EQ(got, init1);
    EXPECT_EQ(rig.pool->in_use_bytes(), 0u);
    EXPECT_EQ(rig.opt->steps_done(1), 0u);
    Reference ref(init1);
    const auto g = random_floats(kNumel, 3);
    std::vector<uint16_t> out(kNumel);
    rig.opt->step(1, g, hyper(1), {out.data(), DType::BF16});
    EXPECT_EQ(out, ref.step(g, hyper(1), DType::BF16));
  }
  {  // two threads at once, on two units: neither's writes are lost
    OptimizerRig rig({{0, kNumel}, {1, kNumel}}, oo);
    const auto init0 = random_floats(kNumel, 4), init1 = random_floats(kNumel, 5);
    std::thread other([&] { rig.opt->init_state_async(1, init1); });
    rig.opt->init_state_async(0, init0);
    other.join();
    rig.opt->flush();
    EXPECT_EQ(rig.pool->in_use_bytes(), 0u);
    std::vector<float> got(kNumel);
    rig.opt->read_master(0, got);
    EXPECT_EQ(got, init0);
    rig.opt->read_master(1, got);
    EXPECT_EQ(got, init1);
  }
  {
    OptimizerRig rig({{0, kNumel}}, oo);
    const auto init = random_floats(kNumel, 1);
    // The last of the 10 writes: left in flight by init_state_async, never waited inside it.
    rig.faults->add_fault({.kind = aio::Fault::Kind::kEio, .nth = kNumel / kSg, .direction = 1});
    rig.opt->init_state_async(0, init);
    try {
      rig.opt->flush();
      FAIL() << "expected IoError";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_number(), EIO);
      EXPECT_NE(std::string(e.what()).find("optimizer/0.bin"), std::string::npos) << e.what();
    }
    EXPECT_EQ(rig.faults->faults_fired(), 1u);
    EXPECT_EQ(rig.pool->in_use_bytes(), 0u);
    std::vector<float> got(kNumel);
    EXPECT_THROW(rig.opt->read_master(0, got), InvalidArgument);  // never initialised
    rig.opt->flush();                                             // nothing left
    rig.opt->init_state(0, init);
    rig.opt->read_master(0, got);
    EXPECT_EQ(got, init);
  }
}

TEST(OptimizerSwapper, CorruptBlockFailsTheStep) {
  OptimizerRig rig(
      {{0, kNumel}},
      {.sub_group_size = kSg, .buffer_count = 3, .pipeline_read = true, .pipeline_write = true});
  rig.opt->init_state(0, random_floats(kNumel, 1));
  TensorId sg5 = rig.space->find(0, SwapKind::kOptimizer, "sg5");
  const uint64_t at = rig.space->info(sg5).offset + 4096 + 17;  // in sub-group 5's exp_avg
  test::flip_byte(rig.space->file_path(0, SwapKind::kOptimizer), at);
  auto g = random_floats(kNumel, 2);
  try {
    rig.opt->step(0, g, hyper(1));
    FAIL() << "expected CorruptData";
  } catch (const CorruptData& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("optimizer/0.bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find("sg5"), std::string::npos) << msg;
  }
  EXPECT_EQ(rig.opt->steps_done(0), 0u);
  EXPECT_TRUE(rig.opt->poisoned(0));  // sub-groups 0.. were already rewritten
  EXPECT_EQ(rig.pool->in_use_bytes(), 0u);
}

// Spare copy: a tentative step gives the step's output while the unit's state stays what it
// was until commit; discard forgets it; commits alternate the copies and every step after one
// (in place or tentative) continues the in-memory reference bit for bit. A tentative step
// that fails leaves nothing pending and the unit unpoisoned.
TEST(OptimizerSwapper, TentativeStepsCommitOrLeaveTheStateAsItWas) {
  const SwapFileSpec two = optimizer_file_spec(0, 2500, 1000, DType::F32, 2);
  ASSERT_EQ(two.tensors.size(), 6u);
  EXPECT_EQ(two.tensors[3].name, "sg0.spare");
  EXPECT_EQ(two.tensors[5].bytes, two.tensors[2].bytes);
  EXPECT_THROW(optimizer_file_spec(0, 2500, 1000, DType::F32, 3), InvalidArgument);

  const OptimizerSwapperOptions oo{.sub_group_size = kSg,
                                   .buffer_count = 3,
                                   .pipeline_read = true,
                                   .pipeline_write = true,
                                   .spare_copy = true};
  OptimizerRig rig({{0, kNumel}}, oo);
  const auto init = random_floats(kNumel, 1);
  Reference ref(init);
  rig.opt->init_state(0, init);
  std::vector<uint16_t> out(kNumel);
  std::vector<float> master(kNumel), m(kNumel), v(kNumel);

  const auto g1 = random_floats(kNumel, 2);
  Reference ahead = ref;
  const std::vector<uint16_t> want1 = ahead.step(g1, hyper(1), DType::BF16);
  rig.opt->step_tentative(0, g1, hyper(1), {out.data(), DType::BF16});
  EXPECT_EQ(out, want1);
  EXPECT_TRUE(rig.opt->tentative_pending(0));
  EXPECT_EQ(rig.opt->steps_done(0), 0u);
  EXPECT_THROW(rig.opt->read_master(0, master), InvalidArgument);  // neither state is judged
  EXPECT_THROW(rig.opt->step(0, g1, hyper(1)), InvalidArgument);
  EXPECT_THROW(rig.opt->commit(1), InvalidArgument);  // nothing pending there
  rig.opt->discard(0);
  rig.opt->read_master(0, master);
  EXPECT_EQ(master, init);  // the state as it was

  // Commit, then an in-place step, then tentative ones from either copy.
  rig.opt->step_tentative(0, g1, hyper(1), {out.data(), DType::BF16});
  rig.opt->commit(0);
  ref.step(g1, hyper(1), DType::BF16);
  EXPECT_EQ(rig.opt->steps_done(0), 1u);
  rig.opt->read_state(0, master, m, v);
  EXPECT_EQ(master, ref.master);
  EXPECT_EQ(v, ref.v);
  for (uint64_t step = 2; step <= 5; ++step) {
    const auto g = random_floats(kNumel, 10 + step);
    if (step == 3)
      rig.opt->step(0, g, hyper(step), {out.data(), DType::BF16});
    else
      rig.opt->step_tentative(0, g, hyper(step), {out.data(), DType::BF16});
    if (step != 3) rig.opt->commit(0);
    EXPECT_EQ(out, ref.step(g, hyper(step), DType::BF16)) << "step " << step;
  }
  EXPECT_EQ(rig.opt->steps_done(0), 5u);
  rig.opt->visit_state(
      0, kNumel, [&](uint64_t first, uint64_t n, const float* w, const float*, const float* sq) {
        EXPECT_EQ(std::memcmp(w, ref.master.data() + first, n * sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(sq, ref.v.data() + first, n * sizeof(float)), 0);
      });

  // A failed tentative write: the state stays current and usable.
  // Writes so far: init 10, two tentative steps 20, steps 2-5 40; fail the 3rd of this one.
  rig.faults->add_fault({.kind = aio::Fault::Kind::kEio, .nth = 73, .direction = 1});
  const auto g6 = random_floats(kNumel, 20);
  EXPECT_THROW(rig.opt->step_tentative(0, g6, hyper(6), {out.data(), DType::BF16}), IoError);
  rig.faults->clear_faults();
  EXPECT_FALSE(rig.opt->poisoned(0));
  EXPECT_FALSE(rig.opt->tentative_pending(0));
  EXPECT_EQ(rig.pool->in_use_bytes(), 0u);
  rig.opt->step(0, g6, hyper(6), {out.data(), DType::BF16});
  EXPECT_EQ(out, ref.step(g6, hyper(6), DType::BF16));

  // Without a spare copy there is no tentative step.
  OptimizerRig plain({{0, kNumel}}, {.sub_group_size = kSg, .buffer_count = 3});
  plain.opt->init_state(0, init);
  EXPECT_THROW(plain.opt->step_tentative(0, g1, hyper(1)), InvalidArgument);
}

TEST(OptimizerSwapper, MisuseIsInvalidArgument) {
  OptimizerRig rig({{0, kNumel}}, {.sub_group_size = kSg, .buffer_count = 3});
  auto init = random_floats(kNumel, 1);
  std::vector<float> g(kNumel);
  EXPECT_THROW(rig.opt->step(0, g, hyper(1)), InvalidArgument);  // not initialised
  EXPECT_THROW(rig.opt->init_state(0, std::span(init).first(kNumel - 1)), InvalidArgument);
  EXPECT_THROW(rig.opt->init_state(9, init), InvalidArgument);  // no file for unit 9
  rig.opt->init_state(0, init);
  EXPECT_THROW(rig.opt->step(0, std::span(g).first(10), hyper(1)), InvalidArgument);
  cpu_adam::AdamParams bad = hyper(1);
  bad.beta1 = 1.5;
  EXPECT_THROW(rig.opt->step(0, g, bad), InvalidArgument);
  EXPECT_EQ(rig.opt->steps_done(0), 0u);
  EXPECT_THROW(OptimizerSwapper(*rig.swapper, *rig.pool, {.sub_group_size = 0}), InvalidArgument);
  EXPECT_THROW(OptimizerSwapper(*rig.swapper, *rig.pool, {.buffer_count = 0}), InvalidArgument);
}

TEST(OptimizerSwapper, OverlappingCallsOnOneUnitAreRefused) {
  OptimizerRig rig({{0, kNumel}}, {.sub_group_size = kSg, .buffer_count = 3});
  rig.opt->init_state(0, random_floats(kNumel, 1));
  // Slow I/O keeps the step running while the main thread tries a second call.
  rig.faults->add_fault({.kind = aio::Fault::Kind::kDelay,
                         .nth = 1,
                         .every = 1,
                         .delay = std::chrono::microseconds(50'000)});
  std::vector<float> g(kNumel, 0.5f);
  std::thread stepper([&] { rig.opt->step(0, g, hyper(1)); });
  while (rig.pool->in_use_bytes() == 0) std::this_thread::yield();  // the step holds its buffers
  std::vector<float> master(kNumel);
  EXPECT_THROW(rig.opt->read_master(0, master), InvalidArgument);
  stepper.join();
  EXPECT_EQ(rig.opt->steps_done(0), 1u);
}

}  // namespace
}  // namespace outcore::swap
