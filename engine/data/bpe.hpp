// BpeModel: Hugging Face's BPE model (tokenizers' models::bpe) for encoding one pre-token.
//
// In byte-level mode (a ByteLevel pre-tokenizer in front) a word is raw bytes; the vocabulary
// is keyed by the bytes each token stands for (GPT-2's byte-to-character map undone), so words
// are never mapped to characters and back. Otherwise a word's symbols are its UTF-8
// characters and tokens are keyed by their text.
//
// Threading: immutable after build; encode_word may run on many threads at once, each with
// its own BpeScratch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/data/string_table.hpp"

namespace outcore::data {

// GPT-2's map from a byte to the character that stands for it in a byte-level vocabulary, and
// back: the code point for byte b, and the byte for a code point (-1 when none).
char32_t byte_level_char(uint8_t b);
int byte_of_byte_level_char(char32_t c);

// A text in byte-level characters turned back into the bytes it stands for; nullopt when it
// holds a character outside the byte-level alphabet. REQUIRES: well-formed UTF-8.
std::optional<std::string> byte_level_decode(std::string_view text);

// Per-thread working memory of BpeModel::encode_word.
struct BpeScratch {
  struct Symbol {
    uint32_t id;
    int32_t prev, next;
  };
  struct Candidate {
    uint32_t rank, pos, new_id;
  };
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;
};

class BpeModel {
 public:
  struct Options {
    bool byte_level = false;
    // A word that is itself a token is that token, whatever the merges would make (Llama 3).
    bool ignore_merges = false;
    // Characters (bytes in byte-level mode) without a token become this id; when absent they
    // are dropped, as tokenizers does.
    std::optional<uint32_t> unk_id;
    // Consecutive unknown characters become one unk_id.
    bool fuse_unk = false;
  };

  explicit BpeModel(Options options) : options_(options) {}

  // Adds token `text` (as written in tokenizer.json) with `id`. Returns false when the token
  // cannot occur in this mode (a byte-level token with a character outside the alphabet); it
  // still counts for max_id().
  bool add_token(std::string_view text, uint32_t id);
  // Adds the merge of tokens `left` and `right` (as written in tokenizer.json) with `rank`
  // (lower merges first); a later merge of the same pair replaces an earlier one, and a merge
  // of tokens that cannot occur in this mode is left out. Returns an error message naming the
  // missing token when `left`, `right` or their concatenation is not a token, "" otherwise.
  std::string add_merge(std::string_view left, std::string_view right, uint32_t rank);
  // Appends the ids of `word` (bytes or text per the mode; not empty) to `out`.
  void encode_word(std::string_view word, BpeScratch& scratch, std::vector<uint32_t>& out) const;

  // The id of token `text` as written in tokenizer.json, or nullopt.
  std::optional<uint32_t> token_id(std::string_view text) const;
  // How many tokens were added (tokenizers' get_vocab_size of the model).
  size_t token_count() const { return vocab_.size() + unreachable_.size(); }
  // The largest id added (0 when none).
  uint32_t max_id() const { return max_id_; }
  bool byte_level() const { return options_.byte_level; }
  // Byte-level mode: the bytes no token stands for alone, in order (text holding them loses
  // them unless unk_id is set). Empty in the other mode.
  std::vector<uint8_t> bytes_without_token() const;

 private:
  struct MergeSlot {
    uint64_t pair = kEmptyPair;
    uint32_t rank = 0, new_id = 0;
  };
  static constexpr uint64_t kEmptyPair = UINT64_MAX;

  const MergeSlot* find_merge(uint32_t left, uint32_t right) const;
  void insert_merge(uint64_t pair, uint32_t rank, uint32_t new_id);
  // The token key of a text as written in tokenizer.json: its bytes in byte-level mode.
  std::optional<std::string> key_of(std::string_view text) const;
  // The initial symbols of `word`, unknown characters handled per the options.
  void split_symbols(std::string_view word, BpeScratch& scratch) const;
  void merge_symbols(BpeScratch& scratch) const;

  Options options_;
  StringTable<uint32_t> vocab_;
  StringTable<uint32_t> unreachable_;  // tokens add_token refused, by their text
  std::vector<int64_t> byte_ids_ = std::vector<int64_t>(256, -1);  // byte-level: byte -> id
  std::vector<MergeSlot> merges_ = std::vector<MergeSlot>(1024);
  size_t merge_count_ = 0;
  uint32_t max_id_ = 0;
};

}  // namespace outcore::data
