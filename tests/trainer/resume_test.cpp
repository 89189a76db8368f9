// Checkpoints through the Trainer: a run saved after k steps and resumed by a new Trainer gives
// bit-identical losses, gradient norms, loss scales and final weights to an uninterrupted run,
// for several stages, tiers and precisions, partial optimizer offload included, also when the
// resumed run places its state differently. Bad checkpoints are refused before anything is built.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <vector>

#include "aio/aio.hpp"
#include "common/error.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/train/token_file.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/trainer/trainer_test_util.hpp"

namespace outcore::train {
namespace {

namespace fs = std::filesystem;
using testing::DemoData;
using testing::make_config;
using testing::quiet_options;
using testing::tiny_model;

struct RunTrace {
  std::vector<double> losses, grad_norms, loss_scales;
  testing::Weights weights;  // at the end of the run
};

void record_steps(TrainerOptions& o, RunTrace& t) {
  o.on_step = [&t](const StepMetrics& m) {
    t.losses.push_back(m.loss);
    t.grad_norms.push_back(m.grad_norm.value_or(-1.0));
    t.loss_scales.push_back(m.loss_scale.value_or(0.0));
  };
}

void record_weights(Trainer& tr, RunTrace& t) { t.weights = testing::weights_of(tr); }

RunTrace straight(const config::Config& cfg, const DemoData& data, int64_t steps) {
  RunTrace t;
  TrainerOptions o = quiet_options(data, steps);
  record_steps(o, t);
  Trainer tr(cfg, tiny_model(), o);
  tr.run();
  record_weights(tr, t);
  return t;
}

// k steps under cfg_a saved into save_dir, then a new Trainer under cfg_b resumes to `steps`.
RunTrace resumed(const config::Config& cfg_a, const config::Config& cfg_b, const DemoData& data,
                 int64_t k, int64_t steps, const std::string& save_dir,
                 uint64_t piece_elems = uint64_t{8} << 20) {
  RunTrace t;
  {
    TrainerOptions o = quiet_options(data, k);
    o.save_dir = save_dir;
    o.checkpoint_io.piece_elems = piece_elems;
    record_steps(o, t);
    Trainer tr(cfg_a, tiny_model(), o);
    TrainResult r = tr.run();
    EXPECT_EQ(r.checkpoints.size(), 1u);
  }
  TrainerOptions o = quiet_options(data, steps);
  o.resume_from = save_dir;
  o.seed = 99;  // ignored: the checkpoint's seed fixes the data order
  record_steps(o, t);
  Trainer tr(cfg_b, tiny_model(), o);
  EXPECT_EQ(tr.steps_done(), k);
  tr.run();
  record_weights(tr, t);
  return t;
}

void expect_identical(const RunTrace& a, const RunTrace& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(a.losses[i], b.losses[i]) << "loss of step " << i + 1;
    EXPECT_EQ(a.grad_norms[i], b.grad_norms[i]) << "grad norm of step " << i + 1;
    EXPECT_EQ(a.loss_scales[i], b.loss_scales[i]) << "loss scale of step " << i + 1;
  }
  const testing::Weights &wa = a.weights, &wb = b.weights;
  ASSERT_EQ(wa.master.size(), wb.master.size());
  for (size_t u = 0; u < wa.master.size(); ++u) {
    EXPECT_EQ(0, std::memcmp(wa.master[u].data(), wb.master[u].data(), wa.master[u].size() * 4))
        << "master weights of unit " << u;
    EXPECT_EQ(wa.params[u], wb.params[u]) << "parameters of unit " << u;
  }
}

class ResumeTest : public ::testing::Test {
 protected:
  std::string dir(const std::string& name) { return data_.file(name); }
  // Trains `saved` steps of `cfg` into dir("ckpt"), then returns the options that resume from
  // there up to `steps`.
  TrainerOptions saved_then_resumed(const config::Config& cfg, int saved, int steps,
                                    const std::string& save_dir = "ckpt") {
    TrainerOptions first = quiet_options(data_, saved);
    first.save_dir = dir(save_dir);
    Trainer(cfg, tiny_model(), first).run();
    TrainerOptions o = quiet_options(data_, steps);
    o.resume_from = dir(save_dir);
    return o;
  }
  DemoData data_;
};

// WarmupLR over 10 steps: the resumed run starts mid-warmup.
nlohmann::json warmup_patch() {
  return {
      {"scheduler",
       {{"type", "WarmupLR"},
        {"params", {{"warmup_min_lr", 0.0}, {"warmup_max_lr", 3e-3}, {"warmup_num_steps", 10}}}}},
      {"gradient_clipping", 1.0}};
}

TEST_F(ResumeTest, Stage3NvmeMidWarmupIsBitIdentical) {
  nlohmann::json p = testing::nvme_patch(dir("swap"));
  p.merge_patch(warmup_patch());
  const config::Config cfg = make_config(p, tiny_model());
  const RunTrace a = straight(cfg, data_, 7);
  const RunTrace b = resumed(cfg, cfg, data_, 3, 7, dir("ckpt"));
  expect_identical(a, b);
}

// outcore.step_in_backward: a checkpoint reads each unit's current state copy (after an odd
// number of committed steps, the spare one) and a resumed run, with or without it, continues
// bit-identically to the run without it.
TEST_F(ResumeTest, StepInBackwardSavesTheCurrentCopyAndResumesBitIdentically) {
  nlohmann::json p = testing::nvme_patch(dir("swap"));
  p.merge_patch({{"gradient_clipping", 0.0}});
  const config::Config plain = make_config(p, tiny_model());
  p["outcore"]["step_in_backward"] = true;
  const config::Config in_backward = make_config(p, tiny_model());
  const RunTrace a = straight(plain, data_, 6);
  expect_identical(a, resumed(in_backward, in_backward, data_, 3, 6, dir("ckpt")));
  expect_identical(a, resumed(in_backward, plain, data_, 3, 6, dir("ckpt2")));
}

TEST_F(ResumeTest, SubGroupsAndPiecesThatDoNotAlignAreBitIdentical) {
  // Optimizer sub-groups of 3000 elements stream through the checkpoint's pieces of 5000, so
  // ranges straddle pieces when saving and reads straddle segments (unaligned) when loading.
  nlohmann::json p = testing::nvme_patch(dir("swap"));
  p.merge_patch({{"zero_optimization", {{"sub_group_size", 3000}}}, {"bf16", {{"enabled", true}}}});
  const config::Config cfg = make_config(p, tiny_model());
  expect_identical(straight(cfg, data_, 5), resumed(cfg, cfg, data_, 2, 5, dir("ckpt"), 5000));
  // The checkpoint is cut into pieces of 5000 elements.
  const ckpt::Checkpoint ck = ckpt::Checkpoint::open(dir("ckpt"));
  for (const ckpt::FileInfo& f : ck.manifest().files)
    for (const ckpt::Segment& s : f.segments) EXPECT_LE(s.count, 5000u) << f.path;
}

TEST_F(ResumeTest, PartialOptimizerOffloadIsBitIdentical) {
  // offload_optimizer.ratio 0.5: the first units' optimizer state in swap files (sub-groups of
  // 3000 elements) or host memory, the others' in device memory. Saved and resumed under the
  // same ratio, and resumed under ratio 1 (all offloaded), the run is the uninterrupted one,
  // which is itself the ratio-1 run.
  for (const char* dev : {"nvme", "cpu"}) {
    SCOPED_TRACE(dev);
    const std::string d(dev);
    nlohmann::json p = testing::nvme_patch(dir("swap_" + d));
    p.merge_patch(warmup_patch());
    p.merge_patch({{"zero_optimization",
                    {{"sub_group_size", 3000}, {"offload_optimizer", {{"device", d}}}}}});
    nlohmann::json half = p;
    half.merge_patch({{"zero_optimization", {{"offload_optimizer", {{"ratio", 0.5}}}}}});
    const config::Config c1 = make_config(p, tiny_model());
    const config::Config ch = make_config(half, tiny_model());
    {  // units 0 and 1 (embedding, layer 0) offloaded; layer 1 and the head on the device
      Trainer tr(ch, tiny_model(), quiet_options(data_, 1));
      EXPECT_EQ(tr.engine().plan().placement.device_optimizer_from, 2u);
    }
    const RunTrace a = straight(ch, data_, 6);
    expect_identical(straight(c1, data_, 6), a);
    expect_identical(a, resumed(ch, ch, data_, 3, 6, dir("ckpt_half_" + d), 5000));
    expect_identical(a, resumed(ch, c1, data_, 2, 6, dir("ckpt_full_" + d)));
  }
}

TEST_F(ResumeTest, Stage2CpuOffloadBf16IsBitIdentical) {
  nlohmann::json p = {
      {"bf16", {{"enabled", true}}},
      {"gradient_accumulation_steps", 2},
      {"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}}};
  p.merge_patch(warmup_patch());
  const config::Config cfg = make_config(p, tiny_model());
  expect_identical(straight(cfg, data_, 6), resumed(cfg, cfg, data_, 2, 6, dir("ckpt")));
}

TEST_F(ResumeTest, Bf16MomentsAreBitIdenticalAcrossTiersAndTakeFp32Checkpoints) {
  // Adam moments in bf16, optimizer state on NVMe in sub-groups of 3000 elements. The
  // checkpoint keeps moments as fp32 (bf16 widened exactly), so resuming into bf16 moments
  // narrows them back without loss: the run is the uninterrupted one, also when resumed with
  // the state in host memory.
  nlohmann::json p = testing::nvme_patch(dir("swap"));
  p.merge_patch(warmup_patch());
  p.merge_patch({{"zero_optimization", {{"sub_group_size", 3000}}},
                 {"bf16", {{"enabled", true}}},
                 {"optimizer", {{"params", {{"fp32_optimizer_states", false}}}}}});
  const config::Config cfg = make_config(p, tiny_model());
  ASSERT_TRUE(config::adam_moments_bf16(cfg));
  nlohmann::json p2 = p;
  p2.merge_patch({{"zero_optimization",
                   {{"stage", 2},
                    {"offload_param", {{"device", "none"}}},
                    {"offload_optimizer", {{"device", "cpu"}}}}}});
  const RunTrace a = straight(cfg, data_, 6);
  expect_identical(a, resumed(cfg, cfg, data_, 3, 6, dir("ckpt")));
  expect_identical(a, resumed(cfg, make_config(p2, tiny_model()), data_, 3, 6, dir("ckpt2")));
  // An fp32-moment checkpoint resumes into bf16 moments (rounded once on load) and trains on.
  nlohmann::json p32 = p;
  p32["optimizer"]["params"]["fp32_optimizer_states"] = true;
  const RunTrace c = resumed(make_config(p32, tiny_model()), cfg, data_, 3, 6, dir("ckpt32"));
  ASSERT_EQ(c.losses.size(), 6u);
  for (double l : c.losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_NE(c.weights.master, a.weights.master);  // the fp32 moments of steps 1-3 differ
}

TEST_F(ResumeTest, Fp16LossScalerStateCarriesOver) {
  // A loss-scale window of 2 doubles the scale every 2 clean steps: the resumed run must
  // continue the scaler's iteration count, not restart it.
  nlohmann::json p = {
      {"fp16", {{"enabled", true}, {"initial_scale_power", 8}, {"loss_scale_window", 2}}},
      {"zero_optimization", {{"stage", 1}}}};
  const config::Config cfg = make_config(p, tiny_model());
  const RunTrace a = straight(cfg, data_, 6);
  EXPECT_NE(a.loss_scales.front(), a.loss_scales.back());  // the scale moved
  expect_identical(a, resumed(cfg, cfg, data_, 3, 6, dir("ckpt")));
}

TEST_F(ResumeTest, ResumesUnderADifferentPlacement) {
  // Saved from stage 3 with everything on NVMe; resumed at stage 2 with the optimizer in host
  // memory and then at stage 0 in memory: the state is the same, only where it lives differs.
  nlohmann::json p3 = testing::nvme_patch(dir("swap"));
  p3.merge_patch(warmup_patch());
  nlohmann::json p2 = {
      {"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}}};
  p2.merge_patch(warmup_patch());
  nlohmann::json p0 = warmup_patch();
  const config::Config c3 = make_config(p3, tiny_model());
  const RunTrace a = straight(c3, data_, 6);
  expect_identical(a, resumed(c3, make_config(p2, tiny_model()), data_, 3, 6, dir("ckpt2")));
  expect_identical(a, resumed(make_config(p0, tiny_model()), c3, data_, 2, 6, dir("ckpt0")));
}

TEST_F(ResumeTest, CheckpointHoldsTheRunDescriptionAndVerifies) {
  const config::Config cfg = make_config(testing::nvme_patch(dir("swap")), tiny_model());
  TrainerOptions o = quiet_options(data_, 4);
  o.save_dir = dir("ckpt");
  o.save_every = 2;
  o.keep = 1;
  Trainer tr(cfg, tiny_model(), o);
  TrainResult r = tr.run();
  ASSERT_EQ(r.checkpoints.size(), 2u);                      // steps 2 and 4
  EXPECT_FALSE(fs::exists(dir("ckpt") + "/global_step2"));  // --keep 1
  ckpt::Checkpoint ck = ckpt::Checkpoint::open(dir("ckpt"));
  EXPECT_EQ(ck.manifest().tag, "global_step4");
  EXPECT_EQ(ck.manifest().step, 4);
  EXPECT_EQ(ck.manifest().zero_stage, 3);
  ck.verify();
  const nlohmann::json st = nlohmann::json::parse(ck.read_text("trainer_state.json"));
  EXPECT_EQ(st["steps_done"], 4);
  EXPECT_EQ(st["adam_steps"], 4);
  EXPECT_EQ(st["data"]["step"], 4);
  EXPECT_EQ(model::LlamaConfig::from_json(ck.read_text("config.json")).num_parameters(),
            tiny_model().num_parameters());
  EXPECT_EQ(config::parse_config(ck.read_text("ds_config.json")).config.zero_optimization.stage, 3);
  // The low-precision parameters in model.bin are the engine's.
  for (const model::UnitLayout& ul : tr.model().layout().units) {
    std::vector<std::byte> want(ul.padded_numel * 4), got(ul.padded_numel * 4);
    tr.engine().get_params(ul.index, want);
    ck.read_slab(ul.index, ckpt::ArrayKind::kParams, 0, ul.padded_numel, got);
    EXPECT_EQ(want, got) << "unit " << ul.index;
  }
}

// trainer_state.json edited by hand (the manifest's CRC of it recomputed): step counts that
// disagree with the manifest are refused naming the file, before a step runs.
TEST_F(ResumeTest, EditedStepCountsAreRefused) {
  const config::Config cfg = make_config({}, tiny_model());
  const TrainerOptions o = saved_then_resumed(cfg, 2, 4);
  const std::string ck = dir("ckpt") + "/global_step2";
  auto slurp = [](const std::string& p) {
    std::stringstream ss;
    ss << std::ifstream(p).rdbuf();
    return ss.str();
  };
  const std::string state = slurp(ck + "/trainer_state.json"),
                    manifest = slurp(ck + "/manifest.json");
  for (const auto& [key, value] : {std::pair<const char*, nlohmann::json>{"steps_done", 1000},
                                   {"adam_steps", -1},
                                   {"adam_steps", 3},
                                   {"loss_scaler", nullptr}}) {
    nlohmann::ordered_json st = nlohmann::ordered_json::parse(state);
    if (value.is_null())  // a value the loss scaler refuses: the file named too
      st["loss_scaler"]["cur_scale"] = -1;
    else
      st[key] = value;
    const std::string text = st.dump(2) + "\n";
    std::ofstream(ck + "/trainer_state.json", std::ios::trunc) << text;
    ckpt::Manifest m = ckpt::parse_manifest(manifest, "manifest.json");
    for (ckpt::FileInfo& f : m.files)
      if (f.path == "trainer_state.json") {
        f.bytes = text.size();
        f.crc32c = ckpt::crc32c(std::as_bytes(std::span(text.data(), text.size())));
      }
    std::ofstream(ck + "/manifest.json", std::ios::trunc) << ckpt::manifest_text(m);
    try {
      Trainer(cfg, tiny_model(), o).run();
      ADD_FAILURE() << key << " " << value << " was taken";
    } catch (const Error& e) {  // CorruptData; InvalidArgument for the scaler's value
      EXPECT_NE(std::string(e.what()).find(value.is_null() ? "trainer_state.json: loss scaler"
                                                           : "trainer_state.json: steps_done"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST_F(ResumeTest, CorruptCheckpointIsRefusedBeforeAnythingIsBuilt) {
  const config::Config cfg = make_config(testing::nvme_patch(dir("swap")), tiny_model());
  {
    TrainerOptions o = quiet_options(data_, 2);
    o.save_dir = dir("ckpt");
    Trainer(cfg, tiny_model(), o).run();
  }
  const std::string file = dir("ckpt") + "/global_step2/rank0/optimizer.bin";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(5000);
    char c = 0;
    f.read(&c, 1);
    f.seekp(5000);
    c = static_cast<char>(c ^ 0x10);
    f.write(&c, 1);
  }
  TrainerOptions o = quiet_options(data_, 4);
  o.resume_from = dir("ckpt");
  try {
    Trainer tr(cfg, tiny_model(), o);
    FAIL() << "a flipped byte was not detected";
  } catch (const CorruptData& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.bin: CRC32C mismatch: expected"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(testing::count_files(dir("swap")), 0);  // refused before swap files existed
}

TEST_F(ResumeTest, MismatchedModelOrBatchIsRefused) {
  const config::Config cfg = make_config({}, tiny_model());
  TrainerOptions o = saved_then_resumed(cfg, 1, 2);
  nlohmann::json bigger = testing::tiny_model_json();
  bigger["num_hidden_layers"] = 3;
  const model::LlamaConfig other = model::LlamaConfig::from_json(bigger.dump(), "other");
  EXPECT_THROW(Trainer(make_config({}, other), other, o), ConfigError);
  // The refusal says what would resume: the saved micro-batch and sequence length.
  try {
    Trainer(make_config({{"train_micro_batch_size_per_gpu", 2}}, tiny_model()), tiny_model(), o);
    ADD_FAILURE() << "another micro-batch was taken";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("the data position cannot carry over"), std::string::npos) << what;
    EXPECT_NE(what.find("Resume with --micro-batch-size " +
                        std::to_string(cfg.train_micro_batch_size_per_gpu.value()) + " --seq-len " +
                        std::to_string(o.seq_len) + " at a world size dividing"),
              std::string::npos)
        << what;
  }
  TrainerOptions seq = o;
  seq.seq_len = 16;
  EXPECT_THROW(Trainer(cfg, tiny_model(), seq), InvalidArgument);
  // Models of the same shapes that compute otherwise: heads of 8 instead of 16, another RoPE
  // base, another epsilon. The weights would be read as another model's.
  for (const auto& [key, value] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"num_attention_heads", 8}, {"rope_theta", 500000.0}, {"rms_norm_eps", 1e-2}}) {
    nlohmann::json j = testing::tiny_model_json();
    j[key] = value;
    if (key == "num_attention_heads") j["num_key_value_heads"] = 4;
    const model::LlamaConfig same_shapes = model::LlamaConfig::from_json(j.dump(), "same shapes");
    ASSERT_EQ(model::make_layout(same_shapes, 1).units[1].numel,
              model::make_layout(tiny_model(), 1).units[1].numel);
    try {
      Trainer(make_config({}, same_shapes), same_shapes, o);
      ADD_FAILURE() << key << " changed on resume was taken";
    } catch (const ConfigError& e) {  // heads: head_dim (16 -> 8) is the first key that differs
      EXPECT_EQ(e.json_path(), key == "num_attention_heads" ? "head_dim" : key) << e.what();
    }
  }
}

// The step count is the run's whole length: a checkpoint beyond it is refused, one at it has
// nothing left to train and says so.
TEST_F(ResumeTest, StepsAtOrBelowTheCheckpointsStep) {
  const config::Config cfg = make_config({}, tiny_model());
  TrainerOptions o = saved_then_resumed(cfg, 2, 1);
  try {
    Trainer(cfg, tiny_model(), o);
    ADD_FAILURE() << "--steps 1 below the checkpoint's step 2 was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("is at step 2, beyond the 1 steps asked for"),
              std::string::npos)
        << e.what();
  }
  o.steps = 2;
  Trainer tr(cfg, tiny_model(), o);
  EXPECT_NE(tr.summary().find("nothing left to train"), std::string::npos) << tr.summary();
  const TrainResult r = tr.run();
  EXPECT_EQ(r.steps, 0);
  // Its checkpoint's run validated at that step: no second validation of it.
  EXPECT_FALSE(r.final_val_loss.has_value());
  // A checkpoint saved at a step its run did not validate (every step saved, validation at the
  // end only): resumed with no step left, that step is validated.
  TrainerOptions first = quiet_options(data_, 2);
  first.save_dir = dir("every");
  first.save_every = 1;
  Trainer(cfg, tiny_model(), first).run();
  TrainerOptions at_one = quiet_options(data_, 1);
  at_one.resume_from = dir("every") + "/global_step1";
  EXPECT_TRUE(Trainer(cfg, tiny_model(), at_one).run().final_val_loss.has_value());
}

// The checkpoint's data position indexes the data it was saved over: resuming over a data file
// of another length says so (the run continues, as it may be meant to).
TEST_F(ResumeTest, ResumingOverOtherDataSaysSo) {
  const config::Config cfg = make_config({}, tiny_model());
  TrainerOptions o = saved_then_resumed(cfg, 1, 2);
  {
    test::LogCapture log;
    Trainer(cfg, tiny_model(), o).run();
    EXPECT_EQ(log.text().find("the checkpoint was saved over"), std::string::npos) << log.text();
    EXPECT_EQ(log.text().find("holds other tokens"), std::string::npos) << log.text();
  }
  const std::string shorter = dir("shorter.bin");
  {
    const train::TokenFile all = train::TokenFile::open(data_.train());
    std::vector<uint16_t> tokens(all.size() * 3 / 4);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(all[i]);
    train::write_llmc_tokens(shorter, tokens);
  }
  o.train_data = shorter;
  o.steps = 3;
  {
    test::LogCapture log;
    Trainer(cfg, tiny_model(), o).run();
    EXPECT_NE(log.text().find("the training data " + shorter + " holds"), std::string::npos)
        << log.text();
  }
  // As many tokens, other ones (a file replaced by another of the same length): said too.
  const std::string other = dir("other.bin");
  {
    const train::TokenFile all = train::TokenFile::open(data_.train());
    std::vector<uint16_t> tokens(all.size());
    for (size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = static_cast<uint16_t>(all[tokens.size() - 1 - i]);  // reversed
    train::write_llmc_tokens(other, tokens);
  }
  {
    TrainerOptions same_length = saved_then_resumed(cfg, 1, 2, "ckpt3");
    same_length.train_data = other;
    test::LogCapture log;
    Trainer(cfg, tiny_model(), same_length).run();
    EXPECT_NE(log.text().find("the training data " + other + " holds other tokens than the file"),
              std::string::npos)
        << log.text();
  }
  // The same file split otherwise: a tenth of it for validation moves tokens already trained on
  // into the validation set.
  TrainerOptions first = quiet_options(data_, 1);
  first.save_dir = dir("ckpt2");
  Trainer(cfg, tiny_model(), first).run();
  TrainerOptions split = quiet_options(data_, 2);
  split.resume_from = dir("ckpt2");
  split.val_data.clear();
  split.val_fraction = 0.1;
  test::LogCapture log;
  Trainer(cfg, tiny_model(), split).run();
  EXPECT_NE(log.text().find("the checkpoint trained on [0, "), std::string::npos) << log.text();
  EXPECT_NE(log.text().find("partly over tokens already trained on"), std::string::npos)
      << log.text();
}

TEST_F(ResumeTest, DiskFullDuringASaveKeepsThePreviousCheckpoint) {
  const config::Config cfg = make_config(testing::nvme_patch(dir("swap")), tiny_model());
  TrainerOptions o = quiet_options(data_, 4);
  o.save_dir = dir("ckpt");
  o.save_every = 2;
  auto fault = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
  o.checkpoint_io.backend = fault;
  Trainer tr(cfg, tiny_model(), o);
  tr.train_step();
  tr.train_step();
  tr.save_checkpoint();
  tr.train_step();
  tr.train_step();
  aio::Fault f;
  f.kind = aio::Fault::Kind::kEnospc;
  f.nth = fault->requests_seen() + 3;
  f.direction = 1;
  fault->add_fault(f);
  try {
    tr.save_checkpoint();
    FAIL() << "the injected ENOSPC was not reported";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC);
    EXPECT_NE(std::string(e.what()).find("global_step4.tmp"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir("ckpt") + "/global_step4.tmp"));
  EXPECT_FALSE(fs::exists(dir("ckpt") + "/global_step4"));
  ckpt::Checkpoint ck = ckpt::Checkpoint::open(dir("ckpt"));
  EXPECT_EQ(ck.manifest().tag, "global_step2");
  ck.verify();
  // Training state untouched: the run goes on and a later save succeeds.
  fault->clear_faults();
  tr.train_step();
  EXPECT_EQ(tr.save_checkpoint().tag, "global_step5");
}

TEST_F(ResumeTest, AFailedSaveInARunSaysWhatIsKept) {
  const config::Config cfg = make_config({}, tiny_model());
  TrainerOptions o = quiet_options(data_, 6);
  o.save_dir = dir("ckpt");
  o.save_every = 2;
  auto fault = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
  o.checkpoint_io.backend = fault;
  int steps = 0;
  o.on_step = [&](const StepMetrics&) {
    if (++steps == 3) {  // the save at step 4 fails
      aio::Fault f;
      f.kind = aio::Fault::Kind::kEnospc;
      f.nth = fault->requests_seen() + 2;
      fault->add_fault(f);
    }
  };
  Trainer tr(cfg, tiny_model(), o);
  try {
    tr.run();
    FAIL() << "the failed save was not reported";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("checkpoint global_step4 not saved into"), std::string::npos) << msg;
    EXPECT_NE(msg.find("No space left on device"), std::string::npos) << msg;
    EXPECT_NE(msg.find("the previous checkpoint global_step2 is intact"), std::string::npos) << msg;
  }
  ckpt::Checkpoint::open(dir("ckpt")).verify();
  std::ofstream(dir("file")) << "x";
  TrainerOptions bad = quiet_options(data_, 1);
  bad.save_dir = dir("file");
  EXPECT_THROW(Trainer(cfg, tiny_model(), bad), InvalidArgument);
}

// A run that starts over in a save directory, whose first save fails: what latest still names is
// the replaced run's checkpoint, and said to be (it was "the previous checkpoint").
TEST_F(ResumeTest, AFailedFirstSaveOfARunStartingOverSaysWhoseCheckpointIsKept) {
  const config::Config cfg = make_config({}, tiny_model());
  {
    TrainerOptions o = quiet_options(data_, 2);
    o.save_dir = dir("ckpt");
    Trainer(cfg, tiny_model(), o).run();
  }
  TrainerOptions over = quiet_options(data_, 3);
  over.save_dir = dir("ckpt");
  over.start_over = true;
  auto fault = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
  over.checkpoint_io.backend = fault;
  aio::Fault f;
  f.kind = aio::Fault::Kind::kEnospc;
  f.nth = 2;
  fault->add_fault(f);
  Trainer again(cfg, tiny_model(), over);
  try {
    again.run();
    FAIL() << "the failed save was not reported";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("checkpoint global_step3 not saved into"), std::string::npos) << msg;
    EXPECT_NE(msg.find("global_step2, the checkpoint latest names, of the run this one starts "
                       "over, is intact"),
              std::string::npos)
        << msg;
  }
  EXPECT_EQ(ckpt::Checkpoint::open(dir("ckpt")).manifest().tag, "global_step2");
}

TEST_F(ResumeTest, StopRequestSavesAfterTheStepInProgress) {
  const config::Config cfg = make_config({}, tiny_model());
  std::atomic<bool> stop{false};
  TrainerOptions o = quiet_options(data_, 50);
  o.save_dir = dir("ckpt");
  o.save_every = 100;
  o.stop_requested = &stop;
  o.on_step = [&](const StepMetrics& m) {
    if (m.step == 3) stop = true;
  };
  Trainer tr(cfg, tiny_model(), o);
  TrainResult r = tr.run();
  EXPECT_TRUE(r.stopped);
  ASSERT_EQ(r.checkpoints.size(), 1u);
  EXPECT_EQ(r.checkpoints[0].tag, "global_step3");
}

}  // namespace
}  // namespace outcore::train
