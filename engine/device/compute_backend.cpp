// ComputeBackend's default attention: head by head and block by block through the backend's
// own gemm and causal softmax, the order the CPU backends compute in; make_backend, the choice of
// backend for a device.
#include "engine/device/compute_backend.hpp"

#include <algorithm>

#include "engine/device/device.hpp"

namespace outcore::device {

void ComputeBackend::attention_forward(const Attention& a, const float* q, const float* k,
                                       const float* v, float* lse, float* attn, float* scores) {
  const int64_t Q = a.nh * a.hd, KV = a.nkv * a.hd, group = a.nh / a.nkv;
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t h = 0; h < a.nh; ++h) {
      const int64_t g = h / group;
      const float* kb = k + b * a.T * KV + g * a.hd;
      const float* vb = v + b * a.T * KV + g * a.hd;
      float* l = lse + (b * a.nh + h) * a.T;
      for (int64_t r0 = 0; r0 < a.T; r0 += a.block) {
        const int64_t rows = std::min(a.block, a.T - r0), keys = r0 + rows;
        const float* qb = q + (b * a.T + r0) * Q + h * a.hd;
        gemm(false, true, rows, keys, a.hd, a.scale, qb, Q, kb, KV, 0.0f, scores, keys);
        causal_softmax_forward(scores, l + r0, rows, keys, r0);
        gemm(false, false, rows, a.hd, keys, 1.0f, scores, keys, vb, KV, 0.0f,
             attn + (b * a.T + r0) * Q + h * a.hd, Q);
      }
    }
  }
}

void ComputeBackend::attention_backward(const Attention& a, const float* q, const float* k,
                                        const float* v, const float* lse, const float* dattn,
                                        float* dq, float* dk, float* dv, float* scores,
                                        float* dprob) {
  const int64_t Q = a.nh * a.hd, KV = a.nkv * a.hd, group = a.nh / a.nkv;
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t h = 0; h < a.nh; ++h) {
      const int64_t g = h / group;
      const int64_t kv_at = b * a.T * KV + g * a.hd;
      const float* l = lse + (b * a.nh + h) * a.T;
      for (int64_t r0 = 0; r0 < a.T; r0 += a.block) {
        const int64_t rows = std::min(a.block, a.T - r0), keys = r0 + rows;
        const int64_t q_at = (b * a.T + r0) * Q + h * a.hd;
        gemm(false, true, rows, keys, a.hd, a.scale, q + q_at, Q, k + kv_at, KV, 0.0f, scores,
             keys);
        gemm(false, true, rows, keys, a.hd, 1.0f, dattn + q_at, Q, v + kv_at, KV, 0.0f, dprob,
             keys);
        causal_softmax_backward(scores, dprob, l + r0, rows, keys, r0);
        gemm(false, false, rows, a.hd, keys, a.scale, dprob, keys, k + kv_at, KV, 0.0f, dq + q_at,
             Q);
        gemm(true, false, keys, a.hd, rows, a.scale, dprob, keys, q + q_at, Q, 1.0f, dk + kv_at,
             KV);
        gemm(true, false, keys, a.hd, rows, 1.0f, scores, keys, dattn + q_at, Q, 1.0f, dv + kv_at,
             KV);
      }
    }
  }
}

std::shared_ptr<ComputeBackend> make_backend(Device& device) {
  if (device.kind() == DeviceKind::Cuda) return make_cuda_backend(device);
  if (const auto* cpu = dynamic_cast<const CpuDevice*>(&device)) return make_cpu_backend(*cpu);
  return cpu_backend();
}

}  // namespace outcore::device
