#include "engine/data/document_reader.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include "common/open_file.hpp"

namespace outcore::data {
namespace {

bool is_blank(std::string_view line) {
  for (char c : line)
    if (c != ' ' && c != '\t' && c != '\r' && c != '\v' && c != '\f') return false;
  return true;
}

// `line` without a final "\r" (of a "\r\n" break).
size_t without_cr(std::string_view s, size_t begin, size_t end) {
  return end > begin && s[end - 1] == '\r' ? end - 1 : end;
}

}  // namespace

InputFormat input_format_of(const std::string& path) {
  std::string lower = path;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return lower.ends_with(".jsonl") || lower.ends_with(".json") || lower.ends_with(".ndjson")
             ? InputFormat::kJsonLines
             : InputFormat::kText;
}

DocumentReader::DocumentReader(std::vector<std::string> files, Options options)
    : files_(std::move(files)), options_(options) {}

DocumentReader::~DocumentReader() {
  if (fd_ >= 0) ::close(fd_);
}

void DocumentReader::close_file() {
  ::close(fd_);
  fd_ = -1;
  ++file_;
  carry_.clear();
  carry_line_ = scanned_line_ = 1;
  scanned_ = 0;
  doc_open_ = false;
}

bool DocumentReader::read_more(std::string& buffer, size_t bytes) {
  const std::string& path = files_[file_];
  size_t have = buffer.size();
  buffer.resize(have + bytes);
  bool eof = false;
  while (have < buffer.size()) {
    const ssize_t n = ::read(fd_, buffer.data() + have, buffer.size() - have);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(path, bytes_read_, buffer.size() - have, errno, "read input");
    if (n == 0) {
      eof = true;
      break;
    }
    have += static_cast<size_t>(n);
    bytes_read_ += static_cast<uint64_t>(n);
  }
  buffer.resize(have);
  return eof;
}

std::unique_ptr<Batch> DocumentReader::next() {
  while (file_ < files_.size()) {
    const std::string& path = files_[file_];
    if (fd_ < 0) fd_ = open_for_reading(path, "input");
    auto b = std::make_unique<Batch>();
    b->file = file_;
    b->bytes = std::move(carry_);
    carry_.clear();
    bool eof = read_more(b->bytes, std::max(options_.chunk_bytes, b->bytes.size()));
    while (options_.doc_per_file && !eof && b->bytes.size() <= options_.max_document_bytes)
      eof = read_more(b->bytes, std::min(b->bytes.size(), options_.max_document_bytes));
    b->bytes_read = bytes_read_;
    if (options_.doc_per_file) {
      if (!eof)
        throw BadDocument(path, 1,
                          fmt::format("the file is longer than {} bytes, the most one "
                                      "document may hold (--doc-per-file; --max-document-mb "
                                      "raises it)",
                                      options_.max_document_bytes));
      if (!b->bytes.empty()) b->docs.push_back({0, b->bytes.size(), 1});
    } else {
      cut(*b, eof);
    }
    if (eof) close_file();
    if (!b->docs.empty()) return b;
  }
  return nullptr;
}

void DocumentReader::cut(Batch& b, bool eof) {
  if (input_format_of(files_[b.file]) == InputFormat::kJsonLines)
    cut_lines(b, eof);
  else
    cut_text(b, eof);
}

void DocumentReader::throw_line_too_long(const Batch& b, uint64_t line) const {
  throw BadDocument(files_[b.file], line,
                    fmt::format("a line longer than {} bytes (--max-document-mb raises it)",
                                options_.max_document_bytes));
}

void DocumentReader::throw_document_too_long(const Batch& b) const {
  throw BadDocument(files_[b.file], doc_line_,
                    fmt::format("a document longer than {} bytes (documents are separated by "
                                "blank lines; --max-document-mb raises it)",
                                options_.max_document_bytes));
}

void DocumentReader::cut_lines(Batch& b, bool eof) {
  const std::string_view s = b.bytes;
  size_t begin = 0;
  uint64_t line = carry_line_;
  while (begin < s.size()) {
    const size_t nl = s.find('\n', begin);
    if (nl == std::string_view::npos && !eof) break;
    const size_t end = nl == std::string_view::npos ? s.size() : nl;
    if (!is_blank(s.substr(begin, end - begin))) {
      if (end - begin > options_.max_document_bytes) throw_line_too_long(b, line);
      b.docs.push_back({begin, without_cr(s, begin, end) - begin, line});
    }
    begin = end + 1;
    ++line;
  }
  begin = std::min(begin, s.size());
  if (s.size() - begin > options_.max_document_bytes) throw_line_too_long(b, line);
  carry_.assign(s.substr(begin));
  b.bytes.resize(begin);
  carry_line_ = line;
}

void DocumentReader::cut_text(Batch& b, bool eof) {
  const std::string_view s = b.bytes;
  size_t pos = scanned_;  // complete lines before it were scanned by an earlier call
  uint64_t line = scanned_line_;
  size_t doc_start = 0;  // a document still open from an earlier call starts the carry
  auto close_doc = [&] {
    if (doc_end_ - doc_start > options_.max_document_bytes) throw_document_too_long(b);
    b.docs.push_back({doc_start, doc_end_ - doc_start, doc_line_});
    doc_open_ = false;
  };
  while (pos < s.size()) {
    const size_t nl = s.find('\n', pos);
    if (nl == std::string_view::npos && !eof) break;
    const size_t end = nl == std::string_view::npos ? s.size() : nl;
    if (is_blank(s.substr(pos, end - pos))) {
      if (doc_open_) close_doc();
    } else {
      if (!doc_open_) {
        doc_open_ = true;
        doc_start = pos;
        doc_line_ = line;
      }
      doc_end_ = without_cr(s, pos, end);
    }
    pos = std::min(end + 1, s.size());
    ++line;
  }
  if (eof && doc_open_) close_doc();
  const size_t carry_from = doc_open_ ? doc_start : pos;
  if (s.size() - carry_from > options_.max_document_bytes) {
    if (doc_open_) throw_document_too_long(b);
    throw_line_too_long(b, line);  // blank lines only
  }
  carry_.assign(s.substr(carry_from));
  scanned_ = pos - carry_from;
  scanned_line_ = line;
  if (doc_open_) doc_end_ -= carry_from;
  b.bytes.resize(carry_from);
}

}  // namespace outcore::data
