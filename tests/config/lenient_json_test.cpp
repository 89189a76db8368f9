// The lenient JSON layer: comments, trailing commas, duplicate keys, error positions.
#include "engine/config/lenient_json.hpp"

#include <gtest/gtest.h>

namespace outcore::config::detail {
namespace {

TEST(LenientJson, AcceptsLineAndBlockComments) {
  LenientParse p = parse_lenient_json(R"({
    // a line comment
    "url": "http://example.com/*not a comment*/", /* a block
    comment */ "n": 2
  })");
  ASSERT_TRUE(p.errors.empty()) << p.errors[0].to_string();
  EXPECT_EQ(p.value["url"], "http://example.com/*not a comment*/");
  EXPECT_EQ(p.value["n"], 2);
}

TEST(LenientJson, BlanksTrailingCommasOnly) {
  std::string_view text = R"({"a": [1, 2,], "s": ",}", /* ,} */ "b": {"c": 1,},})";
  std::string out = blank_trailing_commas(text);
  ASSERT_EQ(out.size(), text.size());  // offsets unchanged for error positions
  EXPECT_EQ(out, R"({"a": [1, 2 ], "s": ",}", /* ,} */ "b": {"c": 1 } })");
}

TEST(LenientJson, TrailingCommaBeforeCommentAndNewline) {
  LenientParse p = parse_lenient_json("{\"a\": 1, // last\n}");
  ASSERT_TRUE(p.errors.empty()) << p.errors[0].to_string();
  EXPECT_EQ(p.value["a"], 1);
}

// DeepSpeed reads config files with hjson, whose # comments run to the end of the line; a # in
// a string or in another comment is not one.
TEST(LenientJson, HashCommentsAreComments) {
  const std::string_view text =
      "# a DeepSpeed config\n{\"a\": 1, # the first\n \"s\": \"#x\", /* # */ \"b\": 2, # last\n}";
  const std::string out = blank_trailing_commas(text);
  ASSERT_EQ(out.size(), text.size());
  const LenientParse p = parse_lenient_json(text);
  ASSERT_TRUE(p.errors.empty()) << p.errors[0].to_string();
  EXPECT_EQ(p.value["a"], 1);
  EXPECT_EQ(p.value["s"], "#x");
  EXPECT_EQ(p.value["b"], 2);
  const LenientParse bad = parse_lenient_json("{\"a\": # 1\n}");
  ASSERT_EQ(bad.errors.size(), 1u);
  EXPECT_NE(bad.errors[0].message.find("line 2"), std::string::npos) << bad.errors[0].to_string();
}

TEST(LenientJson, LoneCommaIsStillAnError) {
  EXPECT_EQ(blank_trailing_commas("[,]"), "[,]");
  EXPECT_EQ(blank_trailing_commas("{\"a\": 1,,}"), "{\"a\": 1,,}");
  EXPECT_FALSE(parse_lenient_json("[,]").errors.empty());
  EXPECT_FALSE(parse_lenient_json("{\"a\": 1,,}").errors.empty());
}

TEST(LenientJson, EscapedQuoteDoesNotEndString) {
  std::string_view text = R"({"s": "a\",]", "t": 1,})";
  EXPECT_EQ(blank_trailing_commas(text), R"({"s": "a\",]", "t": 1 })");
}

TEST(LenientJson, LineColumnOfOffsets) {
  std::string_view text = "ab\ncd\n\nx";
  EXPECT_EQ(line_column(text, 0).line, 1u);
  EXPECT_EQ(line_column(text, 0).column, 1u);
  EXPECT_EQ(line_column(text, 4).line, 2u);
  EXPECT_EQ(line_column(text, 4).column, 2u);
  EXPECT_EQ(line_column(text, 7).line, 4u);
  EXPECT_EQ(line_column(text, 7).column, 1u);
  EXPECT_EQ(line_column(text, 100).line, 4u);  // clamped
}

TEST(LenientJson, SyntaxErrorNamesLineAndColumn) {
  // The stray token is the `x` at line 3, column 8.
  LenientParse p = parse_lenient_json("{\n  \"a\": 1,\n  \"b\": x\n}");
  ASSERT_EQ(p.errors.size(), 1u);
  EXPECT_NE(p.errors[0].message.find("line 3, column 8"), std::string::npos) << p.errors[0].message;
  EXPECT_EQ(p.errors[0].message.find("json.exception"), std::string::npos);
}

TEST(LenientJson, PositionsSurviveBlankedCommas) {
  // A trailing comma on line 1 is blanked; the error on line 2 keeps its column.
  LenientParse p = parse_lenient_json("{\"a\": [1,],\n \"b\": }");
  ASSERT_EQ(p.errors.size(), 1u);
  EXPECT_NE(p.errors[0].message.find("line 2, column 7"), std::string::npos) << p.errors[0].message;
}

TEST(LenientJson, UnterminatedBlockCommentIsAnError) {
  LenientParse p = parse_lenient_json("{\"a\": 1 /* never closed\n}");
  ASSERT_EQ(p.errors.size(), 1u);
  EXPECT_NE(p.errors[0].message.find("line "), std::string::npos);
}

TEST(LenientJson, EmptyInputIsAnError) {
  LenientParse p = parse_lenient_json("  // nothing\n");
  ASSERT_EQ(p.errors.size(), 1u);
  EXPECT_NE(p.errors[0].message.find("malformed JSON"), std::string::npos);
}

// The parser's lexer takes a NUL byte for the end of the text: a config with one before more
// keys (or garbage) is refused at it, not read as the part before it.
TEST(LenientJson, ANulByteIsAnErrorNotTheEnd) {
  using namespace std::string_literals;
  for (const std::string& text : {"{\"a\": 1}\0\n{\"b\": }}"s, "{\"a\": 1,\n  \0 \"b\": 2}"s}) {
    LenientParse p = parse_lenient_json(text);
    ASSERT_EQ(p.errors.size(), 1u);
    EXPECT_NE(p.errors[0].message.find("a NUL byte"), std::string::npos) << p.errors[0].message;
    EXPECT_NE(p.errors[0].message.find(text[8] == '\0' ? "line 1, column 9" : "line 2, column 3"),
              std::string::npos)
        << p.errors[0].message;
  }
}

TEST(LenientJson, DuplicateKeysReportedByPath) {
  LenientParse p = parse_lenient_json(R"({
    "a": 1,
    "z": {"o": {"device": "cpu", "device": "nvme"}},
    "list": [{"x": 1}, {"x": 2, "x": 3}],
    "a": 2
  })");
  ASSERT_EQ(p.errors.size(), 3u);
  EXPECT_EQ(p.errors[0].json_path, "z.o.device");
  EXPECT_EQ(p.errors[1].json_path, "list[1].x");
  EXPECT_EQ(p.errors[2].json_path, "a");
  EXPECT_NE(p.errors[0].message.find("duplicate key"), std::string::npos);
}

TEST(LenientJson, SameKeyInDifferentObjectsIsFine) {
  LenientParse p =
      parse_lenient_json(R"({"a": {"k": 1}, "b": {"k": 2}, "c": [{"k": 1}, {"k": 2}]})");
  EXPECT_TRUE(p.errors.empty());
}

}  // namespace
}  // namespace outcore::config::detail
