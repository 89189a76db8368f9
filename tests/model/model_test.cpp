// LlamaModel behaviour beyond the oracle: checkpointing bit-identity, determinism, gradient
// accumulation, finite differences, bad input, workspace sizes and the device budget.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "tests/model/model_harness.hpp"

namespace outcore::model {
namespace {

using testing::Harness;
using testing::random_ids;
using testing::random_params;
using testing::small_config;

struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch make_batch(int64_t n, int64_t vocab, uint32_t seed) {
  auto ids = random_ids(n + 1, vocab, seed);
  return {{ids.begin(), ids.end() - 1}, {ids.begin() + 1, ids.end()}};
}

LlamaConfig gqa(bool tied = false) { return small_config(48, 80, 2, 6, 2, 97, tied); }

bool bit_identical(const std::vector<std::vector<float>>& a,
                   const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4) != 0)
      return false;
  return true;
}

// In bf16 compute too, where the recomputed forward rounds its activations into bf16 copies
// through the backward's own scratch.
TEST(Model, ActivationCheckpointingGivesBitIdenticalGradients) {
  const std::pair<DType, DType> cases[] = {
      {DType::F32, DType::F32}, {DType::BF16, DType::F32}, {DType::BF16, DType::BF16}};
  for (const auto& [dtype, compute] : cases) {
    for (bool tied : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " parameters, " +
                   std::string(dtype_name(compute)) + " compute" + (tied ? ", tied" : ", untied"));
      const LlamaConfig c = gqa(tied);
      const auto params = random_params(make_layout(c), 5);
      ModelOptions o{
          .micro_batch = 2, .seq_len = 140, .param_dtype = dtype, .compute_dtype = compute};
      Harness plain(c, o, params);
      o.activation_checkpointing = true;
      Harness ckpt(c, o, params);
      EXPECT_EQ(ckpt.model.saved_bytes(1), 0u);
      EXPECT_GT(plain.model.saved_bytes(1), 0u);
      const Batch b = make_batch(o.micro_batch * o.seq_len, c.vocab_size, 6);
      const float l1 = plain.train(b.tokens, b.targets);
      const float l2 = ckpt.train(b.tokens, b.targets);
      EXPECT_EQ(std::memcmp(&l1, &l2, 4), 0);
      EXPECT_TRUE(bit_identical(plain.grads, ckpt.grads));
    }
  }
}

// The head's rows per launch change only where the rows' losses and gradients are summed: the
// loss, logits and gradients stay within summation-order distance of the default chunking, in
// fp32 and bf16 compute. head_rows_for_device sizes the chunk from the device's memory.
TEST(Model, HeadChunkRowsChangeOnlyTheSummationOrder) {
  const LlamaConfig c = small_config(48, 80, 1, 6, 2, 5000, true);
  for (DType compute : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(dtype_name(compute));
    const auto params = random_params(make_layout(c), 8);
    ModelOptions o{
        .micro_batch = 2, .seq_len = 90, .param_dtype = DType::BF16, .compute_dtype = compute};
    Harness base(c, o, params);
    o.head_chunk_rows = 7;  // 26 chunks, the last one partial
    Harness small(c, o, params);
    o.head_chunk_rows = 1000;  // one chunk
    Harness whole(c, o, params);
    const Batch b = make_batch(o.micro_batch * o.seq_len, c.vocab_size, 9);
    const float l0 = base.train(b.tokens, b.targets);
    for (Harness* h : {&small, &whole}) {
      EXPECT_NEAR(h->train(b.tokens, b.targets), l0, 1e-5 * l0);
      for (size_t u = 0; u < base.grads.size(); ++u) {
        double diff = 0, norm = 0;
        for (size_t i = 0; i < base.grads[u].size(); ++i) {
          diff = std::max(diff, double(std::abs(h->grads[u][i] - base.grads[u][i])));
          norm = std::max(norm, double(std::abs(base.grads[u][i])));
        }
        // bf16 compute: another summation order of the logits moves some logit gradients across
        // a bf16 rounding boundary (one bf16 ulp is 2^-8 relative) before the weight-gradient
        // GEMM reads them; how many depends on the BLAS kernels (seen: 1.9e-4 on Zen kernels).
        const double tol = compute == DType::F32 ? 1e-4 : 2e-3;
        EXPECT_LE(diff, tol * norm + 1e-9) << "unit " << u;
      }
    }
  }
  ModelOptions o{
      .micro_batch = 4, .seq_len = 4096, .param_dtype = DType::BF16, .compute_dtype = DType::BF16};
  LlamaConfig llama3 = c;
  llama3.vocab_size = 128256;
  EXPECT_EQ(head_rows_for_device(llama3, o, uint64_t{80} << 30), 2790);  // 2 GiB of logits
  EXPECT_EQ(head_rows_for_device(llama3, o, uint64_t{4} << 30), 348);    // a sixteenth of 4 GiB
  EXPECT_EQ(head_rows_for_device(llama3, o, 1 << 20), 16);               // at least 16
  o.micro_batch = 1;
  o.seq_len = 100;
  EXPECT_EQ(head_rows_for_device(llama3, o, uint64_t{80} << 30), 100);  // at most the tokens
  // A GPU's rows come from the budget, or its memory size where that is smaller or no budget is
  // set (head_rows_on; never its free memory).
  EXPECT_EQ(head_sizing_bytes(0, uint64_t{80} << 30), uint64_t{80} << 30);
  EXPECT_EQ(head_sizing_bytes(uint64_t{4} << 30, uint64_t{80} << 30), uint64_t{4} << 30);
  EXPECT_EQ(head_sizing_bytes(uint64_t{96} << 30, uint64_t{80} << 30), uint64_t{80} << 30);
  // Only a GPU takes them (head_rows_on): host memory, simulated or not, keeps the default.
  for (const bool discrete : {false, true}) {
    const device::CpuDevice host(
        device::CpuDeviceOptions{.memory_budget_bytes = uint64_t{80} << 30, .discrete = discrete});
    EXPECT_EQ(head_rows_on(llama3, o, host, uint64_t{80} << 30), 0) << discrete;
  }
}

// What the CUDA backend keeps on the GPU for a model (cuBLASLt's workspace, attention's, the
// staged ids, the constant tables), which the planner charges to the device budget: the figures
// of a Llama 3 8B decoder at 4096 tokens; nothing on the CPU backends.
TEST(Model, WorkspaceShapeGivesTheCudaBackendsBytes) {
  LlamaConfig c = small_config(4096, 14336, 1, 32, 8, 128256, false, 128);
  c.max_position_embeddings = 8192;
  const ModelOptions bf16{
      .micro_batch = 1, .seq_len = 4096, .param_dtype = DType::BF16, .compute_dtype = DType::BF16};
  const LlamaModel m(c, bf16);
  const device::WorkspaceShape s = m.workspace_shape();
  EXPECT_EQ(s.tokens, 4096);
  EXPECT_EQ(s.attention.nh, 32);
  EXPECT_EQ(s.attention.nkv, 8);
  EXPECT_EQ(s.attention.block, 128);
  EXPECT_EQ(s.constant_bytes, 2u * 4096 * 64 * 4);  // rotary cos and sin, T x hd/2 each
  const device::Workspace w = device::backend_workspace(device::DeviceKind::Cuda, s);
  // cuBLASLt's workspace: none unless OUTCORE_CUBLASLT_WORKSPACE_MB asks (test_main passes it).
  const uint64_t asked = device::gemm_workspace_bytes();
  if (std::getenv("OUTCORE_CUBLASLT_WORKSPACE_MB") == nullptr) {
    EXPECT_EQ(asked, 0u);
  }
  EXPECT_EQ(w.gemm, asked);
  EXPECT_EQ(w.attention, 0u);  // fused: D, a float per head and query, on the model's scratch
  EXPECT_EQ(device::ComputeBackend::attention_bf16_scratch(s.attention),
            2 * 128 * 4096 + 2 * 32 * 4096);
  EXPECT_EQ(w.ids, 2 * 16384u + 13u * 4096);  // two id slots, groups of 3n + 1 ints (pages)
  EXPECT_EQ(w.constants, s.constant_bytes);
  EXPECT_EQ(w.norm, 64u << 10);  // RMSNorm dw's partial sums (rmsnorm_dw_split.hpp)
  EXPECT_EQ(w.total(), w.gemm + w.attention + w.ids + w.constants + w.norm);
  EXPECT_EQ(device::backend_workspace(device::DeviceKind::Cpu, s).total(), 0u);

  // fp32 compute: two score blocks of 128 queries x 4096 keys for every kv head (32 MiB).
  ModelOptions fp32 = bf16;
  fp32.param_dtype = fp32.compute_dtype = DType::F32;
  const LlamaModel m32(c, fp32);
  EXPECT_EQ(device::backend_workspace(device::DeviceKind::Cuda, m32.workspace_shape()).attention,
            2u * 8 * 128 * 4096 * 4);
  // bf16 heads the fused kernels do not take run the default attention on the model's scratch.
  LlamaConfig c48 = small_config(96, 160, 1, 2, 1, 64, false, 48);
  c48.max_position_embeddings = 4096;
  const LlamaModel m48(c48, bf16);
  EXPECT_FALSE(device::fused_attention_shape(m48.workspace_shape().attention));
  // The fused kernels' grids run over 64-row tiles in y (at most 65535 of them): longer
  // sequences take the default attention instead of failing to launch.
  device::ComputeBackend::Attention longest{1, 65535 * 64, 32, 8, 128, 128, 0.0884f, DType::BF16};
  EXPECT_TRUE(device::fused_attention_shape(longest));
  ++longest.T;
  EXPECT_FALSE(device::fused_attention_shape(longest));
  EXPECT_EQ(device::backend_workspace(device::DeviceKind::Cuda, m48.workspace_shape()).attention,
            0u);

  // cuBLASLt's workspace: the size asked for (OUTCORE_CUBLASLT_WORKSPACE_MB), the same whatever
  // the budget; text that is not a size from 0 to 1024 MiB keeps the current one.
  device::request_gemm_workspace("32", "test");
  EXPECT_EQ(device::gemm_workspace_bytes(), 32u << 20);
  EXPECT_EQ(device::backend_workspace(device::DeviceKind::Cuda, s).gemm, 32u << 20);
  for (const char* bad : {"-1", "4.5", "1025", "32MiB", "x"}) {
    device::request_gemm_workspace(bad, "test");
    EXPECT_EQ(device::gemm_workspace_bytes(), 32u << 20) << bad;
  }
  device::request_gemm_workspace("", "test");  // empty: unchanged
  EXPECT_EQ(device::gemm_workspace_bytes(), 32u << 20);
  device::request_gemm_workspace("0", "test");
  EXPECT_EQ(device::backend_workspace(device::DeviceKind::Cuda, s).gemm, 0u);
  device::request_gemm_workspace(std::to_string(asked >> 20), "test");  // as it was
}

TEST(Model, RepeatedRunsAreBitIdentical) {
  const LlamaConfig c = gqa();
  const auto params = random_params(make_layout(c), 7);
  ModelOptions o{.micro_batch = 2, .seq_len = 33};
  Harness a(c, o, params), b(c, o, params);
  const Batch batch = make_batch(66, c.vocab_size, 8);
  const float l1 = a.train(batch.tokens, batch.targets);
  const auto g1 = a.grads;
  const float l2 = a.train(batch.tokens, batch.targets);  // same buffers, second run
  const float l3 = b.train(batch.tokens, batch.targets);  // fresh buffers
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(l1, l3);
  EXPECT_TRUE(bit_identical(g1, a.grads));
  EXPECT_TRUE(bit_identical(g1, b.grads));
}

// k micro-batches accumulated with loss_scale 1/k equal one micro-batch k times larger.
TEST(Model, GradientAccumulationEqualsALargerBatch) {
  for (bool tied : {false, true}) {
    const LlamaConfig c = gqa(tied);
    const auto params = random_params(make_layout(c), 9);
    const int64_t T = 20, k = 3;
    Harness small(c, {.micro_batch = 1, .seq_len = T}, params);
    Harness big(c, {.micro_batch = k, .seq_len = T}, params);
    const Batch all = make_batch(k * T, c.vocab_size, 10);
    double loss_sum = 0;
    for (int64_t i = 0; i < k; ++i) {
      Batch part{{all.tokens.begin() + i * T, all.tokens.begin() + (i + 1) * T},
                 {all.targets.begin() + i * T, all.targets.begin() + (i + 1) * T}};
      loss_sum += small.train(part.tokens, part.targets,
                              i == 0 ? GradMode::Overwrite : GradMode::Accumulate, 1.0f / k);
    }
    const float big_loss = big.train(all.tokens, all.targets);
    EXPECT_NEAR(loss_sum / k, big_loss, 1e-6 * std::abs(big_loss));
    for (size_t u = 0; u < small.grads.size(); ++u) {
      double err = 0, scale = 0;
      for (size_t i = 0; i < small.grads[u].size(); ++i) {
        err = std::max(err, double(std::abs(small.grads[u][i] - big.grads[u][i])));
        scale = std::max(scale, double(std::abs(big.grads[u][i])));
      }
      EXPECT_LT(err, 1e-5 * scale) << "unit " << u << (tied ? " tied" : "");
    }
  }
}

TEST(Model, GradientsMatchFiniteDifferences) {
  const LlamaConfig c = small_config(16, 24, 1, 4, 2, 23, true);
  auto params = random_params(make_layout(c), 11, 0.3f);
  ModelOptions o{.micro_batch = 1, .seq_len = 6};
  Harness h(c, o, params);
  const Batch b = make_batch(6, c.vocab_size, 12);
  h.train(b.tokens, b.targets);
  const auto grads = h.grads;
  // One element of several kinds of tensor: the largest-gradient element of each.
  const std::vector<std::pair<int, std::string>> probes = {
      {0, "model.embed_tokens.weight"},
      {1, "model.layers.0.input_layernorm.weight"},
      {1, "model.layers.0.self_attn.q_proj.weight"},
      {1, "model.layers.0.self_attn.k_proj.weight"},
      {1, "model.layers.0.self_attn.v_proj.weight"},
      {1, "model.layers.0.mlp.gate_proj.weight"},
      {1, "model.layers.0.mlp.down_proj.weight"},
      {2, "model.norm.weight"}};
  for (const auto& [unit, name] : probes) {
    const TensorSpec* t = h.model.layout().units[unit].find(name);
    ASSERT_NE(t, nullptr) << name;
    size_t best = t->offset;
    for (size_t i = t->offset; i < t->offset + t->numel; ++i)
      if (std::abs(grads[unit][i]) > std::abs(grads[unit][best])) best = i;
    const float eps = 1e-2f, keep = h.master[unit][best];
    h.master[unit][best] = keep + eps;
    const double up = h.eval(b.tokens, b.targets);
    h.master[unit][best] = keep - eps;
    const double down = h.eval(b.tokens, b.targets);
    h.master[unit][best] = keep;
    const double fd = (up - down) / (2.0 * eps);
    EXPECT_NEAR(grads[unit][best], fd, 2e-2 * std::abs(fd) + 2e-4) << name;
  }
}

TEST(Model, F16StorageComputesLikeFp32WithRoundedWeights) {
  const LlamaConfig c = gqa();
  auto params = random_params(make_layout(c), 13);
  for (auto& s : params)
    for (auto& x : s) x = round_to(DType::F16, x);
  Harness f32(c, {.micro_batch = 1, .seq_len = 16}, params);
  Harness f16(c, {.micro_batch = 1, .seq_len = 16, .param_dtype = DType::F16}, params);
  const Batch b = make_batch(16, c.vocab_size, 14);
  EXPECT_NEAR(f32.train(b.tokens, b.targets), f16.train(b.tokens, b.targets), 1e-6);
  for (size_t u = 0; u < f32.grads.size(); ++u)
    for (size_t i = 0; i < f32.grads[u].size(); ++i)
      ASSERT_NEAR(f32.grads[u][i], f16.grads[u][i], 1e-6 + 1e-5 * std::abs(f32.grads[u][i]));
}

TEST(Model, InitialLossIsNearLogVocabAndSgdLowersIt) {
  const LlamaConfig c = gqa(true);
  const ModelLayout layout = make_layout(c);
  std::vector<std::vector<float>> params;
  for (const UnitLayout& u : layout.units) {
    params.emplace_back(u.padded_numel);
    init_params(layout, u.index, 42, 0, u.padded_numel, params.back().data());
  }
  Harness h(c, {.micro_batch = 2, .seq_len = 16}, params);
  const Batch b = make_batch(32, c.vocab_size, 15);
  const float first = h.train(b.tokens, b.targets);
  EXPECT_NEAR(first, std::log(97.0), 0.15);  // tied: each token slightly predicts itself
  float last = first;
  for (int step = 0; step < 30; ++step) {
    for (size_t u = 0; u < h.master.size(); ++u)
      for (size_t i = 0; i < h.master[u].size(); ++i) h.master[u][i] -= 0.5f * h.grads[u][i];
    last = h.train(b.tokens, b.targets);
  }
  EXPECT_LT(last, 0.8f * first);
}

TEST(Model, TokenAndTargetIdsOutsideTheVocabularyAreErrors) {
  const LlamaConfig c = gqa();
  Harness h(c, {.micro_batch = 2, .seq_len = 8}, random_params(make_layout(c), 16));
  Batch b = make_batch(16, c.vocab_size, 17);
  b.tokens[11] = 97;
  try {
    h.train(b.tokens, b.targets);
    FAIL();
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("token id 97 at position 11 (sequence 1, offset 3)"), std::string::npos) << m;
    EXPECT_NE(m.find("[0, 97)"), std::string::npos) << m;
  }
  b.tokens[11] = 0;
  b.targets[2] = 97;
  try {
    h.train(b.tokens, b.targets);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("target id 97 at position 2"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(h.eval(b.tokens, b.targets), InvalidArgument);
  b.targets[2] = kIgnoreTarget;  // a masked target is not an error
  EXPECT_NO_THROW(h.train(b.tokens, b.targets));
}

// A loss mask splits the loss: with complementary masks A and not-A (kIgnoreTarget rows), the
// losses and the gradients add up to those of the unmasked batch, and neither half equals the
// whole (so a mask that is ignored, or that leaks its rows' gradients, fails). A row whose
// target is masked contributes nothing even when its logits are extreme.
TEST(Model, MaskedTargetsSplitTheLossAndTheGradients) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const LlamaConfig c = gqa(tied);
    const auto params = random_params(make_layout(c), 21);
    const int64_t B = 2, T = 12;
    Harness h(c, {.micro_batch = B, .seq_len = T}, params);
    const Batch all = make_batch(B * T, c.vocab_size, 22);
    Batch prompt = all, completion = all;  // prompt: trains on the prompt; completion: the rest
    for (int64_t i = 0; i < B * T; ++i) {
      const bool is_prompt = i % T < 5 + i / T;
      (is_prompt ? completion : prompt).targets[static_cast<size_t>(i)] = kIgnoreTarget;
    }
    const float loss_all = h.train(all.tokens, all.targets);
    const auto grads_all = h.grads;
    const float loss_prompt = h.train(prompt.tokens, prompt.targets);
    const auto grads_prompt = h.grads;
    const float loss_completion = h.train(completion.tokens, completion.targets);
    EXPECT_NEAR(loss_prompt + loss_completion, loss_all, 1e-6 * loss_all);
    EXPECT_GT(std::abs(loss_completion - loss_all), 0.2 * loss_all);
    for (size_t u = 0; u < grads_all.size(); ++u) {
      double err = 0, scale = 0, diff = 0;
      for (size_t i = 0; i < grads_all[u].size(); ++i) {
        const double sum = double(grads_prompt[u][i]) + h.grads[u][i];
        err = std::max(err, std::abs(sum - grads_all[u][i]));
        diff = std::max(diff, double(std::abs(h.grads[u][i] - grads_all[u][i])));
        scale = std::max(scale, double(std::abs(grads_all[u][i])));
      }
      EXPECT_LT(err, 1e-5 * scale) << "unit " << u;
      EXPECT_GT(diff, 1e-2 * scale) << "unit " << u << ": the mask changed nothing";
    }
    // Every target masked: no loss, and every gradient exactly zero.
    Batch none = all;
    std::fill(none.targets.begin(), none.targets.end(), kIgnoreTarget);
    EXPECT_EQ(h.train(none.tokens, none.targets), 0.0f);
    for (const auto& g : h.grads)
      for (float x : g) ASSERT_EQ(x, 0.0f);
  }
}

TEST(Model, MissingOrSmallBuffersAreErrors) {
  const LlamaConfig c = gqa();
  Harness h(c, {.micro_batch = 1, .seq_len = 8}, random_params(make_layout(c), 18));
  std::vector<float> x(8 * 48), y(8 * 48);
  std::vector<std::byte> small(64);
  const ModelBuffers mb = h.buffers();
  EXPECT_THROW(h.model.forward(1, {.params = mb.params[1],
                                   .input = x.data(),
                                   .output = y.data(),
                                   .saved = h.acts.saved(1),
                                   .scratch = small}),
               InvalidArgument);
  EXPECT_THROW(h.model.forward(1, {.params = mb.params[1],
                                   .input = x.data(),
                                   .output = y.data(),
                                   .scratch = h.acts.scratch()}),
               InvalidArgument);  // no saved buffer without checkpointing
  EXPECT_THROW(h.model.forward(1, {.params = mb.params[1],
                                   .input = x.data(),
                                   .saved = h.acts.saved(1),
                                   .scratch = h.acts.scratch()}),
               InvalidArgument);  // no output
  const LlamaConfig tied = gqa(true);
  Harness t(tied, {.micro_batch = 1, .seq_len = 8}, random_params(make_layout(tied), 18));
  EXPECT_THROW(
      t.model.forward(
          3, {.params = t.buffers().params[3], .input = x.data(), .scratch = t.acts.scratch()}),
      InvalidArgument);  // tied head without the embedding slab
}

TEST(Model, BadShapesAreErrors) {
  EXPECT_THROW(LlamaModel(gqa(), {.micro_batch = 1, .seq_len = 513}), InvalidArgument);
  EXPECT_THROW(LlamaModel(gqa(), {.micro_batch = 0, .seq_len = 8}), InvalidArgument);
  LlamaConfig bad = gqa();
  bad.num_key_value_heads = 4;
  EXPECT_THROW(LlamaModel(bad, {.micro_batch = 1, .seq_len = 8}), ConfigError);
}

TEST(Model, ActivationPlanIsTheDevicePeakAndTheBudgetIsEnforced) {
  const LlamaConfig c = gqa();
  for (bool ckpt : {false, true}) {
    for (bool cpu_ckpt : {false, true}) {
      LlamaModel m(c, {.micro_batch = 2, .seq_len = 24, .activation_checkpointing = ckpt});
      const ActivationPlan p = plan_activations(m, cpu_ckpt);
      EXPECT_EQ(p.checkpoint_bytes, 3 * m.hidden_bytes());
      EXPECT_EQ(p.saved_bytes, ckpt ? 0 : 2 * m.saved_bytes(1));
      EXPECT_EQ(p.host_bytes > 0, cpu_ckpt);
      {
        device::CpuDevice dev({.memory_budget_bytes = p.device_bytes});
        ActivationBuffers acts(m, dev, cpu_ckpt);
        EXPECT_EQ(dev.memory_stats().peak_bytes, p.device_bytes);
      }
      device::CpuDevice tight({.memory_budget_bytes = p.device_bytes - 4096});
      EXPECT_THROW(ActivationBuffers(m, tight, cpu_ckpt), OutOfMemory);
    }
  }
  LlamaModel plain(c, {.micro_batch = 2, .seq_len = 24});
  LlamaModel ckpt(c, {.micro_batch = 2, .seq_len = 24, .activation_checkpointing = true});
  EXPECT_LT(plan_activations(ckpt, true).device_bytes, plan_activations(ckpt, false).device_bytes);
  EXPECT_LT(plan_activations(ckpt, false).device_bytes,
            plan_activations(plain, false).device_bytes);
}

TEST(Model, CpuCheckpointingGivesTheSameResultsOffTheDeviceBudget) {
  const LlamaConfig c = gqa();
  const auto params = random_params(make_layout(c), 19);
  ModelOptions o{.micro_batch = 1, .seq_len = 24, .activation_checkpointing = true};
  Harness on_device(c, o, params, 0, false);
  const ActivationPlan p = plan_activations(on_device.model, true);
  Harness on_host(c, o, params, p.device_bytes, true);  // budget without the checkpoints
  const Batch b = make_batch(24, c.vocab_size, 20);
  EXPECT_EQ(on_device.train(b.tokens, b.targets), on_host.train(b.tokens, b.targets));
  EXPECT_TRUE(bit_identical(on_device.grads, on_host.grads));
  EXPECT_LE(on_host.device.memory_stats().peak_bytes, p.device_bytes);
}

TEST(Model, RunsAsComputeOnADeviceStream) {
  const LlamaConfig c = gqa();
  const auto params = random_params(make_layout(c), 21);
  Harness direct(c, {.micro_batch = 1, .seq_len = 12}, params);
  Harness streamed(c, {.micro_batch = 1, .seq_len = 12}, params);
  const Batch b = make_batch(12, c.vocab_size, 22);
  const float want = direct.train(b.tokens, b.targets);
  auto compute = streamed.device.create_stream("compute");
  float got = 0;
  compute->enqueue([&] { got = streamed.train(b.tokens, b.targets); });
  compute->synchronize();
  EXPECT_EQ(got, want);
  EXPECT_TRUE(bit_identical(direct.grads, streamed.grads));
}

}  // namespace
}  // namespace outcore::model
