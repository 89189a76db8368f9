// Tokenizer throughput against Hugging Face tokenizers, measured in the same run.
//
// Encodes the same documents (generated multilingual text, tests/data/sample_text.hpp, or the
// blank-line-separated documents of --input) with outcore's Tokenizer on N threads and with
// Hugging Face tokenizers under Node (tests/data/oracle/encode.js: encodeBatch, its threads set
// by RAYON_NUM_THREADS=N), checks that every document's ids agree, and prints tokens/s of each
// and the ratio ours / reference. Only encoding is timed on both sides (not loading, not
// reading files). Each side runs once per thread count with a freshly loaded tokenizer, so both
// start with empty caches.
//
//   tokenize_bench [--tokenizer DIR] [--mb 32] [--threads 1,2] [--input FILE] [--dir DIR]
//                  [--no-reference]
#include <fmt/format.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench/common/scratch.hpp"
#include "engine/data/document_reader.hpp"
#include "engine/data/tokenizer.hpp"
#include "tests/common/run_command.hpp"
#include "tests/data/oracle_util.hpp"
#include "tests/data/sample_text.hpp"

namespace {

using namespace outcore;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::vector<std::string> read_documents(const std::string& path) {
  data::DocumentReader reader({path}, {});
  std::vector<std::string> docs;
  while (auto b = reader.next())
    for (const data::Document& d : b->docs) docs.emplace_back(b->bytes.substr(d.offset, d.size));
  return docs;
}

// Encodes every document on `threads` threads; returns the seconds it took.
double encode_all(const data::Tokenizer& t, const std::vector<std::string>& docs, int threads,
                  std::vector<std::vector<uint32_t>>& ids) {
  ids.assign(docs.size(), {});
  tbb::task_arena arena(threads);
  const auto t0 = Clock::now();
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, docs.size(), 16),
                      [&](const tbb::blocked_range<size_t>& r) {
                        for (size_t i = r.begin(); i != r.end(); ++i)
                          t.encode(docs[i], true, ids[i]);
                      });
  });
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

static int run_bench(int argc, char** argv) {
  CLI::App app{"tokenize_bench: outcore's tokenizer against Hugging Face tokenizers (Node)"};
  std::string tokenizer_dir = (outcore::test::llama3_dir()).string(), input, dir;
  double mb = 32;
  std::vector<int> thread_counts = {1, 2};
  bool no_reference = false;
  app.add_option("--tokenizer", tokenizer_dir,
                 "model directory (default: Llama 3's, from "
                 "tests/data/oracle/node_modules)");
  app.add_option("--mb", mb, "megabytes of generated text (default 32)");
  app.add_option("--threads", thread_counts, "thread counts to measure (default 1,2)")
      ->delimiter(',');
  app.add_option("--input", input, "plain text to use instead (blank-line-separated documents)");
  app.add_option("--dir", dir,
                 "directory in which one of the benchmark's own is made and removed (default "
                 "<build>/bench_tmp/tokenize)");
  app.add_flag("--no-reference", no_reference, "measure outcore only");
  CLI11_PARSE(app, argc, argv);
  if (dir.empty()) dir = (fs::path(OUTCORE_BINARY_DIR) / "bench_tmp/tokenize").string();
  // The documents and the reference's ids go in a directory of its own, removed at the end.
  const outcore::bench::ScratchDir scratch(dir, "tokenize_bench");

  std::vector<std::string> docs;
  if (input.empty()) {
    outcore::test::SampleTextOptions o;
    o.total_bytes = static_cast<size_t>(mb * 1e6);
    docs = outcore::test::sample_documents(o);
  } else {
    docs = read_documents(input);
  }
  size_t bytes = 0;
  for (const std::string& d : docs) bytes += d.size();
  const fs::path docs_file = scratch.path() / "docs.bin";
  outcore::test::write_documents(docs_file, docs);

  std::printf("tokenize_bench: %s\n  %zu documents, %.1f MB; hardware threads %d\n",
              data::Tokenizer::load(tokenizer_dir).description().c_str(), docs.size(), bytes / 1e6,
              tbb::info::default_concurrency());
  std::printf("%8s %14s %14s %10s %8s\n", "threads", "ours tok/s", "HF tok/s", "ours/HF", "ids");
  int rc = 0;
  for (int threads : thread_counts) {
    // A tokenizer loaded afresh, so that its word caches start empty as the reference's do.
    const data::Tokenizer tokenizer = data::Tokenizer::load(tokenizer_dir);
    std::vector<std::vector<uint32_t>> ours;
    const double ours_s = encode_all(tokenizer, docs, threads, ours);
    size_t tokens = 0;
    for (const auto& d : ours) tokens += d.size();
    if (no_reference) {
      std::printf("%8d %14.0f %14s %10s %8s\n", threads, tokens / ours_s, "-", "-", "-");
      continue;
    }
    const fs::path ref_file = scratch.path() / "ref.bin";
    std::string log;
    const int node_rc = outcore::test::run_node_oracle(
        docs_file, {{fs::path(tokenizer_dir) / "tokenizer.json", ref_file}}, true, log,
        fmt::format("RAYON_NUM_THREADS={}", threads));
    if (node_rc != 0) {
      std::fprintf(stderr, "tokenize_bench: the reference failed:\n%s\n", log.c_str());
      return 1;
    }
    const nlohmann::json result = nlohmann::json::parse(log.substr(log.find('{')));
    const double ref_s = result["seconds"].get<double>();
    const std::vector<std::vector<uint32_t>> ref = outcore::test::read_reference_ids(ref_file);
    size_t differ = ref.size() == ours.size() ? 0 : docs.size();
    for (size_t i = 0; differ == 0 && i < ref.size(); ++i) differ += ref[i] != ours[i];
    if (differ != 0) rc = 1;
    std::printf("%8d %14.0f %14.0f %10.2f %8s\n", threads, tokens / ours_s,
                result["tokens"].get<double>() / ref_s, ref_s / ours_s,
                differ == 0 ? "same" : fmt::format("{} differ", differ).c_str());
  }
  return rc;
}

int main(int argc, char** argv) {
  return outcore::bench::main_removing_scratch("tokenize_bench", run_bench, argc, argv);
}
