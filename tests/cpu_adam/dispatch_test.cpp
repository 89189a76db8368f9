// Instruction set names, detection, override by set_isa and by request_isa (the setting the
// tools read from OUTCORE_CPU_ADAM_ISA).
#include <gtest/gtest.h>

#include <memory>
#include <sstream>
#include <string>

#include "common/error.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "test_util.hpp"
#include "tests/common/log_capture.hpp"

namespace outcore::cpu_adam {
namespace {

using outcore::test::LogCapture;

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

TEST(Dispatch, ActiveIsaIsSupported) { EXPECT_TRUE(isa_supported(active_isa())); }

TEST(Dispatch, RequestIsaSelectsASupportedIsaSilently) {
  for (Isa isa : testing::supported_isas()) {
    testing::IsaGuard guard(detect_isa());
    LogCapture log;
    request_isa(isa_name(isa), "OUTCORE_CPU_ADAM_ISA");
    EXPECT_EQ(active_isa(), isa);
    EXPECT_EQ(log.text(), "");
  }
}

TEST(Dispatch, EmptyRequestChangesNothing) {
  testing::IsaGuard guard(Isa::kScalar);
  LogCapture log;
  request_isa("", "OUTCORE_CPU_ADAM_ISA");
  EXPECT_EQ(active_isa(), Isa::kScalar);
  EXPECT_EQ(log.text(), "");
}

TEST(Dispatch, UnknownRequestKeepsTheIsaAndWarnsNamingTheSource) {
  testing::IsaGuard guard(detect_isa());
  LogCapture log;
  request_isa("mmx", "OUTCORE_CPU_ADAM_ISA");
  EXPECT_EQ(active_isa(), detect_isa());
  const std::string text = log.text();
  EXPECT_NE(text.find("OUTCORE_CPU_ADAM_ISA: "), std::string::npos) << text;
  EXPECT_NE(text.find("'mmx'"), std::string::npos) << text;
  EXPECT_NE(text.find("using " + std::string(isa_name(detect_isa()))), std::string::npos) << text;
}

TEST(Dispatch, UnsupportedRequestKeepsTheIsaAndWarnsNamingTheSource) {
  if (isa_supported(Isa::kAvx512)) GTEST_SKIP() << "this CPU runs every ISA";
  testing::IsaGuard guard(detect_isa());
  LogCapture log;
  request_isa("avx512", "OUTCORE_CPU_ADAM_ISA");
  EXPECT_EQ(active_isa(), detect_isa());
  EXPECT_NE(log.text().find("OUTCORE_CPU_ADAM_ISA=avx512: this CPU cannot run it; using " +
                            std::string(isa_name(detect_isa()))),
            std::string::npos)
      << log.text();
}

}  // namespace
}  // namespace outcore::cpu_adam
