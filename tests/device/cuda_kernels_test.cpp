// Each CUDA kernel (engine/device/cuda/cuda_kernels.hpp) against the host kernels of
// engine/device/cpu on random data. Skips, saying why, where no GPU can be used. Tolerances,
// per kernel:
//   casts, embedding gather and scatter-add, gradient accumulation, inf/NaN count: exact;
//   SwiGLU, RoPE: 2e-6 relative (the GPU may fuse a multiply-add the host rounds twice);
//   RMSNorm, softmax, cross-entropy, sum of squares: 1e-5 relative (block-tree reductions
//   instead of the host's 8/16 lanes); the gradient norm's block sums and Adam: exact (they
//   follow cpu_adam's lanes and operations);
//   GEMM: 1e-5 of sum|a||b| for fp32, 1e-4 for bf16/fp16 (inputs rounded alike on both sides).
#include "engine/device/cuda/cuda_kernels.hpp"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "engine/device/device.hpp"
#include "engine/device/flash_attention_tiles.hpp"
#include "engine/device/kernel_math.hpp"
#include "engine/device/rmsnorm_dw_split.hpp"
#include "engine/device/token_groups.hpp"
#include "tests/common/numeric.hpp"
#include "tests/device/host_attention.hpp"

namespace outcore::device::cuda {
namespace {

namespace hk = outcore::device::cpu;

using outcore::test::attention_case;
using outcore::test::AttentionCase;
using outcore::test::AttentionShape;
using outcore::test::expect_bf16_attention;
using outcore::test::expect_rmsnorm_dw;
using outcore::test::host_causal_softmax;
using outcore::test::host_rmsnorm;
using outcore::test::HostAttention;
using outcore::test::HostRmsNorm;
using outcore::test::randn;

// A device copy of a host vector, copied back with get().
template <typename T>
class Dev {
 public:
  explicit Dev(const std::vector<T>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<size_t>(1, n_) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  explicit Dev(size_t n) : Dev(std::vector<T>(n)) {}
  ~Dev() { cudaFree(p_); }
  Dev(const Dev&) = delete;
  T* get() { return p_; }
  std::vector<T> host() const {
    std::vector<T> h(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_;
};

using outcore::test::expect_close;

bool maps_cublaslt() {
  std::ifstream maps("/proc/self/maps");
  const std::string text{std::istreambuf_iterator<char>(maps), std::istreambuf_iterator<char>()};
  return text.find("libcublasLt.so") != std::string::npos;
}

// cuBLASLt (about 147 MiB resident once loaded) is loaded by the first Gemm, not at start: a
// process that computes on the CPU never maps it. Runs on every machine (no GPU needed to load
// the library), first in this file so that no earlier test's Gemm has loaded it.
TEST(CuBlasLt, IsLoadedOnFirstUseNotAtStart) {
  EXPECT_FALSE(maps_cublaslt()) << "cuBLASLt was mapped before any Gemm was made";
  const std::string path = cublaslt_library();
  EXPECT_NE(path.find("libcublasLt.so."), std::string::npos) << path;
  EXPECT_TRUE(maps_cublaslt()) << "loaded from " << path;
  EXPECT_EQ(cublaslt_library(), path);  // once
}

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    const ProbeResult p = probe();
    if (!p.available) GTEST_SKIP() << "no usable GPU: " << p.summary();
  }
};

// 10007 elements: the eight-at-a-time kernels and their tail, then the one-at-a-time kernels.
TEST_F(CudaKernels, CastsMatchTheHostConversionsExactly) {
  auto x = randn(10007, 1, 50.0f);
  x[3] = std::numeric_limits<float>::infinity();
  x[4] = 1e-6f;  // an fp16 subnormal
  for (DType t : {DType::BF16, DType::F16}) {
    std::vector<uint16_t> want(x.size());
    hk::from_fp32(x.data(), want.data(), t, static_cast<int64_t>(x.size()));
    Dev<float> dx(x);
    Dev<uint16_t> dh(x.size());
    from_fp32(dx.get(), dh.get(), t, static_cast<int64_t>(x.size()), nullptr);
    ASSERT_EQ(dh.host(), want);
    std::vector<float> back(x.size());
    hk::to_fp32(want.data(), t, back.data(), static_cast<int64_t>(x.size()));
    Dev<float> db(x.size());
    to_fp32(dh.get(), t, db.get(), static_cast<int64_t>(x.size()), nullptr);
    expect_close(db.host(), back, 0.0, "to_fp32");
    // Buffers not on 16 bytes (one element in) take the one-at-a-time kernels.
    Dev<uint16_t> dh1(x.size());
    from_fp32(dx.get() + 1, dh1.get() + 1, t, static_cast<int64_t>(x.size()) - 1, nullptr);
    const std::vector<uint16_t> got1 = dh1.host();
    ASSERT_TRUE(std::equal(got1.begin() + 1, got1.end(), want.begin() + 1));
    Dev<float> db1(x.size());
    to_fp32(dh.get() + 1, t, db1.get() + 1, static_cast<int64_t>(x.size()) - 1, nullptr);
    const std::vector<float> back1 = db1.host();
    ASSERT_TRUE(std::equal(back1.begin() + 1, back1.end(), back.begin() + 1));
  }
}

TEST_F(CudaKernels, SwigluAndRopeMatchTheHost) {
  // 4096 elements and a head of 16: four a thread (16-byte loads); 4099 and 12: one at a time.
  for (const int64_t n : {int64_t{4096}, int64_t{4099}}) {
    auto g = randn(n, 2, 3.0f), u = randn(n, 3), da = randn(n, 4);
    std::vector<float> a(n), dg(n), du(n);
    hk::swiglu_forward(g.data(), u.data(), a.data(), n);
    hk::swiglu_backward(da.data(), g.data(), u.data(), dg.data(), du.data(), n);
    Dev<float> G(g), U(u), DA(da), A(n), DG(n), DU(n);
    swiglu_forward(G.get(), U.get(), A.get(), n, nullptr);
    swiglu_backward(DA.get(), G.get(), U.get(), DG.get(), DU.get(), n, nullptr);
    expect_close(A.host(), a, 2e-6, "swiglu " + std::to_string(n));
    expect_close(DG.host(), dg, 2e-6, "dg " + std::to_string(n));
    expect_close(DU.host(), du, 2e-6, "du " + std::to_string(n));
  }
  for (const int64_t hd : {int64_t{16}, int64_t{12}}) {
    const int64_t rows = 24, seq = 8, heads = 3;
    auto x = randn(rows * heads * hd, 5), c = randn(seq * hd / 2, 6), s = randn(seq * hd / 2, 7);
    for (bool inverse : {false, true}) {
      auto want = x;
      hk::rope(want.data(), rows, seq, heads, hd, c.data(), s.data(), inverse);
      Dev<float> X(x), C(c), S(s);
      rope(X.get(), rows, seq, heads, hd, C.get(), S.get(), inverse, nullptr);
      expect_close(X.host(), want, 2e-6, "rope, head size " + std::to_string(hd));
    }
  }
}

// The host's loss and gradient (as head.cpp computes them): `logits` [rows, vocab] becomes
// The embedding's gather and scatter-add on the GPU against the host's, exactly: `table`
// ([vocab, hidden] in `dtype` storage) gathered at `ids`, and `dy` added into a gradient of
// 0.5s in token order.
template <typename T>
void expect_embedding_as_host(const std::vector<T>& table, DType dtype,
                              const std::vector<int32_t>& ids, const std::vector<float>& dy,
                              int64_t hidden) {
  const auto tokens = static_cast<int64_t>(ids.size());
  const int64_t vocab = static_cast<int64_t>(table.size()) / hidden;
  std::vector<float> values(table.size());
  hk::to_fp32(table.data(), dtype, values.data(), static_cast<int64_t>(table.size()));
  std::vector<float> out(tokens * hidden), grad(vocab * hidden, 0.5f);
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t j = 0; j < hidden; ++j) {
      out[i * hidden + j] = values[int64_t{ids[i]} * hidden + j];
      grad[int64_t{ids[i]} * hidden + j] += dy[i * hidden + j];
    }
  Dev<T> TB(table);
  Dev<float> O(tokens * hidden), DY(dy), GR(std::vector<float>(vocab * hidden, 0.5f));
  Dev<int32_t> I(ids);
  embedding_forward(TB.get(), dtype, I.get(), tokens, hidden, O.get(), nullptr);
  const TokenGroups groups(ids);
  Dev<int32_t> GP(groups.packed());
  embedding_backward(GP.get(), tokens, groups.groups(), DY.get(), hidden, GR.get(), nullptr);
  expect_close(O.host(), out, 0.0, "gather");
  expect_close(GR.host(), grad, 0.0, "scatter-add");
}

// coef * (softmax - onehot(target)), a masked row (target < 0) zeros and no loss.
void host_cross_entropy(std::vector<float>& logits, const std::vector<int32_t>& targets,
                        int64_t vocab, float coef, std::vector<float>& loss) {
  for (size_t r = 0; r < targets.size(); ++r) {
    float* row = logits.data() + r * vocab;
    if (targets[r] < 0) {
      std::fill(row, row + vocab, 0.0f);
      continue;
    }
    const float target_logit = row[targets[r]];
    loss[r] = kmath::xent_loss(hk::softmax_inplace(row, vocab), target_logit);
    for (int64_t j = 0; j < vocab; ++j) row[j] = kmath::xent_scale(row[j], coef);
    row[targets[r]] = kmath::xent_target(row[targets[r]], coef);
  }
}

// n values spread over [-scale, scale) from a 64-bit LCG: cheap enough for a layer's tensors.
std::vector<float> spread(size_t n, uint64_t seed, float scale) {
  std::vector<float> v(n);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (float& f : v) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    f = scale * (static_cast<float>(x >> 40) * 0x1p-23f - 1.0f);
  }
  return v;
}

// Every element of `got` is `fp32`'s rounded to bf16 (fp32_to_bf16).
void expect_rounded(const std::vector<uint16_t>& got, const std::vector<float>& fp32,
                    const std::string& what) {
  ASSERT_EQ(got.size(), fp32.size()) << what;
  size_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += got[i] != kmath::fp32_to_bf16(fp32[i]);
  EXPECT_EQ(differ, 0u) << what << ": of " << got.size();
}

// The elementwise and row kernels at Llama 3 8B's shapes (4096 tokens, hidden 4096, 32 heads of
// 128, intermediate 14336, vocabulary 128256), where the vector paths and the grid's stride
// loops run for real: SwiGLU, RoPE, the loss and the embedding, forward and backward, with their
// bf16 outputs.
TEST_F(CudaKernels, KernelsMatchTheHostAtLlama3Shapes) {
  const int64_t tokens = 4096, hidden = 4096, heads = 32, hd = 128, inter = 14336;
  const int64_t vocab = 128256;
  {
    SCOPED_TRACE("SwiGLU");
    const int64_t n = tokens * inter;
    const auto g = spread(n, 1, 6.0f), u = spread(n, 2, 2.0f), da = spread(n, 3, 1.0f);
    std::vector<float> a(n), dg(n), du(n);
    hk::swiglu_forward(g.data(), u.data(), a.data(), n);
    hk::swiglu_backward(da.data(), g.data(), u.data(), dg.data(), du.data(), n);
    Dev<float> G(g), U(u), DA(da), A(n), DG(n), DU(n);
    Dev<uint16_t> A16(n), DG16(n), DU16(n);
    swiglu_forward(G.get(), U.get(), A.get(), n, nullptr);
    swiglu_backward(DA.get(), G.get(), U.get(), DG.get(), DU.get(), n, nullptr);
    swiglu_forward(G.get(), U.get(), nullptr, n, nullptr, A16.get());
    swiglu_backward(DA.get(), G.get(), U.get(), nullptr, nullptr, n, nullptr, DG16.get(),
                    DU16.get());
    const std::vector<float> a_got = A.host(), dg_got = DG.host(), du_got = DU.host();
    expect_close(a_got, a, 2e-6, "swiglu");
    expect_close(dg_got, dg, 2e-6, "dg");
    expect_close(du_got, du, 2e-6, "du");
    expect_rounded(A16.host(), a_got, "swiglu in bf16");
    expect_rounded(DG16.host(), dg_got, "dg in bf16");
    expect_rounded(DU16.host(), du_got, "du in bf16");
  }
  {
    SCOPED_TRACE("RoPE");
    const auto x = spread(tokens * heads * hd, 4, 3.0f);
    const auto c = spread(tokens * hd / 2, 5, 1.0f), sn = spread(tokens * hd / 2, 6, 1.0f);
    Dev<float> C(c), S(sn);
    for (bool inverse : {false, true}) {
      auto want = x;
      hk::rope(want.data(), tokens, tokens, heads, hd, c.data(), sn.data(), inverse);
      Dev<float> X(x);
      Dev<uint16_t> X16(x.size());
      rope(X.get(), tokens, tokens, heads, hd, C.get(), S.get(), inverse, nullptr, X16.get());
      const std::vector<float> got = X.host();
      expect_close(got, want, 2e-6, inverse ? "rope inverse" : "rope");
      expect_rounded(X16.host(), got, "rope in bf16");
    }
  }
  {
    SCOPED_TRACE("cross-entropy");
    const int64_t rows = 16;
    const float coef = 1.0f / rows;
    const auto logits = spread(rows * vocab, 7, 12.0f);
    std::vector<int32_t> targets(rows);
    for (int64_t r = 0; r < rows; ++r) targets[r] = static_cast<int32_t>((r * 8017) % vocab);
    targets[5] = -1;  // a masked row
    std::vector<float> grad = logits, loss(rows);
    host_cross_entropy(grad, targets, vocab, coef, loss);
    Dev<float> X(logits), X2(logits), RL(rows), RL2(rows);
    Dev<int32_t> T(targets);
    Dev<uint16_t> G16(logits.size());
    cross_entropy(X.get(), T.get(), rows, vocab, coef, true, RL.get(), nullptr);
    cross_entropy(X2.get(), T.get(), rows, vocab, coef, true, RL2.get(), nullptr, G16.get());
    const std::vector<float> dlogits = X.host();
    expect_close(RL.host(), loss, 1e-5, "loss");
    expect_close(dlogits, grad, 1e-5, "dlogits");
    // Most of a 128256-wide row's gradients lie far below expect_close's absolute floor (1e-5):
    // each within 1e-4 of its own size (the row sums' orders differ by far less), so a wrong
    // shift, sum or element shows.
    for (size_t i = 0; i < grad.size(); ++i)
      ASSERT_NEAR(dlogits[i], grad[i], 1e-4 * std::abs(grad[i]) + 1e-30) << "dlogits @" << i;
    expect_close(RL2.host(), RL.host(), 0.0, "loss with the bf16 gradient");
    expect_rounded(G16.host(), dlogits, "dlogits in bf16");
  }
  {
    SCOPED_TRACE("embedding");
    std::vector<uint16_t> table(vocab * hidden);
    const auto values = spread(table.size(), 8, 1.0f);
    hk::from_fp32(values.data(), table.data(), DType::BF16, static_cast<int64_t>(table.size()));
    std::vector<int32_t> ids(tokens);
    for (int64_t i = 0; i < tokens; ++i)  // every part of the table, and repeats
      ids[i] = static_cast<int32_t>(i % 3 == 0 ? vocab - 1 - i % 97 : (i * 31337) % vocab);
    expect_embedding_as_host(table, DType::BF16, ids, spread(tokens * hidden, 9, 1.0f), hidden);
  }
}

TEST_F(CudaKernels, EmbeddingGatherAndScatterAddMatchTheHostExactly) {
  const int64_t vocab = 50, hidden = 72, n = 300;
  auto table = randn(vocab * hidden, 8);
  std::vector<int32_t> ids(n);
  std::mt19937 rng(9);
  for (auto& i : ids) i = static_cast<int32_t>(rng() % 7);  // many repeats
  expect_embedding_as_host(table, DType::F32, ids, randn(n * hidden, 10), hidden);
}

TEST_F(CudaKernels, RmsNormForwardAndBackwardMatchTheHost) {
  // A toy shape (a partial column tile, rows not a multiple of the lanes), one whose rows take
  // dw's loads eight rows ahead and then a tail, one split over 11 row ranges of 273 rows
  // (norm::dw_split), Llama 3 8B's (4096 tokens of hidden 4096: 2 ranges) and Qwen3 8B's q
  // norm (4096 tokens x 32 heads of 128: 64 ranges).
  for (const auto& [rows, dim] : {std::pair<int64_t, int64_t>{37, 520},
                                  {300, 96},
                                  {3000, 96},
                                  {4096, 4096},
                                  {4096 * 32, 128}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(dim));
    const HostRmsNorm h = host_rmsnorm(rows, dim, 11, 0.25f);
    Dev<float> X(h.x), W(h.w), DY(h.dy), Y(rows * dim), R(rows);
    Dev<float> DX(std::vector<float>(rows * dim, 0.5f)), DW(std::vector<float>(dim, 0.25f));
    Dev<float> partials(norm::kDwPartialFloats);
    rmsnorm_forward(X.get(), W.get(), 1e-5f, rows, dim, Y.get(), R.get(), nullptr);
    rmsnorm_backward(DY.get(), X.get(), W.get(), R.get(), rows, dim, DX.get(), DW.get(),
                     partials.get(), nullptr);
    expect_close(Y.host(), h.y, 1e-5, "y");
    expect_close(R.host(), h.rstd, 1e-5, "rstd");
    expect_close(DX.host(), h.dx, 1e-5, "dx");
    expect_rmsnorm_dw(DW.host(), h, rows, dim);
  }
}

// The fused bf16 kernels against the host's default attention in bf16 (the same rounding points):
// within 2e-3 of the largest value, and in the 2-norm several times closer than fp32 attention
// on the same inputs is, so the rounding is really where the host rounds. The closeness is taken
// in the 2-norm because summation orders differ: a probability or score gradient whose fp32
// value lies within an ulp of a bf16 rounding boundary may round the other way on one side,
// which moves a single element by up to a bf16 ulp of that term; at 4096 tokens such an element
// set the max-norm distance for dq (7.5e-4 against 5.3e-4 for fp32 on an H200) while leaving the
// 2-norm, which the rounding everywhere dominates, unmoved. Shapes: partial tiles, grouped kv
// heads, each head size, and Llama 3 8B's (32 heads over 8 kv heads of 128, 4096 tokens).
TEST_F(CudaKernels, FusedAttentionMatchesTheHostInBf16) {
  for (const AttentionShape& s :
       {AttentionShape{2, 150, 4, 2, 64}, AttentionShape{1, 70, 2, 1, 128},
        AttentionShape{1, 100, 3, 3, 32}, AttentionShape{2, 65, 2, 1, 16},
        AttentionShape{1, 4096, 32, 8, 128}}) {
    const AttentionCase c = attention_case(s);
    SCOPED_TRACE(c.name);
    const std::vector<std::vector<uint16_t>>& bits = c.in.bits;
    const HostAttention& want = c.want;
    const float scale = c.a.scale;

    // Backward reads the host's bf16 output: its D has the host's bits.
    Dev<uint16_t> Q(bits[0]), K(bits[1]), V(bits[2]), DA(bits[3]), A(want.attn_bf16);
    Dev<float> L(want.lse.size()), O(want.attn.size()), R(want.lse.size()), DQ(want.dq.size());
    Dev<float> DK(want.dk.size()), DV(want.dv.size());  // zeros: backward adds into them
    flash_attention_forward(Q.get(), K.get(), V.get(), s.B, s.T, s.nh, s.nkv, s.hd, scale, L.get(),
                            O.get(), nullptr);
    flash_attention_backward(Q.get(), K.get(), V.get(), L.get(), A.get(), DA.get(), s.B, s.T, s.nh,
                             s.nkv, s.hd, scale, R.get(), DQ.get(), DK.get(), DV.get(), nullptr);
    Dev<uint16_t> O16(std::vector<uint16_t>(want.attn.size(), 0x7fc1));
    Dev<float> L2(want.lse.size());
    flash_attention_forward(Q.get(), K.get(), V.get(), s.B, s.T, s.nh, s.nkv, s.hd, scale, L2.get(),
                            nullptr, nullptr, O16.get());
    std::vector<uint16_t> o16(want.attn.size());
    const std::vector<float> o = O.host();
    hk::from_fp32(o.data(), o16.data(), DType::BF16, static_cast<int64_t>(o.size()));
    EXPECT_EQ(O16.host(), o16) << "attn in bf16: the fp32 output, rounded";
    EXPECT_EQ(L2.host(), L.host()) << "lse: the same with a bf16 output";
    std::vector<float> delta(want.lse.size());
    cpu_backend()->attention_delta(c.a, want.attn_bf16.data(), bits[3].data(), delta.data());
    EXPECT_EQ(R.host(), delta) << "D: the host's bits";
    expect_bf16_attention({O.host(), L.host(), DQ.host(), DK.host(), DV.host(), {}}, want, c.fp32);
  }
}

TEST_F(CudaKernels, FusedAttentionRefusesAHeadSizeOrScaleItDoesNotTake) {
  EXPECT_FALSE(flash_attention_supported(8));
  EXPECT_FALSE(flash_attention_supported(96));
  EXPECT_TRUE(flash_attention_supported(64));  // 54 KiB: every device from sm_80 on
  // 102 KiB: not on a device allowing 99 KiB a block (sm_86, sm_89, sm_120).
  int device = 0, optin = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
            cudaSuccess);
  EXPECT_EQ(flash::shared_bytes(128), 104448u);  // 102 KiB at head size 128
  if (optin >= 232448) {                         // sm_90: 227 KiB
    EXPECT_TRUE(flash_attention_supported(128)) << optin;
  }
  if (optin < 104448) {
    EXPECT_FALSE(flash_attention_supported(128)) << optin;
  }
  Dev<uint16_t> X(64);
  Dev<float> F(64);
  EXPECT_THROW(flash_attention_forward(X.get(), X.get(), X.get(), 1, 4, 1, 1, 8, 1.0f, F.get(),
                                       F.get(), nullptr),
               InvalidArgument);
  // The kernels take the row's max of scale * s as scale times the max of s.
  EXPECT_THROW(flash_attention_forward(X.get(), X.get(), X.get(), 1, 4, 1, 1, 16, 0.0f, F.get(),
                                       F.get(), nullptr),
               InvalidArgument);
}

// The host's causal softmax as decoder.cpp runs it (rows starting at query r0).
TEST_F(CudaKernels, CausalSoftmaxForwardAndBackwardMatchTheHost) {
  const int64_t batch = 3, rows = 40, keys = 64, r0 = keys - rows;
  auto scores = randn(batch * rows * keys, 14, 2.0f), dp = randn(batch * rows * keys, 15);
  const auto [p, lse, ds, num, inv] = host_causal_softmax(scores, dp, batch, rows, keys, r0);
  Dev<float> S(scores), L(batch * rows), DP(dp);
  causal_softmax_forward(S.get(), L.get(), batch, rows, keys, r0, nullptr);
  expect_close(S.host(), p, 1e-5, "prob");
  expect_close(L.host(), lse, 1e-5, "lse");
  Dev<float> S2(scores);
  causal_softmax_backward(S2.get(), DP.get(), L.get(), batch, rows, keys, r0, nullptr);
  expect_close(S2.host(), p, 1e-5, "recomputed prob");
  expect_close(DP.host(), ds, 1e-5, "dscores");
  // bf16 attention's numerators and 1 / sum, laid out as lse.
  Dev<float> SN(scores), LN(batch * rows), IN(batch * rows);
  causal_softmax_forward(SN.get(), LN.get(), batch, rows, keys, r0, nullptr, 0, IN.get());
  expect_close(SN.host(), num, 1e-5, "numerators");
  expect_close(IN.host(), inv, 1e-5, "1 / sum");
  expect_close(LN.host(), lse, 1e-5, "lse with numerators");
}

TEST_F(CudaKernels, CrossEntropyLossAndGradientMatchTheHost) {
  const int64_t rows = 19, vocab = 1000;
  const float coef = 1.0f / rows;
  auto logits = randn(rows * vocab, 16, 3.0f);
  std::vector<int32_t> targets(rows);
  for (int64_t r = 0; r < rows; ++r) targets[r] = static_cast<int32_t>((r * 37) % vocab);
  targets[3] = targets[11] = -1;  // masked rows: no loss, no gradient
  std::vector<float> grad = logits, loss(rows);
  host_cross_entropy(grad, targets, vocab, coef, loss);
  Dev<float> X(logits), X2(logits), RL(rows), RL2(rows);
  Dev<int32_t> T(targets);
  cross_entropy(X.get(), T.get(), rows, vocab, coef, true, RL.get(), nullptr);
  cross_entropy(X2.get(), T.get(), rows, vocab, coef, false, RL2.get(), nullptr);
  expect_close(RL.host(), loss, 1e-5, "loss");
  expect_close(RL2.host(), loss, 1e-5, "loss without gradient");
  expect_close(X.host(), grad, 1e-5, "dlogits");
  expect_close(X2.host(), logits, 0.0, "logits untouched without gradient");

  // The gradient rounded to bf16 in the kernel: the fp32 kernel's bits rounded, masked rows
  // zeros, the logits and the loss as they were.
  Dev<float> X3(logits), RL3(rows);
  Dev<uint16_t> G(std::vector<uint16_t>(logits.size(), 0x7fc1));
  cross_entropy(X3.get(), T.get(), rows, vocab, coef, true, RL3.get(), nullptr, G.get());
  const std::vector<float> dlogits = X.host();
  const std::vector<uint16_t> g16 = G.host();
  size_t differ = 0;
  for (size_t i = 0; i < g16.size(); ++i) differ += g16[i] != kmath::fp32_to_bf16(dlogits[i]);
  EXPECT_EQ(differ, 0u) << "of " << g16.size() << " bf16 gradients";
  EXPECT_EQ(g16[3 * vocab + 5], 0u) << "a masked row's gradient";
  expect_close(RL3.host(), RL.host(), 0.0, "loss with the bf16 gradient");
  expect_close(X3.host(), logits, 0.0, "logits kept with the bf16 gradient");
}

TEST_F(CudaKernels, GradientAccumulationNormAndNonfiniteCount) {
  const int64_t n = 300001;
  auto x = randn(n, 17), y = randn(n, 18);
  Dev<float> X(x), Y(y), P(kSumSquaresPartials), OUT(1);
  add_inplace(Y.get(), X.get(), n, nullptr);
  auto want = y;
  hk::add_inplace(want.data(), x.data(), n);
  expect_close(Y.host(), want, 0.0, "add");
  sum_squares(X.get(), n, P.get(), OUT.get(), nullptr);
  const float got = OUT.host()[0];
  EXPECT_NEAR(got, hk::sum_squares(x.data(), n), 1e-5 * got);
  sum_squares(X.get(), n, P.get(), OUT.get(), nullptr);
  EXPECT_EQ(kmath::float_bits(OUT.host()[0]), kmath::float_bits(got));  // deterministic
  x[5] = std::numeric_limits<float>::quiet_NaN();
  x[n - 1] = -std::numeric_limits<float>::infinity();
  Dev<float> X2(x);
  Dev<unsigned int> C(std::vector<unsigned int>{3});
  count_nonfinite(X2.get(), n, C.get(), nullptr);
  EXPECT_EQ(C.host()[0], 5u);
}

// Adam on the GPU: cpu_adam::adam_step's bits on this CPU, for both formulas, fp32 and bf16
// moments, every copy-out (bf16, fp16, none), AdamW's and L2's decay, with and without a
// gradient multiplier and bias correction (the optimizer state kept on the device).
TEST_F(CudaKernels, AdamStepHasCpuAdamsBits) {
  // More elements than the launch has threads (8192 blocks of 256): the grid-stride loop runs
  // a second pass, and a partial third.
  const int64_t n = 4194319;
  struct Variant {
    bool pytorch, bf16_moments;
    DType out;  // F32: no copy-out
    bool adamw, bias_correction;
    double grad_scale;
  };
  for (const Variant c : {Variant{false, false, DType::BF16, true, true, 0.37},
                          Variant{false, true, DType::F16, false, true, 1.0},
                          Variant{true, false, DType::F32, true, false, 0.37},
                          Variant{true, true, DType::BF16, false, false, 1.0},
                          Variant{false, false, DType::F32, false, false, 0.5}}) {
    cpu_adam::AdamParams hp;
    hp.lr = 3e-3;
    hp.weight_decay = 0.1;
    hp.adamw_mode = c.adamw;
    hp.bias_correction = c.bias_correction;
    hp.grad_scale = c.grad_scale;
    hp.step = 5;
    hp.formula = c.pytorch ? cpu_adam::Formula::kPyTorch : cpu_adam::Formula::kDeepSpeed;
    auto p = randn(n, 31), g = randn(n, 32, 0.01f), m = randn(n, 33, 0.001f),
         v = randn(n, 34, 1e-6f);
    for (float& x : v) x = std::fabs(x);
    std::vector<uint16_t> mb(n), vb(n);
    for (int64_t i = 0; i < n; ++i) {
      mb[i] = kmath::fp32_to_bf16(m[i]);
      vb[i] = kmath::fp32_to_bf16(v[i]);
    }
    Dev<float> P(p), G(g), M(m), V(v);
    Dev<uint16_t> MB(mb), VB(vb), OUT(static_cast<size_t>(n));
    void* dm = c.bf16_moments ? static_cast<void*>(MB.get()) : M.get();
    void* dv = c.bf16_moments ? static_cast<void*>(VB.get()) : V.get();
    const bool copy_out = c.out != DType::F32;
    adam_step(cpu_adam::adam_coefficients(hp), c.pytorch, n, P.get(), G.get(), dm, dv,
              c.bf16_moments, copy_out ? OUT.get() : nullptr, c.out, nullptr);
    std::vector<uint16_t> out(n);
    const cpu_adam::Moments host_moments =
        c.bf16_moments ? cpu_adam::Moments{mb.data(), vb.data(), DType::BF16}
                       : cpu_adam::Moments{m.data(), v.data(), DType::F32};
    cpu_adam::adam_step(hp, n, p.data(), {g.data(), DType::F32}, host_moments,
                        {copy_out ? out.data() : nullptr, copy_out ? c.out : DType::BF16});
    const std::string what = std::string(c.pytorch ? "pytorch" : "deepspeed") +
                             (c.bf16_moments ? ", bf16 moments" : ", fp32 moments") +
                             ", copy-out " + std::string(copy_out ? dtype_name(c.out) : "none") +
                             (c.adamw ? ", adamw" : ", l2") + (c.bias_correction ? ", bc" : "");
    expect_close(P.host(), p, 0.0, "params, " + what);
    if (copy_out) {
      EXPECT_EQ(OUT.host(), out) << what;
    }
    if (c.bf16_moments) {
      EXPECT_EQ(MB.host(), mb) << what;
      EXPECT_EQ(VB.host(), vb) << what;
    } else {
      expect_close(M.host(), m, 0.0, "exp_avg, " + what);
      expect_close(V.host(), v, 0.0, "exp_avg_sq, " + what);
    }
  }
}

// The gradient norm's block sums on the GPU: cpu_adam::block_sums_of_squares' bits on this CPU,
// with the engine's block (2048), a short last block, a block shorter than the lanes, and
// magnitudes spread far enough that another order of additions would show; at Llama 3 8B's head
// (128256 x 4096 elements, 2 GiB) and at toy sizes.
TEST_F(CudaKernels, BlockSumsOfSquaresHaveCpuAdamsBits) {
  struct Case {
    int64_t n, block;
  };
  for (const Case c : {Case{1, 2048}, Case{5, 3}, Case{2048 * 37 + 11, 2048}, Case{100003, 7},
                       Case{128256LL * 4096, 2048}}) {
    const std::string what = "n " + std::to_string(c.n) + ", block " + std::to_string(c.block);
    auto x = spread(static_cast<size_t>(c.n), 41, 0.01f);  // 2 GiB: randn would take 20 s
    for (int64_t i = 0; i < c.n; i += 5) x[i] *= static_cast<float>(1 << (i % 17));
    const int64_t blocks = (c.n + c.block - 1) / c.block;
    Dev<float> X(x);
    Dev<double> OUT(static_cast<size_t>(blocks));
    block_sums_of_squares(X.get(), c.n, c.block, OUT.get(), nullptr);
    std::vector<double> want(blocks);
    const cpu_adam::Executor ex(4);
    cpu_adam::block_sums_of_squares(x.data(), DType::F32, c.n, c.block, want.data(), &ex);
    const std::vector<double> got = OUT.host();
    int64_t differ = 0;
    for (int64_t b = 0; b < blocks; ++b)
      differ += std::bit_cast<uint64_t>(got[b]) != std::bit_cast<uint64_t>(want[b]);
    EXPECT_EQ(differ, 0) << "blocks of " << blocks << ", " << what << ": first " << got[0] << " vs "
                         << want[0];
  }
}

TEST_F(CudaKernels, GemmMatchesTheHostForEveryTransposeDtypeAndBatch) {
  Gemm gemm;
  const int64_t m = 33, n = 47, k = 65, batch = 3;
  for (DType t : {DType::F32, DType::BF16, DType::F16}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        const int64_t lda = ta ? m : k, ldb = tb ? k : n, sa = m * k, sb = k * n, sc = m * n;
        auto a = randn(batch * sa, 19), b = randn(batch * sb, 20), c = randn(batch * sc, 21);
        for (auto* v : {&a, &b})
          for (float& e : *v) e = round_to(t, e);
        std::vector<float> want = c;
        double mag = 0;
        for (int64_t i = 0; i < batch; ++i)
          hk::gemm(ta, tb, m, n, k, 0.5f, a.data() + i * sa, lda, b.data() + i * sb, ldb, 2.0f,
                   want.data() + i * sc, n);
        for (float e : a) mag = std::max(mag, double(std::abs(e)));
        std::vector<uint16_t> a16(a.size()), b16(b.size());
        if (t != DType::F32) {
          hk::from_fp32(a.data(), a16.data(), t, static_cast<int64_t>(a.size()));
          hk::from_fp32(b.data(), b16.data(), t, static_cast<int64_t>(b.size()));
        }
        Dev<float> A(a), B(b), C(c);
        Dev<uint16_t> A16(a16), B16(b16);
        const void* pa = t == DType::F32 ? static_cast<const void*>(A.get()) : A16.get();
        const void* pb = t == DType::F32 ? static_cast<const void*>(B.get()) : B16.get();
        gemm.run(ta, tb, m, n, k, 0.5f, pa, lda, pb, ldb, t, 2.0f, C.get(), n, nullptr, batch, sa,
                 sb, sc);
        const double tol = (t == DType::F32 ? 1e-5 : 1e-4) * k * mag * mag;
        const auto got = C.host();
        for (size_t i = 0; i < got.size(); ++i)
          ASSERT_NEAR(got[i], want[i], tol) << dtype_name(t) << ta << tb << " @" << i;
      }
    }
  }
}

// Operands need not start on 256 bytes: a head's columns inside a row, a tensor at 64 elements
// into a bf16 slab, a batch whose stride is odd. Each operand here starts its own number of
// elements past an allocation (and batch entries one element further apart than they need), so
// cuBLASLt must be told the real alignment: an algorithm chosen for 256 bytes fails or faults.
TEST_F(CudaKernels, GemmOnOperandsThatStartOffTheirAllocationMatchesTheHost) {
  Gemm gemm;
  const int64_t m = 64, n = 128, k = 256;
  struct Offsets {
    int64_t a, b, c;
  };
  for (DType t : {DType::F32, DType::BF16}) {
    for (const int64_t batch : {1, 2}) {
      for (const Offsets o : {Offsets{1, 0, 3}, Offsets{8, 64, 1}, Offsets{64, 2, 32}}) {
        const std::string what = std::string(dtype_name(t)) + " batch " + std::to_string(batch) +
                                 " offsets " + std::to_string(o.a) + "/" + std::to_string(o.b) +
                                 "/" + std::to_string(o.c);
        const int64_t pad = batch > 1 ? 1 : 0;
        const int64_t sa = m * k + pad, sb = k * n + pad, sc = m * n + pad;
        auto a = randn(batch * sa, 23), b = randn(batch * sb, 24);
        for (auto* v : {&a, &b})
          for (float& e : *v) e = round_to(t, e);
        std::vector<float> want(static_cast<size_t>(batch * sc), 0.0f);
        for (int64_t i = 0; i < batch; ++i)
          hk::gemm(false, true, m, n, k, 1.0f, a.data() + i * sa, k, b.data() + i * sb, k, 0.0f,
                   want.data() + i * sc, n);
        // The operands placed `off` elements into zero-filled buffers, in the GEMM's dtype.
        auto placed = [&](const std::vector<float>& v, int64_t off) {
          std::vector<uint16_t> out(static_cast<size_t>(off) * 2 + v.size() * 2, 0);
          if (t == DType::F32)
            std::memcpy(reinterpret_cast<float*>(out.data()) + off, v.data(), v.size() * 4);
          else
            hk::from_fp32(v.data(), out.data() + off, t, static_cast<int64_t>(v.size()));
          return out;
        };
        const size_t esize = dtype_size(t);
        Dev<uint16_t> A(placed(a, o.a)), B(placed(b, o.b));
        Dev<float> C(static_cast<size_t>(o.c + batch * sc));
        const auto at = [&](Dev<uint16_t>& d, int64_t off) {
          return static_cast<const void*>(reinterpret_cast<const char*>(d.get()) + off * esize);
        };
        gemm.run(false, true, m, n, k, 1.0f, at(A, o.a), k, at(B, o.b), k, t, 0.0f, C.get() + o.c,
                 n, nullptr, batch, sa, sb, sc);
        const auto got = C.host();
        for (int64_t i = 0; i < batch; ++i)
          for (int64_t e = 0; e < m * n; ++e)
            ASSERT_NEAR(got[o.c + i * sc + e], want[i * sc + e], 1e-4 * k)
                << what << " entry " << i << " @" << e;
      }
    }
  }
}

// The decoder's GEMMs at Llama 3 8B's widths (hidden 4096, intermediate 14336; 512 tokens so
// that the host's reference stays short) in bf16 operands with fp32 accumulation, as bf16
// compute runs them: the forward Y = X W^T, the input gradient dX = dY W and the weight
// gradient dW = dY^T X, against OpenBLAS on the same rounded operands. Both sum in fp32 in
// different orders, and tensor cores may round each step of 16 products toward zero: over k up
// to 14336 that drifts by up to about k / 16 ulps, 1e-4 of the result's norm at most; a wrong
// transpose, leading dimension or dtype is off by the result's whole size.
TEST_F(CudaKernels, GemmAtLlama3_8BShapesMatchesTheHost) {
  Gemm gemm;
  const int64_t tokens = 512, hidden = 4096, inter = 14336;
  struct Shape {
    const char* what;
    bool ta, tb;
    int64_t m, n, k;
  };
  const Shape shapes[] = {
      {"forward (gate/up projection)", false, true, tokens, inter, hidden},
      {"input gradient (of the gate/up projection)", false, false, tokens, hidden, inter},
      {"weight gradient", true, false, inter, hidden, tokens}};
  for (const Shape& sh : shapes) {
    const int64_t lda = sh.ta ? sh.m : sh.k, ldb = sh.tb ? sh.k : sh.n;
    auto a = randn(sh.m * sh.k, 31, 0.05f), b = randn(sh.k * sh.n, 32, 0.05f);
    for (auto* v : {&a, &b})
      for (float& e : *v) e = round_to(DType::BF16, e);
    std::vector<float> want(static_cast<size_t>(sh.m * sh.n));
    hk::gemm(sh.ta, sh.tb, sh.m, sh.n, sh.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, want.data(),
             sh.n);
    std::vector<uint16_t> a16(a.size()), b16(b.size());
    hk::from_fp32(a.data(), a16.data(), DType::BF16, static_cast<int64_t>(a.size()));
    hk::from_fp32(b.data(), b16.data(), DType::BF16, static_cast<int64_t>(b.size()));
    Dev<uint16_t> A16(a16), B16(b16);
    Dev<float> C(want.size());
    gemm.run(sh.ta, sh.tb, sh.m, sh.n, sh.k, 1.0f, A16.get(), lda, B16.get(), ldb, DType::BF16,
             0.0f, C.get(), sh.n, nullptr);
    const auto got = C.host();
    double diff = 0, norm = 0, largest = 0, worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double d = double(got[i]) - want[i];
      diff += d * d;
      norm += double(want[i]) * want[i];
      largest = std::max(largest, std::abs(double(want[i])));
      worst = std::max(worst, std::abs(d));
    }
    EXPECT_LE(std::sqrt(diff), 1e-4 * std::sqrt(norm)) << sh.what;
    EXPECT_LE(worst, 2e-3 * largest) << sh.what;
  }
}

}  // namespace
}  // namespace outcore::device::cuda
