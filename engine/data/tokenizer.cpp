#include "engine/data/tokenizer.hpp"

#include <fmt/format.h>

#include <charconv>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "engine/data/added_tokens.hpp"
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

// A token Hugging Face splits out of a text before its model sees the rest.
struct SplitToken {
  std::string content;
  uint32_t id = 0;
  AddedTokenFlags flags;
};

// A JSON boolean flag of an added token (false when absent or null).
bool token_flag(const json& t, const char* key, const std::string& where) {
  if (!t.contains(key) || t[key].is_null()) return false;
  if (!t[key].is_boolean())
    throw ConfigError(
        "", fmt::format("{}.{}: must be true or false, got {}", where, key, json_brief(t[key])));
  return t[key].get<bool>();
}

// The added tokens of tokenizer.json `json_path`, with the ids tokenizers gives them over
// `backend`'s pieces (its AddedVocabulary: the piece's id when the content is a piece, else the
// next free id after the pieces and the ids given so far; a different "id" in the file is
// warned about, as tokenizers warns).
std::vector<SplitToken> json_added_tokens(const detail::Backend& backend,
                                          const std::string& json_path) {
  const json root =
      parse_json_file(read_whole_file(json_path, "tokenizer", size_t{1} << 30), json_path,
                      {.max_depth = kMaxJsonFileDepth, .on_repeated_key = {}},
                      [](const std::string& why) { throw ConfigError("", why); });
  const auto list = root.find("added_tokens");
  if (list == root.end() || list->is_null()) return {};
  if (!list->is_array())
    throw ConfigError("", fmt::format("{}: added_tokens: must be an array", json_path));
  const uint64_t pieces = backend.vocab_size();
  std::optional<uint32_t> max_id;
  std::vector<SplitToken> out;
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string where = fmt::format("{}: added_tokens[{}]", json_path, i);
    const json& t = (*list)[i];
    if (!t.is_object() || !t.contains("content") || !t["content"].is_string())
      throw ConfigError("", where + ": must be an object with a string \"content\"");
    SplitToken s;
    s.content = t["content"].get<std::string>();
    if (s.content.empty()) continue;
    s.flags = {token_flag(t, "single_word", where), token_flag(t, "lstrip", where),
               token_flag(t, "rstrip", where)};
    std::optional<uint32_t> id;
    for (const SplitToken& seen : out)
      if (seen.content == s.content) id = seen.id;
    if (!id) id = backend.token_id(s.content);
    if (!id) {
      const uint64_t next = !max_id                            ? pieces
                            : *max_id >= pieces || pieces == 0 ? uint64_t{*max_id} + 1
                                                               : pieces;
      if (next >= UINT32_MAX) throw ConfigError("", where + ": too many tokens for 32-bit ids");
      id = static_cast<uint32_t>(next);
    }
    if (t.contains("id") && !(t["id"].is_number_unsigned() && t["id"].get<uint64_t>() == *id))
      log::warn("{}: token \"{}\" is given id {} but tokenizers assigns it {}; using {}", where,
                s.content, json_brief(t["id"]), *id, *id);
    s.id = *id;
    max_id = std::max(max_id.value_or(0), *id);
    out.push_back(std::move(s));
  }
  return out;
}

// The tokens Hugging Face's slow tokenizer splits out of a text for a SentencePiece model alone:
// the model's own unk, bos and eos pieces (LlamaTokenizer's special tokens), then the entries
// of tokenizer_config.json's added_tokens_decoder ({"<id>": {"content": ..., flags}}).
std::vector<SplitToken> model_split_tokens(const detail::LoadedBackend& loaded, const json& config,
                                           const std::string& config_file) {
  std::vector<SplitToken> out;
  for (const auto& [content, id] : loaded.own_specials) out.push_back({content, id, {}});
  const auto decoder = config.is_object() ? config.find("added_tokens_decoder") : config.end();
  if (!config.is_object() || decoder == config.end() || decoder->is_null()) return out;
  if (!decoder->is_object())
    throw ConfigError("added_tokens_decoder",
                      fmt::format("must be an object of id -> token (in {})", config_file));
  for (auto it = decoder->begin(); it != decoder->end(); ++it) {
    const std::string where =
        fmt::format("{}: added_tokens_decoder[\"{}\"]", config_file, it.key());
    uint64_t id = 0;
    const auto [end, ec] = std::from_chars(it.key().data(), it.key().data() + it.key().size(), id);
    if (ec != std::errc() || end != it.key().data() + it.key().size() || id >= UINT32_MAX)
      throw ConfigError("added_tokens_decoder", where + ": the key must be a token id");
    const json& t = it.value();
    if (!t.is_object() || !t.contains("content") || !t["content"].is_string())
      throw ConfigError("added_tokens_decoder",
                        where + ": must be an object with a string \"content\"");
    SplitToken s{t["content"].get<std::string>(),
                 static_cast<uint32_t>(id),
                 {token_flag(t, "single_word", where), token_flag(t, "lstrip", where),
                  token_flag(t, "rstrip", where)}};
    if (!s.content.empty()) out.push_back(std::move(s));
  }
  return out;
}

// A SentencePiece model with the tokens Hugging Face splits out of a text before the model sees
// the rest (its added tokens: "</s>" in a document is EOS, not the characters "</", "s", ">"):
// each stretch between them is encoded by the model on its own, as both Hugging Face tokenizers
// do for Llama 2 and Mistral (the fast one normalizes each stretch apart, the slow one encodes
// each apart).
class WithAddedTokens final : public detail::Backend {
 public:
  WithAddedTokens(std::unique_ptr<detail::Backend> inner, const std::vector<SplitToken>& tokens)
      : inner_(std::move(inner)), vocab_size_(inner_->vocab_size()) {
    for (const SplitToken& t : tokens) {
      matcher_.add(t.content, t.id, t.flags);
      ids_.emplace(t.content, t.id);  // the first of a content wins, as in the matcher
      vocab_size_ = std::max<uint64_t>(vocab_size_, uint64_t{t.id} + 1);
    }
  }

  void encode_text(std::string_view text, std::vector<uint32_t>& out) const override {
    matcher_.split(
        text, [&](std::string_view stretch) { inner_->encode_text(stretch, out); },
        [&](uint32_t id) { out.push_back(id); });
  }
  uint64_t vocab_size() const override { return vocab_size_; }
  std::optional<uint32_t> token_id(std::string_view content) const override {
    if (const auto it = ids_.find(std::string(content)); it != ids_.end()) return it->second;
    return inner_->token_id(content);
  }

 private:
  std::unique_ptr<detail::Backend> inner_;
  AddedTokenMatcher matcher_;
  std::map<std::string, uint32_t> ids_;
  uint64_t vocab_size_;
};

detail::LoadedBackend load_backend(const fs::path& dir, const json& config) {
  const fs::path json_path = dir / "tokenizer.json", model_path = dir / "tokenizer.model";
  std::error_code ec;
  const bool has_model = fs::exists(model_path, ec);
  std::vector<SplitToken> split;
  detail::LoadedBackend loaded;
  if (fs::exists(json_path, ec)) {
    try {
      return detail::load_tokenizer_json(json_path.string());
    } catch (const detail::UnsupportedTokenizer& e) {
      if (!has_model) throw;
      loaded = detail::load_sentencepiece(model_path.string());
      log::warn("{}; using {} instead", e.what(), model_path.string());
      split = json_added_tokens(*loaded.backend, json_path.string());
    }
  } else if (has_model) {
    loaded = detail::load_sentencepiece(model_path.string());
    split = model_split_tokens(loaded, config, (dir / "tokenizer_config.json").string());
  } else {
    throw ConfigError("", fmt::format("{}: no tokenizer.json or tokenizer.model in this directory",
                                      dir.string()));
  }
  if (!split.empty())
    loaded.backend = std::make_unique<WithAddedTokens>(std::move(loaded.backend), split);
  return loaded;
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& dir) {
  const fs::path d(dir);
  std::error_code ec;
  if (!fs::is_directory(d, ec))
    throw ConfigError("", fmt::format("{}: not a directory (want a model directory holding "
                                      "tokenizer.json or tokenizer.model)",
                                      dir));
  const json config = read_optional_json(d, "tokenizer_config.json");
  detail::LoadedBackend loaded = load_backend(d, config);
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
