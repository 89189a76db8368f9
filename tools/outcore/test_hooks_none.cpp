// The shipped `outcore`: no test hook, and no way to turn one on.
#include "tools/outcore/test_hooks.hpp"

namespace outcore::cli {

const TestHooks& test_hooks() {
  static const TestHooks none;
  return none;
}

}  // namespace outcore::cli
