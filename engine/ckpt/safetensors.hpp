// engine/ckpt: the safetensors file format (Hugging Face weights), read and written.
//
// A file is an 8-byte little-endian header length N, N bytes of JSON header, then the data
// section. The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin,
// end]} (offsets relative to the data section) and may hold "__metadata__", a map of strings.
// Only the dtypes outcore computes with are accepted: F32, BF16 and F16.
//
//   SafetensorsFile f = SafetensorsFile::open("model.safetensors");
//   const SafetensorsEntry* e = f.find("model.norm.weight");
//   f.read(*e, 0, e->bytes, buffer);
//
//   SafetensorsWriter w("out.safetensors", {{"a", DType::F32, {2, 3}}}, {{"format", "pt"}});
//   w.append(bytes_of_a);          // in declared order, in as many pieces as convenient
//   w.close();                     // fsync, then out.safetensors.tmp -> out.safetensors
//
// Errors: a header that is malformed or inconsistent (bad length, not JSON, not an object, a key
// twice in one JSON object, such as a tensor listed twice, a missing or mistyped field, a
// negative dimension, offsets that disagree with the shape, point past the end of the file,
// overlap another tensor or leave bytes between tensors) is
// CorruptData naming the file and the tensor (or duplicate key); a dtype other than F32/BF16/F16 is
// InvalidArgument naming the file, tensor and dtype. I/O failures are IoError naming the file,
// offset, length and errno. Misuse (reading outside a tensor, appending more bytes than declared)
// is InvalidArgument.
//
// Threading: a SafetensorsFile is immutable after open(); read() may be called from several
// threads at once (each opens the file for itself). A SafetensorsWriter is used by one thread at a
// time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "aio/aio.hpp"
#include "common/dtype.hpp"

namespace outcore::ckpt {

// Headers larger than this are refused as corrupt (real ones are a few hundred KiB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;

// Parses JSON `text`, refusing any object that holds a key twice (a plain parse keeps the last
// value silently). CorruptData "`where`: not valid JSON: ..." for a syntax error, or naming
// `where`, the duplicate key and the key of the object holding it.
nlohmann::json parse_json_unique_keys(std::string_view text, const std::string& where);

// The elements of `shape` (1 for a scalar, shape []).
uint64_t shape_numel(std::span<const int64_t> shape);
// "[4096, 11008]".
std::string format_shape(std::span<const int64_t> shape);

// One tensor of an open file.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t offset = 0;  // first byte in the file (8 + N + data_offsets[0])
  uint64_t bytes = 0;   // numel * dtype_size
  uint64_t numel() const { return bytes / dtype_size(dtype); }
};

// A safetensors file opened for reading, its header parsed and validated. Move-only.
class SafetensorsFile {
 public:
  // Opens and validates `path` (see the file comment for every check). Nothing about the data
  // is trusted before every entry has passed. Throws IoError if it cannot be opened or read,
  // CorruptData / InvalidArgument as described above.
  static SafetensorsFile open(const std::filesystem::path& path);

  const std::string& path() const { return path_; }
  // Every tensor, in the order of their data (data_offsets).
  const std::vector<SafetensorsEntry>& tensors() const { return tensors_; }
  // The tensor named `name`, or nullptr.
  const SafetensorsEntry* find(std::string_view name) const;
  // "__metadata__" (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Bytes of the 8-byte length plus the JSON header: where the data section starts.
  uint64_t data_start() const { return data_start_; }

  // Copies bytes [byte_begin, byte_begin + byte_count) of tensor `t` (an entry of this file)
  // into `out`, opening the file for this read alone (no descriptor is held between reads).
  // InvalidArgument when the range leaves the tensor; CorruptData when the path names another
  // file than the one validated (another inode or size); IoError when it cannot be opened (it
  // was removed) or a read fails or comes up short.
  void read(const SafetensorsEntry& t, uint64_t byte_begin, uint64_t byte_count, void* out) const;
  // The same by name; InvalidArgument naming the file when there is no such tensor.
  void read(std::string_view name, uint64_t byte_begin, uint64_t byte_count, void* out) const;

  // The file open for a run of reads (one open and one check for all of them, as read() makes
  // for each): CorruptData / IoError on construction as read() throws them. Move-less; lives
  // on one thread.
  class Reader {
   public:
    explicit Reader(const SafetensorsFile& file);
    ~Reader();
    Reader(const Reader&) = delete;
    Reader& operator=(const Reader&) = delete;
    // As SafetensorsFile::read, through this descriptor.
    void read(const SafetensorsEntry& t, uint64_t byte_begin, uint64_t byte_count, void* out) const;

   private:
    const SafetensorsFile* file_;
    int fd_;
  };

 private:
  SafetensorsFile() = default;

  std::string path_;
  uint64_t device_ = 0, inode_ = 0, size_ = 0;  // the file validated, checked again on each read
  std::vector<SafetensorsEntry> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_start_ = 0;
};

// A tensor to be written: name, dtype and shape; its data follows in declaration order.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
};

// Writes one safetensors file as a stream: the header first (from the full list of tensors),
// then each tensor's bytes in declared order. The file is built as `<path>.tmp` and renamed to
// `path` by close(), so `path` never holds a partial file. Move-only.
class SafetensorsWriter {
 public:
  // Creates (truncates) `<path>.tmp` and writes the header: `__metadata__` first when
  // `metadata` is not empty, then the tensors in order with contiguous offsets, the JSON
  // padded with spaces so the data section starts at a multiple of 8 bytes.
  // InvalidArgument for a duplicate or empty name, a name "__metadata__", or a negative
  // dimension; IoError when the file cannot be created or written.
  SafetensorsWriter(std::filesystem::path path, std::vector<SafetensorsTensor> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  // Removes `<path>.tmp` unless close() succeeded.
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Writes the next bytes of the data section (tensor boundaries need not coincide with
  // pieces). InvalidArgument when they go past the declared total; IoError (ENOSPC, EIO...)
  // naming the file when the write fails.
  void append(std::span<const std::byte> bytes);
  // Checks every declared byte was appended (InvalidArgument otherwise), fsyncs, closes and
  // renames `<path>.tmp` to `path`, then fsyncs the directory. IoError on any failure. After a
  // failure `path` is untouched and the temporary file goes when the writer is destroyed.
  void close();

  const std::filesystem::path& path() const { return path_; }
  uint64_t data_bytes() const { return data_bytes_; }        // declared data section size
  uint64_t written_bytes() const { return written_bytes_; }  // appended so far

 private:
  std::filesystem::path path_, tmp_path_;
  aio::File file_;
  uint64_t header_bytes_ = 0;  // 8 + padded JSON
  uint64_t data_bytes_ = 0;
  uint64_t written_bytes_ = 0;
  bool committed_ = false;
};

}  // namespace outcore::ckpt
