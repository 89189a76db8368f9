// Token files: llm.c .bin and raw uint16/uint32 files, their validation and errors.
#include "engine/train/token_file.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "tests/train/temp_dir.hpp"

namespace outcore::train {
namespace {

using testing::as_bytes;
using testing::TempDir;
using testing::write_bytes;

// An llm.c file image: header (magic, version, count) + uint16 tokens.
std::vector<uint8_t> llmc_image(const std::vector<uint16_t>& tokens, int32_t magic = kLlmcMagic,
                                int32_t version = 1, std::optional<int32_t> count = {}) {
  std::vector<int32_t> header(kLlmcHeaderInts, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count.value_or(static_cast<int32_t>(tokens.size()));
  std::vector<uint8_t> img = as_bytes(header);
  std::vector<uint8_t> body = as_bytes(tokens);
  img.insert(img.end(), body.begin(), body.end());
  return img;
}

template <typename E>
std::string error_of(const std::string& path, TokenFormat f = TokenFormat::kAuto) {
  try {
    TokenFile::open(path, f);
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

TEST(TokenFile, WriterOutputReadsBack) {
  TempDir dir;
  std::vector<uint16_t> tokens{0, 1, 65535, 42, 7};
  write_llmc_tokens(dir.file("t.bin"), tokens);
  TokenFile f = TokenFile::open(dir.file("t.bin"));
  EXPECT_EQ(f.format(), TokenFormat::kLlmc);
  ASSERT_EQ(f.size(), tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(f[i], tokens[i]);
  std::vector<int32_t> out(3);
  f.read(2, out);
  EXPECT_EQ(out, (std::vector<int32_t>{65535, 42, 7}));
  EXPECT_EQ(f.max_token(), 65535u);
  EXPECT_FALSE(std::filesystem::exists(dir.file("t.bin.tmp")));
}

// A file shortened while it is open (`cp new.bin data.bin` during a run): the reads past its new
// end fail naming it, never a SIGBUS; what is still there reads as before.
TEST(TokenFile, AFileShortenedWhileOpenFailsTheReadNamingIt) {
  TempDir dir;
  std::vector<uint16_t> tokens(20000);
  std::iota(tokens.begin(), tokens.end(), uint16_t{0});
  write_llmc_tokens(dir.file("t.bin"), tokens);
  write_bytes(dir.file("t.mask"), std::vector<uint8_t>(tokens.size(), 1));
  const TokenFile f = TokenFile::open(dir.file("t.bin"));
  const MaskFile m = MaskFile::open(dir.file("t.mask"), f);
  std::filesystem::resize_file(dir.file("t.bin"), kLlmcHeaderBytes + 2 * 100);
  std::filesystem::resize_file(dir.file("t.mask"), 100);
  std::vector<int32_t> out(10);
  f.read(90, out);
  EXPECT_EQ(out[9], 99);
  auto expect_shortened = [](const std::function<void()>& read, const std::string& path) {
    try {
      read();
      ADD_FAILURE() << "read past the end of the shortened " << path;
    } catch (const CorruptData& e) {
      EXPECT_NE(std::string(e.what()).find(path + ": ends before byte"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("shortened or replaced while in use"), std::string::npos)
          << e.what();
    }
  };
  expect_shortened([&] { f.read(95, out); }, dir.file("t.bin"));
  expect_shortened([&] { (void)f[150]; }, dir.file("t.bin"));
  expect_shortened([&] { f.check_vocab(65536); }, dir.file("t.bin"));
  expect_shortened([&] { (void)f.max_token(); }, dir.file("t.bin"));
  std::vector<uint8_t> bytes(10);
  m.read(90, bytes);
  EXPECT_EQ(bytes, std::vector<uint8_t>(10, 1));
  expect_shortened([&] { m.read(95, bytes); }, dir.file("t.mask"));
  expect_shortened([&] { (void)m.check(0, tokens.size()); }, dir.file("t.mask"));
}

TEST(TokenFile, HeaderLayoutIsLlmcs) {
  TempDir dir;
  write_llmc_tokens(dir.file("t.bin"), std::vector<uint16_t>{9, 8});
  std::ifstream in(dir.file("t.bin"), std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  ASSERT_EQ(bytes.size(), 1024u + 4u);
  int32_t h[3];
  std::memcpy(h, bytes.data(), sizeof(h));
  EXPECT_EQ(h[0], 20240520);
  EXPECT_EQ(h[1], 1);
  EXPECT_EQ(h[2], 2);
  uint16_t t[2];
  std::memcpy(t, bytes.data() + 1024, sizeof(t));
  EXPECT_EQ(t[0], 9);
  EXPECT_EQ(t[1], 8);
}

TEST(TokenFile, RawFormatsByExtensionAndExplicitly) {
  TempDir dir;
  std::vector<uint16_t> u16{1, 2, 3};
  std::vector<uint32_t> u32{70000, 5};
  write_bytes(dir.file("a.u16"), as_bytes(u16));
  write_bytes(dir.file("b.uint32"), as_bytes(u32));
  write_bytes(dir.file("c.bin"), as_bytes(u16));  // a raw dump under llm.c's extension
  TokenFile a = TokenFile::open(dir.file("a.u16"));
  EXPECT_EQ(a.size(), 3u);
  EXPECT_EQ(a[2], 3u);
  TokenFile b = TokenFile::open(dir.file("b.uint32"));
  EXPECT_EQ(b.format(), TokenFormat::kRawU32);
  EXPECT_EQ(b[0], 70000u);
  TokenFile c = TokenFile::open(dir.file("c.bin"), TokenFormat::kRawU16);
  EXPECT_EQ(c.size(), 3u);
  EXPECT_EQ(parse_token_format("uint32"), TokenFormat::kRawU32);
  EXPECT_THROW(parse_token_format("int8"), InvalidArgument);
  // An llm.c file given as raw tokens (one format for the training and the validation file)
  // would train on its header: refused, naming the file and what it is.
  std::vector<uint16_t> tokens(600, 7);
  write_llmc_tokens(dir.file("v.bin"), tokens);
  for (TokenFormat raw : {TokenFormat::kRawU16, TokenFormat::kRawU32}) {
    const std::string msg = error_of<InvalidArgument>(dir.file("v.bin"), raw);
    EXPECT_NE(msg.find(dir.file("v.bin") + ": begins with llm.c's token file header"),
              std::string::npos)
        << msg;
  }
}

TEST(TokenFile, UnknownExtensionAsksForAFormat) {
  TempDir dir;
  write_bytes(dir.file("x.dat"), std::vector<uint8_t>{1, 2});
  EXPECT_NE(error_of<InvalidArgument>(dir.file("x.dat")).find("give the format"),
            std::string::npos);
}

TEST(TokenFile, TruncatedBodyIsCorruptNamingTheFile) {
  TempDir dir;
  auto img = llmc_image({1, 2, 3, 4});
  img.resize(img.size() - 3);
  write_bytes(dir.file("t.bin"), img);
  std::string msg = error_of<CorruptData>(dir.file("t.bin"));
  EXPECT_NE(msg.find(dir.file("t.bin")), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4 tokens"), std::string::npos) << msg;
}

TEST(TokenFile, TruncatedHeaderIsCorrupt) {
  TempDir dir;
  auto img = llmc_image({});
  img.resize(100);
  write_bytes(dir.file("t.bin"), img);
  EXPECT_NE(error_of<CorruptData>(dir.file("t.bin")).find("header"), std::string::npos);
  write_bytes(dir.file("empty.bin"), {});
  EXPECT_NE(error_of<CorruptData>(dir.file("empty.bin")).find("0 bytes"), std::string::npos);
}

TEST(TokenFile, TrailingBytesAreCorrupt) {
  TempDir dir;
  auto img = llmc_image({1, 2});
  img.push_back(0);
  img.push_back(0);
  write_bytes(dir.file("t.bin"), img);
  EXPECT_NE(error_of<CorruptData>(dir.file("t.bin")).find("oversized"), std::string::npos);
}

TEST(TokenFile, BadMagicAndVersionAreCorrupt) {
  TempDir dir;
  write_bytes(dir.file("m.bin"), llmc_image({1}, 20240326));
  std::string msg = error_of<CorruptData>(dir.file("m.bin"));
  EXPECT_NE(msg.find("bad magic 20240326"), std::string::npos) << msg;
  EXPECT_NE(msg.find("give the format: u16 for 2-byte ids, u32 for 4-byte ids"), std::string::npos)
      << msg;
  // Raw 4-byte ids under a .bin name: the hint names u32 (u16 would read a zero after each).
  std::vector<uint8_t> raw32;
  for (uint32_t id = 1; id <= 600; ++id)
    for (int b = 0; b < 4; ++b) raw32.push_back(static_cast<uint8_t>(id >> (8 * b)));
  write_bytes(dir.file("raw32.bin"), raw32);
  msg = error_of<CorruptData>(dir.file("raw32.bin"));
  EXPECT_NE(msg.find("give the format: u32 (its bytes look like 4-byte ids"), std::string::npos)
      << msg;
  write_bytes(dir.file("v.bin"), llmc_image({1}, kLlmcMagic, 2));
  EXPECT_NE(error_of<CorruptData>(dir.file("v.bin")).find("version 2"), std::string::npos);
  write_bytes(dir.file("n.bin"), llmc_image({1}, kLlmcMagic, 1, -5));
  EXPECT_NE(error_of<CorruptData>(dir.file("n.bin")).find("negative"), std::string::npos);
}

TEST(TokenFile, RawSizeNotAWholeNumberOfTokensIsCorrupt) {
  TempDir dir;
  write_bytes(dir.file("t.u32"), std::vector<uint8_t>{1, 2, 3, 4, 5, 6});
  EXPECT_NE(error_of<CorruptData>(dir.file("t.u32")).find("6 bytes"), std::string::npos);
}

TEST(TokenFile, MissingFileIsAnIoError) {
  TempDir dir;
  std::string msg = error_of<IoError>(dir.file("nope.bin"));
  EXPECT_NE(msg.find("nope.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("No such file"), std::string::npos) << msg;
}

TEST(TokenFile, VocabCheckNamesFileAndPosition) {
  TempDir dir;
  std::vector<uint16_t> tokens(10000);
  std::iota(tokens.begin(), tokens.end(), 0);
  for (auto& t : tokens) t %= 50;
  tokens[7777] = 300;
  tokens[9000] = 400;
  write_llmc_tokens(dir.file("t.bin"), tokens);
  TokenFile f = TokenFile::open(dir.file("t.bin"));
  f.check_vocab(401);
  f.check_vocab(256, 0, 7777);  // the range before the bad token is fine
  try {
    f.check_vocab(256);
    FAIL() << "no error";
  } catch (const CorruptData& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(dir.file("t.bin")), std::string::npos) << msg;
    EXPECT_NE(msg.find("token 300 at position 7777"), std::string::npos) << msg;
    EXPECT_NE(msg.find("vocabulary of 256"), std::string::npos) << msg;
  }
  try {
    f.check_vocab(256, 8000, 10000);
    FAIL() << "no error";
  } catch (const CorruptData& e) {
    EXPECT_NE(std::string(e.what()).find("position 9000"), std::string::npos) << e.what();
  }
  EXPECT_THROW(f.check_vocab(256, 5, 20000), InvalidArgument);
}

TEST(TokenFile, ReadPastTheEndThrows) {
  TempDir dir;
  write_llmc_tokens(dir.file("t.bin"), std::vector<uint16_t>{1, 2, 3});
  TokenFile f = TokenFile::open(dir.file("t.bin"));
  std::vector<int32_t> out(2);
  EXPECT_THROW(f.read(2, out), InvalidArgument);
}

TEST(TokenFile, WriterReportsAnUnwritableDirectory) {
  EXPECT_THROW(write_llmc_tokens("/nonexistent_dir_outcore/t.bin", std::vector<uint16_t>{1}),
               IoError);
}

}  // namespace
}  // namespace outcore::train
