// Run by oracle_unavailable_test.cpp as a child process: a test whose oracle is unavailable, so
// that its result (skip or failure) shows what OUTCORE_ORACLE_UNAVAILABLE does under the child's
// environment.
#include <string>

#include "tests/common/oracle_unavailable.hpp"

TEST(OracleProbe, ReportsAnUnavailableOracle) {
  const std::string reason = "probe: no reference interpreter";
  OUTCORE_ORACLE_UNAVAILABLE(reason);
  ADD_FAILURE() << "OUTCORE_ORACLE_UNAVAILABLE returned to its caller";
}
