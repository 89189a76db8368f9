// aio::File: open modes, O_DIRECT and its buffered fallback, preallocate, sync, close.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statfs.h>

#include "aio/aio.hpp"
#include "aio/file_internal.hpp"
#include "tests/aio/test_util.hpp"

namespace outcore::aio {
namespace {

using test::LogCapture;
using test::TempDir;

TEST(AioFile, OpenMissingFileThrowsIoErrorNamingPathAndErrno) {
  TempDir dir;
  auto path = dir / "missing.bin";
  try {
    File::open(path, {});
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.file(), path.string());
    EXPECT_EQ(e.error_number(), ENOENT);
    EXPECT_NE(std::string(e.what()).find("missing.bin"), std::string::npos);
  }
}

// What O_DIRECT opens but is not a file to swap to (a FIFO, a directory, /dev/null read) is
// refused naming the path, whether or not the direct open is what took it.
TEST(AioFile, NotARegularFileIsRefusedNamingThePath) {
  TempDir dir;
  const std::filesystem::path fifo = dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::filesystem::path& path : {fifo, dir.path(), std::filesystem::path("/dev/null")})
    for (const bool direct : {true, false}) {
      try {
        File::open(path, {.access = Access::kRead, .direct = direct});
        ADD_FAILURE() << path << " opened";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(path.string() + ": is "), std::string::npos)
            << e.what();
      } catch (const IoError& e) {  // a kernel refusing the open itself still names the path
        EXPECT_EQ(e.file(), path.string()) << e.what();
      }
    }
}

// A FIFO opened for writing without a reader (the kernel's ENXIO) is refused as a FIFO too.
TEST(AioFile, AFifoOpenedForWritingIsRefusedAsAFifo) {
  TempDir dir;
  const std::filesystem::path fifo = dir / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const bool direct : {true, false}) try {
      File::open(fifo, {.access = Access::kWrite, .direct = direct});
      ADD_FAILURE() << "opened";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(fifo.string() + ": is a FIFO"), std::string::npos)
          << e.what();
    }
}

TEST(AioFile, CreateOnBuildDirectoryIsDirect) {
  TempDir dir;
  File f = File::open(dir / "a.bin", kCreateRw);
  ASSERT_TRUE(f.is_open());
  if (!f.direct()) GTEST_SKIP() << "the build tree's filesystem refuses O_DIRECT";
  EXPECT_EQ(f.size(), 0u);
  EXPECT_EQ(f.path(), (dir / "a.bin").string());
}

TEST(AioFile, ExclusiveCreateOfExistingFileFails) {
  TempDir dir;
  File::open(dir / "a.bin", kCreateRw);
  OpenOptions excl = kCreateRw;
  excl.exclusive = true;
  try {
    File::open(dir / "a.bin", excl);
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), EEXIST);
  }
}

TEST(AioFile, PreallocateSetsSizeAndNeverShrinks) {
  TempDir dir;
  File f = File::open(dir / "a.bin", kCreateRw);
  f.preallocate(1 << 20);
  EXPECT_EQ(f.size(), 1u << 20);
  f.preallocate(4096);
  EXPECT_EQ(f.size(), 1u << 20);
  f.truncate(8192);
  EXPECT_EQ(f.size(), 8192u);
  f.fdatasync();
  f.fsync();
}

TEST(AioFile, PreallocateBeyondMaximumFileSizeReportsPathLengthAndErrno) {
  TempDir dir;
  File f = File::open(dir / "a.bin", kCreateRw);
  try {
    f.preallocate(uint64_t{1} << 62);  // past every filesystem's limit: EFBIG, checked up front
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.file(), f.path());
    EXPECT_EQ(e.length(), uint64_t{1} << 62);
    EXPECT_NE(e.error_number(), 0);
    EXPECT_NE(std::string(e.what()).find("fallocate"), std::string::npos);
  }
}

int fallocate_enospc(int, int, off_t, off_t) {
  errno = ENOSPC;
  return -1;
}
int fallocate_unsupported(int, int, off_t, off_t) {
  errno = EOPNOTSUPP;
  return -1;
}

TEST(AioFile, PreallocateOnFullDiskIsIoErrorWithEnospc) {
  TempDir dir;
  File f = File::open(dir / "a.bin", kCreateRw);
  auto previous = internal::set_fallocate_function_for_testing(&fallocate_enospc);
  try {
    f.preallocate(1 << 20);
    ADD_FAILURE() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC);
    EXPECT_EQ(e.file(), f.path());
    EXPECT_NE(std::string(e.what()).find("No space left"), std::string::npos);
  }
  internal::set_fallocate_function_for_testing(previous);
}

TEST(AioFile, PreallocateWithoutFallocateSupportSetsSizeAndWarns) {
  TempDir dir;
  File f = File::open(dir / "a.bin", kCreateRw);
  LogCapture log;
  auto previous = internal::set_fallocate_function_for_testing(&fallocate_unsupported);
  f.preallocate(1 << 20);
  internal::set_fallocate_function_for_testing(previous);
  EXPECT_EQ(f.size(), 1u << 20);
  EXPECT_EQ(LogCapture::count(log.text(), "fallocate is not supported"), 1u);
}

TEST(AioFile, MoveTransfersOwnershipAndCloseReleases) {
  TempDir dir;
  int before = test::open_fd_count();
  File a = File::open(dir / "a.bin", kCreateRw);
  uint64_t serial = a.serial();
  File b = std::move(a);
  EXPECT_FALSE(a.is_open());
  EXPECT_TRUE(b.is_open());
  EXPECT_EQ(b.serial(), serial);
  EXPECT_EQ(test::open_fd_count(), before + 1);
  b.close();
  EXPECT_FALSE(b.is_open());
  b.close();  // no-op
  EXPECT_EQ(test::open_fd_count(), before);
  EXPECT_THROW(b.size(), IoError);
}

TEST(AioFile, BufferedWhenAsked) {
  TempDir dir;
  OpenOptions o = kCreateRw;
  o.direct = false;
  File f = File::open(dir / "a.bin", o);
  EXPECT_FALSE(f.direct());
  EXPECT_EQ(::fcntl(f.fd(), F_GETFL) & O_DIRECT, 0);
}

int open_refusing_direct(const char* path, int flags, mode_t mode) {
  if (flags & O_DIRECT) {
    errno = EINVAL;
    return -1;
  }
  return ::open(path, flags, mode);
}

TEST(AioFile, RefusedDirectFallsBackToBufferedWithOneWarning) {
  TempDir dir;
  LogCapture log;
  internal::reset_fallback_warnings_for_testing();
  auto previous = internal::set_open_function_for_testing(&open_refusing_direct);
  File a = File::open(dir / "a.bin", kCreateRw);
  File b = File::open(dir / "b.bin", kCreateRw);
  internal::set_open_function_for_testing(previous);
  EXPECT_FALSE(a.direct());
  EXPECT_FALSE(b.direct());
  EXPECT_EQ(LogCapture::count(log.text(), "refuses O_DIRECT"), 1u) << log.text();

  // Misaligned I/O is fine on the buffered file.
  Engine engine(Options{.block_size = 4096, .queue_depth = 4});
  std::vector<std::byte> out(10001), in(10001);
  test::fill_random(out, 7);
  engine.write(a, 13, out);
  engine.read(a, 13, in);
  EXPECT_EQ(test::checksum(in), test::checksum(out));
}

TEST(AioFile, TmpfsFallsBackOrIsDirect) {
  struct statfs fs {};
  constexpr long kTmpfsMagic = 0x01021994;
  if (::statfs("/dev/shm", &fs) != 0 || fs.f_type != kTmpfsMagic) {
    GTEST_SKIP() << "/dev/shm is not tmpfs here";
  }
  auto path = std::filesystem::path("/dev/shm") /
              ("outcore-aio-test-" + std::to_string(::getpid()) + ".bin");
  File f = File::open(path, kCreateRw);
  std::filesystem::remove(path);
  if (f.direct()) {
    GTEST_SKIP() << "tmpfs accepts O_DIRECT on this kernel (>= 6.6); the fallback is covered "
                    "by RefusedDirectFallsBackToBufferedWithOneWarning";
  }
  Engine engine(Options{.block_size = 4096});
  std::vector<std::byte> out(5000), in(5000);
  test::fill_random(out, 3);
  engine.write(f, 1, out);
  engine.read(f, 1, in);
  EXPECT_EQ(test::checksum(in), test::checksum(out));
}

}  // namespace
}  // namespace outcore::aio
