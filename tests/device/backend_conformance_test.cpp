// Every ComputeBackend operation on every backend this machine has, on the same small inputs,
// against the host reference: the host kernels of engine/device/cpu (fp32), and a plain fp64
// reference for attention. Backends: "cpu" (cpu_backend() on a CpuDevice), "cpu_discrete" (the
// CPU backend on a discrete CpuDevice, through its host view) and "cuda" (make_cuda_backend on
// GPU 0; skipped, saying why, without a usable GPU).
//
// Tolerances. The CPU backends run the host kernels themselves, so every result must have the
// reference's bits. The CUDA backend (as tests/device/cuda_kernels_test.cpp):
//   memory operations, casts, add, embedding gather and scatter-add: exact;
//   SwiGLU, RoPE: 2e-6 relative (the GPU may fuse a multiply-add the host rounds twice);
//   RMSNorm, causal softmax, cross-entropy: 1e-5 relative (block-tree reductions), dw 1e-4;
//   GEMM: 1e-5 of k * max|a| * max|b| (fp32, no TF32).
// Attention on every backend: 1e-4 relative to the fp64 reference.
#include <gtest/gtest.h>
#include <tbb/global_control.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/cpu/bf16_gemm.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "engine/device/device.hpp"
#include "engine/device/kernel_math.hpp"
#include "engine/device/profiling_backend.hpp"
#include "tests/common/numeric.hpp"

namespace outcore::device {
namespace {

using outcore::test::expect_close;
using outcore::test::randn;

// A buffer on `dev` holding `host`, written through `be`.
template <typename T>
DeviceBuffer put_on(Device& dev, ComputeBackend& be, const std::vector<T>& host) {
  DeviceBuffer b = dev.alloc(std::max<size_t>(1, host.size()) * sizeof(T), "conformance");
  be.upload(b.data(), host.data(), host.size() * sizeof(T));
  return b;
}
// The first `n` elements of `b`, after every operation queued on `be`.
template <typename T = float>
std::vector<T> get_from(ComputeBackend& be, const DeviceBuffer& b, size_t n) {
  std::vector<T> host(n);
  be.download(host.data(), b.data(), n * sizeof(T));
  return host;
}
std::vector<uint16_t> bf16_of(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  cpu::from_fp32(x.data(), h.data(), DType::BF16, static_cast<int64_t>(x.size()));
  return h;
}

// Attention's operands (`x` rounded to bf16 in bf16) and outputs: lse, attn (in bf16 the fp32
// scratch), dq, dk, dv and, in bf16, attn rounded (its bits, as floats) from one forward and
// backward on `be` (buffers on `dev`), dk and dv added into dk0 and dv0.
struct AttentionInputs {
  std::vector<float> q, k, v, dattn, dk0, dv0;
};
std::vector<std::vector<float>> attention_outputs(Device& dev, ComputeBackend& be,
                                                  const ComputeBackend::Attention& a,
                                                  const AttentionInputs& in) {
  const bool bf16 = a.dtype == DType::BF16;
  auto put = [&](const auto& host) { return put_on(dev, be, host); };
  auto operand = [&](const std::vector<float>& x) { return bf16 ? put(bf16_of(x)) : put(x); };
  const int64_t tokens = a.B * a.T, Q = a.nh * a.hd, KV = a.nkv * a.hd;
  DeviceBuffer q = operand(in.q), k = operand(in.k), v = operand(in.v), da = operand(in.dattn);
  DeviceBuffer L = put(std::vector<float>(a.B * a.nh * a.T)),
               O = put(std::vector<float>(tokens * Q)),
               O16 = put(std::vector<uint16_t>(tokens * Q));
  DeviceBuffer S = put(std::vector<float>(a.block * a.T)),
               P = put(std::vector<float>(a.block * a.T));
  DeviceBuffer LP = put(std::vector<uint16_t>(ComputeBackend::attention_bf16_scratch(a)));
  DeviceBuffer DQ = put(std::vector<float>(tokens * Q)), DK = put(in.dk0), DV = put(in.dv0);
  void* lowp = bf16 ? LP.data() : nullptr;
  be.attention_forward(a, q.data(), k.data(), v.data(), L.as<float>(), O.as<float>(), S.as<float>(),
                       lowp, bf16 ? O16.data() : nullptr);
  be.attention_backward(a, q.data(), k.data(), v.data(), L.as<float>(),
                        bf16 ? O16.data() : O.data(), da.data(), DQ.as<float>(), DK.as<float>(),
                        DV.as<float>(), S.as<float>(), P.as<float>(), lowp);
  be.finish();
  std::vector<std::vector<float>> out{get_from(be, L, a.B * a.nh * a.T),
                                      get_from(be, O, tokens * Q), get_from(be, DQ, tokens * Q),
                                      get_from(be, DK, tokens * KV), get_from(be, DV, tokens * KV)};
  if (bf16) {
    const auto o16 = get_from<uint16_t>(be, O16, tokens * Q);
    out.emplace_back(o16.begin(), o16.end());
  }
  return out;
}
AttentionInputs attention_inputs(const ComputeBackend::Attention& a, uint32_t seed) {
  const int64_t tokens = a.B * a.T, Q = a.nh * a.hd, KV = a.nkv * a.hd;
  return {randn(tokens * Q, seed),     randn(tokens * KV, seed + 1), randn(tokens * KV, seed + 2),
          randn(tokens * Q, seed + 3), randn(tokens * KV, seed + 4), randn(tokens * KV, seed + 5)};
}
constexpr const char* kAttentionOutputs[] = {"lse", "attn", "dq", "dk", "dv", "attn (bf16 bits)"};
void expect_same_attention(const std::vector<std::vector<float>>& got,
                           const std::vector<std::vector<float>>& want, DType dtype) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    expect_close(got[i], want[i], 0.0, std::string(dtype_name(dtype)) + " " + kAttentionOutputs[i]);
}

class BackendConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "cuda") {
      const ProbeResult p = probe();
      if (!p.available) GTEST_SKIP() << "no usable GPU: " << p.summary();
      device_ = make_cuda_device();
    } else {
      device_ = std::make_unique<CpuDevice>(CpuDeviceOptions{.discrete = GetParam() != "cpu"});
    }
    backend_ = make_backend(*device_);
  }

  bool cuda() const { return GetParam() == "cuda"; }
  // The tolerance the CUDA backend gets for an operation; the CPU backends must be exact.
  double tol(double cuda_rel) const { return cuda() ? cuda_rel : 0.0; }

  // A device buffer holding `host`.
  template <typename T>
  DeviceBuffer put(const std::vector<T>& host) {
    return put_on(*device_, *backend_, host);
  }
  // A device buffer holding `x` rounded to bf16.
  DeviceBuffer put_bf16(const std::vector<float>& x) { return put(bf16_of(x)); }
  // The first `n` elements of `b`, after every queued operation.
  template <typename T = float>
  std::vector<T> get(const DeviceBuffer& b, size_t n) {
    return get_from<T>(*backend_, b, n);
  }

  std::unique_ptr<Device> device_;
  std::shared_ptr<ComputeBackend> backend_;  // destroyed before device_
};

TEST_P(BackendConformance, CopyZeroUploadDownloadAreExact) {
  const auto x = randn(1037, 1);
  DeviceBuffer a = put(x), b = put(std::vector<float>(x.size(), 7.0f));
  backend_->copy(b.data(), a.data(), 100 * sizeof(float));
  backend_->zero(a.data(), 10 * sizeof(float));
  std::vector<float> want_b(x.size(), 7.0f), want_a = x;
  std::copy(x.begin(), x.begin() + 100, want_b.begin());
  std::fill(want_a.begin(), want_a.begin() + 10, 0.0f);
  backend_->finish();
  expect_close(get(b, x.size()), want_b, 0.0, "copy");
  expect_close(get(a, x.size()), want_a, 0.0, "zero");
}

TEST_P(BackendConformance, ConstantAndStagedIdsHoldTheHostValues) {
  const auto table = randn(123, 2);
  const float* c = backend_->constant(table);
  std::vector<float> back(table.size());
  backend_->download(back.data(), c, table.size() * sizeof(float));
  expect_close(back, table, 0.0, "constant");

  const std::vector<int32_t> ids0{3, 1, 4, 1, 5}, ids1{9, 2, 6};
  const int32_t* s0 = backend_->stage_ids(ids0.data(), 5, 0);
  const int32_t* s1 = backend_->stage_ids(ids1.data(), 3, 1);  // slot 0 stays valid
  std::vector<int32_t> got0(5), got1(3);
  backend_->download(got0.data(), s0, 5 * sizeof(int32_t));
  backend_->download(got1.data(), s1, 3 * sizeof(int32_t));
  EXPECT_EQ(got0, ids0);
  EXPECT_EQ(got1, ids1);
  backend_->finish();
}

TEST_P(BackendConformance, GemmMatchesTheHostForEveryTransposeAndBeta) {
  const int64_t m = 13, n = 21, k = 37, lda = 40, ldb = 41, ldc = 23;
  for (float beta : {0.0f, 2.0f}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const auto a = randn(40 * lda, 3), b = randn(40 * ldb, 4);
        auto c = randn(m * ldc, 5);
        if (beta == 0.0f) c[0] = std::numeric_limits<float>::quiet_NaN();  // ignored
        auto want = c;
        cpu::gemm(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, beta, want.data(), ldc);
        DeviceBuffer A = put(a), B = put(b), C = put(c);
        backend_->gemm(ta, tb, m, n, k, 0.5f, A.as<float>(), lda, B.as<float>(), ldb, beta,
                       C.as<float>(), ldc);
        const auto got = get(C, c.size());
        double ma = 0, mb = 0;
        for (float e : a) ma = std::max(ma, double(std::abs(e)));
        for (float e : b) mb = std::max(mb, double(std::abs(e)));
        const double abs_tol = cuda() ? 1e-5 * k * ma * mb : 0.0;
        for (size_t i = 0; i < got.size(); ++i) {
          const std::string what = "gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                                   " beta=" + std::to_string(beta) + " @" + std::to_string(i);
          if (abs_tol == 0.0)
            ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i])) << what;
          else
            ASSERT_NEAR(got[i], want[i], abs_tol) << what;
        }
      }
    }
  }
}

TEST_P(BackendConformance, ToFp32IsExactForEveryDtype) {
  auto x = randn(1037, 6, 50.0f);
  x[3] = std::numeric_limits<float>::infinity();
  x[4] = 1e-6f;  // an fp16 subnormal
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    std::vector<uint16_t> raw(x.size() * 2);
    cpu::from_fp32(x.data(), raw.data(), t, static_cast<int64_t>(x.size()));
    std::vector<float> want(x.size());
    cpu::to_fp32(raw.data(), t, want.data(), static_cast<int64_t>(x.size()));
    DeviceBuffer src = put(raw), dst = put(std::vector<float>(x.size()));
    backend_->to_fp32(src.data(), t, dst.as<float>(), static_cast<int64_t>(x.size()));
    expect_close(get(dst, x.size()), want, 0.0, std::string("to_fp32 ") + dtype_name(t).data());
  }
}

TEST_P(BackendConformance, FromFp32RoundsToNearestEvenForEveryDtype) {
  auto x = randn(1037, 30, 50.0f);
  x[3] = std::numeric_limits<float>::infinity();
  x[4] = 1e-6f;                              // an fp16 subnormal
  x[5] = std::bit_cast<float>(0x3f808000u);  // a bf16 tie: rounds to even (down)
  x[6] = std::bit_cast<float>(0x3f818000u);  // a bf16 tie: rounds to even (up)
  for (DType t : {DType::BF16, DType::F16}) {
    std::vector<uint16_t> want(x.size());
    cpu::from_fp32(x.data(), want.data(), t, static_cast<int64_t>(x.size()));
    DeviceBuffer src = put(x), dst = put(std::vector<uint16_t>(x.size()));
    backend_->from_fp32(src.as<float>(), dst.data(), t, static_cast<int64_t>(x.size()));
    EXPECT_EQ(get<uint16_t>(dst, x.size()), want) << "from_fp32 " << dtype_name(t);
  }
  EXPECT_EQ(fp32_to_bf16(x[5]), 0x3f80);
  EXPECT_EQ(fp32_to_bf16(x[6]), 0x3f82);
}

// bf16 operands, fp32 accumulation: the host's bf16 GEMM (cpu/bf16_gemm.hpp, which
// tests/device/bf16_gemm_test.cpp holds to the exact products' sum), exactly on the CPU backends.
TEST_P(BackendConformance, GemmBf16MatchesTheHostBf16Gemm) {
  const int64_t m = 13, n = 21, k = 37, lda = 40, ldb = 41, ldc = 23;
  for (float beta : {0.0f, 2.0f}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const auto af = randn(40 * lda, 31), bf = randn(40 * ldb, 32);
        std::vector<uint16_t> a(af.size()), b(bf.size());
        cpu::from_fp32(af.data(), a.data(), DType::BF16, static_cast<int64_t>(a.size()));
        cpu::from_fp32(bf.data(), b.data(), DType::BF16, static_cast<int64_t>(b.size()));
        auto c = randn(m * ldc, 33);
        if (beta == 0.0f) c[0] = std::numeric_limits<float>::quiet_NaN();  // ignored
        auto want = c;
        cpu::gemm_bf16(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, beta, want.data(), ldc);
        DeviceBuffer A = put(a), B = put(b), C = put(c);
        backend_->gemm_bf16(ta, tb, m, n, k, 0.5f, A.data(), lda, B.data(), ldb, beta,
                            C.as<float>(), ldc);
        expect_close(get(C, c.size()), want, tol(1e-5 * k),
                     "gemm_bf16 ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                         " beta=" + std::to_string(beta));
      }
    }
  }
}

TEST_P(BackendConformance, AddInplaceIsExact) {
  for (const int64_t n : {int64_t{1036}, int64_t{1037}}) {  // 16-byte loads on the GPU, or not
    const auto x = randn(n, 7), y = randn(n, 8);
    auto want = y;
    cpu::add_inplace(want.data(), x.data(), n);
    DeviceBuffer X = put(x), Y = put(y);
    backend_->add_inplace(Y.as<float>(), X.as<float>(), n);
    expect_close(get(Y, n), want, 0.0, "add_inplace " + std::to_string(n));
  }
}

// Each of the first `cols` columns of a strided row times its scale, exactly; the columns past
// them untouched.
TEST_P(BackendConformance, ScaleRowsIsExact) {
  const int64_t rows = 5, cols = 37, ld = 40;
  const auto x = randn(rows * ld, 9), scale = randn(rows, 10);
  std::vector<float> want = x;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) want[r * ld + c] = x[r * ld + c] * scale[r];
  DeviceBuffer X = put(x), S = put(scale);
  backend_->scale_rows(X.as<float>(), rows, cols, ld, S.as<float>());
  expect_close(get(X, x.size()), want, 0.0, "scale_rows");
}

// Every element of `got` (bf16 bits) is `fp32[i]` rounded as from_fp32 rounds it.
void expect_bf16_of(const std::vector<uint16_t>& got, const std::vector<float>& fp32,
                    const char* what) {
  ASSERT_EQ(got.size(), fp32.size()) << what;
  size_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += got[i] != kmath::fp32_to_bf16(fp32[i]);
  EXPECT_EQ(differ, 0u) << what << ": of " << got.size();
}

TEST_P(BackendConformance, RmsNormForwardAndBackwardMatchTheHost) {
  const int64_t rows = 7, dim = 133;
  const float eps = 1e-5f;
  const auto x = randn(rows * dim, 9), w = randn(dim, 10), dy = randn(rows * dim, 11);
  std::vector<float> y(rows * dim), rstd(rows), dx(rows * dim, 0.5f), dw(dim, 0.25f);
  cpu::rmsnorm_forward(x.data(), w.data(), eps, rows, dim, y.data(), rstd.data());
  cpu::rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), rows, dim, dx.data(),
                        dw.data());
  DeviceBuffer X = put(x), W = put(w), DY = put(dy), Y = put(std::vector<float>(rows * dim)),
               R = put(std::vector<float>(rows)), DX = put(std::vector<float>(rows * dim, 0.5f)),
               DW = put(std::vector<float>(dim, 0.25f));
  backend_->rmsnorm_forward(X.as<float>(), W.as<float>(), eps, rows, dim, Y.as<float>(),
                            R.as<float>(), nullptr);
  backend_->rmsnorm_backward(DY.as<float>(), X.as<float>(), W.as<float>(), R.as<float>(), rows, dim,
                             DX.as<float>(), DW.as<float>());
  const std::vector<float> y_got = get(Y, y.size());
  expect_close(y_got, y, tol(1e-5), "y");
  expect_close(get(R, rstd.size()), rstd, tol(1e-5), "rstd");
  expect_close(get(DX, dx.size()), dx, tol(1e-5), "dx");
  expect_close(get(DW, dw.size()), dw, tol(1e-4), "dw");
  // y rounded to bf16 by the kernel itself: this backend's fp32 y, rounded as from_fp32 rounds.
  DeviceBuffer Y16 = put(std::vector<uint16_t>(y.size(), 0x7fc1)),
               R16 = put(std::vector<float>(rows));
  backend_->rmsnorm_forward(X.as<float>(), W.as<float>(), eps, rows, dim, nullptr, R16.as<float>(),
                            Y16.data());
  expect_bf16_of(get<uint16_t>(Y16, y.size()), y_got, "y in bf16");
  expect_close(get(R16, rows), get(R, rows), 0.0, "rstd with y in bf16");
}

TEST_P(BackendConformance, RopeForwardAndInverseMatchTheHost) {
  // Head size 16: four pairs a thread on the GPU (16-byte loads); 12: one pair at a time.
  for (const int64_t hd : {int64_t{16}, int64_t{12}}) {
    SCOPED_TRACE(hd);
    const int64_t rows = 12, seq = 6, heads = 3;
    const auto x = randn(rows * heads * hd, 12), c = randn(seq * hd / 2, 13),
               s = randn(seq * hd / 2, 14);
    const float* dc = backend_->constant(c);
    const float* ds = backend_->constant(s);
    for (bool inverse : {false, true}) {
      auto want = x;
      cpu::rope(want.data(), rows, seq, heads, hd, c.data(), s.data(), inverse);
      DeviceBuffer X = put(x);
      backend_->rope(X.as<float>(), rows, seq, heads, hd, dc, ds, inverse, nullptr);
      const std::vector<float> got = get(X, x.size());
      expect_close(got, want, tol(2e-6), inverse ? "rope inverse" : "rope");
      // With a bf16 output: the same fp32 result, and that result rounded there.
      DeviceBuffer X2 = put(x), X16 = put(std::vector<uint16_t>(x.size(), 0x7fc1));
      backend_->rope(X2.as<float>(), rows, seq, heads, hd, dc, ds, inverse, X16.data());
      expect_close(get(X2, x.size()), got, 0.0, "rope with a bf16 output");
      expect_bf16_of(get<uint16_t>(X16, x.size()), got, "rope in bf16");
    }
  }
}

TEST_P(BackendConformance, SwigluForwardAndBackwardMatchTheHost) {
  // 1036: four elements a thread on the GPU (16-byte loads); 1037: one at a time.
  for (const int64_t n : {int64_t{1036}, int64_t{1037}}) {
    SCOPED_TRACE(n);
    const auto g = randn(n, 15, 3.0f), u = randn(n, 16), da = randn(n, 17);
    std::vector<float> a(n), dg(n), du(n);
    cpu::swiglu_forward(g.data(), u.data(), a.data(), n);
    cpu::swiglu_backward(da.data(), g.data(), u.data(), dg.data(), du.data(), n);
    DeviceBuffer G = put(g), U = put(u), DA = put(da), A = put(std::vector<float>(n)),
                 DG = put(std::vector<float>(n)), DU = put(std::vector<float>(n));
    backend_->swiglu_forward(G.as<float>(), U.as<float>(), A.as<float>(), n, nullptr);
    backend_->swiglu_backward(DA.as<float>(), G.as<float>(), U.as<float>(), DG.as<float>(),
                              DU.as<float>(), n, nullptr, nullptr);
    const std::vector<float> a_got = get(A, n), dg_got = get(DG, n), du_got = get(DU, n);
    expect_close(a_got, a, tol(2e-6), "swiglu");
    expect_close(dg_got, dg, tol(2e-6), "dg");
    expect_close(du_got, du, tol(2e-6), "du");
    // The results rounded to bf16 by the kernels themselves: this backend's fp32 ones, rounded.
    DeviceBuffer A16 = put(std::vector<uint16_t>(n, 0x7fc1)),
                 DG16 = put(std::vector<uint16_t>(n, 0x7fc1)),
                 DU16 = put(std::vector<uint16_t>(n, 0x7fc1));
    backend_->swiglu_forward(G.as<float>(), U.as<float>(), nullptr, n, A16.data());
    backend_->swiglu_backward(DA.as<float>(), G.as<float>(), U.as<float>(), nullptr, nullptr, n,
                              DG16.data(), DU16.data());
    expect_bf16_of(get<uint16_t>(A16, n), a_got, "swiglu in bf16");
    expect_bf16_of(get<uint16_t>(DG16, n), dg_got, "dg in bf16");
    expect_bf16_of(get<uint16_t>(DU16, n), du_got, "du in bf16");
    // dg may alias da.
    DeviceBuffer DA2 = put(da), DU2 = put(std::vector<float>(n));
    backend_->swiglu_backward(DA2.as<float>(), G.as<float>(), U.as<float>(), DA2.as<float>(),
                              DU2.as<float>(), n, nullptr, nullptr);
    expect_close(get(DA2, n), dg, tol(2e-6), "dg aliasing da");
    expect_close(get(DU2, n), du, tol(2e-6), "du with dg aliasing da");
  }
}

TEST_P(BackendConformance, CausalSoftmaxForwardAndBackwardMatchTheHost) {
  const int64_t rows = 9, keys = 20, first_query = keys - rows;
  const auto scores = randn(rows * keys, 18, 2.0f), dp = randn(rows * keys, 19);
  std::vector<float> p = scores, lse(rows), q = scores, ds = dp;
  for (int64_t i = 0; i < rows; ++i) {  // as the CPU backend: host kernels row by row
    const int64_t n = kmath::causal_keys(first_query + i);
    float* row = p.data() + i * keys;
    lse[i] = cpu::softmax_inplace(row, n);
    std::fill(row + n, row + keys, 0.0f);
    // Backward recomputes prob = exp(scores - lse) from the forward's lse.
    float* pr = q.data() + i * keys;
    cpu::exp_shift(pr, lse[i], n);
    std::fill(pr + n, pr + keys, 0.0f);
    float* d = ds.data() + i * keys;
    const float dd = cpu::dot(pr, d, n);
    for (int64_t j = 0; j < keys; ++j) d[j] = j < n ? kmath::softmax_grad(pr[j], d[j], dd) : 0.0f;
  }
  DeviceBuffer S = put(scores), L = put(std::vector<float>(rows));
  backend_->causal_softmax_forward(S.as<float>(), L.as<float>(), rows, keys, first_query, nullptr);
  expect_close(get(S, p.size()), p, tol(1e-5), "prob");
  expect_close(get(L, rows), lse, tol(1e-5), "lse");
  // bf16 attention's numerators: exp(x - m), m the row's max rounded up to a multiple of ln 2
  // (so the largest lies in (1/2, 1]), and 1 / their sum; the same log-sum-exp.
  DeviceBuffer SN = put(scores), LN = put(std::vector<float>(rows)),
               IN = put(std::vector<float>(rows));
  backend_->causal_softmax_forward(SN.as<float>(), LN.as<float>(), rows, keys, first_query,
                                   IN.as<float>());
  const std::vector<float> num = get(SN, p.size()), inv = get(IN, rows);
  std::vector<float> host_num = scores, host_inv(rows), host_lse(rows), exact(num.size());
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t n = kmath::causal_keys(first_query + i);
    float* row = host_num.data() + i * keys;
    host_lse[i] = cpu::softmax_numerators(row, n, &host_inv[i]);
    std::fill(row + n, row + keys, 0.0f);
    double mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max<double>(mx, scores[i * keys + j]);
    const double m = std::ceil(mx / std::log(2.0)) * std::log(2.0);
    for (int64_t j = 0; j < n; ++j) exact[i * keys + j] = float(std::exp(scores[i * keys + j] - m));
    const float top = *std::max_element(num.begin() + i * keys, num.begin() + i * keys + n);
    EXPECT_TRUE(top > 0.5f && top <= 1.0f) << "row " << i << "'s largest numerator " << top;
  }
  expect_close(host_num, exact, 1e-5, "the host's numerators against their definition");
  expect_close(num, host_num, tol(1e-5), "numerators");
  expect_close(inv, host_inv, tol(1e-5), "1 / sum");
  expect_close(get(LN, rows), host_lse, tol(1e-5), "lse with numerators");
  expect_close(host_lse, lse, 1e-5, "the same lse as the softmax's");
  DeviceBuffer S2 = put(scores), DP = put(dp), L2 = put(lse);
  backend_->causal_softmax_backward(S2.as<float>(), DP.as<float>(), L2.as<float>(), rows, keys,
                                    first_query, nullptr);
  expect_close(get(S2, q.size()), q, tol(1e-5), "recomputed prob");
  expect_close(get(DP, ds.size()), ds, tol(1e-5), "dscores");
  // A given D replaces each row's sum(prob * dp).
  const auto delta = randn(rows, 21);
  std::vector<float> ds_given = dp;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t n = kmath::causal_keys(first_query + i);
    for (int64_t j = 0; j < keys; ++j) {
      float& d = ds_given[i * keys + j];
      d = j < n ? kmath::softmax_grad(q[i * keys + j], d, delta[i]) : 0.0f;
    }
  }
  DeviceBuffer S3 = put(scores), DP3 = put(dp), D3 = put(delta);
  backend_->causal_softmax_backward(S3.as<float>(), DP3.as<float>(), L2.as<float>(), rows, keys,
                                    first_query, D3.as<float>());
  expect_close(get(S3, q.size()), q, tol(1e-5), "recomputed prob, D given");
  expect_close(get(DP3, ds.size()), ds_given, tol(1e-5), "dscores, D given");
}

// D of every (sequence, head, token) row: kmath::bf16_row_dot of the head's values, the same bits
// on every backend; other dtypes are refused.
TEST_P(BackendConformance, AttentionDeltaIsTheRowDotOfOutputAndGradient) {
  // Head size 40: the GPU loads eight values at a time; 12: one at a time.
  for (const int64_t hd : {int64_t{40}, int64_t{12}}) {
    SCOPED_TRACE(hd);
    const ComputeBackend::Attention a{.B = 2,
                                      .T = 7,
                                      .nh = 3,
                                      .nkv = 1,
                                      .hd = hd,
                                      .block = 4,
                                      .scale = 0.25f,
                                      .dtype = DType::BF16};
    const int64_t n = a.B * a.T * a.nh * a.hd;
    std::vector<uint16_t> attn(n), dattn(n);
    const auto x = randn(n, 22), y = randn(n, 23);
    cpu::from_fp32(x.data(), attn.data(), DType::BF16, n);
    cpu::from_fp32(y.data(), dattn.data(), DType::BF16, n);
    std::vector<float> want(a.B * a.nh * a.T);
    for (int64_t b = 0; b < a.B; ++b)
      for (int64_t t = 0; t < a.T; ++t)
        for (int64_t h = 0; h < a.nh; ++h) {
          const int64_t at = ((b * a.T + t) * a.nh + h) * a.hd;
          float sum = 0.0f;
          for (int64_t d = 0; d < a.hd; ++d)
            sum += kmath::bf16_to_fp32(attn[at + d]) * kmath::bf16_to_fp32(dattn[at + d]);
          want[(b * a.nh + h) * a.T + t] = sum;
        }
    DeviceBuffer A = put(attn), DA = put(dattn), D = put(std::vector<float>(want.size()));
    backend_->attention_delta(a, A.data(), DA.data(), D.as<float>());
    expect_close(get(D, want.size()), want, 0.0, "D");
    ComputeBackend::Attention f32 = a;
    f32.dtype = DType::F32;
    EXPECT_THROW(backend_->attention_delta(f32, A.data(), DA.data(), D.as<float>()),
                 InvalidArgument);
  }
}

TEST_P(BackendConformance, CrossEntropyLossAndGradientMatchTheHost) {
  const int64_t rows = 6, vocab = 301;
  const float coef = 1.0f / rows;
  const auto logits = randn(rows * vocab, 20, 3.0f);
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) targets[r] = static_cast<int32_t>((r * 37) % vocab);
  targets[1] = -1;    // masked rows (model::kIgnoreTarget): no loss, no gradient
  targets[4] = -100;  // Hugging Face's label for it
  std::vector<float> grad = logits, loss(rows), loss_only(rows);
  for (int64_t r = 0; r < rows; ++r) {  // as the CPU backend
    float* row = grad.data() + r * vocab;
    if (targets[r] < 0) {
      std::fill(row, row + vocab, 0.0f);
      continue;
    }
    const float target_logit = row[targets[r]];
    loss_only[r] = kmath::xent_loss(cpu::log_sum_exp(row, vocab), target_logit);
    loss[r] = kmath::xent_loss(cpu::softmax_inplace(row, vocab), target_logit);
    for (int64_t j = 0; j < vocab; ++j) row[j] = kmath::xent_scale(row[j], coef);
    row[targets[r]] = kmath::xent_target(row[targets[r]], coef);
  }
  DeviceBuffer X = put(logits), X2 = put(logits), T = put(targets),
               RL = put(std::vector<float>(rows)), RL2 = put(std::vector<float>(rows));
  backend_->cross_entropy(X.as<float>(), T.as<int32_t>(), rows, vocab, coef, true, RL.as<float>(),
                          nullptr);
  backend_->cross_entropy(X2.as<float>(), T.as<int32_t>(), rows, vocab, coef, false,
                          RL2.as<float>(), nullptr);
  expect_close(get(RL, rows), loss, tol(1e-5), "loss");
  expect_close(get(RL2, rows), loss_only, tol(1e-5), "loss without gradient");
  const std::vector<float> dlogits = get(X, grad.size());
  expect_close(dlogits, grad, tol(1e-5), "dlogits");
  expect_close(get(X2, logits.size()), logits, 0.0, "logits untouched without gradient");

  // The gradient rounded to bf16 by the kernel itself: the fp32 gradient's bits, rounded as
  // from_fp32 rounds them, masked rows zeros; the loss is the same.
  DeviceBuffer X3 = put(logits), RL3 = put(std::vector<float>(rows)),
               G = put(std::vector<uint16_t>(grad.size(), 0x7fc1));
  backend_->cross_entropy(X3.as<float>(), T.as<int32_t>(), rows, vocab, coef, true, RL3.as<float>(),
                          G.data());
  const std::vector<uint16_t> g16 = get<uint16_t>(G, grad.size());
  size_t differ = 0;
  for (size_t i = 0; i < g16.size(); ++i) differ += g16[i] != kmath::fp32_to_bf16(dlogits[i]);
  EXPECT_EQ(differ, 0u) << "of " << g16.size() << " bf16 gradients";
  EXPECT_EQ(g16[1 * vocab + 7], 0u) << "a masked row's gradient";
  expect_close(get(RL3, rows), get(RL, rows), 0.0, "loss with the bf16 gradient");
}

TEST_P(BackendConformance, EmbeddingGatherAndScatterAddAreExact) {
  const int64_t vocab = 17, hidden = 40, n = 30;
  const auto table = randn(vocab * hidden, 21);
  std::vector<int32_t> ids(n);
  std::mt19937 rng(22);
  for (auto& i : ids) i = static_cast<int32_t>(rng() % 5);  // many repeats
  const int32_t* staged = backend_->stage_ids(ids.data(), n, 0);
  DeviceBuffer I = put(ids);
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    std::vector<uint16_t> raw(table.size() * 2);
    cpu::from_fp32(table.data(), raw.data(), t, static_cast<int64_t>(table.size()));
    std::vector<float> want(n * hidden);
    for (int64_t i = 0; i < n; ++i)
      cpu::to_fp32(raw.data() + ids[i] * hidden * dtype_size(t) / 2, t, want.data() + i * hidden,
                   hidden);
    DeviceBuffer TB = put(raw), O = put(std::vector<float>(n * hidden));
    backend_->embedding_forward(TB.data(), t, staged, n, hidden, O.as<float>());
    expect_close(get(O, want.size()), want, 0.0, std::string("gather ") + dtype_name(t).data());
  }
  const auto dy = randn(n * hidden, 23);
  std::vector<float> grad(vocab * hidden, 0.5f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < hidden; ++j) grad[ids[i] * hidden + j] += dy[i * hidden + j];
  DeviceBuffer DY = put(dy), GR = put(std::vector<float>(vocab * hidden, 0.5f));
  backend_->embedding_backward(I.as<int32_t>(), DY.as<float>(), n, hidden, GR.as<float>());
  expect_close(get(GR, grad.size()), grad, 0.0, "scatter-add");
}

// Causal attention with grouped kv heads in fp64, straight from the definition.
struct AttentionReference {
  std::vector<float> attn, lse, dq, dk, dv;
};

// With `bf16`, at the rounding points of the bf16 compute dtype: q, k, v and dattn rounded to
// bf16, the softmax's numerators (forward), the probabilities and score gradients (backward)
// rounded where a GEMM reads them, and each row's D = sum(p dp) taken as the dot of its output,
// rounded, and dattn.
AttentionReference attention_reference(const ComputeBackend::Attention& a, std::vector<float> q,
                                       std::vector<float> k, std::vector<float> v,
                                       std::vector<float> dattn, bool bf16 = false) {
  auto r16 = [bf16](double x) { return bf16 ? double(round_to(DType::BF16, float(x))) : x; };
  for (auto* t : {&q, &k, &v, &dattn})
    for (float& x : *t) x = static_cast<float>(r16(x));
  const int64_t Q = a.nh * a.hd, KV = a.nkv * a.hd, group = a.nh / a.nkv;
  AttentionReference r;
  r.attn.assign(q.size(), 0.0f);
  r.dq.assign(q.size(), 0.0f);
  r.lse.assign(a.B * a.nh * a.T, 0.0f);
  std::vector<double> dk(k.size()), dv(v.size()), p(a.T), num(a.T), dp(a.T);
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t h = 0; h < a.nh; ++h) {
      const int64_t g = h / group;
      for (int64_t t = 0; t < a.T; ++t) {
        const float* qt = &q[(b * a.T + t) * Q + h * a.hd];
        const float* dot = &dattn[(b * a.T + t) * Q + h * a.hd];
        auto kv_at = [&](int64_t j) { return (b * a.T + j) * KV + g * a.hd; };
        double mx = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          double s = 0;
          for (int64_t d = 0; d < a.hd; ++d) s += double(qt[d]) * k[kv_at(j) + d];
          p[j] = s * a.scale;
          mx = std::max(mx, p[j]);
        }
        // bf16: forward rounds the numerators exp(s - m), m the max rounded up to a multiple
        // of ln 2, and divides by their sum after the product with v.
        const double m = bf16 ? std::ceil(mx / std::log(2.0)) * std::log(2.0) : mx;
        double sum = 0;
        for (int64_t j = 0; j <= t; ++j) sum += num[j] = std::exp(p[j] - m);
        r.lse[(b * a.nh + h) * a.T + t] = static_cast<float>(m + std::log(sum));
        for (int64_t j = 0; j <= t; ++j) p[j] = num[j] / sum;
        double pdp = 0;
        for (int64_t j = 0; j <= t; ++j) {
          dp[j] = 0;
          for (int64_t d = 0; d < a.hd; ++d) dp[j] += double(dot[d]) * v[kv_at(j) + d];
          pdp += p[j] * dp[j];
        }
        float* out = &r.attn[(b * a.T + t) * Q + h * a.hd];
        for (int64_t d = 0; d < a.hd; ++d) {
          double o = 0;
          for (int64_t j = 0; j <= t; ++j) o += r16(num[j]) * v[kv_at(j) + d];
          out[d] = static_cast<float>(o / sum);
        }
        if (bf16) {  // sum_j p_j dp_j = dattn . sum_j p_j v_j, from the output kept in bf16
          pdp = 0;
          for (int64_t d = 0; d < a.hd; ++d) pdp += r16(out[d]) * dot[d];
        }
        for (int64_t d = 0; d < a.hd; ++d) {
          double dqd = 0;
          for (int64_t j = 0; j <= t; ++j) {
            const double ds = r16(p[j] * (dp[j] - pdp)), pj = r16(p[j]);
            dqd += a.scale * ds * k[kv_at(j) + d];
            dk[kv_at(j) + d] += a.scale * ds * qt[d];
            dv[kv_at(j) + d] += pj * dot[d];
          }
          r.dq[(b * a.T + t) * Q + h * a.hd + d] = static_cast<float>(dqd);
        }
      }
    }
  }
  r.dk.assign(dk.begin(), dk.end());
  r.dv.assign(dv.begin(), dv.end());
  return r;
}

TEST_P(BackendConformance, AttentionForwardAndBackwardMatchTheFp64Reference) {
  // Two kv heads shared by four query heads; blocks of 5 queries, the last one partial.
  const ComputeBackend::Attention a{
      .B = 2, .T = 13, .nh = 4, .nkv = 2, .hd = 8, .block = 5, .scale = 1.0f / std::sqrt(8.0f)};
  const int64_t tokens = a.B * a.T, Q = a.nh * a.hd, KV = a.nkv * a.hd;
  const auto q = randn(tokens * Q, 24), k = randn(tokens * KV, 25), v = randn(tokens * KV, 26),
             dattn = randn(tokens * Q, 27);
  const AttentionReference want = attention_reference(a, q, k, v, dattn);

  DeviceBuffer Qb = put(q), Kb = put(k), Vb = put(v), DA = put(dattn);
  DeviceBuffer L = put(std::vector<float>(a.B * a.nh * a.T)), O = put(std::vector<float>(q.size()));
  DeviceBuffer S = put(std::vector<float>(a.block * a.T)),
               P = put(std::vector<float>(a.block * a.T));
  DeviceBuffer DQ = put(std::vector<float>(q.size())), DK = put(std::vector<float>(k.size())),
               DV = put(std::vector<float>(v.size()));
  backend_->attention_forward(a, Qb.as<float>(), Kb.as<float>(), Vb.as<float>(), L.as<float>(),
                              O.as<float>(), S.as<float>(), nullptr, nullptr);
  expect_close(get(O, q.size()), want.attn, 1e-4, "attn");
  expect_close(get(L, want.lse.size()), want.lse, 1e-4, "lse");

  backend_->zero(DK.data(), k.size() * sizeof(float));  // backward adds into dk and dv
  backend_->zero(DV.data(), v.size() * sizeof(float));
  backend_->attention_backward(a, Qb.as<float>(), Kb.as<float>(), Vb.as<float>(), L.as<float>(),
                               nullptr, DA.as<float>(), DQ.as<float>(), DK.as<float>(),
                               DV.as<float>(), S.as<float>(), P.as<float>(), nullptr);
  expect_close(get(DQ, q.size()), want.dq, 1e-4, "dq");
  expect_close(get(DK, k.size()), want.dk, 1e-4, "dk");
  expect_close(get(DV, v.size()), want.dv, 1e-4, "dv");
}

// max |got - want| over max |want|.
double scaled_diff(const std::vector<float>& got, const std::vector<float>& want) {
  return outcore::test::scaled_error(got.data(), want.data(), got.size());
}

// The CPU backends run element-wise and row-wise kernels on oneTBB's threads in ranges: at
// sizes of several ranges, the host kernel's bits (one range), tails and bf16 outputs included;
// the loss, whose host loop is the backend's own, as on one thread.
TEST_P(BackendConformance, LargeKernelsInRangesHaveTheHostsBits) {
  if (cuda()) GTEST_SKIP() << "the CPU backends' threads";
  const int64_t n = (int64_t{1} << 18) + 37;
  const auto g = randn(n, 81), u = randn(n, 82), da = randn(n, 83);
  DeviceBuffer G = put(g), U = put(u), DA = put(da);
  {  // casts
    std::vector<uint16_t> want16(n);
    cpu::from_fp32(g.data(), want16.data(), DType::BF16, n);
    DeviceBuffer H = put(std::vector<uint16_t>(n)), F = put(std::vector<float>(n));
    backend_->from_fp32(G.as<float>(), H.data(), DType::BF16, n);
    EXPECT_EQ(get<uint16_t>(H, n), want16) << "from_fp32";
    std::vector<float> want(n);
    cpu::to_fp32(want16.data(), DType::BF16, want.data(), n);
    backend_->to_fp32(H.data(), DType::BF16, F.as<float>(), n);
    expect_close(get(F, n), want, 0.0, "to_fp32");
  }
  {  // add
    auto want = u;
    cpu::add_inplace(want.data(), g.data(), n);
    DeviceBuffer Y = put(u);
    backend_->add_inplace(Y.as<float>(), G.as<float>(), n);
    expect_close(get(Y, n), want, 0.0, "add_inplace");
  }
  {  // SwiGLU, fp32 and bf16 outputs
    std::vector<float> a(n), dg(n), du(n);
    std::vector<uint16_t> a16(n), dg16(n), du16(n);
    cpu::swiglu_forward(g.data(), u.data(), a.data(), n);
    cpu::swiglu_forward(g.data(), u.data(), nullptr, n, a16.data());
    cpu::swiglu_backward(da.data(), g.data(), u.data(), dg.data(), du.data(), n);
    cpu::swiglu_backward(da.data(), g.data(), u.data(), nullptr, nullptr, n, dg16.data(),
                         du16.data());
    DeviceBuffer A = put(std::vector<float>(n)), DG = put(std::vector<float>(n)),
                 DU = put(std::vector<float>(n));
    DeviceBuffer A16 = put(std::vector<uint16_t>(n)), DG16 = put(std::vector<uint16_t>(n)),
                 DU16 = put(std::vector<uint16_t>(n));
    backend_->swiglu_forward(G.as<float>(), U.as<float>(), A.as<float>(), n, nullptr);
    backend_->swiglu_forward(G.as<float>(), U.as<float>(), nullptr, n, A16.data());
    backend_->swiglu_backward(DA.as<float>(), G.as<float>(), U.as<float>(), DG.as<float>(),
                              DU.as<float>(), n, nullptr, nullptr);
    backend_->swiglu_backward(DA.as<float>(), G.as<float>(), U.as<float>(), nullptr, nullptr, n,
                              DG16.data(), DU16.data());
    expect_close(get(A, n), a, 0.0, "swiglu a");
    expect_close(get(DG, n), dg, 0.0, "swiglu dg");
    expect_close(get(DU, n), du, 0.0, "swiglu du");
    EXPECT_EQ(get<uint16_t>(A16, n), a16) << "swiglu a in bf16";
    EXPECT_EQ(get<uint16_t>(DG16, n), dg16) << "swiglu dg in bf16";
    EXPECT_EQ(get<uint16_t>(DU16, n), du16) << "swiglu du in bf16";
  }
  {  // RMSNorm forward and row scaling, by rows
    const int64_t rows = 300, dim = 1000;
    const auto x = randn(rows * dim, 84), w = randn(dim, 85);
    std::vector<float> y(rows * dim), rstd(rows);
    std::vector<uint16_t> y16(rows * dim);
    cpu::rmsnorm_forward(x.data(), w.data(), 1e-5f, rows, dim, y.data(), rstd.data());
    cpu::rmsnorm_forward(x.data(), w.data(), 1e-5f, rows, dim, nullptr, rstd.data(), y16.data());
    DeviceBuffer X = put(x), W = put(w), Y = put(std::vector<float>(rows * dim)),
                 R = put(std::vector<float>(rows)), Y16 = put(std::vector<uint16_t>(rows * dim));
    backend_->rmsnorm_forward(X.as<float>(), W.as<float>(), 1e-5f, rows, dim, Y.as<float>(),
                              R.as<float>(), nullptr);
    expect_close(get(Y, y.size()), y, 0.0, "rmsnorm y");
    expect_close(get(R, rows), rstd, 0.0, "rmsnorm rstd");
    backend_->rmsnorm_forward(X.as<float>(), W.as<float>(), 1e-5f, rows, dim, nullptr,
                              R.as<float>(), Y16.data());
    EXPECT_EQ(get<uint16_t>(Y16, y16.size()), y16) << "rmsnorm y in bf16";
    const int64_t srows = 3000, cols = 100, ld = 104;
    const auto sx = randn(srows * ld, 86), scale = randn(srows, 87);
    auto want = sx;
    cpu::scale_rows(want.data(), srows, cols, ld, scale.data());
    DeviceBuffer SX = put(sx), SC = put(scale);
    backend_->scale_rows(SX.as<float>(), srows, cols, ld, SC.as<float>());
    expect_close(get(SX, sx.size()), want, 0.0, "scale_rows");
  }
  {  // the loss and its bf16 gradient, by rows, against one thread
    const int64_t rows = 200, vocab = 5000;
    const auto logits = randn(rows * vocab, 88);
    std::vector<int32_t> targets(rows);
    for (int64_t r = 0; r < rows; ++r) targets[r] = r % 7 == 3 ? -100 : int32_t((r * 37) % vocab);
    auto run = [&](int threads) {
      const tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
      DeviceBuffer L = put(logits), T = put(targets), RL = put(std::vector<float>(rows)),
                   G16 = put(std::vector<uint16_t>(rows * vocab));
      backend_->cross_entropy(L.as<float>(), T.as<int32_t>(), rows, vocab, 0.01f, true,
                              RL.as<float>(), G16.data());
      return std::pair{get(RL, rows), get<uint16_t>(G16, rows * vocab)};
    };
    const auto one = run(1), all = run(4);
    expect_close(all.first, one.first, 0.0, "row losses");
    EXPECT_EQ(all.second, one.second) << "loss gradient in bf16";
  }
}

// RMSNorm's backward (rows, then its weight gradient by columns), RoPE, the embedding (its
// gradient by columns, repeated ids added in token order), the causal softmax and attention's D,
// each at sizes the CPU backends split into several ranges: the host kernels' bits.
TEST_P(BackendConformance, RowAndColumnKernelsInRangesHaveTheHostsBits) {
  if (cuda()) GTEST_SKIP() << "the CPU backends' threads";
  {  // RMSNorm backward: rows in ranges, then columns (as large as the backends split)
    const int64_t rows = 300, dim = 4000;
    const auto dy = randn(rows * dim, 91), x = randn(rows * dim, 92), w = randn(dim, 93),
               rstd = randn(rows, 94), dx0 = randn(rows * dim, 95), dw0 = randn(dim, 96);
    auto dx = dx0, dw = dw0;
    cpu::rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), rows, dim, dx.data(),
                          dw.data());
    DeviceBuffer DY = put(dy), X = put(x), W = put(w), R = put(rstd), DX = put(dx0), DW = put(dw0);
    backend_->rmsnorm_backward(DY.as<float>(), X.as<float>(), W.as<float>(), R.as<float>(), rows,
                               dim, DX.as<float>(), DW.as<float>());
    expect_close(get(DX, dx.size()), dx, 0.0, "rmsnorm dx");
    expect_close(get(DW, dim), dw, 0.0, "rmsnorm dw");
  }
  {  // RoPE, forward and inverse, with its bf16 output: 6 ranges of rows, positions wrapping
    const int64_t rows = 3000, seq = 700, heads = 4, hd = 32, width = heads * hd;
    const auto x = randn(rows * width, 97), c = randn(seq * hd / 2, 98),
               sn = randn(seq * hd / 2, 99);
    DeviceBuffer C = put(c), S = put(sn);
    for (const bool inverse : {false, true}) {
      auto want = x;
      std::vector<uint16_t> want16(x.size());
      cpu::rope(want.data(), rows, seq, heads, hd, c.data(), sn.data(), inverse, want16.data());
      DeviceBuffer X = put(x), X16 = put(std::vector<uint16_t>(x.size()));
      backend_->rope(X.as<float>(), rows, seq, heads, hd, C.as<float>(), S.as<float>(), inverse,
                     X16.data());
      expect_close(get(X, x.size()), want, 0.0, inverse ? "rope inverse" : "rope");
      EXPECT_EQ(get<uint16_t>(X16, x.size()), want16) << "rope in bf16, inverse " << inverse;
    }
  }
  {  // the embedding: 14 ranges of tokens forward, of columns backward
    const int64_t vocab = 50, n = 5000, hidden = 200;
    const auto table = randn(vocab * hidden, 100), dy = randn(n * hidden, 101),
               grad0 = randn(vocab * hidden, 102);
    std::vector<int32_t> ids(n);
    for (int64_t i = 0; i < n; ++i) ids[i] = int32_t((i * 7 + i / 3) % vocab);
    std::vector<uint16_t> table16(table.size());
    cpu::from_fp32(table.data(), table16.data(), DType::BF16, table16.size());
    std::vector<float> want(n * hidden);
    for (int64_t i = 0; i < n; ++i)
      cpu::to_fp32(table16.data() + ids[i] * hidden, DType::BF16, want.data() + i * hidden, hidden);
    DeviceBuffer T16 = put(table16), I = put(ids), OUT = put(std::vector<float>(n * hidden));
    backend_->embedding_forward(T16.data(), DType::BF16, I.as<int32_t>(), n, hidden,
                                OUT.as<float>());
    expect_close(get(OUT, want.size()), want, 0.0, "embedding forward");
    auto grad = grad0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < hidden; ++j) grad[ids[i] * hidden + j] += dy[i * hidden + j];
    DeviceBuffer DY = put(dy), G = put(grad0);
    backend_->embedding_backward(I.as<int32_t>(), DY.as<float>(), n, hidden, G.as<float>());
    expect_close(get(G, grad.size()), grad, 0.0, "embedding backward");
  }
  {  // the causal softmax, forward (fp32 and bf16's numerators) and backward: 3 ranges of rows
    const int64_t rows = 300, keys = 1000, first = keys - rows;
    const auto scores = randn(rows * keys, 103), dp = randn(rows * keys, 104),
               delta = randn(rows, 105);
    for (const bool numerators : {false, true}) {
      auto want = scores;
      std::vector<float> lse(rows), inv(rows);
      for (int64_t i = 0; i < rows; ++i) {
        float* row = want.data() + i * keys;
        const int64_t n = first + i + 1;
        lse[i] = numerators ? cpu::softmax_numerators(row, n, inv.data() + i)
                            : cpu::softmax_inplace(row, n);
        std::fill(row + n, row + keys, 0.0f);
      }
      DeviceBuffer Sc = put(scores), L = put(std::vector<float>(rows)),
                   IV = put(std::vector<float>(rows));
      backend_->causal_softmax_forward(Sc.as<float>(), L.as<float>(), rows, keys, first,
                                       numerators ? IV.as<float>() : nullptr);
      expect_close(get(Sc, want.size()), want, 0.0, "softmax forward");
      expect_close(get(L, rows), lse, 0.0, "softmax lse");
      if (numerators) expect_close(get(IV, rows), inv, 0.0, "softmax 1 / sum");
    }
    for (const bool given_delta : {false, true}) {
      auto p = scores, d = dp;
      const auto lse = randn(rows, 106);
      for (int64_t i = 0; i < rows; ++i) {
        float* pr = p.data() + i * keys;
        float* dr = d.data() + i * keys;
        const int64_t n = first + i + 1;
        cpu::exp_shift(pr, lse[i], n);
        std::fill(pr + n, pr + keys, 0.0f);
        const float dd = given_delta ? delta[i] : cpu::dot(pr, dr, n);
        for (int64_t j = 0; j < n; ++j) dr[j] = kmath::softmax_grad(pr[j], dr[j], dd);
        std::fill(dr + n, dr + keys, 0.0f);
      }
      DeviceBuffer P = put(scores), DP = put(dp), L = put(lse), D = put(delta);
      backend_->causal_softmax_backward(P.as<float>(), DP.as<float>(), L.as<float>(), rows, keys,
                                        first, given_delta ? D.as<float>() : nullptr);
      expect_close(get(P, p.size()), p, 0.0, "softmax backward p");
      expect_close(get(DP, d.size()), d, 0.0, "softmax backward dp");
    }
  }
  {  // attention's D: 8 ranges of (sequence, head, token) rows
    ComputeBackend::Attention a{.B = 2,
                                .T = 1000,
                                .nh = 4,
                                .nkv = 2,
                                .hd = 64,
                                .block = 64,
                                .scale = 0.125f,
                                .dtype = DType::BF16};
    const int64_t Q = a.nh * a.hd;
    const auto o = randn(a.B * a.T * Q, 107), d = randn(a.B * a.T * Q, 108);
    std::vector<uint16_t> o16(o.size()), d16(d.size());
    cpu::from_fp32(o.data(), o16.data(), DType::BF16, o.size());
    cpu::from_fp32(d.data(), d16.data(), DType::BF16, d.size());
    std::vector<float> want(a.B * a.nh * a.T);
    for (int64_t b = 0; b < a.B; ++b)
      for (int64_t h = 0; h < a.nh; ++h)
        for (int64_t t = 0; t < a.T; ++t) {
          const int64_t at = (b * a.T + t) * Q + h * a.hd;
          want[(b * a.nh + h) * a.T + t] =
              kmath::bf16_row_dot(o16.data() + at, d16.data() + at, a.hd);
        }
    DeviceBuffer O = put(o16), DA = put(d16), D = put(std::vector<float>(want.size()));
    backend_->attention_delta(a, O.data(), DA.data(), D.as<float>());
    expect_close(get(D, want.size()), want, 0.0, "attention D");
  }
}

// The CPU backends' attention runs its kv heads on oneTBB's threads, each GEMM on its thread
// alone: one thread or all give the same bits, in bf16 also for GEMMs large enough that oneDNN
// would otherwise give them a team (a score block of 128 x 1024 x 128).
TEST_P(BackendConformance, AttentionHasTheSameBitsOnAnyNumberOfThreads) {
  if (cuda()) GTEST_SKIP() << "the CPU backends' threads";
  for (const DType dtype : {DType::BF16, DType::F32}) {
    ComputeBackend::Attention a{.B = 2,
                                .T = 1024,
                                .nh = 4,
                                .nkv = 2,
                                .hd = 128,
                                .block = 128,
                                .scale = 1.0f / std::sqrt(128.0f),
                                .dtype = dtype};
    AttentionInputs in = attention_inputs(a, 71);
    std::fill(in.dk0.begin(), in.dk0.end(), 0.0f);
    std::fill(in.dv0.begin(), in.dv0.end(), 0.0f);
    // One forward and backward on at most `threads` threads.
    auto run = [&](int threads) {
      const tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
      return attention_outputs(*device_, *backend_, a, in);
    };
    expect_same_attention(run(4), run(1), dtype);
  }
}

// The default attention (ComputeBackend's loop over heads and blocks) on a backend's own
// operations, each GEMM on the calling thread alone (SerialGemms, as the CPU backends' groups).
class DefaultAttention final : public ProfilingBackend {
 public:
  using ProfilingBackend::ProfilingBackend;
  void attention_forward(const Attention& a, const void* q, const void* k, const void* v,
                         float* lse, float* attn, float* scores, void* lowp,
                         void* attn_bf16) override {
    const cpu::SerialGemms serial;
    ComputeBackend::attention_forward(a, q, k, v, lse, attn, scores, lowp, attn_bf16);
  }
  void attention_backward(const Attention& a, const void* q, const void* k, const void* v,
                          const float* lse, const void* attn, const void* dattn, float* dq,
                          float* dk, float* dv, float* scores, float* dprob, void* lowp) override {
    const cpu::SerialGemms serial;
    ComputeBackend::attention_backward(a, q, k, v, lse, attn, dattn, dq, dk, dv, scores, dprob,
                                       lowp);
  }
};

// The CPU backend's attention runs the default's work per kv head, in bf16 on dense copies of
// its operands: the default's bits, with dk and dv added into (not overwritten), at a length no
// block divides.
TEST_P(BackendConformance, AttentionHasTheDefaultLoopsBits) {
  if (GetParam() != "cpu")
    GTEST_SKIP() << "the CPU backend's attention (the discrete device's is one operation of it: "
                    "DiscreteAttentionHasTheHostAccessibleDevicesBits)";
  for (const DType dtype : {DType::BF16, DType::F32}) {
    ComputeBackend::Attention a{
        .B = 2, .T = 300, .nh = 4, .nkv = 2, .hd = 32, .block = 64, .scale = 0.2f, .dtype = dtype};
    const AttentionInputs in = attention_inputs(a, 111);
    DefaultAttention by_default(backend_);
    expect_same_attention(attention_outputs(*device_, *backend_, a, in),
                          attention_outputs(*device_, by_default, a, in), dtype);
  }
}

// The discrete CPU device's attention, queued as one operation, has the host-accessible
// device's bits, in bf16 and in fp32, at head sizes whose sums two GEMM libraries would order
// differently.
TEST(BackendConformanceAcrossDevices, DiscreteAttentionHasTheHostAccessibleDevicesBits) {
  CpuDevice host, discrete({.discrete = true});
  const auto host_be = make_backend(host), discrete_be = make_backend(discrete);
  for (const DType dtype : {DType::BF16, DType::F32})
    for (const int64_t hd : {64, 128}) {
      ComputeBackend::Attention a{.B = 2,
                                  .T = 300,
                                  .nh = 4,
                                  .nkv = 2,
                                  .hd = hd,
                                  .block = 128,
                                  .scale = 0.1f,
                                  .dtype = dtype};
      const AttentionInputs in = attention_inputs(a, 121);
      expect_same_attention(attention_outputs(discrete, *discrete_be, a, in),
                            attention_outputs(host, *host_be, a, in), dtype);
    }
}

// bf16 operands: the result follows the fp64 reference with bf16 rounding at the same points,
// several times closer than the fp32 reference is (so the rounding is really applied), and the
// fp32 scratch and lse are those of fp32 softmax.
TEST_P(BackendConformance, AttentionInBf16RoundsWhereTheReferenceRounds) {
  ComputeBackend::Attention a{.B = 2,
                              .T = 37,
                              .nh = 4,
                              .nkv = 2,
                              .hd = 16,
                              .block = 16,
                              .scale = 0.25f,
                              .dtype = DType::BF16};
  const int64_t tokens = a.B * a.T, Q = a.nh * a.hd, KV = a.nkv * a.hd;
  const auto q = randn(tokens * Q, 34), k = randn(tokens * KV, 35), v = randn(tokens * KV, 36),
             dattn = randn(tokens * Q, 37);
  const AttentionReference want = attention_reference(a, q, k, v, dattn, true);
  const AttentionReference fp32 = attention_reference(a, q, k, v, dattn, false);
  DeviceBuffer Qb = put_bf16(q), Kb = put_bf16(k), Vb = put_bf16(v), DA = put_bf16(dattn);
  DeviceBuffer L = put(std::vector<float>(a.B * a.nh * a.T)), O = put(std::vector<float>(q.size()));
  DeviceBuffer S = put(std::vector<float>(a.block * a.T)),
               P = put(std::vector<float>(a.block * a.T));
  DeviceBuffer LP = put(std::vector<uint16_t>(ComputeBackend::attention_bf16_scratch(a)));
  DeviceBuffer DQ = put(std::vector<float>(q.size())), DK = put(std::vector<float>(k.size())),
               DV = put(std::vector<float>(v.size()));
  backend_->attention_forward(a, Qb.data(), Kb.data(), Vb.data(), L.as<float>(), O.as<float>(),
                              S.as<float>(), LP.data(), nullptr);
  // The output rounded by attention itself, as the decoder keeps it for backward: this
  // backend's fp32 output, rounded.
  DeviceBuffer O16 = put(std::vector<uint16_t>(q.size(), 0x7fc1)),
               scratch = put(std::vector<float>(q.size()));
  backend_->attention_forward(a, Qb.data(), Kb.data(), Vb.data(), L.as<float>(),
                              scratch.as<float>(), S.as<float>(), LP.data(), O16.data());
  expect_bf16_of(get<uint16_t>(O16, q.size()), get(O, q.size()), "attn in bf16");
  backend_->zero(DK.data(), k.size() * sizeof(float));
  backend_->zero(DV.data(), v.size() * sizeof(float));
  backend_->attention_backward(a, Qb.data(), Kb.data(), Vb.data(), L.as<float>(), O16.data(),
                               DA.data(), DQ.as<float>(), DK.as<float>(), DV.as<float>(),
                               S.as<float>(), P.as<float>(), LP.data());
  const std::pair<const char*, std::pair<std::vector<float>, std::pair<const std::vector<float>*,
                                                                       const std::vector<float>*>>>
      outputs[] = {{"attn", {get(O, q.size()), {&want.attn, &fp32.attn}}},
                   {"lse", {get(L, want.lse.size()), {&want.lse, &fp32.lse}}},
                   {"dq", {get(DQ, q.size()), {&want.dq, &fp32.dq}}},
                   {"dk", {get(DK, k.size()), {&want.dk, &fp32.dk}}},
                   {"dv", {get(DV, v.size()), {&want.dv, &fp32.dv}}}};
  for (const auto& [name, o] : outputs) {
    const double err = scaled_diff(o.first, *o.second.first);
    const double fp32_err = scaled_diff(*o.second.second, *o.second.first);
    EXPECT_LT(err, 2e-3) << name;
    EXPECT_LT(err, 0.25 * fp32_err) << name << ": no closer to the bf16 reference than fp32 is";
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendConformance,
                         ::testing::Values("cpu", "cpu_discrete", "cuda"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace outcore::device
