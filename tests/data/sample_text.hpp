// Generated text that exercises a tokenizer: many scripts, accents composed and decomposed,
// compatibility characters, emoji (ZWJ sequences, skin tones, flags), digit runs, runs of
// spaces, tabs and line breaks (\r\n too), exotic white space, special-token strings inside
// text, contractions in every case, punctuation and code, very long words, and ill-formed
// UTF-8. Deterministic for a seed. Used by the tokenizer tests and bench/data's benchmark.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace outcore::test {

struct SampleTextOptions {
  uint64_t seed = 1;
  // Documents are generated until their bytes reach this total.
  size_t total_bytes = size_t{1} << 20;
  // Each document's length is drawn in [min_doc_bytes, max_doc_bytes] (roughly: it ends
  // after the piece that crosses the length).
  size_t min_doc_bytes = 16;
  size_t max_doc_bytes = 4096;
  // Whether documents may hold ill-formed UTF-8.
  bool invalid_utf8 = true;
  // Whether documents may hold the strings of special tokens ("<|endoftext|>", ...).
  bool special_strings = true;
};

// Documents that never contain a NUL byte.
inline std::vector<std::string> sample_documents(const SampleTextOptions& o) {
  static const char* const kWords[] = {
      // English, with cases and contractions
      "the", "The", "THE", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Hello",
      "world", "WORLD", "tokenizer", "Tokenization", "isn't", "don't", "John's", "WE'LL", "they'Re",
      "I'M", "you've", "She'd", "it'S", "can'T", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S",
      "'LL", "'Re", "'VE", "'M", "'D", "'\xC5\xBF", "o'clock", "rock'n'roll",
      // Latin with accents, composed and decomposed
      "caf\xC3\xA9", "na\xC3\xAFve", "\xC3\x85ngstr\xC3\xB6m",
      "fa\xC3\xA7"
      "ade",
      "Stra\xC3\x9F"
      "e",
      "\xC3\x89"
      "COLE",
      "cafe\xCC\x81", "A\xCC\x8Angstro\xCC\x88m", "se\xC3\xB1or",
      "\xC5\x81\xC3\xB3"
      "d\xC5\xBA",
      "\xC4\x8C"
      "esk\xC3\xBD",
      "Ti\xE1\xBA\xBFng Vi\xE1\xBB\x87t",
      "\xC3\xBC"
      "ber",
      "O\xCC\x88"
      "L",
      // Compatibility characters (NFKC changes them)
      "\xEF\xAC\x81le", "\xEF\xBC\xA8\xEF\xBD\x85\xEF\xBD\x8C\xEF\xBD\x8C\xEF\xBD\x8F",
      "\xE2\x91\xA0", "x\xC2\xB2", "\xC2\xBD", "\xE2\x85\xAB", "\xE3\x8E\x8F",
      "\xE2\x84\xAA"
      "elvin",
      "\xEF\xBE\x8A\xEF\xBE\x9D",
      // Cyrillic, Greek
      "\xD0\xBF\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82",
      "\xD0\x9C\xD0\xBE\xD1\x81\xD0\xBA\xD0\xB2\xD0\xB0", "\xD0\x81\xD0\x96\xD0\x98\xD0\x9A",
      "\xD1\x81\xD0\xBB\xD0\xBE\xD0\xB2\xD0\xBE",
      "\xCE\xBA\xCE\xB1\xCE\xBB\xCE\xB7\xCE\xBC\xCE\xAD\xCF\x81\xCE\xB1",
      "\xCE\x95\xCE\xBB\xCE\xBB\xCE\xAC\xCE\xB4\xCE\xB1",
      "\xCE\xA3\xCE\x9F\xCE\xA6\xCE\x99\xCE\x91",
      // CJK, Japanese, Korean
      "\xE4\xB8\xAD\xE6\x96\x87\xE5\xAD\x97\xE7\xAC\xA6",
      "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E\xE3\x81\xAE\xE3\x83\x86\xE3\x82\xAD\xE3\x82\xB9\xE3\x83"
      "\x88",
      "\xE6\x9D\xB1\xE4\xBA\xAC", "\xE6\x88\x91\xE4\xBB\xAC\xE7\x9A\x84\xE6\xA8\xA1\xE5\x9E\x8B",
      "\xEC\x95\x88\xEB\x85\x95\xED\x95\x98\xEC\x84\xB8\xEC\x9A\x94",
      "\xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4",
      "\xE1\x84\x92\xE1\x85\xA1\xE1\x86\xAB",  // Hangul jamo (NFC composes them)
      // Arabic, Hebrew, Hindi, Thai
      "\xD9\x85\xD8\xB1\xD8\xAD\xD8\xA8\xD8\xA7",
      "\xD8\xA7\xD9\x84\xD8\xB9\xD8\xA7\xD9\x84\xD9\x85", "\xD7\xA9\xD7\x9C\xD7\x95\xD7\x9D",
      "\xE0\xA4\xA8\xE0\xA4\xAE\xE0\xA4\xB8\xE0\xA5\x8D\xE0\xA4\xA4\xE0\xA5\x87",
      "\xE0\xA4\xA6\xE0\xA5\x81\xE0\xA4\xA8\xE0\xA4\xBF\xE0\xA4\xAF\xE0\xA4\xBE",
      "\xE0\xB8\xAA\xE0\xB8\xA7\xE0\xB8\xB1\xE0\xB8\xAA\xE0\xB8\x94\xE0\xB8\xB5\xE0\xB8\x84\xE0\xB8"
      "\xA3\xE0\xB8\xB1\xE0\xB8\x9A",
      // Emoji: plain, skin tone, ZWJ family, rainbow flag, VS16, regional flags
      "\xF0\x9F\x98\x80", "\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD",
      "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7\xE2\x80\x8D\xF0\x9F"
      "\x91\xA6",
      "\xF0\x9F\x8F\xB3\xEF\xB8\x8F\xE2\x80\x8D\xF0\x9F\x8C\x88", "\xE2\x9D\xA4\xEF\xB8\x8F",
      "\xF0\x9F\x87\xAB\xF0\x9F\x87\xB7", "\xF0\x9F\xA4\x96\xF0\x9F\xA7\xA0",
      // Punctuation and code
      "...", "!!!", "?!", "\xE2\x80\x94", "\xC2\xAB\xC2\xBB",
      "\xE2\x80\x9C"
      "quoted\xE2\x80\x9D",
      "(x)", "[{}]", "#@$%^&*", "foo_bar(x, y)", "=> {return x+1;}", "std::vector<int>", "a->b",
      "i++", "https://example.com/a?b=c&d=e", "user@example.org", "C:\\path\\file.txt",
      "--flag=value", "\xE3\x80\x82", "\xEF\xBC\x8C", "\xD8\x8C"};
  static const char* const kSpecials[] = {
      "<|end_of_text|>", "<|begin_of_text|>", "<|im_end|>",
      "<|im_start|>",    "<|endoftext|>",     "<think>",
      "</think>",        "<|eot_id|>",        "<|reserved_special_token_7|>",
      "<|end_of",        "<|endoftext|",      "<|im_end|><|im_start|>",
      "<<|endoftext|>>", "x<|endoftext|>y"};
  static const char* const kSpaces[] = {" ",
                                        "  ",
                                        "   ",
                                        "\t",
                                        "\t\t",
                                        "\n",
                                        "\n\n",
                                        "\r\n",
                                        "\r\n\r\n",
                                        " \n",
                                        "\n ",
                                        " \t \n ",
                                        "\xC2\xA0",
                                        "\xE3\x80\x80",
                                        "\xE2\x80\xA8",
                                        "\xC2\x85",
                                        "\xE1\xA0\x8E",
                                        "\xE2\x80\x8B",
                                        "\xE2\x80\x83",
                                        "\x0B",
                                        "\x0C",
                                        "\r"};
  static const char* const kInvalid[] = {
      "\xFF",     "\xC3", "\xE2\x82",     "\xED\xA0\x80", "\xF4\x90\x80\x80",
      "\xC0\xAF", "\x80", "\xF0\x9F\x98", "\xE0\x80\xAF"};
  std::mt19937_64 rng(o.seed);
  auto pick = [&rng](auto& list) {
    return list[std::uniform_int_distribution<size_t>(0, std::size(list) - 1)(rng)];
  };
  auto chance = [&rng](int percent) {
    return std::uniform_int_distribution<int>(0, 99)(rng) < percent;
  };
  std::vector<std::string> docs;
  size_t total = 0;
  while (total < o.total_bytes) {
    const size_t want =
        std::uniform_int_distribution<size_t>(o.min_doc_bytes, o.max_doc_bytes)(rng);
    std::string doc;
    while (doc.size() < want) {
      const int kind = std::uniform_int_distribution<int>(0, 99)(rng);
      if (kind < 55) {
        doc += pick(kWords);
      } else if (kind < 63) {  // a number
        const int digits = std::uniform_int_distribution<int>(1, 24)(rng);
        for (int d = 0; d < digits; ++d) doc += static_cast<char>('0' + rng() % 10);
        if (chance(20)) doc += chance(50) ? "." : ",";
      } else if (kind < 78) {
        doc += pick(kSpaces);
      } else if (kind < 80) {  // a long run of spaces or of one letter
        const int n = std::uniform_int_distribution<int>(8, 300)(rng);
        doc += std::string(static_cast<size_t>(n), chance(60) ? ' ' : 'a');
      } else if (kind < 81) {  // a very long word
        const int n = std::uniform_int_distribution<int>(200, 1500)(rng);
        for (int k = 0; k < n; ++k) doc += static_cast<char>('a' + rng() % 26);
      } else if (kind < 85 && o.special_strings) {
        doc += pick(kSpecials);
      } else if (kind < 87 && o.invalid_utf8) {
        doc += pick(kInvalid);
      } else if (kind < 92) {  // words glued without spaces
        doc += pick(kWords);
        doc += pick(kWords);
      } else {
        doc += ' ';
        doc += pick(kWords);
      }
      if (chance(70)) doc += ' ';
    }
    total += doc.size();
    docs.push_back(std::move(doc));
  }
  return docs;
}

}  // namespace outcore::test
