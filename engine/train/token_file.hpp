// Token files: a read-only view of a stream of token ids, read with pread as it is needed.
//
// Formats:
// - llm.c (.bin): a header of 256 little-endian int32 ([0] magic 20240520, [1] version 1,
//   [2] token count), then the tokens as uint16. The file size must be exactly
//   1024 + 2 x count bytes.
// - raw uint16 (.u16, .uint16) and raw uint32 (.u32, .uint32): nothing but tokens; the size
//   must be a multiple of the token width.
// The format is taken from the extension unless given explicitly; a .bin file that is not
// llm.c's (a raw uint16 dump, say) needs TokenFormat::kRawU16 spelled out.
//
// Loss masks (.mask, what `outcore tokenize` writes for prompt/completion data): one byte per
// token of the token file it belongs to, 1 where that token is a training target (the loss
// counts the model's prediction of it), 0 where it is not (a prompt). Nothing else: the size is
// the token count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/unique_fd.hpp"

namespace outcore::train {

enum class TokenFormat { kAuto, kLlmc, kRawU16, kRawU32 };

inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int32_t kLlmcVersion = 1;
inline constexpr size_t kLlmcHeaderInts = 256;
inline constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);

// "auto", "llmc", "u16", "u32" (the names parse_token_format accepts).
std::string_view to_string(TokenFormat f);
// Parses "auto", "llmc" (or "bin"), "u16" (or "uint16"), "u32" (or "uint32").
// Throws InvalidArgument listing the accepted names.
TokenFormat parse_token_format(std::string_view name);

// An open token file. Move-only; the file stays open as long as the object. All const
// members are safe to call from many threads at once.
class TokenFile {
 public:
  // Opens `path` (read with pread, never mapped: a file shortened meanwhile is a named read
  // error, not a SIGBUS), validating its header and size.
  // Throws IoError (cannot open / stat, naming the path and errno), CorruptData (bad
  // magic or version, a count that disagrees with the file size, a size that is not a whole
  // number of tokens; naming the path and the numbers), InvalidArgument (kAuto with an
  // unknown extension).
  static TokenFile open(const std::string& path, TokenFormat format = TokenFormat::kAuto);

  TokenFile(TokenFile&&) noexcept;
  TokenFile& operator=(TokenFile&&) noexcept;
  ~TokenFile();

  const std::string& path() const { return path_; }
  TokenFormat format() const { return format_; }
  // Number of tokens.
  size_t size() const { return count_; }
  // Token i. REQUIRES i < size().
  uint32_t operator[](size_t i) const;
  // Copies tokens [begin, begin + out.size()) into `out`.
  // Throws InvalidArgument when the range runs past size(); CorruptData naming the path when the
  // file ends before it (shortened since it was opened), IoError when the read fails. The same
  // for every member that reads.
  void read(size_t begin, std::span<int32_t> out) const;

  // Checks that every token in [begin, end) is < vocab_size, reading each once.
  // Throws CorruptData naming the path, the first offending position (counted from the
  // first token of the file) and its value; InvalidArgument when the range runs past size().
  void check_vocab(uint64_t vocab_size, size_t begin, size_t end) const;
  void check_vocab(uint64_t vocab_size) const { check_vocab(vocab_size, 0, count_); }
  // Largest token id in the file (0 for an empty file); scans the whole file.
  uint32_t max_token() const;

 private:
  TokenFile() = default;
  // Reads tokens [begin, begin + n) as stored (width_ bytes each) into `dst`.
  void read_raw(size_t begin, size_t n, void* dst) const;
  UniqueFd file_;  // read with pread, never mapped (see open)
  std::string path_;
  TokenFormat format_ = TokenFormat::kAuto;
  uint64_t first_byte_ = 0;  // of the first token (after llm.c's header)
  size_t count_ = 0;
  size_t width_ = 2;
};

// An open loss mask. Move-only, like TokenFile; const members are safe from many threads.
class MaskFile {
 public:
  // Opens `path` as the mask of `tokens` (read as TokenFile is). Throws IoError (cannot open /
  // stat),
  // CorruptData (a size other than tokens.size() bytes, naming both files and both counts).
  static MaskFile open(const std::string& path, const TokenFile& tokens);

  MaskFile(MaskFile&&) noexcept;
  MaskFile& operator=(MaskFile&&) noexcept;
  ~MaskFile();

  const std::string& path() const { return path_; }
  size_t size() const { return count_; }
  // Whether token i is a training target. REQUIRES i < size().
  bool operator[](size_t i) const;
  // Copies the bytes of tokens [begin, begin + out.size()) into `out`, each 0 or 1: a file
  // changed since check() (another value written in place) throws CorruptData naming the path,
  // the position and the value. Throws InvalidArgument when the range runs past size().
  void read(size_t begin, std::span<uint8_t> out) const;
  // Checks that every byte in [begin, end) is 0 or 1 and returns how many are 1. Throws
  // CorruptData naming the path, the first bad position and its value; InvalidArgument when
  // the range runs past size().
  uint64_t check(size_t begin, size_t end) const;

 private:
  MaskFile() = default;
  UniqueFd file_;  // read with pread, never mapped (see open)
  std::string path_;
  size_t count_ = 0;
};

// The mask that belongs beside a token file: the token file's path with its extension replaced
// by ".mask" ("data/sft.u32" -> "data/sft.mask").
std::string mask_path_beside(const std::string& token_path);

// Writes `tokens` as an llm.c .bin file: written to "<path>.tmp", fsynced, then renamed over
// `path`, so a reader never sees a partial file. Throws IoError naming the path on any
// failure (the temporary is removed).
void write_llmc_tokens(const std::string& path, std::span<const uint16_t> tokens);

}  // namespace outcore::train
