// Internal to engine/ckpt: small durable file operations (every failure is an IoError naming
// the path), and the 4 KiB alignment of data files' segments and O_DIRECT transfers.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "common/aligned_buffer.hpp"
#include "common/open_file.hpp"

namespace outcore::ckpt {

inline constexpr uint64_t kAlign = kIoAlignment;
inline uint64_t align_down(uint64_t n) { return n / kAlign * kAlign; }
inline uint64_t align_up(uint64_t n) { return outcore::align_up(n, kAlign); }
inline bool aligned(uint64_t n) { return n % kAlign == 0; }

// First bytes of every checkpoint data file ("OCCKPT", format generation 1).
inline constexpr char kDataFileMagic[8] = {'O', 'C', 'C', 'K', 'P', 'T', '\0', '\1'};
// The rest of a data file's 4 KiB header, zero elsewhere: the format version (uint32) and the
// rank (int32), then the kind ("model", "optimizer") and the checkpoint's tag, each cut to its
// field and zero-padded.
inline constexpr size_t kHeaderVersionAt = 8, kHeaderRankAt = 12;
inline constexpr size_t kHeaderKindAt = 16, kHeaderKindMax = 15;
inline constexpr size_t kHeaderTagAt = 32, kHeaderTagMax = 95;

// Writes `data` to `path`, a file it creates (IoError EEXIST when anything is there, a symbolic
// link included: nothing is written through one), and fsyncs it; on failure the partial file
// is removed.
void write_file_durably(const std::filesystem::path& path, std::string_view data);
// rename(2) from -> to, then fsyncs `dir` (the directory holding `to`).
void rename_durably(const std::filesystem::path& from, const std::filesystem::path& to,
                    const std::filesystem::path& dir);
// Swaps the entries `a` and `b` (both present) in one step (renameat2's RENAME_EXCHANGE): true
// (the caller fsyncs their directory). False, with nothing changed, where the filesystem cannot
// (then two renames are the caller's way). Throws IoError on any other failure.
bool exchange_entries(const std::filesystem::path& a, const std::filesystem::path& b);
// A whole small file (at most `limit` bytes; CorruptData beyond, and "<path>: missing" when
// there is none).
std::string read_small_file(const std::filesystem::path& path, size_t limit);
// The same from `fd`, a file opened for reading (read from its start; `path` names it in errors).
std::string read_small_fd(int fd, const std::filesystem::path& path, size_t limit);
// The tag a `latest` file names (one line, a plain directory name; CorruptData otherwise).
std::string read_latest_tag(const std::filesystem::path& latest);

}  // namespace outcore::ckpt
