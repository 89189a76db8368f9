// LlamaConfig: parsing Hugging Face config.json, defaults, errors naming the key, sizes, FLOPs.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "common/error.hpp"
#include "engine/model/model.hpp"

namespace outcore::model {
namespace {

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
  expect_error("[1, 2]", "", "JSON object");
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
  EXPECT_DOUBLE_EQ(c.train_flops_per_token(T), 3 * c.forward_flops_per_token(T));
}

}  // namespace
}  // namespace outcore::model
