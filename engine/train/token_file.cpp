#include "engine/train/token_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "common/error.hpp"
#include "common/open_file.hpp"

namespace outcore::train {

namespace {

TokenFormat format_from_extension(const std::string& path) {
  std::string ext = std::filesystem::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  if (ext == ".bin") return TokenFormat::kLlmc;
  if (ext == ".u16" || ext == ".uint16") return TokenFormat::kRawU16;
  if (ext == ".u32" || ext == ".uint32") return TokenFormat::kRawU32;
  throw InvalidArgument(fmt::format(
      "{}: cannot tell the token format from the extension '{}' (.bin = llm.c, .u16/.uint16 "
      "= raw uint16, .u32/.uint32 = raw uint32); give the format explicitly",
      path, ext));
}

// Reads bytes [offset, offset + bytes) of `file` into `dst`: CorruptData when the file ends
// before (shortened since it was opened), IoError when the read fails; both name `path`.
void read_exact(const UniqueFd& file, const std::string& path, uint64_t offset, void* dst,
                size_t bytes) {
  auto* p = static_cast<char*>(dst);
  for (size_t done = 0; done < bytes;) {
    const ssize_t n =
        ::pread(file.get(), p + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(path, offset + done, bytes - done, errno, "read");
    if (n == 0)
      throw CorruptData(fmt::format(
          "{}: ends before byte {}, which it held when it was opened: the file was shortened or "
          "replaced while in use (write a new file under another name, then rename it)",
          path, offset + bytes));
    done += static_cast<size_t>(n);
  }
}

// Reads elements [begin, end) of a file of T (from byte `first`) in chunks, calling
// f(chunk_begin, data, n) for each.
template <typename T, typename F>
void for_chunks(const UniqueFd& file, const std::string& path, uint64_t first, size_t begin,
                size_t end, F&& f) {
  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<T> buf(std::min(kChunk, end - begin));
  for (size_t b = begin; b < end; b += kChunk) {
    const size_t n = std::min(kChunk, end - b);
    read_exact(file, path, first + b * sizeof(T), buf.data(), n * sizeof(T));
    f(b, buf.data(), n);
  }
}

}  // namespace

std::string_view to_string(TokenFormat f) {
  switch (f) {
    case TokenFormat::kAuto:
      return "auto";
    case TokenFormat::kLlmc:
      return "llmc";
    case TokenFormat::kRawU16:
      return "u16";
    case TokenFormat::kRawU32:
      return "u32";
  }
  return "?";
}

TokenFormat parse_token_format(std::string_view name) {
  if (name == "auto") return TokenFormat::kAuto;
  if (name == "llmc" || name == "bin") return TokenFormat::kLlmc;
  if (name == "u16" || name == "uint16") return TokenFormat::kRawU16;
  if (name == "u32" || name == "uint32") return TokenFormat::kRawU32;
  throw InvalidArgument(fmt::format(
      "unknown token file format '{}'; allowed: auto, llmc (or bin), u16 (or uint16), u32 (or "
      "uint32)",
      name));
}

TokenFile::TokenFile(TokenFile&&) noexcept = default;
TokenFile& TokenFile::operator=(TokenFile&&) noexcept = default;
TokenFile::~TokenFile() = default;

TokenFile TokenFile::open(const std::string& path, TokenFormat format) {
  if (format == TokenFormat::kAuto) format = format_from_extension(path);
  TokenFile f;
  f.file_.reset(open_for_reading(path, "token file"));
  struct stat st {};
  if (fstat(f.file_.get(), &st) != 0) throw IoError(path, errno, "stat token file");
  size_t bytes = static_cast<size_t>(st.st_size);
  f.path_ = path;
  f.format_ = format;

  if (format == TokenFormat::kLlmc) {
    if (bytes < kLlmcHeaderBytes) {
      throw CorruptData(
          fmt::format("{}: truncated llm.c token file: {} bytes, shorter than the {}-byte header",
                      path, bytes, kLlmcHeaderBytes));
    }
    int32_t header[3];
    read_exact(f.file_, path, 0, header, sizeof(header));
    if (header[0] != kLlmcMagic) {
      // Raw 4-byte ids below 65536 leave every other 2-byte word zero: read as u16 they would
      // train on a zero after every token, so the hint says which format the bytes look like.
      std::array<uint16_t, 2048> words{};
      const size_t n = std::min<uint64_t>(bytes, sizeof(words)) / sizeof(uint16_t);
      read_exact(f.file_, path, 0, words.data(), n * sizeof(uint16_t));
      bool u32_like = bytes % 4 == 0;
      for (size_t i = 1; i < n && u32_like; i += 2) u32_like = words[i] == 0;
      throw CorruptData(fmt::format(
          "{}: bad magic {} in llm.c token file header (want {}); if the file holds raw tokens, "
          "give the format: {}",
          path, header[0], kLlmcMagic,
          u32_like ? "u32 (its bytes look like 4-byte ids: every other 2-byte word is zero)"
                   : "u16 for 2-byte ids, u32 for 4-byte ids"));
    }
    if (header[1] != kLlmcVersion) {
      throw CorruptData(fmt::format("{}: unsupported llm.c token file version {} (want {})", path,
                                    header[1], kLlmcVersion));
    }
    if (header[2] < 0) {
      throw CorruptData(fmt::format("{}: negative token count {} in header", path, header[2]));
    }
    size_t count = static_cast<size_t>(header[2]);
    size_t want = kLlmcHeaderBytes + count * sizeof(uint16_t);
    if (bytes != want) {
      throw CorruptData(fmt::format(
          "{}: {} llm.c token file: header says {} tokens ({} bytes with the header) but the "
          "file has {} bytes",
          path, bytes < want ? "truncated" : "oversized", count, want, bytes));
    }
    f.width_ = 2;
    f.count_ = count;
    f.first_byte_ = kLlmcHeaderBytes;
  } else {
    f.width_ = format == TokenFormat::kRawU16 ? 2 : 4;
    // An llm.c file read as raw tokens would train on its header: refused, naming it.
    if (bytes >= kLlmcHeaderBytes) {
      int32_t header[2];
      read_exact(f.file_, path, 0, header, sizeof(header));
      if (header[0] == kLlmcMagic && header[1] == kLlmcVersion)
        throw InvalidArgument(fmt::format(
            "{}: begins with llm.c's token file header (magic {}, version {}) but is to be read "
            "as raw {} tokens: read it as llmc (the format given applies to every token file of "
            "the run)",
            path, kLlmcMagic, kLlmcVersion, to_string(format)));
    }
    if (bytes % f.width_ != 0) {
      throw CorruptData(fmt::format("{}: {} bytes is not a whole number of {}-byte tokens", path,
                                    bytes, f.width_));
    }
    f.count_ = bytes / f.width_;
  }
  return f;
}

void TokenFile::read_raw(size_t begin, size_t n, void* dst) const {
  read_exact(file_, path_, first_byte_ + begin * width_, dst, n * width_);
}

uint32_t TokenFile::operator[](size_t i) const {
  if (width_ == 2) {
    uint16_t t = 0;
    read_raw(i, 1, &t);
    return t;
  }
  uint32_t t = 0;
  read_raw(i, 1, &t);
  return t;
}

void TokenFile::read(size_t begin, std::span<int32_t> out) const {
  if (begin > count_ || out.size() > count_ - begin) {
    throw InvalidArgument(fmt::format("{}: read of tokens [{}, {}) past the end ({} tokens)", path_,
                                      begin, begin + out.size(), count_));
  }
  if (width_ == 2) {
    thread_local std::vector<uint16_t> src;  // kept: a read per micro-batch sequence
    src.resize(out.size());
    read_raw(begin, src.size(), src.data());
    for (size_t i = 0; i < out.size(); ++i) out[i] = src[i];
  } else {
    read_raw(begin, out.size(), out.data());  // uint32 ids, stored as they are
  }
}

namespace {

// Index of the first token >= limit, or n when none.
template <typename T>
size_t first_at_or_above(const T* p, size_t n, uint64_t limit) {
  constexpr size_t kBlock = 4096;
  for (size_t b = 0; b < n; b += kBlock) {
    size_t e = std::min(n, b + kBlock);
    T m = 0;
    for (size_t i = b; i < e; ++i) m = std::max(m, p[i]);  // vectorizes; scan again on a hit
    if (m >= limit) {
      for (size_t i = b; i < e; ++i)
        if (p[i] >= limit) return i;
    }
  }
  return n;
}

template <typename T>
T max_of(const T* p, size_t n) {
  T m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, p[i]);
  return m;
}

}  // namespace

void TokenFile::check_vocab(uint64_t vocab_size, size_t begin, size_t end) const {
  if (begin > end || end > count_) {
    throw InvalidArgument(
        fmt::format("{}: vocabulary check of tokens [{}, {}) past the end ({} tokens)", path_,
                    begin, end, count_));
  }
  auto check = [&](size_t at, const auto* p, size_t n) {
    const size_t rel = first_at_or_above(p, n, vocab_size);
    if (rel == n) return;
    throw CorruptData(fmt::format(
        "{}: token {} at position {} is outside the model's vocabulary of {} (ids 0..{})", path_,
        static_cast<uint64_t>(p[rel]), at + rel, vocab_size, vocab_size == 0 ? 0 : vocab_size - 1));
  };
  if (width_ == 2)
    for_chunks<uint16_t>(file_, path_, first_byte_, begin, end, check);
  else
    for_chunks<uint32_t>(file_, path_, first_byte_, begin, end, check);
}

uint32_t TokenFile::max_token() const {
  uint32_t m = 0;
  auto take = [&m](size_t, const auto* p, size_t n) { m = std::max<uint32_t>(m, max_of(p, n)); };
  if (width_ == 2)
    for_chunks<uint16_t>(file_, path_, first_byte_, 0, count_, take);
  else
    for_chunks<uint32_t>(file_, path_, first_byte_, 0, count_, take);
  return m;
}

MaskFile::MaskFile(MaskFile&&) noexcept = default;
MaskFile& MaskFile::operator=(MaskFile&&) noexcept = default;
MaskFile::~MaskFile() = default;

MaskFile MaskFile::open(const std::string& path, const TokenFile& tokens) {
  MaskFile m;
  m.file_.reset(open_for_reading(path, "loss mask"));
  struct stat st {};
  if (fstat(m.file_.get(), &st) != 0) throw IoError(path, errno, "stat loss mask");
  const auto bytes = static_cast<size_t>(st.st_size);
  if (bytes != tokens.size()) {
    throw CorruptData(fmt::format(
        "{}: a loss mask of {} bytes does not belong to {} ({} tokens): a mask has one byte per "
        "token",
        path, bytes, tokens.path(), tokens.size()));
  }
  m.path_ = path;
  m.count_ = bytes;
  return m;
}

bool MaskFile::operator[](size_t i) const {
  uint8_t b = 0;
  read_exact(file_, path_, i, &b, 1);
  return b != 0;
}

void MaskFile::read(size_t begin, std::span<uint8_t> out) const {
  if (begin > count_ || out.size() > count_ - begin) {
    throw InvalidArgument(fmt::format("{}: read of mask bytes [{}, {}) past the end ({} tokens)",
                                      path_, begin, begin + out.size(), count_));
  }
  read_exact(file_, path_, begin, out.data(), out.size());
  uint8_t any = 0;
  for (const uint8_t b : out) any |= b;
  if (any > 1) {
    const size_t bad = first_at_or_above(out.data(), out.size(), 2);
    throw CorruptData(
        fmt::format("{}: byte {} at position {} is not a mask value (0 or 1); the "
                    "file changed while training read it",
                    path_, out[bad], begin + bad));
  }
}

uint64_t MaskFile::check(size_t begin, size_t end) const {
  if (begin > end || end > count_) {
    throw InvalidArgument(fmt::format("{}: mask check of [{}, {}) past the end ({} tokens)", path_,
                                      begin, end, count_));
  }
  // One pass per chunk (vectorized: a widening sum and an OR); the bad byte is looked for only
  // when there is one.
  uint64_t ones = 0;
  for_chunks<uint8_t>(file_, path_, 0, begin, end, [&](size_t at, const uint8_t* p, size_t n) {
    uint8_t any = 0;
    for (size_t i = 0; i < n; ++i) {
      ones += p[i];
      any |= p[i];
    }
    if (any > 1) {
      const size_t bad = first_at_or_above(p, n, 2);
      throw CorruptData(fmt::format("{}: byte {} at position {} is not a mask value (0 or 1)",
                                    path_, p[bad], at + bad));
    }
  });
  return ones;
}

std::string mask_path_beside(const std::string& token_path) {
  return std::filesystem::path(token_path).replace_extension(".mask").string();
}

void write_llmc_tokens(const std::string& path, std::span<const uint16_t> tokens) {
  if (tokens.size() > static_cast<size_t>(INT32_MAX)) {
    throw InvalidArgument(fmt::format("{}: {} tokens do not fit an llm.c header (max {})", path,
                                      tokens.size(), INT32_MAX));
  }
  // A temporary of its own beside `path` ("<path>.tmp-<pid>[-k]"), created exclusively: an
  // existing file or link there (a user's) is never written through or replaced.
  // Those of writers killed before their rename go first (an llm.c header, or nothing yet).
  remove_killed_temporaries(path, "token file", [](int fd) {
    return empty_or_begins_with(
        fd, std::string_view(reinterpret_cast<const char*>(&kLlmcMagic), sizeof kLlmcMagic));
  });
  std::string tmp;
  int raw = -1;
  for (int k = 0; raw < 0; ++k) {
    tmp = fmt::format("{}.tmp-{}", path, ::getpid()) + (k > 0 ? fmt::format("-{}", k) : "");
    raw = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (raw < 0 && (errno != EEXIST || k >= 100)) throw IoError(tmp, errno, "create token file");
  }
  UniqueFd fd(raw);
  auto fail = [&](const char* op) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(tmp, err, op);
  };
  int32_t header[kLlmcHeaderInts] = {};
  header[0] = kLlmcMagic;
  header[1] = kLlmcVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  auto write_all = [&](const void* data, size_t n) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::write(fd.get(), p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) fail("write token file");
      if (w == 0) {
        errno = EIO;
        fail("write token file");
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
  };
  write_all(header, sizeof(header));
  write_all(tokens.data(), tokens.size_bytes());
  if (::fsync(fd.get()) != 0) fail("fsync token file");
  if (fd.close() != 0) fail("close token file");
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(path, err, "rename token file into place");
  }
}

}  // namespace outcore::train
