// The model families (Mistral, Qwen2 with q/k/v biases, Qwen3 with per-head q/k norms and its
// own head_dim) train bit-identically with ZeRO-3 and parameters and optimizer state on NVMe
// as with stage 0 in memory, as Llama does: every tier moves their extra tensors alike.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/train/trainer.hpp"
#include "tests/trainer/trainer_test_util.hpp"

namespace outcore::train {
namespace {

using testing::DemoData;
using testing::make_config;
using testing::nvme_patch;
using testing::quiet_options;
using testing::tiny_model_json;
using testing::Weights;
using testing::weights_of;

struct Family {
  const char* name;
  model::ModelType type;
  nlohmann::json patch;  // merged into tiny_model_json()
};

class Families : public ::testing::TestWithParam<Family> {};

TEST_P(Families, Stage3OnNvmeTrainsBitIdenticallyToStage0InMemory) {
  DemoData data;
  nlohmann::json mj = tiny_model_json();
  mj.merge_patch(GetParam().patch);
  const model::LlamaConfig mc = model::LlamaConfig::from_json(mj.dump(), GetParam().name);
  ASSERT_EQ(mc.model_type, GetParam().type);
  const nlohmann::json gas = {{"gradient_accumulation_steps", 2}};
  nlohmann::json s3 = nvme_patch(data.file("swap"));
  s3.merge_patch(gas);
  auto run = [&](const nlohmann::json& patch, Weights* w) {
    Trainer t(make_config(patch, mc), mc, quiet_options(data, 3));
    const TrainResult r = t.run();
    *w = weights_of(t);
    return r;
  };
  Weights w0, w3;
  const TrainResult r0 = run(gas, &w0), r3 = run(s3, &w3);
  ASSERT_EQ(r0.losses.size(), 3u);
  EXPECT_EQ(r0.losses, r3.losses);
  EXPECT_EQ(r0.final_val_loss, r3.final_val_loss);
  EXPECT_EQ(w0.master, w3.master);
  EXPECT_EQ(w0.params, w3.params);
  EXPECT_LT(r0.losses.back(), r0.losses.front());
}

INSTANTIATE_TEST_SUITE_P(
    Trainer, Families,
    ::testing::Values(
        Family{"mistral",
               model::ModelType::kMistral,
               {{"model_type", "mistral"}, {"sliding_window", 4096}}},
        Family{"qwen2",
               model::ModelType::kQwen2,
               {{"model_type", "qwen2"}, {"tie_word_embeddings", true}}},
        Family{"qwen3", model::ModelType::kQwen3, {{"model_type", "qwen3"}, {"head_dim", 32}}}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace outcore::train
