// OUTCORE_ORACLE_UNAVAILABLE: a missing oracle skips, unless OUTCORE_REQUIRE_ORACLES=1 makes it
// a failure (as `./dev.sh test` does, so CI cannot pass with its oracles silently skipped).
#include "tests/common/oracle_unavailable.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace outcore::test {
namespace {

TEST(OracleUnavailable, OnlyTheValueOneRequiresTheOracles) {
  EXPECT_FALSE(oracles_required(nullptr));
  EXPECT_FALSE(oracles_required(""));
  EXPECT_FALSE(oracles_required("0"));
  EXPECT_FALSE(oracles_required("yes"));
  EXPECT_FALSE(oracles_required("10"));
  EXPECT_TRUE(oracles_required("1"));
}

struct ChildResult {
  int exit_code = -1;
  std::string output;
};

// Runs the probe program (one test that reports an unavailable oracle) with `env_prefix`
// (arguments to env(1)) in front; returns its exit code and output.
ChildResult run_probe(const std::string& env_prefix) {
  const std::string cmd = "env " + env_prefix + " " + OUTCORE_ORACLE_PROBE + " 2>&1";
  ChildResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[512];
  while (fgets(buf, sizeof(buf), pipe) != nullptr) r.output += buf;
  const int status = pclose(pipe);
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  return r;
}

TEST(OracleUnavailable, SkipsWithTheReasonWhenNotRequired) {
  for (const std::string env : {"-u OUTCORE_REQUIRE_ORACLES", "OUTCORE_REQUIRE_ORACLES=0"}) {
    SCOPED_TRACE(env);
    const ChildResult r = run_probe(env);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("[  SKIPPED ] OracleProbe.ReportsAnUnavailableOracle"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("probe: no reference interpreter"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("[  FAILED  ]"), std::string::npos) << r.output;
  }
}

TEST(OracleUnavailable, FailsWithTheReasonWhenRequired) {
  const ChildResult r = run_probe("OUTCORE_REQUIRE_ORACLES=1");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("[  FAILED  ] OracleProbe.ReportsAnUnavailableOracle"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("oracle unavailable: probe: no reference interpreter"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("OUTCORE_REQUIRE_ORACLES=1"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("[  SKIPPED ]"), std::string::npos) << r.output;
  // The macro ends the test: the line after it never runs.
  EXPECT_EQ(r.output.find("returned to its caller"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace outcore::test
