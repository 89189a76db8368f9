// Instruction set names, detection, override by set_isa and by OUTCORE_CPU_ADAM_ISA.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <memory>
#include <string>

#include "common/error.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "test_util.hpp"

namespace outcore::cpu_adam {
namespace {

TEST(Dispatch, NamesRoundTrip) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    EXPECT_EQ(parse_isa(isa_name(isa)), isa);
  }
  EXPECT_THROW(parse_isa("sse2"), InvalidArgument);
  EXPECT_THROW(parse_isa(""), InvalidArgument);
}

TEST(Dispatch, DetectedIsaIsSupportedAndScalarAlwaysIs) {
  EXPECT_TRUE(isa_supported(detect_isa()));
  EXPECT_TRUE(isa_supported(Isa::kScalar));
  if (isa_supported(Isa::kAvx512)) {
    EXPECT_TRUE(isa_supported(Isa::kAvx2));
    EXPECT_EQ(detect_isa(), Isa::kAvx512);
  }
}

TEST(Dispatch, SetIsaChangesTheActiveIsa) {
  for (Isa isa : testing::supported_isas()) {
    testing::IsaGuard guard(isa);
    EXPECT_EQ(active_isa(), isa);
  }
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    if (!isa_supported(isa)) {
      EXPECT_THROW(set_isa(isa), InvalidArgument);
    }
  }
}

// Also run in a child process by EnvironmentVariableSelectsTheIsaAtStartUp, which reads the
// line it prints.
TEST(Dispatch, ActiveIsaIsSupported) {
  EXPECT_TRUE(isa_supported(active_isa()));
  std::printf("active_isa=%s\n", std::string(isa_name(active_isa())).c_str());
}

std::string self_path() {
  char buf[4096];
  const ssize_t len = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return len > 0 ? std::string(buf, static_cast<size_t>(len)) : std::string();
}

// Runs this test binary's ActiveIsaIsSupported with OUTCORE_CPU_ADAM_ISA=value; returns
// its stdout and stderr.
std::string run_self_with_env(const std::string& value) {
  const std::string cmd = "OUTCORE_CPU_ADAM_ISA='" + value + "' '" + self_path() +
                          "' --gtest_filter=Dispatch.ActiveIsaIsSupported 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  if (!pipe) return "popen failed";
  std::string out;
  std::array<char, 512> buf;
  while (fgets(buf.data(), buf.size(), pipe.get()) != nullptr) out += buf.data();
  return out;
}

TEST(Dispatch, EnvironmentVariableSelectsTheIsaAtStartUp) {
  for (Isa isa : testing::supported_isas()) {
    const std::string out = run_self_with_env(std::string(isa_name(isa)));
    EXPECT_NE(out.find("active_isa=" + std::string(isa_name(isa)) + "\n"), std::string::npos)
        << out;
  }
  const std::string bad = run_self_with_env("mmx");
  EXPECT_NE(bad.find("active_isa=" + std::string(isa_name(detect_isa())) + "\n"), std::string::npos)
      << bad;
  EXPECT_NE(bad.find("OUTCORE_CPU_ADAM_ISA"), std::string::npos) << "no warning: " << bad;
}

}  // namespace
}  // namespace outcore::cpu_adam
