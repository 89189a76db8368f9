// Test helpers for injected I/O faults (tests/zero/fault_test.cpp, gpu_test.cpp): an aio
// backend that fails one chosen request with EIO (eio_on_nth.hpp), and a run of engine steps
// until the first I/O error.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <memory>
#include <string>
#include <vector>

#include "aio/aio.hpp"
#include "tests/zero/eio_on_nth.hpp"
#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {

// Runs up to `steps` steps of one micro-batch on `dev` (the model's backend must compute on it)
// and returns the error message of the first IoError (checked to be EIO), "" if none; `where`
// names the call that threw. With `step_in_backward`, every step is expected first (clipping
// off, so each starts during the backward).
inline std::string run_until_error_on(device::Device& dev, const config::Config& cfg,
                                      const model::LlamaModel& model, EngineOptions options,
                                      int steps, const char** where, bool wait_each_step = true,
                                      bool step_in_backward = false) {
  comm::LocalComm comm;
  ZeroEngine engine(cfg, model, dev, comm, 5, std::move(options));
  const size_t n = static_cast<size_t>(model.tokens());
  try {
    for (int t = 1; t <= steps; ++t) {
      std::vector<int32_t> tok = make_tokens(n + 1, model.config().vocab_size, t, n + 1);
      StepParams sp = step_params(cfg, 1e-3, t, 1.0);
      if (step_in_backward) {
        sp.gradient_clipping = 0;
        engine.expect_step(sp);
      }
      *where = "forward_backward";
      engine.forward_backward(tok.data(), tok.data() + 1, 1.0f, true);
      *where = "step";
      engine.step(sp);
      if (wait_each_step) engine.wait_step();  // an overlapped step's error surfaces here
    }
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), EIO);
    return e.what();
  }
  return "";
}

}  // namespace outcore::zero::test
