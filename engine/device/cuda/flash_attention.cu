// The fused causal attention's CUDA kernels (see cuda_kernels.hpp): the thread blocks of
// flash_attention_tiles.hpp (decision 031), run with Simt, the thread's view of a GPU: bf16
// operands, products on tensor cores through mma.sync, no score matrix in device memory.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/error.hpp"
#include "engine/device/cuda/cuda_check.hpp"
#include "engine/device/cuda/cuda_kernels.hpp"
#include "engine/device/flash_attention_tiles.hpp"
#include "engine/device/kernel_math.hpp"

namespace outcore::device::cuda {
namespace {

using Geometry = flash::Geometry;  // shapes shared by the kernels of one launch

// flash_attention_tiles.hpp's X on a GPU: the thread itself.
struct Simt {
  __device__ __forceinline__ int thread() const { return threadIdx.x; }
  __device__ __forceinline__ int block(int axis) const {
    return axis == 0 ? blockIdx.x : axis == 1 ? blockIdx.y : blockIdx.z;
  }
  __device__ __forceinline__ unsigned char* shared() const {
    extern __shared__ __align__(128) unsigned char tiles_smem[];
    return tiles_smem;
  }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
  __device__ __forceinline__ float shfl_xor(float v, int mask) const {
    return __shfl_xor_sync(0xffffffffu, v, mask);
  }
  __device__ __forceinline__ void ldmatrix(uint32_t (&r)[4], const uint16_t* row) const {
    const auto at = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
  }
  __device__ __forceinline__ void ldmatrix_trans(uint32_t (&r)[4], const uint16_t* row) const {
    const auto at = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
  }
  __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                      uint32_t b1) const {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ void copy16_async(void* dst, const void* src) const {
    const auto at = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at),
                 "l"(__cvta_generic_to_global(src))
                 : "memory");
  }
  __device__ __forceinline__ void wait_all() const {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  }
  __device__ __forceinline__ void zero16(void* dst) const {
    *static_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ float exp2(float v) const {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(v));
    return r;
  }
  __device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) const {
    uint32_t r;  // the first source goes to the upper half
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

template <int HD>
__global__ void __launch_bounds__(flash::kThreads)
    tiles_forward_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v, float* lse,
                         float* attn, uint16_t* attn16, flash::Geometry g) {
  Simt x;
  flash::forward_block<HD>(x, q, k, v, lse, attn, attn16, g);
}

template <int HD>
__global__ void __launch_bounds__(flash::kThreads)
    tiles_backward_dq_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                             const float* lse, const uint16_t* dattn, const float* delta, float* dq,
                             flash::Geometry g) {
  Simt x;
  flash::backward_dq_block<HD>(x, q, k, v, lse, dattn, delta, dq, g);
}

template <int HD>
__global__ void __launch_bounds__(flash::kThreads)
    tiles_backward_dkv_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const float* lse, const uint16_t* dattn, const float* delta,
                              float* dk, float* dv, flash::Geometry g) {
  Simt x;
  flash::backward_dkv_block<HD>(x, q, k, v, lse, dattn, delta, dk, dv, g);
}

dim3 grid(flash::Grid g) {
  return dim3(static_cast<unsigned>(g.x), static_cast<unsigned>(g.y), static_cast<unsigned>(g.z));
}

template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
}

Geometry geometry(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float scale,
                  const char* what) {
  if (B <= 0 || T <= 0 || nh <= 0 || nkv <= 0 || nh % nkv != 0 || !flash_attention_supported(hd))
    throw InvalidArgument(std::string(what) + ": unsupported shape");
  if (T > flash::kMaxTokens || nh > 65535 || B > 65535)
    throw InvalidArgument(std::string(what) + ": sequence, heads or batch too large");
  if (!(scale > 0.0f))  // the kernels take a row's max of scale * s as scale times its max of s
    throw InvalidArgument(std::string(what) + ": scale must be positive");
  return {static_cast<int>(T), static_cast<int>(nh), static_cast<int>(nkv),
          static_cast<int>(nh / nkv), scale};
}

template <int HD>
void forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, Geometry g,
             float* lse, float* attn, uint16_t* attn16, cudaStream_t s) {
  allow_shared(tiles_forward_kernel<HD>, flash::Tiles<HD>::kForward);
  tiles_forward_kernel<HD><<<grid(flash::forward_grid(g, static_cast<int>(B))), flash::kThreads,
                             flash::Tiles<HD>::kForward, s>>>(q, k, v, lse, attn, attn16, g);
  LAUNCHED();
}

template <int HD>
void backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* lse,
              const uint16_t* attn, const uint16_t* dattn, int64_t B, Geometry g, float* delta,
              float* dq, float* dk, float* dv, cudaStream_t s) {
  using L = flash::Tiles<HD>;
  allow_shared(tiles_backward_dq_kernel<HD>, L::kDq);
  allow_shared(tiles_backward_dkv_kernel<HD>, L::kDkv);
  attention_delta(attn, dattn, B, g.T, g.nh, HD, delta, s);
  tiles_backward_dq_kernel<HD>
      <<<grid(flash::dq_grid(g, static_cast<int>(B))), flash::kThreads, L::kDq, s>>>(
          q, k, v, lse, dattn, delta, dq, g);
  LAUNCHED();
  tiles_backward_dkv_kernel<HD>
      <<<grid(flash::dkv_grid(g, static_cast<int>(B))), flash::kThreads, L::kDkv, s>>>(
          q, k, v, lse, dattn, delta, dk, dv, g);
  LAUNCHED();
}

}  // namespace

bool flash_attention_supported(int64_t hd) {
  int device = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return flash::fits_shared(hd, static_cast<size_t>(optin));
}

void flash_attention_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B,
                             int64_t T, int64_t nh, int64_t nkv, int64_t hd, float scale,
                             float* lse, float* attn, StreamHandle stream, uint16_t* attn_bf16) {
  const Geometry g = geometry(B, T, nh, nkv, hd, scale, "flash_attention_forward");
  const auto s = static_cast<cudaStream_t>(stream);
  switch (hd) {
    case 16:
      return forward<16>(q, k, v, B, g, lse, attn, attn_bf16, s);
    case 32:
      return forward<32>(q, k, v, B, g, lse, attn, attn_bf16, s);
    case 64:
      return forward<64>(q, k, v, B, g, lse, attn, attn_bf16, s);
    default:
      return forward<128>(q, k, v, B, g, lse, attn, attn_bf16, s);
  }
}

void flash_attention_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const float* lse, const uint16_t* attn, const uint16_t* dattn,
                              int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                              float scale, float* delta, float* dq, float* dk, float* dv,
                              StreamHandle stream) {
  const Geometry g = geometry(B, T, nh, nkv, hd, scale, "flash_attention_backward");
  const auto s = static_cast<cudaStream_t>(stream);
  switch (hd) {
    case 16:
      return backward<16>(q, k, v, lse, attn, dattn, B, g, delta, dq, dk, dv, s);
    case 32:
      return backward<32>(q, k, v, lse, attn, dattn, B, g, delta, dq, dk, dv, s);
    case 64:
      return backward<64>(q, k, v, lse, attn, dattn, B, g, delta, dq, dk, dv, s);
    default:
      return backward<128>(q, k, v, lse, attn, dattn, B, g, delta, dq, dk, dv, s);
  }
}

}  // namespace outcore::device::cuda
