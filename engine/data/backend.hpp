// What each kind of tokenizer file provides to Tokenizer (internal to engine/data).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/error.hpp"

namespace outcore::data::detail {

// A tokenizer.json that is well-formed but asks for a component outcore does not implement.
class UnsupportedTokenizer : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Appends the ids of `text` (well-formed UTF-8) without any template special tokens.
  // Thread-safe.
  virtual void encode_text(std::string_view text, std::vector<uint32_t>& out) const = 0;
  // Largest id + 1.
  virtual uint64_t vocab_size() const = 0;
  // The id of the token whose text is `content`, or nullopt.
  virtual std::optional<uint32_t> token_id(std::string_view content) const = 0;
};

// A backend with what its file says about special tokens.
struct LoadedBackend {
  std::unique_ptr<Backend> backend;
  // Ids the file's post-processing puts around a text when special tokens are added.
  std::vector<uint32_t> prefix, suffix;
  // The file's own BOS / EOS (SentencePiece only).
  std::optional<uint32_t> bos, eos;
  // SentencePiece only: the texts and ids of the model's unk, bos and eos pieces, which Hugging
  // Face's LlamaTokenizer splits out of a text as special tokens.
  std::vector<std::pair<std::string, uint32_t>> own_specials;
  std::string description;
};

// Loads tokenizer.json at `path`. Throws ConfigError naming `path` and the JSON key for
// anything malformed or unsupported (an UnsupportedTokenizer for what is well-formed but not
// implemented), IoError when it cannot be read.
LoadedBackend load_tokenizer_json(const std::string& path);

// Loads a SentencePiece model at `path`. Throws ConfigError naming `path` when
// libsentencepiece refuses it.
LoadedBackend load_sentencepiece(const std::string& path);

}  // namespace outcore::data::detail
