// Hugging Face weights through the Trainer: a model trained by outcore, saved and exported with
// write_hf_model (fp32 master weights read from the checkpoint) comes back through
// TrainerOptions::init_from under another placement with the same master weights, parameters
// and validation loss, bit for bit; the float64 PyTorch reference (tests/ckpt/oracle/
// hf_oracle.py, run by /usr/bin/python3; without torch skipped, or failed under
// OUTCORE_REQUIRE_ORACLES=1) reading the exported directory gives outcore's validation loss; a
// directory that does not match the model is refused naming the tensor, before the engine is
// built.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "aio/aio.hpp"
#include "common/error.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/hf.hpp"
#include "engine/ckpt/safetensors.hpp"
#include "engine/train/data_loader.hpp"
#include "engine/train/token_file.hpp"
#include "tests/common/oracle_unavailable.hpp"
#include "tests/trainer/trainer_test_util.hpp"

namespace outcore::train {
namespace {

namespace fs = std::filesystem;
using testing::DemoData;
using testing::make_config;
using testing::quiet_options;
using testing::tiny_model;
using testing::Weights;
using testing::weights_of;

constexpr int64_t kTrainSteps = 4;

// The first element where two slabs differ, or -1.
int64_t first_difference(std::span<const std::byte> a, std::span<const std::byte> b,
                         size_t elem_bytes) {
  for (size_t i = 0; i < a.size(); i += elem_bytes)
    if (std::memcmp(a.data() + i, b.data() + i, elem_bytes) != 0)
      return static_cast<int64_t>(i / elem_bytes);
  return -1;
}

void expect_same_weights(const Weights& a, const Weights& b, size_t param_bytes) {
  ASSERT_EQ(a.master.size(), b.master.size());
  for (size_t u = 0; u < a.master.size(); ++u) {
    ASSERT_EQ(a.master[u].size(), b.master[u].size()) << "unit " << u;
    ASSERT_EQ(a.params[u].size(), b.params[u].size()) << "unit " << u;
    EXPECT_EQ(first_difference(std::as_bytes(std::span(a.master[u])),
                               std::as_bytes(std::span(b.master[u])), 4),
              -1)
        << "first master weight of unit " << u << " that differs";
    EXPECT_EQ(first_difference(a.params[u], b.params[u], param_bytes), -1)
        << "first parameter of unit " << u << " that differs";
  }
}

// Writes the fp32 master weights of the checkpoint at `ckpt_path` (verified first) as a Hugging
// Face directory `out`, in pieces that do not align with tensors or checkpoint segments.
void export_fp32(const std::string& ckpt_path, const fs::path& out) {
  const ckpt::Checkpoint ck = ckpt::Checkpoint::open(ckpt_path);
  ck.verify();
  const model::LlamaConfig cfg =
      model::LlamaConfig::from_json(ck.read_text("config.json"), ckpt_path + "/config.json");
  auto read_master = [&ck](int unit, uint64_t begin, uint64_t count, float* dst) {
    ck.read_slab(unit, ckpt::ArrayKind::kMaster, begin, count,
                 std::as_writable_bytes(std::span(dst, count)));
  };
  ckpt::write_hf_model(cfg, read_master, out, {.dtype = DType::F32, .piece_elems = 3000});
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
  ASSERT_TRUE(f.good()) << p;
}

template <typename T>
void write_array(const fs::path& p, const std::vector<T>& v) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(v.data()),
          static_cast<std::streamsize>(v.size() * sizeof(T)));
  ASSERT_TRUE(f.good()) << p;
}

std::vector<double> read_doubles(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  const std::string raw(std::istreambuf_iterator<char>(f), {});
  std::vector<double> v(raw.size() / sizeof(double));
  std::memcpy(v.data(), raw.data(), v.size() * sizeof(double));
  return v;
}

class HfRoundTripTest : public ::testing::Test {
 protected:
  std::string dir(const std::string& name) const { return data_.file(name); }

  // Trains kTrainSteps under `cfg` saving into dir("ckpt"), exports the checkpoint to dir("hf"),
  // then builds a Trainer under `init_cfg` with init_from = dir("hf"): its weights and validation
  // loss must be the trained run's.
  void expect_init_from_reproduces_training(const config::Config& cfg,
                                            const config::Config& init_cfg) {
    Weights trained;
    double trained_val = 0;
    {
      TrainerOptions o = quiet_options(data_, kTrainSteps);
      o.save_dir = dir("ckpt");
      Trainer tr(cfg, tiny_model(), o);
      const TrainResult r = tr.run();
      ASSERT_EQ(r.checkpoints.size(), 1u);
      ASSERT_TRUE(r.final_val_loss.has_value());
      trained = weights_of(tr);
      trained_val = tr.validate().loss;
      EXPECT_EQ(trained_val, *r.final_val_loss);
    }
    export_fp32(dir("ckpt"), dir("hf"));

    TrainerOptions o = quiet_options(data_, kTrainSteps);
    o.init_from = dir("hf");
    o.seed = 99;  // another random initialisation: any element not imported would show
    Trainer tr(init_cfg, tiny_model(), o);
    EXPECT_EQ(tr.steps_done(), 0);
    expect_same_weights(trained, weights_of(tr), dtype_size(tr.engine().param_dtype()));
    EXPECT_EQ(tr.validate().loss, trained_val);
    // Imported weights start a new run: the Adam moments are zero.
    for (const model::UnitLayout& ul : tr.model().layout().units) {
      const size_t n = tr.engine().partition_numel(ul.index);
      std::vector<float> m(n), a(n, 1.0f), v(n, 1.0f);
      tr.engine().read_unit_state(ul.index, m, a, v);
      EXPECT_EQ(std::count(a.begin(), a.end(), 0.0f), static_cast<long>(n)) << ul.name;
      EXPECT_EQ(std::count(v.begin(), v.end(), 0.0f), static_cast<long>(n)) << ul.name;
    }
  }

  DemoData data_;
};

TEST_F(HfRoundTripTest, Stage3NvmeRunComesBackUnderStage2CpuOffload) {
  const config::Config trained = make_config(testing::nvme_patch(dir("swap")), tiny_model());
  const config::Config init = make_config(
      {{"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}}},
      tiny_model());
  expect_init_from_reproduces_training(trained, init);
}

TEST_F(HfRoundTripTest, Bf16Stage2RunComesBackUnderStage3Nvme) {
  const config::Config trained = make_config(
      {{"bf16", {{"enabled", true}}}, {"zero_optimization", {{"stage", 2}}}}, tiny_model());
  nlohmann::json p = testing::nvme_patch(dir("swap"));
  p.merge_patch({{"bf16", {{"enabled", true}}}});
  expect_init_from_reproduces_training(trained, make_config(p, tiny_model()));
}

// The validation micro-batches exactly as Trainer::validate() reads them: the validation file in
// order (no shuffle), micro-batch and sequence length of the run, at most eval_batches.
struct ValBatches {
  std::vector<int32_t> inputs, targets;  // [n * B, T] each
  int64_t n = 0;
};

ValBatches validation_batches(const TrainerOptions& o, int64_t micro_batch) {
  auto file = std::make_shared<const TokenFile>(TokenFile::open(o.val_data, o.token_format));
  DataLoaderOptions lo;
  lo.micro_batch = micro_batch;
  lo.seq_len = o.seq_len;
  lo.shuffle = false;
  lo.vocab_size = 256;
  DataLoader loader(file, {0, file->size()}, lo, "validation");
  ValBatches b;
  b.n = std::min<int64_t>(o.eval_batches, static_cast<int64_t>(loader.batches_per_epoch()));
  const size_t per = loader.tokens_per_batch();
  b.inputs.resize(per * b.n);
  b.targets.resize(per * b.n);
  for (int64_t i = 0; i < b.n; ++i) {
    loader.next(std::span(b.inputs).subspan(i * per, per),
                std::span(b.targets).subspan(i * per, per));
  }
  return b;
}

TEST_F(HfRoundTripTest, ReferenceGivesOutcoresValidationLossOnTheExportedWeights) {
  if (std::system(OUTCORE_PYTHON " -c 'import torch' >/dev/null 2>&1") != 0)
    OUTCORE_ORACLE_UNAVAILABLE("no PyTorch for " OUTCORE_PYTHON);
  const config::Config cfg = make_config(testing::nvme_patch(dir("swap")), tiny_model());
  TrainerOptions o = quiet_options(data_, kTrainSteps);
  o.save_dir = dir("ckpt");
  Trainer tr(cfg, tiny_model(), o);
  tr.run();
  export_fp32(dir("ckpt"), dir("hf"));

  const int64_t micro = cfg.train_micro_batch_size_per_gpu.value();
  const ValBatches b = validation_batches(o, micro);
  ASSERT_GT(b.n, 1);
  const size_t per = static_cast<size_t>(micro * o.seq_len);
  std::vector<double> outcore(b.n);
  double sum = 0;
  for (int64_t i = 0; i < b.n; ++i) {
    outcore[i] = tr.engine().evaluate(b.inputs.data() + i * per, b.targets.data() + i * per);
    sum += outcore[i];
  }
  // These are the batches validate() evaluates.
  ASSERT_EQ(sum / static_cast<double>(b.n), tr.validate().loss);

  write_array(dir("inputs.bin"), b.inputs);
  write_array(dir("targets.bin"), b.targets);
  const std::string cmd =
      fmt::format("{} {}/tests/ckpt/oracle/hf_oracle.py loss {} {} {} {} {} {}", OUTCORE_PYTHON,
                  OUTCORE_SOURCE_DIR, dir("hf"), dir("inputs.bin"), dir("targets.bin"), micro,
                  o.seq_len, dir("ref_loss.bin"));
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::vector<double> ref = read_doubles(dir("ref_loss.bin"));
  ASSERT_EQ(ref.size(), static_cast<size_t>(b.n));
  double ref_sum = 0, worst = 0;
  for (int64_t i = 0; i < b.n; ++i) {
    const double rel = std::abs(outcore[i] - ref[i]) / ref[i];
    EXPECT_LT(rel, 1e-5) << "micro-batch " << i << ": outcore " << outcore[i] << ", reference "
                         << ref[i];
    worst = std::max(worst, rel);
    ref_sum += ref[i];
  }
  const double ref_mean = ref_sum / static_cast<double>(b.n);
  EXPECT_LT(std::abs(tr.validate().loss - ref_mean) / ref_mean, 1e-5);
  std::printf("[ oracle   ] validation loss %.6f, reference %.6f, worst micro-batch %.2e\n",
              tr.validate().loss, ref_mean, worst);
}

// ---------------------------------------------------------------------------------------------
// Directories that do not match the model

// Writes `cfg`'s config.json and a model.safetensors holding its tensors (value 0.5) except
// `omit`, into `dir`.
void write_hf_dir(const model::LlamaConfig& cfg, const fs::path& dir, const std::string& omit) {
  fs::create_directories(dir);
  write_text(dir / ckpt::kHfConfigFile, cfg.to_json());
  std::vector<ckpt::SafetensorsTensor> tensors;
  uint64_t elems = 0;
  for (const model::UnitLayout& u : model::make_layout(cfg).units) {
    for (const model::TensorSpec& t : u.tensors) {
      if (t.name == omit) continue;
      tensors.push_back({t.name, DType::F32, t.shape});
      elems += t.numel;
    }
  }
  ckpt::SafetensorsWriter w(dir / ckpt::kHfWeightsFile, tensors, {{"format", "pt"}});
  const std::vector<float> values(elems, 0.5f);
  w.append(std::as_bytes(std::span(values)));
  w.close();
}

class InitFromErrorsTest : public ::testing::Test {
 protected:
  // The message of the E that building a stage-3 NVMe Trainer with init_from = `hf` throws;
  // checks that it was thrown before the engine was built: no swap I/O at all (the engine writes
  // its initialisation to the swap files) and no swap file left.
  template <typename E = CorruptData>
  std::string refusal(const fs::path& hf) {
    const std::string swap = data_.file("swap");
    const config::Config cfg = make_config(testing::nvme_patch(swap), tiny_model());
    auto swap_io = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
    TrainerOptions o = quiet_options(data_, 2);
    o.init_from = hf.string();
    o.engine.io_backend = swap_io;
    std::string msg;
    try {
      Trainer tr(cfg, tiny_model(), o);
      ADD_FAILURE() << hf << " was accepted";
    } catch (const E& e) {
      msg = e.what();
    }
    EXPECT_EQ(swap_io->requests_seen(), 0u) << "swap I/O before " << hf << " was checked";
    EXPECT_EQ(testing::count_files(swap), 0);
    return msg;
  }
  DemoData data_;
};

#define EXPECT_MENTIONS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "\"" << (msg) << "\" lacks \"" << (part) << "\""

TEST_F(InitFromErrorsTest, MissingTensorIsNamed) {
  const fs::path hf = data_.file("hf");
  write_hf_dir(tiny_model(), hf, "model.layers.1.mlp.up_proj.weight");
  const std::string msg = refusal(hf);
  EXPECT_MENTIONS(msg, "model.layers.1.mlp.up_proj.weight");
  EXPECT_MENTIONS(msg, "missing");
  EXPECT_MENTIONS(msg, (hf / ckpt::kHfWeightsFile).string());
}

TEST_F(InitFromErrorsTest, OtherIntermediateSizeNamesTheMisShapedTensor) {
  nlohmann::json j = testing::tiny_model_json();
  j["intermediate_size"] = 128;
  const fs::path hf = data_.file("hf");
  write_hf_dir(model::LlamaConfig::from_json(j.dump(), "narrow"), hf, "");
  write_text(hf / ckpt::kHfConfigFile, tiny_model().to_json());  // a config.json that lies
  const std::string msg = refusal(hf);
  EXPECT_MENTIONS(msg, "model.layers.0.mlp.gate_proj.weight");
  EXPECT_MENTIONS(msg, "[128, 64]");
  EXPECT_MENTIONS(msg, "[176, 64]");
}

TEST_F(InitFromErrorsTest, ExtraLayerIsNamedAsUnexpected) {
  nlohmann::json j = testing::tiny_model_json();
  j["num_hidden_layers"] = 3;
  const fs::path hf = data_.file("hf");
  write_hf_dir(model::LlamaConfig::from_json(j.dump(), "deeper"), hf, "");
  write_text(hf / ckpt::kHfConfigFile, tiny_model().to_json());
  const std::string msg = refusal(hf);
  EXPECT_MENTIONS(msg, "model.layers.2.");
  EXPECT_MENTIONS(msg, "unexpected");
}

// Weights made for another model (same shapes, other math) are refused by the key that differs.
TEST_F(InitFromErrorsTest, ConfigThatDiffersBeyondShapesIsNamed) {
  for (const auto& [key, value] : {std::pair<std::string, nlohmann::json>{"rope_theta", 500000.0},
                                   {"rms_norm_eps", 1e-6},
                                   {"tie_word_embeddings", true}}) {
    nlohmann::json j = testing::tiny_model_json();
    j[key] = value;
    const fs::path hf = data_.file("hf_" + key);
    write_hf_dir(tiny_model(), hf, "");
    write_text(hf / ckpt::kHfConfigFile, model::LlamaConfig::from_json(j.dump(), key).to_json());
    const std::string msg = refusal<ConfigError>(hf);
    EXPECT_MENTIONS(msg, key);
    EXPECT_MENTIONS(msg, "another model");
  }
}

TEST_F(InitFromErrorsTest, DirectoryWithoutWeightsIsInvalidArgument) {
  const fs::path hf = data_.file("empty_hf");
  fs::create_directories(hf);
  const std::string msg = refusal<InvalidArgument>(hf);
  EXPECT_MENTIONS(msg, hf.string());
  EXPECT_MENTIONS(msg, ckpt::kHfWeightsFile);
}

}  // namespace
}  // namespace outcore::train
