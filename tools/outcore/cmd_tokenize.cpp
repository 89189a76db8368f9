// `outcore tokenize --tokenizer DIR --input FILE... --out PREFIX [--text-key K | --prompt-key P
// --completion-key C] [--doc-per-file] [--threads N] [--max-document-mb N] [--skip-bad]
// [--log-json FILE]`: text or
// JSON lines -> a token file (PREFIX.bin, llm.c's format, or PREFIX.u32 for vocabularies over
// 65536) and, for prompt/completion pairs, a loss mask (PREFIX.mask); engine/data's
// tokenize_job.hpp says what is written. Progress on stderr about once a second (and as JSON
// lines with --log-json), the result on stdout. Exit 0 when written, 2 on bad input (a bad
// option, tokenizer or document: one line naming the file and line), 1 when reading or writing
// fails, 130 when SIGINT, SIGTERM or SIGHUP stopped it; on any failure nothing is written,
// except that a log whose last record cannot be written once the outputs are in place is an
// exit 1 after the lines naming them. --log-json replaces only a log of this command, and no
// output may lie in a checkpoint.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/json_lines.hpp"
#include "common/unique_fd.hpp"
#include "engine/data/document_reader.hpp"
#include "engine/data/tokenize_job.hpp"
#include "engine/data/tokenizer.hpp"
#include "tools/outcore/commands.hpp"
#include "tools/outcore/stop_signals.hpp"
#include "tools/outcore/train_session.hpp"

namespace outcore::cli {
namespace {

struct TokenizeArgs {
  std::string tokenizer, out, text_key = "text", prompt_key, completion_key, log_json;
  std::vector<std::string> inputs;
  int threads = 0;
  int64_t max_document_mb = 64;
  bool skip_bad = false, doc_per_file = false;
  bool text_key_given = false;  // --text-key on the command line
};

// Skipped documents named on stderr; the rest only counted.
constexpr uint64_t kSkippedShown = 5;

nlohmann::json progress_json(const char* event, const data::TokenizeProgress& p) {
  return {{"event", event},
          {"seconds", p.seconds},
          {"mb_read", p.bytes_read / 1e6},
          {"mb_per_s", p.seconds > 0 ? p.bytes_read / 1e6 / p.seconds : 0.0},
          {"documents", p.documents},
          {"tokens", p.tokens},
          {"skipped", p.skipped}};
}

// Whether `path` is missing, empty, or a log this command wrote (its first line a JSON record
// whose "event" is progress, done or error): the only files --log-json replaces. Otherwise one
// error line naming it.
bool holds_tokenize_log_or_nothing(const std::string& path) {
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0 && errno == ENOENT) return true;
  if (fd.get() >= 0 && first_json_line_is(fd.get(), "event", {"progress", "done", "error"}))
    return true;
  std::fprintf(stderr,
               "error: --log-json %s: exists and is not a log of outcore tokenize (its first line "
               "is not a JSON record of \"event\" progress, done or error): the command replaces "
               "only such a log; move it away or name another file\n",
               path.c_str());
  return false;
}

std::string optional_id(std::optional<uint32_t> id) {
  return id ? std::to_string(*id) : std::string("none");
}

int run_tokenize(const TokenizeArgs& a) {
  std::vector<std::pair<std::string, const char*>> inputs;
  for (const std::string& in : a.inputs) {
    if (!check_input_file(in, "--input")) return 2;
    inputs.emplace_back(in, "--input");
  }
  if (!a.prompt_key.empty() && a.completion_key.empty())
    throw InvalidArgument("--prompt-key needs --completion-key");
  if (a.prompt_key.empty() && !a.completion_key.empty())
    throw InvalidArgument("--completion-key needs --prompt-key");
  if (!a.prompt_key.empty() && a.prompt_key == a.completion_key)
    throw InvalidArgument(fmt::format(
        "--prompt-key and --completion-key are both \"{}\": the completion would repeat the "
        "prompt; name the two keys of a pair",
        a.prompt_key));
  // A key given for an input read as plain text would be dropped without a word (its JSON
  // lines tokenized as text).
  if (a.text_key_given)
    for (const std::string& in : a.inputs)
      if (data::input_format_of(in) != data::InputFormat::kJsonLines)
        throw InvalidArgument(fmt::format(
            "--text-key {}: {} is read as plain text (JSON lines are files named .jsonl, .json "
            "or .ndjson), where the key does not apply: rename it, or leave out --text-key",
            a.text_key, in));
  if (a.threads < 0 || a.threads > data::kMaxTokenizeThreads)
    throw InvalidArgument(
        fmt::format("--threads {}: 0 (all cores) to {}", a.threads, data::kMaxTokenizeThreads));
  const std::filesystem::path out_name = std::filesystem::path(a.out).filename();
  if (out_name.empty() || out_name == "." || out_name == "..")
    throw InvalidArgument("--out " + a.out +
                          ": a prefix of file names (PREFIX.bin), not a directory: add a name, "
                          "e.g. " +
                          a.out + "data");

  const data::Tokenizer tokenizer = data::Tokenizer::load(a.tokenizer);
  std::fprintf(stderr, "tokenizer: %s; vocab_size %llu, BOS %s, EOS %s\n",
               tokenizer.description().c_str(),
               static_cast<unsigned long long>(tokenizer.vocab_size()),
               optional_id(tokenizer.bos_id()).c_str(), optional_id(tokenizer.eos_id()).c_str());
  if (!tokenizer.eos_id())
    std::fprintf(stderr,
                 "warning: the tokenizer names no EOS token: documents are written "
                 "without a separator\n");

  data::TokenizeOptions o;
  o.inputs = a.inputs;
  o.out_prefix = a.out;
  o.text_key = a.text_key;
  o.prompt_key = a.prompt_key;
  o.completion_key = a.completion_key;
  o.doc_per_file = a.doc_per_file;
  o.threads = a.threads;
  o.skip_bad = a.skip_bad;
  o.max_document_bytes = static_cast<size_t>(a.max_document_mb) << 20;
  o.stop = &stop_flag();
  const std::vector<std::string> outputs = data::tokenize_outputs(o, tokenizer.vocab_size());
  // The tokenizer's files are inputs too (tokenizer.json, its config, a SentencePiece model).
  std::error_code ec;
  if (std::filesystem::is_directory(a.tokenizer, ec))
    for (const auto& e : std::filesystem::directory_iterator(a.tokenizer, ec))
      if (e.is_regular_file(ec)) inputs.emplace_back(e.path().string(), "--tokenizer");
  for (const std::string& out : outputs)
    if (!check_output_file(out, "--out", inputs)) return 2;
  if (!check_output_file(a.log_json, "--log-json", inputs)) return 2;
  // Nor may the log be an output, or the loss mask this job replaces or removes, under any name.
  std::vector<std::pair<std::string, const char*>> written;
  for (const std::string& out : outputs) written.emplace_back(out, "--out");
  written.emplace_back(a.out + ".mask", "--out");
  written.emplace_back(a.out + ".lock", "--out");  // the job's lock on its outputs
  if (!check_output_file(a.log_json, "--log-json", written, "one of the outputs")) return 2;
  // Nothing goes into a checkpoint (a file it does not list keeps it from being pruned), and the
  // log replaces only a log.
  // Nor into a swap directory (a run's swap file of that name, and its end, would take it).
  for (const std::string& out : outputs)
    if (!check_outside_checkpoints(out, "--out", "") || !check_not_a_save_name(out, "--out") ||
        !check_outside_swap_trees(out, "--out"))
      return 2;
  if (!check_outside_checkpoints(a.out + ".mask", "--out", "") ||
      !check_outside_swap_trees(a.out + ".mask", "--out") ||
      !check_outside_checkpoints(a.log_json, "--log-json", "") ||
      !check_outside_swap_trees(a.log_json, "--log-json") ||
      !check_not_a_save_name(a.log_json, "--log-json") ||
      (!a.log_json.empty() && !holds_tokenize_log_or_nothing(a.log_json)))
    return 2;

  // The log is locked for the job (flock, as a metrics file): two jobs writing it would tear its
  // lines. Checked again once locked, then emptied.
  std::ofstream log;
  UniqueFd log_lock;
  if (!a.log_json.empty()) {
    log_lock = UniqueFd(::open(a.log_json.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (log_lock.get() < 0) throw IoError(a.log_json, errno, "open --log-json");
    if (::flock(log_lock.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK)
        throw PathBusy(a.log_json,
                       "lock --log-json (another job is writing it: give each job its own log)");
      std::fprintf(stderr, "warning: --log-json %s cannot be locked (%s)\n", a.log_json.c_str(),
                   errno_string(errno).c_str());
    }
    if (!holds_tokenize_log_or_nothing(a.log_json)) return 2;
    log.open(a.log_json, std::ios::trunc);
    if (!log) throw IoError(a.log_json, errno, "open --log-json");
  }
  o.on_progress = [&log, &a](const data::TokenizeProgress& p) {
    std::fprintf(stderr, "tokenize: %.1f MB read (%.1f MB/s), %llu documents, %llu tokens%s\n",
                 p.bytes_read / 1e6, p.seconds > 0 ? p.bytes_read / 1e6 / p.seconds : 0.0,
                 static_cast<unsigned long long>(p.documents),
                 static_cast<unsigned long long>(p.tokens),
                 p.skipped > 0 ? fmt::format(", {} skipped", p.skipped).c_str() : "");
    if (log.is_open()) {
      log << progress_json("progress", p).dump() << '\n' << std::flush;
      // Before anything is written: a log that cannot be written fails the job, which then
      // writes nothing.
      if (!log) throw IoError(a.log_json, errno != 0 ? errno : EIO, "write --log-json");
    }
  };
  uint64_t skipped = 0;
  o.on_skipped = [&skipped](const data::BadDocument& bad) {
    if (skipped++ < kSkippedShown) std::fprintf(stderr, "skipped: %s\n", bad.what());
  };

  const StopSignals signals({});
  data::TokenizeResult r;
  try {
    r = data::run_tokenize_job(tokenizer, o);
  } catch (const std::exception& e) {  // the log says how the job ended, too
    if (log.is_open())
      log << nlohmann::json{{"event", "error"}, {"message", e.what()}}.dump() << '\n' << std::flush;
    throw;
  }
  if (skipped > kSkippedShown)
    std::fprintf(stderr, "skipped: %llu more bad documents not shown\n",
                 static_cast<unsigned long long>(skipped - kSkippedShown));
  // The outputs are in place: a log that fails now is reported after them (exit 1).
  int log_errno = 0;
  if (log.is_open()) {
    nlohmann::json done = progress_json("done", r.totals);
    done["token_file"] = r.token_file;
    if (!r.mask_file.empty()) done["mask_file"] = r.mask_file;
    if (!r.removed_mask.empty()) done["removed_mask_file"] = r.removed_mask;
    log << done.dump() << '\n' << std::flush;
    if (!log) log_errno = errno != 0 ? errno : EIO;
  }
  const data::TokenizeProgress& t = r.totals;
  std::printf(
      "tokenized %llu documents (%llu skipped as bad) from %zu files: %.1f MB in %.1f s "
      "(%.1f MB/s), %llu tokens\n",
      static_cast<unsigned long long>(t.documents), static_cast<unsigned long long>(t.skipped),
      a.inputs.size(), t.bytes_read / 1e6, t.seconds,
      t.seconds > 0 ? t.bytes_read / 1e6 / t.seconds : 0.0,
      static_cast<unsigned long long>(t.tokens));
  std::printf("wrote %s (%s, vocab_size %llu)\n", r.token_file.c_str(),
              r.llmc ? "llm.c format, uint16 tokens" : "raw uint32 tokens",
              static_cast<unsigned long long>(tokenizer.vocab_size()));
  if (!r.removed_mask.empty())
    std::printf(
        "removed %s (the loss mask of the token file replaced; every token of %s is a "
        "training target)\n",
        r.removed_mask.c_str(), r.token_file.c_str());
  if (!r.mask_file.empty())
    std::printf("wrote %s (one byte per token; %llu of %llu tokens are training targets)\n",
                r.mask_file.c_str(), static_cast<unsigned long long>(r.targets),
                static_cast<unsigned long long>(t.tokens));
  if (log_errno != 0) {
    std::fprintf(stderr,
                 "error: write --log-json %s: %s (the outputs above are written and whole; the "
                 "log lacks its last record)\n",
                 a.log_json.c_str(), errno_string(log_errno).c_str());
    return 1;
  }
  return 0;
}

// Bad input exits 2, failures while reading or writing exit 1, a stop 130.
int run_tokenize_reporting(const TokenizeArgs& a) {
  catch_early_stop();
  return run_reporting([&] { return run_tokenize(a); },
                       [&](const char* message) {
                         std::fprintf(stderr, "stopped: %s; nothing was written to %s.*\n", message,
                                      a.out.c_str());
                       });
}

}  // namespace

void add_tokenize_command(CLI::App& app, int& rc) {
  auto a = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize",
      "Tokenize text or JSON lines with a Hugging Face tokenizer into a token file (llm.c .bin; "
      "raw .u32 for vocabularies over 65536) and, for prompt/completion pairs, a loss mask");
  cmd->footer(
      "Inputs: a .jsonl, .json or .ndjson file holds one JSON object per line (blank lines "
      "skipped); any "
      "other file is plain text, where a document is a maximal run of non-blank lines (blank: "
      "only spaces, tabs, \\r), or the whole file with --doc-per-file.\n"
      "Each document is encoded with the tokenizer's special tokens (e.g. a BOS) and followed by "
      "EOS. Pairs: the prompt (with special tokens, mask 0), the completion (mask 1), EOS (mask "
      "1); PREFIX.mask holds one byte per token, 1 where the token is a training target.\n"
      "Without pairs, a PREFIX.mask an earlier job left is removed with the token file it "
      "belonged to.\n"
      "Outputs are written as temporaries and renamed into place only when all input was read; "
      "bad input (ill-formed UTF-8, a bad JSON line, a missing key) stops the job naming the "
      "file and line, unless --skip-bad.");
  cmd->add_option("--tokenizer", a->tokenizer,
                  "model directory with tokenizer.json or tokenizer.model (and "
                  "tokenizer_config.json for BOS/EOS)")
      ->required();
  cmd->add_option("--input", a->inputs,
                  "input files, in order (text, or JSON lines: .jsonl, .json or .ndjson)")
      ->required();
  cmd->add_option("--out", a->out, "output prefix: writes PREFIX.bin or PREFIX.u32 (+ PREFIX.mask)")
      ->required();
  CLI::Option* text_key = cmd->add_option("--text-key", a->text_key,
                                          "JSON key of a document's text (default \"text\")");
  CLI::Option* prompt_key = cmd->add_option(
      "--prompt-key", a->prompt_key,
      "JSON key of the prompt of a prompt/completion pair (needs --completion-key)");
  cmd->add_option("--completion-key", a->completion_key,
                  "JSON key of the completion of a prompt/completion pair");
  text_key->excludes(prompt_key);
  cmd->add_flag("--doc-per-file", a->doc_per_file, "each plain-text input is one document");
  cmd->add_option("--threads", a->threads, "tokenizing threads (default 0: all cores)");
  cmd->add_option("--max-document-mb", a->max_document_mb,
                  "longest document (or JSON line) accepted, in MiB; tokenizing one takes about 5 "
                  "times its size in memory (default 64)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  cmd->add_flag("--skip-bad", a->skip_bad,
                "leave out bad documents (counted, the first few named on stderr) instead of "
                "failing");
  cmd->add_option("--log-json", a->log_json,
                  "also write the progress as JSON lines to FILE (replaces only such a log)");
  cmd->callback([a, text_key, &rc] {
    a->text_key_given = text_key->count() > 0;
    rc = run_tokenize_reporting(*a);
  });
}

}  // namespace outcore::cli
