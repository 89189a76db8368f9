// ComputeBackend's default attention: head by head and block by block through the backend's
// own gemm and causal softmax, the order the CPU backends compute in; make_backend, the choice of
// backend for a device.
#include "engine/device/compute_backend.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "common/log.hpp"
#include "engine/device/device.hpp"
#include "engine/device/flash_attention_tiles.hpp"
#include "engine/device/rmsnorm_dw_split.hpp"

namespace outcore::device {

namespace {

// The GEMMs of the default attention in the operands' dtype, and element offsets into them.
struct AttentionGemm {
  ComputeBackend& be;
  DType dtype;
  const void* at(const void* p, int64_t elements) const {
    return static_cast<const std::byte*>(p) + elements * static_cast<int64_t>(dtype_size(dtype));
  }
  void operator()(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
                  int64_t lda, const void* b, int64_t ldb, float beta, float* c,
                  int64_t ldc) const {
    if (dtype == DType::F32) {
      be.gemm(ta, tb, m, n, k, alpha, static_cast<const float*>(a), lda,
              static_cast<const float*>(b), ldb, beta, c, ldc);
    } else {
      be.gemm_bf16(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
  }
  // `src` as an operand of the next GEMM: itself in fp32, else rounded to bf16 into `lowp`.
  const void* operand(const float* src, int64_t n, void* lowp) const {
    if (dtype == DType::F32) return src;
    be.from_fp32(src, lowp, DType::BF16, n);
    return lowp;
  }
};

void check_attention_output(const ComputeBackend::Attention& a, const void* attn_bf16) {
  if (attn_bf16 != nullptr && a.dtype != DType::BF16)
    throw InvalidArgument("attention: a bf16 output with operands in " +
                          std::string(dtype_name(a.dtype)));
}

void check_attention_dtype(const ComputeBackend::Attention& a, const void* lowp) {
  if (a.dtype != DType::F32 && a.dtype != DType::BF16)
    throw InvalidArgument("attention: operands in " + std::string(dtype_name(a.dtype)) +
                          " (fp32 or bf16 only)");
  if (a.dtype == DType::BF16 && lowp == nullptr)
    throw InvalidArgument("attention: bf16 operands need the bf16 scratch");
}

}  // namespace

void ComputeBackend::attention_forward(const Attention& a, const void* q, const void* k,
                                       const void* v, float* lse, float* attn, float* scores,
                                       void* lowp, void* attn_bf16) {
  check_attention_dtype(a, lowp);
  check_attention_output(a, attn_bf16);
  // bf16: each block's 1 / sum in the rows scratch.
  float* inv_sum = a.dtype == DType::BF16 ? attention_rows_scratch(a, lowp) : nullptr;
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t g = 0; g < a.nkv; ++g)
      attention_forward_group(a, b, g, q, k, v, lse, attn, scores, lowp, inv_sum);
  if (attn_bf16 != nullptr) from_fp32(attn, attn_bf16, DType::BF16, a.B * a.T * a.nh * a.hd);
}

void ComputeBackend::attention_forward_group(const Attention& a, int64_t b, int64_t g,
                                             const void* q, const void* k, const void* v,
                                             float* lse, float* attn, float* scores, void* p16,
                                             float* inv_sum) {
  const AttentionGemm mm{*this, a.dtype};
  const int64_t Q = a.nh * a.hd, KV = a.nkv * a.hd, group = a.nh / a.nkv;
  const void* kb = mm.at(k, b * a.T * KV + g * a.hd);
  const void* vb = mm.at(v, b * a.T * KV + g * a.hd);
  // bf16: each block's softmax numerators, rounded, times v, then each row divided by its sum.
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    float* l = lse + (b * a.nh + h) * a.T;
    for (int64_t r0 = 0; r0 < a.T; r0 += a.block) {
      const int64_t rows = std::min(a.block, a.T - r0), keys = r0 + rows;
      const void* qb = mm.at(q, (b * a.T + r0) * Q + h * a.hd);
      float* out = attn + (b * a.T + r0) * Q + h * a.hd;
      mm(false, true, rows, keys, a.hd, a.scale, qb, Q, kb, KV, 0.0f, scores, keys);
      causal_softmax_forward(scores, l + r0, rows, keys, r0, inv_sum);
      const void* p = mm.operand(scores, rows * keys, p16);
      mm(false, false, rows, a.hd, keys, 1.0f, p, keys, vb, KV, 0.0f, out, Q);
      if (inv_sum != nullptr) scale_rows(out, rows, a.hd, Q, inv_sum);
    }
  }
}

const float* ComputeBackend::attention_backward_delta(const Attention& a, const void* attn,
                                                      const void* dattn, void* lowp) {
  check_attention_dtype(a, lowp);
  if (a.dtype != DType::BF16) return nullptr;
  if (attn == nullptr) throw InvalidArgument("attention backward: bf16 needs forward's output");
  float* delta = attention_rows_scratch(a, lowp);
  attention_delta(a, attn, dattn, delta);
  return delta;
}

void ComputeBackend::attention_backward(const Attention& a, const void* q, const void* k,
                                        const void* v, const float* lse, const void* attn,
                                        const void* dattn, float* dq, float* dk, float* dv,
                                        float* scores, float* dprob, void* lowp) {
  const float* delta = attention_backward_delta(a, attn, dattn, lowp);
  // The bf16 scratch: probabilities, then score gradients, then D.
  void* lowp_ds = lowp == nullptr ? nullptr : static_cast<uint16_t*>(lowp) + a.block * a.T;
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t g = 0; g < a.nkv; ++g)
      attention_backward_group(a, b, g, q, k, v, lse, dattn, delta, dq, dk, dv, scores, dprob, lowp,
                               lowp_ds);
}

void ComputeBackend::attention_backward_group(const Attention& a, int64_t b, int64_t g,
                                              const void* q, const void* k, const void* v,
                                              const float* lse, const void* dattn,
                                              const float* delta, float* dq, float* dk, float* dv,
                                              float* scores, float* dprob, void* p16, void* ds16) {
  const AttentionGemm mm{*this, a.dtype};
  const int64_t Q = a.nh * a.hd, KV = a.nkv * a.hd, group = a.nh / a.nkv;
  const int64_t kv_at = b * a.T * KV + g * a.hd;
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    const int64_t rows_at = (b * a.nh + h) * a.T;  // the head's lse and D
    for (int64_t r0 = 0; r0 < a.T; r0 += a.block) {
      const int64_t rows = std::min(a.block, a.T - r0), keys = r0 + rows;
      const int64_t q_at = (b * a.T + r0) * Q + h * a.hd;
      mm(false, true, rows, keys, a.hd, a.scale, mm.at(q, q_at), Q, mm.at(k, kv_at), KV, 0.0f,
         scores, keys);
      mm(false, true, rows, keys, a.hd, 1.0f, mm.at(dattn, q_at), Q, mm.at(v, kv_at), KV, 0.0f,
         dprob, keys);
      causal_softmax_backward(scores, dprob, lse + rows_at + r0, rows, keys, r0,
                              delta == nullptr ? nullptr : delta + rows_at + r0);
      const void* ds = mm.operand(dprob, rows * keys, ds16);
      const void* p = mm.operand(scores, rows * keys, p16);
      mm(false, false, rows, a.hd, keys, a.scale, ds, keys, mm.at(k, kv_at), KV, 0.0f, dq + q_at,
         Q);
      mm(true, false, keys, a.hd, rows, a.scale, ds, keys, mm.at(q, q_at), Q, 1.0f, dk + kv_at, KV);
      mm(true, false, keys, a.hd, rows, 1.0f, p, keys, mm.at(dattn, q_at), Q, 1.0f, dv + kv_at, KV);
    }
  }
}

double gemm_flops(Device& device, ComputeBackend& backend, DType dtype, int64_t n, int reps) {
  if (dtype != DType::F32 && dtype != DType::BF16)
    throw InvalidArgument("gemm_flops: operands in fp32 or bf16 only");
  const size_t elems = static_cast<size_t>(n) * static_cast<size_t>(n);
  DeviceBuffer a = device.alloc(elems * dtype_size(dtype), "gemm rate");
  DeviceBuffer c = device.alloc(elems * sizeof(float), "gemm rate");
  backend.zero(a.data(), a.size());
  double best = 0;
  for (int r = 0; r <= reps; ++r) {  // call 0 warms up
    const auto t0 = std::chrono::steady_clock::now();
    if (dtype == DType::BF16)
      backend.gemm_bf16(false, true, n, n, n, 1.0f, a.data(), n, a.data(), n, 0.0f, c.as<float>(),
                        n);
    else
      backend.gemm(false, true, n, n, n, 1.0f, a.as<float>(), n, a.as<float>(), n, 0.0f,
                   c.as<float>(), n);
    backend.finish();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::max(best, 2.0 * double(n) * double(n) * double(n) / s);
  }
  return best;
}

double attention_train_flops(const ComputeBackend::Attention& a) {
  // T (T + 1) / 2 pairs per sequence and head
  return 3.0 * 4.0 * static_cast<double>(a.nh * a.hd) * static_cast<double>(a.B) *
         static_cast<double>(a.T) * static_cast<double>(a.T + 1) / 2.0;
}

double attention_flops(Device& device, ComputeBackend& backend, const ComputeBackend::Attention& a,
                       int reps) {
  if (a.B < 1 || a.T < 1 || a.nh < 1 || a.nkv < 1 || a.nh % a.nkv != 0 || a.hd < 1 || a.block < 1 ||
      reps < 1 || (a.dtype != DType::F32 && a.dtype != DType::BF16))
    throw InvalidArgument(fmt::format(
        "attention_flops: B {} T {} heads {} kv heads {} head size {} block {} reps {} {}: "
        "positive sizes, heads a multiple of kv heads, fp32 or bf16 operands",
        a.B, a.T, a.nh, a.nkv, a.hd, a.block, reps, dtype_name(a.dtype)));
  const size_t q_elems = static_cast<size_t>(a.B * a.T * a.nh * a.hd);
  const size_t kv_elems = static_cast<size_t>(a.B * a.T * a.nkv * a.hd);
  const size_t es = dtype_size(a.dtype);
  const size_t block_floats = static_cast<size_t>(a.block * a.T);
  const size_t lowp_bytes =
      std::max<size_t>(1, static_cast<size_t>(ComputeBackend::attention_bf16_scratch(a)) * 2);
  const char* what = "attention rate";
  DeviceBuffer q = device.alloc(q_elems * es, what), k = device.alloc(kv_elems * es, what),
               v = device.alloc(kv_elems * es, what), dattn = device.alloc(q_elems * es, what);
  DeviceBuffer attn = device.alloc(q_elems * sizeof(float), what),
               dq = device.alloc(q_elems * sizeof(float), what),
               dk = device.alloc(kv_elems * sizeof(float), what),
               dv = device.alloc(kv_elems * sizeof(float), what),
               lse = device.alloc(static_cast<size_t>(a.B * a.nh * a.T) * sizeof(float), what),
               scores = device.alloc(block_floats * sizeof(float), what),
               dprob = device.alloc(block_floats * sizeof(float), what),
               lowp = device.alloc(lowp_bytes, what);
  DeviceBuffer attn_saved = device.alloc(a.dtype == DType::BF16 ? q_elems * es : 1, what);
  // Zeros: every probability 1 / (keys), every gradient 0; the work is the same as for any data.
  for (DeviceBuffer* b : {&q, &k, &v, &dattn}) backend.zero(b->data(), b->size());
  const double flops = attention_train_flops(a);
  double best = 0;
  for (int r = 0; r <= reps; ++r) {  // run 0 warms up
    const auto t0 = std::chrono::steady_clock::now();
    backend.zero(dk.data(), dk.size());
    backend.zero(dv.data(), dv.size());
    // The output as the decoder keeps it for backward: fp32, or rounded to bf16 by attention.
    void* saved = a.dtype == DType::BF16 ? attn_saved.data() : attn.data();
    backend.attention_forward(a, q.data(), k.data(), v.data(), lse.as<float>(), attn.as<float>(),
                              scores.as<float>(), lowp.data(),
                              a.dtype == DType::BF16 ? saved : nullptr);
    backend.attention_backward(a, q.data(), k.data(), v.data(), lse.as<float>(), saved,
                               dattn.data(), dq.as<float>(), dk.as<float>(), dv.as<float>(),
                               scores.as<float>(), dprob.as<float>(), lowp.data());
    backend.finish();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) best = std::max(best, flops / s);
  }
  return best;
}

double copy_bytes_per_second(Device& device, size_t bytes, int reps) {
  if (bytes == 0 || reps < 1) throw InvalidArgument("copy_bytes_per_second: bytes and reps > 0");
  std::vector<std::byte> host(bytes);
  device.register_host(host.data(), bytes);
  double best = 0;
  try {
    DeviceBuffer d = device.alloc(bytes, "copy rate");
    std::unique_ptr<Stream> s = device.create_stream("copy rate");
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      s->copy_h2d(d.data(), host.data(), bytes);
      s->copy_d2h(host.data(), d.data(), bytes);
      s->synchronize();
      const double sec =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 2.0 * double(bytes) / sec);
    }
  } catch (...) {
    device.unregister_host(host.data());
    throw;
  }
  device.unregister_host(host.data());
  return best;
}

bool fused_attention_shape(const ComputeBackend::Attention& a) {
  if (a.dtype != DType::BF16) return false;
  if (a.hd != 16 && a.hd != 32 && a.hd != 64 && a.hd != 128) return false;
  return a.B <= 65535 && a.nh <= 65535 && a.T <= flash::kMaxTokens;  // the grid's limits
}

namespace {
std::atomic<uint64_t>& gemm_workspace_slot() {
  static std::atomic<uint64_t> slot{0};
  return slot;
}
}  // namespace

uint64_t gemm_workspace_bytes() { return gemm_workspace_slot().load(std::memory_order_relaxed); }

void request_gemm_workspace(std::string_view text, std::string_view source) {
  if (text.empty()) return;
  uint64_t mib = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), mib);
  if (ec != std::errc() || end != text.data() + text.size() || mib > kMaxGemmWorkspaceMiB) {
    log::warn("{}={}: not a whole number of MiB from 0 to {}; keeping {} MiB", source, text,
              kMaxGemmWorkspaceMiB, gemm_workspace_bytes() >> 20);
    return;
  }
  gemm_workspace_slot().store(mib << 20, std::memory_order_relaxed);
}

uint64_t attention_workspace_bytes(const ComputeBackend::Attention& a) {
  if (a.dtype == DType::F32)
    return charged_bytes(static_cast<size_t>(2 * a.nkv * a.block * a.T) * sizeof(float));
  return 0;  // bf16: the fused kernels or the default, on the model's scratch
}

uint64_t id_slot_bytes(int64_t tokens) {
  return charged_bytes(static_cast<size_t>(tokens) * sizeof(int32_t));
}

uint64_t token_groups_bytes(int64_t tokens) {
  return charged_bytes(static_cast<size_t>(3 * tokens + 1) * sizeof(int32_t));
}

Workspace backend_workspace(DeviceKind kind, const WorkspaceShape& shape) {
  if (kind != DeviceKind::Cuda) return {};
  return {.gemm = gemm_workspace_bytes(),
          .attention = attention_workspace_bytes(shape.attention),
          .ids = 2 * id_slot_bytes(shape.tokens) + token_groups_bytes(shape.tokens),
          .constants = shape.constant_bytes,
          .norm = charged_bytes(norm::kDwPartialBytes)};
}

std::shared_ptr<ComputeBackend> make_backend(Device& device) {
  if (device.kind() == DeviceKind::Cuda) return make_cuda_backend(device);
  if (auto* cpu = dynamic_cast<CpuDevice*>(&device)) return make_cpu_backend(*cpu);
  return cpu_backend();
}

}  // namespace outcore::device
