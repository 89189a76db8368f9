// Test harness for engine/model: a small model with random parameters on a CpuDevice, every
// unit's slabs resident (fp32 master, optional low-precision copy, fp32 gradients).
#pragma once

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/device/device.hpp"
#include "engine/model/model.hpp"

namespace outcore::model::testing {

// A small config with the given shape; vocab and sizes chosen by the caller.
inline LlamaConfig small_config(int64_t hidden, int64_t inter, int64_t layers, int64_t heads,
                                int64_t kv_heads, int64_t vocab, bool tied, int64_t head_dim = 0) {
  LlamaConfig c;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.vocab_size = vocab;
  c.max_position_embeddings = 512;
  c.head_dim = head_dim != 0 ? head_dim : hidden / heads;
  c.rope_theta = 10000.0;
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = tied;
  return c;
}

// Random fp32 parameters: Linear/embedding N(0, weight_std), norms 1 + N(0, 0.2), padding 0.
inline std::vector<std::vector<float>> random_params(const ModelLayout& layout, uint32_t seed,
                                                     float weight_std = 0.15f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> slabs;
  for (const UnitLayout& u : layout.units) {
    std::vector<float> s(u.padded_numel, 0.0f);
    for (const TensorSpec& t : u.tensors) {
      const bool norm = t.name.find("norm") != std::string::npos;
      for (size_t i = 0; i < t.numel; ++i)
        s[t.offset + i] = norm ? 1.0f + 0.2f * normal(rng) : weight_std * normal(rng);
    }
    slabs.push_back(std::move(s));
  }
  return slabs;
}

inline std::vector<int32_t> random_ids(size_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(n);
  for (auto& t : ids) t = dist(rng);
  return ids;
}

// A model with resident parameters, gradients and activation buffers.
struct Harness {
  LlamaModel model;
  device::CpuDevice device;
  std::vector<std::vector<float>> master;   // fp32 values (rounded to param_dtype if not fp32)
  std::vector<std::vector<uint16_t>> lowp;  // bf16/fp16 storage when param_dtype != F32
  std::vector<std::vector<float>> grads;
  ActivationBuffers acts;

  Harness(const LlamaConfig& c, ModelOptions o, std::vector<std::vector<float>> params,
          uint64_t budget = 0, bool cpu_checkpointing = false)
      : model(c, o),
        device(device::CpuDeviceOptions{.memory_budget_bytes = budget}),
        master(std::move(params)),
        acts(model, device, cpu_checkpointing) {
    for (size_t u = 0; u < master.size(); ++u) {
      grads.emplace_back(master[u].size(), 0.0f);
      if (o.param_dtype != DType::F32) {
        lowp.emplace_back(master[u].size());
        convert_from_fp32(master[u].data(), lowp[u].data(), o.param_dtype, master[u].size());
        convert_to_fp32(lowp[u].data(), o.param_dtype, master[u].data(), master[u].size());
      }
    }
  }

  ModelBuffers buffers() {
    ModelBuffers b;
    for (size_t u = 0; u < master.size(); ++u) {
      b.params.push_back(lowp.empty() ? static_cast<const void*>(master[u].data())
                                      : lowp[u].data());
      b.grads.push_back(grads[u].data());
    }
    return b;
  }

  float train(const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
              GradMode mode = GradMode::Overwrite, float loss_scale = 1.0f) {
    return train_micro_batch(model, buffers(), acts, tokens.data(), targets.data(), mode,
                             loss_scale);
  }

  float eval(const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
             float* logits = nullptr) {
    return eval_micro_batch(model, buffers(), acts, tokens.data(), targets.data(), logits);
  }
};

}  // namespace outcore::model::testing
