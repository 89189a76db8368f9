// A small byte-level BPE tokenizer written by hand, for tests that need a real tokenizer.json
// but not a real vocabulary: the 256 byte tokens, a few merges, and <|endoftext|> as EOS.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/data/bpe.hpp"
#include "tests/data/oracle_util.hpp"

namespace outcore::test {

// `bytes` in byte-level characters (GPT-2's map), as tokenizer.json writes tokens.
inline std::string byte_level(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) {
    const char32_t c = data::byte_level_char(b);
    if (c < 0x80) {
      out += static_cast<char>(c);
    } else {
      out += static_cast<char>(0xC0 | (c >> 6));
      out += static_cast<char>(0x80 | (c & 0x3F));
    }
  }
  return out;
}

// Ids: byte b is b; merges add " t", "he", " the", "in", "ing", " a", "an", "and" in this
// order (ids 256...); <|endoftext|> is `eos_id` (>= 264), a model token too, so that an id past
// 65535 makes a vocabulary that needs 32-bit ids.
inline json tiny_tokenizer(uint32_t eos_id = 264) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level(std::string(1, static_cast<char>(b)))] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {" ", "t"},  {"h", "e"}, {" t", "he"}, {"i", "n"},
      {"in", "g"}, {" ", "a"}, {"a", "n"},   {"an", "d"}};
  json merge_list = json::array();
  uint32_t id = 256;
  for (const auto& [a, b] : merges) {
    vocab[byte_level(a + b)] = id++;
    merge_list.push_back(json::array({byte_level(a), byte_level(b)}));
  }
  vocab["<|endoftext|>"] = eos_id;
  json t;
  t["version"] = "1.0";
  t["truncation"] = nullptr;
  t["padding"] = nullptr;
  t["added_tokens"] = json::array({{{"id", eos_id},
                                    {"content", "<|endoftext|>"},
                                    {"single_word", false},
                                    {"lstrip", false},
                                    {"rstrip", false},
                                    {"normalized", false},
                                    {"special", true}}});
  t["normalizer"] = nullptr;
  t["pre_tokenizer"] = {{"type", "ByteLevel"},
                        {"add_prefix_space", false},
                        {"trim_offsets", true},
                        {"use_regex", true}};
  t["post_processor"] = nullptr;
  t["decoder"] = nullptr;
  t["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", vocab},
                {"merges", merge_list}};
  return t;
}

// A model directory with tiny_tokenizer(eos_id) and a tokenizer_config.json naming its EOS.
inline void write_tiny_tokenizer_dir(const std::filesystem::path& dir, uint32_t eos_id = 264) {
  write_tokenizer_dir(dir, tiny_tokenizer(eos_id), json{{"eos_token", "<|endoftext|>"}});
}

// The bytes of an llm.c token file of `tokens` (what an earlier job wrote at an output, which a
// job replaces; a file that is not one is never replaced).
inline std::string llmc_token_file(const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;  // magic
  header[1] = 1;         // version
  header[2] = static_cast<int32_t>(tokens.size());
  std::string out(reinterpret_cast<const char*>(header.data()), header.size() * sizeof(int32_t));
  out.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(uint16_t));
  return out;
}

}  // namespace outcore::test
