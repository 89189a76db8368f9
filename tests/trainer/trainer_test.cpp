// The Trainer: gradient accumulation, falling loss, fp16 overflow handling, activation
// checkpointing, stop requests, metrics, and refusal of bad input.
#include "engine/train/trainer.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "aio/aio.hpp"
#include "common/error.hpp"
#include "engine/train/checkpointing.hpp"
#include "engine/train/token_file.hpp"
#include "engine/zero/plan.hpp"
#include "tests/comm/thread_comm.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/trainer/trainer_test_util.hpp"

namespace outcore::train {
namespace {

using testing::DemoData;
using testing::make_config;
using testing::quiet_options;
using testing::tiny_model;

std::vector<std::vector<float>> master_weights(Trainer& t) {
  std::vector<std::vector<float>> w;
  for (const model::UnitLayout& u : t.model().layout().units) {
    w.emplace_back(u.padded_numel);
    t.engine().get_master_weights(u.index, w.back());
  }
  return w;
}

// Gradient accumulation over k micro-batches must give the gradient of one batch k times
// larger. Adam with eps = 1 and lr = 1 turns the first update into -g / (|g| + 1), a
// monotonic function of each gradient element, so comparing updates compares gradients.
TEST(TrainerTest, GradientAccumulationEqualsOneLargerBatch) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  const nlohmann::json adam = {
      {"optimizer", {{"params", {{"lr", 1.0}, {"eps", 1.0}, {"betas", {0.9, 0.999}}}}}}};
  nlohmann::json accum = adam, large = adam;
  accum.merge_patch({{"train_micro_batch_size_per_gpu", 2}, {"gradient_accumulation_steps", 3}});
  large.merge_patch({{"train_micro_batch_size_per_gpu", 6}, {"gradient_accumulation_steps", 1}});

  Trainer a(make_config(accum, mc), mc, quiet_options(data, 1));
  Trainer b(make_config(large, mc), mc, quiet_options(data, 1));
  ASSERT_EQ(a.tokens_per_step(), b.tokens_per_step());
  const auto w0 = master_weights(b);
  ASSERT_EQ(master_weights(a), w0);  // same seed, same initial weights

  StepMetrics ma = a.train_step();
  StepMetrics mb = b.train_step();
  EXPECT_NEAR(ma.loss, mb.loss, 1e-5 * std::fabs(mb.loss));
  ASSERT_TRUE(ma.grad_norm && mb.grad_norm);
  EXPECT_NEAR(*ma.grad_norm, *mb.grad_norm, 1e-5 * *mb.grad_norm);

  const auto wa = master_weights(a), wb = master_weights(b);
  double max_delta = 0, max_diff = 0;
  size_t changed = 0;
  for (size_t u = 0; u < w0.size(); ++u) {
    for (size_t i = 0; i < w0[u].size(); ++i) {
      const double da = wa[u][i] - w0[u][i], db = wb[u][i] - w0[u][i];
      max_delta = std::max(max_delta, std::fabs(db));
      max_diff = std::max(max_diff, std::fabs(da - db));
      changed += db != 0;
    }
  }
  EXPECT_GT(changed, w0.size() * 100u);
  EXPECT_GT(max_delta, 1e-4);
  EXPECT_LE(max_diff, 1e-5 * max_delta) << "max update " << max_delta;
}

TEST(TrainerTest, LossFallsOnTheDemoData) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 30);
  o.eval_batches = 4;
  Trainer t(make_config({{"train_micro_batch_size_per_gpu", 8}}, mc), mc, o);
  const double val_before = t.validate().loss;
  EXPECT_NEAR(val_before, std::log(256.0), 0.3);  // an untrained model is near uniform
  TrainResult r = t.run();
  ASSERT_EQ(r.steps, 30);
  ASSERT_EQ(r.losses.size(), 30u);
  EXPECT_FALSE(r.stopped);
  EXPECT_EQ(r.skipped_steps, 0);
  const double first = r.losses.front();
  const double last5 = std::accumulate(r.losses.end() - 5, r.losses.end(), 0.0) / 5;
  EXPECT_LT(last5, first - 1.0) << "first " << first << ", mean of the last 5 " << last5;
  ASSERT_TRUE(r.final_val_loss.has_value());
  EXPECT_LT(*r.final_val_loss, val_before - 1.0);
  EXPECT_EQ(r.tokens, 30u * 8 * 32);
  EXPECT_GT(r.gflops_per_s, 0);
}

// The engine's initialisation shows its progress once it has run init_progress_after_s: the
// first unit, then at most a line a second, and the last unit.
TEST(TrainerTest, InitialisationShowsItsProgress) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 1);
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  o.progress_out = out;
  o.init_progress_after_s = 0;
  const Trainer t(make_config({}, mc), mc, o);
  std::rewind(out);
  std::string text;
  for (int c = std::fgetc(out); c != EOF; c = std::fgetc(out)) text += static_cast<char>(c);
  std::fclose(out);
  const size_t units = static_cast<size_t>(t.model().num_units());
  EXPECT_NE(text.find("initialising the training state: 1 of " + std::to_string(units) + " units"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("initialising the training state: " + std::to_string(units) + " of " +
                      std::to_string(units) + " units"),
            std::string::npos)
      << text;
  // Below the threshold nothing is shown.
  std::FILE* quiet = std::tmpfile();
  o.progress_out = quiet;
  o.init_progress_after_s = 3600;
  { const Trainer again(make_config({}, mc), mc, o); }
  EXPECT_EQ(std::ftell(quiet), 0L);
  std::fclose(quiet);
}

// steps_per_print thins a log's step lines (lines mode): every N-th, the first and the last.
TEST(TrainerTest, StepsPerPrintThinsTheStepLinesOfALog) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 5);
  o.val_data.clear();
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  o.progress_out = out;
  o.progress_mode = ProgressDisplay::Mode::kLines;
  Trainer t(make_config({{"steps_per_print", 2}}, mc), mc, o);
  t.run();
  std::rewind(out);
  std::string text;
  for (int c = std::fgetc(out); c != EOF; c = std::fgetc(out)) text += static_cast<char>(c);
  std::fclose(out);
  for (const int step : {1, 2, 4, 5})
    EXPECT_NE(text.find("step " + std::to_string(step) + "/5 |"), std::string::npos) << text;
  EXPECT_EQ(text.find("step 3/5 |"), std::string::npos) << text;
}

// The summary's zero line says where the state is, not only what the config asked: NVMe
// optimizer state needs stage 3, so at stage 2 it is in host memory.
TEST(TrainerTest, SummarySaysWhereTheOptimizerStateIs) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  const Trainer t(
      make_config(
          {{"zero_optimization",
            {{"stage", 2},
             {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", data.train() + ".d"}}}}}},
          mc),
      mc, quiet_options(data, 1));
  const std::string s = t.summary();
  EXPECT_NE(s.find("optimizer state host (offload_optimizer nvme needs stage 3)"),
            std::string::npos)
      << s;
}

// OneCycle with cycle_momentum sets Adam's betas: the summary says so instead of showing the
// config's, each step's beta1 is in its metrics, and a momentum decay that would take beta1 to
// 1 within the steps asked for is refused before the run starts, naming the key and the step.
TEST(TrainerTest, OneCycleMomentumIsShownAndBoundedBeforeTheRun) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  nlohmann::json params = {{"cycle_min_lr", 1e-4},       {"cycle_max_lr", 1e-3},
                           {"cycle_first_step_size", 1}, {"decay_step_size", 1},
                           {"decay_mom_rate", 0.1},      {"decay_lr_rate", 0.1}};
  auto cfg = [&] {
    return make_config({{"scheduler", {{"type", "OneCycle"}, {"params", params}}}}, mc);
  };
  // cycle_max_mom 0.9 x (1 + 0.1 x k) reaches 1.08 at k = 2, the schedule's index 3: step 5.
  try {
    Trainer t(cfg(), mc, quiet_options(data, 8));
    FAIL() << "a run reaching beta1 1.08 was taken";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.json_path(), "scheduler.params.decay_mom_rate");
    EXPECT_NE(std::string(e.what()).find("beta1 to 1.08 at step 5 of the 8 steps"),
              std::string::npos)
        << e.what();
  }
  TrainerOptions o = quiet_options(data, 4);  // beta1 0.99 at step 4 at the most
  std::vector<double> beta1;
  o.on_step = [&](const StepMetrics& m) { beta1.push_back(m.beta1.value_or(-1)); };
  Trainer t(cfg(), mc, o);
  EXPECT_NE(t.summary().find("betas set by OneCycle (beta2 0.99"), std::string::npos)
      << t.summary();
  t.run();
  ASSERT_EQ(beta1.size(), 4u);
  EXPECT_DOUBLE_EQ(beta1[3], 0.9 * 1.1);
  params["decay_mom_rate"] = 0.0;
  params.erase("decay_step_size");
  Trainer(cfg(), mc, quiet_options(data, 100));  // beta1 stays at cycle_max_mom
}

// A validation pass is the set's first --eval-batches micro-batches at any world size: with two
// ranks on a set of 3 micro-batches, rank 0 evaluates the 1st and 3rd, rank 1 the 2nd (it once
// wrapped into a second epoch and evaluated the 1st twice). The loss has the bits of one rank's,
// and a mask whose only targets lie in the 3rd micro-batch leaves it a loss.
TEST(TrainerTest, ValidationIsTheSameSetAtAnyWorldSize) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  const std::string val = data.file("small_val.bin"), mask = data.file("small_val.mask");
  {  // 3 sequences of 32 and one more token; only the 3rd sequence's targets trained
    const TokenFile all = TokenFile::open(data.val());
    std::vector<uint16_t> tokens(3 * 32 + 1);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(all[i]);
    int32_t header[kLlmcHeaderInts] = {kLlmcMagic, kLlmcVersion,
                                       static_cast<int32_t>(tokens.size())};
    std::ofstream f(val, std::ios::binary);
    f.write(reinterpret_cast<const char*>(header), sizeof header);
    f.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size() * 2));
    std::string bytes(tokens.size(), '\0');
    for (size_t i = 2 * 32 + 1; i < bytes.size(); ++i) bytes[i] = 1;
    std::ofstream(mask, std::ios::binary) << bytes;
  }
  auto run = [&](int world, const std::string& val_mask) {
    const config::Config cfg = make_config(
        {{"train_micro_batch_size_per_gpu", 1}, {"gradient_accumulation_steps", 2 / world}}, mc);
    auto engine_group = std::make_shared<comm::testing::ThreadGroup>(world);
    auto control_group = std::make_shared<comm::testing::ThreadGroup>(world);
    std::vector<double> val_loss(static_cast<size_t>(world));
    std::vector<std::thread> ranks;
    for (int r = 0; r < world; ++r)
      ranks.emplace_back([&, r] {
        comm::testing::ThreadComm engine_comm(engine_group, r), control_comm(control_group, r);
        TrainerOptions o = quiet_options(data, 1);
        o.val_data = val;
        o.val_mask = val_mask;
        o.comm = &engine_comm;
        o.control_comm = &control_comm;
        val_loss[static_cast<size_t>(r)] = Trainer(cfg, mc, o).run().final_val_loss.value_or(-1);
      });
    for (std::thread& t : ranks) t.join();
    for (double l : val_loss) EXPECT_EQ(std::memcmp(&l, val_loss.data(), sizeof l), 0);
    return val_loss[0];
  };
  for (const std::string& m : {std::string(), mask}) {
    const double one = run(1, m), two = run(2, m);
    EXPECT_TRUE(std::isfinite(two)) << "mask " << m;
    EXPECT_GT(one, 0.0);
    EXPECT_EQ(std::memcmp(&one, &two, sizeof one), 0)
        << "mask " << m << ": " << one << " vs " << two;
  }
}

// Ranks that resume different checkpoints (each resolves its save directory's `latest` on its
// own, and another run saving there may move it between them) end together before training,
// naming each rank's checkpoint.
TEST(TrainerTest, RanksThatResumedDifferentCheckpointsEndNamingThem) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  const std::string save = data.file("ck");
  {
    TrainerOptions o = quiet_options(data, 4);
    o.save_dir = save;
    o.save_every = 2;
    Trainer(make_config({}, mc), mc, o).run();
  }
  const config::Config cfg = make_config({}, mc);
  auto engine_group = std::make_shared<comm::testing::ThreadGroup>(2);
  auto control_group = std::make_shared<comm::testing::ThreadGroup>(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      comm::testing::ThreadComm engine_comm(engine_group, r), control_comm(control_group, r);
      TrainerOptions o = quiet_options(data, 6);
      o.resume_from = save + "/global_step" + std::to_string(2 * r + 2);
      o.comm = &engine_comm;
      o.control_comm = &control_comm;
      try {
        Trainer(cfg, mc, o).run();
      } catch (const InvalidArgument& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (std::thread& t : ranks) t.join();
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("the ranks resumed different checkpoints of " + save + "/global_step"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("(rank 0: global_step2, rank 1: global_step4)"), std::string::npos) << e;
  }
}

// A schedule that decays to lr 0 before the run ends says from which step on nothing is
// updated; one that ends with the run, or a warmup's first zeros, says nothing.
TEST(TrainerTest, StepsPastTheScheduleAtLrZeroAreWarned) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  const config::Config cfg = make_config({{"scheduler",
                                           {{"type", "WarmupDecayLR"},
                                            {"params",
                                             {{"warmup_min_lr", 0.0},
                                              {"warmup_max_lr", 1e-3},
                                              {"warmup_num_steps", 2},
                                              {"total_num_steps", 4}}}}}},
                                         mc);
  for (const int64_t steps : {5, 8}) {
    test::LogCapture log;
    Trainer t(cfg, mc, quiet_options(data, steps));
    const bool warned =
        log.text().find(
            "WarmupDecayLR reaches lr 0 at step 6 of the 8 steps asked for: steps 6 "
            "to 8 update no weight") != std::string::npos;
    EXPECT_EQ(warned, steps == 8) << log.text();
  }
}

// A decaying schedule longer than the run (a config written for another run) says so, with the
// lr the run ends at; one as long as the run, or "auto", says nothing.
TEST(TrainerTest, AScheduleLongerThanTheRunIsWarned) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  for (const nlohmann::json& total :
       {nlohmann::json(50), nlohmann::json(4), nlohmann::json("auto")}) {
    const config::Config cfg =
        make_config({{"scheduler",
                      {{"type", "WarmupCosineLR"},
                       {"params", {{"warmup_num_steps", 2}, {"total_num_steps", total}}}}}},
                    mc, /*total_steps=*/4);  // what "auto" takes
    test::LogCapture log;
    Trainer t(cfg, mc, quiet_options(data, 4));
    const bool warned =
        log.text().find(
            "WarmupCosineLR: scheduler.params.total_num_steps 50 is more than the 4 "
            "steps asked for: the last step trains at lr") != std::string::npos;
    EXPECT_EQ(warned, total == 50) << total << ": " << log.text();
  }
}

// Validation data that is the training data (by another path too) is taken, with a warning
// that its loss is over tokens the run trains on.
TEST(TrainerTest, ValidationDataThatIsTheTrainingDataIsWarned) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 1);
  {
    test::LogCapture log;
    Trainer t(make_config({}, mc), mc, o);
    EXPECT_EQ(log.text().find("is the training data"), std::string::npos) << log.text();
  }
  const std::string link = data.file("same.bin");
  std::filesystem::create_symlink(data.train(), link);
  o.val_data = link;
  test::LogCapture log;
  Trainer t(make_config({}, mc), mc, o);
  EXPECT_NE(log.text().find("the validation data " + link + " is the training data"),
            std::string::npos)
      << log.text();
}

// fp16 with a loss scale far beyond fp32's range: the gradients overflow, the step is
// skipped (no weight changes, no lr schedule step, no Adam step), the scale is halved.
TEST(TrainerTest, Fp16OverflowSkipsTheStepAndHalvesTheScale) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  config::Config cfg = make_config(
      {{"fp16", {{"enabled", true}, {"hysteresis", 1}}},
       {"scheduler",
        {{"type", "WarmupLR"},
         {"params",
          {{"warmup_min_lr", 1e-4}, {"warmup_num_steps", 10}, {"warmup_type", "linear"}}}}}},
      mc);
  Trainer t(cfg, mc, quiet_options(data, 10));
  ASSERT_TRUE(t.loss_scaler().dynamic());
  EXPECT_EQ(t.loss_scaler().scale(), 65536.0);  // 2^initial_scale_power
  LossScalerState s = t.loss_scaler().state();
  s.cur_scale = std::ldexp(1.0, 200);  // any gradient times this is inf in fp32
  t.loss_scaler().load_state(s);

  const auto w0 = master_weights(t);
  StepMetrics m = t.train_step();
  EXPECT_TRUE(m.skipped);
  EXPECT_FALSE(m.grad_norm.has_value());
  ASSERT_TRUE(m.loss_scale.has_value());
  EXPECT_EQ(*m.loss_scale, std::ldexp(1.0, 200));
  EXPECT_TRUE(std::isfinite(m.loss));
  EXPECT_EQ(t.loss_scaler().scale(), std::ldexp(1.0, 199));
  EXPECT_EQ(t.schedule().last_batch_iteration(), -1);
  EXPECT_EQ(t.adam_steps(), 0u);
  EXPECT_EQ(t.steps_done(), 1);
  EXPECT_EQ(master_weights(t), w0);

  // Back to a sane scale: the next step applies, with the lr the skipped step would have used.
  s = t.loss_scaler().state();
  s.cur_scale = 1024;
  t.loss_scaler().load_state(s);
  const double lr = t.schedule().lr();
  m = t.train_step();
  EXPECT_FALSE(m.skipped);
  EXPECT_EQ(m.lr, lr);
  EXPECT_EQ(t.schedule().last_batch_iteration(), 0);
  EXPECT_EQ(t.adam_steps(), 1u);
  EXPECT_NE(master_weights(t), w0) << "lr " << m.lr << " gnorm " << m.grad_norm.value_or(-1);
}

// With DeepSpeed's default hysteresis of 2, the first overflow keeps the scale.
TEST(TrainerTest, Fp16HysteresisDelaysTheHalving) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  Trainer t(make_config({{"fp16", {{"enabled", true}}}}, mc), mc, quiet_options(data, 10));
  LossScalerState s = t.loss_scaler().state();
  s.cur_scale = std::ldexp(1.0, 200);
  t.loss_scaler().load_state(s);
  EXPECT_TRUE(t.train_step().skipped);
  EXPECT_EQ(t.loss_scaler().scale(), std::ldexp(1.0, 200));
  EXPECT_TRUE(t.train_step().skipped);
  EXPECT_EQ(t.loss_scaler().scale(), std::ldexp(1.0, 199));
  EXPECT_EQ(t.adam_steps(), 0u);
}

TEST(TrainerTest, ActivationCheckpointingGivesBitIdenticalLosses) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  const config::Config cfg = make_config({{"gradient_accumulation_steps", 2}}, mc);
  TrainerOptions plain = quiet_options(data, 4), ckpt = quiet_options(data, 4);
  plain.activation_checkpointing = false;
  ckpt.activation_checkpointing = true;
  Trainer a(cfg, mc, plain), b(cfg, mc, ckpt);
  ASSERT_FALSE(a.model().options().activation_checkpointing);
  ASSERT_TRUE(b.model().options().activation_checkpointing);
  TrainResult ra = a.run(), rb = b.run();
  ASSERT_EQ(ra.losses.size(), 4u);
  EXPECT_EQ(ra.losses, rb.losses);  // exact
  EXPECT_EQ(master_weights(a), master_weights(b));
  EXPECT_EQ(ra.final_val_loss, rb.final_val_loss);
}

// outcore.compute_dtype: "auto" with bf16 enabled is bf16 compute, which differs from fp32
// compute on the same bf16 parameters (the GEMM operands are rounded) yet trains alike;
// "bf16" without bf16.enabled is refused naming the key.
TEST(TrainerTest, ComputeDtypeBf16RoundsEveryGemmOperand) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  auto run = [&](const char* compute, DType want, std::vector<std::vector<float>>* w) {
    const nlohmann::json patch = {{"bf16", {{"enabled", true}}},
                                  {"train_micro_batch_size_per_gpu", 8},
                                  {"outcore", {{"compute_dtype", compute}}}};
    Trainer t(make_config(patch, mc), mc, quiet_options(data, 12));
    EXPECT_EQ(t.model().options().param_dtype, DType::BF16) << compute;
    EXPECT_EQ(t.model().options().compute_dtype, want) << compute;
    TrainResult r = t.run();
    if (w != nullptr) *w = master_weights(t);
    return r.losses;
  };
  std::vector<std::vector<float>> w_auto, w_bf16, w_fp32;
  const std::vector<double> autod = run("auto", DType::BF16, &w_auto);
  const std::vector<double> bf16 = run("bf16", DType::BF16, &w_bf16);
  const std::vector<double> fp32 = run("fp32", DType::F32, &w_fp32);
  ASSERT_EQ(autod.size(), 12u);
  EXPECT_EQ(autod, bf16);  // exact: the same computation
  EXPECT_EQ(w_auto, w_bf16);
  EXPECT_NE(bf16.front(), fp32.front()) << "bf16 compute computed the fp32 forward";
  EXPECT_NE(w_bf16, w_fp32);
  for (size_t i = 0; i < fp32.size(); ++i)
    EXPECT_NEAR(bf16[i], fp32[i], 0.02 * fp32[i]) << "step " << i + 1;
  EXPECT_LT(bf16.back(), bf16.front() - 0.5);

  try {
    make_config({{"outcore", {{"compute_dtype", "bf16"}}}}, mc);
    ADD_FAILURE() << "bf16 compute without bf16 parameters was accepted";
  } catch (const config::ConfigValidationError& e) {
    EXPECT_NE(std::string(e.what()).find("outcore.compute_dtype"), std::string::npos) << e.what();
  }
}

TEST(TrainerTest, StopRequestEndsTheRunAfterTheStepInProgress) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  const std::string swap = data.file("swap");
  std::atomic<bool> stop{false};
  TrainerOptions o = quiet_options(data, 50);
  o.stop_requested = &stop;
  o.on_step = [&](const StepMetrics& m) {
    if (m.step == 3) stop = true;
  };
  {
    Trainer t(make_config(testing::nvme_patch(swap), mc), mc, o);
    EXPECT_GT(testing::count_files(swap), 0);  // the swap files exist while training
    TrainResult r = t.run();
    EXPECT_TRUE(r.stopped);
    EXPECT_EQ(r.steps, 3);
    EXPECT_EQ(t.steps_done(), 3);
    EXPECT_FALSE(r.final_val_loss.has_value());  // no validation on the way out
  }
  EXPECT_EQ(testing::count_files(swap), 0);  // and are gone once the trainer is
}

// An I/O error while training surfaces from run() as the engine's IoError (the command
// exits 1), after the steps before it were recorded; the swap files go with the Trainer.
TEST(TrainerTest, IoErrorWhileTrainingStopsTheRunWithTheError) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  const std::string swap = data.file("swap");
  auto faults = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
  faults->add_fault({.kind = aio::Fault::Kind::kEio, .nth = 40, .direction = 0});
  TrainerOptions o = quiet_options(data, 20);
  o.engine.io_backend = faults;
  o.metrics_file = data.file("metrics.jsonl");
  int64_t last_step = 0;
  o.on_step = [&](const StepMetrics& m) { last_step = m.step; };
  {
    Trainer t(make_config(testing::nvme_patch(swap), mc), mc, o);
    try {
      t.run();
      ADD_FAILURE() << "the injected read error was not reported";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_number(), EIO);
      EXPECT_NE(std::string(e.what()).find(swap), std::string::npos) << e.what();
    }
    EXPECT_EQ(faults->faults_fired(), 1u);
    EXPECT_GT(last_step, 0);
    EXPECT_LT(last_step, 20);
  }
  EXPECT_EQ(testing::count_files(swap), 0);
  std::ifstream in(o.metrics_file);
  int step_records = 0;
  for (std::string line; std::getline(in, line);) {
    step_records += nlohmann::json::parse(line)["type"] == "step";
  }
  EXPECT_EQ(step_records, last_step);
}

// A metrics file that can no longer be written (a full disk: here its descriptor turns into
// /dev/full's after step 2) ends the metrics, not the run: training goes on to its last step and
// saves, and the result says why the metrics stopped (the command then exits 1).
TEST(TrainerTest, AMetricsFileThatCannotBeWrittenStopsOnlyTheMetrics) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 4);
  o.metrics_file = data.file("metrics.jsonl");
  o.save_dir = data.file("ckpt");
  o.on_step = [&](const StepMetrics& m) {
    if (m.step != 2) return;
    const int full = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
    ASSERT_GE(full, 0);
    bool replaced = false;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      if (std::filesystem::read_symlink(e.path(), ec) != std::filesystem::path(o.metrics_file))
        continue;
      ASSERT_GE(::dup2(full, std::stoi(e.path().filename().string())), 0);
      replaced = true;
    }
    ::close(full);
    ASSERT_TRUE(replaced);
  };
  Trainer t(make_config(testing::nvme_patch(data.file("swap")), mc), mc, o);
  const TrainResult r = t.run();
  EXPECT_EQ(r.steps, 4);
  EXPECT_FALSE(r.stopped);
  ASSERT_EQ(r.checkpoints.size(), 1u);
  EXPECT_EQ(r.checkpoints[0].tag, "global_step4");
  EXPECT_NE(r.metrics_error.find("No space left on device"), std::string::npos) << r.metrics_error;
  EXPECT_NE(r.metrics_error.find(o.metrics_file), std::string::npos) << r.metrics_error;
  std::ifstream in(o.metrics_file);
  int step_records = 0;
  for (std::string line; std::getline(in, line);)
    step_records += nlohmann::json::parse(line)["type"] == "step";
  EXPECT_EQ(step_records, 2);
}

TEST(TrainerTest, MetricsFileHasOneRecordPerStepWithTierTraffic) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 4);
  o.metrics_file = data.file("metrics.jsonl");
  o.eval_every = 2;
  o.eval_batches = 2;
  Trainer t(make_config(testing::nvme_patch(data.file("swap")), mc), mc, o);
  TrainResult r = t.run();
  std::ifstream in(o.metrics_file);
  std::string line;
  std::vector<nlohmann::json> steps, vals;
  int starts = 0;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (j["type"] == "step") steps.push_back(j);
    if (j["type"] == "val") vals.push_back(j);
    if (j["type"] == "start") ++starts;
  }
  EXPECT_EQ(starts, 1);
  ASSERT_EQ(steps.size(), 4u);
  ASSERT_EQ(vals.size(), 2u);  // after steps 2 and 4
  EXPECT_EQ(vals[1]["step"], 4);
  for (size_t i = 0; i < steps.size(); ++i) {
    const nlohmann::json& s = steps[i];
    EXPECT_EQ(s["step"], static_cast<int>(i + 1));
    EXPECT_EQ(s["loss"].get<double>(), r.losses[i]);
    EXPECT_GT(s["tokens_per_s"].get<double>(), 0);
    EXPECT_GT(s["device_mem_peak_bytes"].get<uint64_t>(), 0u);
    EXPECT_TRUE(s.contains("grad_norm"));
    EXPECT_FALSE(s["skipped"].get<bool>());
    // Parameters and optimizer state live in swap files: every step reads them, and writes
    // them from the second step on (the I/O of a step is what moved during its wall time; the
    // optimizer step's writes finish under the next step's forward). Step 3 follows a
    // validation, under which step 2's optimizer work and the reads step 3 would make ran: its
    // own window may move nothing (AStepsIoLeavesOutTheValidationAndSaveBeforeIt).
    ASSERT_TRUE(s.contains("io") && s["io"].contains("nvme")) << s.dump();
    if (i == 2) continue;
    EXPECT_GT(s["io"]["nvme"]["read_gb_per_s"].get<double>(), 0) << s.dump();
    if (i > 0) {
      EXPECT_GT(s["io"]["nvme"]["write_gb_per_s"].get<double>(), 0) << s.dump();
    }
  }
  EXPECT_GT(r.traffic.nvme_read_bytes, 0u);
  EXPECT_GT(r.traffic.nvme_write_bytes, 0u);
}

// A step's I/O rates count the bytes moved since the last step, validation or save ended: a
// validation's parameter reads and a save's state reads are no step's. The step after each
// moves no more than a step after a step (it moved more: the validation's or save's bytes).
TEST(TrainerTest, AStepsIoLeavesOutTheValidationAndSaveBeforeIt) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 8);
  o.eval_batches = 2;
  o.save_dir = data.file("ckpt");
  Trainer t(make_config(testing::nvme_patch(data.file("swap")), mc), mc, o);
  const auto nvme_read = [](const StepMetrics& m) {
    for (const TierIo& io : m.io)
      if (io.tier == "nvme") return io.read_gb_per_s * 1e9 * m.step_time_s;
    ADD_FAILURE() << "no nvme rates";
    return 0.0;
  };
  for (int i = 0; i < 3; ++i) t.train_step();
  const double plain = nvme_read(t.train_step());
  ASSERT_GT(plain, 0);
  t.validate();
  // Its parameters gathered by the validation, the step reads less than a plain one (as much
  // when the validation's reads were counted in).
  EXPECT_LT(nvme_read(t.train_step()), plain * (1 - 1e-9)) << "after a validation";
  t.train_step();
  t.save_checkpoint();
  EXPECT_LE(nvme_read(t.train_step()), plain * (1 + 1e-9)) << "after a save";
}

// A step that a validation or a save follows (or the run's last) waits for its update: its time
// and I/O include the update's writes, which nothing after it would hide (they were no step's:
// with a validation after every step, every step showed no swap-file writes, and the run's
// tokens/s was several times what it trained at).
TEST(TrainerTest, AStepBeforeAValidationOrASaveCountsItsUpdate) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 4);
  o.eval_every = 1;
  o.eval_batches = 1;
  o.save_dir = data.file("ckpt");
  o.save_every = 3;
  std::vector<double> writes;
  o.on_step = [&](const StepMetrics& m) {
    for (const TierIo& io : m.io)
      if (io.tier == "nvme") writes.push_back(io.write_gb_per_s);
  };
  Trainer t(make_config(testing::nvme_patch(data.file("swap")), mc), mc, o);
  t.run();
  ASSERT_EQ(writes.size(), 4u);
  for (size_t i = 0; i < writes.size(); ++i) EXPECT_GT(writes[i], 0) << "step " << i + 1;
  // Saves alone, and the run's end: steps 2 and 4 wait (1 and 3 leave theirs to the next
  // forward), each moving the previous step's update, which ran under its forward, and its own:
  // two updates' writes (one, the previous step's, without the wait).
  DemoData again;
  TrainerOptions saves = quiet_options(again, 4);
  saves.save_dir = again.file("ckpt");
  saves.save_every = 2;
  std::vector<StepMetrics> steps;
  saves.on_step = [&](const StepMetrics& m) { steps.push_back(m); };
  Trainer s(make_config(testing::nvme_patch(again.file("swap")), mc), mc, saves);
  s.run();
  ASSERT_EQ(steps.size(), 4u);
  const auto written = [](const StepMetrics& m) {
    for (const TierIo& io : m.io)
      if (io.tier == "nvme") return io.write_gb_per_s * 1e9 * m.step_time_s;
    return 0.0;
  };
  const double update = static_cast<double>(s.engine().plan().per_step.nvme_write);
  ASSERT_GT(update, 0);
  EXPECT_NEAR(written(steps[1]), 2 * update, 1e-6 * update) << "step 2";
  EXPECT_NEAR(written(steps[3]), 2 * update, 1e-6 * update) << "step 4";
}

// The run's traffic includes its last step's optimizer work (which runs after the step's
// backward, under no next forward): each step more adds the same bytes. It was read without
// waiting for that work, and under-counted by a varying amount.
TEST(TrainerTest, TheRunsTrafficIncludesItsLastStep) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  std::vector<zero::TrafficStats> runs;
  for (int steps : {2, 3, 4}) {
    Trainer t(make_config(testing::nvme_patch(data.file("swap")), mc), mc,
              quiet_options(data, steps));
    runs.push_back(t.run().traffic);
  }
  const uint64_t read = runs[1].nvme_read_bytes - runs[0].nvme_read_bytes;
  const uint64_t written = runs[1].nvme_write_bytes - runs[0].nvme_write_bytes;
  EXPECT_GT(read, 0u);
  EXPECT_GT(written, 0u);
  EXPECT_EQ(runs[2].nvme_read_bytes - runs[1].nvme_read_bytes, read);
  EXPECT_EQ(runs[2].nvme_write_bytes - runs[1].nvme_write_bytes, written);
  EXPECT_EQ(runs[2].h2d_bytes - runs[1].h2d_bytes, runs[1].h2d_bytes - runs[0].h2d_bytes);
}

// The last step's optimizer work runs after its step() returned (under a next forward that never
// comes): a failure of its last write fails the run, with neither a save nor a validation to
// wait for it. The writes are counted in a first run (a zero delay fires on each), and the
// run's last one fails.
TEST(TrainerTest, AFailureInTheLastStepsOverlappedWorkFailsTheRun) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  const std::string swap = data.file("swap");
  auto run_with = [&](const aio::Fault& f) {
    auto io = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
    io->add_fault(f);
    TrainerOptions o = quiet_options(data, 3);
    o.val_data.clear();  // a validation forward would wait for the last step's updates
    o.engine.io_backend = io;
    std::string error;
    try {
      Trainer(make_config(testing::nvme_patch(swap), mc), mc, o).run();
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_number(), EIO);
      error = e.what();
    }
    EXPECT_EQ(testing::count_files(swap), 0);
    return std::pair{io->faults_fired(), error};
  };
  const auto [writes, none] = run_with({.kind = aio::Fault::Kind::kDelay,
                                        .nth = 1,
                                        .every = 1,
                                        .direction = 1,
                                        .delay = std::chrono::microseconds{0}});
  ASSERT_EQ(none, "");
  ASSERT_GT(writes, 0u);
  const auto [fired, error] =
      run_with({.kind = aio::Fault::Kind::kEio, .nth = writes, .direction = 1});
  EXPECT_EQ(fired, 1u);
  EXPECT_NE(error.find(swap), std::string::npos) << "the run did not fail: " << error;
}

// A run that saves counts a save's buffers in its plan's host memory (a run that trained fine
// was killed by a memory limit while saving); one that does not save, nothing. Here: the
// writer's 8 staging slots of the largest fp32 partition and the 4 x 32 MiB read-back ring,
// plus, with bf16 moments in swap files, a sub-group's moments widened to fp32.
TEST(TrainerTest, ARunThatSavesPlansTheHostMemoryOfItsSaves) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  auto saves_item = [](const zero::Plan& p) {
    for (const zero::PlanItem& it : p.items)
      if (it.what.find("checkpoint saves") != std::string::npos) return it.bytes;
    return uint64_t{0};
  };
  TrainerOptions o = quiet_options(data, 1);
  Trainer plain(make_config(testing::nvme_patch(data.file("swap")), mc), mc, o);
  EXPECT_EQ(saves_item(plain.engine().plan()), 0u);
  o.save_dir = data.file("ckpt");
  Trainer saving(make_config(testing::nvme_patch(data.file("swap2")), mc), mc, o);
  uint64_t largest = 0;
  for (const model::UnitLayout& ul : saving.engine().model().layout().units)
    largest = std::max<uint64_t>(largest, ul.padded_numel);
  const uint64_t buffers = 8 * largest * sizeof(float) + (uint64_t{128} << 20);
  EXPECT_EQ(saves_item(saving.engine().plan()), buffers);
  EXPECT_EQ(zero::host_need_bytes(saving.engine().plan()),
            zero::host_need_bytes(plain.engine().plan()) + buffers);
  nlohmann::json bf16_moments = testing::nvme_patch(data.file("swap3"));
  bf16_moments["optimizer"] = {{"params", {{"fp32_optimizer_states", false}}}};
  bf16_moments["zero_optimization"]["sub_group_size"] = 4096;
  o.save_dir = data.file("ckpt2");
  Trainer widening(make_config(bf16_moments, mc), mc, o);
  EXPECT_EQ(saves_item(widening.engine().plan()), buffers + 2 * sizeof(float) * 4096);
}

// fp32 has no overflow check: a diverged run must stop, naming the step, before the
// non-finite gradients are applied.
TEST(TrainerTest, NonFiniteLossWithoutAnOverflowCheckEndsTheRun) {
  DemoData data;
  const config::Config cfg = make_config(
      {{"optimizer", {{"params", {{"lr", 1e30}, {"weight_decay", 0.0}}}}}}, tiny_model());
  TrainerOptions o = quiet_options(data, 10);
  std::vector<double> losses;
  o.on_step = [&](const StepMetrics& m) { losses.push_back(m.loss); };
  Trainer tr(cfg, tiny_model(), o);
  try {
    tr.run();
    FAIL() << "a non-finite loss did not end the run";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("step " + std::to_string(losses.size() + 1) + ": the training loss is"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("fp32"), std::string::npos) << msg;
  }
  ASSERT_FALSE(losses.empty());
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_EQ(tr.steps_done(), static_cast<int64_t>(losses.size()));
}

// bf16 skips a step whose gradients are not finite (DeepSpeed's bf16.check_grad_overflow), but
// with no loss scale to lower, a run whose every step is skipped has diverged: ten in a row end
// it, naming them, instead of "training" on with the same weights to the last step.
TEST(TrainerTest, TenBf16StepsSkippedInARowEndTheRun) {
  DemoData data;
  const config::Config cfg = make_config(
      {{"bf16", {{"enabled", true}}}, {"optimizer", {{"params", {{"lr", 1e30}}}}}}, tiny_model());
  TrainerOptions o = quiet_options(data, 40);
  std::vector<bool> skipped;
  o.on_step = [&](const StepMetrics& m) { skipped.push_back(m.skipped); };
  Trainer tr(cfg, tiny_model(), o);
  try {
    tr.run();
    FAIL() << "40 steps ran; skipped: " << std::count(skipped.begin(), skipped.end(), true);
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("the gradients were not finite in 10 steps in a row"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("no loss scale to lower (bf16)"), std::string::npos) << msg;
  }
  // The steps before the first skip updated the weights; the nine recorded after it were skipped
  // and the tenth ended the run.
  ASSERT_GE(skipped.size(), 9u);
  EXPECT_TRUE(std::all_of(skipped.end() - 9, skipped.end(), [](bool s) { return s; }));
  EXPECT_EQ(tr.steps_done(), static_cast<int64_t>(skipped.size()) + 1);
}

// Ctrl-C while the swap files are being initialised (minutes for a large model) stops there,
// instead of after the whole setup, and leaves no swap file.
TEST(TrainerTest, StopRequestDuringInitialisationInterruptsIt) {
  DemoData data;
  const std::string swap = data.file("swap");
  const config::Config cfg = make_config(testing::nvme_patch(swap), tiny_model());
  std::atomic<bool> stop{true};
  TrainerOptions o = quiet_options(data, 5);
  o.stop_requested = &stop;
  auto io = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
  o.engine.io_backend = io;
  try {
    Trainer tr(cfg, tiny_model(), o);
    FAIL() << "the stop request was not honoured during initialisation";
  } catch (const Interrupted& e) {
    EXPECT_NE(std::string(e.what()).find("0 of 4 units"), std::string::npos) << e.what();
  }
  EXPECT_EQ(io->requests_seen(), 0u);  // no unit was written to its swap files
  EXPECT_EQ(testing::count_files(swap), 0);
  stop = false;
  EXPECT_NO_THROW(Trainer(cfg, tiny_model(), o));
}

TEST(TrainerTest, RefusesBadInputNamingIt) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  const config::Config cfg = make_config({}, mc);

  TrainerOptions o = quiet_options(data, 0);
  EXPECT_THROW(Trainer(cfg, mc, o), InvalidArgument);  // steps < 1

  o = quiet_options(data, 5);
  o.val_data.clear();
  o.eval_every = 5;  // validation without a validation set
  EXPECT_THROW(Trainer(cfg, mc, o), InvalidArgument);

  o = quiet_options(data, 5);
  o.seq_len = 129;  // beyond max_position_embeddings
  EXPECT_THROW(Trainer(cfg, mc, o), InvalidArgument);

  // A data file too short for one micro-batch of 4 x 32 tokens.
  const std::string short_file = data.file("short.bin");
  std::vector<uint16_t> few(100, 65);
  write_llmc_tokens(short_file, few);
  o = quiet_options(data, 5);
  o.train_data = short_file;
  try {
    Trainer t(cfg, mc, o);
    ADD_FAILURE() << "a data file too short was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(short_file), std::string::npos) << e.what();
  }

  // Bytes of text are outside a vocabulary of 64 tokens.
  nlohmann::json small = testing::tiny_model_json();
  small["vocab_size"] = 64;
  const model::LlamaConfig small_mc = model::LlamaConfig::from_json(small.dump());
  try {
    Trainer t(make_config({}, small_mc), small_mc, quiet_options(data, 5));
    ADD_FAILURE() << "tokens outside the vocabulary were accepted";
  } catch (const CorruptData& e) {
    EXPECT_NE(std::string(e.what()).find(data.train()), std::string::npos) << e.what();
  }

  // A config with a value still "auto".
  nlohmann::json j = testing::base_ds_json();
  j["optimizer"]["params"]["lr"] = "auto";
  config::Config unresolved = config::parse_config(j.dump()).config;
  config::AutoContext ctx;
  ctx.hidden_size = mc.hidden_size;
  config::resolve_auto(unresolved, ctx);  // batch sizes resolve; the lr has no source
  try {
    Trainer t(unresolved, mc, quiet_options(data, 5));
    ADD_FAILURE() << "an unresolved config was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.params.lr"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace outcore::train
