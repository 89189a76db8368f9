// What aio_bench and bench_aio share around a measurement: the benchmark file (removed on
// every way out), Ctrl-C handling, the bad-input error that exits with code 2, and the aio
// backend the measurements run on.
#pragma once

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>

#include "aio/aio.hpp"
#include "common/open_file.hpp"

namespace outcore::aio_bench {

// Bad input (path, sizes, free space): main prints it on one line and exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The backend every Engine of this run uses (aio::resolve_backend()). An invalid
// OUTCORE_AIO_BACKEND, or io_uring forced where it cannot be used, is a UsageError.
aio::BackendChoice backend_for_run();
// One line for humans: "io_uring", "sync (forced by OUTCORE_AIO_BACKEND)" (the source given to
// aio::request_backend()), or "sync (fallback: <reason>)".
std::string describe_backend(const aio::BackendChoice& b);

// SIGINT, SIGTERM and SIGHUP set a flag that stop_requested() reports; measurements poll it
// and unwind, so destructors remove files. A second signal removes the benchmark file
// (ScratchFile) and ends the process at once. A signal ignored at start (nohup) stays ignored.
void install_stop_handlers();
bool stop_requested();
int stop_signal();

// Throws UsageError if `dir` is missing, not a directory, not writable, or has less than
// `need` bytes free.
void check_directory(const std::filesystem::path& dir, uint64_t need);

// The benchmark file `<dir>/<stem>.<pid>.dat`: created exclusively (O_DIRECT), preallocated
// to `size`, removed when this object is destroyed. Permission and space failures are
// UsageError; other failures IoError.
class ScratchFile {
 public:
  ScratchFile(const std::filesystem::path& dir, const std::string& stem, uint64_t size);
  ~ScratchFile();
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;
  const aio::File& file() const { return file_; }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
  aio::File file_;
  FileId id_;  // the file created: removed only while its name still names it
  bool created_ = false;
};

// Fills the first `size` bytes of `file` with pseudo-random data from `buffer` (whose
// contents it overwrites), so reads hit written blocks, not unwritten extents.
void fill_file(const aio::File& file, std::span<std::byte> buffer, uint64_t size);

}  // namespace outcore::aio_bench
