// The default backend: io_uring where the kernel allows it, else the synchronous fallback with
// one warning; request_backend() forcing either, its source named in messages; the decision
// made once per process. A failing io_uring probe is simulated through
// aio/backend_internal.hpp.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <thread>
#include <vector>

#include "aio/aio.hpp"
#include "aio/backend_internal.hpp"
#include "common/aligned_buffer.hpp"
#include "tests/aio/test_util.hpp"

namespace outcore::aio {
namespace {

using test::checksum;
using test::fill_random;
using test::LogCapture;
using test::TempDir;

// The source the tools give request_backend().
constexpr const char* kSource = "OUTCORE_AIO_BACKEND";
constexpr const char* kFallbackWarning = "io_uring cannot be used";

// The fake probe: counts its calls and returns g_probe_result. It sleeps a little so that
// concurrent first callers overlap inside the decision.
std::atomic<int> g_probe_calls{0};
std::atomic<int> g_probe_result{0};

int fake_probe() {
  ++g_probe_calls;
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return g_probe_result.load();
}

bool contains(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

class AioBackendChoice : public ::testing::Test {
 protected:
  void SetUp() override { g_probe_calls = 0; }
  void TearDown() override {
    request_backend("", "");
    internal::set_io_uring_probe_for_testing(nullptr);
    internal::reset_backend_choice_for_testing();
  }
  // The next decision sees request_backend(`value`, `source`) (nullptr: no request) and a
  // probe that returns `probe_result` (0 or -errno).
  static void decide_next_with(const char* value, int probe_result, const char* source = kSource) {
    request_backend(value != nullptr ? value : "", value != nullptr ? source : "");
    g_probe_result = probe_result;
    internal::set_io_uring_probe_for_testing(&fake_probe);
    internal::reset_backend_choice_for_testing();
  }
};

TEST_F(AioBackendChoice, ProbeFailureChoosesSyncWithOneWarningNamingCauseAndCost) {
  decide_next_with(nullptr, -EPERM);
  LogCapture log;
  BackendChoice c = resolve_backend();
  EXPECT_EQ(c.kind, BackendKind::kSync);
  EXPECT_EQ(c.name(), "sync");
  EXPECT_FALSE(c.forced);
  EXPECT_TRUE(contains(c.fallback_reason, "EPERM")) << c.fallback_reason;
  Engine engine(Options{.thread_count = 2});
  EXPECT_EQ(engine.backend_name(), "sync");
  EXPECT_EQ(engine.stats().backend, "sync");
  resolve_backend();
  Engine second(Options{});
  const std::string text = log.text();
  EXPECT_EQ(LogCapture::count(text, kFallbackWarning), 1u) << text;
  EXPECT_TRUE(contains(text, "EPERM")) << text;                     // the cause
  EXPECT_TRUE(contains(text, "one request at a time")) << text;     // the cost
  EXPECT_TRUE(contains(text, "aio.intra_op_parallelism")) << text;  // the remedy
  EXPECT_EQ(g_probe_calls.load(), 1);
}

// EPERM: PermissionDeniedNamesTheSysctlOrSeccomp.
TEST_F(AioBackendChoice, EachProbeErrnoIsExplained) {
  struct Case {
    int err;
    const char* name;
    const char* meaning;
  };
  for (const Case& k :
       {Case{ENOSYS, "ENOSYS", "kernel has no io_uring"}, Case{ENOMEM, "ENOMEM", "RLIMIT_MEMLOCK"},
        Case{EMFILE, "EMFILE", "file descriptor"}, Case{EIO, "errno 5", ""}}) {
    decide_next_with(nullptr, -k.err);
    LogCapture log;
    BackendChoice c = resolve_backend();
    EXPECT_EQ(c.kind, BackendKind::kSync);
    EXPECT_TRUE(contains(c.fallback_reason, k.name)) << c.fallback_reason;
    EXPECT_TRUE(contains(c.fallback_reason, k.meaning)) << c.fallback_reason;
    EXPECT_TRUE(contains(log.text(), c.fallback_reason)) << log.text();
  }
}

// EPERM's meaning depends on the sysctl; where it allows io_uring, a seccomp filter is blamed.
TEST_F(AioBackendChoice, PermissionDeniedNamesTheSysctlOrSeccomp) {
  decide_next_with(nullptr, -EPERM);
  LogCapture log;
  const std::string reason = resolve_backend().fallback_reason;
  std::ifstream sysctl("/proc/sys/kernel/io_uring_disabled");
  int disabled = -1;
  if (!(sysctl >> disabled) || disabled == 0) {
    EXPECT_TRUE(contains(reason, "seccomp")) << reason;
  } else {
    EXPECT_TRUE(contains(reason, "kernel.io_uring_disabled = " + std::to_string(disabled)))
        << reason;
  }
}

TEST_F(AioBackendChoice, DecisionIsMadeOnceUnderConcurrentEngines) {
  decide_next_with(nullptr, -ENOSYS);
  LogCapture log;
  std::vector<std::thread> threads;
  std::atomic<int> sync_engines{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      if (i % 2 == 0) {
        if (resolve_backend().kind == BackendKind::kSync) ++sync_engines;
      } else {
        Engine e(Options{.thread_count = 2});
        if (e.backend_name() == "sync") ++sync_engines;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(sync_engines.load(), 8);
  EXPECT_EQ(g_probe_calls.load(), 1);
  EXPECT_EQ(LogCapture::count(log.text(), kFallbackWarning), 1u) << log.text();
}

std::atomic<bool> g_slow_probe_entered{false};
int slow_probe() {
  g_slow_probe_entered = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  return -ENOSYS;
}

// A fork while another thread makes the decision (holding its lock through the probe) must not
// leave the lock held in the child, whose first engine would then wait for it forever.
TEST_F(AioBackendChoice, AForkDuringTheDecisionLeavesTheChildFreeToDecide) {
  decide_next_with(nullptr, 0);
  internal::set_io_uring_probe_for_testing(&slow_probe);
  g_slow_probe_entered = false;
  LogCapture log;
  std::thread decider([] { (void)resolve_backend(); });
  while (!g_slow_probe_entered) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::alarm(20);  // a child left waiting on the lock dies of SIGALRM
    _exit(resolve_backend().kind == BackendKind::kSync ? 0 : 3);
  }
  decider.join();
  ASSERT_GT(pid, 0);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST_F(AioBackendChoice, FallbackEngineRoundTripsData) {
  decide_next_with(nullptr, -EPERM);
  LogCapture log;
  TempDir dir;
  File f = File::open(dir / "fallback.bin", {.access = Access::kReadWrite, .create = true});
  constexpr size_t kBytes = 3 << 20;
  f.preallocate(kBytes);
  Engine engine(Options{.block_size = 65536, .queue_depth = 8, .thread_count = 3});
  ASSERT_EQ(engine.backend_name(), "sync");
  AlignedBuffer out(kBytes), in(kBytes);
  fill_random(std::span(out.data(), kBytes), 7);
  engine.write(f, 0, std::span<const std::byte>(out.data(), kBytes));
  engine.read(f, 0, std::span(in.data(), kBytes));
  EXPECT_EQ(checksum(std::span(in.data(), kBytes)), checksum(std::span(out.data(), kBytes)));
  EXPECT_EQ(engine.stats().read.bytes, kBytes);
}

TEST_F(AioBackendChoice, ForcedSyncIsUsedWithoutProbingOrWarning) {
  for (int probe : {0, -EPERM}) {
    decide_next_with("sync", probe);
    LogCapture log;
    BackendChoice c = resolve_backend();
    EXPECT_EQ(c.kind, BackendKind::kSync);
    EXPECT_TRUE(c.forced);
    EXPECT_EQ(c.forced_by, kSource);
    EXPECT_TRUE(c.fallback_reason.empty()) << c.fallback_reason;
    Engine engine(Options{});
    EXPECT_EQ(engine.backend_name(), "sync");
    EXPECT_EQ(g_probe_calls.load(), 0);
    EXPECT_EQ(LogCapture::count(log.text(), kFallbackWarning), 0u) << log.text();
  }
}

TEST_F(AioBackendChoice, ForcedIoUringThatCannotBeUsedThrowsNamingTheCause) {
  decide_next_with("io_uring", -EPERM);
  LogCapture log;
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      resolve_backend();
      FAIL() << "expected ConfigError";
    } catch (const ConfigError& e) {
      EXPECT_TRUE(contains(e.what(), "OUTCORE_AIO_BACKEND=io_uring")) << e.what();
      EXPECT_TRUE(contains(e.what(), "EPERM")) << e.what();
    }
  }
  EXPECT_THROW(Engine(Options{}), ConfigError);
  EXPECT_EQ(g_probe_calls.load(), 1);  // the error is remembered, not probed again
  EXPECT_EQ(LogCapture::count(log.text(), kFallbackWarning), 0u) << log.text();
}

TEST_F(AioBackendChoice, ForcedIoUringIsUsedWhereTheKernelAllowsIt) {
  if (int err = test::io_uring_setup_errno()) {
    GTEST_SKIP() << "io_uring_setup fails here: " << errno_string(err);
  }
  decide_next_with("io_uring", 0);
  BackendChoice c = resolve_backend();
  EXPECT_EQ(c.kind, BackendKind::kIoUring);
  EXPECT_TRUE(c.forced);
  EXPECT_EQ(c.forced_by, kSource);
  EXPECT_EQ(Engine(Options{}).backend_name(), "io_uring");
}

TEST_F(AioBackendChoice, InvalidValueThrowsNamingTheVariableAndTheAllowedValues) {
  decide_next_with("uring", 0);
  try {
    resolve_backend();
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "OUTCORE_AIO_BACKEND=uring")) << e.what();
    EXPECT_TRUE(contains(e.what(), "io_uring, sync")) << e.what();
  }
  EXPECT_THROW(Engine(Options{}), ConfigError);
  EXPECT_EQ(g_probe_calls.load(), 0);
}

TEST_F(AioBackendChoice, EmptyValueChoosesAutomatically) {
  decide_next_with("", -ENOSYS);
  LogCapture log;
  BackendChoice c = resolve_backend();
  EXPECT_EQ(c.kind, BackendKind::kSync);
  EXPECT_FALSE(c.forced);
  EXPECT_TRUE(c.forced_by.empty()) << c.forced_by;
  EXPECT_EQ(g_probe_calls.load(), 1);
  // The warning tells how to select sync without it, through the request's source.
  EXPECT_TRUE(contains(log.text(), "OUTCORE_AIO_BACKEND=sync selects this backend")) << log.text();
}

TEST_F(AioBackendChoice, MessagesNameTheSourceOfTheRequest) {
  decide_next_with("uring", 0, "--aio-backend");
  try {
    resolve_backend();
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "--aio-backend=uring")) << e.what();
    EXPECT_FALSE(contains(e.what(), "OUTCORE_AIO_BACKEND")) << e.what();
  }
  decide_next_with("sync", 0, "");
  BackendChoice c = resolve_backend();
  EXPECT_EQ(c.forced_by, "aio::request_backend");
}

TEST_F(AioBackendChoice, RequestAfterTheDecisionDoesNotChangeIt) {
  decide_next_with("sync", 0);
  EXPECT_EQ(resolve_backend().kind, BackendKind::kSync);
  request_backend("uring", kSource);
  BackendChoice c = resolve_backend();
  EXPECT_EQ(c.kind, BackendKind::kSync);
  EXPECT_EQ(c.forced_by, kSource);
  EXPECT_EQ(g_probe_calls.load(), 0);
}

// With the real probe: io_uring exactly where the raw io_uring_setup system call works.
TEST_F(AioBackendChoice, RealProbeAgreesWithTheKernel) {
  request_backend("", "");
  internal::reset_backend_choice_for_testing();
  LogCapture log;
  BackendChoice c = resolve_backend();
  int err = test::io_uring_setup_errno();
  EXPECT_EQ(c.kind, err == 0 ? BackendKind::kIoUring : BackendKind::kSync) << c.fallback_reason;
  EXPECT_EQ(c.fallback_reason.empty(), err == 0) << c.fallback_reason;
  EXPECT_EQ(Engine(Options{}).backend_name(), c.name());
}

}  // namespace
}  // namespace outcore::aio
