// Embedding unit: a row lookup forward, a scatter-add backward (in token order, so the sum of
// repeated tokens is deterministic).
#include <cstring>

#include "engine/model/unit_internal.hpp"

namespace outcore::model::detail {

void check_ids(const int32_t* ids, int64_t n, int64_t seq, int64_t vocab, const char* what) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab)
      throw InvalidArgument(fmt::format(
          "{} id {} at position {} (sequence {}, offset {}) is outside the vocabulary [0, {})",
          what, ids[i], i, i / seq, i % seq, vocab));
  }
}

size_t embedding_scratch_bytes(const LlamaConfig&, const ModelOptions&) { return 0; }

void embedding_forward(const UnitContext& ctx, const ForwardArgs& a) {
  if (a.params == nullptr || a.tokens == nullptr || a.output == nullptr)
    throw InvalidArgument("embed forward: params, tokens and output are required");
  const int64_t N = ctx.tokens(), H = ctx.cfg.hidden_size;
  check_ids(a.tokens, N, ctx.opt.seq_len, ctx.cfg.vocab_size, "token");
  const TensorSpec& t = ctx.unit.tensors[0];
  const std::byte* table =
      static_cast<const std::byte*>(a.params) + t.offset * dtype_size(ctx.opt.param_dtype);
  ctx.be.embedding_forward(table, ctx.opt.param_dtype, ctx.be.stage_ids(a.tokens, N, 0), N, H,
                           a.output);
}

void embedding_backward(const UnitContext& ctx, const BackwardArgs& a) {
  if (a.tokens == nullptr || a.grad_output == nullptr || a.grads == nullptr)
    throw InvalidArgument("embed backward: tokens, grad_output and grads are required");
  const int64_t N = ctx.tokens(), H = ctx.cfg.hidden_size;
  check_ids(a.tokens, N, ctx.opt.seq_len, ctx.cfg.vocab_size, "token");
  // Tied: the head's backward already wrote this micro-batch's share, so always add.
  if (a.mode == GradMode::Overwrite && !ctx.cfg.tie_word_embeddings)
    ctx.be.zero(a.grads, sizeof(float) * ctx.unit.padded_numel);
  ctx.be.embedding_backward(ctx.be.stage_ids(a.tokens, N, 0), a.grad_output, N, H,
                            a.grads + ctx.unit.tensors[0].offset);
}

}  // namespace outcore::model::detail
