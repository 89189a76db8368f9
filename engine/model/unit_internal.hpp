// Internals shared by the unit implementations (embedding.cpp, decoder.cpp, head.cpp): the
// workspace carver and the context every unit call gets.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <vector>

#include "common/error.hpp"
#include "engine/model/model.hpp"

namespace outcore::model::detail {

// Hands out float arrays from a byte range, in order, each at a multiple of kAlign bytes from
// its base. With a null base it only measures, so sizes computed ahead of time and carving at run
// time use the same code. kAlign is the largest alignment cuBLASLt's algorithm choice looks at:
// an array has the same alignment wherever the range starts on such a boundary (activations
// carved after the saved ones under checkpointing, or apart from them without), so a GEMM gets
// the same algorithm, and the same bits, either way.
class Arena {
 public:
  static constexpr size_t kAlign = 256;
  explicit Arena(std::byte* base = nullptr, size_t capacity = SIZE_MAX)
      : base_(base), capacity_(capacity) {}
  float* floats(int64_t n) {
    const size_t at = (used_ + kAlign - 1) / kAlign * kAlign;
    const size_t end = at + static_cast<size_t>(n) * sizeof(float);
    if (base_ != nullptr && end > capacity_)
      throw InvalidArgument(
          fmt::format("workspace of {} bytes is too small (needs at least {})", capacity_, end));
    used_ = end;
    return base_ == nullptr ? nullptr : reinterpret_cast<float*>(base_ + at);
  }
  // n bf16 (or fp16) elements.
  void* halves(int64_t n) { return floats((n + 1) / 2); }
  size_t used() const { return used_; }

 private:
  std::byte* base_;
  size_t capacity_;
  size_t used_ = 0;
};

// What a unit call needs to know besides its arguments.
struct UnitContext {
  const LlamaConfig& cfg;
  const ModelOptions& opt;
  device::ComputeBackend& be;  // runs every operation (see compute_backend.hpp)
  const UnitLayout& unit;
  const UnitLayout& embed;  // the embedding unit (tied head weight)
  const float* rope_cos;    // [seq, head_dim/2]
  const float* rope_sin;
  const float* ones;  // qkv_bias: tokens() ones (null otherwise)
  int64_t tokens() const { return opt.micro_batch * opt.seq_len; }
};

// The fp32 view of one weight tensor of a slab: the slab itself when it is fp32, else a
// conversion into `tmp` (which must hold numel floats).
inline const float* weight_f32(const UnitContext& ctx, const void* slab, const TensorSpec& t,
                               float* tmp, size_t first = 0, size_t count = SIZE_MAX) {
  const size_t n = std::min(count, t.numel - first);
  const size_t esize = dtype_size(ctx.opt.param_dtype);
  const void* src = static_cast<const std::byte*>(slab) + (t.offset + first) * esize;
  if (ctx.opt.param_dtype == DType::F32) return static_cast<const float*>(src);
  ctx.be.to_fp32(src, ctx.opt.param_dtype, tmp, static_cast<int64_t>(n));
  return tmp;
}

// GradMode::Overwrite without a pass over the whole slab: zeroes `grads` (the gradient slab of
// `unit`, padded_numel elements) everywhere but in `whole`, the tensors the backward then writes
// whole with a GEMM of beta 0 before anything adds into them. What kernels add into (norm
// weights, biases, the embedding), the alignment gaps and the padding start from 0.
inline void zero_all_but(const UnitContext& ctx, const UnitLayout& unit, float* grads,
                         std::initializer_list<const TensorSpec*> whole) {
  std::vector<const TensorSpec*> sorted(whole);
  std::sort(sorted.begin(), sorted.end(),
            [](const TensorSpec* a, const TensorSpec* b) { return a->offset < b->offset; });
  size_t at = 0;
  const auto zero_to = [&](size_t end) {
    if (end > at) ctx.be.zero(grads + at, sizeof(float) * (end - at));
  };
  for (const TensorSpec* t : sorted) {
    zero_to(t->offset);
    at = std::max(at, t->offset + t->numel);
  }
  zero_to(unit.padded_numel);
}

// ---- GEMM operands in the compute dtype (ModelOptions::compute_dtype)

inline bool bf16_compute(const UnitContext& ctx) { return ctx.opt.compute_dtype == DType::BF16; }

// A GEMM operand in the compute dtype (fp32 or bf16 elements) and its leading dimension.
struct Operand {
  const void* p;
  int64_t ld;
};

// `x` ([rows, ld], fp32) as an operand: in bf16 compute rounded into `half` (rows * ld bf16
// elements).
inline Operand make_operand(const UnitContext& ctx, const float* x, int64_t rows, int64_t ld,
                            void* half) {
  if (!bf16_compute(ctx)) return {x, ld};
  ctx.be.from_fp32(x, half, DType::BF16, rows * ld);
  return {half, ld};
}

// A GEMM operand that a kernel writes itself (rmsnorm_forward, swiglu_*), rounding where
// make_operand would have, without the fp32 pass between them: the kernel's fp32 output `fp32`
// (`x` in fp32 compute, else null) and bf16 output `bf16` (`half` in bf16 compute, else null),
// and the operand that results (ld columns).
struct KernelOperand {
  float* fp32;
  void* bf16;
  Operand op;
};
inline KernelOperand kernel_operand(const UnitContext& ctx, float* x, void* half, int64_t ld) {
  if (bf16_compute(ctx)) return {nullptr, half, {half, ld}};
  return {x, nullptr, {x, ld}};
}

// Operand `o` from element `at` on (an offset in its dtype); rows_from: from row `row` on,
// column_from: from column `col` on.
inline Operand offset_by(const UnitContext& ctx, Operand o, int64_t at) {
  const size_t esize = bf16_compute(ctx) ? 2 : 4;
  return {static_cast<const std::byte*>(o.p) + static_cast<size_t>(at) * esize, o.ld};
}
inline Operand rows_from(const UnitContext& ctx, Operand o, int64_t row) {
  return offset_by(ctx, o, row * o.ld);
}
inline Operand column_from(const UnitContext& ctx, Operand o, int64_t col) {
  return offset_by(ctx, o, col);
}

// Weight `t` of `slab` (elements first..first+count) as an operand: in bf16 compute the slab's
// bf16 values themselves; in fp32 compute weight_f32 (into `tmp` unless the slab is fp32).
inline Operand weight_operand(const UnitContext& ctx, const void* slab, const TensorSpec& t,
                              int64_t ld, float* tmp, size_t first = 0, size_t count = SIZE_MAX) {
  if (!bf16_compute(ctx)) return {weight_f32(ctx, slab, t, tmp, first, count), ld};
  return {static_cast<const std::byte*>(slab) + (t.offset + first) * sizeof(uint16_t), ld};
}

// C[m,n] = alpha op(A) op(B) + beta C in the compute dtype: gemm in fp32, gemm_bf16 in bf16.
inline void matmul(const UnitContext& ctx, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                   float alpha, Operand a, Operand b, float beta, float* c, int64_t ldc) {
  if (bf16_compute(ctx)) {
    ctx.be.gemm_bf16(ta, tb, m, n, k, alpha, a.p, a.ld, b.p, b.ld, beta, c, ldc);
  } else {
    ctx.be.gemm(ta, tb, m, n, k, alpha, static_cast<const float*>(a.p), a.ld,
                static_cast<const float*>(b.p), b.ld, beta, c, ldc);
  }
}

// The largest single weight of a decoder (the bf16 conversion buffer size), in elements.
inline int64_t max_decoder_weight(const LlamaConfig& c) {
  return std::max(
      {c.q_dim() * c.hidden_size, c.kv_dim() * c.hidden_size, c.intermediate_size * c.hidden_size});
}

// Query rows per attention block: scores for one block are [block, keys].
inline int64_t attention_block(const ModelOptions& o) { return std::min<int64_t>(o.seq_len, 128); }

// Decoder: bytes saved by forward (without checkpointing), and scratch of forward / backward.
size_t decoder_saved_bytes(const LlamaConfig& c, const ModelOptions& o);
size_t decoder_scratch_bytes(const LlamaConfig& c, const ModelOptions& o);
// The attention every decoder runs (its shape, block and dtype).
device::ComputeBackend::Attention decoder_attention(const LlamaConfig& c, const ModelOptions& o);
void decoder_forward(const UnitContext& ctx, const ForwardArgs& a);
void decoder_backward(const UnitContext& ctx, const BackwardArgs& a);

// Head: rows of logits computed at once, scratch bytes, forward (loss, logits) and fused
// forward+backward.
int64_t head_chunk_rows(const LlamaConfig& c, const ModelOptions& o);
size_t head_scratch_bytes(const LlamaConfig& c, const ModelOptions& o);
float head_forward(const UnitContext& ctx, const ForwardArgs& a);
float head_backward(const UnitContext& ctx, const BackwardArgs& a);

// Embedding.
size_t embedding_scratch_bytes(const LlamaConfig& c, const ModelOptions& o);
void embedding_forward(const UnitContext& ctx, const ForwardArgs& a);
void embedding_backward(const UnitContext& ctx, const BackwardArgs& a);

// Throws InvalidArgument naming `what` when any id is outside [0, vocab).
void check_ids(const int32_t* ids, int64_t n, int64_t seq, int64_t vocab, const char* what);

}  // namespace outcore::model::detail
