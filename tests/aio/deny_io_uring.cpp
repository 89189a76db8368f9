// aio_deny_io_uring ERRNO COMMAND [ARGS...]: runs COMMAND under a seccomp filter that fails
// io_uring_setup with ERRNO (a number), as a container's seccomp profile does, so a test can
// see what a program does where io_uring is refused by the kernel rather than by a seam.
// Exits 77 (skip) where no filter can be installed.
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

#if defined(__x86_64__)
constexpr unsigned kArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
constexpr unsigned kArch = AUDIT_ARCH_AARCH64;
#else
constexpr unsigned kArch = 0;
#endif

constexpr int kSkip = 77;

bool install_filter(unsigned err) {
  sock_filter code[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kArch, 0, 3),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (err & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(code) / sizeof(code[0])), code};
  return kArch != 0 && ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: aio_deny_io_uring ERRNO COMMAND [ARGS...]\n");
    return 2;
  }
  unsigned err = static_cast<unsigned>(std::atoi(argv[1]));
  if (!install_filter(err)) {
    std::fprintf(stderr, "aio_deny_io_uring: cannot install a seccomp filter: %s\n",
                 std::strerror(errno));
    return kSkip;
  }
  ::execvp(argv[2], argv + 2);
  std::fprintf(stderr, "aio_deny_io_uring: %s: %s\n", argv[2], std::strerror(errno));
  return 127;
}
