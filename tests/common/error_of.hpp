// error_of<E>(f): the message of the E that f throws, for tests that check what an error says.
// A test failure (and "") when f throws nothing, or an exception that is not an E.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <string>
#include <type_traits>

namespace outcore::test {

template <class E = std::exception, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    if constexpr (std::is_same_v<E, std::exception>) {
      return e.what();
    } else if (dynamic_cast<const E*>(&e) != nullptr) {
      return e.what();
    }
    ADD_FAILURE() << "an exception of another type: " << e.what();
    return {};
  }
  ADD_FAILURE() << "no exception thrown";
  return {};
}

}  // namespace outcore::test
