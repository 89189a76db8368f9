// `outcore doctor`: its host-side lines, verdicts and exit codes, run as a user would.
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace {

struct DoctorRun {
  int rc = -1;
  std::string out;  // stdout and stderr
};

const std::string kOutcore = std::string(OUTCORE_BINARY_DIR) + "/bin/outcore";

// Runs a shell command line, stdout and stderr together.
DoctorRun run_shell(const std::string& cmd) {
  DoctorRun r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

DoctorRun doctor(const std::string& args) {
  return run_shell(kOutcore + " doctor " + args + " 2>&1");
}

std::string text_of(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// The line of the table whose check column is `check`.
std::string line_of(const std::string& out, const std::string& check) {
  size_t at = 0;
  while ((at = out.find(check, at)) != std::string::npos) {
    if (at == 0 || out[at - 1] == '\n') {
      const size_t end = out.find('\n', at);
      return out.substr(at, end - at);
    }
    ++at;
  }
  return "";
}

class Doctor : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("outcore_doctor_test_" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(Doctor, ReportsEveryHostCheckWithAVerdictAndPassesOnAWritableSwapPath) {
  const DoctorRun r = doctor("--nvme-path " + dir_.string() + " --pinned-mb 0");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(line_of(r.out, "cpu").find("CPU Adam kernel"), std::string::npos) << r.out;
  // bf16 GEMMs on oneDNN where the CPU has bf16 dot products, else widened for sgemm.
  const std::string bf16 = line_of(r.out, "bf16 gemm");
  EXPECT_NE(bf16.find(__builtin_cpu_supports("avx512bf16") ? "oneDNN" : "OpenBLAS sgemm"),
            std::string::npos)
      << r.out;
  const std::string ring = line_of(r.out, "io_uring");  // ok, or warn naming the fallback
  EXPECT_TRUE(ring.find(" ok ") != std::string::npos || ring.find(" warn ") != std::string::npos)
      << r.out;
  const std::string nvme = line_of(r.out, "nvme path");
  EXPECT_NE(nvme.find(dir_.string()), std::string::npos) << r.out;
  EXPECT_NE(nvme.find("GiB free"), std::string::npos) << r.out;
  // What plans are checked against: MemAvailable or a memory cgroup's room, whichever is less.
  const std::string host = line_of(r.out, "host memory");
  EXPECT_NE(host.find(" available ("), std::string::npos) << r.out;
  // --pinned-mb 0: any limit holds a pool of 0 bytes.
  EXPECT_NE(line_of(r.out, "locked memory").find(" ok "), std::string::npos) << r.out;
  // A GPU line either way: `none` with the reason, or one line per GPU.
  EXPECT_TRUE(!line_of(r.out, "gpu").empty() || !line_of(r.out, "gpu 0").empty()) << r.out;
  EXPECT_NE(r.out.find("verdict: ready"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::is_empty(dir_)) << "the O_DIRECT probe file was left behind";
}

// A rank among several on this node (its launcher's local size) runs with OpenMP's idle threads
// sleeping, unless the user chose how they wait.
TEST_F(Doctor, ARankAmongSeveralOnThisNodeLetsIdleOpenMpThreadsSleep) {
  if (!__builtin_cpu_supports("avx512bf16")) GTEST_SKIP() << "no bf16 dot products: no OpenMP";
  const std::string unset = "env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT ";
  const std::string cli = std::string(OUTCORE_BINARY_DIR) + "/bin/outcore doctor 2>&1";
  auto bf16_line = [&](const std::string& env) {
    std::string out;
    FILE* p = popen((unset + env + " " + cli).c_str(), "r");
    if (p == nullptr) return out;
    std::array<char, 4096> buf{};
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
    pclose(p);
    return line_of(out, "bf16 gemm");
  };
  EXPECT_NE(bf16_line("OMPI_COMM_WORLD_LOCAL_SIZE=2").find("waiting passive"), std::string::npos);
  EXPECT_NE(bf16_line("OMPI_COMM_WORLD_LOCAL_SIZE=1").find("waiting default"), std::string::npos);
  EXPECT_NE(bf16_line("LOCAL_WORLD_SIZE=4 OMP_WAIT_POLICY=active").find("waiting active"),
            std::string::npos);
}

TEST_F(Doctor, NoGpuIsReportedAsNoneNotAsAFailure) {
  const DoctorRun r = doctor("");
  const std::string gpu = line_of(r.out, "gpu ");
  if (gpu.find(" none ") == std::string::npos) GTEST_SKIP() << "this machine has a GPU: " << gpu;
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(gpu.find("no GPU"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("no GPU: training runs on the simulated device"), std::string::npos);
}

// A swap path on a filesystem in memory warns: the swap files would take host memory.
TEST_F(Doctor, ASwapPathInMemoryWarns) {
  struct statfs fs {};
  if (::statfs("/dev/shm", &fs) != 0 || fs.f_type != TMPFS_MAGIC)
    GTEST_SKIP() << "/dev/shm is not a tmpfs here";
  const std::string dir = "/dev/shm/outcore-doctor-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const DoctorRun r = doctor("--nvme-path " + dir + " --pinned-mb 0");
  std::filesystem::remove_all(dir);
  const std::string line = line_of(r.out, "nvme path");
  EXPECT_NE(line.find(" warn "), std::string::npos) << r.out;
  EXPECT_NE(line.find("a filesystem in memory (tmpfs): swap files there take host memory"),
            std::string::npos)
      << line;
}

// A swap path training would create is checked where it creates it, with a warning (a drive not
// mounted yet has its path created on the filesystem above); one it cannot create (a file in its
// place or on its way) or look at (a loop of links) fails, with exit 1.
TEST_F(Doctor, ASwapPathThatCannotBeADirectoryFailsWithExitOne) {
  const std::string absent = (dir_ / "absent" / "swap").string();
  const DoctorRun missing = doctor("--nvme-path " + absent);
  const std::string line = line_of(missing.out, "nvme path");
  EXPECT_EQ(line.find("FAIL"), std::string::npos) << missing.out;
  EXPECT_NE(line.find(" warn "), std::string::npos) << missing.out;
  EXPECT_NE(
      line.find(absent + ": does not exist yet; training creates it, in " + dir_.string() + ": "),
      std::string::npos)
      << line;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "absent"));
  std::filesystem::create_symlink(dir_ / "loop", dir_ / "loop");
  const DoctorRun loop = doctor("--nvme-path " + (dir_ / "loop" / "swap").string());
  EXPECT_EQ(loop.rc, 1) << loop.out;
  EXPECT_NE(line_of(loop.out, "nvme path").find("cannot be looked at"), std::string::npos)
      << loop.out;
  const DoctorRun loop_itself = doctor("--nvme-path " + (dir_ / "loop").string());
  EXPECT_EQ(loop_itself.rc, 1) << loop_itself.out;
  EXPECT_NE(line_of(loop_itself.out, "nvme path").find("cannot be looked at"), std::string::npos)
      << loop_itself.out;

  std::ofstream(dir_ / "file") << "x";
  const DoctorRun file = doctor("--nvme-path " + (dir_ / "file").string());
  EXPECT_EQ(file.rc, 1) << file.out;
  EXPECT_NE(line_of(file.out, "nvme path").find("FAIL"), std::string::npos) << file.out;
  EXPECT_NE(file.out.find("verdict: NOT READY (1 failed"), std::string::npos) << file.out;
  const DoctorRun below = doctor("--nvme-path " + (dir_ / "file" / "swap").string());
  EXPECT_EQ(below.rc, 1) << below.out;
  EXPECT_NE(line_of(below.out, "nvme path")
                .find("cannot be created: " + (dir_ / "file").string() + " is not a directory"),
            std::string::npos)
      << below.out;
  // A filesystem without storage is named as such, not as full.
  const DoctorRun proc = doctor("--pinned-mb 0 --nvme-path /proc");
  EXPECT_EQ(proc.rc, 1) << proc.out;
  EXPECT_NE(line_of(proc.out, "nvme path").find("/proc: a filesystem without storage"),
            std::string::npos)
      << proc.out;
  // An empty path is a usage error, not "no swap path to check".
  const DoctorRun empty = doctor("--nvme-path ''");
  EXPECT_EQ(empty.rc, 2) << empty.out;
  EXPECT_NE(empty.out.find("--nvme-path: an empty value"), std::string::npos) << empty.out;
}

// The O_DIRECT probe writes a file of its own: a link (or file) already at its name, here the
// first name the probe tries (the shell's pid is the one `exec` hands to outcore), is never
// written through, truncated or removed.
TEST_F(Doctor, TheSwapPathProbeNeverTouchesAFileItDidNotCreate) {
  std::ofstream(dir_ / "victim.txt") << "IMPORTANT\n";
  std::filesystem::create_directories(dir_ / "swap");
  const DoctorRun r = run_shell(
      "sh -c 'ln -s ../victim.txt " + (dir_ / "swap").string() + "/.outcore_doctor_$$_0 && exec " +
      kOutcore + " doctor --pinned-mb 0 --nvme-path " + (dir_ / "swap").string() + "' 2>&1");
  EXPECT_EQ(text_of(dir_ / "victim.txt"), "IMPORTANT\n") << r.out;
  size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir_ / "swap")) {
    EXPECT_TRUE(std::filesystem::is_symlink(e.symlink_status())) << e.path();
    ++entries;
  }
  EXPECT_EQ(entries, 1u) << "the link was removed, or the probe's own file was left";
  EXPECT_NE(line_of(r.out, "nvme path").find("O_DIRECT works"), std::string::npos) << r.out;
}

// A swap path with little space is a warning, and with none left a failure, not a missing
// O_DIRECT. Needs a small tmpfs
// (mount privileges, as root in CI).
TEST_F(Doctor, AFullSwapPathFailsWithExitOne) {
  const std::filesystem::path full = dir_ / "full";
  std::filesystem::create_directories(full);
  if (std::system(("mount -t tmpfs -o size=64k tmpfs " + full.string() + " 2>/dev/null").c_str()) !=
      0)
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root and mount privileges)";
  // Room for almost nothing: a warning saying so (it said "ok").
  const DoctorRun small = doctor("--pinned-mb 0 --nvme-path " + full.string());
  EXPECT_NE(line_of(small.out, "nvme path").find(" warn "), std::string::npos) << small.out;
  EXPECT_NE(line_of(small.out, "nvme path").find("under 1.0 GiB free"), std::string::npos)
      << small.out;
  {
    std::ofstream fill(full / "fill", std::ios::binary);
    const std::string block(4096, 'x');
    for (int i = 0; i < 64 && fill; ++i) fill << block;
  }
  const DoctorRun r = doctor("--pinned-mb 0 --nvme-path " + full.string());
  std::system(("umount " + full.string()).c_str());
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(line_of(r.out, "nvme path").find("FAIL"), std::string::npos) << r.out;
  EXPECT_NE(line_of(r.out, "nvme path").find("no space left"), std::string::npos) << r.out;
}

// Without CAP_IPC_LOCK (dropped from the bounding set where setpriv can: root holds it) a limit
// below the pool is a warning naming the fix; with it, the limit does not apply and it is ok.
TEST_F(Doctor, ALockedMemoryLimitBelowThePoolIsAWarningNamingTheFix) {
  const std::string args = " doctor --pinned-mb 1024 2>&1";  // 1 GiB: above a default limit
  const DoctorRun with_cap = run_shell(kOutcore + args);
  const DoctorRun r = run_shell("setpriv --bounding-set -ipc_lock " + kOutcore + args);
  const std::string line = line_of(r.out, "locked memory");
  if (line.find("RLIMIT_MEMLOCK unlimited") != std::string::npos ||
      line.find(">= pinned pool") != std::string::npos)
    GTEST_SKIP() << "RLIMIT_MEMLOCK holds 1 GiB here: " << line;
  ASSERT_FALSE(line.empty()) << "setpriv failed: " << r.out;
  EXPECT_NE(line.find("warn"), std::string::npos) << r.out;
  EXPECT_NE(line.find("ulimit -l"), std::string::npos) << r.out;
  EXPECT_EQ(r.rc, 0) << r.out;  // a warning: training still works
  if (::geteuid() == 0) {       // root's CAP_IPC_LOCK: mlock is not bound by the limit
    const std::string cap = line_of(with_cap.out, "locked memory");
    EXPECT_NE(cap.find(" ok "), std::string::npos) << with_cap.out;
    EXPECT_NE(cap.find("CAP_IPC_LOCK"), std::string::npos) << with_cap.out;
  }
}

// A pinned pool larger than the host's memory can never be locked, whatever the limit or the
// capability: FAIL, never "ready".
TEST_F(Doctor, APinnedPoolLargerThanTheHostFails) {
  const DoctorRun r = doctor("--pinned-mb 1073741824");  // 1 PiB
  const std::string line = line_of(r.out, "locked memory");
  EXPECT_NE(line.find("FAIL"), std::string::npos) << r.out;
  EXPECT_NE(line.find("larger than this host's memory"), std::string::npos) << r.out;
  EXPECT_EQ(r.rc, 1) << r.out;
}

// --pinned-mb is a whole number of MiB: another value is said to be, naming the flag, exit 2.
TEST_F(Doctor, APinnedPoolSizeThatIsNoWholeNumberOfMibIsSaidToBe) {
  const std::pair<const char*, const char*> cases[] = {
      {"1.5", "a whole number (no fraction, no exponent)"},
      {"lots", "allowed: a number"},
      {"-1", "a whole number of MiB from 0 to 1073741824"},
      {"1073741825", "a whole number of MiB from 0 to 1073741824"},
      {"99999999999999999999", "a whole number from"}};
  for (const auto& [value, says] : cases) {
    const DoctorRun r = doctor(std::string("--pinned-mb=") + value);
    EXPECT_EQ(r.rc, 2) << value << ": " << r.out;
    EXPECT_NE(r.out.find(std::string("error: --pinned-mb: got \"") + value + "\"; "),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find(says), std::string::npos) << r.out;
  }
}

TEST_F(Doctor, BadArgumentsExitTwo) {
  EXPECT_EQ(doctor("--pinned-mb -5").rc, 2);
  EXPECT_EQ(doctor("--pinned-mb lots").rc, 2);
  EXPECT_EQ(doctor("--no-such-flag").rc, 2);
}

}  // namespace
