// The tokenize job: text or JSON-lines files -> one token file (and, for prompt/completion
// pairs, a loss mask), streamed with bounded memory on all threads; the output does not depend
// on the thread count.
//
// Inputs: see document_reader.hpp (plain text: blank-line-separated documents, or one per file
// with doc_per_file; ".jsonl"/".json": one JSON object per line, blank lines skipped).
//
// Document layout, in input order:
// - a text document (a text file's, or the string at text_key): encode(text, special tokens
//   added), then EOS unless the tokenizer has none or the encoding already ends with it;
// - a prompt/completion pair (the strings at prompt_key and completion_key): encode(prompt +
//   completion, special tokens added), then EOS unless the tokenizer has none or the sequence
//   already ends with it. Mask 0 up to the first token where it differs from encode(prompt)
//   with the template's special tokens that come before a text (BOS), 1 from there: the whole
//   prompt's tokens where they are the sequence's first, as they are unless a token joins the
//   prompt's end to the completion's start (then that token is a target).
//
// Output, beside `out_prefix`: PREFIX.bin in llm.c's format (256 int32 header: magic 20240520,
// version 1, token count; then uint16 tokens) when the tokenizer's vocab_size is at most 65536,
// else PREFIX.u32 (raw little-endian uint32); for pairs also PREFIX.mask, one byte per token, 1
// where the token is a training target (the loss counts the prediction of that token), 0 where
// not (engine/train/token_file.hpp reads both). Each file is written as a temporary beside its
// target, fsynced, and renamed over the target only when the whole job succeeded; on any
// failure the temporaries are removed and no existing file is touched (a mask already at
// PREFIX.mask, which the job replaces or, without pairs, removes, is linked aside first and put
// back if the token file's rename fails; a kill during those renames can leave it as
// PREFIX.mask.old-<pid>). Without pairs, a file at PREFIX.mask is removed only when it is the
// loss mask of the token file replaced (a regular file of its token count, and still the file
// found at the start when the job commits); anything else there is refused, and kept. PREFIX.mask
// beside the token file of the other extension (PREFIX.u32 when writing PREFIX.bin, or the reverse)
// may be that file's: the job is then refused. Inputs are only read.
//
// Bad input (ill-formed UTF-8, a line that is not a JSON object, a missing or non-string key)
// is a BadDocument naming the file and the 1-based line, unless skip_bad: then that document
// (or JSON line) is left out and counted.
//
// Threads: a oneTBB pipeline in an arena of `threads`: one reader, documents encoded in
// parallel, one writer taking them in input order (on_progress and on_skipped run there).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/data/document_reader.hpp"
#include "engine/data/tokenizer.hpp"

namespace outcore::data {

struct TokenizeProgress {
  uint64_t bytes_read = 0;  // of all inputs
  uint64_t documents = 0;   // written
  uint64_t tokens = 0;      // written
  uint64_t skipped = 0;     // bad documents left out (skip_bad)
  double seconds = 0;       // since the job started
};

// The most threads a job takes (TokenizeOptions::threads).
inline constexpr int kMaxTokenizeThreads = 1024;

struct TokenizeOptions {
  std::vector<std::string> inputs;
  std::string out_prefix;
  // The key of a JSON line's text; ignored when prompt_key is set.
  std::string text_key = "text";
  // Prompt/completion pairs: both keys, or neither. Every input must then be JSON lines.
  std::string prompt_key, completion_key;
  // Each plain-text file is one document. Refused for JSON-lines inputs.
  bool doc_per_file = false;
  // Threads tokenizing (0: every hardware thread; at most kMaxTokenizeThreads).
  int threads = 0;
  // Leave bad documents out (counted) instead of failing.
  bool skip_bad = false;
  // Bytes read per chunk, and the longest document (or JSON line) accepted.
  size_t chunk_bytes = size_t{16} << 20;
  size_t max_document_bytes = size_t{64} << 20;
  // When set and true, the job stops at the next chunk with Interrupted.
  const std::atomic<bool>* stop = nullptr;
  // Called on the writing thread at most every progress_interval, and once at the end, before
  // the outputs are put in place (what it throws fails the job, which then writes nothing).
  std::function<void(const TokenizeProgress&)> on_progress;
  std::chrono::milliseconds progress_interval{1000};
  // Called on the writing thread for each bad document left out (skip_bad).
  std::function<void(const BadDocument&)> on_skipped;
};

struct TokenizeResult {
  TokenizeProgress totals;
  uint64_t targets = 0;    // tokens the mask marks 1 (pairs only)
  std::string token_file;  // PREFIX.bin or PREFIX.u32
  std::string mask_file;   // PREFIX.mask, or "" without pairs
  // Without pairs: PREFIX.mask when one was there (an earlier job's, for the token file this
  // one replaced) and was removed, so that no loss mask pairs with these tokens; else "".
  std::string removed_mask;
  bool llmc = false;  // token_file is llm.c's uint16 format
};

// The files a job with these options would write: the token file (PREFIX.bin or PREFIX.u32 for
// `vocab_size`) and, for pairs, PREFIX.mask.
std::vector<std::string> tokenize_outputs(const TokenizeOptions& options, uint64_t vocab_size);

// Runs the job. Throws InvalidArgument for bad options (no inputs, one key of a pair, pairs or
// doc_per_file with the wrong input format, an output that is an input or not a regular file,
// more tokens than an llm.c file can count, no token at all: an input with no document, or
// every document skipped), BadDocument for bad input (without skip_bad) or an
// oversized document, IoError for I/O failures (naming the file), Interrupted when `stop` was
// set. Nothing is left behind by a failure. One job at a time writes a prefix: the job holds
// PREFIX.lock (LockFile) to its end, and another job into the prefix meanwhile fails with
// PathBusy naming it; holding it, the job first removes the temporaries that jobs killed before
// it left beside the outputs ("<output>.tmp-<pid>[-<k>]").
TokenizeResult run_tokenize_job(const Tokenizer& tokenizer, const TokenizeOptions& options);

// The marker a job keeps beside its outputs while it puts the token file and the loss mask in
// place (two renames, or a rename and the stale mask's removal): token file "data/sft.bin" ->
// "data/sft.tokenize-commit". Written whole (renamed in) before the first change, held locked
// (flock) by its job, removed after the last. One left by a killed job says the pair may not
// belong together: `outcore train` refuses the token file while it is there, and the next job
// into the prefix replaces both files, removes the killed job's leftovers (found by the names a
// job makes and the pids the marker holds), and then the marker. A job that finds the marker
// locked (its job is committing now) refuses to start.
inline std::string tokenize_commit_marker(const std::string& token_path) {
  const size_t slash = token_path.rfind('/');
  const size_t dot = token_path.rfind('.');
  const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash + 1);
  return (has_ext ? token_path.substr(0, dot) : token_path) + ".tokenize-commit";
}

}  // namespace outcore::data
