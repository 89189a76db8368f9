// The GPU side of `outcore doctor` (see doctor.hpp), in builds with CUDA.
#include <cuda_runtime.h>
#if OUTCORE_HAVE_NCCL
#include <nccl.h>
#endif

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "common/error.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "engine/device/cuda/cuda_kernels.hpp"
#include "engine/device/device.hpp"
#include "engine/device/kernel_math.hpp"
#include "engine/device/rmsnorm_dw_split.hpp"
#include "engine/model/model.hpp"
#include "tools/outcore/doctor.hpp"

namespace outcore::cli::doctor {
namespace {

namespace hk = device::cpu;
namespace ck = device::cuda;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw Error(fmt::format("{}: {}", what, cudaGetErrorString(err)));
}

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Device memory holding a copy of a host vector.
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n;
  explicit Dev(const std::vector<T>& h) : n(h.size()) {
    check(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc");
    check(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  explicit Dev(size_t count) : Dev(std::vector<T>(count)) {}
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  std::vector<T> host() const {
    std::vector<T> h(n);
    check(cudaDeviceSynchronize(), "kernel");
    check(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return h;
  }
};

// The largest |got - want| / max(1, |want|).
double max_rel(const std::vector<float>& got, const std::vector<float>& want) {
  double e = 0;
  for (size_t i = 0; i < got.size(); ++i)
    e = std::max(e, std::abs(double(got[i]) - want[i]) / std::max(1.0, std::abs(double(want[i]))));
  return std::isnan(e) ? INFINITY : e;
}

Line verdict(const std::string& name, double err, double tol) {
  return {"kernel " + name, err <= tol ? Verdict::kOk : Verdict::kFail,
          fmt::format("max relative error {:.2g} vs host (tolerance {:.0g})", err, tol)};
}

// Adam on the GPU (optimizer state kept there, decision 036): cpu_adam's bits for both formulas,
// AdamW's and L2's decay, fp32 and bf16 moments, bf16, fp16 and no copy-out.
Line check_adam() {
  const int64_t n = 1 << 16;
  struct Variant {
    bool pytorch, adamw, bf16_moments;
    DType out;  // F32: no copy-out
  };
  for (const Variant c :
       {Variant{false, true, false, DType::BF16}, Variant{true, false, true, DType::F16},
        Variant{false, false, false, DType::F32}}) {
    cpu_adam::AdamParams hp;
    hp.lr = 3e-3;
    hp.weight_decay = 0.1;
    hp.adamw_mode = c.adamw;
    hp.grad_scale = 0.37;
    hp.step = 5;
    hp.formula = c.pytorch ? cpu_adam::Formula::kPyTorch : cpu_adam::Formula::kDeepSpeed;
    auto p = randn(n, 11), g = randn(n, 12, 0.01f), m = randn(n, 13, 0.001f),
         v = randn(n, 14, 1e-6f);
    for (float& x : v) x = std::abs(x);
    std::vector<uint16_t> mb(n), vb(n);
    for (int64_t i = 0; i < n; ++i) {
      mb[i] = kmath::fp32_to_bf16(m[i]);
      vb[i] = kmath::fp32_to_bf16(v[i]);
    }
    Dev<float> P(p), G(g), M(m), V(v);
    Dev<uint16_t> MB(mb), VB(vb), OUT(static_cast<size_t>(n));
    const bool copy_out = c.out != DType::F32;
    ck::adam_step(cpu_adam::adam_coefficients(hp), c.pytorch, n, P.p, G.p,
                  c.bf16_moments ? static_cast<void*>(MB.p) : M.p,
                  c.bf16_moments ? static_cast<void*>(VB.p) : V.p, c.bf16_moments,
                  copy_out ? OUT.p : nullptr, c.out, nullptr);
    std::vector<uint16_t> out(n);
    cpu_adam::adam_step(hp, n, p.data(), {g.data(), DType::F32},
                        c.bf16_moments ? cpu_adam::Moments{mb.data(), vb.data(), DType::BF16}
                                       : cpu_adam::Moments{m.data(), v.data(), DType::F32},
                        {copy_out ? out.data() : nullptr, copy_out ? c.out : DType::BF16});
    const bool same =
        P.host() == p && (!copy_out || OUT.host() == out) &&
        (c.bf16_moments ? MB.host() == mb && VB.host() == vb : M.host() == m && V.host() == v);
    if (!same)
      return {"kernel adam", Verdict::kFail,
              fmt::format("{} formula{}: differs from the host's cpu_adam, so Adam on the GPU "
                          "would not be bit-identical",
                          c.pytorch ? "PyTorch's" : "DeepSpeed's",
                          c.bf16_moments ? ", bf16 moments" : "")};
  }
  return {"kernel adam", Verdict::kOk,
          "the host's bits (both formulas, fp32 and bf16 moments, every copy-out)"};
}

// The gradient norm's block sums on the GPU (gradients kept there for Adam on the GPU, decision
// 037): cpu_adam::block_sums_of_squares' bits, a short last block included.
Line check_norm_blocks() {
  const int64_t n = (int64_t{1} << 16) + 77, block = 2048, blocks = (n + block - 1) / block;
  auto x = randn(n, 15, 0.01f);
  for (int64_t i = 0; i < n; i += 5) x[i] *= static_cast<float>(1 << (i % 17));
  Dev<float> X(x);
  Dev<double> OUT(static_cast<size_t>(blocks));
  ck::block_sums_of_squares(X.p, n, block, OUT.p, nullptr);
  std::vector<double> want(blocks);
  cpu_adam::block_sums_of_squares(x.data(), DType::F32, n, block, want.data());
  if (OUT.host() != want)
    return {"kernel norm blocks", Verdict::kFail,
            "differs from the host's cpu_adam, so a gradient norm taken on the GPU would not be "
            "bit-identical"};
  return {"kernel norm blocks", Verdict::kOk, "the host's bits"};
}

Line check_swiglu() {
  const int64_t n = 1 << 16;
  auto g = randn(n, 1, 3.0f), u = randn(n, 2), da = randn(n, 3);
  std::vector<float> a(n), dg(n), du(n);
  hk::swiglu_forward(g.data(), u.data(), a.data(), n);
  hk::swiglu_backward(da.data(), g.data(), u.data(), dg.data(), du.data(), n);
  Dev<float> G(g), U(u), DA(da), A(n), DG(n), DU(n);
  ck::swiglu_forward(G.p, U.p, A.p, n, nullptr);
  ck::swiglu_backward(DA.p, G.p, U.p, DG.p, DU.p, n, nullptr);
  return verdict("swiglu",
                 std::max({max_rel(A.host(), a), max_rel(DG.host(), dg), max_rel(DU.host(), du)}),
                 2e-6);
}

Line check_rmsnorm() {
  // Rows enough for the weight gradient to split over row ranges (norm::dw_split).
  const int64_t rows = 1024, dim = 1024;
  auto x = randn(rows * dim, 4), w = randn(dim, 5), dy = randn(rows * dim, 6);
  std::vector<float> y(rows * dim), r(rows), dx(rows * dim), dw(dim);
  hk::rmsnorm_forward(x.data(), w.data(), 1e-5f, rows, dim, y.data(), r.data());
  hk::rmsnorm_backward(dy.data(), x.data(), w.data(), r.data(), rows, dim, dx.data(), dw.data());
  Dev<float> X(x), W(w), DY(dy), Y(rows * dim), R(rows), DX(rows * dim), DW(dim);
  Dev<float> partials(device::norm::kDwPartialFloats);
  ck::rmsnorm_forward(X.p, W.p, 1e-5f, rows, dim, Y.p, R.p, nullptr);
  ck::rmsnorm_backward(DY.p, X.p, W.p, R.p, rows, dim, DX.p, DW.p, partials.p, nullptr);
  return verdict(
      "rmsnorm",
      std::max({max_rel(Y.host(), y), max_rel(DX.host(), dx), max_rel(DW.host(), dw) / 10}), 1e-5);
}

Line check_rope() {
  const int64_t rows = 256, seq = 128, heads = 8, hd = 64;
  auto x = randn(rows * heads * hd, 7), c = randn(seq * hd / 2, 8), s = randn(seq * hd / 2, 9);
  auto want = x;
  hk::rope(want.data(), rows, seq, heads, hd, c.data(), s.data(), false);
  Dev<float> X(x), C(c), S(s);
  ck::rope(X.p, rows, seq, heads, hd, C.p, S.p, false, nullptr);
  return verdict("rope", max_rel(X.host(), want), 2e-6);
}

Line check_softmax() {
  const int64_t batch = 4, rows = 128, keys = 128;
  auto s = randn(batch * rows * keys, 10, 2.0f);
  std::vector<float> p = s, lse(batch * rows);
  for (int64_t r = 0; r < batch * rows; ++r) {
    float* row = p.data() + r * keys;
    const int64_t n = kmath::causal_keys(r % rows);
    lse[r] = hk::softmax_inplace(row, n);
    std::fill(row + n, row + keys, 0.0f);
  }
  Dev<float> S(s), L(batch * rows);
  ck::causal_softmax_forward(S.p, L.p, batch, rows, keys, 0, nullptr);
  return verdict("causal softmax", std::max(max_rel(S.host(), p), max_rel(L.host(), lse)), 1e-5);
}

Line check_cross_entropy() {
  const int64_t rows = 32, vocab = 32000;
  auto x = randn(rows * vocab, 11, 3.0f);
  std::vector<int32_t> t(rows);
  for (int64_t r = 0; r < rows; ++r) t[r] = static_cast<int32_t>(r * 997 % vocab);
  std::vector<float> g = x, loss(rows);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = g.data() + r * vocab;
    const float tl = row[t[r]];
    loss[r] = kmath::xent_loss(hk::softmax_inplace(row, vocab), tl);
    for (int64_t j = 0; j < vocab; ++j) row[j] = kmath::xent_scale(row[j], 0.5f);
    row[t[r]] = kmath::xent_target(row[t[r]], 0.5f);
  }
  Dev<float> X(x), RL(rows);
  Dev<int32_t> T(t);
  ck::cross_entropy(X.p, T.p, rows, vocab, 0.5f, true, RL.p, nullptr);
  return verdict("cross-entropy", std::max(max_rel(X.host(), g), max_rel(RL.host(), loss)), 1e-5);
}

Line check_casts() {
  auto x = randn(1 << 16, 12, 100.0f);
  double err = 0;
  for (DType t : {DType::BF16, DType::F16}) {
    std::vector<uint16_t> want(x.size());
    model::convert_from_fp32(x.data(), want.data(), t, x.size());
    Dev<float> X(x);
    Dev<uint16_t> H(x.size());
    ck::from_fp32(X.p, H.p, t, static_cast<int64_t>(x.size()), nullptr);
    if (H.host() != want) err = 1;
  }
  return verdict("casts bf16/fp16", err, 0);
}

Line check_gemm(ck::Gemm& gemm, DType t) {
  const int64_t m = 256, n = 384, k = 512;
  auto a = randn(m * k, 13), b = randn(n * k, 14);
  for (auto* v : {&a, &b})
    for (float& e : *v) e = round_to(t, e);
  std::vector<float> want(m * n);
  hk::gemm(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, want.data(), n);
  std::vector<uint16_t> a16(a.size()), b16(b.size());
  model::convert_from_fp32(a.data(), a16.data(), t == DType::F32 ? DType::BF16 : t, a.size());
  model::convert_from_fp32(b.data(), b16.data(), t == DType::F32 ? DType::BF16 : t, b.size());
  Dev<float> A(a), B(b), C(m * n);
  Dev<uint16_t> A16(a16), B16(b16);
  const bool f32 = t == DType::F32;
  gemm.run(false, true, m, n, k, 1.0f, f32 ? static_cast<void*>(A.p) : A16.p, k,
           f32 ? static_cast<void*>(B.p) : B16.p, k, t, 0.0f, C.p, n, nullptr);
  return verdict(fmt::format("gemm {}", dtype_name(t)), max_rel(C.host(), want) / std::sqrt(k),
                 1e-5);
}

Line gemm_tflops(ck::Gemm& gemm) {
  const int64_t s = 8192;
  Dev<uint16_t> A(static_cast<size_t>(s * s)), B(static_cast<size_t>(s * s));
  Dev<float> C(static_cast<size_t>(s * s));
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  gemm.run(false, true, s, s, s, 1.0f, A.p, s, B.p, s, DType::BF16, 0.0f, C.p, s, nullptr);
  const int iters = 10;
  check(cudaEventRecord(e0), "cudaEventRecord");
  for (int i = 0; i < iters; ++i)
    gemm.run(false, true, s, s, s, 1.0f, A.p, s, B.p, s, DType::BF16, 0.0f, C.p, s, nullptr);
  check(cudaEventRecord(e1), "cudaEventRecord");
  check(cudaEventSynchronize(e1), "gemm");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  const double tflops = 2.0 * s * s * s * iters / (ms * 1e-3) / 1e12;
  return {"gemm bf16 TFLOPS", Verdict::kOk,
          fmt::format("{:.0f} TFLOPS ({}^3, fp32 accumulation, fp32 output)", tflops, s)};
}

// The model FLOP/s of the CUDA backend's attention at Llama 3 8B's shape (what `outcore
// estimate --attention-tflops` takes for this GPU).
Line attention_tflops() {
  const std::unique_ptr<device::Device> dev = device::make_cuda_device({.ordinal = 0});
  const std::unique_ptr<device::ComputeBackend> backend = device::make_cuda_backend(*dev);
  const device::ComputeBackend::Attention a{.B = 1,
                                            .T = 4096,
                                            .nh = 32,
                                            .nkv = 8,
                                            .hd = 128,
                                            .block = 128,
                                            .scale = 1.0f / std::sqrt(128.0f),
                                            .dtype = DType::BF16};
  const double flops = device::attention_flops(*dev, *backend, a);
  return {
      "attention bf16 TFLOPS", Verdict::kOk,
      fmt::format("{:.1f} TFLOPS (causal, forward + backward, 4096 tokens, 32 heads of 128 "
                  "over 8 kv heads: Llama 3 8B; {})",
                  flops / 1e12,
                  device::fused_attention_shape(a) && device::cuda::flash_attention_supported(a.hd)
                      ? "fused kernels"
                      : "through GEMMs (the fused kernels need more shared memory per block "
                        "than this GPU allows)")};
}

Line copy_bandwidth() {
  const size_t bytes = size_t{256} << 20;
  void* host = nullptr;
  check(cudaHostAlloc(&host, bytes, cudaHostAllocDefault), "cudaHostAlloc (pinned)");
  void* dev = nullptr;
  check(cudaMalloc(&dev, bytes), "cudaMalloc");
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  auto time = [&](cudaMemcpyKind kind) {
    void* dst = kind == cudaMemcpyHostToDevice ? dev : host;
    const void* src = kind == cudaMemcpyHostToDevice ? host : dev;
    check(cudaMemcpy(dst, src, bytes, kind), "cudaMemcpy");
    check(cudaEventRecord(e0), "cudaEventRecord");
    for (int i = 0; i < 5; ++i) check(cudaMemcpyAsync(dst, src, bytes, kind), "cudaMemcpyAsync");
    check(cudaEventRecord(e1), "cudaEventRecord");
    check(cudaEventSynchronize(e1), "copy");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    return 5.0 * bytes / (ms * 1e-3) / 1e9;
  };
  const double h2d = time(cudaMemcpyHostToDevice), d2h = time(cudaMemcpyDeviceToHost);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(dev);
  cudaFreeHost(host);
  return {"pinned copies", Verdict::kOk,
          fmt::format("H2D {:.1f} GB/s, D2H {:.1f} GB/s (256 MiB, pinned)", h2d, d2h)};
}

Line nccl_line(int gpus) {
  if (gpus < 2) return {"nccl all-reduce", Verdict::kNone, "one GPU: nothing to reduce across"};
#if OUTCORE_HAVE_NCCL
  std::vector<ncclComm_t> comms(gpus);
  if (ncclCommInitAll(comms.data(), gpus, nullptr) != ncclSuccess)
    return {"nccl all-reduce", Verdict::kFail, "ncclCommInitAll failed"};
  const size_t n = size_t{1} << 20;
  std::vector<float*> bufs(gpus);
  ncclResult_t rc = ncclGroupStart();
  for (int g = 0; g < gpus; ++g) {
    check(cudaSetDevice(g), "cudaSetDevice");
    check(cudaMalloc(&bufs[g], n * sizeof(float)), "cudaMalloc");
    std::vector<float> ones(n, 1.0f);
    check(cudaMemcpy(bufs[g], ones.data(), n * sizeof(float), cudaMemcpyHostToDevice), "copy");
  }
  for (int g = 0; g < gpus; ++g)
    if (rc == ncclSuccess)
      rc = ncclAllReduce(bufs[g], bufs[g], n, ncclFloat, ncclSum, comms[g], nullptr);
  if (rc == ncclSuccess) rc = ncclGroupEnd();
  bool right = rc == ncclSuccess;
  for (int g = 0; g < gpus; ++g) {
    check(cudaSetDevice(g), "cudaSetDevice");
    float first = 0;
    if (right) check(cudaMemcpy(&first, bufs[g], sizeof first, cudaMemcpyDeviceToHost), "copy");
    right = right && first == float(gpus);
    cudaFree(bufs[g]);
    ncclCommDestroy(comms[g]);
  }
  check(cudaSetDevice(0), "cudaSetDevice");
  return {"nccl all-reduce", right ? Verdict::kOk : Verdict::kFail,
          right ? fmt::format("{} GPUs sum correctly", gpus)
                : fmt::format("wrong sum or NCCL error: {}", ncclGetErrorString(rc))};
#else
  return {"nccl all-reduce", Verdict::kWarn, "this build has no NCCL"};
#endif
}

// Runs one check; a thrown error becomes its fail line.
void run(std::vector<Line>& lines, const std::string& name, const std::function<Line()>& fn) {
  try {
    lines.push_back(fn());
  } catch (const std::exception& e) {
    lines.push_back({name, Verdict::kFail, e.what()});
  }
}

}  // namespace

std::vector<Line> gpu_checks() {
  const device::ProbeResult p = device::probe();
  if (!p.available) return {{"gpu", Verdict::kNone, p.summary()}};
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::vector<Line> lines;
  for (const device::GpuInfo& g : p.gpus) {
    const bool built_for = g.compute_capability_major >= 8;
    lines.push_back(
        {fmt::format("gpu {}", g.ordinal), built_for ? Verdict::kOk : Verdict::kFail,
         fmt::format("{}, {:.1f} GiB, sm_{}{}, driver {}.{}, runtime {}.{}{}", g.name,
                     g.total_memory_bytes / double(1ull << 30), g.compute_capability_major,
                     g.compute_capability_minor, driver / 1000, driver % 1000 / 10, runtime / 1000,
                     runtime % 1000 / 10,
                     built_for ? "" : " (this build has code for sm_80 and newer)")});
  }
  if (cudaSetDevice(0) != cudaSuccess) return lines;
  run(lines, "kernel casts bf16/fp16", check_casts);
  run(lines, "kernel swiglu", check_swiglu);
  run(lines, "kernel rope", check_rope);
  run(lines, "kernel rmsnorm", check_rmsnorm);
  run(lines, "kernel causal softmax", check_softmax);
  run(lines, "kernel cross-entropy", check_cross_entropy);
  run(lines, "kernel adam", check_adam);
  run(lines, "kernel norm blocks", check_norm_blocks);
  try {
    ck::Gemm gemm;
    for (DType t : {DType::F32, DType::BF16, DType::F16})
      run(lines, fmt::format("kernel gemm {}", dtype_name(t)), [&] { return check_gemm(gemm, t); });
    run(lines, "gemm bf16 TFLOPS", [&] { return gemm_tflops(gemm); });
  } catch (const std::exception& e) {
    lines.push_back({"kernel gemm", Verdict::kFail, e.what()});
  }
  run(lines, "attention bf16 TFLOPS", attention_tflops);
  run(lines, "pinned copies", copy_bandwidth);
  run(lines, "nccl all-reduce", [&] { return nccl_line(static_cast<int>(p.gpus.size())); });
  return lines;
}

}  // namespace outcore::cli::doctor
