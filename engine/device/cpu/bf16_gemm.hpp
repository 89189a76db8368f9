// The CPU backend's bf16 GEMM: bf16 operands, fp32 products and accumulation, fp32 C (and, for
// GEMMs run from several threads at once, an fp32 GEMM on the calling thread: gemm_f32_serial).
// Where the CPU multiplies bf16 in hardware (AVX512_BF16 dot products or AMX tiles, as oneDNN
// detects them), it runs oneDNN's matmul on the operands as they are; elsewhere, and for any shape
// or stride oneDNN would only run in a generic implementation, both operands are widened to fp32
// (exact) and multiplied by OpenBLAS's sgemm. Either way each product of two bf16 values is
// exact in fp32, so the two differ only in summation order (and oneDNN's hardware path flushes
// subnormal inputs and results to zero). For a given shape and thread count the result is the
// same bits run after run; oneDNN may split a long K across threads, so another thread count
// (set_bf16_gemm_threads) can sum some GEMMs in another order.
#pragma once

#include <cstdint>
#include <string>

namespace outcore::device::cpu {

// C[m,n] = alpha * op(A) op(B) + beta * C, row-major; A and B bf16 (op(A) [m,k], op(B) [k,n]),
// C fp32. beta == 0 ignores C's old contents. Allocates per-thread scratch and, on the first
// call of a shape, compiles oneDNN's kernel for it (cached); throws outcore::Error if oneDNN
// fails to run one.
void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const void* a, int64_t lda, const void* b, int64_t ldb, float beta, float* c,
               int64_t ldc);

// The threads oneDNN's GEMMs run on (each GEMM of fewer than 2^25 FLOPs runs on the calling
// thread alone); 0, the default: OpenMP's default number (OMP_NUM_THREADS, else the processors
// this process may run on). A GEMM's summation order may depend on its threads (see above), so
// a run sets this once, before its first GEMM, and runs that are to give the same bits (ranks
// of a data-parallel run and the one rank they equal) use the same number: the default, or the
// same OMP_NUM_THREADS, whatever the ranks sharing a node.
void set_bf16_gemm_threads(int threads);
// The threads a GEMM of 2^25 FLOPs or more runs on now.
int bf16_gemm_threads();

// C = alpha op(A) op(B) + beta C in fp32 (any leading dimensions), on oneDNN's matmul on the
// calling thread alone; OpenBLAS's sgemm (gemm(), kernels.hpp) where oneDNN has only its
// reference kernel for the shape. For GEMMs that several threads make at once (the CPU
// backend's fp32 attention, kv heads in parallel), where each sgemm would start a team of its
// own: the same bits for a given shape, whatever the threads. The sums' order is oneDNN's, not
// OpenBLAS's.
void gemm_f32_serial(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                     const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                     int64_t ldc);

// While alive, every bf16 GEMM the calling thread makes runs on that thread alone, whatever its
// size, so that its sums depend on nothing else, and the CPU backend's fp32 GEMMs run as
// gemm_f32_serial: the CPU backend's attention, whose kv heads run in parallel, runs its GEMMs
// so however many threads it has.
class SerialGemms {
 public:
  SerialGemms();
  ~SerialGemms();
  SerialGemms(const SerialGemms&) = delete;
  SerialGemms& operator=(const SerialGemms&) = delete;

 private:
  bool previous_;
};
// Whether a SerialGemms is alive on the calling thread.
bool serial_gemms_here();

// How gemm_bf16 runs a large dense GEMM on this CPU: "oneDNN <implementation>" (e.g. oneDNN
// brg:avx512_core_amx_bf16) or "widened to fp32, OpenBLAS sgemm".
std::string bf16_gemm_path();

}  // namespace outcore::device::cpu
