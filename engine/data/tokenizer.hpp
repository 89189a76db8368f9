// Tokenizer: text -> token ids, as Hugging Face produces them for a model directory.
//
// Loading, Tokenizer::load(DIR):
// - DIR/tokenizer.json (the `tokenizers` format) when present. Supported, with the exact
//   behaviour of tokenizers 0.22:
//     model           BPE (byte_fallback false; dropout null or 0; no subword prefix or word
//                     suffix), with ignore_merges, unk_token and fuse_unk; merges written as
//                     "a b" or as ["a", "b"]
//     normalizer      null, NFC, NFD, NFKC, NFKD, Sequence of those
//     pre_tokenizer   null, Split (Regex or String pattern; Removed, Isolated,
//                     MergedWithPrevious, MergedWithNext, Contiguous; invert), ByteLevel
//                     (add_prefix_space, use_regex; last), Sequence of those
//     post_processor  null, ByteLevel, TemplateProcessing (the single-sequence template),
//                     BertProcessing, RobertaProcessing, Sequence of those
//     added_tokens    matched in the raw text (normalized: false) or in the normalized text
//                     (normalized: true) before pre-tokenization, with single_word, lstrip
//                     and rstrip; special or not, they are always matched, as tokenizers does
//   `decoder` is not used (nothing is decoded); `truncation` and `padding` must be null.
//   Anything else is refused with a ConfigError naming the file and the JSON key.
//   Split patterns run on PCRE2 with Oniguruma's meaning of \s (see regex.hpp); characters
//   assigned after Unicode 14 may be classed differently than tokenizers classes them.
// - Else DIR/tokenizer.model, a SentencePiece model run by libsentencepiece (BOS added by
//   default, as Llama 2 and Mistral do). Also used, with a warning on the log, when
//   tokenizer.json asks for something unsupported and tokenizer.model is beside it (Llama 2
//   and Mistral ship both; their tokenizer.json is a conversion of the SentencePiece model).
//   As Hugging Face does, special tokens are split out of the text first and each stretch
//   between them is encoded by the model on its own: that tokenizer.json's added_tokens (with
//   the ids tokenizers gives them, past the pieces for those the model lacks), or, with
//   tokenizer.model alone, the model's unk, bos and eos pieces and the tokens of
//   tokenizer_config.json's added_tokens_decoder (LlamaTokenizer's).
// - BOS and EOS: DIR/tokenizer_config.json's bos_token and eos_token (a string, or an object
//   with "content"), else DIR/special_tokens_map.json's; a SentencePiece model's own ids when
//   neither file names them. When tokenizer_config.json has add_bos_token or add_eos_token
//   (either key), the special tokens added to a text are [BOS if add_bos_token] text [EOS if
//   add_eos_token], in place of the post-processor's (transformers' LlamaTokenizerFast).
//
// Encoding: text that is not well-formed UTF-8 is first decoded with U+FFFD replacing each
// maximal subpart of an ill-formed sequence (the WHATWG decoder's rule, so a reference reading
// the same bytes with Node's TextDecoder sees the same text).
//
// Threading: a Tokenizer is immutable; encode() may run on many threads at once (each thread
// keeps its own scratch and word cache). Copies share the loaded model.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace outcore::data {

namespace detail {
class Backend;
}

class Tokenizer {
 public:
  // Loads the tokenizer of model directory `dir` as described above. Throws ConfigError naming
  // the directory when it holds neither tokenizer.json nor tokenizer.model, and naming the
  // file and key for anything malformed or unsupported; IoError when a file cannot be read.
  static Tokenizer load(const std::string& dir);

  // Which of the single-sequence template's special tokens (e.g. Llama 3's BOS before the text,
  // a converted Llama 2's EOS after it) go with an encoding: none, both sides, or one side (a
  // prompt takes those before it and its completion those after, so that the pair is encoded
  // as one sequence is).
  enum class Specials { kNone, kAround, kBefore, kAfter };
  // Appends the ids of `text` to `out`, with `specials`. Never throws for any input bytes
  // (OutOfMemory aside).
  void encode(std::string_view text, Specials specials, std::vector<uint32_t>& out) const;
  // encode with kAround (add_special_tokens, as Hugging Face's) or kNone.
  void encode(std::string_view text, bool add_special_tokens, std::vector<uint32_t>& out) const {
    encode(text, add_special_tokens ? Specials::kAround : Specials::kNone, out);
  }

  // Largest token id this tokenizer can produce, plus one (added tokens included).
  uint64_t vocab_size() const { return vocab_size_; }
  std::optional<uint32_t> eos_id() const { return eos_; }
  std::optional<uint32_t> bos_id() const { return bos_; }
  // The id of the token whose text is `content` (an added token or a model token), or nullopt.
  std::optional<uint32_t> token_id(std::string_view content) const;
  // What was loaded, for messages: "<path> (BPE, byte-level)" or "<path> (SentencePiece)".
  const std::string& description() const { return description_; }

 private:
  Tokenizer() = default;

  std::shared_ptr<const detail::Backend> backend_;
  std::vector<uint32_t> prefix_, suffix_;  // ids around the text with add_special_tokens
  std::optional<uint32_t> bos_, eos_;
  uint64_t vocab_size_ = 0;
  std::string description_;
};

}  // namespace outcore::data
