// Slab layout: Hugging Face names and shapes, aligned offsets, partition padding at any world
// size; deterministic, partitionable initialisation; dtype conversion.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "engine/model/model.hpp"
#include "tests/model/model_harness.hpp"

namespace outcore::model {
namespace {

LlamaConfig cfg(bool tied) { return testing::small_config(96, 160, 3, 6, 2, 1000, tied); }

TEST(Layout, UnitsHoldHuggingFaceTensorsInOrder) {
  ModelLayout m = make_layout(cfg(false));
  ASSERT_EQ(m.units.size(), 5u);
  EXPECT_EQ(m.units[0].kind, UnitKind::Embedding);
  EXPECT_EQ(m.units[0].tensors[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(m.units[0].tensors[0].shape, (std::vector<int64_t>{1000, 96}));
  const UnitLayout& l1 = m.units[2];
  EXPECT_EQ(l1.kind, UnitKind::Decoder);
  EXPECT_EQ(l1.layer, 1);
  EXPECT_EQ(l1.name, "layers.1");
  std::vector<std::string> names;
  for (const auto& t : l1.tensors) names.push_back(t.name);
  const std::string p = "model.layers.1.";
  EXPECT_EQ(names,
            (std::vector<std::string>{
                p + "input_layernorm.weight", p + "self_attn.q_proj.weight",
                p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight",
                p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight",
                p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"}));
  EXPECT_EQ(l1.find(p + "self_attn.k_proj.weight")->shape, (std::vector<int64_t>{32, 96}));
  EXPECT_EQ(l1.find(p + "self_attn.o_proj.weight")->shape, (std::vector<int64_t>{96, 96}));
  EXPECT_EQ(l1.find(p + "mlp.down_proj.weight")->shape, (std::vector<int64_t>{96, 160}));
  EXPECT_EQ(l1.find("nope"), nullptr);
  EXPECT_EQ(m.units[4].kind, UnitKind::Head);
  ASSERT_EQ(m.units[4].tensors.size(), 2u);
  EXPECT_EQ(m.units[4].tensors[1].name, "lm_head.weight");
}

TEST(Layout, TiedHeadHoldsOnlyTheFinalNorm) {
  ModelLayout m = make_layout(cfg(true));
  EXPECT_TRUE(m.tied);
  ASSERT_EQ(m.units.back().tensors.size(), 1u);
  EXPECT_EQ(m.units.back().tensors[0].name, "model.norm.weight");
}

TEST(Layout, OffsetsAreAlignedAndDisjointAndCountEveryParameter) {
  ModelLayout m = make_layout(cfg(false));
  uint64_t total = 0;
  for (const UnitLayout& u : m.units) {
    size_t end = 0;
    for (const TensorSpec& t : u.tensors) {
      EXPECT_EQ(t.offset % kTensorAlignElems, 0u) << t.name;
      EXPECT_GE(t.offset, end) << t.name;
      end = t.offset + t.numel;
      total += t.numel;
    }
    EXPECT_EQ(u.numel, end);
  }
  EXPECT_EQ(total, cfg(false).num_parameters());
}

TEST(Layout, PartitionsAreWholePagesAtEveryWorldSize) {
  const ModelLayout one = make_layout(cfg(false), 1);
  for (int world : {1, 2, 3, 4, 8}) {
    const ModelLayout m = make_layout(cfg(false), world);
    for (size_t i = 0; i < m.units.size(); ++i) {
      const UnitLayout& u = m.units[i];
      EXPECT_EQ(u.padded_numel % (world * kPartitionAlignElems), 0u);
      EXPECT_GE(u.padded_numel, u.numel);
      EXPECT_LT(u.padded_numel - u.numel, world * kPartitionAlignElems);
      EXPECT_EQ(u.partition_numel(world) * 4 % 4096, 0u);  // fp32
      EXPECT_EQ(u.partition_numel(world) * 2 % 4096, 0u);  // bf16 / fp16
      // Tensor offsets never depend on the world size.
      for (size_t t = 0; t < u.tensors.size(); ++t)
        EXPECT_EQ(u.tensors[t].offset, one.units[i].tensors[t].offset);
    }
  }
  EXPECT_THROW(make_layout(cfg(false), 0), InvalidArgument);
}

TEST(Init, IsDeterministicAndPartitionIndependent) {
  const ModelLayout m = make_layout(cfg(false), 1);
  const UnitLayout& u = m.units[1];
  std::vector<float> full(u.padded_numel), again(u.padded_numel), other(u.padded_numel);
  init_params(m, 1, 7, 0, u.padded_numel, full.data());
  init_params(m, 1, 7, 0, u.padded_numel, again.data());
  init_params(m, 1, 8, 0, u.padded_numel, other.data());
  EXPECT_EQ(full, again);
  EXPECT_NE(full, other);
  // Three ragged pieces give the same elements as the whole slab.
  const size_t cuts[] = {0, 1001, 9000, u.padded_numel};
  for (int p = 0; p < 3; ++p) {
    std::vector<float> part(cuts[p + 1] - cuts[p]);
    init_params(m, 1, 7, cuts[p], cuts[p + 1], part.data());
    EXPECT_TRUE(std::equal(part.begin(), part.end(), full.begin() + cuts[p])) << "piece " << p;
  }
  EXPECT_THROW(init_params(m, 1, 7, 0, u.padded_numel + 1, full.data()), InvalidArgument);
  EXPECT_THROW(init_params(m, 9, 7, 0, 1, full.data()), InvalidArgument);
}

TEST(Init, NormsAreOneWeightsAreSmallNormalsPaddingIsZero) {
  const ModelLayout m = make_layout(cfg(false));
  const UnitLayout& u = m.units[1];
  std::vector<float> s(u.padded_numel);
  init_params(m, 1, 3, 0, u.padded_numel, s.data());
  std::vector<bool> covered(u.padded_numel, false);
  for (const TensorSpec& t : u.tensors) {
    std::fill(covered.begin() + t.offset, covered.begin() + t.offset + t.numel, true);
    if (t.name.find("norm") != std::string::npos) {
      for (size_t i = 0; i < t.numel; ++i) ASSERT_EQ(s[t.offset + i], 1.0f);
      continue;
    }
    double sum = 0, sq = 0;
    for (size_t i = 0; i < t.numel; ++i)
      sum += s[t.offset + i], sq += double(s[t.offset + i]) * s[t.offset + i];
    const double mean = sum / t.numel, sd = std::sqrt(sq / t.numel - mean * mean);
    EXPECT_NEAR(mean, 0.0, 0.002) << t.name;
    EXPECT_NEAR(sd, 0.02, 0.002) << t.name;
  }
  for (size_t i = 0; i < u.padded_numel; ++i)
    if (!covered[i]) {
      ASSERT_EQ(s[i], 0.0f) << i;
    }
}

// config.json's initializer_range is the weights' standard deviation, as in Hugging Face: the
// same draws, scaled; the norms stay 1. A value that is not positive and finite is refused.
TEST(Init, TheConfigsInitializerRangeScalesTheWeights) {
  nlohmann::json j = nlohmann::json::parse(cfg(false).to_json());
  const ModelLayout base = make_layout(LlamaConfig::from_json(j.dump()));
  EXPECT_EQ(base.init_std, 0.02);
  j["initializer_range"] = 0.5;
  const LlamaConfig wide_cfg = LlamaConfig::from_json(j.dump());
  EXPECT_NE(wide_cfg.hf_extra.find("initializer_range"), std::string::npos);  // kept for export
  const ModelLayout wide = make_layout(wide_cfg);
  const UnitLayout& u = base.units[1];
  std::vector<float> a(u.padded_numel), b(u.padded_numel);
  init_params(base, 1, 3, 0, u.padded_numel, a.data());
  init_params(wide, 1, 3, 0, u.padded_numel, b.data());
  for (const TensorSpec& t : u.tensors)
    for (size_t i = t.offset; i < t.offset + t.numel; ++i) {
      if (t.name.find("norm") != std::string::npos) {
        ASSERT_EQ(b[i], 1.0f) << t.name;
        continue;
      }
      ASSERT_FLOAT_EQ(b[i], a[i] * 25.0f) << t.name << " " << i;
    }
  for (const nlohmann::json& bad : {nlohmann::json(0.0), nlohmann::json(-0.1)}) {
    j["initializer_range"] = bad;
    try {
      LlamaConfig::from_json(j.dump());
      ADD_FAILURE() << bad;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("initializer_range"), std::string::npos) << e.what();
    }
  }
}

TEST(Convert, MatchesTheScalarConversions) {
  std::vector<float> x = {0.0f,    -1.5f,       3.14159f, 1e-8f, 65504.0f,
                          -2.5e5f, 1.0f / 3.0f, 7.0f,     0.1f,  -0.2f};
  for (DType t : {DType::BF16, DType::F16}) {
    std::vector<uint16_t> low(x.size());
    std::vector<float> back(x.size());
    convert_from_fp32(x.data(), low.data(), t, x.size());
    convert_to_fp32(low.data(), t, back.data(), x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_EQ(low[i], t == DType::BF16 ? fp32_to_bf16(x[i]) : fp32_to_fp16(x[i])) << i;
      EXPECT_EQ(back[i], round_to(t, x[i])) << i;
    }
  }
}

}  // namespace
}  // namespace outcore::model
