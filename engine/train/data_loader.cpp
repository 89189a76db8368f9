#include "engine/train/data_loader.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>

#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "engine/model/model.hpp"

namespace outcore::train {
namespace {

uint64_t mix64(uint64_t z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A bijection of [0, n) keyed by (seed, epoch): a balanced Feistel network over the
// smallest even power of two >= n, with cycle walking back into [0, n).
class Permutation {
 public:
  Permutation(uint64_t n, uint64_t seed, uint64_t epoch) : n_(n) {
    unsigned bits = n <= 1 ? 2 : static_cast<unsigned>(std::bit_width(n - 1));
    half_ = (bits + 1) / 2;
    mask_ = (uint64_t{1} << half_) - 1;
    uint64_t k = mix64(seed ^ 0x6a09e667f3bcc909ULL) ^ mix64(epoch + 0x3c6ef372fe94f82bULL);
    for (auto& key : keys_) key = k = mix64(k + 0x9e3779b97f4a7c15ULL);
  }

  uint64_t operator()(uint64_t i) const {
    do i = encrypt(i);
    while (i >= n_);
    return i;
  }

 private:
  uint64_t encrypt(uint64_t x) const {
    uint64_t l = x >> half_, r = x & mask_;
    for (uint64_t key : keys_) {
      uint64_t t = l ^ (mix64(r ^ key) & mask_);
      l = r;
      r = t;
    }
    return (l << half_) | r;
  }

  uint64_t n_;
  unsigned half_;
  uint64_t mask_;
  uint64_t keys_[6];
};

}  // namespace

TokenSplit split_tokens(size_t n_tokens, double val_fraction) {
  if (!(val_fraction >= 0.0 && val_fraction < 1.0)) {
    throw InvalidArgument(fmt::format("validation fraction {} is outside [0, 1)", val_fraction));
  }
  auto val = static_cast<size_t>(std::floor(static_cast<double>(n_tokens) * val_fraction));
  return {{0, n_tokens - val}, {n_tokens - val, n_tokens}};
}

nlohmann::json to_json(const DataPosition& p) { return {{"epoch", p.epoch}, {"step", p.step}}; }

DataPosition data_position_from_json(const nlohmann::json& j) {
  auto field = [&](const char* name) {
    if (!j.is_object() || !j.contains(name) || !j[name].is_number_unsigned()) {
      throw InvalidArgument(
          fmt::format("data position: '{}' is missing or not a non-negative integer in {}", name,
                      json_brief(j)));
    }
    return j[name].get<uint64_t>();
  };
  return {field("epoch"), field("step")};
}

DataLoader::DataLoader(std::shared_ptr<const TokenFile> file, TokenRange range,
                       DataLoaderOptions options, std::string split_name,
                       std::shared_ptr<const MaskFile> mask)
    : file_(std::move(file)),
      range_(range),
      opts_(options),
      split_name_(std::move(split_name)),
      mask_(std::move(mask)) {
  if (!file_) throw InvalidArgument("DataLoader: no token file");
  const std::string& path = file_->path();
  if (opts_.micro_batch < 1 || opts_.seq_len < 1) {
    throw InvalidArgument(fmt::format("{}: micro-batch {} x sequence length {} must both be >= 1",
                                      path, opts_.micro_batch, opts_.seq_len));
  }
  if (opts_.world_size < 1 || opts_.rank < 0 || opts_.rank >= opts_.world_size) {
    throw InvalidArgument(
        fmt::format("{}: rank {} is outside a world of {}", path, opts_.rank, opts_.world_size));
  }
  if (range_.begin > range_.end || range_.end > file_->size()) {
    throw InvalidArgument(fmt::format("{}: {} split [{}, {}) runs past the file's {} tokens", path,
                                      split_name_, range_.begin, range_.end, file_->size()));
  }
  auto T = static_cast<uint64_t>(opts_.seq_len);
  auto per_step =
      static_cast<uint64_t>(opts_.micro_batch) * static_cast<uint64_t>(opts_.world_size);
  sequences_ = range_.size() > 0 ? (range_.size() - 1) / T : 0;
  batches_per_epoch_ = sequences_ / per_step;
  if (batches_per_epoch_ == 0) {
    throw InvalidArgument(fmt::format(
        "{}: the {} split has {} tokens, too few for one micro-batch: {} sequences x {} tokens "
        "x {} rank(s) need at least {} tokens",
        path, split_name_, range_.size(), opts_.micro_batch, opts_.seq_len, opts_.world_size,
        per_step * T + 1));
  }
  if (opts_.vocab_size > 0) file_->check_vocab(opts_.vocab_size, range_.begin, range_.end);
  if (mask_ != nullptr) {
    if (mask_->size() != file_->size()) {
      throw InvalidArgument(fmt::format("{}: the loss mask {} has {} bytes for {} tokens", path,
                                        mask_->path(), mask_->size(), file_->size()));
    }
    // The targets of the split's whole sequences: tokens [begin + 1, begin + 1 + sequences x T).
    // The split's first token and a tail shorter than a sequence are never targets.
    const size_t first = range_.begin + 1, last = first + static_cast<size_t>(sequences_ * T);
    const uint64_t ones = mask_->check(range_.begin, range_.end) -
                          mask_->check(range_.begin, first) - mask_->check(last, range_.end);
    split_targets_ = ones;
    if (ones == 0) {
      throw InvalidArgument(fmt::format(
          "{}: the loss mask {} marks no target of the {} split's {} sequences (tokens [{}, {})) "
          "as trained",
          path, mask_->path(), split_name_, sequences_, first, last));
    }
  }
}

DataPosition DataLoader::advanced(DataPosition pos, uint64_t n) const {
  const uint64_t at = pos.step + n;
  return {pos.epoch + at / batches_per_epoch_, at % batches_per_epoch_};
}

uint64_t DataLoader::trained_in_slots(uint64_t epoch, uint64_t first, uint64_t count) const {
  const auto T = static_cast<uint64_t>(opts_.seq_len);
  if (mask_ == nullptr) return count * T;
  Permutation perm(sequences_, opts_.seed, epoch);
  std::vector<uint8_t> bytes(T);
  uint64_t n = 0;
  for (uint64_t slot = first; slot < first + count; ++slot) {
    const uint64_t seq = opts_.shuffle ? perm(slot) : slot;
    mask_->read(range_.begin + static_cast<size_t>(seq * T) + 1, bytes);
    for (const uint8_t b : bytes) n += b != 0 ? 1 : 0;
  }
  return n;
}

uint64_t DataLoader::trained_targets(DataPosition pos) const {
  const auto B = static_cast<uint64_t>(opts_.micro_batch);
  return trained_in_slots(
      pos.epoch,
      (pos.step * static_cast<uint64_t>(opts_.world_size) + static_cast<uint64_t>(opts_.rank)) * B,
      B);
}

uint64_t DataLoader::trained_in_first(uint64_t micro_batches) const {
  return trained_in_slots(0, 0, micro_batches * static_cast<uint64_t>(opts_.micro_batch));
}

uint64_t DataLoader::trained_targets_all_ranks(DataPosition pos) const {
  const uint64_t per_step =
      static_cast<uint64_t>(opts_.micro_batch) * static_cast<uint64_t>(opts_.world_size);
  return trained_in_slots(pos.epoch, pos.step * per_step, per_step);
}

uint64_t DataLoader::sequence_at(DataPosition pos, int64_t b) const {
  uint64_t slot =
      (pos.step * static_cast<uint64_t>(opts_.world_size) + static_cast<uint64_t>(opts_.rank)) *
          static_cast<uint64_t>(opts_.micro_batch) +
      static_cast<uint64_t>(b);
  if (!opts_.shuffle) return slot;
  return Permutation(sequences_, opts_.seed, pos.epoch)(slot);
}

void DataLoader::next(std::span<int32_t> inputs, std::span<int32_t> targets) {
  size_t n = tokens_per_batch();
  if (inputs.size() != n || targets.size() != n) {
    throw InvalidArgument(fmt::format("DataLoader::next: inputs {} and targets {} must be B*T = {}",
                                      inputs.size(), targets.size(), n));
  }
  auto T = static_cast<size_t>(opts_.seq_len);
  Permutation perm(sequences_, opts_.seed, pos_.epoch);
  uint64_t first =
      (pos_.step * static_cast<uint64_t>(opts_.world_size) + static_cast<uint64_t>(opts_.rank)) *
      static_cast<uint64_t>(opts_.micro_batch);
  for (int64_t b = 0; b < opts_.micro_batch; ++b) {
    uint64_t slot = first + static_cast<uint64_t>(b);
    uint64_t seq = opts_.shuffle ? perm(slot) : slot;
    size_t start = range_.begin + static_cast<size_t>(seq) * T;
    // The sequence and its next token in one read: inputs [0, T), targets [1, T + 1).
    sequence_.resize(T + 1);
    file_->read(start, sequence_);
    // Checked at construction; a file changed in place since is named here, not by the model.
    if (opts_.vocab_size > 0)
      for (size_t i = 0; i <= T; ++i)
        if (static_cast<uint64_t>(static_cast<uint32_t>(sequence_[i])) >= opts_.vocab_size)
          throw CorruptData(fmt::format(
              "{}: token {} at position {} is outside the vocabulary [0, {}); the file changed "
              "while training read it",
              file_->path(), static_cast<uint32_t>(sequence_[i]), start + i, opts_.vocab_size));
    std::copy_n(sequence_.begin(), T, inputs.begin() + static_cast<ptrdiff_t>(b * T));
    std::span<int32_t> tg = targets.subspan(static_cast<size_t>(b) * T, T);
    std::copy_n(sequence_.begin() + 1, T, tg.begin());
    if (mask_ != nullptr) {
      mask_bytes_.resize(T);
      mask_->read(start + 1, mask_bytes_);
      for (size_t i = 0; i < T; ++i)
        if (mask_bytes_[i] == 0) tg[i] = model::kIgnoreTarget;
    }
  }
  if (++pos_.step == batches_per_epoch_) {
    pos_.step = 0;
    ++pos_.epoch;
  }
}

void DataLoader::seek(DataPosition pos) {
  if (pos.step >= batches_per_epoch_) {
    throw InvalidArgument(fmt::format(
        "{}: cannot seek the {} split to micro-batch {} of epoch {}, where the run resumed was: "
        "an epoch of this data has {} micro-batches. Resume on the data that run trained on, or "
        "start a new run on this data from the checkpoint's weights (`outcore export`, then "
        "--init-from)",
        file_->path(), split_name_, pos.step, pos.epoch, batches_per_epoch_));
  }
  pos_ = pos;
}

}  // namespace outcore::train
