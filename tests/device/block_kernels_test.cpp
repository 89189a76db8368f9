// The CUDA kernels whose threads work together (engine/device/block_kernels.hpp) run on the host
// under the SIMT emulation of a thread block (tests/common/simt.hpp): the very bodies the CUDA
// kernels run, launched as cuda_kernels.cu launches them, against the host kernels of
// engine/device/cpu, at the GPU tests' tolerances (tests/device/cuda_kernels_test.cpp): RMSNorm,
// softmax, cross-entropy and the sum of squares within 1e-5 relative (block-tree reductions
// instead of the host's lanes), the gradient norm's block sums with CPU Adam's bits.
#include "engine/device/block_kernels.hpp"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpu_adam/cpu_adam.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "engine/device/kernel_math.hpp"
#include "engine/device/rmsnorm_dw_split.hpp"
#include "tests/common/numeric.hpp"
#include "tests/common/simt.hpp"
#include "tests/device/host_attention.hpp"

namespace outcore::test {
namespace {

namespace blocks = device::blocks;
namespace hk = device::cpu;
namespace norm = device::norm;

constexpr int kThreads = 256;  // cuda_kernels.cu's block size

// cuda_kernels.cu's RMSNorm launches: a block per row for y and dx, then dw in tiles over the
// split's ranges and, with several ranges, the second kernel adding them in order.
void rmsnorm_dw(const std::vector<float>& dy, const std::vector<float>& x,
                const std::vector<float>& rstd, int64_t rows, int64_t dim, std::vector<float>& dw) {
  const norm::DwSplit split = norm::dw_split(rows, dim);
  std::vector<float> partials(norm::kDwPartialFloats, std::numeric_limits<float>::quiet_NaN());
  float* p = split.ranges > 1 ? partials.data() : nullptr;
  simt_launch({static_cast<int>(split.tiles), static_cast<int>(split.ranges), 1},
              blocks::kDwThreads, blocks::kDwShared, [&](SimtThread& t) {
                blocks::rmsnorm_dw_tile(t, dy.data(), x.data(), rstd.data(), rows,
                                        split.rows_per_range, dim, dw.data(), p);
              });
  if (p == nullptr) return;
  simt_launch(
      {static_cast<int>((dim + kThreads - 1) / kThreads), 1, 1}, kThreads, 0,
      [&](SimtThread& t) { blocks::rmsnorm_dw_ranges(t, p, split.ranges, dim, dw.data()); });
}

// A partial column tile with rows not a multiple of the lanes, and rows that take dw's loads
// eight rows ahead and then a tail.
TEST(BlockKernels, RmsNormForwardAndBackwardMatchTheHost) {
  for (const auto& [rows, dim] : {std::pair<int64_t, int64_t>{37, 520}, {300, 96}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(dim));
    const HostRmsNorm h = host_rmsnorm(rows, dim, 11, 0.25f);
    const std::vector<float>&x = h.x, &w = h.w, &dy = h.dy;
    std::vector<float> gy(rows * dim), grstd(rows), gdx(rows * dim, 0.5f), gdw(dim, 0.25f);
    std::vector<uint16_t> gy16(rows * dim);
    const SimtGrid per_row{static_cast<int>(rows), 1, 1};
    simt_launch(per_row, kThreads, blocks::kReduceShared, [&](SimtThread& t) {
      blocks::rmsnorm_forward_row(t, x.data(), w.data(), 1e-5f, dim, gy.data(), nullptr,
                                  grstd.data());
    });
    simt_launch(per_row, kThreads, blocks::kReduceShared, [&](SimtThread& t) {
      blocks::rmsnorm_forward_row(t, x.data(), w.data(), 1e-5f, dim, nullptr, gy16.data(),
                                  grstd.data());
    });
    simt_launch(per_row, kThreads, blocks::kReduceShared, [&](SimtThread& t) {
      blocks::rmsnorm_dx_row(t, dy.data(), x.data(), w.data(), grstd.data(), dim, gdx.data());
    });
    rmsnorm_dw(dy, x, grstd, rows, dim, gdw);
    expect_close(gy, h.y, 1e-5, "y");
    size_t differ = 0;
    for (size_t i = 0; i < gy.size(); ++i) differ += gy16[i] != kmath::fp32_to_bf16(gy[i]);
    EXPECT_EQ(differ, 0u) << "y rounded to bf16 in the kernel";
    expect_close(grstd, h.rstd, 1e-5, "rstd");
    expect_close(gdx, h.dx, 1e-5, "dx");
    expect_rmsnorm_dw(gdw, h, rows, dim);
  }
}

// The weight gradient split over row ranges (norm::dw_split): 3000 rows of 96 in 11 ranges,
// their partial sums added in range order by the second kernel.
TEST(BlockKernels, RmsNormWeightGradientOverRowRangesMatchesTheHost) {
  const int64_t rows = 3000, dim = 96;
  ASSERT_EQ(norm::dw_split(rows, dim).ranges, 11);
  const HostRmsNorm h = host_rmsnorm(rows, dim, 21, -0.5f);
  std::vector<float> gdw(dim, -0.5f);
  rmsnorm_dw(h.dy, h.x, h.rstd, rows, dim, gdw);
  expect_rmsnorm_dw(gdw, h, rows, dim);
}

TEST(BlockKernels, CausalSoftmaxForwardAndBackwardMatchTheHost) {
  const int64_t batch = 3, rows = 40, keys = 64, r0 = keys - rows;
  auto scores = randn(batch * rows * keys, 14, 2.0f), dp = randn(batch * rows * keys, 15);
  const auto [p, lse, ds, num, inv] = host_causal_softmax(scores, dp, batch, rows, keys, r0);
  const SimtGrid per_row{static_cast<int>(batch * rows), 1, 1};
  auto forward = [&](std::vector<float>& s, std::vector<float>& l, float* inv_sum) {
    simt_launch(per_row, kThreads, blocks::kReduceShared, [&](SimtThread& t) {
      blocks::causal_softmax_forward_row(t, s.data(), l.data(), rows, keys, r0, rows, inv_sum);
    });
  };
  std::vector<float> gs = scores, gl(batch * rows), gd = dp;
  forward(gs, gl, nullptr);
  expect_close(gs, p, 1e-5, "prob");
  expect_close(gl, lse, 1e-5, "lse");
  std::vector<float> gs2 = scores;
  simt_launch(per_row, kThreads, blocks::kReduceShared, [&](SimtThread& t) {
    blocks::causal_softmax_backward_row(t, gs2.data(), gd.data(), gl.data(), rows, keys, r0, rows,
                                        nullptr);
  });
  expect_close(gs2, p, 1e-5, "recomputed prob");
  expect_close(gd, ds, 1e-5, "dscores");
  std::vector<float> gn = scores, gln(batch * rows), ginv(batch * rows);
  forward(gn, gln, ginv.data());
  expect_close(gn, num, 1e-5, "numerators");
  expect_close(ginv, inv, 1e-5, "1 / sum");
  expect_close(gln, lse, 1e-5, "lse with numerators");
}

// The host's loss and gradient of coef x loss per row (a target below 0: loss 0, gradient 0).
void host_cross_entropy(std::vector<float>& logits, int64_t at, const std::vector<int32_t>& targets,
                        int64_t vocab, float coef, std::vector<float>& loss) {
  for (size_t r = 0; r < targets.size(); ++r) {
    float* row = logits.data() + at + r * vocab;
    if (targets[r] < 0) {
      std::fill(row, row + vocab, 0.0f);
      loss[r] = 0.0f;
      continue;
    }
    const float target_logit = row[targets[r]];
    loss[r] = kmath::xent_loss(hk::softmax_inplace(row, vocab), target_logit);
    for (int64_t j = 0; j < vocab; ++j) row[j] = kmath::xent_scale(row[j], coef);
    row[targets[r]] = kmath::xent_target(row[targets[r]], coef);
  }
}

// The one-pass cross-entropy: rows read four floats at a time (a vocabulary that is a multiple
// of 4, rows on 16 bytes), one at a time (an odd vocabulary, and rows that start off 16 bytes),
// fewer elements than threads, masked rows; the loss without the gradient, and the gradient
// rounded to bf16 (the logits then kept).
TEST(BlockKernels, CrossEntropyLossAndGradientMatchTheHost) {
  struct Case {
    int64_t vocab, offset;  // offset: floats before the first row
  };
  for (const Case c : {Case{1000, 0}, Case{1001, 0}, Case{1000, 1}, Case{100, 0}}) {
    SCOPED_TRACE("vocab " + std::to_string(c.vocab) + ", offset " + std::to_string(c.offset));
    const int64_t rows = 9;
    const float coef = 1.0f / rows;
    auto logits = randn(c.offset + rows * c.vocab, 16, 3.0f);
    std::vector<int32_t> targets(rows);
    for (int64_t r = 0; r < rows; ++r) targets[r] = static_cast<int32_t>((r * 37) % c.vocab);
    targets[3] = -1;
    targets[7] = -100;
    std::vector<float> grad = logits, loss(rows);
    host_cross_entropy(grad, c.offset, targets, c.vocab, coef, loss);
    auto run = [&](std::vector<float>& x, bool with_grad, uint16_t* g16) {
      std::vector<float> got(rows, std::numeric_limits<float>::quiet_NaN());
      simt_launch({static_cast<int>(rows), 1, 1}, kThreads, blocks::kReduceShared,
                  [&](SimtThread& t) {
                    blocks::cross_entropy_row(t, x.data() + c.offset, targets.data(), c.vocab, coef,
                                              with_grad, got.data(), g16);
                  });
      return got;
    };
    std::vector<float> x = logits, x2 = logits, x3 = logits;
    std::vector<uint16_t> g16(rows * c.vocab, 0x7fc1);
    expect_close(run(x, true, nullptr), loss, 1e-5, "loss");
    expect_close(x, grad, 1e-5, "dlogits");
    expect_close(run(x2, false, nullptr), loss, 1e-5, "loss without gradient");
    expect_close(x2, logits, 0.0, "logits untouched without gradient");
    expect_close(run(x3, true, g16.data()), loss, 1e-5, "loss with the bf16 gradient");
    expect_close(x3, logits, 0.0, "logits kept with the bf16 gradient");
    size_t differ = 0;
    for (int64_t i = 0; i < rows * c.vocab; ++i)
      differ += g16[i] != kmath::fp32_to_bf16(x[c.offset + i]);
    EXPECT_EQ(differ, 0u) << "of " << g16.size() << " bf16 gradients";
    EXPECT_EQ(g16[3 * c.vocab + 5], 0u) << "a masked row's gradient";
  }
}

// A row whose logits are all -inf has no distribution: NaN, as on the host; a NaN logit makes
// the row's loss NaN; an infinite logit too. Each as the host's softmax gives it.
TEST(BlockKernels, CrossEntropyOfRowsWithoutAFiniteSoftmaxIsNaNAsOnTheHost) {
  const int64_t vocab = 512;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits = randn(3 * vocab, 31);
  std::fill(logits.begin(), logits.begin() + vocab, -inf);
  logits[vocab + 77] = std::numeric_limits<float>::quiet_NaN();
  logits[2 * vocab + 300] = inf;
  const std::vector<int32_t> targets{1, 2, 3};
  std::vector<float> loss(3);
  simt_launch({3, 1, 1}, kThreads, blocks::kReduceShared, [&](SimtThread& t) {
    blocks::cross_entropy_row(t, logits.data(), targets.data(), vocab, 1.0f, false, loss.data(),
                              nullptr);
  });
  std::vector<float> host = logits, want(3);
  host_cross_entropy(host, 0, targets, vocab, 1.0f, want);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(std::isnan(loss[r])) << "row " << r << ": " << loss[r];
    EXPECT_EQ(std::isnan(loss[r]), std::isnan(want[r])) << "row " << r;
  }
}

TEST(BlockKernels, SumOfSquaresMatchesTheHostAndIsDeterministic) {
  const int64_t n = 30001;
  const auto x = randn(n, 17);
  auto run = [&](int grid) {
    std::vector<float> partials(grid), out(1);
    simt_launch({grid, 1, 1}, kThreads, blocks::kReduceShared, [&](SimtThread& t) {
      blocks::sum_squares_partials(t, x.data(), n, partials.data());
    });
    simt_launch({1, 1, 1}, kThreads, blocks::kReduceShared,
                [&](SimtThread& t) { blocks::sum_partials(t, partials.data(), grid, out.data()); });
    return out[0];
  };
  const float got = run(16);
  EXPECT_NEAR(got, hk::sum_squares(x.data(), n), 1e-5 * got);
  EXPECT_EQ(kmath::float_bits(run(16)), kmath::float_bits(got));
  EXPECT_NEAR(run(3), got, 1e-5 * got);  // partials over another grid
}

// The gradient norm's block sums with CPU Adam's bits: blocks shorter than the lanes, a last
// short block, blocks of many lane strides.
TEST(BlockKernels, BlockSumsOfSquaresHaveCpuAdamsBits) {
  struct Case {
    int64_t n, block;
  };
  for (const Case c : {Case{1, 2048}, Case{5, 3}, Case{2048 * 7 + 11, 2048}, Case{10003, 7}}) {
    SCOPED_TRACE("n " + std::to_string(c.n) + ", block " + std::to_string(c.block));
    auto x = randn(static_cast<size_t>(c.n), 41, 0.01f);
    for (int64_t i = 0; i < c.n; i += 5) x[i] *= static_cast<float>(1 << (i % 17));
    const int64_t count = (c.n + c.block - 1) / c.block;
    const int64_t grid = (count * cpu_adam::math::kSquareLanes + kThreads - 1) / kThreads;
    std::vector<double> got(count, std::numeric_limits<double>::quiet_NaN()), want(count);
    simt_launch({static_cast<int>(grid), 1, 1}, kThreads, 0, [&](SimtThread& t) {
      blocks::block_sums_of_squares(t, x.data(), c.n, c.block, count, got.data());
    });
    const cpu_adam::Executor ex(2);
    cpu_adam::block_sums_of_squares(x.data(), DType::F32, c.n, c.block, want.data(), &ex);
    int64_t differ = 0;
    for (int64_t b = 0; b < count; ++b)
      differ += std::bit_cast<uint64_t>(got[b]) != std::bit_cast<uint64_t>(want[b]);
    EXPECT_EQ(differ, 0) << "of " << count << " blocks: first " << got[0] << " vs " << want[0];
  }
}

// The emulation's additions for these bodies: shfl reads a lane of the caller's segment (srcLane
// modulo the width, as __shfl_sync), a 16-byte load off 16 bytes is a fault, and threads() and
// blocks() are the launch's.
TEST(BlockKernels, EmulatedShuffleAndLoadsFollowCuda) {
  std::vector<double> got(64);
  simt_launch({2, 1, 1}, 32, 0, [&](SimtThread& t) {
    EXPECT_EQ(t.threads(), 32);
    EXPECT_EQ(t.blocks(), 2);
    const double mine = 100.0 * t.block(0) + t.thread();
    got[32 * t.block(0) + t.thread()] = t.shfl(mine, 16 + 3, 16);
  });
  for (int b = 0; b < 2; ++b)
    for (int lane = 0; lane < 32; ++lane)
      EXPECT_EQ(got[32 * b + lane], 100.0 * b + (lane < 16 ? 3 : 19)) << b << "/" << lane;
  alignas(16) float data[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT_THROW(simt_launch({1, 1, 1}, 32, 0,
                           [&](SimtThread& t) {
                             float v[4];
                             t.load4(data + 1, v);
                           }),
               std::runtime_error);
  EXPECT_THROW(simt_launch({1, 1, 1}, 32, 0, [&](SimtThread& t) { t.shfl(1.0, 0, 12); }),
               std::runtime_error);
}

}  // namespace
}  // namespace outcore::test
