// StagedFile: an output file written under a temporary name beside its target and renamed over
// the target only by commit(), so the target is either untouched or complete. The temporary is
// registered for cleanup until then (common/cleanup.hpp: a process ended at once removes it).
//
// Threading: one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace outcore::data {

class StagedFile {
 public:
  // Creates "<target>.tmp-<pid>" (or "...-<pid>-<k>" when that exists) exclusively, mode 0644.
  // Throws IoError naming the temporary.
  explicit StagedFile(std::string target);
  // Removes the temporary unless commit() ran.
  ~StagedFile();
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;

  // Appends bytes (buffered). Throws IoError (ENOSPC, EIO, ...) naming the temporary.
  void append(const void* data, size_t bytes);
  // Writes bytes at `offset` of what was appended so far. Throws IoError.
  void write_at(uint64_t offset, const void* data, size_t bytes);
  // Writes what is buffered, fsyncs and closes the temporary. Throws IoError.
  void finish();
  // Renames the temporary over the target and fsyncs the directory. REQUIRES finish().
  // Throws IoError; the temporary is removed then.
  void commit();

  const std::string& target() const { return target_; }
  // True once commit() renamed the temporary over the target.
  bool committed() const { return committed_; }
  const std::string& temporary() const { return temporary_; }
  uint64_t bytes() const { return written_ + buffer_.size(); }

 private:
  void flush();

  std::string target_, temporary_;
  int fd_ = -1;
  bool committed_ = false;
  uint64_t written_ = 0;
  std::vector<char> buffer_;
};

}  // namespace outcore::data
