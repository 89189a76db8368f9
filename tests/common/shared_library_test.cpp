// SharedLibrary: candidates tried in order, errors that name what was tried and why.
#include "common/shared_library.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "common/error.hpp"
#include "tests/common/error_of.hpp"

namespace outcore {
namespace {

TEST(SharedLibrary, TakesTheFirstCandidateThatLoadsAndResolvesItsSymbols) {
  const SharedLibrary lib =
      SharedLibrary::open("the C math library", {"/nonexistent/libm.so.6", "libm.so.6"});
  EXPECT_EQ(lib.path(), "libm.so.6");
  const auto cosine = lib.symbol<double (*)(double)>("cos");
  EXPECT_DOUBLE_EQ(cosine(0.5), std::cos(0.5));
}

TEST(SharedLibrary, NoCandidateLoadingNamesWhatEachCandidateAndWhy) {
  const std::string message = test::error_of<Error>([] {
    SharedLibrary::open("cuBLASLt", {"/nonexistent/dir/libcublasLt.so.99", "libnothing-here.so.1"});
  });
  EXPECT_NE(message.find("cannot load cuBLASLt"), std::string::npos) << message;
  EXPECT_NE(message.find("/nonexistent/dir/libcublasLt.so.99: "), std::string::npos) << message;
  EXPECT_NE(message.find("libnothing-here.so.1: "), std::string::npos) << message;
  EXPECT_NE(message.find("No such file"), std::string::npos) << message;
  EXPECT_NE(message.find("LD_LIBRARY_PATH"), std::string::npos) << message;
}

TEST(SharedLibrary, AMissingSymbolIsNamedWithItsLibrary) {
  const SharedLibrary lib = SharedLibrary::open("the C math library", {"libm.so.6"});
  const std::string message =
      test::error_of<Error>([&] { lib.symbol<void (*)()>("no_such_function_here"); });
  EXPECT_NE(message.find("no_such_function_here"), std::string::npos) << message;
  EXPECT_NE(message.find("libm.so.6"), std::string::npos) << message;
}

TEST(SharedLibrary, TheDirectoryOfALinkedFunctionIsWhereItsLibraryLies) {
  const std::string dir = SharedLibrary::directory_of(
      reinterpret_cast<const void*>(static_cast<double (*)(double)>(&::cos)));
  ASSERT_FALSE(dir.empty());
  EXPECT_EQ(dir.front(), '/') << dir;
  EXPECT_EQ(SharedLibrary::directory_of(nullptr), "");
}

}  // namespace
}  // namespace outcore
