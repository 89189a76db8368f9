// The optimizer step's contract: overflow, unscale + clip, misuse, state access.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

struct Fixture {
  explicit Fixture(const std::string& json, DType dtype = DType::F32, bool tied = false)
      : cfg(make_config(json)), model(tiny_config(tied), tiny_options(dtype)) {
    engine = std::make_unique<ZeroEngine>(cfg, model, dev, comm, 11);
  }
  float micro_batch(uint64_t seed, float loss_scale, bool first) {
    const size_t n = static_cast<size_t>(model.tokens());
    std::vector<int32_t> tok = make_tokens(n + 1, model.config().vocab_size, seed, n + 1);
    return engine->forward_backward(tok.data(), tok.data() + 1, loss_scale, first);
  }
  std::vector<float> master(int unit) {
    std::vector<float> m(model.layout().units[unit].padded_numel);
    engine->get_master_weights(unit, m);
    return m;
  }
  config::Config cfg;
  model::LlamaModel model;
  device::CpuDevice dev;
  comm::LocalComm comm;
  std::unique_ptr<ZeroEngine> engine;
};

TEST(ZeroStep, OverflowSkipsTheUpdateAndClearsTheGradients) {
  Fixture f(config_json({2, "none", "cpu"}, DType::F32, ""));
  const std::vector<float> before = f.master(1);
  // An infinite scale makes every scaled gradient non-finite, as an fp16 overflow would.
  f.micro_batch(1, std::numeric_limits<float>::infinity(), true);
  StepParams sp = step_params(f.cfg, 1e-3, 1, 65536.0);
  sp.check_overflow = true;
  const StepResult r = f.engine->step(sp);
  EXPECT_TRUE(r.overflow);
  EXPECT_FALSE(std::isfinite(r.grad_norm));
  EXPECT_EQ(f.master(1), before);
  // The gradients are gone: accumulating onto them is refused, a new step starts cleanly.
  EXPECT_THROW(f.micro_batch(2, 1.0f, false), InvalidArgument);
  EXPECT_THROW(f.engine->step(sp), InvalidArgument);
  f.micro_batch(2, 1.0f, true);
  const StepResult ok = f.engine->step(step_params(f.cfg, 1e-3, 1, 1.0));
  EXPECT_FALSE(ok.overflow);
  EXPECT_NE(f.master(1), before);
}

TEST(ZeroStep, UnscaleAndClipIsDeepSpeedsCombinedMultiplier) {
  Fixture f(config_json({3, "cpu", "cpu"}, DType::F32, ""));
  f.micro_batch(1, 64.0f, true);
  StepParams sp = step_params(f.cfg, 1e-3, 1, 64.0);
  sp.gradient_clipping = 1e-3;  // far below the norm: clipping active
  const StepResult r = f.engine->step(sp);
  ASSERT_FALSE(r.overflow);
  ASSERT_GT(r.grad_norm, 1e-3);
  const double clip = (r.grad_norm + 1e-6) / sp.gradient_clipping;
  EXPECT_DOUBLE_EQ(r.grad_scale, 1.0 / (clip * 64.0));
  // Without clipping the multiplier only unscales.
  f.micro_batch(2, 64.0f, true);
  sp.gradient_clipping = 0;
  sp.step = 2;
  EXPECT_DOUBLE_EQ(f.engine->step(sp).grad_scale, 1.0 / 64.0);
}

TEST(ZeroStep, PowerOfTwoLossScaleGivesTheUnscaledRunBitForBit) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::F32));
  const config::Config cfg = make_config(config_json({3, "cpu", "cpu"}, DType::F32, ""));
  auto run = [&](float scale) {
    Fixture f(config_json({3, "cpu", "cpu"}, DType::F32, ""));
    std::vector<double> norms;
    for (int t = 1; t <= 4; ++t) {
      f.micro_batch(t, scale / 2, true);
      f.micro_batch(t + 50, scale / 2, false);
      norms.push_back(f.engine->step(step_params(cfg, 1e-3, t, scale)).grad_norm);
    }
    return std::make_pair(norms, f.master(2));
  };
  const auto a = run(1.0f), b = run(1024.0f);
  EXPECT_EQ(a.first, b.first);
  EXPECT_EQ(a.second, b.second);
}

TEST(ZeroStep, EvaluateBetweenMicroBatchesLeavesTheGradientsAlone) {
  Fixture f(config_json({3, "cpu", "cpu"}, DType::BF16, ""), DType::BF16, true);
  Fixture g(config_json({3, "cpu", "cpu"}, DType::BF16, ""), DType::BF16, true);
  const size_t n = static_cast<size_t>(f.model.tokens());
  std::vector<int32_t> tok = make_tokens(n + 1, f.model.config().vocab_size, 77, n + 1);
  f.micro_batch(1, 0.5f, true);
  const float eval = f.engine->evaluate(tok.data(), tok.data() + 1);
  EXPECT_TRUE(std::isfinite(eval));
  f.micro_batch(2, 0.5f, false);
  g.micro_batch(1, 0.5f, true);
  g.micro_batch(2, 0.5f, false);
  EXPECT_EQ(f.engine->step(step_params(f.cfg, 1e-3, 1, 1.0)).grad_norm,
            g.engine->step(step_params(g.cfg, 1e-3, 1, 1.0)).grad_norm);
  EXPECT_EQ(f.master(0), g.master(0));
  EXPECT_NE(f.engine->evaluate(tok.data(), tok.data() + 1), eval);  // the step changed the model
}

// outcore.step_in_backward at the engine's interface: after expect_step, the next pass steps
// units tentatively; step() commits them, and any other call first undoes them (evaluate sees
// the model as it was, a second micro-batch accumulates normally), so every sequence gives
// the results of the engine without it. Its optimizer swap files hold two copies.
TEST(ZeroStep, TentativeStepStandsOnlyWhenStepJudgesIt) {
  const std::string top = R"(, "outcore": {"step_in_backward": true})";
  const Placing p{3, "nvme", "nvme"};
  Fixture f(config_json(p, DType::BF16, swap_dir("tentative_on").string(), "", top), DType::BF16);
  Fixture g(config_json(p, DType::BF16, swap_dir("tentative_off").string()), DType::BF16);
  const Plan& pf = f.engine->plan();
  const Plan& pg = g.engine->plan();
  EXPECT_GT(pf.optimizer_nvme_bytes, 2 * pg.optimizer_nvme_bytes - (64u << 10));
  EXPECT_LE(pf.optimizer_nvme_bytes, 2 * pg.optimizer_nvme_bytes);
  EXPECT_NE(format_plan(pf).find("(swap files, 2 copies)"), std::string::npos);
  const size_t n = static_cast<size_t>(f.model.tokens());
  std::vector<int32_t> tok = make_tokens(n + 1, f.model.config().vocab_size, 77, n + 1);
  auto sp = [&](Fixture& x, uint64_t t) {
    StepParams s = step_params(x.cfg, 1e-3, t, 1.0);
    s.gradient_clipping = 0;  // no clipping: every expected step is started in backward
    return s;
  };
  auto same_state = [&] {
    for (int u = 0; u < f.model.num_units(); ++u)
      ASSERT_EQ(f.master(u), g.master(u)) << "unit " << u;
  };
  // 1: committed.
  f.engine->expect_step(sp(f, 1));
  f.micro_batch(1, 1.0f, true);
  g.micro_batch(1, 1.0f, true);
  StepResult rf = f.engine->step(sp(f, 1)), rg = g.engine->step(sp(g, 1));
  EXPECT_EQ(rf.in_backward, StepResult::InBackward::kCommitted);
  EXPECT_EQ(rg.in_backward, StepResult::InBackward::kNone);
  EXPECT_EQ(rf.grad_norm, rg.grad_norm);
  same_state();
  // 2: an evaluation between the pass and step() undoes the tentative updates first.
  f.engine->expect_step(sp(f, 2));
  f.micro_batch(2, 1.0f, true);
  g.micro_batch(2, 1.0f, true);
  EXPECT_EQ(f.engine->evaluate(tok.data(), tok.data() + 1),
            g.engine->evaluate(tok.data(), tok.data() + 1));
  rf = f.engine->step(sp(f, 2));
  g.engine->step(sp(g, 2));
  EXPECT_EQ(rf.in_backward, StepResult::InBackward::kNone);
  same_state();
  // 3: a second micro-batch after the expected last one: undone, then accumulated.
  f.engine->expect_step(sp(f, 3));
  f.micro_batch(3, 0.5f, true);
  f.micro_batch(4, 0.5f, false);
  g.micro_batch(3, 0.5f, true);
  g.micro_batch(4, 0.5f, false);
  EXPECT_EQ(f.engine->step(sp(f, 3)).in_backward, StepResult::InBackward::kNone);
  g.engine->step(sp(g, 3));
  same_state();
  // 4: step() with other parameters than expected (a different lr): redone.
  f.engine->expect_step(sp(f, 4));
  f.micro_batch(5, 1.0f, true);
  g.micro_batch(5, 1.0f, true);
  StepParams other = sp(f, 4);
  other.lr = 2e-3;
  EXPECT_EQ(f.engine->step(other).in_backward, StepResult::InBackward::kRedone);
  g.engine->step(other);
  same_state();
  EXPECT_EQ(f.engine->evaluate(tok.data(), tok.data() + 1),
            g.engine->evaluate(tok.data(), tok.data() + 1));
  // 5: step() refusing its parameters before the verdict: the pass is undone by the next call.
  f.engine->expect_step(sp(f, 5));
  f.micro_batch(6, 1.0f, true);
  StepParams bad = sp(f, 5);
  bad.lr = -1;
  EXPECT_THROW(f.engine->step(bad), InvalidArgument);
  EXPECT_EQ(f.engine->evaluate(tok.data(), tok.data() + 1),
            g.engine->evaluate(tok.data(), tok.data() + 1));
  f.micro_batch(7, 1.0f, true);
  g.micro_batch(7, 1.0f, true);
  f.engine->step(sp(f, 5));
  g.engine->step(sp(g, 5));
  same_state();
}

TEST(ZeroStep, StateRoundTripsAndWritingMasterRefreshesParameters) {
  for (const Placing& s : {Placing{1, "none", "cpu"}, Placing{3, "nvme", "nvme"}}) {
    SCOPED_TRACE(s.name());
    const std::string dir = swap_dir("state_" + s.name()).string();
    Fixture f(config_json(s, DType::BF16, dir), DType::BF16);
    f.micro_batch(1, 1.0f, true);
    f.engine->step(step_params(f.cfg, 1e-2, 1, 1.0));
    const int unit = 2;
    const size_t n = f.engine->partition_numel(unit);
    ASSERT_EQ(n, f.model.layout().units[unit].padded_numel);  // world size 1
    std::vector<float> m(n), v(n);
    f.engine->read_state(unit, StateKind::kExpAvg, m);
    f.engine->read_state(unit, StateKind::kExpAvgSq, v);
    EXPECT_NE(m, std::vector<float>(n, 0.0f));
    std::vector<float> w(n);
    for (size_t i = 0; i < n; ++i) w[i] = 0.25f + static_cast<float>(i % 7);
    f.engine->write_state(unit, StateKind::kMaster, w);
    EXPECT_EQ(f.master(unit), w);
    std::vector<std::byte> p(n * 2);
    f.engine->get_params(unit, p);
    for (size_t i = 0; i < n; i += 97) {
      uint16_t h;
      std::memcpy(&h, p.data() + 2 * i, 2);
      EXPECT_EQ(bf16_to_fp32(h), round_to(DType::BF16, w[i])) << i;
    }
    std::vector<float> m2(n);
    f.engine->read_state(unit, StateKind::kExpAvg, m2);
    EXPECT_EQ(m, m2);  // writing the master left the moments alone
  }
}

TEST(ZeroStep, MisuseIsRefusedWithClearErrors) {
  Fixture f(config_json({0}, DType::F32, ""));
  EXPECT_THROW(f.engine->step(step_params(f.cfg, 1e-3, 1, 1.0)), InvalidArgument);
  std::vector<float> small(3);
  EXPECT_THROW(f.engine->get_master_weights(0, small), InvalidArgument);
  EXPECT_THROW(f.engine->get_master_weights(99, small), InvalidArgument);
  EXPECT_THROW(f.engine->read_state(-1, StateKind::kMaster, small), InvalidArgument);
  EXPECT_THROW(f.engine->forward_backward(nullptr, nullptr, 1.0f, true), InvalidArgument);
  const size_t n = static_cast<size_t>(f.model.tokens());
  std::vector<int32_t> bad(n + 1, 5);
  bad[3] = 100000;  // outside the vocabulary
  EXPECT_THROW(f.engine->forward_backward(bad.data(), bad.data() + 1, 1.0f, true), InvalidArgument);
  f.micro_batch(1, 1.0f, true);
  StepParams sp = step_params(f.cfg, 1e-3, 1, 0.0);
  EXPECT_THROW(f.engine->step(sp), InvalidArgument);
}

TEST(ZeroStep, ModelDtypeMustMatchTheConfig) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::F32));
  const config::Config cfg = make_config(config_json({0}, DType::BF16, ""));
  device::CpuDevice dev;
  comm::LocalComm comm;
  EXPECT_THROW(ZeroEngine(cfg, model, dev, comm, 1), ConfigError);
}

// offload_optimizer.cpuadam_cores_perc sizes the engine's CPU threads (CPU Adam, gradient norms
// and host accumulation) when the caller does not; EngineOptions::cpu_threads overrides it.
TEST(CpuThreads, TheConfigsShareOfTheHardwareThreads) {
  EXPECT_EQ(cpu_threads_for(0.8, 16), 13u);
  EXPECT_EQ(cpu_threads_for(0.5, 2), 1u);
  EXPECT_EQ(cpu_threads_for(0.01, 8), 1u);  // at least one
  EXPECT_EQ(cpu_threads_for(1.0, 7), 7u);
  EXPECT_THROW(cpu_threads_for(0.0, 8), InvalidArgument);
  EXPECT_THROW(cpu_threads_for(1.5, 8), InvalidArgument);

  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::F32));
  device::CpuDevice dev;
  comm::LocalComm comm;
  for (const auto& [share, given, want] :
       {std::tuple{std::string(), 0u, hw},
        std::tuple{std::string(", \"cpuadam_cores_perc\": 0.5"), 0u, cpu_threads_for(0.5, hw)},
        std::tuple{std::string(", \"cpuadam_cores_perc\": 0.5"), 3u, 3u}}) {
    const config::Config cfg =
        make_config(config_json({2, "none", "cpu"}, DType::F32, "", "", "", share));
    EXPECT_DOUBLE_EQ(cfg.zero_optimization.offload_optimizer.cpuadam_cores_perc,
                     share.empty() ? 1.0 : 0.5);
    EngineOptions eo;
    eo.cpu_threads = given;
    ZeroEngine engine(cfg, model, dev, comm, 1, eo);
    EXPECT_EQ(engine.cpu_threads(), want) << share << " threads given " << given;
    EXPECT_EQ(engine.data_threads(), given != 0 ? given : hw)
        << share << " threads given " << given;
  }
}

// The initial weights are computed on the engine's CPU threads in chunks, and are
// model::init_params's values over the whole slab for any thread count (each decoder unit here
// spans several chunks).
TEST(Initialise, AnyThreadCountGivesInitParamsWeights) {
  model::LlamaConfig c = tiny_config(false);
  c.hidden_size = 128;
  c.intermediate_size = 384;
  c.num_attention_heads = 8;
  const model::LlamaModel model(c, tiny_options(DType::F32));
  device::CpuDevice dev;
  comm::LocalComm comm;
  const config::Config cfg = make_config(config_json({2, "none", "cpu"}, DType::F32, ""));
  ASSERT_GT(model.layout().units[1].padded_numel, size_t{3} << 14);
  for (unsigned threads : {1u, 3u}) {
    EngineOptions eo;
    eo.cpu_threads = threads;
    ZeroEngine engine(cfg, model, dev, comm, /*seed=*/5, eo);
    for (const model::UnitLayout& u : model.layout().units) {
      std::vector<float> got(u.padded_numel), want(u.padded_numel);
      engine.get_master_weights(u.index, got);
      model::init_params(model.layout(), u.index, 5, 0, u.padded_numel, want.data());
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
          << "unit " << u.index << ", " << threads << " threads";
    }
  }
}

}  // namespace
}  // namespace outcore::zero::test
