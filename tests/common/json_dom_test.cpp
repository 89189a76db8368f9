// common/json_dom.hpp: what its messages say about untrusted text.
#include "common/json_dom.hpp"

#include <gtest/gtest.h>

#include <string>

namespace outcore {
namespace {

std::string message_of(const std::string& text) {
  try {
    parse_json_dom(text);
  } catch (const nlohmann::json::exception& e) {
    return json_message(e);
  }
  ADD_FAILURE() << "parsed: " << text;
  return {};
}

// A parse error quotes what the parser last read: bytes that are not UTF-8 (a safetensors
// header's tensor name of raw bytes) are shown escaped, never written to a terminal as they
// are; UTF-8 is quoted as it is, and nlohmann's "[json.exception...]" prefix is left out.
TEST(JsonDom, MessagesShowBytesThatAreNotUtf8Escaped) {
  const std::string bad = message_of("{\"lm_head.\xff\xfe\": 1");
  EXPECT_EQ(bad.find('\xff'), std::string::npos) << bad;
  EXPECT_NE(bad.find("lm_head.\\xff"), std::string::npos) << bad;
  EXPECT_EQ(bad.find("[json.exception"), std::string::npos) << bad;
  EXPECT_NE(bad.find("parse error at line 1"), std::string::npos) << bad;
  // A sequence cut short is escaped too; a whole one (é, 中) is kept.
  const std::string cut = message_of("{\"a\xe4\xb8\": 1");
  EXPECT_NE(cut.find("a\\xe4\\xb8"), std::string::npos) << cut;
  const std::string good = message_of("{\"caf\xc3\xa9 \xe4\xb8\xad\\q\": 1}");
  EXPECT_NE(good.find("caf\xc3\xa9 \xe4\xb8\xad"), std::string::npos) << good;
}

}  // namespace
}  // namespace outcore
