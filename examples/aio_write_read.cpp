// aio_write_read: the aio layer alone. Writes 64 MiB to a file through an aio::Engine (io_uring,
// O_DIRECT where the filesystem allows it), reads it back, checks every byte and prints the
// throughput of each direction.
//
//   build/bin/aio_write_read [DIR]   # the scratch file goes under DIR (default: $TMPDIR or /tmp)
//
// The file lives in a fresh directory under DIR, removed at exit. Exit 0 when the data read
// back equals the data written, 1 otherwise or on any error.
#include <stdlib.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "aio/aio.hpp"

namespace fs = std::filesystem;
using namespace outcore;
using Clock = std::chrono::steady_clock;

// A fresh directory under `parent`, removed with everything in it at scope exit.
class ScratchDir {
 public:
  explicit ScratchDir(const fs::path& parent) {
    std::string tmpl = (parent / "aio_write_read.XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) throw IoError(tmpl, errno, "mkdtemp");
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

double gb_per_s(size_t bytes, Clock::time_point t0) {
  return bytes / 1e9 / std::chrono::duration<double>(Clock::now() - t0).count();
}

int main(int argc, char** argv) {
  constexpr size_t kBytes = 64 << 20;
  try {
    ScratchDir dir(argc > 1 ? fs::path(argv[1]) : fs::temp_directory_path());
    aio::File file = aio::File::open(dir.path() / "data.bin",
                                     {.access = aio::Access::kReadWrite, .create = true});
    file.preallocate(kBytes);  // a full disk fails here, not halfway through the write
    const aio::Options options{.block_size = 1 << 20, .queue_depth = 16};  // DeepSpeed's "aio"
    aio::Engine engine(options);
    std::printf("%s backend, %s I/O, %zu MiB in %zu KiB requests, queue depth %u\n",
                engine.backend_name().c_str(), file.direct() ? "O_DIRECT" : "buffered",
                kBytes >> 20, options.block_size >> 10, options.queue_depth);

    // 4 KiB-aligned buffers, as O_DIRECT requires of address, offset and length.
    AlignedBuffer src(kBytes), dst(kBytes);
    std::span<uint64_t> words = src.as<uint64_t>();
    for (size_t i = 0; i < words.size(); ++i) words[i] = i * 0x9E3779B97F4A7C15ull;

    // submit_* returns at once; the buffer must stay alive and unchanged until wait().
    auto t0 = Clock::now();
    aio::Ticket t = engine.submit_write(file, 0, std::span<const std::byte>(src.data(), kBytes));
    engine.wait(t);  // throws IoError naming file, offset, length and errno on failure
    file.fdatasync();
    const double write_gbps = gb_per_s(kBytes, t0);

    t0 = Clock::now();
    t = engine.submit_read(file, 0, std::span<std::byte>(dst.data(), kBytes));
    engine.wait(t);
    const double read_gbps = gb_per_s(kBytes, t0);
    file.close();  // reports a failing close as IoError

    const bool same = std::memcmp(src.data(), dst.data(), kBytes) == 0;
    std::printf("write %.2f GB/s (fdatasync included), read %.2f GB/s\n", write_gbps, read_gbps);
    std::printf("check: %s\n", same ? "data read back equals data written" : "MISMATCH");
    return same ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "aio_write_read: %s\n", e.what());
    return 1;
  }
}
