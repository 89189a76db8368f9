// DocumentReader: reads input files in chunks and cuts them into documents, never holding more
// than a chunk plus the document that spans its end.
//
// Formats (by file name: ".jsonl" and ".json" are JSON lines, anything else plain text):
// - Plain text: a document is a maximal run of non-blank lines (a blank line holds nothing but
//   spaces, tabs, \r, \v and \f); its text is those lines, line breaks between them kept as
//   they are, without the line break (\n or \r\n) after the last one. With doc_per_file, each
//   file's whole bytes are one document (an empty file is none).
// - JSON lines: every line that is not blank is one document to be parsed (by the caller);
//   its text is the line without its line break.
//
// Threading: one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/error.hpp"

namespace outcore::data {

enum class InputFormat { kText, kJsonLines };

// kJsonLines for names ending in ".jsonl", ".json" or ".ndjson" (any case), else kText.
InputFormat input_format_of(const std::string& path);

// Bad input at a place in a file: what() is "<file>:<line>: <reason>".
class BadDocument : public CorruptData {
 public:
  BadDocument(std::string file, uint64_t line, const std::string& reason)
      : CorruptData(file + ":" + std::to_string(line) + ": " + reason),
        file_(std::move(file)),
        line_(line),
        reason_(reason) {}
  const std::string& file() const { return file_; }
  uint64_t line() const { return line_; }
  const std::string& reason() const { return reason_; }

 private:
  std::string file_;
  uint64_t line_;
  std::string reason_;
};

struct Document {
  size_t offset = 0, size = 0;  // in Batch::bytes
  uint64_t line = 0;            // 1-based line of its first byte
};

// Whole documents of one file, in file order.
struct Batch {
  size_t file = 0;  // index into the reader's files
  std::string bytes;
  std::vector<Document> docs;
  uint64_t bytes_read = 0;  // bytes read from all files once this batch was read
};

class DocumentReader {
 public:
  struct Options {
    bool doc_per_file = false;
    // Bytes read per chunk.
    size_t chunk_bytes = size_t{16} << 20;
    // A document (or JSON line) longer than this is refused.
    size_t max_document_bytes = size_t{64} << 20;
  };

  DocumentReader(std::vector<std::string> files, Options options);
  ~DocumentReader();
  DocumentReader(const DocumentReader&) = delete;
  DocumentReader& operator=(const DocumentReader&) = delete;

  // The next batch holding at least one document, or nullptr after the last. Throws IoError
  // (open, read; naming the file), InvalidArgument (not a regular file) and BadDocument (a
  // document longer than max_document_bytes, at its first line).
  std::unique_ptr<Batch> next();

  const std::vector<std::string>& files() const { return files_; }

 private:
  // Cuts complete documents off the front of `b.bytes` (all of it at end of file); the rest,
  // an unfinished document or line, stays in carry_.
  void cut(Batch& b, bool eof);
  void cut_text(Batch& b, bool eof);
  void cut_lines(Batch& b, bool eof);
  // BadDocument for a line (JSON lines; `line`) or the open document (plain text) longer than
  // max_document_bytes.
  [[noreturn]] void throw_line_too_long(const Batch& b, uint64_t line) const;
  [[noreturn]] void throw_document_too_long(const Batch& b) const;
  void close_file();
  // Appends up to `bytes` read from the open file to `buffer`; true at end of file.
  bool read_more(std::string& buffer, size_t bytes);

  std::vector<std::string> files_;
  Options options_;
  size_t file_ = 0;
  int fd_ = -1;
  uint64_t bytes_read_ = 0;
  // What was read but not yet cut. JSON lines: a partial line, starting on line carry_line_.
  // Text: the open document (from its first byte) or a partial line; its complete lines before
  // scanned_ (on line scanned_line_) were scanned already.
  std::string carry_;
  uint64_t carry_line_ = 1;
  size_t scanned_ = 0;
  uint64_t scanned_line_ = 1;
  bool doc_open_ = false;
  size_t doc_end_ = 0;  // end of the open document's last non-blank line, in carry_
  uint64_t doc_line_ = 0;
};

}  // namespace outcore::data
