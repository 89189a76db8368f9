// LlamaConfig: Hugging Face config.json parsing, validation, sizes and FLOPs.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "common/open_file.hpp"
#include "engine/model/model.hpp"

namespace outcore::model {
namespace {

using nlohmann::json;

// A ConfigError whose path is the key and whose message names the file.
[[noreturn]] void fail(std::string_view source, std::string key, const std::string& msg) {
  throw ConfigError(std::move(key), fmt::format("{} (in {})", msg, source));
}

// The keys of one JSON object of config.json; `prefix` is its JSON path ("" or "rope_scaling.").
struct Keys {
  const json& j;
  std::string_view source;
  std::string prefix = "";

  std::string path(const char* key) const { return prefix + key; }
  // The value of `key`, or nullptr when it is absent or null.
  const json* find(const char* key) const {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }

  int64_t get_int(const char* key, bool required, int64_t fallback) const {
    const json* v = find(key);
    if (v == nullptr) {
      if (required) fail(source, path(key), "required key is missing");
      return fallback;
    }
    if (!v->is_number_integer())
      fail(source, path(key), fmt::format("expected an integer, got {}", v->dump()));
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t{INT64_MAX})
      fail(source, path(key), fmt::format("{} is too large", v->dump()));
    return v->get<int64_t>();
  }

  double get_double(const char* key, bool required, double fallback) const {
    const json* v = find(key);
    if (v == nullptr) {
      if (required) fail(source, path(key), "required key is missing");
      return fallback;
    }
    if (!v->is_number())
      fail(source, path(key), fmt::format("expected a number, got {}", v->dump()));
    return v->get<double>();
  }

  bool get_bool(const char* key, bool fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean())
      fail(source, path(key), fmt::format("expected true or false, got {}", v->dump()));
    return v->get<bool>();
  }

  // The string value of `key`, or "" when absent or null.
  std::string get_string(const char* key) const {
    const json* v = find(key);
    if (v == nullptr) return "";
    if (!v->is_string())
      fail(source, path(key), fmt::format("expected a string, got {}", v->dump()));
    return v->get<std::string>();
  }
};

// config.json's model_type and architectures of each family.
struct TypeNames {
  ModelType type;
  const char* model_type;
  const char* architecture;
};
constexpr TypeNames kTypeNames[] = {{ModelType::kLlama, "llama", "LlamaForCausalLM"},
                                    {ModelType::kMistral, "mistral", "MistralForCausalLM"},
                                    {ModelType::kQwen2, "qwen2", "Qwen2ForCausalLM"},
                                    {ModelType::kQwen3, "qwen3", "Qwen3ForCausalLM"}};

const TypeNames& names_of(ModelType t) {
  for (const TypeNames& n : kTypeNames)
    if (n.type == t) return n;
  return kTypeNames[0];
}

// Refuses keys asking for something this model does not implement.
void refuse_unsupported(const Keys& k) {
  if (const json* v = k.find("model_type")) {
    const bool known =
        v->is_string() && std::any_of(std::begin(kTypeNames), std::end(kTypeNames),
                                      [&](const TypeNames& n) { return *v == n.model_type; });
    if (!known)
      fail(k.source, "model_type",
           fmt::format("only \"llama\", \"mistral\", \"qwen2\" and \"qwen3\" are supported, "
                       "got {}",
                       v->dump()));
  }
  if (k.get_bool("use_sliding_window", false))
    fail(k.source, "use_sliding_window", "true is not supported (attention has no window)");
  // Qwen2's q, k and v projections have biases whatever attention_bias says (Hugging Face's
  // Qwen2 reads no such key); every other family has none.
  const json* type = k.find("model_type");
  if (k.get_bool("attention_bias", false) && !(type != nullptr && *type == "qwen2"))
    fail(k.source, "attention_bias", "true is not supported (the projections have no bias)");
  if (k.get_bool("mlp_bias", false))
    fail(k.source, "mlp_bias", "true is not supported (the projections have no bias)");
  if (const json* v = k.find("hidden_act"); v != nullptr && (!v->is_string() || *v != "silu"))
    fail(k.source, "hidden_act", fmt::format("only \"silu\" is supported, got {}", v->dump()));
  if (const double p = k.get_double("attention_dropout", false, 0.0); p != 0.0)
    fail(k.source, "attention_dropout", fmt::format("only 0 is supported, got {}", p));
}

// Refuses a share of each head's dimensions rotated (Hugging Face's partial_rotary_factor, in
// the config or in its RoPE object `k`): outcore rotates them all.
void refuse_partial_rotary(const Keys& k) {
  if (const double f = k.get_double("partial_rotary_factor", false, 1.0); f != 1.0)
    fail(k.source, k.path("partial_rotary_factor"),
         fmt::format("{} is not supported (RoPE over every dimension of a head: only 1)", f));
}

// Parses one object of RoPE parameters (`rope_scaling`, or transformers 5's `rope_parameters`):
// its type in "rope_type" or, in older files, "type"; without either, `untyped` ("" refuses it).
// Values are checked later by validate().
RopeScaling parse_rope_object(const Keys& k, const char* untyped) {
  const char* type_key = k.find("rope_type") != nullptr ? "rope_type" : "type";
  std::string type = k.get_string(type_key);
  if (k.find("rope_type") != nullptr && k.find("type") != nullptr && k.get_string("type") != type)
    fail(k.source, k.path("type"),
         fmt::format("\"{}\" contradicts rope_type \"{}\"", k.get_string("type"), type));
  if (type.empty()) {
    // Scaling keys without a type: which scaling they are for is not said.
    for (const char* key :
         {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
      if (k.find(key) != nullptr)
        fail(k.source, k.path("rope_type"),
             fmt::format("required key is missing ({} is given)", key));
    type = untyped;
  }
  refuse_partial_rotary(k);
  RopeScaling s;
  if (type == "default") return s;
  if (type == "linear") {
    s.type = RopeScalingType::Linear;
    s.factor = k.get_double("factor", true, 0.0);
  } else if (type == "llama3") {
    s.type = RopeScalingType::Llama3;
    s.factor = k.get_double("factor", true, 0.0);
    s.low_freq_factor = k.get_double("low_freq_factor", true, 0.0);
    s.high_freq_factor = k.get_double("high_freq_factor", true, 0.0);
    s.original_max_position_embeddings = k.get_int("original_max_position_embeddings", true, 0);
  } else if (type.empty()) {
    fail(k.source, k.path("rope_type"), "required key is missing");
  } else {
    fail(k.source, k.path(type_key),
         fmt::format("\"{}\" is not supported (only \"linear\" and \"llama3\", which change "
                     "nothing but the rotary frequencies)",
                     type));
  }
  return s;
}

bool operator==(const RopeScaling& a, const RopeScaling& b) {
  return a.type == b.type && a.factor == b.factor && a.low_freq_factor == b.low_freq_factor &&
         a.high_freq_factor == b.high_freq_factor &&
         a.original_max_position_embeddings == b.original_max_position_embeddings;
}

// The RoPE of a config: `rope_theta` and `rope_scaling` (null, or an object), and transformers
// 5's `rope_parameters` (an object holding rope_theta and the scaling; one object per kind of
// layer is refused). Where both forms are given they must agree.
void parse_rope(const Keys& top, LlamaConfig& c) {
  c.rope_theta = top.get_double("rope_theta", false, 10000.0);
  if (const json* v = top.find("rope_scaling")) {
    if (!v->is_object())
      fail(top.source, "rope_scaling",
           fmt::format("expected an object or null, got {}", v->dump()));
    c.rope_scaling = parse_rope_object(Keys{*v, top.source, "rope_scaling."}, "");
  }
  refuse_partial_rotary(top);
  const json* v = top.find("rope_parameters");
  if (v == nullptr) return;
  if (!v->is_object())
    fail(top.source, "rope_parameters",
         fmt::format("expected an object or null, got {}", v->dump()));
  const Keys k{*v, top.source, "rope_parameters."};
  const bool per_layer_kind =
      std::any_of(v->begin(), v->end(), [](const json& member) { return member.is_object(); });
  if (per_layer_kind && k.find("rope_type") == nullptr && k.find("type") == nullptr &&
      k.find("rope_theta") == nullptr)
    fail(top.source, "rope_parameters",
         "holds neither rope_type nor rope_theta (RoPE parameters per kind of layer are not "
         "supported)");
  if (const json* t = k.find("rope_theta")) {
    const double theta = k.get_double("rope_theta", true, 0.0);
    if (top.find("rope_theta") != nullptr && theta != c.rope_theta)
      fail(top.source, "rope_parameters.rope_theta",
           fmt::format("{} contradicts rope_theta {}", t->dump(), c.rope_theta));
    c.rope_theta = theta;
  }
  const RopeScaling s = parse_rope_object(k, "default");
  if (top.find("rope_scaling") != nullptr && !(s == c.rope_scaling))
    fail(
        top.source, "rope_parameters",
        fmt::format("{} contradicts rope_scaling {}", v->dump(), top.find("rope_scaling")->dump()));
  c.rope_scaling = s;
}

// Keys of config.json that to_hf_json writes itself or that do not describe the exported model
// (its dtype is the export's; its RoPE is written as rope_theta and rope_scaling; its weights are
// not quantized); every other key is kept for Hugging Face as it was (hf_extra).
bool written_or_dropped(const std::string& key) {
  static const char* const kKeys[] = {"architectures",
                                      "model_type",
                                      "hidden_act",
                                      "hidden_size",
                                      "intermediate_size",
                                      "num_hidden_layers",
                                      "num_attention_heads",
                                      "num_key_value_heads",
                                      "head_dim",
                                      "vocab_size",
                                      "max_position_embeddings",
                                      "rope_theta",
                                      "rope_scaling",
                                      "rope_parameters",
                                      "rms_norm_eps",
                                      "tie_word_embeddings",
                                      "torch_dtype",
                                      "dtype",
                                      "quantization_config"};
  return std::any_of(std::begin(kKeys), std::end(kKeys), [&](const char* k) { return key == k; });
}

void require_positive(int64_t v, const char* key) {
  if (v <= 0) throw ConfigError(key, fmt::format("must be positive, got {}", v));
}

// A positive integer no larger than `max`.
void require_size(int64_t v, const char* key, int64_t max) {
  require_positive(v, key);
  if (v > max) throw ConfigError(key, fmt::format("{} is larger than the supported {}", v, max));
}

void require_positive_finite(double v, const std::string& key) {
  if (!(v > 0) || !std::isfinite(v))
    throw ConfigError(key, fmt::format("must be positive and finite, got {}", v));
}

// A value the kernels use in fp32: positive and finite there too (1e39 is fp32's infinity,
// 1e-50 its zero).
void require_positive_finite_fp32(double v, const std::string& key) {
  require_positive_finite(v, key);
  const float f = static_cast<float>(v);
  if (!(f > 0) || !std::isfinite(f))
    throw ConfigError(key, fmt::format("must be positive and finite in fp32 (about 1.2e-38 to "
                                       "3.4e38, where the kernels use it), got {}",
                                       v));
}

// Saturating arithmetic: sizes beyond 2^64 compare as UINT64_MAX, never wrap.
uint64_t mul_sat(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}
uint64_t add_sat(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}

// Parameter counts of a config whose dimensions are positive (saturating).
struct ParameterCounts {
  uint64_t embedding, attention, mlp, layer, total;
};

ParameterCounts count_parameters(const LlamaConfig& c) {
  const uint64_t h = c.hidden_size;
  const uint64_t q = mul_sat(c.num_attention_heads, c.head_dim);
  const uint64_t kv = mul_sat(c.num_key_value_heads, c.head_dim);
  ParameterCounts n;
  n.embedding = mul_sat(c.vocab_size, h);
  n.attention = mul_sat(2 * h, add_sat(q, kv));  // q, o: q x h; k, v: kv x h
  n.mlp = mul_sat(3 * h, c.intermediate_size);
  n.layer = add_sat(add_sat(n.attention, n.mlp), 2 * h);  // + two norms
  if (c.qk_norm()) n.layer = add_sat(n.layer, 2 * static_cast<uint64_t>(c.head_dim));
  if (c.qkv_bias()) n.layer = add_sat(n.layer, add_sat(q, 2 * kv));
  n.total = add_sat(mul_sat(c.num_hidden_layers, n.layer), h);
  n.total = add_sat(n.total, mul_sat(c.tie_word_embeddings ? 1 : 2, n.embedding));
  return n;
}

void require_parameters(uint64_t n, const char* key, int64_t value, const char* what) {
  if (n > kMaxConfigParameters)
    throw ConfigError(
        key, fmt::format("{} gives {} {}, more than the supported 2^48", value,
                         n == UINT64_MAX ? std::string(">= 2^64") : std::to_string(n), what));
}

void validate_rope_scaling(const RopeScaling& s) {
  if (s.type == RopeScalingType::None) return;
  require_positive_finite(s.factor, "rope_scaling.factor");
  if (s.type != RopeScalingType::Llama3) return;
  require_positive_finite(s.low_freq_factor, "rope_scaling.low_freq_factor");
  require_positive_finite(s.high_freq_factor, "rope_scaling.high_freq_factor");
  if (s.low_freq_factor >= s.high_freq_factor)
    throw ConfigError("rope_scaling.high_freq_factor",
                      fmt::format("{} must be greater than low_freq_factor {}", s.high_freq_factor,
                                  s.low_freq_factor));
  require_size(s.original_max_position_embeddings, "rope_scaling.original_max_position_embeddings",
               kMaxConfigDim);
}

}  // namespace

const char* family_name(ModelType t) {
  switch (t) {
    case ModelType::kMistral:
      return "Mistral";
    case ModelType::kQwen2:
      return "Qwen2";
    case ModelType::kQwen3:
      return "Qwen3";
    case ModelType::kLlama:
      break;
  }
  return "Llama";
}

// Objects and arrays nested in each other in a model config, at most: far more than any
// config has, and few enough that the keys kept for the export (hf_extra, serialized
// recursively) never run the stack out.
constexpr int kMaxModelConfigDepth = 256;

LlamaConfig LlamaConfig::from_json(std::string_view text, std::string_view source) {
  json j;
  try {
    // Linear in the text (a callback bounding the depth would make json::parse quadratic in an
    // object's members).
    j = parse_json_dom(text, {.max_depth = kMaxModelConfigDepth, .on_repeated_key = {}});
  } catch (const JsonRefused& e) {
    fail(source, "", e.what());
  } catch (const json::parse_error& e) {
    fail(source, "", fmt::format("malformed JSON at byte {}: {}", e.byte, json_message(e)));
  } catch (const json::exception& e) {  // a number out of range (1e400)
    fail(source, "", fmt::format("malformed JSON: {}", json_message(e)));
  }
  if (!j.is_object()) fail(source, "", "expected a JSON object");
  const Keys k{j, source};
  refuse_unsupported(k);
  LlamaConfig c;
  c.hidden_size = k.get_int("hidden_size", true, 0);
  c.intermediate_size = k.get_int("intermediate_size", true, 0);
  c.num_hidden_layers = k.get_int("num_hidden_layers", true, 0);
  c.num_attention_heads = k.get_int("num_attention_heads", true, 0);
  c.num_key_value_heads = k.get_int("num_key_value_heads", false, c.num_attention_heads);
  c.vocab_size = k.get_int("vocab_size", true, 0);
  c.max_position_embeddings = k.get_int("max_position_embeddings", true, 0);
  c.rms_norm_eps = k.get_double("rms_norm_eps", false, 1e-6);
  c.tie_word_embeddings = k.get_bool("tie_word_embeddings", false);
  c.initializer_range = k.get_double("initializer_range", false, 0.02);
  parse_rope(k, c);
  const std::string type = k.get_string("model_type");
  for (const TypeNames& n : kTypeNames)
    if (type == n.model_type) c.model_type = n.type;
  // Hugging Face's Qwen3Config takes 128 where head_dim is absent, not hidden / heads: the same
  // file would build another model here.
  if (c.model_type == ModelType::kQwen3 && k.find("head_dim") == nullptr)
    fail(source, "head_dim",
         "required key is missing for model_type \"qwen3\" (Hugging Face's Qwen3Config then "
         "takes 128, not hidden_size / num_attention_heads: give it)");
  // Mistral's, Qwen2's and Qwen3's configs in Hugging Face take a number of their own (8, 32,
  // 32) where num_key_value_heads is absent, not num_attention_heads as Llama's does (and as
  // null does in all four): the same file would build another model here.
  if (!k.j.contains("num_key_value_heads")) {
    const char* hf_default =
        c.model_type == ModelType::kMistral                                      ? "8"
        : c.model_type == ModelType::kQwen2 || c.model_type == ModelType::kQwen3 ? "32"
                                                                                 : nullptr;
    if (hf_default != nullptr)
      fail(source, "num_key_value_heads",
           fmt::format("required key is missing for model_type \"{}\" (Hugging Face's config "
                       "then takes {}, not num_attention_heads: give it)",
                       type, hf_default));
  }
  // Mistral: a key left out is Hugging Face's MistralConfig default, a window of 4096; null is
  // none.
  if (c.model_type == ModelType::kMistral)
    c.sliding_window = k.j.contains("sliding_window") ? k.get_int("sliding_window", false, 0)
                                                      : kMistralDefaultSlidingWindow;
  if (c.sliding_window < 0)
    fail(source, "sliding_window",
         fmt::format("must be positive or null, got {}", c.sliding_window));
  if (c.hidden_size > 0 && c.num_attention_heads > 0 &&
      c.hidden_size % c.num_attention_heads != 0 && k.find("head_dim") == nullptr)
    fail(source, "num_attention_heads",
         fmt::format("hidden_size {} is not divisible by num_attention_heads {} "
                     "(and no head_dim is given)",
                     c.hidden_size, c.num_attention_heads));
  c.head_dim = k.get_int("head_dim", false,
                         c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  try {
    c.validate();
  } catch (const ConfigError& e) {
    // A value rope_parameters gave is named there.
    std::string key = e.json_path();
    if (const json* rp = k.find("rope_parameters")) {
      if (key == "rope_theta" && Keys{*rp, source}.find("rope_theta") != nullptr)
        key = "rope_parameters.rope_theta";
      if (key.starts_with("rope_scaling."))
        key = "rope_parameters." + key.substr(std::string_view("rope_scaling.").size());
    }
    fail(source, key, std::string(e.what()).substr(e.json_path().size() + 2));
  }
  json extra = json::object();
  for (const auto& [key, value] : j.items())
    if (!written_or_dropped(key)) extra[key] = value;
  if (!extra.empty()) c.hf_extra = extra.dump();
  return c;
}

LlamaConfig LlamaConfig::load(const std::filesystem::path& path) {
  // A Hugging Face config.json is a few KiB; 16 MiB leaves room for any that exists.
  return from_json(read_whole_file(path.string(), "model config", size_t{16} << 20), path.string());
}

void LlamaConfig::validate() const {
  require_size(hidden_size, "hidden_size", kMaxConfigDim);
  require_size(intermediate_size, "intermediate_size", kMaxConfigDim);
  require_size(num_hidden_layers, "num_hidden_layers", kMaxConfigLayers);
  require_size(num_attention_heads, "num_attention_heads", kMaxConfigDim);
  require_size(num_key_value_heads, "num_key_value_heads", kMaxConfigDim);
  require_positive(vocab_size, "vocab_size");
  if (vocab_size > kMaxConfigDim)
    throw ConfigError("vocab_size", fmt::format("{} does not fit 32-bit token ids", vocab_size));
  require_size(max_position_embeddings, "max_position_embeddings", kMaxConfigDim);
  require_size(head_dim, "head_dim", kMaxConfigDim);
  if (num_attention_heads % num_key_value_heads != 0)
    throw ConfigError("num_key_value_heads",
                      fmt::format("num_attention_heads {} is not a multiple of "
                                  "num_key_value_heads {}",
                                  num_attention_heads, num_key_value_heads));
  if (head_dim % 2 != 0)
    throw ConfigError(
        "head_dim",
        fmt::format("must be even for rotary embeddings, got {}{}", head_dim,
                    head_dim * num_attention_heads == hidden_size
                        ? fmt::format(" (hidden_size {} / num_attention_heads {}: its value when "
                                      "config.json gives none)",
                                      hidden_size, num_attention_heads)
                        : std::string()));
  // Both factors are <= kMaxConfigDim, so the product cannot overflow; kv_dim <= q_dim.
  if (num_attention_heads * head_dim > kMaxConfigDim)
    throw ConfigError("head_dim", fmt::format("{} times num_attention_heads {} is larger than the "
                                              "supported {}",
                                              head_dim, num_attention_heads, kMaxConfigDim));
  const ParameterCounts n = count_parameters(*this);
  require_parameters(n.embedding, "vocab_size", vocab_size, "embedding parameters");
  require_parameters(n.mlp, "intermediate_size", intermediate_size, "MLP parameters per layer");
  require_parameters(n.attention, "hidden_size", hidden_size, "attention parameters per layer");
  if (n.total > kMaxConfigParameters) {
    // Each layer and the embedding fit: the layer count or the untied second matrix is too much.
    const bool layers = mul_sat(num_hidden_layers, n.layer) > kMaxConfigParameters / 2;
    require_parameters(n.total, layers ? "num_hidden_layers" : "vocab_size",
                       layers ? num_hidden_layers : vocab_size, "parameters in all");
  }
  require_positive_finite(rope_theta, "rope_theta");
  require_positive_finite_fp32(rms_norm_eps, "rms_norm_eps");
  require_positive_finite(initializer_range, "initializer_range");
  validate_rope_scaling(rope_scaling);
}

std::string LlamaConfig::to_json() const {
  const bool mistral = model_type == ModelType::kMistral, qwen2 = model_type == ModelType::kQwen2,
             qwen3 = model_type == ModelType::kQwen3;
  json j = {{"architectures", {names_of(model_type).architecture}},
            {"model_type", names_of(model_type).model_type},
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
            {"rope_scaling", nullptr},
            {"rms_norm_eps", rms_norm_eps},
            {"tie_word_embeddings", tie_word_embeddings}};
  if (mistral) j["sliding_window"] = sliding_window > 0 ? json(sliding_window) : json(nullptr);
  if (qwen3) j["attention_bias"] = false;
  if (qwen2 || qwen3) j["use_sliding_window"] = false;
  const RopeScaling& s = rope_scaling;
  if (s.type == RopeScalingType::Linear)
    j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", s.factor}};
  if (s.type == RopeScalingType::Llama3)
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", s.factor},
                         {"low_freq_factor", s.low_freq_factor},
                         {"high_freq_factor", s.high_freq_factor},
                         {"original_max_position_embeddings", s.original_max_position_embeddings}};
  return j.dump(2);
}

std::string LlamaConfig::to_hf_json() const {
  json j = json::parse(to_json());
  if (hf_extra.empty()) return j.dump(2);
  json out = json::parse(hf_extra);
  for (const auto& [key, value] : j.items()) out[key] = value;  // outcore's keys win
  return out.dump(2);
}

uint64_t LlamaConfig::num_parameters() const { return count_parameters(*this).total; }

double LlamaConfig::forward_flops_per_token(int64_t seq_len) const {
  const double h = hidden_size;
  const double layer_gemm = 2.0 * h * (2.0 * q_dim() + 2.0 * kv_dim() + 3.0 * intermediate_size);
  const double head = 2.0 * h * vocab_size;
  return num_hidden_layers * layer_gemm + head + attention_flops_per_token(seq_len);
}

double LlamaConfig::recompute_flops_per_token(int64_t seq_len) const {
  const double h = hidden_size;
  const double gemm = 2.0 * h * (2.0 * q_dim() + 2.0 * kv_dim() + 2.0 * intermediate_size);
  return num_hidden_layers * gemm + attention_flops_per_token(seq_len);
}

double LlamaConfig::attention_flops_per_token(int64_t seq_len) const {
  // 4 * q_dim per key, over a mean of (T + 1) / 2 keys per query
  return static_cast<double>(num_hidden_layers) * 2.0 * static_cast<double>(q_dim()) *
         static_cast<double>(seq_len + 1);
}

}  // namespace outcore::model
