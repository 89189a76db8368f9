// Hugging Face weights: the safetensors reader and writer (round trips and every malformed
// header), HF directory import against a float64 PyTorch reference (tests/ckpt/oracle/
// hf_oracle.py run by /usr/bin/python3; without torch skipped, or failed under
// OUTCORE_REQUIRE_ORACLES=1), byte-exact export round trips, sharding, bounded export pieces and
// bad input.
#include "engine/ckpt/hf.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "common/error.hpp"
#include "common/open_file.hpp"
#include "engine/ckpt/safetensors.hpp"
#include "tests/common/error_of.hpp"
#include "tests/common/oracle_unavailable.hpp"
#include "tests/common/temp_dir.hpp"
#include "tests/model/model_harness.hpp"

namespace outcore::ckpt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using model::LlamaConfig;
using model::testing::small_config;
using test::TempDir;

// ---------------------------------------------------------------------------------------------
// Helpers

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_all(const fs::path& p, std::string_view data) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
  ASSERT_TRUE(f.good()) << p;
}

std::vector<std::byte> random_bytes(size_t n, uint64_t seed) {
  std::vector<std::byte> v(n);
  test::fill_random(v, seed);
  return v;
}

using outcore::test::error_of;

#define EXPECT_MENTIONS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "\"" << (msg) << "\" lacks \"" << (part) << "\""

// Every unit's full slab (world size 1) read through HfWeights.
std::vector<std::vector<float>> import_slabs(const HfWeights& w) {
  std::vector<std::vector<float>> slabs;
  for (const model::UnitLayout& u : w.layout().units) {
    slabs.emplace_back(u.padded_numel, -1.0f);
    w.read_unit_range(u, 0, u.padded_numel, slabs.back().data());
  }
  return slabs;
}

// A read_master callback serving whole slabs from memory.
ReadMasterFn from_slabs(const std::vector<std::vector<float>>& slabs) {
  return [&slabs](int unit, uint64_t begin, uint64_t count, float* out) {
    std::copy_n(slabs.at(unit).data() + begin, count, out);
  };
}

std::vector<std::vector<float>> random_slabs(const LlamaConfig& cfg, uint32_t seed) {
  return model::testing::random_params(model::make_layout(cfg), seed);
}

// Every model tensor of `cfg` (HF names and shapes).
std::vector<SafetensorsTensor> model_tensors(const LlamaConfig& cfg, DType dtype) {
  std::vector<SafetensorsTensor> ts;
  for (const model::UnitLayout& u : model::make_layout(cfg).units)
    for (const model::TensorSpec& t : u.tensors) ts.push_back({t.name, dtype, t.shape});
  return ts;
}

// Writes `tensors` with random contents to `path`.
void write_tensors(const fs::path& path, const std::vector<SafetensorsTensor>& tensors) {
  SafetensorsWriter w(path, tensors);
  w.append(random_bytes(w.data_bytes(), 7));
  w.close();
}

// ---------------------------------------------------------------------------------------------
// safetensors format

TEST(Safetensors, RoundTripKeepsDtypesShapesBytesMetadataAndPadding) {
  TempDir dir("hf");
  const fs::path path = dir / "t.safetensors";
  const std::vector<SafetensorsTensor> decl = {
      {"w.f32", DType::F32, {3, 5}},    {"b.bf16", DType::BF16, {7}},
      {"c.f16", DType::F16, {2, 3, 4}}, {"scalar", DType::F32, {}},
      {"empty", DType::BF16, {0, 4}},   {"big", DType::F32, {1000, 37}}};
  uint64_t total = 0;
  for (const auto& t : decl) total += shape_numel(t.shape) * dtype_size(t.dtype);
  const std::vector<std::byte> data = random_bytes(total, 1);
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "x y"}};
  {
    SafetensorsWriter w(path, decl, meta);
    EXPECT_EQ(w.data_bytes(), total);
    // Pieces of odd sizes that straddle tensor boundaries.
    size_t at = 0, piece = 1;
    while (at < data.size()) {
      const size_t n = std::min(piece, data.size() - at);
      w.append(std::span(data).subspan(at, n));
      at += n;
      piece = piece * 3 + 1;
    }
    EXPECT_FALSE(fs::exists(path)) << "the final name appears only at close()";
    EXPECT_TRUE(fs::exists(path.string() + ".tmp"));
    w.close();
  }
  EXPECT_FALSE(fs::exists(path.string() + ".tmp"));

  const std::string raw = read_all(path);
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "header padded to a multiple of 8";
  EXPECT_EQ(raw.size(), 8 + n + total);
  const std::string header = raw.substr(8, n);
  EXPECT_EQ(header.find_last_not_of(' ') + 1, header.find_last_of('}') + 1);
  EXPECT_TRUE(header.starts_with("{\"__metadata__\"")) << header;

  SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.data_start(), 8 + n);
  EXPECT_EQ(f.metadata(), meta);
  ASSERT_EQ(f.tensors().size(), decl.size());
  uint64_t at = 0;
  for (size_t i = 0; i < decl.size(); ++i) {
    SCOPED_TRACE(decl[i].name);
    const SafetensorsEntry* e = f.find(decl[i].name);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(&f.tensors()[i], e) << "entries in data order = declaration order";
    EXPECT_EQ(e->dtype, decl[i].dtype);
    EXPECT_EQ(e->shape, decl[i].shape);
    EXPECT_EQ(e->offset, f.data_start() + at);
    EXPECT_EQ(e->bytes, shape_numel(decl[i].shape) * dtype_size(decl[i].dtype));
    std::vector<std::byte> back(e->bytes);
    f.read(*e, 0, e->bytes, back.data());
    EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin() + at));
    at += e->bytes;
  }
  std::vector<std::byte> part(10);
  f.read("big", 3, 10, part.data());
  const uint64_t big_at = f.find("big")->offset - f.data_start();
  EXPECT_TRUE(std::equal(part.begin(), part.end(), data.begin() + big_at + 3));
  EXPECT_MENTIONS(error_of<InvalidArgument>([&] { f.read("big", 148000 - 4, 8, part.data()); }),
                  "big");
  EXPECT_MENTIONS(error_of<InvalidArgument>([&] { f.read("nope", 0, 1, part.data()); }), "nope");
}

TEST(Safetensors, WriterChecksByteCountsAndNeverLeavesAPartialFile) {
  TempDir dir("hf");
  const fs::path path = dir / "w.safetensors";
  const std::vector<SafetensorsTensor> decl = {{"a", DType::F32, {4}}, {"b", DType::BF16, {3}}};
  {
    SafetensorsWriter w(path, decl);
    EXPECT_EQ(w.data_bytes(), 22u);
    w.append(random_bytes(20, 2));
    EXPECT_MENTIONS(error_of<InvalidArgument>([&] { w.append(random_bytes(3, 3)); }),
                    path.string());
    EXPECT_MENTIONS(error_of<InvalidArgument>([&] { w.close(); }), "20 of the 22");
    EXPECT_FALSE(fs::exists(path));
  }
  EXPECT_FALSE(fs::exists(path.string() + ".tmp")) << "temporary removed on destruction";
  {
    SafetensorsWriter w(path, decl);
    w.append(random_bytes(22, 2));
  }  // destroyed without close()
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path.string() + ".tmp"));

  EXPECT_MENTIONS(error_of<InvalidArgument>([&] {
                    SafetensorsWriter(path, {{"a", DType::F32, {1}}, {"a", DType::F32, {1}}});
                  }),
                  "\"a\"");
  EXPECT_MENTIONS(error_of<InvalidArgument>([&] {
                    SafetensorsWriter(path, {{"n", DType::F32, {2, -1}}});
                  }),
                  "\"n\"");
  EXPECT_MENTIONS(
      error_of<IoError>([&] { SafetensorsWriter(dir / "missing" / "x.safetensors", decl); }),
      "missing/x.safetensors");
}

// One malformed file: the header text (or raw bytes) and what the error must name.
struct BadFile {
  std::string label;
  std::string header;                // JSON text after the length
  size_t data_bytes = 0;             // zero bytes of data section appended
  std::optional<uint64_t> length{};  // header length field; default header.size()
  bool unsupported = false;          // InvalidArgument instead of CorruptData
  std::vector<std::string> names{};  // substrings the message must contain besides the path
};

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

TEST(Safetensors, EveryMalformedHeaderIsRefusedNamingFileAndTensor) {
  const std::vector<BadFile> cases = {
      {"past the end",
       R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
       8,
       {},
       false,
       {"\"t\"", "past the data section"}},
      {"size mismatch",
       R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}})",
       16,
       {},
       false,
       {"\"t\"", "needs 16"}},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
       R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})",
       24,
       {},
       false,
       {"\"a\"", "\"b\"", "overlaps"}},
      {"begin after end",
       R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[16,8]}})",
       16,
       {},
       false,
       {"\"t\""}},
      {"negative dim",
       R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
       4,
       {},
       false,
       {"\"t\"", "-1"}},
      {"fractional dim",
       R"({"t":{"dtype":"F32","shape":[2.5],"data_offsets":[0,4]}})",
       4,
       {},
       false,
       {"\"t\""}},
      {"overflowing shape",
       R"({"t":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,4]}})",
       4,
       {},
       false,
       {"\"t\"", "overflow"}},
      // A huge dimension beside a zero one: no element (not an overflow), so 4 bytes are 4 too
      // many.
      {"no element under a huge dim",
       R"({"t":{"dtype":"F32","shape":[4611686018427387904,0],"data_offsets":[0,4]}})",
       4,
       {},
       false,
       {"\"t\"", "needs 0"}},
      {"no dtype", R"({"t":{"shape":[1],"data_offsets":[0,4]}})", 4, {}, false, {"\"t\"", "dtype"}},
      {"offsets not a pair",
       R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0]}})",
       4,
       {},
       false,
       {"\"t\"", "data_offsets"}},
      {"entry not an object", R"({"t":3})", 0, {}, false, {"\"t\""}},
      {"unsupported dtype",
       R"({"t":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})",
       8,
       {},
       true,
       {"\"t\"", "I64"}},
      {"not an object", "[1,2]", 0, {}, false, {"not a JSON object"}},
      {"not JSON", "{\"t\":", 0, {}, false, {"not valid JSON"}},
      {"metadata not strings", R"({"__metadata__":{"k":1}})", 0, {}, false, {"\"k\""}},
      {"huge header length", "{}", 0, ~uint64_t{0}, false, {"header length"}},
      {"header length past the file", "{}", 0, 1000, false, {"header length 1000"}},
      // A value nested a million deep: refused as the header is parsed (a message showing it
      // would recurse that deep); a long shape is described, not printed.
      {"nested a million deep",
       R"({"t":{"dtype":"F32","shape":)" + std::string(1'000'000, '[') +
           std::string(1'000'000, ']') + R"(,"data_offsets":[0,0]}})",
       0,
       {},
       false,
       {"nested deeper than 128 levels"}},
      {"long shape",
       R"({"t":{"dtype":"F32","shape":)" +
           [] {
             std::string shape = "[-1";
             for (int i = 0; i < 20000; ++i) shape += ",1";
             return shape + "]";
           }() +
           R"(,"data_offsets":[0,0]}})",
       0,
       {},
       false,
       {"\"t\"", "shape an array of 20001 elements holds -1"}},
  };
  TempDir dir("hf");
  for (size_t i = 0; i < cases.size(); ++i) {
    const BadFile& c = cases[i];
    SCOPED_TRACE(c.label);
    const fs::path p = dir / fmt::format("bad{}.safetensors", i);
    write_all(
        p, le64(c.length.value_or(c.header.size())) + c.header + std::string(c.data_bytes, '\0'));
    const std::string msg = c.unsupported
                                ? error_of<InvalidArgument>([&] { SafetensorsFile::open(p); })
                                : error_of<CorruptData>([&] { SafetensorsFile::open(p); });
    EXPECT_MENTIONS(msg, p.string());
    for (const std::string& n : c.names) EXPECT_MENTIONS(msg, n);
  }
  const fs::path tiny = dir / "tiny.safetensors";
  write_all(tiny, "abc");
  EXPECT_MENTIONS(error_of<CorruptData>([&] { SafetensorsFile::open(tiny); }), tiny.string());
  EXPECT_MENTIONS(error_of<IoError>([&] { SafetensorsFile::open(dir / "absent"); }), "absent");
}

TEST(Safetensors, TruncatedFileNamesTheTensorPastTheEnd) {
  TempDir dir("hf");
  const fs::path p = dir / "t.safetensors";
  write_tensors(p, {{"first", DType::F32, {16}}, {"last", DType::BF16, {64}}});
  fs::resize_file(p, fs::file_size(p) - 2);
  const std::string msg = error_of<CorruptData>([&] { SafetensorsFile::open(p); });
  EXPECT_MENTIONS(msg, p.string());
  EXPECT_MENTIONS(msg, "\"last\"");
}

// The safetensors library refuses bytes after the last tensor's data; so does outcore.
TEST(Safetensors, BytesAfterTheLastTensorAreRefused) {
  TempDir dir("hf");
  const fs::path p = dir / "t.safetensors";
  write_tensors(p, {{"first", DType::F32, {16}}, {"last", DType::BF16, {64}}});
  SafetensorsFile::open(p);
  std::ofstream(p, std::ios::app | std::ios::binary) << "tail";
  const std::string msg = error_of<CorruptData>([&] { SafetensorsFile::open(p); });
  EXPECT_MENTIONS(msg, p.string());
  EXPECT_MENTIONS(msg, "4 bytes after the last tensor's data");
}

// A JSON object keeps one value per key, so a name listed twice would let one entry silently
// win: the header parser refuses it, naming the key and the file.
TEST(Safetensors, KeyTwiceInTheHeaderIsRefusedNamingKeyAndFile) {
  TempDir dir("hf");
  const std::vector<BadFile> cases = {
      {"tensor twice",
       R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
       8,
       {},
       false,
       {"\"t\"", "twice"}},
      {"field twice",
       R"({"t":{"dtype":"F32","shape":[1],"dtype":"BF16","data_offsets":[0,4]}})",
       4,
       {},
       false,
       {"\"dtype\"", "\"t\"", "twice"}},
      {"metadata twice",
       R"({"__metadata__":{"format":"pt"},"__metadata__":{"format":"np"}})",
       0,
       {},
       false,
       {"\"__metadata__\"", "twice"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const BadFile& c = cases[i];
    SCOPED_TRACE(c.label);
    const fs::path p = dir / fmt::format("dup{}.safetensors", i);
    write_all(p, le64(c.header.size()) + c.header + std::string(c.data_bytes, '\0'));
    const std::string msg = error_of<CorruptData>([&] { SafetensorsFile::open(p); });
    EXPECT_MENTIONS(msg, p.string());
    for (const std::string& n : c.names) EXPECT_MENTIONS(msg, n);
  }
  // The same names in different objects are no duplicates.
  const std::string fine = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  write_all(dir / "fine.safetensors", le64(fine.size()) + fine + std::string(8, '\0'));
  EXPECT_EQ(SafetensorsFile::open(dir / "fine.safetensors").tensors().size(), 2u);
}

// A header of very many tensors is read in time linear in its size (the parse was quadratic in
// the number of entries: a 20 MB header of 400000 empty tensors took about half an hour; under
// this test's timeout it now takes a second or two).
TEST(Safetensors, AHeaderOfManyTensorsIsReadInLinearTime) {
  TempDir dir("hf");
  constexpr int kTensors = 400000;
  std::string header = "{";
  for (int i = 0; i < kTensors; ++i)
    header += fmt::format(R"({}"t{}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})",
                          i == 0 ? "" : ",", i);
  header += "}";
  const fs::path p = dir / "many.safetensors";
  write_all(p, le64(header.size()) + header);
  EXPECT_EQ(SafetensorsFile::open(p).tensors().size(), static_cast<size_t>(kTensors));
}

// As the safetensors library: data_offsets leave no byte between tensors or before the first.
TEST(Safetensors, GapsBetweenTensorsAreRefused) {
  TempDir dir("hf");
  auto refused = [&](const std::string& header, uint64_t data_bytes, const std::string& part) {
    const fs::path p = dir / "t.safetensors";
    write_all(p, le64(header.size()) + header + std::string(data_bytes, '\0'));
    EXPECT_MENTIONS(error_of<CorruptData>([&] { SafetensorsFile::open(p); }), part);
  };
  refused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8,
          "starts 4 bytes after the data section's start");
  refused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
          R"("b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})",
          16, "starts 8 bytes after the end of tensor \"a\"");
  // An empty tensor sits between the others at the offset where one ends.
  const std::string fine = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                           R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  write_all(dir / "fine.safetensors", le64(fine.size()) + fine + std::string(8, '\0'));
  EXPECT_EQ(SafetensorsFile::open(dir / "fine.safetensors").tensors().size(), 3u);
}

// A model of many shards reads with few descriptors free (each read opens its shard for itself),
// and a shard replaced after it was validated is refused, not read.
TEST(HfImport, ManyShardsReadWithFewDescriptorsAndAReplacedShardIsRefused) {
  TempDir dir("hf");
  const LlamaConfig cfg = small_config(32, 48, 2, 4, 2, 61, false);
  const auto slabs = random_slabs(cfg, 12);
  write_hf_model(cfg, from_slabs(slabs), dir / "m", {.max_shard_bytes = 1});
  size_t shards = 0;
  for (const auto& e : fs::directory_iterator(dir / "m"))
    shards += e.path().extension() == ".safetensors";
  ASSERT_GE(shards, 20u);
  size_t open_fds = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator("/proc/self/fd")) ++open_fds;
  struct rlimit was {};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &was), 0);
  struct rlimit few = was;
  few.rlim_cur = open_fds + 8;  // fewer than the shards
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &few), 0);
  std::vector<std::vector<float>> back;
  std::string error;
  try {
    back = import_slabs(HfWeights::open(dir / "m", cfg));
  } catch (const std::exception& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_NOFILE, &was);
  ASSERT_EQ(error, "");
  for (size_t u = 0; u < back.size(); ++u) EXPECT_EQ(back[u], slabs[u]) << "unit " << u;

  const HfWeights w = HfWeights::open(dir / "m", cfg);
  const std::string shard = w.file("model.norm.weight")->path();
  const std::string bytes = read_all(shard);
  // The same bytes in another file. The old one is kept (renamed away): removed, its inode
  // number could be given to the new file, which would then look like the one validated.
  fs::rename(shard, dir / "validated.safetensors.old");
  write_all(shard, bytes);
  const model::UnitLayout& head = w.layout().units.back();
  std::vector<float> out(head.padded_numel);
  EXPECT_MENTIONS(
      error_of<CorruptData>([&] { w.read_unit_range(head, 0, head.padded_numel, out.data()); }),
      "replaced or resized since it was validated");
}

// An export keeps the keys of the model's config.json that outcore does not act on (the special
// tokens' ids...), writes its weights under the umask, and an empty directory it replaces keeps
// its mode.
TEST(HfExport, KeepsConfigKeysItDoesNotActOnTheUmaskAndTheDirectorysMode) {
  TempDir dir("hf");
  LlamaConfig cfg = small_config(32, 48, 1, 4, 2, 61, false);
  cfg.hf_extra = R"({"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": null})";
  const auto slabs = random_slabs(cfg, 13);
  fs::create_directories(dir / "private");
  const fs::perms mode = fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec;
  fs::permissions(dir / "private", mode);  // 0750: not what a directory made under 077 gets
  const mode_t was = ::umask(077);
  write_hf_model(cfg, from_slabs(slabs), dir / "private", {});
  ::umask(was);
  EXPECT_EQ(fs::status(dir / "private").permissions() & fs::perms::all, mode);
  for (const char* f : {kHfWeightsFile, kHfConfigFile})
    EXPECT_EQ(fs::status(dir / "private" / f).permissions() & fs::perms::all,
              fs::perms::owner_read | fs::perms::owner_write)
        << f;
  const json j = json::parse(read_all(dir / "private" / kHfConfigFile));
  EXPECT_EQ(j["bos_token_id"], 1);
  EXPECT_EQ(j["eos_token_id"], json::array({2, 3}));
  EXPECT_TRUE(j.contains("pad_token_id") && j["pad_token_id"].is_null()) << j.dump();
  const LlamaConfig back = LlamaConfig::load(dir / "private" / kHfConfigFile);
  EXPECT_EQ(json::parse(back.hf_extra), json::parse(cfg.hf_extra));
  EXPECT_EQ(back.to_json(), cfg.to_json()) << "the architecture does not hold them";
}

// ---------------------------------------------------------------------------------------------
// HF import: bad input (no Python needed)

class HfImportErrors : public ::testing::Test {
 protected:
  LlamaConfig cfg = small_config(32, 48, 2, 4, 2, 61, false);
  TempDir dir{"hf"};
  fs::path file() const { return dir / kHfWeightsFile; }
  std::string open_error() {
    return error_of<CorruptData>([&] { HfWeights::open(dir.path(), cfg); });
  }
  // A sharded export of random weights into dir (several shards).
  void write_sharded() {
    const auto slabs = random_slabs(cfg, 3);
    fs::remove_all(dir.path());
    write_hf_model(cfg, from_slabs(slabs), dir.path(), {.max_shard_bytes = 16 << 10});
  }
  json index() const { return json::parse(read_all(dir / kHfIndexFile)); }
  void set_index(const json& j) { write_all(dir / kHfIndexFile, j.dump()); }
};

TEST_F(HfImportErrors, MissingTensorIsNamedWithTheFile) {
  auto ts = model_tensors(cfg, DType::F32);
  std::erase_if(ts, [](const auto& t) { return t.name == "model.layers.1.mlp.up_proj.weight"; });
  write_tensors(file(), ts);
  const std::string msg = open_error();
  EXPECT_MENTIONS(msg, "model.layers.1.mlp.up_proj.weight");
  EXPECT_MENTIONS(msg, file().string());
  EXPECT_MENTIONS(msg, "missing");
}

TEST_F(HfImportErrors, UnexpectedTensorIsNamedWithTheFile) {
  auto ts = model_tensors(cfg, DType::F32);
  ts.push_back({"model.layers.0.mlp.extra.weight", DType::F32, {3}});
  write_tensors(file(), ts);
  const std::string msg = open_error();
  EXPECT_MENTIONS(msg, "model.layers.0.mlp.extra.weight");
  EXPECT_MENTIONS(msg, file().string());
}

TEST_F(HfImportErrors, WrongShapeNamesTensorFileAndBothShapes) {
  auto ts = model_tensors(cfg, DType::BF16);
  for (auto& t : ts)
    if (t.name == "model.layers.0.self_attn.k_proj.weight") t.shape = {32, 16};
  write_tensors(file(), ts);
  const std::string msg = open_error();
  EXPECT_MENTIONS(msg, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_MENTIONS(msg, file().string());
  EXPECT_MENTIONS(msg, "[32, 16]");
  EXPECT_MENTIONS(msg, "[16, 32]");
}

TEST_F(HfImportErrors, RotaryInvFreqAndATiedLmHeadAreIgnored) {
  cfg.tie_word_embeddings = true;
  auto ts = model_tensors(cfg, DType::F32);
  ts.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", DType::F32, {4}});
  ts.push_back({"lm_head.weight", DType::F32, {61, 32}});
  write_tensors(file(), ts);
  const HfWeights w = HfWeights::open(dir.path(), cfg);
  EXPECT_EQ(w.entry("lm_head.weight"), nullptr);
  EXPECT_NE(w.entry("model.embed_tokens.weight"), nullptr);
  // The same lm_head is unexpected when the embeddings are not tied... and required then.
  cfg.tie_word_embeddings = false;
  EXPECT_NO_THROW(HfWeights::open(dir.path(), cfg));
  std::erase_if(ts, [](const auto& t) { return t.name == "lm_head.weight"; });
  write_tensors(file(), ts);
  EXPECT_MENTIONS(open_error(), "lm_head.weight");
}

TEST_F(HfImportErrors, MissingShardIsNamedWithATensorItHolds) {
  write_sharded();
  const json j = index();
  const std::string shard = j["weight_map"]["model.layers.1.mlp.down_proj.weight"];
  fs::remove(dir / shard);
  const std::string msg = open_error();
  EXPECT_MENTIONS(msg, shard);
  EXPECT_MENTIONS(msg, "is in shard");
  EXPECT_MENTIONS(msg, kHfIndexFile);
}

TEST_F(HfImportErrors, IndexNamingTheWrongFileIsNamed) {
  write_sharded();
  json j = index();
  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  const std::string right = j["weight_map"][name];
  const std::string wrong = j["weight_map"]["lm_head.weight"];
  ASSERT_NE(right, wrong);
  j["weight_map"][name] = wrong;
  set_index(j);
  const std::string msg = open_error();
  EXPECT_MENTIONS(msg, name);
  EXPECT_MENTIONS(msg, wrong);
}

TEST_F(HfImportErrors, ShardTensorAbsentFromTheIndexIsNamed) {
  write_sharded();
  json j = index();
  const std::string shard = j["weight_map"]["model.norm.weight"];
  j["weight_map"].erase("model.norm.weight");
  set_index(j);
  const std::string msg = open_error();
  EXPECT_MENTIONS(msg, "model.norm.weight");
  EXPECT_MENTIONS(msg, shard);
}

TEST_F(HfImportErrors, MalformedIndexIsNamed) {
  write_sharded();
  set_index(json{{"weight_map", {{"model.norm.weight", "../escape.safetensors"}}}});
  EXPECT_MENTIONS(open_error(), "../escape.safetensors");
  // A NUL byte in a shard's name would open the name cut short at it (the real shard).
  write_sharded();
  json j = index();
  const std::string shard = j["weight_map"]["model.norm.weight"];
  j["weight_map"]["model.norm.weight"] = shard + std::string(1, '\0') + "x";
  set_index(j);
  EXPECT_MENTIONS(open_error(), "not a file name in the directory");
  write_all(dir / kHfIndexFile, "{\"weight_map\": ");
  EXPECT_MENTIONS(open_error(), kHfIndexFile);
}

// The duplicate listed first maps to the wrong shard: were the last one to win silently, the
// directory would open.
TEST_F(HfImportErrors, TensorTwiceInTheIndexIsNamedWithTheIndex) {
  write_sharded();
  const json j = index();
  const std::string name = "model.norm.weight";
  const std::string wrong = j["weight_map"]["model.embed_tokens.weight"];
  ASSERT_NE(j["weight_map"][name], wrong);
  std::string text = j.dump();
  const std::string map_start = "\"weight_map\":{";
  const size_t at = text.find(map_start);
  ASSERT_NE(at, std::string::npos) << text;
  text.insert(at + map_start.size(), fmt::format("\"{}\":\"{}\",", name, wrong));
  write_all(dir / kHfIndexFile, text);
  const std::string msg = open_error();
  EXPECT_MENTIONS(msg, name);
  EXPECT_MENTIONS(msg, kHfIndexFile);
  EXPECT_MENTIONS(msg, "twice");
}

// Every model tensor of `cfg` as `dtype`, each element 0.25 except element `bad_elem` of tensor
// `bad_tensor`, which is `bad_value` (rounded to `dtype`).
void write_model_with(const fs::path& path, const LlamaConfig& cfg, DType dtype,
                      const std::string& bad_tensor, uint64_t bad_elem, float bad_value) {
  const std::vector<SafetensorsTensor> ts = model_tensors(cfg, dtype);
  uint64_t numel = 0, bad_at = UINT64_MAX;
  for (const SafetensorsTensor& t : ts) {
    if (t.name == bad_tensor) bad_at = numel + bad_elem;
    numel += shape_numel(t.shape);
  }
  ASSERT_NE(bad_at, UINT64_MAX) << bad_tensor;
  std::vector<float> vals(numel, 0.25f);
  vals[bad_at] = bad_value;
  std::vector<std::byte> bytes(numel * dtype_size(dtype));
  model::convert_from_fp32(vals.data(), bytes.data(), dtype, numel);
  SafetensorsWriter w(path, ts);
  w.append(bytes);
  w.close();
}

// A NaN or Inf weight is refused where it is converted, naming file, tensor and element index
// (in the tensor), in every source dtype; ranges that do not reach it still read.
TEST_F(HfImportErrors, NonFiniteWeightIsNamedWithFileTensorAndElement) {
  const std::string name = "model.layers.1.mlp.up_proj.weight";
  const struct {
    DType dtype;
    float value;
    const char* shown;
  } cases[] = {{DType::F32, std::nanf(""), "nan"},
               {DType::BF16, INFINITY, "inf"},
               {DType::F16, -INFINITY, "-inf"},
               {DType::F16, std::nanf(""), "nan"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(fmt::format("{} {}", dtype_name(c.dtype), c.shown));
    write_model_with(file(), cfg, c.dtype, name, 37, c.value);
    const HfWeights w = HfWeights::open(dir.path(), cfg);
    const model::UnitLayout& layer1 = w.layout().units[2];
    const auto t = std::find_if(layer1.tensors.begin(), layer1.tensors.end(),
                                [&](const auto& s) { return s.name == name; });
    ASSERT_NE(t, layer1.tensors.end());
    std::vector<float> out(layer1.padded_numel);
    const std::string msg = error_of<CorruptData>(
        [&] { w.read_unit_range(layer1, 0, layer1.padded_numel, out.data()); });
    EXPECT_MENTIONS(msg, file().string());
    EXPECT_MENTIONS(msg, "\"" + name + "\"");
    EXPECT_MENTIONS(msg, "element 37 ");
    EXPECT_MENTIONS(msg, std::string(" ") + c.shown + " ");
    // A range starting inside the tensor still gives the index in the tensor.
    EXPECT_MENTIONS(
        error_of<CorruptData>([&] { w.read_unit_range(layer1, t->offset + 30, 10, out.data()); }),
        "element 37 ");
    // Every other unit, and the elements around the bad one, read.
    EXPECT_NO_THROW(w.read_unit_range(layer1, 0, t->offset + 37, out.data()));
    EXPECT_NO_THROW(w.read_unit_range(layer1, t->offset + 38, 100, out.data()));
    EXPECT_EQ(out[0], 0.25f);
    EXPECT_NO_THROW(w.read_unit_range(w.layout().units[1], 0, 100, out.data()));
  }
}

// A value finite in the file but beyond the dtype the parameters are stored in is refused as it
// is read, naming it; the same file reads in a dtype that holds it.
TEST_F(HfImportErrors, ValueBeyondTheParametersDtypeIsNamed) {
  const std::string name = "model.layers.0.mlp.up_proj.weight";
  write_model_with(file(), cfg, DType::F32, name, 5, 1e5f);
  const HfWeights f32 = HfWeights::open(dir.path(), cfg);
  const model::UnitLayout& layer0 = f32.layout().units[1];  // of a weights object that lives on
  std::vector<float> out(layer0.padded_numel);
  const HfWeights f16 = HfWeights::open(dir.path(), cfg, DType::F16);
  const std::string msg = error_of<CorruptData>(
      [&] { f16.read_unit_range(layer0, 0, layer0.padded_numel, out.data()); });
  EXPECT_MENTIONS(msg, "\"" + name + "\"");
  EXPECT_MENTIONS(msg, "element 5 ");
  EXPECT_MENTIONS(msg, "beyond the range of fp16");
  for (const DType ok : {DType::F32, DType::BF16})
    EXPECT_NO_THROW(HfWeights::open(dir.path(), cfg, ok)
                        .read_unit_range(layer0, 0, layer0.padded_numel, out.data()));
}

TEST_F(HfImportErrors, FileShorterThanItsHeaderNamesTensorAndFile) {
  write_tensors(file(), model_tensors(cfg, DType::F32));
  fs::resize_file(file(), fs::file_size(file()) - 100);
  const std::string msg = open_error();
  EXPECT_MENTIONS(msg, file().string());
  EXPECT_MENTIONS(msg, "lm_head.weight");  // the last tensor in the data section
}

TEST_F(HfImportErrors, DirectoryWithoutSafetensorsIsInvalidArgument) {
  const std::string msg = error_of<InvalidArgument>([&] { HfWeights::open(dir.path(), cfg); });
  EXPECT_MENTIONS(msg, dir.path().string());
  EXPECT_MENTIONS(msg, kHfWeightsFile);
}

// A link to nowhere, or to itself, at the weights' name is named as such, not taken for a
// directory without weights.
TEST_F(HfImportErrors, ALinkToNowhereAtTheWeightsNameIsNamed) {
  for (const char* target : {"absent.safetensors", kHfWeightsFile}) {
    SCOPED_TRACE(target);
    fs::create_symlink(target, dir / kHfWeightsFile);
    const std::string msg = error_of<IoError>([&] { HfWeights::open(dir.path(), cfg); });
    EXPECT_MENTIONS(msg, (dir / kHfWeightsFile).string());
    EXPECT_EQ(msg.find("holds neither"), std::string::npos) << msg;
    fs::remove(dir / kHfWeightsFile);
  }
}

// ---------------------------------------------------------------------------------------------
// HF import: ranged reads

// Every (begin, count) range of any unit equals the same range of the whole slab, across
// BF16 chunk boundaries (the embedding below is 2.56M elements, more than one 2M chunk).
TEST(HfImport, AnyRangeOfAnyUnitMatchesTheWholeSlab) {
  TempDir dir("hf");
  const LlamaConfig cfg = small_config(128, 64, 1, 4, 2, 20000, false);
  const auto slabs = random_slabs(cfg, 11);
  const fs::path hf = dir / "m";
  write_hf_model(cfg, from_slabs(slabs), hf, {.dtype = DType::BF16});
  const HfWeights w = HfWeights::open(hf, cfg);
  const auto full = import_slabs(w);
  for (size_t u = 0; u < full.size(); ++u) {
    ASSERT_EQ(full[u].size(), slabs[u].size());
    for (size_t i = 0; i < full[u].size(); ++i)
      ASSERT_EQ(full[u][i], round_to(DType::BF16, slabs[u][i])) << "unit " << u << " elem " << i;
  }
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 40; ++trial) {
    const model::UnitLayout& u = w.layout().units[trial % full.size()];
    const uint64_t begin = rng() % u.padded_numel;
    const uint64_t count = rng() % (u.padded_numel - begin + 1);
    std::vector<float> part(count, -7.0f);
    w.read_unit_range(u, begin, count, part.data());
    ASSERT_TRUE(std::equal(part.begin(), part.end(), full[u.index].begin() + begin))
        << u.name << " [" << begin << ", +" << count << ")";
  }
  // Partitions of a world-3 layout of the same model: same offsets, other padding.
  const model::ModelLayout l3 = model::make_layout(cfg, 3);
  for (const model::UnitLayout& u : l3.units) {
    const uint64_t p = u.partition_numel(3);
    for (uint64_t r = 0; r < 3; ++r) {
      std::vector<float> part(p);
      w.read_unit_range(u, r * p, p, part.data());
      for (uint64_t i = 0; i < p; ++i) {
        const uint64_t e = r * p + i;
        ASSERT_EQ(part[i], e < full[u.index].size() ? full[u.index][e] : 0.0f) << u.name;
      }
    }
  }
  std::vector<float> one(1);
  const model::UnitLayout& head = w.layout().units.back();
  EXPECT_MENTIONS(
      error_of<InvalidArgument>([&] { w.read_unit_range(head, head.padded_numel, 1, one.data()); }),
      "head");
}

// ---------------------------------------------------------------------------------------------
// HF export

TEST(HfExport, ReadMasterIsAskedForAtMostOnePieceWithinOneTensor) {
  TempDir dir("hf");
  const LlamaConfig cfg = small_config(32, 48, 2, 4, 2, 61, false);
  const model::ModelLayout layout = model::make_layout(cfg);
  const auto slabs = random_slabs(cfg, 4);
  uint64_t largest = 0, asked = 0, calls = 0;
  auto read = [&](int unit, uint64_t begin, uint64_t count, float* out) {
    largest = std::max(largest, count);
    asked += count;
    ++calls;
    const model::UnitLayout& u = layout.units.at(unit);
    const bool inside = std::any_of(u.tensors.begin(), u.tensors.end(), [&](const auto& t) {
      return begin >= t.offset && begin + count <= t.offset + t.numel;
    });
    EXPECT_TRUE(inside) << "unit " << unit << " [" << begin << ", +" << count << ")";
    std::copy_n(slabs[unit].data() + begin, count, out);
  };
  write_hf_model(cfg, read, dir / "m", {.dtype = DType::F16, .piece_elems = 1000});
  EXPECT_LE(largest, 1000u);
  EXPECT_EQ(asked, cfg.num_parameters());
  EXPECT_GT(calls, 10u);
  const HfWeights w = HfWeights::open(dir / "m", cfg);
  const auto back = import_slabs(w);
  for (size_t u = 0; u < back.size(); ++u)
    for (size_t i = 0; i < back[u].size(); ++i)
      ASSERT_EQ(back[u][i], round_to(DType::F16, slabs[u][i]));
}

// A Mistral model goes out as Mistral (model_type, architectures, sliding_window) under
// Llama's tensor names, and comes back in as the same config and weights.
TEST(HfExport, MistralKeepsItsTypeAndWindowAndComesBackIn) {
  TempDir dir("hf");
  LlamaConfig cfg = small_config(32, 48, 2, 4, 2, 61, false);
  cfg.model_type = model::ModelType::kMistral;
  cfg.sliding_window = 4096;
  const auto slabs = random_slabs(cfg, 5);
  auto read = [&](int unit, uint64_t begin, uint64_t count, float* out) {
    std::copy_n(slabs[unit].data() + begin, count, out);
  };
  write_hf_model(cfg, read, dir / "m", {.dtype = DType::F32});
  const LlamaConfig back_cfg = LlamaConfig::load(dir / "m" / kHfConfigFile);
  EXPECT_EQ(back_cfg.model_type, model::ModelType::kMistral);
  EXPECT_EQ(back_cfg.sliding_window, 4096);
  const std::string text = read_whole_file((dir / "m" / kHfConfigFile).string(), "config", 1 << 20);
  EXPECT_NE(text.find("\"model_type\": \"mistral\""), std::string::npos) << text;
  EXPECT_NE(text.find("MistralForCausalLM"), std::string::npos) << text;
  const HfWeights w = HfWeights::open(dir / "m", back_cfg);
  const auto back = import_slabs(w);
  for (size_t u = 0; u < back.size(); ++u) EXPECT_EQ(back[u], slabs[u]) << "unit " << u;
}

// Qwen2 (q, k, v biases) and Qwen3 (per-head q/k norms, head_dim given) go out under their own
// model_type, architectures and tensor names, come back in as the same config and weights, and
// exporting what was imported writes the same bytes (HF in -> export, byte for byte).
TEST(HfExport, QwenFamiliesRoundTripByteForByte) {
  for (const model::ModelType type : {model::ModelType::kQwen2, model::ModelType::kQwen3}) {
    const bool qwen2 = type == model::ModelType::kQwen2;
    SCOPED_TRACE(qwen2 ? "qwen2" : "qwen3");
    TempDir dir("hf");
    LlamaConfig cfg = small_config(32, 48, 2, 4, 2, 61, !qwen2, qwen2 ? 0 : 16);
    cfg.model_type = type;
    const auto slabs = random_slabs(cfg, 6);
    write_hf_model(cfg, from_slabs(slabs), dir / "m", {.dtype = DType::BF16});
    const LlamaConfig back_cfg = LlamaConfig::load(dir / "m" / kHfConfigFile);
    EXPECT_EQ(back_cfg.model_type, type);
    EXPECT_EQ(back_cfg.head_dim, cfg.head_dim);
    const std::string text =
        read_whole_file((dir / "m" / kHfConfigFile).string(), "config", 1 << 20);
    EXPECT_NE(text.find(qwen2 ? "Qwen2ForCausalLM" : "Qwen3ForCausalLM"), std::string::npos)
        << text;
    const SafetensorsFile f = SafetensorsFile::open(dir / "m" / kHfWeightsFile);
    std::set<std::string> names;
    for (const SafetensorsEntry& e : f.tensors()) names.insert(e.name);
    EXPECT_EQ(names.contains("model.layers.1.self_attn.k_proj.bias"), qwen2);
    EXPECT_EQ(names.contains("model.layers.1.self_attn.k_norm.weight"), !qwen2);

    const HfWeights w = HfWeights::open(dir / "m", back_cfg);
    const auto back = import_slabs(w);
    for (size_t u = 0; u < back.size(); ++u)
      for (size_t i = 0; i < back[u].size(); ++i)
        ASSERT_EQ(back[u][i], round_to(DType::BF16, slabs[u][i])) << "unit " << u << " " << i;
    write_hf_model(back_cfg, from_slabs(back), dir / "again", {.dtype = DType::BF16});
    EXPECT_EQ(read_all(dir / "again" / kHfWeightsFile), read_all(dir / "m" / kHfWeightsFile));
    EXPECT_EQ(read_all(dir / "again" / kHfConfigFile), read_all(dir / "m" / kHfConfigFile));
  }
}

TEST(HfExport, ShardsFollowHfOrderAndTheLimit) {
  TempDir dir("hf");
  const LlamaConfig cfg = small_config(32, 48, 2, 4, 2, 61, false);
  const auto slabs = random_slabs(cfg, 4);
  const uint64_t limit = 6000;  // the embedding (7808 B) alone; q (4096) + k (2048) split
  write_hf_model(cfg, from_slabs(slabs), dir / "m", {.max_shard_bytes = limit});
  EXPECT_FALSE(fs::exists(dir / "m" / kHfWeightsFile));
  const json index = json::parse(read_all(dir / "m" / kHfIndexFile));
  const std::set<std::string> shard_names = [&] {
    std::set<std::string> s;
    for (const auto& [k, v] : index["weight_map"].items()) s.insert(v.get<std::string>());
    return s;
  }();
  const size_t n = shard_names.size();
  ASSERT_GT(n, 3u);
  std::vector<std::string> order;
  uint64_t total = 0;
  std::vector<uint64_t> shard_bytes;
  for (size_t i = 0; i < n; ++i) {
    const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
    ASSERT_TRUE(shard_names.contains(name)) << name;
    const SafetensorsFile f = SafetensorsFile::open(dir / "m" / name);
    EXPECT_EQ(f.metadata().at("format"), "pt");
    uint64_t bytes = 0;
    for (const SafetensorsEntry& e : f.tensors()) {
      order.push_back(e.name);
      EXPECT_EQ(index["weight_map"][e.name], name);
      bytes += e.bytes;
    }
    EXPECT_TRUE(bytes <= limit || f.tensors().size() == 1) << name;
    shard_bytes.push_back(bytes);
    total += bytes;
  }
  EXPECT_EQ(index["metadata"]["total_size"], total);
  EXPECT_EQ(total, cfg.num_parameters() * 4);
  EXPECT_EQ(index["weight_map"].size(), order.size());
  const std::vector<std::string> layer = {
      "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
      "self_attn.o_proj.weight", "mlp.gate_proj.weight",    "mlp.up_proj.weight",
      "mlp.down_proj.weight",    "input_layernorm.weight",  "post_attention_layernorm.weight"};
  std::vector<std::string> expected = {"model.embed_tokens.weight"};
  for (int l = 0; l < 2; ++l)
    for (const auto& t : layer) expected.push_back(fmt::format("model.layers.{}.{}", l, t));
  expected.insert(expected.end(), {"model.norm.weight", "lm_head.weight"});
  EXPECT_EQ(order, expected);
  EXPECT_EQ(shard_bytes.front(), 7808u) << "a tensor over the limit sits alone";
}

TEST(HfExport, WritesConfigWithTorchDtypeAndTiedModelsHaveNoLmHead) {
  TempDir dir("hf");
  LlamaConfig cfg = small_config(32, 40, 1, 2, 2, 50, true);
  cfg.rope_theta = 5e5;
  const auto slabs = random_slabs(cfg, 8);
  write_hf_model(cfg, from_slabs(slabs), dir / "m", {.dtype = DType::BF16});
  const json j = json::parse(read_all(dir / "m" / kHfConfigFile));
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  EXPECT_EQ(j["architectures"], json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(j["model_type"], "llama");
  const LlamaConfig back = LlamaConfig::load(dir / "m" / kHfConfigFile);
  EXPECT_EQ(back.to_json(), cfg.to_json());
  const SafetensorsFile f = SafetensorsFile::open(dir / "m" / kHfWeightsFile);
  EXPECT_EQ(f.find("lm_head.weight"), nullptr);
  EXPECT_EQ(f.tensors().size(), 1u + 9u + 1u);
  for (const SafetensorsEntry& e : f.tensors()) EXPECT_EQ(e.dtype, DType::BF16) << e.name;
}

TEST(HfExport, RefusesANonEmptyDirectoryAndAcceptsAnEmptyOne) {
  TempDir dir("hf");
  const LlamaConfig cfg = small_config(32, 48, 1, 4, 2, 61, false);
  const auto slabs = random_slabs(cfg, 4);
  fs::create_directories(dir / "full");
  write_all(dir / "full" / "keep.txt", "x");
  const std::string msg =
      error_of<InvalidArgument>([&] { write_hf_model(cfg, from_slabs(slabs), dir / "full", {}); });
  EXPECT_MENTIONS(msg, (dir / "full").string());
  EXPECT_EQ(read_all(dir / "full" / "keep.txt"), "x");
  write_all(dir / "file", "x");
  EXPECT_MENTIONS(
      error_of<InvalidArgument>([&] { write_hf_model(cfg, from_slabs(slabs), dir / "file", {}); }),
      "not a directory");
  // A link is refused before anything is written (the final rename would fail on it).
  fs::create_directories(dir / "linked_target");
  fs::create_directory_symlink(dir / "linked_target", dir / "link");
  fs::create_symlink(dir / "nowhere", dir / "dangling");
  for (const char* link : {"link", "dangling"})
    EXPECT_MENTIONS(
        error_of<InvalidArgument>([&] { write_hf_model(cfg, from_slabs(slabs), dir / link, {}); }),
        "is a symbolic link");
  EXPECT_TRUE(fs::is_empty(dir / "linked_target"));
  fs::create_directories(dir / "empty");
  write_hf_model(cfg, from_slabs(slabs), dir / "empty/", {});
  EXPECT_TRUE(fs::exists(dir / "empty" / kHfWeightsFile));
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.path())) left.insert(e.path().filename());
  EXPECT_EQ(left,
            (std::set<std::string>{"empty", "file", "full", "link", "dangling", "linked_target"}))
      << "no temporary left";
}

TEST(HfExport, FailureLeavesNothingUnderTheFinalName) {
  TempDir dir("hf");
  const LlamaConfig cfg = small_config(32, 48, 2, 4, 2, 61, false);
  int calls = 0;
  auto failing = [&](int unit, uint64_t, uint64_t count, float* out) {
    if (++calls == 5) throw IoError("swap.bin", 0, count, EIO, "read");
    std::fill_n(out, count, 0.5f);
  };
  EXPECT_MENTIONS(error_of<IoError>(
                      [&] { write_hf_model(cfg, failing, dir / "m", {.max_shard_bytes = 8192}); }),
                  "swap.bin");
  EXPECT_TRUE(fs::is_empty(dir.path())) << "neither the directory nor its temporary remain";
}

// The slab element of tensor `name` (world size 1) and its unit.
std::pair<int, uint64_t> slab_element(const LlamaConfig& cfg, const std::string& name,
                                      uint64_t elem) {
  for (const model::UnitLayout& u : model::make_layout(cfg).units)
    for (const model::TensorSpec& t : u.tensors)
      if (t.name == name) return {u.index, t.offset + elem};
  ADD_FAILURE() << "no tensor " << name;
  return {0, 0};
}

// fp16 export of values that would round to Inf is refused, counting them across pieces and
// naming the tensor, the first value and the dtypes that hold it; nothing is left on disk.
TEST(HfExport, Fp16RefusesValuesThatWouldBecomeInfAndLeavesNothing) {
  TempDir dir("hf");
  const LlamaConfig cfg = small_config(32, 48, 2, 4, 2, 61, false);
  auto slabs = random_slabs(cfg, 4);
  const std::string name = "model.layers.1.mlp.down_proj.weight";
  const auto [unit, at] = slab_element(cfg, name, 5);
  slabs[unit][at] = 1e5f;
  slabs[unit][at + 700] = -65520.0f;  // the first magnitude rounding to Inf, in another piece
  const std::string msg = error_of<InvalidArgument>([&] {
    write_hf_model(cfg, from_slabs(slabs), dir / "m", {.dtype = DType::F16, .piece_elems = 500});
  });
  EXPECT_MENTIONS(msg, "\"" + name + "\"");
  EXPECT_MENTIONS(msg, "2 value");
  EXPECT_MENTIONS(msg, "100000");
  EXPECT_MENTIONS(msg, "element 5;");
  EXPECT_MENTIONS(msg, "fp16");
  EXPECT_MENTIONS(msg, "--dtype bf16");
  EXPECT_MENTIONS(msg, "fp32");
  EXPECT_TRUE(fs::is_empty(dir.path())) << "neither the directory nor its temporary remain";

  // bf16 and fp32 hold them exactly enough.
  write_hf_model(cfg, from_slabs(slabs), dir / "bf16", {.dtype = DType::BF16});
  const auto back = import_slabs(HfWeights::open(dir / "bf16", cfg));
  EXPECT_EQ(back[unit][at], round_to(DType::BF16, 1e5f));
}

// Values above fp16's largest (65504) that round to it are no overflow; below them the export
// is unchanged.
TEST(HfExport, Fp16KeepsValuesThatRoundToItsLargest) {
  TempDir dir("hf");
  const LlamaConfig cfg = small_config(32, 48, 1, 4, 2, 61, false);
  auto slabs = random_slabs(cfg, 4);
  const auto [unit, at] = slab_element(cfg, "model.norm.weight", 3);
  slabs[unit][at] = 65519.996f;
  slabs[unit][at + 1] = -65504.0f;
  write_hf_model(cfg, from_slabs(slabs), dir / "m", {.dtype = DType::F16});
  const auto back = import_slabs(HfWeights::open(dir / "m", cfg));
  EXPECT_EQ(back[unit][at], 65504.0f);
  EXPECT_EQ(back[unit][at + 1], -65504.0f);
}

// NaN or Inf master weights are refused in every dtype, naming the tensor, and a bf16 export
// refuses finite values past bf16's range.
TEST(HfExport, NonFiniteMasterWeightsAreRefusedInEveryDtype) {
  TempDir dir("hf");
  const LlamaConfig cfg = small_config(32, 48, 2, 4, 2, 61, false);
  const std::string name = "model.layers.0.self_attn.v_proj.weight";
  const auto [unit, at] = slab_element(cfg, name, 11);
  for (const float bad : {std::nanf(""), -INFINITY}) {
    auto slabs = random_slabs(cfg, 4);
    slabs[unit][at] = bad;
    for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
      SCOPED_TRACE(fmt::format("{} {}", dtype_name(dtype), bad));
      const std::string msg = error_of<InvalidArgument>(
          [&] { write_hf_model(cfg, from_slabs(slabs), dir / "m", {.dtype = dtype}); });
      EXPECT_MENTIONS(msg, "\"" + name + "\"");
      EXPECT_MENTIONS(msg, "NaN or Inf");
      EXPECT_MENTIONS(msg, fmt::format("{}", bad));
      EXPECT_MENTIONS(msg, "element 11)");
      EXPECT_TRUE(fs::is_empty(dir.path()));
    }
  }
  auto slabs = random_slabs(cfg, 4);
  slabs[unit][at] = 3.4e38f;  // finite, but past bf16's largest (3.3895e38) by over half a step
  const std::string msg = error_of<InvalidArgument>(
      [&] { write_hf_model(cfg, from_slabs(slabs), dir / "m", {.dtype = DType::BF16}); });
  EXPECT_MENTIONS(msg, "\"" + name + "\"");
  EXPECT_MENTIONS(msg, "bf16");
  EXPECT_MENTIONS(msg, "--dtype fp32");
  EXPECT_TRUE(fs::is_empty(dir.path()));
  EXPECT_NO_THROW(write_hf_model(cfg, from_slabs(slabs), dir / "m", {.dtype = DType::F32}));
}

// ---------------------------------------------------------------------------------------------
// Against the PyTorch reference

struct OracleCase {
  std::string name;
  LlamaConfig config;
  std::string dtype;  // torch_dtype spelling
  int shards;
  std::vector<std::string> extra_tensors{};
  bool save_lm_head = false;
};

constexpr int64_t kBatch = 2, kSeq = 9;

std::vector<OracleCase> oracle_cases() {
  return {
      {"gqa_untied_f32",
       small_config(32, 48, 2, 4, 2, 61, false),
       "float32",
       1,
       {"model.layers.0.self_attn.rotary_emb.inv_freq",
        "model.layers.1.self_attn.rotary_emb.inv_freq"}},
      {"tied_f32", small_config(32, 40, 1, 2, 2, 50, true), "float32", 1, {}, true},
      {"gqa_bf16", small_config(64, 96, 2, 4, 2, 300, false), "bfloat16", 1},
      {"mqa_sharded_f16", small_config(24, 40, 2, 4, 1, 37, false, 8), "float16", 3},
  };
}

DType dtype_of(const std::string& torch) {
  return torch == "float32" ? DType::F32 : torch == "bfloat16" ? DType::BF16 : DType::F16;
}

std::vector<double> read_doubles(const fs::path& p) {
  const std::string raw = read_all(p);
  std::vector<double> v(raw.size() / sizeof(double));
  std::memcpy(v.data(), raw.data(), v.size() * sizeof(double));
  return v;
}

double scaled_error(const std::vector<float>& a, const std::vector<double>& b) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return scale > 0 ? err / scale : err;
}

class HfOracle : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system(OUTCORE_PYTHON " -c 'import torch' >/dev/null 2>&1") != 0) {
      skip_reason_ = "no PyTorch for " OUTCORE_PYTHON;
      return;
    }
    dir_ = std::make_unique<TempDir>("hf_oracle");
    tokens_ = model::testing::random_ids(kBatch * kSeq, 37, 21);  // < every case's vocab
    std::string cmd = script() + " make";
    for (const OracleCase& c : oracle_cases()) {
      const fs::path d = *dir_ / c.name;
      fs::create_directories(d);
      const json cj = {{"config", json::parse(c.config.to_json())},
                       {"dtype", c.dtype},
                       {"shards", c.shards},
                       {"seed", 17},
                       {"batch", kBatch},
                       {"seq", kSeq},
                       {"extra_tensors", c.extra_tensors},
                       {"save_lm_head", c.save_lm_head}};
      write_all(d / "case.json", cj.dump());
      write_all(d / "tokens.bin", std::string_view(reinterpret_cast<const char*>(tokens_.data()),
                                                   tokens_.size() * 4));
      cmd.append(" ").append(d.string());
    }
    if (std::system(cmd.c_str()) != 0) failure_ = "the reference script failed: " + cmd;
  }
  static void TearDownTestSuite() { dir_.reset(); }
  void SetUp() override {
    if (!skip_reason_.empty()) OUTCORE_ORACLE_UNAVAILABLE(skip_reason_);
    ASSERT_TRUE(failure_.empty()) << failure_;
  }

  static std::string script() {
    return OUTCORE_PYTHON " " OUTCORE_SOURCE_DIR "/tests/ckpt/oracle/hf_oracle.py";
  }
  static fs::path hf_dir(const OracleCase& c) { return *dir_ / c.name / "hf"; }
  static std::vector<double> ref_logits(const OracleCase& c) {
    return read_doubles(*dir_ / c.name / "logits.bin");
  }

  // outcore's logits for the case's tokens with the weights imported from `hf`.
  static std::vector<float> outcore_logits(const fs::path& hf) {
    const LlamaConfig cfg = LlamaConfig::load(hf / kHfConfigFile);
    const HfWeights w = HfWeights::open(hf, cfg);
    model::testing::Harness h(cfg, {.micro_batch = kBatch, .seq_len = kSeq}, import_slabs(w));
    std::vector<float> logits(tokens_.size() * cfg.vocab_size);
    h.eval(tokens_, tokens_, logits.data());
    return logits;
  }

  static inline std::unique_ptr<TempDir> dir_;
  static inline std::vector<int32_t> tokens_;
  static inline std::string skip_reason_, failure_;
};

TEST_F(HfOracle, ImportedWeightsGiveTheReferenceLogits) {
  for (const OracleCase& c : oracle_cases()) {
    SCOPED_TRACE(c.name);
    const std::vector<double> ref = ref_logits(c);
    const std::vector<float> got = outcore_logits(hf_dir(c));
    ASSERT_EQ(got.size(), ref.size());
    const double err = scaled_error(got, ref);
    EXPECT_LT(err, 5e-6);
    std::printf("[ oracle   ] %-16s logits %.2e\n", c.name.c_str(), err);
  }
}

// Import then export with the source dtype: every tensor byte for byte, same shapes.
TEST_F(HfOracle, ExportReproducesEveryTensorByteForByte) {
  for (const OracleCase& c : oracle_cases()) {
    SCOPED_TRACE(c.name);
    const LlamaConfig cfg = LlamaConfig::load(hf_dir(c) / kHfConfigFile);
    const HfWeights src = HfWeights::open(hf_dir(c), cfg);
    const fs::path out = *dir_ / c.name / "export";
    auto read = [&](int unit, uint64_t begin, uint64_t count, float* dst) {
      src.read_unit_range(src.layout().units.at(unit), begin, count, dst);
    };
    write_hf_model(cfg, read, out, {.dtype = dtype_of(c.dtype), .piece_elems = 777});
    const HfWeights dst = HfWeights::open(out, cfg);
    size_t tensors = 0;
    for (const SafetensorsFile& f : dst.files()) tensors += f.tensors().size();
    EXPECT_EQ(tensors, 2 + 9 * cfg.num_hidden_layers + (cfg.tie_word_embeddings ? 0 : 1))
        << "only model tensors (no inv_freq, no tied lm_head)";
    for (const model::UnitLayout& u : src.layout().units) {
      for (const model::TensorSpec& t : u.tensors) {
        const SafetensorsEntry* a = src.entry(t.name);
        const SafetensorsEntry* b = dst.entry(t.name);
        ASSERT_NE(b, nullptr) << t.name;
        EXPECT_EQ(a->shape, b->shape) << t.name;
        EXPECT_EQ(a->dtype, b->dtype) << t.name;
        std::vector<std::byte> x(a->bytes), y(b->bytes);
        src.file(t.name)->read(*a, 0, a->bytes, x.data());
        dst.file(t.name)->read(*b, 0, b->bytes, y.data());
        EXPECT_TRUE(x == y) << t.name << " differs after import and export";
      }
    }
  }
}

// A sharded export: the index lists every tensor once with the right total, and the reference
// reads the exported directory back to the same logits.
TEST_F(HfOracle, ShardedExportIsCompleteAndGivesTheReferenceLogits) {
  const OracleCase c = oracle_cases()[0];
  const LlamaConfig cfg = LlamaConfig::load(hf_dir(c) / kHfConfigFile);
  const HfWeights src = HfWeights::open(hf_dir(c), cfg);
  const auto slabs = import_slabs(src);
  const fs::path out = *dir_ / c.name / "sharded";
  write_hf_model(cfg, from_slabs(slabs), out, {.max_shard_bytes = 10000});
  const json index = json::parse(read_all(out / kHfIndexFile));
  std::set<std::string> expected, listed;
  uint64_t total = 0;
  for (const model::UnitLayout& u : src.layout().units)
    for (const model::TensorSpec& t : u.tensors) expected.insert(t.name);
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) {
    EXPECT_TRUE(listed.insert(name).second) << name << " listed twice";
    files.insert(file.get<std::string>());
    const SafetensorsFile f = SafetensorsFile::open(out / file.get<std::string>());
    ASSERT_NE(f.find(name), nullptr) << name << " not in " << file;
    total += f.find(name)->bytes;
  }
  EXPECT_EQ(listed, expected);
  EXPECT_GT(files.size(), 2u);
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);

  const fs::path tokens = *dir_ / c.name / "tokens.bin";
  const fs::path result = *dir_ / c.name / "sharded_logits.bin";
  const std::string cmd = fmt::format("{} logits {} {} {} {} {}", script(), out.string(),
                                      tokens.string(), kBatch, kSeq, result.string());
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::vector<double> back = read_doubles(result), ref = ref_logits(c);
  ASSERT_EQ(back.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_EQ(back[i], ref[i]) << "logit " << i;
  EXPECT_LT(scaled_error(outcore_logits(out), ref), 5e-6);
}

}  // namespace
}  // namespace outcore::ckpt
