// The SentencePiece path (tokenizer.model, run by libsentencepiece) through `outcore tokenize`
// against Python's sentencepiece: models trained in the test (BPE and unigram, byte fallback),
// varied text, identical ids document by document. Also: a model directory whose
// tokenizer.json is unsupported falls back to its tokenizer.model.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "common/error.hpp"
#include "engine/data/tokenizer.hpp"
#include "engine/train/token_file.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/common/oracle_unavailable.hpp"
#include "tests/common/run_command.hpp"
#include "tests/common/temp_dir.hpp"
#include "tests/data/oracle_util.hpp"
#include "tests/data/sample_text.hpp"

namespace outcore::data {
namespace {

using test::json;
namespace fs = std::filesystem;

const std::string kPython = OUTCORE_PYTHON;
const fs::path kOracle = fs::path(OUTCORE_SOURCE_DIR) / "tests/data/sentencepiece_oracle.py";

class SentencePieceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string out;
    if (outcore::testing::run_command(kPython + " -c 'import sentencepiece'", out) != 0)
      OUTCORE_ORACLE_UNAVAILABLE("python3-sentencepiece is not installed: " + out);
    test::SampleTextOptions o;
    o.seed = 7;
    o.total_bytes = 200 * 1000;
    o.max_doc_bytes = 2000;
    o.invalid_utf8 = false;
    docs_ = test::sample_documents(o);
    std::string corpus, jsonl;
    for (const std::string& d : docs_) {
      std::string line = d;
      for (char& c : line)
        if (c == '\n' || c == '\r') c = ' ';
      corpus += line + "\n";
      jsonl += json{{"text", d}}.dump() + "\n";
    }
    test::write_file(dir_ / "corpus.txt", corpus);
    test::write_file(dir_ / "docs.jsonl", jsonl);
  }

  // Trains a model of `type` into DIR/<type>/tokenizer.model and returns the directory.
  fs::path train(const std::string& type) {
    const fs::path model_dir = dir_ / type;
    fs::create_directories(model_dir);
    std::string out;
    const std::string cmd = kPython + " " + test::shell_quote(kOracle.string()) + " train " +
                            test::shell_quote((dir_ / "corpus.txt").string()) + " " +
                            test::shell_quote((model_dir / "tokenizer").string()) + " " + type +
                            " 3000";
    EXPECT_EQ(outcore::testing::run_command(cmd, out), 0) << out;
    return model_dir;
  }

  // `outcore tokenize` over the documents against Python's ids; `split`: the oracle's tokens
  // split out of the text (a JSON list of [content, id]), none when empty.
  void compare(const fs::path& model_dir, const std::string& split = "") {
    std::string out;
    const fs::path ref = dir_ / "ref.bin";
    ASSERT_EQ(outcore::testing::run_command(
                  kPython + " " + test::shell_quote(kOracle.string()) + " encode " +
                      test::shell_quote((model_dir / "tokenizer.model").string()) + " " +
                      test::shell_quote((dir_ / "docs.jsonl").string()) + " " +
                      test::shell_quote(ref.string()) +
                      (split.empty() ? "" : " " + test::shell_quote(split)),
                  out),
              0)
        << out;
    const fs::path prefix = dir_ / "out";
    ASSERT_EQ(outcore::testing::run_command(
                  std::string(OUTCORE_CLI) + " tokenize --tokenizer " +
                      test::shell_quote(model_dir.string()) + " --input " +
                      test::shell_quote((dir_ / "docs.jsonl").string()) + " --out " +
                      test::shell_quote(prefix.string()) + " --threads 2",
                  out),
              0)
        << out;
    const std::vector<std::vector<uint32_t>> want = test::read_reference_ids(ref);
    ASSERT_EQ(want.size(), docs_.size());
    const train::TokenFile got = train::TokenFile::open(prefix.string() + ".bin");
    size_t at = 0;
    for (size_t d = 0; d < want.size(); ++d) {
      for (size_t i = 0; i < want[d].size(); ++i, ++at) {
        ASSERT_LT(at, got.size()) << "the token file ends inside document " << d;
        ASSERT_EQ(got[at], want[d][i])
            << "document " << d << ", token " << i << ": \"" << docs_[d].substr(0, 200) << "\"";
      }
    }
    EXPECT_EQ(at, got.size());
  }

  test::TempDir dir_{"sentencepiece"};
  std::vector<std::string> docs_;
};

TEST_F(SentencePieceTest, BpeModelMatchesPython) { compare(train("bpe")); }

TEST_F(SentencePieceTest, UnigramModelMatchesPython) { compare(train("unigram")); }

// A special token's text inside a document ("</s>" between the turns of a chat rendered as
// text) is that token, as Hugging Face's tokenizers make it, and each stretch between such
// tokens is encoded by the model on its own: with tokenizer.model alone, its unk, bos and eos
// pieces and the tokens tokenizer_config.json's added_tokens_decoder adds; with an unsupported
// tokenizer.json beside it, the tokens that file adds (ids past the pieces included).
TEST_F(SentencePieceTest, SpecialTokensInTheTextAreTheirIdsAsInHuggingFace) {
  const fs::path d = train("bpe");
  const std::vector<std::string> inserts = {"</s>",  "<s>",      " </s> ",
                                            "<unk>", "</s></s>", "<|im_start|>user\n",
                                            "</s",   "< s>",     "\n</s>\n<s>[INST] "};
  std::string jsonl;
  for (size_t i = 0; i < docs_.size(); ++i) {
    std::string& doc = docs_[i];
    for (size_t k = 0; k < 3; ++k) {
      size_t at = (i * 7919 + k * 104729) % (doc.size() + 1);
      while (at < doc.size() && (static_cast<unsigned char>(doc[at]) & 0xC0) == 0x80) ++at;
      doc.insert(at, inserts[(i + k) % inserts.size()]);
    }
    if (i % 5 == 0) doc += "</s>";  // a document ending in EOS takes no second one
    if (i % 7 == 0) doc = "<s>" + doc;
    jsonl += json{{"text", doc}}.dump() + "\n";
  }
  test::write_file(dir_ / "docs.jsonl", jsonl);
  {
    SCOPED_TRACE("tokenizer.model alone");
    compare(d, R"([["<unk>", 0], ["<s>", 1], ["</s>", 2]])");
  }
  {
    SCOPED_TRACE("tokenizer_config.json's added_tokens_decoder");
    const json token = {{"content", "<|im_start|>"}, {"lstrip", false},     {"rstrip", false},
                        {"single_word", false},      {"normalized", false}, {"special", true}};
    test::write_file(d / "tokenizer_config.json",
                     json{{"added_tokens_decoder", {{"3000", token}}}}.dump());
    compare(d, R"([["<unk>", 0], ["<s>", 1], ["</s>", 2], ["<|im_start|>", 3000]])");
    fs::remove(d / "tokenizer_config.json");
  }
  SCOPED_TRACE("an unsupported tokenizer.json");
  auto added = [](const char* content, uint32_t id) {
    return json{{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  const json converted = {
      {"model",
       {{"type", "BPE"},
        {"byte_fallback", true},
        {"vocab", json::object()},
        {"merges", json::array()}}},
      {"added_tokens",
       {added("<unk>", 0), added("<s>", 1), added("</s>", 2), added("<|im_start|>", 3000)}}};
  test::write_file(d / "tokenizer.json", converted.dump());
  compare(d, R"([["<unk>", 0], ["<s>", 1], ["</s>", 2], ["<|im_start|>", 3000]])");
}

// Llama 2 and Mistral ship a tokenizer.json converted from their SentencePiece model, with
// components outcore does not implement; tokenizer.model beside it is used instead.
TEST_F(SentencePieceTest, UnsupportedTokenizerJsonFallsBackToTheModel) {
  const fs::path d = train("bpe");
  auto added = [](const char* content, uint32_t id) {
    return json{{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  json converted = {{"model",
                     {{"type", "BPE"},
                      {"byte_fallback", true},
                      {"vocab", json::object()},
                      {"merges", json::array()}}},
                    {"added_tokens", {added("<unk>", 0), added("<s>", 1), added("</s>", 2)}}};
  test::write_file(d / "tokenizer.json", converted.dump());
  const Tokenizer t = Tokenizer::load(d.string());
  EXPECT_NE(t.description().find("SentencePiece"), std::string::npos) << t.description();
  EXPECT_EQ(t.bos_id(), 1u);
  EXPECT_EQ(t.eos_id(), 2u);
  EXPECT_EQ(t.vocab_size(), 3000u);
  std::vector<uint32_t> ids;
  t.encode("hello", true, ids);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), 1u);  // BOS by default, as Llama 2 adds it
  // Tokens the JSON adds that the model lacks (a chat template's, a <pad> past its pieces) take
  // the ids tokenizers gives them, past the pieces; a text holding one has it as that id.
  converted["added_tokens"].push_back(added("<|im_start|>", 3000));
  test::write_file(d / "tokenizer.json", converted.dump());
  const Tokenizer chat = Tokenizer::load(d.string());
  EXPECT_EQ(chat.vocab_size(), 3001u);
  EXPECT_EQ(chat.token_id("<|im_start|>"), 3000u);
  std::vector<uint32_t> same;
  chat.encode("hello", true, same);
  EXPECT_EQ(same, ids);
  std::vector<uint32_t> with_token;
  chat.encode("<|im_start|>hello", true, with_token);
  std::vector<uint32_t> want = {1, 3000};
  want.insert(want.end(), ids.begin() + 1, ids.end());
  EXPECT_EQ(with_token, want);
  // An id in the file other than the one tokenizers gives is warned about; tokenizers' is used.
  converted["added_tokens"].back()["id"] = 4000;
  test::write_file(d / "tokenizer.json", converted.dump());
  {
    outcore::test::LogCapture log;
    EXPECT_EQ(Tokenizer::load(d.string()).token_id("<|im_start|>"), 3000u);
    EXPECT_NE(log.text().find("is given id 4000 but tokenizers assigns it 3000"), std::string::npos)
        << log.text();
  }
  // Without the model beside it, the same tokenizer.json is refused naming the key.
  fs::remove(d / "tokenizer.model");
  EXPECT_THROW(Tokenizer::load(d.string()), ConfigError);
}

// tokenizer.model is read by outcore, not the library: what is not a regular file is refused
// naming it (a FIFO would block the library's read forever), and so is what does not parse.
TEST(SentencePieceModelFile, WhatIsNotARegularModelIsRefusedByName) {
  test::TempDir dir("sentencepiece-file");
  auto message = [](const fs::path& d) {
    try {
      Tokenizer::load(d.string());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  fs::create_directories(dir / "fifo");
  ASSERT_EQ(::mkfifo((dir / "fifo" / "tokenizer.model").c_str(), 0600), 0);
  EXPECT_NE(message(dir / "fifo").find((dir / "fifo" / "tokenizer.model").string() + ": is a FIFO"),
            std::string::npos)
      << message(dir / "fifo");
  fs::create_directories(dir / "directory" / "tokenizer.model");
  EXPECT_NE(message(dir / "directory").find("is a directory"), std::string::npos)
      << message(dir / "directory");
  fs::create_directories(dir / "garbage");
  test::write_file(dir / "garbage" / "tokenizer.model", std::string(1000, '\x7f'));
  EXPECT_NE(message(dir / "garbage").find("not a SentencePiece model"), std::string::npos)
      << message(dir / "garbage");
}

}  // namespace
}  // namespace outcore::data
