// DataLoader: (inputs, targets) micro-batches of B x T tokens from a token file, in an order
// fixed by a seed, resumable from a recorded position, split into train and validation.
//
// Sequences: a split [begin, end) of the file is cut into windows of T+1 tokens with stride
// T (llm.c's layout): sequence s has inputs tokens[begin + s*T, begin + s*T + T) and targets
// the same window shifted by one. A split of L tokens holds (L-1)/T sequences; the tail that
// does not fill a window is never used.
//
// Order: each epoch visits a permutation of the sequences (the identity when shuffle is off)
// chosen by (seed, epoch) alone, so it is the same on every machine and every run. The
// permutation is a keyed bijection computed per index (no table), so a file of billions of
// tokens costs no memory. An epoch is floor(sequences / (B x world)) micro-batches; the
// sequences that do not fill a last micro-batch are skipped for that epoch (a different
// subset each epoch when shuffled).
//
// Data parallel: micro-batch k of an epoch takes permuted sequences
// [k*B*world, (k+1)*B*world); rank r takes the r-th group of B of them, so ranks never see
// the same sequence in a step and together cover what one rank with B*world would.
//
// Loss mask: with a MaskFile, a target whose token the mask marks 0 is written as
// model::kIgnoreTarget (-1); the model neither counts its loss nor back-propagates it.
//
// Threading: a DataLoader is used by one thread at a time; several loaders may share one
// TokenFile from different threads.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "engine/train/token_file.hpp"

namespace outcore::train {

// A half-open range of token positions in a file.
struct TokenRange {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
  bool operator==(const TokenRange&) const = default;
};

struct TokenSplit {
  TokenRange train;
  TokenRange val;  // empty when val_fraction is 0
};

// Splits a file of n_tokens into training tokens [0, n - v) and validation tokens [n - v, n)
// with v = floor(n_tokens * val_fraction): the validation set is the file's tail.
// Throws InvalidArgument unless 0 <= val_fraction < 1.
TokenSplit split_tokens(size_t n_tokens, double val_fraction);

struct DataLoaderOptions {
  int64_t micro_batch = 1;  // B, sequences per micro-batch per rank; >= 1
  int64_t seq_len = 0;      // T, tokens per sequence; >= 1
  uint64_t seed = 0;        // selects the order of every epoch
  bool shuffle = true;      // false: sequences in file order (validation)
  int rank = 0;             // this rank, in [0, world_size)
  int world_size = 1;       // data-parallel ranks, >= 1
  // The model's vocabulary: every token of the split is checked once at construction.
  // 0 skips the check.
  uint64_t vocab_size = 0;
};

// Where the loader is: the next micro-batch is number `step` of epoch `epoch`.
// Saved in checkpoints; restoring it with seek() on a loader built with the same file,
// split and options replays exactly the batches an uninterrupted run would have seen.
struct DataPosition {
  uint64_t epoch = 0;
  uint64_t step = 0;
  bool operator==(const DataPosition&) const = default;
};

// {"epoch": e, "step": s}. from_json throws InvalidArgument on a missing or mistyped field.
nlohmann::json to_json(const DataPosition& p);
DataPosition data_position_from_json(const nlohmann::json& j);

class DataLoader {
 public:
  // Reads `range` of `file`; `split_name` ("train", "val") appears in error messages; `mask`,
  // when given, is `file`'s loss mask. Throws InvalidArgument for bad options, a range past the
  // file's end, a split too short for one micro-batch (naming the file, the split, its tokens
  // and the tokens one micro-batch needs), or a mask that trains on no target of the split's
  // whole sequences; CorruptData for a token >= vocab_size (naming the file and the token's
  // position in it) or a mask byte other than 0 and 1.
  DataLoader(std::shared_ptr<const TokenFile> file, TokenRange range, DataLoaderOptions options,
             std::string split_name = "train", std::shared_ptr<const MaskFile> mask = nullptr);

  // Fills inputs and targets (each B*T tokens, row-major [B][T]) with the next micro-batch
  // of this rank and advances, wrapping into the next epoch after the last micro-batch.
  // Throws InvalidArgument when a span is not B*T long.
  void next(std::span<int32_t> inputs, std::span<int32_t> targets);

  // The position of the next micro-batch, always with step < batches_per_epoch().
  DataPosition position() const { return pos_; }
  // Moves to `pos`. Throws InvalidArgument when pos.step >= batches_per_epoch().
  void seek(DataPosition pos);
  // The position `n` micro-batches after `pos` (wrapping into later epochs as next() does).
  DataPosition advanced(DataPosition pos, uint64_t n = 1) const;

  // Targets trained on (not masked) in the micro-batch at `pos`: of this rank, or of every
  // rank together (what the step's loss is a mean over). B*T (x world) without a mask.
  uint64_t trained_targets(DataPosition pos) const;
  uint64_t trained_targets_all_ranks(DataPosition pos) const;
  // Trained targets of the first `micro_batches` micro-batches of the first epoch's order (of
  // every rank in turn, for a loader of several).
  uint64_t trained_in_first(uint64_t micro_batches) const;
  bool has_mask() const { return mask_ != nullptr; }
  // The loss mask, or nullptr; and how many targets of the split's whole sequences it marks as
  // trained (sequences() x T targets in all).
  const MaskFile* mask() const { return mask_.get(); }
  uint64_t targets_in_split() const { return split_targets_; }

  // Index (within the split) of the sequence that slot b of this rank's micro-batch at `pos`
  // reads. REQUIRES b < B.
  uint64_t sequence_at(DataPosition pos, int64_t b) const;

  size_t tokens_per_batch() const { return static_cast<size_t>(opts_.micro_batch * opts_.seq_len); }
  uint64_t sequences() const { return sequences_; }
  uint64_t batches_per_epoch() const { return batches_per_epoch_; }
  const DataLoaderOptions& options() const { return opts_; }
  TokenRange range() const { return range_; }
  const TokenFile& file() const { return *file_; }

 private:
  // Trained targets of slots [first, first + count) of epoch `epoch`'s order.
  uint64_t trained_in_slots(uint64_t epoch, uint64_t first, uint64_t count) const;

  std::shared_ptr<const TokenFile> file_;
  TokenRange range_;
  DataLoaderOptions opts_;
  std::string split_name_;
  std::shared_ptr<const MaskFile> mask_;
  std::vector<int32_t> sequence_;    // next()'s: one sequence and the token after it
  std::vector<uint8_t> mask_bytes_;  // next()'s: one sequence's mask
  uint64_t split_targets_ = 0;
  uint64_t sequences_ = 0;
  uint64_t batches_per_epoch_ = 0;
  DataPosition pos_;
};

}  // namespace outcore::train
