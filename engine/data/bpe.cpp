#include "engine/data/bpe.hpp"

#include <algorithm>
#include <array>

#include "engine/data/utf8.hpp"

namespace outcore::data {
namespace {

struct ByteLevelTables {
  std::array<char32_t, 256> to_char{};
  std::array<int16_t, 512> to_byte{};
  ByteLevelTables() {
    to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      to_char[b] = printable ? static_cast<char32_t>(b) : next++;
      to_byte[to_char[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelTables& byte_level_tables() {
  static const ByteLevelTables t;
  return t;
}

uint64_t pair_key(uint32_t left, uint32_t right) {
  return (static_cast<uint64_t>(left) << 32) | right;
}

size_t pair_slot(uint64_t pair, size_t mask) {
  return static_cast<size_t>((pair * 0x9E3779B97F4A7C15ull) >> 17) & mask;
}

// Heap order: the lowest rank first, then the leftmost position (tokenizers' Merge order).
bool later(const BpeScratch::Candidate& a, const BpeScratch::Candidate& b) {
  return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
}

}  // namespace

char32_t byte_level_char(uint8_t b) { return byte_level_tables().to_char[b]; }

int byte_of_byte_level_char(char32_t c) { return c < 512 ? byte_level_tables().to_byte[c] : -1; }

std::optional<std::string> byte_level_decode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const int b = byte_of_byte_level_char(decode_utf8_at(text, i));
    if (b < 0) return std::nullopt;
    out += static_cast<char>(b);
    i += utf8_char_length(static_cast<unsigned char>(text[i]));
  }
  return out;
}

std::optional<std::string> BpeModel::key_of(std::string_view text) const {
  if (options_.byte_level) return byte_level_decode(text);
  return std::string(text);
}

bool BpeModel::add_token(std::string_view text, uint32_t id) {
  max_id_ = std::max(max_id_, id);
  const std::optional<std::string> key = key_of(text);
  if (!key) {
    unreachable_.insert(text, id);
    return false;
  }
  vocab_.insert(*key, id);
  if (options_.byte_level && key->size() == 1) byte_ids_[static_cast<uint8_t>((*key)[0])] = id;
  return true;
}

std::string BpeModel::add_merge(std::string_view left, std::string_view right, uint32_t rank) {
  const std::string joined = std::string(left) + std::string(right);
  const uint32_t* ids[3] = {};
  const std::string_view texts[3] = {left, right, joined};
  for (int k = 0; k < 3; ++k) {
    const std::optional<std::string> key = key_of(texts[k]);
    ids[k] = key ? vocab_.find(*key) : nullptr;
    if (ids[k] != nullptr) continue;
    if (unreachable_.find(texts[k]) != nullptr) return "";  // can never apply
    return "token \"" + std::string(texts[k]) + "\" is not in model.vocab";
  }
  insert_merge(pair_key(*ids[0], *ids[1]), rank, *ids[2]);
  return "";
}

void BpeModel::insert_merge(uint64_t pair, uint32_t rank, uint32_t new_id) {
  if ((merge_count_ + 1) * 2 > merges_.size()) {
    std::vector<MergeSlot> old = std::move(merges_);
    merges_.assign(old.size() * 2, MergeSlot{});
    merge_count_ = 0;
    for (const MergeSlot& s : old)
      if (s.pair != kEmptyPair) insert_merge(s.pair, s.rank, s.new_id);
  }
  const size_t mask = merges_.size() - 1;
  size_t i = pair_slot(pair, mask);
  while (merges_[i].pair != kEmptyPair && merges_[i].pair != pair) i = (i + 1) & mask;
  if (merges_[i].pair == kEmptyPair) ++merge_count_;
  merges_[i] = MergeSlot{pair, rank, new_id};
}

const BpeModel::MergeSlot* BpeModel::find_merge(uint32_t left, uint32_t right) const {
  const uint64_t pair = pair_key(left, right);
  const size_t mask = merges_.size() - 1;
  for (size_t i = pair_slot(pair, mask);; i = (i + 1) & mask) {
    if (merges_[i].pair == pair) return &merges_[i];
    if (merges_[i].pair == kEmptyPair) return nullptr;
  }
}

std::optional<uint32_t> BpeModel::token_id(std::string_view text) const {
  const std::optional<std::string> key = key_of(text);
  const uint32_t* id = key ? vocab_.find(*key) : unreachable_.find(text);
  if (id == nullptr) return std::nullopt;
  return *id;
}

std::vector<uint8_t> BpeModel::bytes_without_token() const {
  std::vector<uint8_t> out;
  if (!options_.byte_level) return out;
  for (int b = 0; b < 256; ++b)
    if (byte_ids_[b] < 0) out.push_back(static_cast<uint8_t>(b));
  return out;
}

void BpeModel::split_symbols(std::string_view word, BpeScratch& scratch) const {
  auto& syms = scratch.symbols;
  syms.clear();
  bool pending_unk = false;  // an unk symbol not yet pushed (fuse_unk gathers a run)
  auto push = [&syms](uint32_t id) {
    const auto n = static_cast<int32_t>(syms.size());
    syms.push_back({id, n - 1, n + 1});
  };
  for (size_t i = 0; i < word.size();) {
    const size_t len =
        options_.byte_level ? 1 : utf8_char_length(static_cast<unsigned char>(word[i]));
    uint32_t id = 0;
    bool known;
    if (options_.byte_level) {
      const int64_t b = byte_ids_[static_cast<uint8_t>(word[i])];
      known = b >= 0;
      id = static_cast<uint32_t>(b);
    } else {
      const uint32_t* found = vocab_.find(word.substr(i, len));
      known = found != nullptr;
      if (known) id = *found;
    }
    i += len;
    if (known) {
      if (pending_unk) push(*options_.unk_id);
      pending_unk = false;
      push(id);
    } else if (options_.unk_id) {
      if (pending_unk && !options_.fuse_unk) push(*options_.unk_id);
      pending_unk = true;
    }
  }
  if (pending_unk) push(*options_.unk_id);
  if (!syms.empty()) syms.back().next = -1;
}

void BpeModel::merge_symbols(BpeScratch& scratch) const {
  auto& syms = scratch.symbols;
  auto& heap = scratch.heap;
  heap.clear();
  auto consider = [&](int32_t pos) {
    const int32_t next = syms[pos].next;
    if (next < 0) return;
    const MergeSlot* m = find_merge(syms[pos].id, syms[next].id);
    if (m == nullptr) return;
    heap.push_back({m->rank, static_cast<uint32_t>(pos), m->new_id});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (size_t i = 0; i + 1 < syms.size(); ++i) consider(static_cast<int32_t>(i));
  constexpr uint32_t kGone = UINT32_MAX;
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const BpeScratch::Candidate top = heap.back();
    heap.pop_back();
    BpeScratch::Symbol& s = syms[top.pos];
    if (s.id == kGone || s.next < 0) continue;
    const int32_t right = s.next;
    const MergeSlot* m = find_merge(s.id, syms[right].id);
    if (m == nullptr || m->new_id != top.new_id) continue;  // stale: a neighbour changed
    s.id = top.new_id;
    s.next = syms[right].next;
    if (s.next >= 0) syms[s.next].prev = static_cast<int32_t>(top.pos);
    syms[right].id = kGone;
    if (s.prev >= 0) consider(s.prev);
    consider(static_cast<int32_t>(top.pos));
  }
}

void BpeModel::encode_word(std::string_view word, BpeScratch& scratch,
                           std::vector<uint32_t>& out) const {
  if (options_.ignore_merges) {
    if (const uint32_t* id = vocab_.find(word)) {
      out.push_back(*id);
      return;
    }
  }
  split_symbols(word, scratch);
  if (scratch.symbols.size() > 1) merge_symbols(scratch);
  for (const BpeScratch::Symbol& s : scratch.symbols)
    if (s.id != UINT32_MAX) out.push_back(s.id);
}

}  // namespace outcore::data
