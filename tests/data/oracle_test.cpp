// outcore's tokenizer against Hugging Face tokenizers itself (under Node, tests/data/oracle):
// over 1 MB of generated text in many documents, the ids must be identical, document by
// document, for Llama 3's and Qwen3's real tokenizer files and for tokenizers derived from
// them that exercise the rest of what tokenizer.json support covers (GPT-2's ByteLevel regex
// and prefix space, NFD/NFKC, templates, added-token flags, every Split behaviour).
#include <gtest/gtest.h>

#include <chrono>

#include "common/error.hpp"
#include "engine/data/tokenizer.hpp"
#include "tests/common/oracle_unavailable.hpp"
#include "tests/common/temp_dir.hpp"
#include "tests/data/oracle_util.hpp"
#include "tests/data/sample_text.hpp"

namespace outcore::data {
namespace {

using test::json;
namespace fs = std::filesystem;

// Printable form of a document around byte `at`, for failure messages.
std::string excerpt(const std::string& doc, size_t at = 0, size_t width = 160) {
  const size_t begin = at > width / 2 ? at - width / 2 : 0;
  std::string out;
  for (unsigned char c : doc.substr(begin, width)) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string ids_around(const std::vector<uint32_t>& ids, size_t at) {
  std::string out;
  const size_t begin = at > 6 ? at - 6 : 0;
  for (size_t i = begin; i < std::min(ids.size(), at + 6); ++i) {
    out += i == at ? "[" : "";
    out += std::to_string(ids[i]);
    out += i == at ? "] " : " ";
  }
  return out;
}

// Each tokenizer compared: a name, its directory, and whether special tokens are added.
struct Case {
  std::string name;
  fs::path dir;
  bool add_special_tokens = true;
};

class TokenizerOracleTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    missing_ = test::node_oracle_missing();
    if (!missing_.empty()) return;
    test::SampleTextOptions o;
    o.seed = 20240520;
    o.total_bytes = 1100 * 1000;
    docs_ = new std::vector<std::string>(test::sample_documents(o));
  }
  static void TearDownTestSuite() {
    delete docs_;
    docs_ = nullptr;
  }

  // Encodes the documents with every case, ours and the reference's, and compares.
  void compare(const std::vector<Case>& cases) {
    if (!missing_.empty()) OUTCORE_ORACLE_UNAVAILABLE(missing_);
    const fs::path docs_file = dir_ / "docs.bin";
    test::write_documents(docs_file, *docs_);
    for (bool special : {true, false}) {
      std::vector<std::pair<fs::path, fs::path>> jobs;
      std::vector<const Case*> which;
      for (const Case& c : cases) {
        if (c.add_special_tokens != special) continue;
        jobs.emplace_back(c.dir / "tokenizer.json", dir_ / (c.name + ".ref"));
        which.push_back(&c);
      }
      if (jobs.empty()) continue;
      std::string log;
      const auto t0 = std::chrono::steady_clock::now();
      ASSERT_EQ(test::run_node_oracle(docs_file, jobs, special, log), 0) << log;
      const double node_s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      for (size_t k = 0; k < which.size(); ++k) {
        const auto t1 = std::chrono::steady_clock::now();
        const Tokenizer tok = Tokenizer::load(which[k]->dir.string());
        const std::vector<std::vector<uint32_t>> ref = test::read_reference_ids(jobs[k].second);
        ASSERT_EQ(ref.size(), docs_->size()) << which[k]->name << ": " << log;
        size_t tokens = 0;
        for (size_t d = 0; d < docs_->size(); ++d) {
          std::vector<uint32_t> ours;
          tok.encode((*docs_)[d], special, ours);
          tokens += ours.size();
          if (ours == ref[d]) continue;
          size_t at = 0;
          while (at < ours.size() && at < ref[d].size() && ours[at] == ref[d][at]) ++at;
          FAIL() << which[k]->name << ": document " << d << " of " << docs_->size()
                 << " differs at token " << at << " (ours " << ours.size() << " tokens, reference "
                 << ref[d].size() << ")\n  ours:      " << ids_around(ours, at)
                 << "\n  reference: " << ids_around(ref[d], at) << "\n  document: \""
                 << excerpt((*docs_)[d], (*docs_)[d].size() * at / std::max<size_t>(1, ours.size()))
                 << "\"";
        }
        const double ours_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
        std::printf(
            "%s: %zu documents, %zu tokens identical (ours %.2f s with loading; the "
            "reference run %.2f s)\n",
            which[k]->name.c_str(), docs_->size(), tokens, ours_s, node_s);
      }
    }
  }

  test::TempDir dir_{"tokenizer-oracle"};
  static std::string missing_;
  static std::vector<std::string>* docs_;
};

std::string TokenizerOracleTest::missing_;
std::vector<std::string>* TokenizerOracleTest::docs_ = nullptr;

// Llama 3's tokenizer.json as shipped (ignore_merges, its Split regex with \p{N}{1,3}, 256
// special tokens) and Qwen3's (NFC, single digits, special and non-special added tokens).
TEST_F(TokenizerOracleTest, Llama3AndQwen3FilesMatchHuggingFace) {
  compare({{"llama3", test::llama3_dir()}, {"qwen3", test::qwen3_dir()}});
}

// Llama 3 with the template Meta's later files carry (a BOS through TemplateProcessing inside
// a Sequence), and NFKC; with and without special tokens.
TEST_F(TokenizerOracleTest, Llama3TemplateAndNfkcMatchHuggingFace) {
  if (!missing_.empty()) OUTCORE_ORACLE_UNAVAILABLE(missing_);
  json t = test::read_json(test::llama3_dir() / "tokenizer.json");
  t["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFKC"}}})}};
  t["post_processor"] = {
      {"type", "Sequence"},
      {"processors",
       json::array({{{"type", "ByteLevel"},
                     {"add_prefix_space", true},
                     {"trim_offsets", false},
                     {"use_regex", true}},
                    {{"type", "TemplateProcessing"},
                     {"single", json::array({{{"SpecialToken",
                                               {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                                             {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                     {"pair", json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                           {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
                     {"special_tokens",
                      {{"<|begin_of_text|>",
                        {{"id", "<|begin_of_text|>"},
                         {"ids", json::array({128000})},
                         {"tokens", json::array({"<|begin_of_text|>"})}}}}}}})}};
  test::write_tokenizer_dir(dir_ / "llama3_bos", t);
  compare({{"llama3_bos_nfkc", dir_ / "llama3_bos", true},
           {"llama3_bos_nfkc_no_special", dir_ / "llama3_bos", false}});
}

// GPT-2's pre-tokenizer (ByteLevel with use_regex), without and with the prefix space; the
// second also with NFD, a BOS template and added tokens with lstrip, rstrip, single_word and
// both normalized settings (a normalized one that NFD changes).
TEST_F(TokenizerOracleTest, Gpt2StyleByteLevelMatchesHuggingFace) {
  if (!missing_.empty()) OUTCORE_ORACLE_UNAVAILABLE(missing_);
  json t = test::gpt2_style_tokenizer(50000);
  test::write_tokenizer_dir(dir_ / "gpt2", t);
  t["pre_tokenizer"]["add_prefix_space"] = true;
  t["normalizer"] = {{"type", "NFD"}};
  t["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", json::array({{{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                              {{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}}})},
      {"pair", json::array({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
      {"special_tokens",
       {{"<|endoftext|>",
         {{"id", "<|endoftext|>"},
          {"ids", json::array({50000})},
          {"tokens", json::array({"<|endoftext|>"})}}}}}};
  auto added = [](uint32_t id, const char* content, bool lstrip, bool rstrip, bool single_word,
                  bool normalized, bool special) {
    return json{{"id", id},          {"content", content}, {"single_word", single_word},
                {"lstrip", lstrip},  {"rstrip", rstrip},   {"normalized", normalized},
                {"special", special}};
  };
  t["added_tokens"] = json::array({added(50000, "<|endoftext|>", false, false, false, false, true),
                                   added(50001, "<think>", true, false, false, false, false),
                                   added(50002, "</think>", false, true, false, false, false),
                                   added(50003, "dog", false, false, true, true, false),
                                   added(50004, "<|im_end|>", true, true, false, false, true),
                                   added(50005, "caf\xC3\xA9", false, false, false, true, false),
                                   added(50006, "fox", true, true, true, true, false)});
  test::write_tokenizer_dir(dir_ / "gpt2_prefix", t);
  compare({{"gpt2", dir_ / "gpt2"},
           {"gpt2_prefix_nfd_flags", dir_ / "gpt2_prefix"},
           {"gpt2_prefix_nfd_flags_no_special", dir_ / "gpt2_prefix", false}});
}

// Every Split behaviour, String and Regex patterns, invert, Sequence, ByteLevel without its
// regex, ignore_merges on a vocabulary that did not ask for it, and merges as pairs.
TEST_F(TokenizerOracleTest, SplitBehavioursMatchHuggingFace) {
  if (!missing_.empty()) OUTCORE_ORACLE_UNAVAILABLE(missing_);
  json t = test::gpt2_style_tokenizer(30000);
  json pairs = json::array();
  for (const json& m : t["model"]["merges"]) {
    const std::string s = m;
    pairs.push_back({s.substr(0, s.find(' ')), s.substr(s.find(' ') + 1)});
  }
  t["model"]["merges"] = pairs;
  t["model"]["ignore_merges"] = true;
  auto split = [](const char* kind, const char* pattern, const char* behavior, bool invert) {
    return json{{"type", "Split"},
                {"pattern", {{kind, pattern}}},
                {"behavior", behavior},
                {"invert", invert}};
  };
  t["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers", json::array({split("String", " ", "MergedWithNext", false),
                                     split("Regex", "\\p{N}", "Contiguous", false),
                                     split("Regex", "[.,!?;:]", "MergedWithPrevious", false),
                                     split("Regex", "\\s+", "Removed", false),
                                     split("Regex", "[\\p{Han}\\p{Hangul}]+", "Isolated", true),
                                     split("String", "'", "MergedWithPrevious", true),
                                     {{"type", "ByteLevel"},
                                      {"add_prefix_space", false},
                                      {"trim_offsets", true},
                                      {"use_regex", false}}})}};
  test::write_tokenizer_dir(dir_ / "splits", t);
  t["pre_tokenizer"]["pretokenizers"][0] = split("Regex", "(?i:the)|\\S+", "Isolated", true);
  t["pre_tokenizer"]["pretokenizers"][1] = split("Regex", "\\d+", "Removed", true);
  test::write_tokenizer_dir(dir_ / "splits_inverted", t);
  // ^ and $ at every line's start and end, as in Oniguruma's Ruby syntax.
  t["pre_tokenizer"]["pretokenizers"][2] = split("Regex", "^[a-z]+|[a-z]+$", "Isolated", false);
  test::write_tokenizer_dir(dir_ / "splits_anchored", t);
  // Each merging behaviour where no later step hides it (above, \\s+ Removed drops the spaces
  // MergedWithNext joined), two steps deep on every piece.
  t["pre_tokenizer"]["pretokenizers"] =
      json::array({split("Regex", "\\s", "MergedWithNext", false),
                   split("Regex", "[.,!?;:']", "MergedWithPrevious", false),
                   split("Regex", "\\p{N}", "Contiguous", false),
                   {{"type", "ByteLevel"},
                    {"add_prefix_space", false},
                    {"trim_offsets", true},
                    {"use_regex", false}}});
  test::write_tokenizer_dir(dir_ / "splits_merged", t);
  compare({{"splits", dir_ / "splits"},
           {"splits_inverted", dir_ / "splits_inverted"},
           {"splits_anchored", dir_ / "splits_anchored"},
           {"splits_merged", dir_ / "splits_merged"}});
}

}  // namespace
}  // namespace outcore::data
