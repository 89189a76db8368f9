// Tokenizer::load and encode on small tokenizer files: the BPE merge order, ignore_merges,
// added-token flags, special-token templates, BOS/EOS from the config files, ill-formed UTF-8,
// threads, and every way a tokenizer directory is refused (naming the file and the key).
#include "engine/data/tokenizer.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <thread>

#include "common/error.hpp"
#include "engine/data/utf8.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/common/temp_dir.hpp"
#include "tests/data/tiny_tokenizer.hpp"

namespace outcore::data {
namespace {

using test::json;
namespace fs = std::filesystem;

std::vector<uint32_t> encode(const Tokenizer& t, std::string_view text, bool special = true) {
  std::vector<uint32_t> ids;
  t.encode(text, special, ids);
  return ids;
}

// The message of the ConfigError that loading `dir` throws ("" when it loads).
std::string load_error(const fs::path& dir) {
  try {
    Tokenizer::load(dir.string());
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

class TokenizerTest : public ::testing::Test {
 protected:
  // Writes `t` (and `config`) to a fresh directory and returns it.
  fs::path dir_with(const json& t, const json& config = nullptr) {
    const fs::path d = dir_ / ("tok" + std::to_string(count_++));
    test::write_tokenizer_dir(d, t, config);
    return d;
  }
  Tokenizer load(const json& t, const json& config = nullptr) {
    return Tokenizer::load(dir_with(t, config).string());
  }

  test::TempDir dir_{"tokenizer"};
  int count_ = 0;
};

TEST(Utf8Test, FindsTheFirstIllFormedSequence) {
  EXPECT_EQ(find_invalid_utf8("plain ascii"), 11u);
  EXPECT_EQ(find_invalid_utf8("caf\xC3\xA9 \xF0\x9F\x98\x80"), 10u);
  EXPECT_EQ(find_invalid_utf8("ab\xC0\xAF"), 2u);         // overlong
  EXPECT_EQ(find_invalid_utf8("x\xED\xA0\x80"), 1u);      // a surrogate
  EXPECT_EQ(find_invalid_utf8("x\xF4\x90\x80\x80"), 1u);  // above U+10FFFF
  EXPECT_EQ(find_invalid_utf8("12345678\xE2\x82"), 8u);   // truncated at the end
  EXPECT_EQ(find_invalid_utf8(std::string_view("a\0b", 3)), 3u);
}

// The WHATWG decoder's U+FFFD per maximal subpart (the Encoding Standard's examples).
TEST(Utf8Test, ReplacesMaximalSubpartsAsTextDecoderDoes) {
  auto repaired = [](std::string_view s) {
    std::string out;
    append_replacing_invalid_utf8(s, out);
    return out;
  };
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(repaired("valid \xC3\xA9"), "valid \xC3\xA9");
  EXPECT_EQ(repaired("\xFF"), r);
  EXPECT_EQ(repaired("a\xE2\x82"
                     "b"),
            "a" + r + "b");                        // one for the truncated sequence
  EXPECT_EQ(repaired("\xF0\x80\x80"), r + r + r);  // F0 80 is not a prefix: three
  EXPECT_EQ(repaired("\xF0\x9F\x98"), r);          // a truncated emoji: one
  EXPECT_EQ(repaired("\xED\xA0\x80"), r + r + r);
  EXPECT_EQ(repaired("\xC0\xAF"), r + r);
  EXPECT_EQ(repaired("\xF4\x90\x80\x80"), r + r + r + r);
  EXPECT_EQ(repaired("\xE0\x80\xAF"), r + r + r);
  EXPECT_EQ(repaired("\xC3\xC3\xA9"), r + "\xC3\xA9");  // the second lead byte starts anew
}

TEST_F(TokenizerTest, MergesApplyLowestRankFirst) {
  const Tokenizer t = load(test::tiny_tokenizer());
  // " the": " t" (256) before "he" (257), then " t"+"he" (258).
  EXPECT_EQ(encode(t, " the"), (std::vector<uint32_t>{258}));
  EXPECT_EQ(encode(t, "the"), (std::vector<uint32_t>{'t', 257}));
  // " and": " a" (261) comes before "an" (262): " a" + "n" + "d"; "and" alone: "an" + "d" ->
  // "and" (263).
  EXPECT_EQ(encode(t, " and"), (std::vector<uint32_t>{261, 'n', 'd'}));
  EXPECT_EQ(encode(t, "and"), (std::vector<uint32_t>{263}));
  EXPECT_EQ(encode(t, "singing"), (std::vector<uint32_t>{'s', 260, 260}));
  EXPECT_EQ(t.vocab_size(), 265u);
  EXPECT_EQ(t.eos_id(), std::nullopt);  // no tokenizer_config.json
}

// A byte-level vocabulary without some bytes and without unk_token drops them, as tokenizers
// does; loading it says so, naming the bytes. A whole one says nothing.
TEST_F(TokenizerTest, AByteLevelVocabularyMissingBytesIsWarnedAbout) {
  {
    outcore::test::LogCapture log;
    (void)load(test::tiny_tokenizer());
    EXPECT_EQ(log.text().find("no token for"), std::string::npos) << log.text();
  }
  json j = test::tiny_tokenizer();
  j["model"]["vocab"].erase(test::byte_level("z"));
  outcore::test::LogCapture log;
  const Tokenizer t = load(j);
  EXPECT_NE(log.text().find("model.vocab has no token for 1 of the 256 bytes (0x7a) and "
                            "model.unk_token is null"),
            std::string::npos)
      << log.text();
  EXPECT_EQ(encode(t, "buzz"), (std::vector<uint32_t>{'b', 'u'}));  // tokenizers' ids
}

// A vocabulary of characters (not byte-level) without unk_token drops the characters it has no
// token for, as tokenizers does; loading it says so. With unk_token they become that token, and
// loading says nothing.
TEST_F(TokenizerTest, ACharacterVocabularyWithoutAnUnknownTokenIsWarnedAbout) {
  json j = test::tiny_tokenizer();
  j["pre_tokenizer"] = nullptr;
  j["model"]["vocab"] = {{"a", 0}, {"b", 1}, {"ab", 2}, {"<unk>", 3}};
  j["model"]["merges"] = json::array({json::array({"a", "b"})});
  j["added_tokens"] = json::array();
  {
    outcore::test::LogCapture log;
    const Tokenizer t = load(j);
    EXPECT_NE(log.text().find("not byte-level and model.unk_token is null: a character with no "
                              "token in model.vocab is dropped"),
              std::string::npos)
        << log.text();
    EXPECT_EQ(encode(t, "abcab"), (std::vector<uint32_t>{2, 2}));  // tokenizers' ids
  }
  j["model"]["unk_token"] = "<unk>";
  outcore::test::LogCapture log;
  const Tokenizer t = load(j);
  EXPECT_EQ(log.text().find("unk_token"), std::string::npos) << log.text();
  EXPECT_EQ(encode(t, "abcab"), (std::vector<uint32_t>{2, 3, 2}));
}

TEST_F(TokenizerTest, IgnoreMergesEmitsAWordThatIsAToken) {
  json j = test::tiny_tokenizer();
  // "tin" is a token, but no merge makes it ("t"+"in" is not a merge).
  j["model"]["vocab"]["tin"] = 265;
  EXPECT_EQ(encode(load(j), "tin"), (std::vector<uint32_t>{'t', 259}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(encode(load(j), "tin"), (std::vector<uint32_t>{265}));
}

TEST_F(TokenizerTest, AddedTokensAreMatchedInTheTextWithTheirFlags) {
  json j = test::tiny_tokenizer();
  auto add = [&j](uint32_t id, const char* content, bool lstrip, bool rstrip, bool single) {
    j["added_tokens"].push_back({{"id", id},
                                 {"content", content},
                                 {"single_word", single},
                                 {"lstrip", lstrip},
                                 {"rstrip", rstrip},
                                 {"normalized", false},
                                 {"special", false}});
  };
  add(265, "<L>", true, false, false);
  add(266, "<R>", false, true, false);
  add(267, "zz", false, false, true);
  const Tokenizer t = load(j);
  EXPECT_EQ(encode(t, "a<|endoftext|>b"), (std::vector<uint32_t>{'a', 264, 'b'}));
  EXPECT_EQ(encode(t, "a  <L>b"), (std::vector<uint32_t>{'a', 265, 'b'}));
  EXPECT_EQ(encode(t, "a<R> \n b"), (std::vector<uint32_t>{'a', 266, 'b'}));
  EXPECT_EQ(encode(t, "x zz y"), (std::vector<uint32_t>{'x', ' ', 267, ' ', 'y'}));
  EXPECT_EQ(encode(t, "xzz"), (std::vector<uint32_t>{'x', 'z', 'z'}));  // not a single word
  EXPECT_EQ(t.vocab_size(), 268u);
  EXPECT_EQ(t.token_id("<R>"), 266u);
  EXPECT_EQ(t.token_id(test::byte_level(" the")), 258u);  // as tokenizer.json writes it
  EXPECT_EQ(t.token_id(" the"), std::nullopt);
  EXPECT_EQ(t.token_id("nothing"), std::nullopt);
}

TEST_F(TokenizerTest, TemplatesAddSpecialTokensOnlyWhenAsked) {
  json j = test::tiny_tokenizer();
  j["added_tokens"].push_back(
      {{"id", 265}, {"content", "<s>"}, {"special", true}, {"normalized", false}});
  j["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                              {{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}}})},
      {"special_tokens",
       {{"<s>", {{"id", "<s>"}, {"ids", {265}}}},
        {"<|endoftext|>", {{"id", "x"}, {"ids", {264}}}}}}};
  const Tokenizer t = load(j);
  EXPECT_EQ(encode(t, "a", true), (std::vector<uint32_t>{265, 'a', 264}));
  EXPECT_EQ(encode(t, "a", false), (std::vector<uint32_t>{'a'}));
  // tokenizer_config.json's add_bos_token / add_eos_token replace the template.
  const Tokenizer bos_only = load(j, {{"bos_token", {{"content", "<s>"}}},
                                      {"eos_token", "<|endoftext|>"},
                                      {"add_bos_token", true}});
  EXPECT_EQ(encode(bos_only, "a", true), (std::vector<uint32_t>{265, 'a'}));
  EXPECT_EQ(bos_only.bos_id(), 265u);
  EXPECT_EQ(bos_only.eos_id(), 264u);
  const Tokenizer eos_only = load(j, {{"eos_token", "<|endoftext|>"}, {"add_eos_token", true}});
  EXPECT_EQ(encode(eos_only, "a", true), (std::vector<uint32_t>{'a', 264}));
  // A template's id outside the vocabulary would be written into every document: refused.
  j["post_processor"]["special_tokens"]["<s>"]["ids"] = {300};
  const std::string err = load_error(dir_with(j));
  EXPECT_NE(err.find("the template adds id 300, outside the vocabulary (vocab_size 266)"),
            std::string::npos)
      << err;
}

TEST_F(TokenizerTest, SpecialTokensComeFromTheConfigFiles) {
  const fs::path d = dir_with(test::tiny_tokenizer());
  test::write_file(
      d / "special_tokens_map.json",
      json{{"eos_token", {{"content", "<|endoftext|>"}}}, {"bos_token", "<|endoftext|>"}}.dump());
  Tokenizer t = Tokenizer::load(d.string());
  EXPECT_EQ(t.eos_id(), 264u);
  EXPECT_EQ(t.bos_id(), 264u);
  // tokenizer_config.json wins, and its null means none.
  test::write_file(d / "tokenizer_config.json", json{{"bos_token", nullptr}}.dump());
  t = Tokenizer::load(d.string());
  EXPECT_EQ(t.bos_id(), std::nullopt);
  EXPECT_EQ(t.eos_id(), 264u);
  test::write_file(d / "tokenizer_config.json", json{{"eos_token", "<|nope|>"}}.dump());
  EXPECT_NE(load_error(d).find("eos_token: \"<|nope|>\" is not a token"), std::string::npos)
      << load_error(d);
  test::write_file(d / "special_tokens_map.json", json{{"eos_token", "<|endoftext|>"}}.dump());
  test::write_file(d / "tokenizer_config.json", json{{"add_bos_token", true}}.dump());
  EXPECT_NE(load_error(d).find("add_bos_token"), std::string::npos);
  test::write_file(d / "tokenizer_config.json", "{not json");
  EXPECT_NE(load_error(d).find("tokenizer_config.json: not valid JSON"), std::string::npos);
}

TEST_F(TokenizerTest, IllFormedUtf8IsEncodedAsReplacementCharacters) {
  const Tokenizer t = load(test::tiny_tokenizer());
  EXPECT_EQ(encode(t,
                   "a\xFF"
                   "b"),
            encode(t,
                   "a\xEF\xBF\xBD"
                   "b"));
  EXPECT_EQ(encode(t, "\xF0\x80\x80"), encode(t, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"));
}

TEST_F(TokenizerTest, EncodeIsThreadSafe) {
  const Tokenizer t = load(test::tiny_tokenizer());
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i)
    texts.push_back("the singing and " + std::to_string(i * 7919) + " <|endoftext|> then");
  std::vector<std::vector<uint32_t>> serial;
  for (const std::string& s : texts) serial.push_back(encode(t, s));
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&] {
      for (int round = 0; round < 20; ++round)
        for (size_t i = 0; i < texts.size(); ++i)
          if (encode(t, texts[i]) != serial[i]) ++mismatches;
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(TokenizerTest, ADirectoryWithoutATokenizerIsRefusedByName) {
  EXPECT_NE(load_error(dir_.path()).find("no tokenizer.json or tokenizer.model"),
            std::string::npos);
  EXPECT_NE(load_error(dir_ / "missing").find("not a directory"), std::string::npos);
}

// Inside a character class \b is a backspace, in Oniguruma as in PCRE2: accepted.
TEST_F(TokenizerTest, ABackspaceInACharacterClassIsAccepted) {
  json j = test::tiny_tokenizer();
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "[\\b\\t]+"}}}, {"behavior", "Isolated"}},
        j["pre_tokenizer"]}}};
  const Tokenizer t = Tokenizer::load(dir_with(j).string());
  std::vector<uint32_t> ids;
  t.encode("a\bb", false, ids);
  EXPECT_EQ(ids, (std::vector<uint32_t>{'a', 0x08, 'b'}));
}

// Each unsupported or malformed part names the file and the JSON key.
TEST_F(TokenizerTest, UnsupportedComponentsAreRefusedNamingTheKey) {
  struct Case {
    const char* key_in_message;
    std::function<void(json&)> edit;
  };
  const std::vector<Case> cases = {
      {"normalizer.type: normalizer \"Lowercase\" is not supported",
       [](json& j) {
         j["normalizer"] = {{"type", "Lowercase"}};
       }},
      {"normalizer.normalizers[1].type",
       [](json& j) {
         j["normalizer"] = {{"type", "Sequence"},
                            {"normalizers", {{{"type", "NFC"}}, {{"type", "Strip"}}}}};
       }},
      {"pre_tokenizer.pretokenizers[0].type: pre-tokenizer \"Whitespace\"",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers", {{{"type", "Whitespace"}}, j["pre_tokenizer"]}}};
       }},
      {"pre_tokenizer.pretokenizers[1]: a pre-tokenizer after ByteLevel",
       [](json& j) {
         j["pre_tokenizer"] = {
             {"type", "Sequence"},
             {"pretokenizers",
              {j["pre_tokenizer"],
               {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Isolated"}}}}};
       }},
      {"pre_tokenizer.pattern: pattern \"(\" does not compile",
       [](json& j) {
         j["pre_tokenizer"] = {
             {"type", "Split"}, {"pattern", {{"Regex", "("}}}, {"behavior", "Isolated"}};
       }},
      {"pre_tokenizer.pattern: \\w is not supported",
       [](json& j) {
         j["pre_tokenizer"] = {
             {"type", "Split"}, {"pattern", {{"Regex", "[^\\w]+|\\w+"}}}, {"behavior", "Isolated"}};
       }},
      {"pre_tokenizer.pattern: \\b is not supported",
       [](json& j) {
         j["pre_tokenizer"] = {
             {"type", "Split"}, {"pattern", {{"Regex", "\\bx"}}}, {"behavior", "Isolated"}};
       }},
      {"pre_tokenizer.pattern: POSIX bracket [:alpha:] is not supported",
       [](json& j) {
         j["pre_tokenizer"] = {
             {"type", "Split"}, {"pattern", {{"Regex", "[[:alpha:]]+"}}}, {"behavior", "Isolated"}};
       }},
      {"pre_tokenizer.behavior: unknown behavior \"Sideways\"",
       [](json& j) {
         j["pre_tokenizer"] = {
             {"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Sideways"}};
       }},
      {"post_processor.type: post-processor \"Bogus\"",
       [](json& j) {
         j["post_processor"] = {{"type", "Bogus"}};
       }},
      {"truncation: truncation is not supported",
       [](json& j) {
         j["truncation"] = {{"max_length", 512}};
       }},
      {"model.type: model \"WordPiece\"", [](json& j) { j["model"]["type"] = "WordPiece"; }},
      {"model.byte_fallback", [](json& j) { j["model"]["byte_fallback"] = true; }},
      {"model.dropout", [](json& j) { j["model"]["dropout"] = 0.1; }},
      {"model.continuing_subword_prefix",
       [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }},
      {"model.merges[8]: token \"zz\" is not in model.vocab",
       [](json& j) {
         j["model"]["merges"].push_back({"z", "z"});
       }},
      {"model.merges[8]: \"a b c\" is not two tokens",
       [](json& j) { j["model"]["merges"].push_back("a b c"); }},
      {"model.vocab[\"x\"]: must be a token id", [](json& j) { j["model"]["vocab"]["x"] = -1; }},
      {"added_tokens[0].content: must be a string",
       [](json& j) { j["added_tokens"][0]["content"] = 5; }},
  };
  for (const Case& c : cases) {
    json j = test::tiny_tokenizer();
    c.edit(j);
    const fs::path d = dir_with(j);
    const std::string message = load_error(d);
    EXPECT_NE(message.find(c.key_in_message), std::string::npos)
        << "want \"" << c.key_in_message << "\" in: " << message;
    EXPECT_NE(message.find((d / "tokenizer.json").string()), std::string::npos) << message;
  }
  const fs::path truncated = dir_with(test::tiny_tokenizer());
  test::write_file(truncated / "tokenizer.json", "{\"model\": ");
  EXPECT_NE(load_error(truncated).find("tokenizer.json: not valid JSON"), std::string::npos);
}

// Values nested a million deep (a few megabytes of brackets) are refused naming the file, in
// tokenizer.json and tokenizer_config.json alike: the messages that show a bad value, and the
// readers of Sequence components, recurse into what they read. A value too large to show is
// described, not dumped.
TEST_F(TokenizerTest, DeeplyNestedOrHugeValuesAreRefusedNamingTheFile) {
  const size_t deep = 1'000'000;
  const std::string nested = std::string(deep, '[') + std::string(deep, ']');
  {
    const fs::path d = dir_with(test::tiny_tokenizer());
    test::write_file(d / "tokenizer_config.json", "{\"eos_token\": " + nested + "}");
    const std::string message = load_error(d);
    EXPECT_NE(message.find((d / "tokenizer_config.json").string() +
                           ": objects and arrays nested deeper than 128 levels"),
              std::string::npos)
        << message;
  }
  {
    json j = test::tiny_tokenizer();
    j["model"]["type"] = "@";
    const fs::path d = dir_with(j);
    std::string text = j.dump();
    text.replace(text.find("\"@\""), 3, nested);
    test::write_file(d / "tokenizer.json", text);
    const std::string message = load_error(d);
    EXPECT_NE(message.find((d / "tokenizer.json").string() +
                           ": objects and arrays nested deeper than 128 levels"),
              std::string::npos)
        << message;
  }
  {  // Sequence in Sequence, 200 deep: past the limit, refused at once
    json j = test::tiny_tokenizer();
    json n = {{"type", "NFC"}};
    for (int i = 0; i < 200; ++i) n = {{"type", "Sequence"}, {"normalizers", json::array({n})}};
    j["normalizer"] = n;
    const std::string message = load_error(dir_with(j));
    EXPECT_NE(message.find("tokenizer.json: objects and arrays nested deeper than 128 levels"),
              std::string::npos)
        << message;
  }
  {  // a wrong value of 100000 elements is described, not printed
    json j = test::tiny_tokenizer();
    j["model"]["type"] = json::array();
    for (int i = 0; i < 100000; ++i) j["model"]["type"].push_back(i);
    const std::string message = load_error(dir_with(j));
    EXPECT_NE(message.find("model an array of 100000 elements is not supported"), std::string::npos)
        << message.substr(0, 300);
    EXPECT_LT(message.size(), 1000u);
  }
}

}  // namespace
}  // namespace outcore::data
