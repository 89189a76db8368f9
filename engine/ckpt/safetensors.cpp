// safetensors: header parsing and validation, ranged reads, the streaming writer.
#include "engine/ckpt/safetensors.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "common/open_file.hpp"
#include "engine/ckpt/file_util.hpp"

namespace outcore::ckpt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Reads exactly `count` bytes at `offset`, resuming short reads.
void pread_exact(int fd, const std::string& path, uint64_t offset, uint64_t count, void* out) {
  auto* p = static_cast<char*>(out);
  uint64_t done = 0;
  while (done < count) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(count - done, 1u << 30));
    const ssize_t n = ::pread(fd, p + done, want, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(path, offset + done, count - done, errno, "read");
    if (n == 0) throw IoError(path, offset + done, count - done, EIO, "read (end of file)");
    done += static_cast<uint64_t>(n);
  }
}

// Writes exactly `bytes` at `offset`, resuming short writes.
void pwrite_exact(int fd, const std::string& path, uint64_t offset,
                  std::span<const std::byte> bytes) {
  uint64_t done = 0;
  while (done < bytes.size()) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(bytes.size() - done, 1u << 30));
    const ssize_t n = ::pwrite(fd, bytes.data() + done, want, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw IoError(path, offset + done, bytes.size() - done, n < 0 ? errno : EIO, "write");
    done += static_cast<uint64_t>(n);
  }
}

std::string tensor_where(const std::string& path, std::string_view name) {
  return fmt::format("{}: tensor \"{}\"", path, name);
}

DType parse_dtype(const std::string& where, const json& v) {
  const auto it = v.find("dtype");
  if (it == v.end() || !it->is_string()) throw CorruptData(where + ": \"dtype\" is not a string");
  const std::string& s = it->get_ref<const std::string&>();
  for (DType t : {DType::F32, DType::BF16, DType::F16})
    if (s == dtype_safetensors_name(t)) return t;
  throw InvalidArgument(
      fmt::format("{}: dtype {} is not supported (allowed: F32, BF16, F16)", where, s));
}

// A non-negative integer that fits `limit`, or nullopt.
std::optional<uint64_t> as_count(const json& v, uint64_t limit) {
  if (!v.is_number_unsigned()) return std::nullopt;
  const uint64_t u = v.get<uint64_t>();
  return u <= limit ? std::optional<uint64_t>(u) : std::nullopt;
}

std::vector<int64_t> parse_shape(const std::string& where, const json& v) {
  const auto it = v.find("shape");
  if (it == v.end() || !it->is_array()) throw CorruptData(where + ": \"shape\" is not an array");
  std::vector<int64_t> shape;
  for (const json& d : *it) {
    const auto n = as_count(d, static_cast<uint64_t>(INT64_MAX));
    if (!n)
      throw CorruptData(fmt::format("{}: shape {} holds {}, not a non-negative integer", where,
                                    json_brief(*it), json_brief(d)));
    shape.push_back(static_cast<int64_t>(*n));
  }
  return shape;
}

// Bytes of a tensor of `shape` and `dtype`; CorruptData when the product overflows.
uint64_t checked_bytes(const std::string& where, std::span<const int64_t> shape, DType dtype) {
  for (int64_t d : shape)
    if (d == 0) return 0;  // no element, whatever the other dimensions
  uint64_t n = dtype_size(dtype);
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n))
      throw CorruptData(fmt::format("{}: shape {} overflows 64 bits", where, format_shape(shape)));
  return n;
}

SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const json& v,
                             uint64_t data_start, uint64_t data_size) {
  const std::string where = tensor_where(path, name);
  if (!v.is_object()) throw CorruptData(where + ": entry is not a JSON object");
  SafetensorsEntry e{.name = name, .dtype = parse_dtype(where, v), .shape = parse_shape(where, v)};
  const auto it = v.find("data_offsets");
  std::optional<uint64_t> begin, end;
  if (it != v.end() && it->is_array() && it->size() == 2) {
    begin = as_count((*it)[0], UINT64_MAX);
    end = as_count((*it)[1], UINT64_MAX);
  }
  if (!begin || !end)
    throw CorruptData(where + ": \"data_offsets\" is not [begin, end] of non-negative integers");
  if (*begin > *end)
    throw CorruptData(
        fmt::format("{}: data_offsets [{}, {}] end before they begin", where, *begin, *end));
  e.bytes = checked_bytes(where, e.shape, e.dtype);
  if (*end - *begin != e.bytes)
    throw CorruptData(fmt::format("{}: data_offsets [{}, {}] hold {} bytes but {} {} needs {}",
                                  where, *begin, *end, *end - *begin,
                                  dtype_safetensors_name(e.dtype), format_shape(e.shape), e.bytes));
  if (*end > data_size)
    throw CorruptData(fmt::format(
        "{}: data_offsets [{}, {}] end past the data section of {} bytes (file truncated?)", where,
        *begin, *end, data_size));
  e.offset = data_start + *begin;
  return e;
}

std::map<std::string, std::string> parse_metadata(const std::string& path, const json& v) {
  if (!v.is_object()) throw CorruptData(path + ": \"__metadata__\" is not a JSON object");
  std::map<std::string, std::string> m;
  for (const auto& [k, s] : v.items()) {
    if (!s.is_string())
      throw CorruptData(fmt::format("{}: \"__metadata__\" key \"{}\" is not a string", path, k));
    m[k] = s.get<std::string>();
  }
  return m;
}

// Sorts by position and refuses tensors that are not contiguous from the data section's start,
// as the safetensors library does: two sharing a byte, or bytes between two (or before the
// first) that belong to none.
void check_contiguous(const std::string& path, std::vector<SafetensorsEntry>& ts,
                      uint64_t data_start) {
  std::sort(ts.begin(), ts.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.bytes < b.bytes;
  });
  uint64_t at = data_start;
  const SafetensorsEntry* last = nullptr;
  for (const SafetensorsEntry& e : ts) {
    if (e.offset < at)
      throw CorruptData(
          fmt::format("{}: tensor \"{}\" overlaps tensor \"{}\"", path, e.name, last->name));
    if (e.offset > at)
      throw CorruptData(fmt::format(
          "{}: tensor \"{}\" starts {} bytes after {} (data_offsets must be contiguous)", path,
          e.name, e.offset - at,
          last == nullptr ? std::string("the data section's start")
                          : fmt::format("the end of tensor \"{}\"", last->name)));
    at = e.offset + e.bytes;
    last = &e;
  }
}

uint64_t read_le64(const unsigned char* b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

}  // namespace

uint64_t shape_numel(std::span<const int64_t> shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::string format_shape(std::span<const int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

json parse_json_unique_keys(std::string_view text, const std::string& where) {
  const auto repeated = [&](const std::string& key, const std::string& object) {
    throw CorruptData(
        fmt::format("{}: key \"{}\" appears twice in {}", where, key,
                    object.empty() ? std::string("one object") : fmt::format("\"{}\"", object)));
  };
  return parse_json_file(text, where, {.max_depth = kMaxJsonFileDepth, .on_repeated_key = repeated},
                         [](const std::string& why) { throw CorruptData(why); });
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile SafetensorsFile::open(const fs::path& path) {
  SafetensorsFile f;
  // Open while it is validated only: read() opens it again for each read, so a model of any
  // number of shards holds no descriptors between reads.
  const aio::File file = aio::File::open(path, {.access = aio::Access::kRead, .direct = false});
  f.path_ = file.path();
  const std::string& p = f.path_;
  const uint64_t size = file.size();
  struct stat st {};
  if (::fstat(file.fd(), &st) != 0) throw IoError(p, errno, "stat");
  f.device_ = st.st_dev;
  f.inode_ = st.st_ino;
  f.size_ = size;
  if (size < 8)
    throw CorruptData(fmt::format("{}: {} bytes, shorter than the 8-byte header length", p, size));
  unsigned char len[8];
  pread_exact(file.fd(), p, 0, 8, len);
  const uint64_t n = read_le64(len);
  if (n > kMaxSafetensorsHeaderBytes)
    throw CorruptData(fmt::format("{}: header length {} exceeds the limit of {} bytes", p, n,
                                  kMaxSafetensorsHeaderBytes));
  if (n > size - 8)
    throw CorruptData(
        fmt::format("{}: header length {} exceeds the {} bytes after it (file "
                    "truncated?)",
                    p, n, size - 8));
  std::string text(n, '\0');
  pread_exact(file.fd(), p, 8, n, text.data());
  const json header = parse_json_unique_keys(text, p + ": header");
  if (!header.is_object()) throw CorruptData(p + ": header is not a JSON object");
  f.data_start_ = 8 + n;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      f.metadata_ = parse_metadata(p, v);
    } else {
      f.tensors_.push_back(parse_entry(p, name, v, f.data_start_, size - f.data_start_));
    }
  }
  check_contiguous(p, f.tensors_, f.data_start_);
  // As the safetensors library reads them: the tensors' data fill the data section exactly, so
  // bytes past the last tensor (a file damaged, or not safetensors) are refused.
  uint64_t end = f.data_start_;
  for (const SafetensorsEntry& e : f.tensors_) end = std::max(end, e.offset + e.bytes);
  if (end != size)
    throw CorruptData(
        fmt::format("{}: {} bytes after the last tensor's data (a safetensors file ends with it)",
                    p, size - end));
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.by_name_.emplace(f.tensors_[i].name, i);
  return f;
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

SafetensorsFile::Reader::Reader(const SafetensorsFile& file)
    : file_(&file), fd_(open_for_reading(file.path_, "safetensors file")) {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    throw IoError(file.path_, err, "stat");
  }
  if (st.st_dev != file.device_ || st.st_ino != file.inode_ ||
      static_cast<uint64_t>(st.st_size) != file.size_) {
    ::close(fd_);
    throw CorruptData(fmt::format("{}: replaced or resized since it was validated", file.path_));
  }
}

SafetensorsFile::Reader::~Reader() { ::close(fd_); }

void SafetensorsFile::Reader::read(const SafetensorsEntry& t, uint64_t byte_begin,
                                   uint64_t byte_count, void* out) const {
  if (byte_begin > t.bytes || byte_count > t.bytes - byte_begin)
    throw InvalidArgument(fmt::format("{}: read of bytes [{}, +{}) outside its {} bytes",
                                      tensor_where(file_->path_, t.name), byte_begin, byte_count,
                                      t.bytes));
  pread_exact(fd_, file_->path_, t.offset + byte_begin, byte_count, out);
}

void SafetensorsFile::read(const SafetensorsEntry& t, uint64_t byte_begin, uint64_t byte_count,
                           void* out) const {
  Reader(*this).read(t, byte_begin, byte_count, out);
}

void SafetensorsFile::read(std::string_view name, uint64_t byte_begin, uint64_t byte_count,
                           void* out) const {
  const SafetensorsEntry* t = find(name);
  if (t == nullptr) throw InvalidArgument(tensor_where(path(), name) + ": no such tensor");
  read(*t, byte_begin, byte_count, out);
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter

SafetensorsWriter::SafetensorsWriter(fs::path path, std::vector<SafetensorsTensor> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tmp_path_(path_.string() + ".tmp") {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  for (const SafetensorsTensor& t : tensors) {
    const std::string where = tensor_where(path_.string(), t.name);
    if (t.name.empty() || t.name == "__metadata__" || header.contains(t.name))
      throw InvalidArgument(where + ": empty, reserved or duplicate name");
    if (std::any_of(t.shape.begin(), t.shape.end(), [](int64_t d) { return d < 0; }))
      throw InvalidArgument(
          fmt::format("{}: negative dimension in {}", where, format_shape(t.shape)));
    const uint64_t bytes = checked_bytes(where, t.shape, t.dtype);
    header[t.name] = {{"dtype", std::string(dtype_safetensors_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {data_bytes_, data_bytes_ + bytes}}};
    data_bytes_ += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  head += text;
  header_bytes_ = head.size();

  file_ = aio::File::open(
      tmp_path_,
      {.access = aio::Access::kWrite, .create = true, .truncate = true, .direct = false});
  // aio::File makes files 0600 (swap files are private): a model file is 0644 under the umask.
  if (::fchmod(file_.fd(), 0644 & ~creation_umask()) != 0)
    throw IoError(file_.path(), errno, "fchmod");
  pwrite_exact(file_.fd(), file_.path(), 0, std::as_bytes(std::span(head)));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (committed_) return;
  file_ = aio::File();
  std::error_code ec;
  fs::remove(tmp_path_, ec);
}

void SafetensorsWriter::append(std::span<const std::byte> bytes) {
  if (bytes.size() > data_bytes_ - written_bytes_)
    throw InvalidArgument(fmt::format("{}: {} more bytes appended after {} of the {} declared",
                                      path_.string(), bytes.size(), written_bytes_, data_bytes_));
  pwrite_exact(file_.fd(), file_.path(), header_bytes_ + written_bytes_, bytes);
  written_bytes_ += bytes.size();
}

void SafetensorsWriter::close() {
  if (committed_) return;
  if (written_bytes_ != data_bytes_)
    throw InvalidArgument(fmt::format("{}: closed after {} of the {} declared data bytes",
                                      path_.string(), written_bytes_, data_bytes_));
  file_.fsync();
  file_.close();
  std::error_code ec;
  fs::rename(tmp_path_, path_, ec);
  if (ec) throw IoError(path_.string(), ec.value(), "rename from " + tmp_path_.string());
  committed_ = true;
  fsync_directory(path_.parent_path());
}

}  // namespace outcore::ckpt
