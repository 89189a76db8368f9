// The host's attention as the fused kernels' reference: the CPU backend's default (head by head,
// blocks of 128 queries), forward and backward, in fp32 or bf16 compute; and the host's causal
// softmax and RMSNorm as the other kernels' references. Shared by the CUDA kernels' tests and
// the SIMT emulation of the kernels' bodies.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/device/compute_backend.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "tests/common/numeric.hpp"

namespace outcore::test {

struct HostAttention {
  std::vector<float> attn, lse, dq, dk, dv;
  std::vector<uint16_t> attn_bf16;  // bf16 compute: attn rounded, as backward read it
};

// `a` in `dtype` on inputs q, k, v, dattn whose values are already bf16 (passed to the backend
// as bf16 bits for BF16, as fp32 for F32).
inline HostAttention host_attention(device::ComputeBackend::Attention a, DType dtype,
                                    const std::vector<std::vector<float>>& in) {
  a.dtype = dtype;
  a.block = 128;
  const auto be = device::cpu_backend();
  std::vector<std::vector<uint16_t>> bits;
  std::vector<const void*> ptr;
  for (const auto& x : in) {
    bits.emplace_back(x.size());
    device::cpu::from_fp32(x.data(), bits.back().data(), DType::BF16,
                           static_cast<int64_t>(x.size()));
    ptr.push_back(dtype == DType::BF16 ? static_cast<const void*>(bits.back().data()) : x.data());
  }
  HostAttention h{std::vector<float>(in[0].size()), std::vector<float>(a.B * a.nh * a.T),
                  std::vector<float>(in[0].size()), std::vector<float>(in[1].size()),
                  std::vector<float>(in[2].size()), {}};
  std::vector<float> scores(a.block * a.T), dprob(a.block * a.T);
  std::vector<uint16_t> lowp(
      std::max<int64_t>(1, device::ComputeBackend::attention_bf16_scratch(a)));
  void* lp = dtype == DType::BF16 ? lowp.data() : nullptr;
  be->attention_forward(a, ptr[0], ptr[1], ptr[2], h.lse.data(), h.attn.data(), scores.data(), lp,
                        nullptr);
  // Backward reads forward's output as the decoder keeps it: rounded to bf16 in bf16 compute.
  const void* attn = h.attn.data();
  if (dtype == DType::BF16) {
    h.attn_bf16.resize(h.attn.size());
    device::cpu::from_fp32(h.attn.data(), h.attn_bf16.data(), DType::BF16,
                           static_cast<int64_t>(h.attn.size()));
    attn = h.attn_bf16.data();
  }
  be->attention_backward(a, ptr[0], ptr[1], ptr[2], h.lse.data(), attn, ptr[3], h.dq.data(),
                         h.dk.data(), h.dv.data(), scores.data(), dprob.data(), lp);
  return h;
}

// Random q, k, v and dattn for `a` whose values are bf16: as fp32 values (the references') and
// as bf16 bits (the fused kernels').
struct AttentionInputs {
  std::vector<std::vector<float>> values;
  std::vector<std::vector<uint16_t>> bits;
};
inline AttentionInputs bf16_attention_inputs(const device::ComputeBackend::Attention& a) {
  const auto tokens = static_cast<size_t>(a.B * a.T);
  const auto q = tokens * static_cast<size_t>(a.nh * a.hd);
  const auto kv = tokens * static_cast<size_t>(a.nkv * a.hd);
  AttentionInputs in{{randn(q, 40), randn(kv, 41), randn(kv, 42), randn(q, 43)}, {}};
  for (auto& x : in.values) {
    const auto n = static_cast<int64_t>(x.size());
    in.bits.emplace_back(x.size());
    device::cpu::from_fp32(x.data(), in.bits.back().data(), DType::BF16, n);
    device::cpu::to_fp32(in.bits.back().data(), DType::BF16, x.data(), n);
  }
  return in;
}

// One case of the fused kernels' tests: a causal GQA attention of `shape` in bf16 compute (the
// host's default blocks of 128 queries), bf16 inputs, and the host's results in bf16 and in fp32
// compute on them.
struct AttentionShape {
  int64_t B, T, nh, nkv, hd;
};
struct AttentionCase {
  device::ComputeBackend::Attention a;
  AttentionInputs in;
  HostAttention want, fp32;
  std::string name;  // "B 2 T 150 heads 4/2 x 64"
};
inline AttentionCase attention_case(const AttentionShape& s) {
  AttentionCase c;
  c.a = {.B = s.B,
         .T = s.T,
         .nh = s.nh,
         .nkv = s.nkv,
         .hd = s.hd,
         .block = 128,
         .scale = 1.0f / std::sqrt(float(s.hd)),
         .dtype = DType::BF16};
  c.in = bf16_attention_inputs(c.a);
  c.want = host_attention(c.a, DType::BF16, c.in.values);
  c.fp32 = host_attention(c.a, DType::F32, c.in.values);
  c.name = "B " + std::to_string(s.B) + " T " + std::to_string(s.T) + " heads " +
           std::to_string(s.nh) + "/" + std::to_string(s.nkv) + " x " + std::to_string(s.hd);
  return c;
}

// ||got - want|| / ||want|| in the 2-norm.
inline double relative_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double d = 0, w = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    d += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    w += double(want[i]) * want[i];
  }
  return w > 0 ? std::sqrt(d / w) : std::sqrt(d);
}

// The fused kernels' tolerance against the host's bf16 attention: within 2e-3 of the largest
// value, and in the 2-norm several times closer to the bf16 reference than fp32 attention is, so
// every probability and score gradient is rounded where the host rounds it.
inline void expect_bf16_attention(const HostAttention& got, const HostAttention& want,
                                  const HostAttention& fp32) {
  const struct {
    const char* name;
    const std::vector<float> HostAttention::*out;
    bool rounded;  // whether bf16 rounding makes the fp32 result differ
  } outputs[] = {{"attn", &HostAttention::attn, true},
                 {"lse", &HostAttention::lse, false},
                 {"dq", &HostAttention::dq, true},
                 {"dk", &HostAttention::dk, true},
                 {"dv", &HostAttention::dv, true}};
  for (const auto& o : outputs) {
    const std::vector<float>& g = got.*o.out;
    const std::vector<float>& w = want.*o.out;
    ASSERT_EQ(g.size(), w.size()) << o.name;
    EXPECT_LT(scaled_error(g.data(), w.data(), g.size()), 2e-3) << o.name;
    if (o.rounded) {
      EXPECT_LT(relative_l2(g, w), 0.25 * relative_l2(fp32.*o.out, w))
          << o.name << ": no closer to the bf16 reference than fp32";
    }
  }
}

// The host's causal softmax over `batch` x `rows` score rows of `keys` keys whose first row is
// query r0, as decoder.cpp runs it: probabilities and lse, the score gradients of `dp`, and
// bf16 attention's numerators with 1 / sum (each row's keys past the causal edge zero).
struct HostCausalSoftmax {
  std::vector<float> p, lse, ds, num, inv;
};
inline HostCausalSoftmax host_causal_softmax(const std::vector<float>& scores,
                                             const std::vector<float>& dp, int64_t batch,
                                             int64_t rows, int64_t keys, int64_t r0) {
  namespace hk = device::cpu;
  HostCausalSoftmax h{scores, std::vector<float>(batch * rows), dp, scores,
                      std::vector<float>(batch * rows)};
  for (int64_t r = 0; r < batch * rows; ++r) {
    float* row = h.p.data() + r * keys;
    const int64_t n = kmath::causal_keys(r0 + r % rows);
    h.lse[r] = hk::softmax_inplace(row, n);
    std::fill(row + n, row + keys, 0.0f);
    float* d = h.ds.data() + r * keys;
    const float dd = hk::dot(row, d, n);
    for (int64_t j = 0; j < keys; ++j) d[j] = j < n ? kmath::softmax_grad(row[j], d[j], dd) : 0.0f;
    float* nr = h.num.data() + r * keys;
    hk::softmax_numerators(nr, n, &h.inv[r]);
    std::fill(nr + n, nr + keys, 0.0f);
  }
  return h;
}

// RMSNorm on the host over random rows x dim inputs (seeds seed, seed + 1, seed + 2), eps 1e-5:
// y and rstd, and the backward added into dx (starting at 0.5) and dw (starting at dw_start).
struct HostRmsNorm {
  std::vector<float> x, w, dy, y, rstd, dx, dw;
  float dw_start = 0;
};
inline HostRmsNorm host_rmsnorm(int64_t rows, int64_t dim, uint32_t seed, float dw_start) {
  namespace hk = device::cpu;
  HostRmsNorm h{randn(rows * dim, seed),           randn(dim, seed + 1),
                randn(rows * dim, seed + 2),       std::vector<float>(rows * dim),
                std::vector<float>(rows),          std::vector<float>(rows * dim, 0.5f),
                std::vector<float>(dim, dw_start), dw_start};
  hk::rmsnorm_forward(h.x.data(), h.w.data(), 1e-5f, rows, dim, h.y.data(), h.rstd.data());
  hk::rmsnorm_backward(h.dy.data(), h.x.data(), h.w.data(), h.rstd.data(), rows, dim, h.dx.data(),
                       h.dw.data());
  return h;
}

// A device's dw against the host's. dw is a sum over rows whose order differs (the host adds row
// by row, a device in row lanes), and the sum can cancel: its rounding scales with the sum of the
// terms' magnitudes, not with the result (4096 rows at Llama 3 8B's shape: 1.1e-4 on a column
// summing to 1.02 whose terms' magnitudes sum to ~3300). A few ulps of that sum (16 eps) still
// leave a dropped or wrong row's term, O(1), far outside.
inline void expect_rmsnorm_dw(const std::vector<float>& got, const HostRmsNorm& h, int64_t rows,
                              int64_t dim) {
  for (int64_t j = 0; j < dim; ++j) {
    double magnitude = std::abs(h.dw_start);
    for (int64_t r = 0; r < rows; ++r)
      magnitude +=
          std::abs(double(kmath::rmsnorm_dw(h.dy[r * dim + j], h.x[r * dim + j], h.rstd[r])));
    ASSERT_NEAR(got[j], h.dw[j], 16 * 0x1p-24 * magnitude) << "dw @" << j;
  }
}

}  // namespace outcore::test
