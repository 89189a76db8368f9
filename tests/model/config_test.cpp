// LlamaConfig: parsing Hugging Face config.json, defaults, errors naming the key, sizes, FLOPs.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <numbers>
#include <utility>

#include "common/error.hpp"
#include "engine/model/model.hpp"
#include "tests/model/alloc_probe.hpp"

namespace outcore::model {
namespace {

using testing::AllocationProbe;

const char* kTinyLlama = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 5632, "max_position_embeddings": 2048, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 22, "num_key_value_heads": 4,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.35.0", "use_cache": true,
  "vocab_size": 32000})";

std::string with(std::string_view extra) {
  return std::string(R"({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 64)") +
         std::string(extra) + "}";
}

// Expects ConfigError whose key is `key` and whose message contains `text`.
void expect_error(const std::string& json, const std::string& key, const std::string& text) {
  try {
    LlamaConfig::from_json(json, "cfg.json");
    FAIL() << "expected ConfigError for " << key;
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.json_path(), key) << e.what();
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("cfg.json"), std::string::npos) << e.what();
  }
}

TEST(LlamaConfig, ParsesAHuggingFaceFile) {
  LlamaConfig c = LlamaConfig::from_json(kTinyLlama);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.rope_theta, 10000.0);  // absent
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_FALSE(c.tie_word_embeddings);
  // TinyLlama-1.1B's published parameter count.
  EXPECT_EQ(c.num_parameters(), 1100048384u);
}

TEST(LlamaConfig, AppliesDefaults) {
  LlamaConfig c = LlamaConfig::from_json(with(""));
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  LlamaConfig d = LlamaConfig::from_json(
      with(R"(, "head_dim": 32, "rope_theta": 500000.0, "tie_word_embeddings": true)"));
  EXPECT_EQ(d.head_dim, 32);
  EXPECT_EQ(d.q_dim(), 128);
  EXPECT_EQ(d.rope_theta, 500000.0);
  EXPECT_TRUE(d.tie_word_embeddings);
}

TEST(LlamaConfig, RoundTripsThroughItsJson) {
  LlamaConfig c = LlamaConfig::from_json(kTinyLlama);
  LlamaConfig d = LlamaConfig::from_json(c.to_json());
  EXPECT_EQ(d.to_json(), c.to_json());
  EXPECT_EQ(d.num_parameters(), c.num_parameters());
}

TEST(LlamaConfig, InconsistentHeadsAreErrorsNamingTheKey) {
  expect_error(with(R"(, "num_key_value_heads": 3)"), "num_key_value_heads", "not a multiple");
  expect_error(R"({"hidden_size": 60, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 8, "vocab_size": 100, "max_position_embeddings": 64})",
               "num_attention_heads", "not divisible");
  expect_error(with(R"(, "head_dim": 15)"), "head_dim", "even");
  // Derived (no head_dim in the file): the message says from what.
  expect_error(R"({"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 64})",
               "head_dim", "got 1 (hidden_size 4 / num_attention_heads 4: its value when");
}

TEST(LlamaConfig, MissingWrongTypeAndImpossibleValuesAreErrors) {
  expect_error(R"({"hidden_size": 64})", "intermediate_size", "missing");
  expect_error(with(R"(, "rope_theta": "big")"), "rope_theta", "number");
  expect_error(with(R"(, "tie_word_embeddings": 1)"), "tie_word_embeddings", "true or false");
  expect_error(R"({"hidden_size": 64.5, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 64})",
               "hidden_size", "integer");
  expect_error(with(R"(, "rms_norm_eps": 0)"), "rms_norm_eps", "positive");
  expect_error(with(R"(, "num_key_value_heads": 0)"), "num_key_value_heads", "positive");
  expect_error(with(R"(, "hidden_act": "gelu")"), "hidden_act", "silu");
  expect_error("{\"hidden_size\": 64,", "", "malformed JSON");
  // nlohmann's message without its "[json.exception.parse_error.101]" prefix.
  try {
    LlamaConfig::from_json("{\"hidden_size\": 64,", "t.json");
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).find("json.exception"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("parse error at line 1"), std::string::npos) << e.what();
  }
  expect_error(with(R"(, "rope_theta": 1e400)"), "", "number overflow");
  expect_error("[1, 2]", "", "JSON object");
  // Nesting deep enough to run the stack out where the unknown keys are kept for the export
  // (100000 levels did) is refused; a key nested 200 levels deep is kept.
  auto nested = [](int depth) {
    return with(", \"x\": " + std::string(depth, '[') + std::string(depth, ']'));
  };
  expect_error(nested(100000), "", "nested deeper than 256 levels");
  EXPECT_NO_THROW(LlamaConfig::from_json(nested(200), "config.json"));
  expect_error(nested(257), "", "nested deeper than 256 levels");
  // rms_norm_eps is used in fp32: beyond its range it is refused, not turned into inf or 0.
  expect_error(with(R"(, "rms_norm_eps": 1e39)"), "rms_norm_eps", "positive and finite in fp32");
  expect_error(with(R"(, "rms_norm_eps": 1e-50)"), "rms_norm_eps", "positive and finite in fp32");
  // A NUL byte would end the parse there, the keys after it dropped unread.
  expect_error(std::string("{\"hidden_size\": 64}\0{\"x\": }", 27), "", "a NUL byte at byte 19");
  EXPECT_NO_THROW(LlamaConfig::from_json(nested(255), "config.json"));  // 256 with the root
  // Many keys whose values are objects are read in time linear in the text (bounding the depth
  // with json::parse's callback made it quadratic: 60000 such keys took 30 s, these 400000 about
  // 20 minutes; under this test's timeout they take a second or two), and kept for the export.
  std::string many;
  for (int i = 0; i < 400000; ++i) many += fmt::format(", \"x{}\": {{}}", i);
  const LlamaConfig c = LlamaConfig::from_json(with(many), "config.json");
  EXPECT_NE(c.hf_extra.find("\"x399999\""), std::string::npos);
}

// Mistral (model_type "mistral"): Llama's architecture and weight names; its sliding_window is
// kept and written back (4096 where the key is left out, as in Hugging Face), and a model with a
// window refuses sequences longer than it, naming the key (attention has no window: within it the
// two are the same).
TEST(LlamaConfig, MistralIsLlamaWithItsSlidingWindowAndRoundTrips) {
  const LlamaConfig v01 =
      LlamaConfig::from_json(with(R"(, "model_type": "mistral", "num_key_value_heads": 4,
      "architectures": ["MistralForCausalLM"], "sliding_window": 32, "rope_theta": 1000000.0)"));
  EXPECT_EQ(v01.model_type, ModelType::kMistral);
  EXPECT_EQ(v01.sliding_window, 32);
  const LlamaConfig back = LlamaConfig::from_json(v01.to_json());
  EXPECT_EQ(back.model_type, ModelType::kMistral);
  EXPECT_EQ(back.sliding_window, 32);
  EXPECT_EQ(back.rope_theta, 1e6);
  EXPECT_NE(v01.to_json().find("MistralForCausalLM"), std::string::npos) << v01.to_json();
  const LlamaConfig v03 = LlamaConfig::from_json(
      with(R"(, "model_type": "mistral", "num_key_value_heads": 4, "sliding_window": null)"));
  EXPECT_EQ(v03.sliding_window, 0);
  EXPECT_NE(v03.to_json().find("\"sliding_window\": null"), std::string::npos);
  // Without the key, Hugging Face's MistralConfig default: a window of 4096, written back.
  const LlamaConfig unset =
      LlamaConfig::from_json(with(R"(, "model_type": "mistral", "num_key_value_heads": 4)"));
  EXPECT_EQ(unset.sliding_window, 4096);
  EXPECT_NE(unset.to_json().find("\"sliding_window\": 4096"), std::string::npos) << unset.to_json();
  EXPECT_EQ(LlamaConfig::from_json(with("")).model_type, ModelType::kLlama);
  EXPECT_EQ(LlamaConfig::from_json(with("")).to_json().find("sliding_window"), std::string::npos);
  expect_error(with(R"(, "model_type": "mistral", "num_key_value_heads": 4, "sliding_window": -1)"),
               "sliding_window", "positive");

  EXPECT_NO_THROW(LlamaModel(v01, ModelOptions{.micro_batch = 1, .seq_len = 32}));
  EXPECT_NO_THROW(LlamaModel(v03, ModelOptions{.micro_batch = 1, .seq_len = 64}));
  try {
    LlamaModel m(v01, ModelOptions{.micro_batch = 1, .seq_len = 33});
    ADD_FAILURE() << "a sequence longer than the sliding window was accepted";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.json_path(), "sliding_window") << e.what();
    EXPECT_NE(std::string(e.what()).find("at most 32"), std::string::npos) << e.what();
  }
}

// Qwen3 (model_type "qwen3"): Qwen3-0.6B's config.json; head_dim given (q_dim 2048 over hidden
// 1024), a q_norm and a k_norm of head_dim per layer, written back as Qwen3;
// use_sliding_window true is refused naming the key.
TEST(LlamaConfig, Qwen3HasPerHeadQkNormsAndRoundTrips) {
  const char* qwen3_06b = R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";
  const LlamaConfig c = LlamaConfig::from_json(qwen3_06b);
  EXPECT_EQ(c.model_type, ModelType::kQwen3);
  EXPECT_TRUE(c.qk_norm());
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.q_dim(), 2048);
  // 151936 x 1024 tied embedding; per layer q 2048x1024, k and v 1024x1024, o 1024x2048, MLP
  // 3 x 1024x3072, two norms of 1024 and two of 128; the final norm.
  EXPECT_EQ(c.num_parameters(), 596049920u);
  const ModelLayout layout = make_layout(c);
  EXPECT_NE(layout.units[1].find("model.layers.0.self_attn.q_norm.weight"), nullptr);
  EXPECT_NE(layout.units[1].find("model.layers.0.self_attn.k_norm.weight"), nullptr);
  uint64_t counted = 0;
  for (const UnitLayout& u : layout.units)
    for (const TensorSpec& t : u.tensors) counted += t.numel;
  EXPECT_EQ(counted, c.num_parameters());
  const LlamaConfig back = LlamaConfig::from_json(c.to_json());
  EXPECT_EQ(back.model_type, ModelType::kQwen3);
  EXPECT_EQ(back.head_dim, 128);
  EXPECT_NE(c.to_json().find("Qwen3ForCausalLM"), std::string::npos);
  EXPECT_EQ(LlamaConfig::from_json(kTinyLlama).num_parameters(), 1100048384u);  // no q/k norms
  std::string sliding(qwen3_06b);
  sliding.replace(sliding.find("\"use_sliding_window\": false"), 27,
                  "\"use_sliding_window\": true");
  expect_error(sliding.replace(0, 0, ""), "use_sliding_window", "not supported");
}

// Qwen2 / Qwen2.5 (model_type "qwen2"): Qwen2.5-0.5B's config.json; biases on the q, k and v
// projections (initialised to 0), written back as Qwen2; its sliding_window is unused.
TEST(LlamaConfig, Qwen2HasQkvBiasesAndRoundTrips) {
  const char* qwen25_05b = R"({
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": true, "use_sliding_window": false,
    "vocab_size": 151936})";
  const LlamaConfig c = LlamaConfig::from_json(qwen25_05b);
  EXPECT_EQ(c.model_type, ModelType::kQwen2);
  EXPECT_TRUE(c.qkv_bias());
  EXPECT_EQ(c.sliding_window, 0);
  // Qwen2.5-0.5B's 494,032,768 parameters, the q, k and v biases included.
  EXPECT_EQ(c.num_parameters(), 494032768u);
  const ModelLayout layout = make_layout(c);
  const TensorSpec* qb = layout.units[1].find("model.layers.0.self_attn.q_proj.bias");
  ASSERT_NE(qb, nullptr);
  EXPECT_EQ(qb->numel, 896u);
  EXPECT_NE(layout.units[1].find("model.layers.0.self_attn.v_proj.bias"), nullptr);
  std::vector<float> init(layout.units[1].padded_numel, 7.0f);
  init_params(layout, 1, 3, 0, init.size(), init.data());
  for (size_t i = 0; i < qb->numel; ++i) ASSERT_EQ(init[qb->offset + i], 0.0f);  // biases: 0
  uint64_t counted = 0;
  for (const UnitLayout& u : layout.units)
    for (const TensorSpec& t : u.tensors) counted += t.numel;
  EXPECT_EQ(counted, c.num_parameters());
  const LlamaConfig back = LlamaConfig::from_json(c.to_json());
  EXPECT_EQ(back.model_type, ModelType::kQwen2);
  EXPECT_NE(c.to_json().find("Qwen2ForCausalLM"), std::string::npos);
}

TEST(LlamaConfig, FeaturesTheModelLacksAreRefusedNamingTheKey) {
  expect_error(with(R"(, "model_type": "gemma")"), "model_type", "\"gemma\"");
  expect_error(with(R"(, "model_type": 7)"), "model_type", "llama");
  expect_error(with(R"(, "attention_bias": true)"), "attention_bias", "not supported");
  expect_error(with(R"(, "attention_bias": "no")"), "attention_bias", "true or false");
  expect_error(with(R"(, "mlp_bias": true)"), "mlp_bias", "not supported");
  expect_error(with(R"(, "mlp_bias": 0)"), "mlp_bias", "true or false");
  expect_error(with(R"(, "hidden_act": "gelu_pytorch_tanh")"), "hidden_act", "gelu_pytorch_tanh");
  expect_error(with(R"(, "hidden_act": 1)"), "hidden_act", "silu");
  expect_error(with(R"(, "attention_dropout": 0.1)"), "attention_dropout", "0.1");
  expect_error(with(R"(, "attention_dropout": "none")"), "attention_dropout", "number");
  expect_error(with(R"(, "tie_word_embeddings": "true")"), "tie_word_embeddings", "true or false");
  // What Llama files say when they ask for nothing more is accepted.
  const LlamaConfig c = LlamaConfig::from_json(
      with(R"(, "model_type": "llama", "attention_bias": false, "mlp_bias": false,
               "hidden_act": "silu", "attention_dropout": 0.0, "rope_scaling": null)"));
  EXPECT_EQ(c.rope_scaling.type, RopeScalingType::None);
}

TEST(LlamaConfig, RopeScalingTypesThatChangeMoreThanFrequenciesAreRefusedByName) {
  for (const char* type : {"dynamic", "yarn", "longrope", "su", "llama4"}) {
    SCOPED_TRACE(type);
    expect_error(
        with(fmt::format(R"(, "rope_scaling": {{"rope_type": "{}", "factor": 2.0}})", type)),
        "rope_scaling.rope_type", fmt::format("\"{}\" is not supported", type));
    expect_error(with(fmt::format(R"(, "rope_scaling": {{"type": "{}", "factor": 2.0}})", type)),
                 "rope_scaling.type", fmt::format("\"{}\" is not supported", type));
  }
  expect_error(with(R"(, "rope_scaling": {"factor": 2.0})"), "rope_scaling.rope_type", "missing");
  expect_error(with(R"(, "rope_scaling": {"rope_type": 1, "factor": 2.0})"),
               "rope_scaling.rope_type", "string");
  expect_error(with(R"(, "rope_scaling": "linear")"), "rope_scaling", "object");
  expect_error(with(R"(, "rope_scaling": {"rope_type": "linear", "type": "dynamic",
                                          "factor": 2.0})"),
               "rope_scaling.type", "contradicts");
}

TEST(LlamaConfig, RopeScalingLinearAndLlama3AreReadAndRoundTripped) {
  const LlamaConfig lin =
      LlamaConfig::from_json(with(R"(, "rope_scaling": {"type": "linear", "factor": 2.5})"));
  EXPECT_EQ(lin.rope_scaling.type, RopeScalingType::Linear);
  EXPECT_EQ(lin.rope_scaling.factor, 2.5);
  // Llama 3.1 8B's rope_scaling, verbatim.
  const LlamaConfig l3 = LlamaConfig::from_json(with(R"(, "rope_theta": 500000.0,
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"})"));
  EXPECT_EQ(l3.rope_scaling.type, RopeScalingType::Llama3);
  EXPECT_EQ(l3.rope_scaling.factor, 8.0);
  EXPECT_EQ(l3.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(l3.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(l3.rope_scaling.original_max_position_embeddings, 8192);
  for (const LlamaConfig* c : {&lin, &l3}) {
    const LlamaConfig back = LlamaConfig::from_json(c->to_json());
    EXPECT_EQ(back.to_json(), c->to_json());
    EXPECT_EQ(back.rope_scaling.type, c->rope_scaling.type);
    EXPECT_EQ(back.rope_scaling.factor, c->rope_scaling.factor);
    EXPECT_EQ(back.rope_scaling.low_freq_factor, c->rope_scaling.low_freq_factor);
    EXPECT_EQ(back.rope_scaling.high_freq_factor, c->rope_scaling.high_freq_factor);
    EXPECT_EQ(back.rope_scaling.original_max_position_embeddings,
              c->rope_scaling.original_max_position_embeddings);
  }
  // "default" is plain RoPE.
  EXPECT_EQ(LlamaConfig::from_json(with(R"(, "rope_scaling": {"rope_type": "default"})"))
                .rope_scaling.type,
            RopeScalingType::None);
}

// transformers 5 writes RoPE as one object, rope_parameters: read as rope_theta and
// rope_scaling are, written back in that form; where both forms are given they must agree, and
// parameters per kind of layer are refused.
TEST(LlamaConfig, RopeParametersOfTransformers5AreReadAsRopeThetaAndScaling) {
  const LlamaConfig v5 = LlamaConfig::from_json(with(R"(, "rope_parameters": {
      "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})"));
  const LlamaConfig v4 = LlamaConfig::from_json(with(R"(, "rope_theta": 500000.0,
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_type": "llama3"})"));
  EXPECT_EQ(v5.to_json(), v4.to_json());
  EXPECT_EQ(v5.rope_theta, 500000.0);
  EXPECT_EQ(v5.rope_scaling.type, RopeScalingType::Llama3);
  EXPECT_EQ(v5.hf_extra, "") << "rope_parameters is written as rope_theta and rope_scaling";
  const LlamaConfig plain = LlamaConfig::from_json(
      with(R"(, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0})"));
  EXPECT_EQ(plain.rope_theta, 1e6);
  EXPECT_EQ(plain.rope_scaling.type, RopeScalingType::None);
  // Both forms, agreeing: accepted.
  EXPECT_EQ(LlamaConfig::from_json(with(R"(, "rope_theta": 1000000.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0})"))
                .rope_theta,
            1e6);
  expect_error(with(R"(, "rope_theta": 10000.0,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0})"),
               "rope_parameters.rope_theta", "contradicts rope_theta");
  expect_error(with(R"(, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                  "rope_parameters": {"rope_type": "linear", "factor": 4.0})"),
               "rope_parameters", "contradicts rope_scaling");
  expect_error(with(R"(, "rope_parameters": {"rope_type": "yarn", "factor": 4.0})"),
               "rope_parameters.rope_type", "\"yarn\" is not supported");
  expect_error(with(R"(, "rope_parameters": {"full_attention": {"rope_type": "default"}})"),
               "rope_parameters", "per kind of layer");
  expect_error(with(R"(, "rope_parameters": 10000)"), "rope_parameters", "object");
  // An empty object is plain RoPE, as in transformers 5; a bad value there is named there.
  EXPECT_EQ(LlamaConfig::from_json(with(R"(, "rope_parameters": {})")).rope_scaling.type,
            RopeScalingType::None);
  expect_error(with(R"(, "rope_parameters": {"factor": 8.0, "rope_theta": 500000.0})"),
               "rope_parameters.rope_type", "missing (factor is given)");
  expect_error(with(R"(, "rope_parameters": {"rope_type": "linear", "factor": -2.0})"),
               "rope_parameters.factor", "positive");
  expect_error(with(R"(, "rope_parameters": {"rope_type": "default", "rope_theta": -1.0})"),
               "rope_parameters.rope_theta", "positive");
  // A share of each head's dimensions rotated: Hugging Face reads it, outcore rotates them all.
  expect_error(with(R"(, "partial_rotary_factor": 0.5)"), "partial_rotary_factor", "not supported");
  expect_error(
      with(R"(, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5})"),
      "rope_parameters.partial_rotary_factor", "not supported");
  EXPECT_EQ(LlamaConfig::from_json(with(R"(, "partial_rotary_factor": 1.0)")).head_dim, 16);
}

// Keys outcore does not act on are kept for Hugging Face (to_hf_json), outside the architecture
// (to_json); the dtype, the quantization and the RoPE's other form are not.
TEST(LlamaConfig, KeysItDoesNotActOnAreKeptForHuggingFace) {
  const LlamaConfig c = LlamaConfig::from_json(kTinyLlama);
  const nlohmann::json extra = nlohmann::json::parse(c.hf_extra);
  EXPECT_EQ(extra["bos_token_id"], 1);
  EXPECT_EQ(extra["eos_token_id"], 2);
  EXPECT_EQ(extra["initializer_range"], 0.02);
  for (const char* dropped : {"torch_dtype", "hidden_size", "rope_scaling", "architectures"})
    EXPECT_FALSE(extra.contains(dropped)) << dropped;
  const nlohmann::json hf = nlohmann::json::parse(c.to_hf_json());
  EXPECT_EQ(hf["eos_token_id"], 2);
  EXPECT_EQ(hf["hidden_size"], 2048);
  EXPECT_FALSE(nlohmann::json::parse(c.to_json()).contains("eos_token_id"));
  const LlamaConfig back = LlamaConfig::from_json(c.to_hf_json());
  EXPECT_EQ(back.to_hf_json(), c.to_hf_json());
  EXPECT_EQ(back.to_json(), c.to_json());
}

// Hugging Face's Qwen3Config takes head_dim 128 where it is absent (not hidden / heads): such a
// file is refused rather than read as another model. Qwen2's projections have biases whatever
// attention_bias says.
TEST(LlamaConfig, Qwen3WithoutHeadDimIsRefusedAndQwen2IgnoresAttentionBias) {
  expect_error(with(R"(, "model_type": "qwen3", "num_key_value_heads": 4)"), "head_dim",
               "takes 128");
  EXPECT_EQ(LlamaConfig::from_json(
                with(R"(, "model_type": "qwen3", "num_key_value_heads": 4, "head_dim": 32)"))
                .head_dim,
            32);
  const LlamaConfig q2 = LlamaConfig::from_json(
      with(R"(, "model_type": "qwen2", "num_key_value_heads": 4, "attention_bias": true)"));
  EXPECT_TRUE(q2.qkv_bias());
  expect_error(
      with(R"(, "model_type": "mistral", "num_key_value_heads": 4, "attention_bias": true)"),
      "attention_bias", "not supported");
}

// Mistral's, Qwen2's and Qwen3's configs in Hugging Face take 8, 32 and 32 key/value heads where
// the key is absent, Llama's the number of heads (null is the number of heads in all four):
// a file without it is refused rather than read as another model.
TEST(LlamaConfig, KeyValueHeadsAbsentAreRefusedWhereHuggingFaceTakesANumberOfItsOwn) {
  expect_error(with(R"(, "model_type": "mistral")"), "num_key_value_heads", "then takes 8");
  expect_error(with(R"(, "model_type": "qwen2")"), "num_key_value_heads", "then takes 32");
  expect_error(with(R"(, "model_type": "qwen3", "head_dim": 16)"), "num_key_value_heads",
               "then takes 32");
  EXPECT_EQ(LlamaConfig::from_json(with("")).num_key_value_heads, 4);
  EXPECT_EQ(LlamaConfig::from_json(with(R"(, "model_type": "llama")")).num_key_value_heads, 4);
  for (const char* type : {"mistral", "qwen2"}) {
    const std::string t(type);
    EXPECT_EQ(LlamaConfig::from_json(
                  with(R"(, "model_type": ")" + t + R"(", "num_key_value_heads": null)"))
                  .num_key_value_heads,
              4)
        << type;
    EXPECT_EQ(
        LlamaConfig::from_json(with(R"(, "model_type": ")" + t + R"(", "num_key_value_heads": 2)"))
            .num_key_value_heads,
        2)
        << type;
  }
}

TEST(LlamaConfig, RopeScalingValuesAreCheckedNamingTheKey) {
  const std::string l3 = R"("rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64)";
  auto llama3 = [&](const std::string& change) {
    return with(R"(, "rope_scaling": {)" + l3 + change + "}");
  };
  EXPECT_EQ(LlamaConfig::from_json(llama3("")).rope_scaling.type, RopeScalingType::Llama3);
  expect_error(with(R"(, "rope_scaling": {"rope_type": "linear"})"), "rope_scaling.factor",
               "missing");
  expect_error(with(R"(, "rope_scaling": {"rope_type": "linear", "factor": 0})"),
               "rope_scaling.factor", "positive");
  expect_error(with(R"(, "rope_scaling": {"rope_type": "linear", "factor": -2})"),
               "rope_scaling.factor", "-2");
  expect_error(with(R"(, "rope_scaling": {"rope_type": "linear", "factor": "2"})"),
               "rope_scaling.factor", "number");
  expect_error(llama3(R"(, "factor": 0.0)"), "rope_scaling.factor", "positive");
  expect_error(llama3(R"(, "low_freq_factor": -1.0)"), "rope_scaling.low_freq_factor", "-1");
  expect_error(llama3(R"(, "high_freq_factor": 0)"), "rope_scaling.high_freq_factor", "positive");
  expect_error(llama3(R"(, "high_freq_factor": 1.0)"), "rope_scaling.high_freq_factor",
               "greater than low_freq_factor");
  expect_error(llama3(R"(, "low_freq_factor": 5.0)"), "rope_scaling.high_freq_factor",
               "greater than low_freq_factor 5");
  expect_error(llama3(R"(, "original_max_position_embeddings": 0)"),
               "rope_scaling.original_max_position_embeddings", "positive");
  expect_error(llama3(R"(, "original_max_position_embeddings": 64.5)"),
               "rope_scaling.original_max_position_embeddings", "integer");
  for (const char* key :
       {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
    std::string json = with(R"(, "rope_scaling": {)" + l3 + "}");
    const size_t at = json.find(std::string("\"") + key + "\"");
    json.replace(at, 1 + std::strlen(key) + 1, std::string("\"x_") + key + "\"");
    expect_error(json, std::string("rope_scaling.") + key, "missing");
  }
  // validate() checks a config built in code the same way.
  LlamaConfig c = LlamaConfig::from_json(llama3(""));
  c.rope_scaling.low_freq_factor = 4.0;
  EXPECT_THROW(c.validate(), ConfigError);
}

// Runs from_json on `json` with the allocation probe armed: a ConfigError naming `key` and
// `value`, thrown within a second having allocated under a mebibyte.
void expect_refused_cheaply(const std::string& json, const std::string& key,
                            const std::string& value) {
  SCOPED_TRACE(key + " " + value);
  std::string path, what;
  size_t bytes = 0;
  const auto start = std::chrono::steady_clock::now();
  {
    AllocationProbe probe;
    try {
      LlamaConfig::from_json(json, "cfg.json");
    } catch (const ConfigError& e) {
      path = e.json_path();
      what = e.what();
    } catch (const std::bad_alloc&) {
      what = "std::bad_alloc";
    }
    bytes = probe.bytes();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(path, key) << what;
  EXPECT_NE(what.find(value), std::string::npos) << what;
  EXPECT_LT(bytes, size_t{1} << 20);
  EXPECT_LT(seconds, 1.0);
}

// The base config with `changes` (a JSON object) merged over it.
std::string with_sizes(const std::string& changes) {
  nlohmann::json j = nlohmann::json::parse(with(""));
  j.merge_patch(nlohmann::json::parse(changes));
  return j.dump();
}

TEST(LlamaConfig, AbsurdSizesAreRefusedBeforeAnythingIsAllocated) {
  expect_refused_cheaply(with_sizes(R"({"num_hidden_layers": 1000000000})"), "num_hidden_layers",
                         "1000000000");
  expect_refused_cheaply(with_sizes(R"({"intermediate_size": 1000000000000})"), "intermediate_size",
                         "1000000000000");
  // head_dim itself fits 32 bits, but q_dim = 4 heads * 1e9 does not.
  expect_refused_cheaply(with_sizes(R"({"head_dim": 1000000000})"), "head_dim", "1000000000");
  expect_refused_cheaply(with_sizes(R"({"num_hidden_layers": 1000000000,
      "intermediate_size": 1000000000000, "head_dim": 1000000000})"),
                         "intermediate_size", "1000000000000");
  for (const char* key : {"hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                          "max_position_embeddings", "head_dim"}) {
    expect_refused_cheaply(with_sizes(fmt::format(R"({{"{}": 4294967296}})", key)), key,
                           "4294967296");
    expect_refused_cheaply(with_sizes(fmt::format(R"({{"{}": -3}})", key)), key, "-3");
  }
  expect_refused_cheaply(with_sizes(R"({"num_hidden_layers": 0})"), "num_hidden_layers", "0");
  // Beyond int64: refused as too large, not wrapped.
  expect_refused_cheaply(with_sizes(R"({"vocab_size": 18446744073709551615})"), "vocab_size",
                         "too large");
}

// A micro-batch whose activations could not be sized in 64 bits is refused before anything is
// sized (the planner's figures wrapped around before: a config far too large said "fits").
TEST(LlamaModel, MicroBatchesTooLargeToSizeAreRefused) {
  const LlamaConfig wide = LlamaConfig::from_json(R"({"hidden_size": 64,
      "intermediate_size": 1048576, "num_hidden_layers": 4, "num_attention_heads": 4,
      "vocab_size": 256, "max_position_embeddings": 1048576})");
  auto make = [&](int64_t micro) {
    LlamaModel m(wide, {.micro_batch = micro, .seq_len = 1 << 20, .planning_only = true});
    return m.hidden_bytes();
  };
  EXPECT_EQ(make(1), uint64_t{1} << 28);
  for (const int64_t micro : {int64_t{512}, int64_t{65536}, int64_t{299542}}) {
    try {
      make(micro);
      ADD_FAILURE() << "micro " << micro << " accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("tokens"), std::string::npos) << e.what();
    }
  }
}

TEST(LlamaConfig, DerivedParameterCountsAreCheckedWithoutOverflow) {
  // Every dimension within its limit, but a product is not.
  expect_refused_cheaply(with_sizes(R"({"hidden_size": 1073741824, "num_attention_heads": 1,
      "num_key_value_heads": 1, "vocab_size": 1000000})"),
                         "vocab_size", "embedding parameters");
  expect_refused_cheaply(with_sizes(R"({"hidden_size": 1073741824, "num_attention_heads": 1,
      "num_key_value_heads": 1, "vocab_size": 2, "intermediate_size": 2147483647})"),
                         "intermediate_size", "MLP parameters per layer");
  expect_refused_cheaply(with_sizes(R"({"hidden_size": 33554432, "num_attention_heads": 1,
      "num_key_value_heads": 1, "vocab_size": 2, "intermediate_size": 2})"),
                         "hidden_size", "attention parameters per layer");
  // A Llama 3 70B layer (~8.6e8 parameters) a million times.
  expect_refused_cheaply(with_sizes(R"({"hidden_size": 8192, "intermediate_size": 28672,
      "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 1000000})"),
                         "num_hidden_layers", "parameters in all");
  // Untied: two vocab x hidden matrices of 2^47.5 each.
  expect_refused_cheaply(with_sizes(R"({"hidden_size": 131072, "num_attention_heads": 1,
      "num_key_value_heads": 1, "intermediate_size": 2, "vocab_size": 1500000000})"),
                         "vocab_size", "parameters in all");
  // 2^18 layers of exactly 2^46 parameters: 2^64, which plain uint64 arithmetic wraps to 0.
  expect_refused_cheaply(with_sizes(R"({"hidden_size": 65536, "num_attention_heads": 1,
      "num_key_value_heads": 1, "head_dim": 268435454, "intermediate_size": 2, "vocab_size": 2,
      "num_hidden_layers": 262144})"),
                         "num_hidden_layers", ">= 2^64");
  // At the limits, checks pass without allocating: a million tiny layers, a 2^31 - 1 context.
  AllocationProbe probe;
  const LlamaConfig c = LlamaConfig::from_json(
      with_sizes(R"({"num_hidden_layers": 1000000, "max_position_embeddings": 2147483647})"));
  EXPECT_EQ(c.num_hidden_layers, 1000000);
  EXPECT_EQ(c.num_parameters(),
            uint64_t{100} * 64 * 2 + 64 + uint64_t{1000000} * (4 * 64 * 64 + 3 * 64 * 128 + 128));
  EXPECT_LT(probe.bytes(), size_t{1} << 20);
}

TEST(LlamaConfig, ConfigsBuiltInCodeAreCheckedBeforeLayoutOrModelAllocate) {
  const LlamaConfig base = LlamaConfig::from_json(with(""));
  LlamaConfig layers = base, inter = base, head_dim = base, all = base;
  layers.num_hidden_layers = all.num_hidden_layers = 1000000000;
  inter.intermediate_size = all.intermediate_size = 1000000000000;
  head_dim.head_dim = all.head_dim = 1000000000;
  const std::pair<const LlamaConfig*, const char*> configs[] = {{&layers, "num_hidden_layers"},
                                                                {&inter, "intermediate_size"},
                                                                {&head_dim, "head_dim"},
                                                                {&all, "intermediate_size"}};
  for (const auto& [c, key] : configs) {
    for (int what = 0; what < 3; ++what) {
      SCOPED_TRACE(fmt::format("{} {}", key, what));
      std::string path;
      size_t bytes = 0;
      {
        AllocationProbe probe;
        try {
          if (what == 0) c->validate();
          if (what == 1) make_layout(*c, 1);
          if (what == 2) (void)LlamaModel(*c, ModelOptions{.seq_len = 8});
        } catch (const ConfigError& e) {
          path = e.json_path();
        } catch (const std::bad_alloc&) {
          path = "std::bad_alloc";
        }
        bytes = probe.bytes();
      }
      EXPECT_EQ(path, key);
      EXPECT_LT(bytes, size_t{1} << 20);
    }
  }
}

// Rotary inverse frequencies of Llama 3.1 8B: kept, blended or divided by the factor.
TEST(RopeInvFreq, FollowsRopeScaling) {
  LlamaConfig c = LlamaConfig::from_json(with(R"(, "head_dim": 128, "rope_theta": 500000.0)"));
  auto base = [](int j) { return std::pow(500000.0, -2.0 * j / 128.0); };
  std::vector<double> f = rope_inv_freq(c);
  ASSERT_EQ(f.size(), 64u);
  for (int j = 0; j < 64; ++j) EXPECT_DOUBLE_EQ(f[j], base(j)) << j;

  c.rope_scaling = {.type = RopeScalingType::Linear, .factor = 2.5};
  f = rope_inv_freq(c);
  for (int j = 0; j < 64; ++j) EXPECT_DOUBLE_EQ(f[j], base(j) / 2.5) << j;

  c.rope_scaling = {.type = RopeScalingType::Llama3,
                    .factor = 8.0,
                    .low_freq_factor = 1.0,
                    .high_freq_factor = 4.0,
                    .original_max_position_embeddings = 8192};
  f = rope_inv_freq(c);
  int kept = 0, blended = 0, divided = 0;
  for (int j = 0; j < 64; ++j) {
    const double wavelength = 2 * std::numbers::pi / base(j);
    if (wavelength < 8192.0 / 4) {
      EXPECT_DOUBLE_EQ(f[j], base(j)) << j;
      ++kept;
    } else if (wavelength > 8192.0) {
      EXPECT_DOUBLE_EQ(f[j], base(j) / 8) << j;
      ++divided;
    } else {
      // s = 1 at wavelength L/4 (kept) falling to 0 at L (divided by 8).
      const double s = (8192.0 / wavelength - 1) / 3;
      EXPECT_GT(s, 0) << j;
      EXPECT_LT(s, 1) << j;
      EXPECT_NEAR(f[j], base(j) * (s + (1 - s) / 8), 1e-15 * base(j)) << j;
      ++blended;
    }
  }
  // head_dim 128, theta 5e5, L 8192: wavelengths 2*pi * 5e5^(j/64) split 29 / 6 / 29.
  EXPECT_EQ(kept, 29);
  EXPECT_EQ(blended, 6);
  EXPECT_EQ(divided, 29);
}

TEST(LlamaConfig, LoadNamesAMissingFile) {
  EXPECT_THROW(LlamaConfig::load("/nonexistent/outcore/config.json"), IoError);
  const auto p = std::filesystem::temp_directory_path() / "outcore_model_config_test.json";
  std::ofstream(p) << with(R"(, "num_key_value_heads": 2)");
  EXPECT_EQ(LlamaConfig::load(p).num_key_value_heads, 2);
  std::ofstream(p) << with(R"(, "num_key_value_heads": 3)");
  try {
    LlamaConfig::load(p);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
  }
  std::filesystem::remove(p);
}

TEST(LlamaConfig, FlopsCountEveryGemmAndCausalAttention) {
  LlamaConfig c = LlamaConfig::from_json(with(R"(, "num_key_value_heads": 2)"));
  const int64_t T = 32;
  // per layer: q,o 64x64, k,v 64x32, gate/up/down 64x128 -> multiply-adds per token
  const double layer_macs = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128;
  const double attention = 4.0 * 64 * (T + 1) / 2;  // QK^T and PV over (t+1) keys on average
  const double head = 2.0 * 64 * 100;
  EXPECT_DOUBLE_EQ(c.forward_flops_per_token(T), 2 * (2 * layer_macs + attention) + head);
  EXPECT_DOUBLE_EQ(c.attention_flops_per_token(T), 2 * attention);
  // Checkpointing's recomputation: every layer's forward but the down projection.
  const double again_macs = 64 * 64 * 2 + 64 * 32 * 2 + 2 * 64 * 128;
  EXPECT_DOUBLE_EQ(c.recompute_flops_per_token(T), 2 * (2 * again_macs + attention));
  EXPECT_DOUBLE_EQ(c.train_flops_per_token(T), 3 * c.forward_flops_per_token(T));
}

}  // namespace
}  // namespace outcore::model
