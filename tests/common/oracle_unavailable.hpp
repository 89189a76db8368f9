// What a test does when its oracle cannot run (no /usr/bin/python3, no PyTorch): skip visibly
// on a developer's machine, but fail where the oracles are required (CI: `./dev.sh test`
// installs them and sets OUTCORE_REQUIRE_ORACLES=1), so a missing interpreter or package can
// never turn a suite of reference checks into a row of silent skips.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

namespace outcore::test {

// The environment variable that turns a missing oracle from a skip into a failure.
inline constexpr const char* kRequireOraclesEnv = "OUTCORE_REQUIRE_ORACLES";

// Whether a missing oracle must fail, given the variable's value (nullptr when unset): true
// only for "1"; unset, empty, "0" or anything else skip.
inline bool oracles_required(const char* env_value) {
  return env_value != nullptr && std::strcmp(env_value, "1") == 0;
}

// The same decision for this process's environment.
inline bool oracles_required() { return oracles_required(std::getenv(kRequireOraclesEnv)); }

}  // namespace outcore::test

// Ends the current test (or SetUp) because its oracle is unavailable: GTEST_SKIP with `reason`
// normally; when OUTCORE_REQUIRE_ORACLES=1, a fatal failure naming `reason` and the variable.
// Like GTEST_SKIP it returns from the enclosing function, which must return void. `reason`:
// one expression that streams into a gtest message (a std::string or a string literal).
#define OUTCORE_ORACLE_UNAVAILABLE(reason)                                                \
  do {                                                                                    \
    if (::outcore::test::oracles_required()) {                                            \
      GTEST_FAIL() << "oracle unavailable: " << (reason) << " ("                          \
                   << ::outcore::test::kRequireOraclesEnv << "=1 requires every oracle)"; \
    } else {                                                                              \
      GTEST_SKIP() << (reason);                                                           \
    }                                                                                     \
  } while (0)
