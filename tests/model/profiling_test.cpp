// device::ProfilingBackend under a model: the same results bit for bit as the backend it wraps,
// and every operation of a step counted under its shape with its FLOPs.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "engine/device/profiling_backend.hpp"
#include "tests/model/model_harness.hpp"

namespace outcore::model {
namespace {

using testing::Harness;

const device::ProfilingBackend::Row* find_row(
    const std::vector<device::ProfilingBackend::Row>& rows, const std::string& op) {
  for (const auto& r : rows)
    if (r.op == op) return &r;
  return nullptr;
}

TEST(ProfilingBackend, AStepIsBitIdenticalAndEveryOperationIsCounted) {
  for (const DType compute : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(std::string(dtype_name(compute)));
    const LlamaConfig c = testing::small_config(64, 160, 2, 4, 2, 96, false);
    const ModelOptions o{
        .micro_batch = 2, .seq_len = 16, .param_dtype = compute, .compute_dtype = compute};
    const auto params = testing::random_params(LlamaModel(c, o).layout(), 7);
    const auto tokens = testing::random_ids(32, c.vocab_size, 8);
    const auto targets = testing::random_ids(32, c.vocab_size, 9);

    Harness plain(c, o, params);
    const float want = plain.train(tokens, targets);

    Harness profiled(c, o, params);
    const auto prof = std::make_shared<device::ProfilingBackend>(device::cpu_backend());
    LlamaModel m(c, o, prof);
    const float got = train_micro_batch(m, profiled.buffers(), profiled.acts, tokens.data(),
                                        targets.data(), GradMode::Overwrite);

    EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want));
    for (size_t u = 0; u < plain.grads.size(); ++u)
      ASSERT_EQ(0, std::memcmp(plain.grads[u].data(), profiled.grads[u].data(),
                               plain.grads[u].size() * sizeof(float)))
          << "unit " << u;

    const auto rows = prof->rows();
    ASSERT_FALSE(rows.empty());
    double sum = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_GT(rows[i].calls, 0) << rows[i].op;
      if (i > 0) {
        EXPECT_LE(rows[i].seconds, rows[i - 1].seconds) << "most time first";
      }
      sum += rows[i].seconds;
    }
    EXPECT_DOUBLE_EQ(prof->total_seconds(), sum);

    // One attention forward and backward per layer, with the causal pairs' FLOPs
    // (B * nh * hd * T(T+1)/2 multiply-adds per product: 2 products forward, 5 backward).
    const std::string shape = "B2 T16 4/2x16 " + std::string(dtype_name(compute));
    const double product = 2.0 * 2 * 4 * 16 * (16.0 * 17 / 2);
    const auto* fwd = find_row(rows, "attention_forward " + shape);
    const auto* bwd = find_row(rows, "attention_backward " + shape);
    ASSERT_NE(fwd, nullptr);
    ASSERT_NE(bwd, nullptr);
    EXPECT_EQ(fwd->calls, 2);
    EXPECT_EQ(bwd->calls, 2);
    EXPECT_DOUBLE_EQ(fwd->flops, 2 * 2 * product);
    EXPECT_DOUBLE_EQ(bwd->flops, 2 * 5 * product);

    // The MLP's down projection, forward: [B*T, inter] x [hidden, inter]^T, once per layer, in
    // the compute dtype's GEMM.
    const std::string gemm = compute == DType::BF16 ? "gemm_bf16" : "gemm";
    const auto* down = find_row(rows, gemm + " NT 32x64x160");
    ASSERT_NE(down, nullptr) << "no " << gemm << " NT 32x64x160";
    EXPECT_EQ(down->calls % 2, 0);
    EXPECT_DOUBLE_EQ(down->flops, double(down->calls) * 2.0 * 32 * 64 * 160);
    EXPECT_NE(find_row(rows, "rmsnorm_forward 32x64"), nullptr);
    EXPECT_NE(find_row(rows, "cross_entropy 32x96"), nullptr);

    prof->reset();
    EXPECT_TRUE(prof->rows().empty());
    EXPECT_EQ(prof->total_seconds(), 0.0);
  }
}

TEST(ProfilingBackend, RefusesNoBackend) {
  EXPECT_THROW(device::ProfilingBackend{nullptr}, InvalidArgument);
}

}  // namespace
}  // namespace outcore::model
