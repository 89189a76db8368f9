#include "engine/data/tokenizer.hpp"

#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "engine/data/backend.hpp"
#include "engine/data/utf8.hpp"

namespace outcore::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr size_t kMaxConfigBytes = size_t{64} << 20;

// DIR/name parsed, or null when the file is not there.
json read_optional_json(const fs::path& dir, const char* name) {
  const fs::path path = dir / name;
  std::error_code ec;
  if (!fs::exists(path, ec)) return json();
  json j = parse_json_file(read_whole_file(path.string(), "tokenizer config", kMaxConfigBytes),
                           path.string(), {.max_depth = kMaxJsonFileDepth, .on_repeated_key = {}},
                           [](const std::string& why) { throw ConfigError("", why); });
  if (!j.is_object())
    throw ConfigError("", fmt::format("{}: must hold a JSON object", path.string()));
  return j;
}

// The token a config names under `key` (a string, or an object with "content"): its text, or
// nullopt when the key is absent or null.
std::optional<std::string> named_token(const json& config, const char* key,
                                       const std::string& file) {
  if (!config.is_object() || !config.contains(key) || config[key].is_null()) return std::nullopt;
  const json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  throw ConfigError(key, fmt::format("must be a token (a string, or an object with \"content\"), "
                                     "got {} (in {})",
                                     json_brief(v), file));
}

// The id of the BOS or EOS token (`key` "bos_token" or "eos_token"): named by
// tokenizer_config.json, else special_tokens_map.json, else the backend's own.
std::optional<uint32_t> special_id(const detail::Backend& backend, const fs::path& dir,
                                   const json& config, const json& map, const char* key,
                                   std::optional<uint32_t> own) {
  const std::string config_file = (dir / "tokenizer_config.json").string();
  const std::string map_file = (dir / "special_tokens_map.json").string();
  std::optional<std::string> name = named_token(config, key, config_file);
  std::string file = config_file;
  if (!name && !(config.is_object() && config.contains(key))) {
    name = named_token(map, key, map_file);
    file = map_file;
  }
  if (!name) return own;
  const std::optional<uint32_t> id = backend.token_id(*name);
  if (!id)
    throw ConfigError(key,
                      fmt::format("\"{}\" is not a token of the tokenizer (in {})", *name, file));
  return id;
}

// tokenizer_config.json's add_bos_token / add_eos_token: nullopt when absent.
std::optional<bool> flag(const json& config, const char* key, const std::string& file) {
  if (!config.is_object() || !config.contains(key) || config[key].is_null()) return std::nullopt;
  if (!config[key].is_boolean())
    throw ConfigError(
        key, fmt::format("must be true or false, got {} (in {})", json_brief(config[key]), file));
  return config[key].get<bool>();
}

// The tokens tokenizer.json `json_path` adds that `backend` does not have as pieces of the same
// ids (a chat template's <|im_start|> on a Mistral model, a <pad> past the model's pieces), shown
// as "\"<content>\" (id N)".
std::vector<std::pair<std::string, std::string>> added_tokens_not_pieces(
    const detail::Backend& backend, const std::string& json_path) {
  json root;
  try {
    root = parse_json_dom(read_whole_file(json_path, "tokenizer", size_t{1} << 30),
                          {.max_depth = kMaxJsonFileDepth, .on_repeated_key = {}});
  } catch (const std::exception&) {
    return {};  // the JSON parsed once already
  }
  const auto list = root.find("added_tokens");
  if (list == root.end() || !list->is_array()) return {};
  std::vector<std::pair<std::string, std::string>> missing;
  for (const json& t : *list) {
    if (!t.is_object() || !t.contains("content") || !t["content"].is_string()) continue;
    const std::string& content = t["content"].get_ref<const std::string&>();
    if (content.empty()) continue;
    const std::optional<uint32_t> id = backend.token_id(content);
    const bool same_id =
        id && t.contains("id") && t["id"].is_number_unsigned() && t["id"].get<uint64_t>() == *id;
    if (!same_id)
      missing.emplace_back(content, fmt::format("\"{}\" (id {})", content,
                                                t.contains("id") ? json_brief(t["id"]) : "none"));
  }
  return missing;
}

// A SentencePiece model used in place of a tokenizer.json that adds tokens the model lacks: a
// text holding one of them is refused (the model would spell it out as text, where Hugging Face
// makes it the token); other texts encode as the model encodes them.
class WithoutAddedTokens final : public detail::Backend {
 public:
  WithoutAddedTokens(std::unique_ptr<detail::Backend> inner,
                     std::vector<std::pair<std::string, std::string>> missing,
                     std::string json_path)
      : inner_(std::move(inner)), missing_(std::move(missing)), json_path_(std::move(json_path)) {}

  void encode_text(std::string_view text, std::vector<uint32_t>& out) const override {
    for (const auto& [content, shown] : missing_)
      if (text.find(content) != std::string_view::npos)
        throw ConfigError(
            "added_tokens",
            fmt::format("a text holds {}, a token {} adds that its SentencePiece model lacks: the "
                        "model would spell it out as text (outcore uses the model in place of "
                        "that file, whose components it does not implement)",
                        shown, json_path_));
    inner_->encode_text(text, out);
  }
  uint64_t vocab_size() const override { return inner_->vocab_size(); }
  std::optional<uint32_t> token_id(std::string_view content) const override {
    return inner_->token_id(content);
  }

 private:
  std::unique_ptr<detail::Backend> inner_;
  std::vector<std::pair<std::string, std::string>> missing_;
  std::string json_path_;
};

detail::LoadedBackend load_backend(const fs::path& dir) {
  const fs::path json_path = dir / "tokenizer.json", model_path = dir / "tokenizer.model";
  std::error_code ec;
  const bool has_model = fs::exists(model_path, ec);
  if (fs::exists(json_path, ec)) {
    try {
      return detail::load_tokenizer_json(json_path.string());
    } catch (const detail::UnsupportedTokenizer& e) {
      if (!has_model) throw;
      detail::LoadedBackend loaded = detail::load_sentencepiece(model_path.string());
      log::warn("{}; using {} instead", e.what(), model_path.string());
      auto missing = added_tokens_not_pieces(*loaded.backend, json_path.string());
      if (!missing.empty()) {
        std::string names;
        for (size_t i = 0; i < missing.size() && i < 5; ++i)
          names += (i ? ", " : "") + missing[i].second;
        if (missing.size() > 5) names += fmt::format(" and {} more", missing.size() - 5);
        log::warn(
            "{}: adds tokens {} lacks as pieces of those ids: {}; a text holding one is "
            "refused",
            json_path.string(), model_path.string(), names);
        loaded.backend = std::make_unique<WithoutAddedTokens>(
            std::move(loaded.backend), std::move(missing), json_path.string());
      }
      return loaded;
    }
  }
  if (has_model) return detail::load_sentencepiece(model_path.string());
  throw ConfigError(
      "", fmt::format("{}: no tokenizer.json or tokenizer.model in this directory", dir.string()));
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  if (!fs::is_directory(d, ec))
    throw ConfigError("", fmt::format("{}: not a directory (want a model directory holding "
                                      "tokenizer.json or tokenizer.model)",
                                      dir));
  detail::LoadedBackend loaded = load_backend(d);
  const json config = read_optional_json(d, "tokenizer_config.json");
  const json map = read_optional_json(d, "special_tokens_map.json");
  Tokenizer t;
  t.bos_ = special_id(*loaded.backend, d, config, map, "bos_token", loaded.bos);
  t.eos_ = special_id(*loaded.backend, d, config, map, "eos_token", loaded.eos);
  t.prefix_ = std::move(loaded.prefix);
  t.suffix_ = std::move(loaded.suffix);
  const std::string config_file = (d / "tokenizer_config.json").string();
  const std::optional<bool> add_bos = flag(config, "add_bos_token", config_file);
  const std::optional<bool> add_eos = flag(config, "add_eos_token", config_file);
  if (add_bos || add_eos) {
    t.prefix_.clear();
    t.suffix_.clear();
    if (add_bos.value_or(false)) {
      if (!t.bos_)
        throw ConfigError("add_bos_token",
                          fmt::format("is true but no bos_token is named (in {})", config_file));
      t.prefix_.push_back(*t.bos_);
    }
    if (add_eos.value_or(false)) {
      if (!t.eos_)
        throw ConfigError("add_eos_token",
                          fmt::format("is true but no eos_token is named (in {})", config_file));
      t.suffix_.push_back(*t.eos_);
    }
  }
  t.vocab_size_ = loaded.backend->vocab_size();
  t.description_ = std::move(loaded.description);
  t.backend_ = std::move(loaded.backend);
  return t;
}

void Tokenizer::encode(std::string_view text, Specials specials, std::vector<uint32_t>& out) const {
  if (specials == Specials::kAround || specials == Specials::kBefore)
    out.insert(out.end(), prefix_.begin(), prefix_.end());
  if (find_invalid_utf8(text) == text.size()) {
    backend_->encode_text(text, out);
  } else {
    std::string repaired;
    repaired.reserve(text.size() + 16);
    append_replacing_invalid_utf8(text, repaired);
    backend_->encode_text(repaired, out);
  }
  if (specials == Specials::kAround || specials == Specials::kAfter)
    out.insert(out.end(), suffix_.begin(), suffix_.end());
}

std::optional<uint32_t> Tokenizer::token_id(std::string_view content) const {
  return backend_->token_id(content);
}

}  // namespace outcore::data
