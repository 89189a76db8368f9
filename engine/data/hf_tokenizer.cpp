// tokenizer.json (Hugging Face tokenizers' format) -> a Backend; see tokenizer.hpp for what is
// supported.
#include <fmt/format.h>
#include <tbb/enumerable_thread_specific.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "engine/data/added_tokens.hpp"
#include "engine/data/backend.hpp"
#include "engine/data/bpe.hpp"
#include "engine/data/normalizer.hpp"
#include "engine/data/pre_tokenizer.hpp"
#include "engine/data/string_table.hpp"

namespace outcore::data::detail {
namespace {

using json = nlohmann::json;

constexpr size_t kMaxTokenizerJsonBytes = size_t{1} << 30;
// Words up to this many bytes are cached (tokenizers' MAX_LENGTH); a thread's cache is emptied
// when it holds more than kCacheWords words or kCacheIds ids.
constexpr size_t kCacheWordBytes = 256;
constexpr size_t kCacheWords = size_t{1} << 17;
constexpr size_t kCacheIds = size_t{1} << 22;

// A word -> ids cache of one thread: the value is (offset into ids) << 24 | count.
struct WordCache {
  StringTable<uint64_t> index;
  std::vector<uint32_t> ids;
};

struct EncodeScratch {
  PreTokenizerScratch pre;
  BpeScratch bpe;
  std::string normalized;
  WordCache cache;
};

class HfBackend final : public Backend {
 public:
  HfBackend(BpeModel model, Normalizer normalizer, PreTokenizer pre, AddedTokenMatcher raw,
            AddedTokenMatcher normalized, StringTable<uint32_t> added_ids, uint64_t vocab_size)
      : model_(std::move(model)),
        normalizer_(std::move(normalizer)),
        pre_(std::move(pre)),
        raw_added_(std::move(raw)),
        normalized_added_(std::move(normalized)),
        added_ids_(std::move(added_ids)),
        vocab_size_(vocab_size) {}

  void encode_text(std::string_view text, std::vector<uint32_t>& out) const override {
    EncodeScratch& s = scratch_.local();
    raw_added_.split(
        text, [&](std::string_view piece) { encode_piece(piece, s, out); },
        [&](uint32_t id) { out.push_back(id); });
  }

  uint64_t vocab_size() const override { return vocab_size_; }

  std::optional<uint32_t> token_id(std::string_view content) const override {
    if (const uint32_t* id = added_ids_.find(content)) return *id;
    return model_.token_id(content);
  }

 private:
  // A stretch between raw-matched added tokens: normalized, then split around the added
  // tokens matched in normalized text, then pre-tokenized and encoded word by word.
  void encode_piece(std::string_view piece, EncodeScratch& s, std::vector<uint32_t>& out) const {
    const std::string_view normalized = normalizer_.apply(piece, s.normalized);
    normalized_added_.split(
        normalized,
        [&](std::string_view part) {
          pre_.for_each_word(part, s.pre,
                             [&](std::string_view word) { encode_word(word, s, out); });
        },
        [&](uint32_t id) { out.push_back(id); });
  }

  void encode_word(std::string_view word, EncodeScratch& s, std::vector<uint32_t>& out) const {
    if (word.size() > kCacheWordBytes) {
      model_.encode_word(word, s.bpe, out);
      return;
    }
    WordCache& c = s.cache;
    if (const uint64_t* hit = c.index.find(word)) {
      const uint32_t* ids = c.ids.data() + (*hit >> 24);
      out.insert(out.end(), ids, ids + (*hit & 0xFFFFFF));
      return;
    }
    const size_t first = out.size();
    model_.encode_word(word, s.bpe, out);
    if (c.index.size() >= kCacheWords || c.ids.size() >= kCacheIds) {
      c.index.clear();
      c.ids.clear();
    }
    c.index.insert(word, (static_cast<uint64_t>(c.ids.size()) << 24) | (out.size() - first));
    c.ids.insert(c.ids.end(), out.begin() + static_cast<ptrdiff_t>(first), out.end());
  }

  BpeModel model_;
  Normalizer normalizer_;
  PreTokenizer pre_;
  AddedTokenMatcher raw_added_, normalized_added_;
  StringTable<uint32_t> added_ids_;
  uint64_t vocab_size_;
  mutable tbb::enumerable_thread_specific<EncodeScratch> scratch_;
};

// Reads one tokenizer.json, every error naming the file and the JSON path.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  [[noreturn]] void bad(const std::string& path, const std::string& msg) const {
    throw ConfigError(path, fmt::format("{} (in {})", msg, file_));
  }
  [[noreturn]] void unsupported(const std::string& path, const std::string& msg) const {
    throw UnsupportedTokenizer(path, fmt::format("{} (in {})", msg, file_));
  }

  // j[key], or null when absent. REQUIRES j is an object.
  static const json& member(const json& j, const char* key) {
    static const json kNull;
    const auto it = j.find(key);
    return it == j.end() ? kNull : *it;
  }

  const json& object(const json& j, const std::string& path) const {
    if (!j.is_object()) bad(path, fmt::format("must be an object, got {}", j.type_name()));
    return j;
  }

  bool boolean(const json& j, const char* key, const std::string& path, bool fallback) const {
    const json& v = member(j, key);
    if (v.is_null()) return fallback;
    if (!v.is_boolean())
      bad(path + "." + key, fmt::format("must be true or false, got {}", json_brief(v)));
    return v.get<bool>();
  }

  std::string string(const json& j, const char* key, const std::string& path) const {
    const json& v = member(j, key);
    if (!v.is_string())
      bad(path + "." + key, fmt::format("must be a string, got {}", json_brief(v)));
    return v.get<std::string>();
  }

  uint32_t id(const json& v, const std::string& path) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= UINT32_MAX)
      bad(path,
          fmt::format("must be a token id (an integer in [0, 2^32 - 1)), got {}", json_brief(v)));
    return static_cast<uint32_t>(v.get<int64_t>());
  }

  std::string type(const json& j, const std::string& path) const {
    object(j, path);
    return string(j, "type", path);
  }

  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

const char* const kSupportedNormalizers = "NFC, NFD, NFKC, NFKD, Sequence";
const char* const kSupportedPreTokenizers = "Split, ByteLevel, Sequence";
const char* const kSupportedPostProcessors =
    "ByteLevel, TemplateProcessing, BertProcessing, RobertaProcessing, Sequence";

void read_normalizer(const Reader& r, const json& j, const std::string& path,
                     std::vector<NormalForm>& forms) {
  if (j.is_null()) return;
  const std::string type = r.type(j, path);
  if (type == "NFC") {
    forms.push_back(NormalForm::kNfc);
  } else if (type == "NFD") {
    forms.push_back(NormalForm::kNfd);
  } else if (type == "NFKC") {
    forms.push_back(NormalForm::kNfkc);
  } else if (type == "NFKD") {
    forms.push_back(NormalForm::kNfkd);
  } else if (type == "Sequence") {
    const json& list = Reader::member(j, "normalizers");
    if (!list.is_array()) r.bad(path + ".normalizers", "must be an array");
    for (size_t i = 0; i < list.size(); ++i)
      read_normalizer(r, list[i], fmt::format("{}.normalizers[{}]", path, i), forms);
  } else {
    r.unsupported(path + ".type", fmt::format("normalizer \"{}\" is not supported (supported: {})",
                                              type, kSupportedNormalizers));
  }
}

SplitBehavior read_behavior(const Reader& r, const json& j, const std::string& path) {
  const std::string b = r.string(j, "behavior", path);
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  r.bad(path + ".behavior",
        fmt::format("unknown behavior \"{}\" (allowed: Removed, Isolated, MergedWithPrevious, "
                    "MergedWithNext, Contiguous)",
                    b));
}

void read_pre_tokenizer(const Reader& r, const json& j, const std::string& path,
                        PreTokenizer& pre) {
  if (j.is_null()) return;
  const std::string type = r.type(j, path);
  if (pre.byte_level())
    r.unsupported(path,
                  "a pre-tokenizer after ByteLevel is not supported (ByteLevel must be last)");
  if (type == "Sequence") {
    const json& list = Reader::member(j, "pretokenizers");
    if (!list.is_array()) r.bad(path + ".pretokenizers", "must be an array");
    for (size_t i = 0; i < list.size(); ++i)
      read_pre_tokenizer(r, list[i], fmt::format("{}.pretokenizers[{}]", path, i), pre);
  } else if (type == "ByteLevel") {
    pre.set_byte_level(r.boolean(j, "add_prefix_space", path, true),
                       r.boolean(j, "use_regex", path, true));
  } else if (type == "Split") {
    const json& pattern = r.object(Reader::member(j, "pattern"), path + ".pattern");
    const bool literal = pattern.contains("String");
    if (!literal && !pattern.contains("Regex"))
      r.bad(path + ".pattern", "must be {\"Regex\": ...} or {\"String\": ...}");
    const std::string text = r.string(pattern, literal ? "String" : "Regex", path + ".pattern");
    if (text.empty()) r.unsupported(path + ".pattern", "an empty pattern is not supported");
    pre.add_split(Regex(text, literal, path + ".pattern", r.file()), read_behavior(r, j, path),
                  r.boolean(j, "invert", path, false));
  } else {
    r.unsupported(path + ".type",
                  fmt::format("pre-tokenizer \"{}\" is not supported (supported: {})", type,
                              kSupportedPreTokenizers));
  }
}

// The ids a TemplateProcessing "special_tokens" entry stands for.
std::vector<uint32_t> template_special_ids(const Reader& r, const json& specials,
                                           const std::string& name, const std::string& path) {
  const json& entry = Reader::member(r.object(specials, path + ".special_tokens"), name.c_str());
  const std::string entry_path = fmt::format("{}.special_tokens[\"{}\"]", path, name);
  if (entry.is_null()) r.bad(entry_path, "the template names a special token that is not listed");
  const json& ids = Reader::member(r.object(entry, entry_path), "ids");
  if (!ids.is_array() || ids.empty()) r.bad(entry_path + ".ids", "must be a non-empty array");
  std::vector<uint32_t> out;
  for (size_t i = 0; i < ids.size(); ++i)
    out.push_back(r.id(ids[i], fmt::format("{}.ids[{}]", entry_path, i)));
  return out;
}

// Reads a post-processor; each one wraps what the earlier ones of a Sequence put around.
void read_post_processor(const Reader& r, const json& j, const std::string& path,
                         std::vector<uint32_t>& prefix, std::vector<uint32_t>& suffix) {
  if (j.is_null()) return;
  const std::string type = r.type(j, path);
  std::vector<uint32_t> before, after;
  if (type == "ByteLevel") {
    return;  // offsets only
  } else if (type == "Sequence") {
    const json& list = Reader::member(j, "processors");
    if (!list.is_array()) r.bad(path + ".processors", "must be an array");
    for (size_t i = 0; i < list.size(); ++i)
      read_post_processor(r, list[i], fmt::format("{}.processors[{}]", path, i), prefix, suffix);
    return;
  } else if (type == "TemplateProcessing") {
    const json& single = Reader::member(j, "single");
    if (!single.is_array()) r.bad(path + ".single", "must be an array of template pieces");
    bool seen_sequence = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const std::string piece_path = fmt::format("{}.single[{}]", path, i);
      const json& piece = r.object(single[i], piece_path);
      if (piece.contains("Sequence")) {
        const std::string id = r.string(piece["Sequence"], "id", piece_path + ".Sequence");
        if (id != "A" || seen_sequence)
          r.bad(piece_path, "the single-sequence template must hold sequence A exactly once");
        seen_sequence = true;
      } else if (piece.contains("SpecialToken")) {
        const std::string name =
            r.string(piece["SpecialToken"], "id", piece_path + ".SpecialToken");
        const std::vector<uint32_t> ids =
            template_special_ids(r, Reader::member(j, "special_tokens"), name, path);
        (seen_sequence ? after : before)
            .insert((seen_sequence ? after : before).end(), ids.begin(), ids.end());
      } else {
        r.bad(piece_path, "must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    if (!seen_sequence) r.bad(path + ".single", "the template does not hold sequence A");
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    for (const char* key : {"cls", "sep"}) {
      const json& v = Reader::member(j, key);
      if (!v.is_array() || v.size() != 2) r.bad(path + "." + key, "must be [token, id]");
      (std::string(key) == "cls" ? before : after)
          .push_back(r.id(v[1], fmt::format("{}.{}[1]", path, key)));
    }
  } else {
    r.unsupported(path + ".type",
                  fmt::format("post-processor \"{}\" is not supported (supported: {})", type,
                              kSupportedPostProcessors));
  }
  prefix.insert(prefix.begin(), before.begin(), before.end());
  suffix.insert(suffix.end(), after.begin(), after.end());
}

BpeModel read_model(const Reader& r, const json& j, bool byte_level) {
  const std::string path = "model";
  r.object(j, path);
  const json& type = Reader::member(j, "type");
  if (!(type.is_null() && j.contains("merges")) && !(type.is_string() && type == "BPE"))
    r.unsupported(path + ".type",
                  fmt::format("model {} is not supported (supported: BPE)", json_brief(type)));
  const json& dropout = Reader::member(j, "dropout");
  if (!dropout.is_null() && !(dropout.is_number() && dropout.get<double>() == 0.0))
    r.unsupported(path + ".dropout", "BPE dropout is not supported (set it to null)");
  if (r.boolean(j, "byte_fallback", path, false))
    r.unsupported(path + ".byte_fallback", "byte_fallback is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json& v = Reader::member(j, key);
    if (!v.is_null() && !(v.is_string() && v.get<std::string>().empty()))
      r.unsupported(path + "." + key,
                    fmt::format("{} is not supported (it must be null or \"\")", key));
  }
  const json& vocab = Reader::member(j, "vocab");
  if (!vocab.is_object()) r.bad(path + ".vocab", "must be an object of token -> id");

  BpeModel::Options options;
  options.byte_level = byte_level;
  options.ignore_merges = r.boolean(j, "ignore_merges", path, false);
  options.fuse_unk = r.boolean(j, "fuse_unk", path, false);
  const json& unk = Reader::member(j, "unk_token");
  if (!unk.is_null()) {
    if (!unk.is_string()) r.bad(path + ".unk_token", "must be a string or null");
    const auto it = vocab.find(unk.get<std::string>());
    if (it == vocab.end())
      r.bad(path + ".unk_token",
            fmt::format("\"{}\" is not in model.vocab", unk.get<std::string>()));
    options.unk_id = r.id(*it, path + ".vocab[\"" + it.key() + "\"]");
  }

  BpeModel model(options);
  for (auto it = vocab.begin(); it != vocab.end(); ++it)
    model.add_token(it.key(), r.id(it.value(), path + ".vocab[\"" + it.key() + "\"]"));
  // Dropped as tokenizers drops them, but never without a word: a corpus would lose text.
  if (const std::vector<uint8_t> missing = model.bytes_without_token();
      !missing.empty() && !options.unk_id) {
    std::string some;
    for (size_t i = 0; i < missing.size() && i < 8; ++i)
      some += fmt::format("{}0x{:02x}", i == 0 ? "" : " ", missing[i]);
    log::warn(
        "{}: model.vocab has no token for {} of the 256 bytes ({}{}) and model.unk_token is "
        "null: text holding them loses those bytes, as Hugging Face tokenizers drops them",
        r.file(), missing.size(), some, missing.size() > 8 ? " ..." : "");
  }
  if (!byte_level && !options.unk_id)
    log::warn(
        "{}: the model is not byte-level and model.unk_token is null: a character with no token "
        "in model.vocab is dropped from the text, as Hugging Face tokenizers drops it",
        r.file());

  const json& merges = Reader::member(j, "merges");
  if (!merges.is_array()) r.bad(path + ".merges", "must be an array");
  uint32_t rank = 0;
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string merge_path = fmt::format("{}.merges[{}]", path, i);
    const json& m = merges[i];
    std::string left, right;
    if (m.is_string()) {
      const std::string& line = m.get_ref<const std::string&>();
      if (line.starts_with("#version")) continue;
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos)
        r.bad(merge_path, fmt::format("\"{}\" is not two tokens separated by one space", line));
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      r.bad(merge_path, "must be \"a b\" or [\"a\", \"b\"]");
    }
    const std::string error = model.add_merge(left, right, rank++);
    if (!error.empty()) r.bad(merge_path, error);
  }
  return model;
}

struct AddedTokens {
  AddedTokenMatcher raw, normalized;
  StringTable<uint32_t> ids;  // by content
  uint64_t vocab_size = 0;    // largest id of the model or an added token, + 1
};

// The added tokens, with the ids tokenizers gives them when it loads a tokenizer.json (its
// AddedVocabulary::add_tokens, in list order): the model's id when the content is a model
// token, else the next free id after the model's token count and the ids given so far. The
// "id" written in the file is not used; where it differs (a file tokenizers did not write)
// a warning says so, as tokenizers does.
AddedTokens read_added_tokens(const Reader& r, const json& list, const BpeModel& model,
                              const Normalizer& normalizer) {
  struct Entry {
    std::string content;
    AddedTokenFlags flags;
    bool normalized;
  };
  AddedTokens out;
  out.vocab_size = uint64_t{model.max_id()} + 1;
  if (list.is_null()) return out;
  if (!list.is_array()) r.bad("added_tokens", "must be an array");
  const uint64_t model_size = model.token_count();
  std::optional<uint32_t> max_id;
  std::vector<Entry> entries;
  std::unordered_map<uint32_t, AddedTokenFlags> flags_by_id;  // the last token's flags win
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string path = fmt::format("added_tokens[{}]", i);
    const json& t = r.object(list[i], path);
    const std::string content = r.string(t, "content", path);
    const uint32_t file_id = r.id(Reader::member(t, "id"), path + ".id");
    if (content.empty()) continue;
    const bool special = r.boolean(t, "special", path, false);
    const AddedTokenFlags flags{r.boolean(t, "single_word", path, false),
                                r.boolean(t, "lstrip", path, false),
                                r.boolean(t, "rstrip", path, false)};
    std::optional<uint32_t> id;
    if (const uint32_t* known = out.ids.find(content)) id = *known;
    if (!id) id = model.token_id(content);
    if (!id) {
      const uint64_t next = !max_id                                    ? model_size
                            : *max_id >= model_size || model_size == 0 ? uint64_t{*max_id} + 1
                                                                       : model_size;
      if (next >= UINT32_MAX) r.bad(path, "too many tokens for 32-bit ids");
      id = static_cast<uint32_t>(next);
    }
    if (*id != file_id)
      log::warn("{}: {}: token \"{}\" is given id {} but tokenizers assigns it {}; using {}",
                r.file(), path, content, file_id, *id, *id);
    *out.ids.insert(content, *id).first = *id;
    max_id = std::max(max_id.value_or(0), *id);
    out.vocab_size = std::max<uint64_t>(out.vocab_size, uint64_t{*id} + 1);
    flags_by_id[*id] = flags;
    entries.push_back({content, flags, r.boolean(t, "normalized", path, !special)});
  }
  std::string buffer;
  for (const Entry& e : entries) {
    const uint32_t id = *out.ids.find(e.content);
    const AddedTokenFlags flags = flags_by_id.at(id);
    if (e.normalized) {
      const std::string_view pattern = normalizer.apply(e.content, buffer);
      if (!pattern.empty()) out.normalized.add(pattern, id, flags);
    } else {
      out.raw.add(e.content, id, flags);
    }
  }
  return out;
}

}  // namespace

LoadedBackend load_tokenizer_json(const std::string& path) {
  const Reader r(path);
  // The depth bounded: Sequence in Sequence...: the readers recurse.
  const json root = parse_json_file(read_whole_file(path, "tokenizer", kMaxTokenizerJsonBytes),
                                    path, {.max_depth = kMaxJsonFileDepth, .on_repeated_key = {}},
                                    [](const std::string& why) { throw ConfigError("", why); });
  r.object(root, "(root)");
  for (const char* key : {"truncation", "padding"}) {
    if (!Reader::member(root, key).is_null())
      r.unsupported(key, fmt::format("{} is not supported: outcore encodes whole texts (set it "
                                     "to null)",
                                     key));
  }
  std::vector<NormalForm> forms;
  read_normalizer(r, Reader::member(root, "normalizer"), "normalizer", forms);
  const Normalizer normalizer(std::move(forms));
  PreTokenizer pre;
  read_pre_tokenizer(r, Reader::member(root, "pre_tokenizer"), "pre_tokenizer", pre);
  LoadedBackend loaded;
  read_post_processor(r, Reader::member(root, "post_processor"), "post_processor", loaded.prefix,
                      loaded.suffix);
  BpeModel model = read_model(r, Reader::member(root, "model"), pre.byte_level());

  AddedTokens added = read_added_tokens(r, Reader::member(root, "added_tokens"), model, normalizer);
  // The template's ids are written as they are: each must be a token of the vocabulary.
  for (const std::vector<uint32_t>* ids : {&loaded.prefix, &loaded.suffix})
    for (const uint32_t id : *ids)
      if (id >= added.vocab_size)
        r.bad("post_processor",
              fmt::format("the template adds id {}, outside the vocabulary (vocab_size {})", id,
                          added.vocab_size));
  loaded.description = fmt::format("{} (BPE{})", path, pre.byte_level() ? ", byte-level" : "");
  loaded.backend = std::make_unique<HfBackend>(std::move(model), normalizer, std::move(pre),
                                               std::move(added.raw), std::move(added.normalized),
                                               std::move(added.ids), added.vocab_size);
  return loaded;
}

}  // namespace outcore::data::detail
