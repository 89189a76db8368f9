#include "engine/data/pre_tokenizer.hpp"

namespace outcore::data {
namespace {

// GPT-2's pattern, as tokenizers' ByteLevel pre-tokenizer compiles it.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

void PreTokenizer::set_byte_level(bool add_prefix_space, bool use_regex) {
  byte_level_ = true;
  add_prefix_space_ = add_prefix_space;
  if (use_regex) gpt2_.emplace(kGpt2Pattern, false, "pre_tokenizer", "ByteLevel");
}

}  // namespace outcore::data
