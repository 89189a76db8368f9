// LlamaConfig: Hugging Face config.json parsing, validation, sizes and FLOPs.
#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.hpp"
#include "engine/model/model.hpp"

namespace outcore::model {
namespace {

using nlohmann::json;

// A ConfigError whose path is the key and whose message names the file.
[[noreturn]] void fail(std::string_view source, std::string key, const std::string& msg) {
  throw ConfigError(std::move(key), fmt::format("{} (in {})", msg, source));
}

int64_t get_int(const json& j, std::string_view source, const char* key, bool required,
                int64_t fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) fail(source, key, "required key is missing");
    return fallback;
  }
  if (!it->is_number_integer())
    fail(source, key, fmt::format("expected an integer, got {}", it->dump()));
  return it->get<int64_t>();
}

double get_double(const json& j, std::string_view source, const char* key, double fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number()) fail(source, key, fmt::format("expected a number, got {}", it->dump()));
  return it->get<double>();
}

bool get_bool(const json& j, std::string_view source, const char* key, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean())
    fail(source, key, fmt::format("expected true or false, got {}", it->dump()));
  return it->get<bool>();
}

void require_positive(int64_t v, const char* key) {
  if (v <= 0) throw ConfigError(key, fmt::format("must be positive, got {}", v));
}

}  // namespace

LlamaConfig LlamaConfig::from_json(std::string_view text, std::string_view source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    fail(source, "", fmt::format("malformed JSON at byte {}: {}", e.byte, e.what()));
  }
  if (!j.is_object()) fail(source, "", "expected a JSON object");
  LlamaConfig c;
  c.hidden_size = get_int(j, source, "hidden_size", true, 0);
  c.intermediate_size = get_int(j, source, "intermediate_size", true, 0);
  c.num_hidden_layers = get_int(j, source, "num_hidden_layers", true, 0);
  c.num_attention_heads = get_int(j, source, "num_attention_heads", true, 0);
  c.num_key_value_heads = get_int(j, source, "num_key_value_heads", false, c.num_attention_heads);
  c.vocab_size = get_int(j, source, "vocab_size", true, 0);
  c.max_position_embeddings = get_int(j, source, "max_position_embeddings", true, 0);
  c.rope_theta = get_double(j, source, "rope_theta", 10000.0);
  c.rms_norm_eps = get_double(j, source, "rms_norm_eps", 1e-6);
  c.tie_word_embeddings = get_bool(j, source, "tie_word_embeddings", false);
  if (c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads != 0 &&
      !j.contains("head_dim"))
    fail(source, "num_attention_heads",
         fmt::format("hidden_size {} is not divisible by num_attention_heads {} "
                     "(and no head_dim is given)",
                     c.hidden_size, c.num_attention_heads));
  c.head_dim = get_int(j, source, "head_dim", false,
                       c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  if (auto it = j.find("hidden_act"); it != j.end() && !it->is_null()) {
    if (!it->is_string() || it->get<std::string>() != "silu")
      fail(source, "hidden_act", fmt::format("only \"silu\" is supported, got {}", it->dump()));
  }
  try {
    c.validate();
  } catch (const ConfigError& e) {
    fail(source, e.json_path(), std::string(e.what()).substr(e.json_path().size() + 2));
  }
  return c;
}

LlamaConfig LlamaConfig::load(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path.string(), errno == 0 ? ENOENT : errno, "open model config");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw IoError(path.string(), EIO, "read model config");
  return from_json(ss.str(), path.string());
}

void LlamaConfig::validate() const {
  require_positive(hidden_size, "hidden_size");
  require_positive(intermediate_size, "intermediate_size");
  require_positive(num_hidden_layers, "num_hidden_layers");
  require_positive(num_attention_heads, "num_attention_heads");
  require_positive(num_key_value_heads, "num_key_value_heads");
  require_positive(vocab_size, "vocab_size");
  require_positive(max_position_embeddings, "max_position_embeddings");
  require_positive(head_dim, "head_dim");
  if (num_attention_heads % num_key_value_heads != 0)
    throw ConfigError("num_key_value_heads",
                      fmt::format("num_attention_heads {} is not a multiple of "
                                  "num_key_value_heads {}",
                                  num_attention_heads, num_key_value_heads));
  if (head_dim % 2 != 0)
    throw ConfigError("head_dim",
                      fmt::format("must be even for rotary embeddings, got {}", head_dim));
  if (!(rope_theta > 0))
    throw ConfigError("rope_theta", fmt::format("must be positive, got {}", rope_theta));
  if (!(rms_norm_eps > 0))
    throw ConfigError("rms_norm_eps", fmt::format("must be positive, got {}", rms_norm_eps));
  if (vocab_size > (int64_t{1} << 31) - 1)
    throw ConfigError("vocab_size", fmt::format("{} does not fit 32-bit token ids", vocab_size));
}

std::string LlamaConfig::to_json() const {
  json j = {{"architectures", {"LlamaForCausalLM"}},
            {"model_type", "llama"},
            {"hidden_act", "silu"},
            {"hidden_size", hidden_size},
            {"intermediate_size", intermediate_size},
            {"num_hidden_layers", num_hidden_layers},
            {"num_attention_heads", num_attention_heads},
            {"num_key_value_heads", num_key_value_heads},
            {"head_dim", head_dim},
            {"vocab_size", vocab_size},
            {"max_position_embeddings", max_position_embeddings},
            {"rope_theta", rope_theta},
            {"rms_norm_eps", rms_norm_eps},
            {"tie_word_embeddings", tie_word_embeddings}};
  return j.dump(2);
}

uint64_t LlamaConfig::num_parameters() const {
  const uint64_t h = hidden_size, v = vocab_size;
  const uint64_t layer = h * q_dim() * 2 + h * kv_dim() * 2 + 3 * h * intermediate_size + 2 * h;
  return v * h + num_hidden_layers * layer + h + (tie_word_embeddings ? 0 : v * h);
}

double LlamaConfig::forward_flops_per_token(int64_t seq_len) const {
  const double h = hidden_size;
  const double layer_gemm = 2.0 * h * (2.0 * q_dim() + 2.0 * kv_dim() + 3.0 * intermediate_size);
  const double attention = 2.0 * q_dim() * (seq_len + 1);  // 4 * q_dim * mean keys (T+1)/2
  const double head = 2.0 * h * vocab_size;
  return num_hidden_layers * (layer_gemm + attention) + head;
}

}  // namespace outcore::model
