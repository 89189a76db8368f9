// Slab layout per unit, deterministic initialisation, dtype conversion of slabs.
#include <fmt/format.h>

#include <cmath>
#include <numbers>

#include "common/error.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "engine/model/model.hpp"

namespace outcore::model {
namespace {

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

void add_tensor(UnitLayout& u, std::string name, std::vector<int64_t> shape) {
  size_t numel = 1;
  for (int64_t d : shape) numel *= static_cast<size_t>(d);
  const size_t offset = round_up(u.numel, kTensorAlignElems);
  u.tensors.push_back(TensorSpec{std::move(name), std::move(shape), offset, numel});
  u.numel = offset + numel;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  return h;
}

// Two standard normal samples that depend only on (stream, pair): Box-Muller on one 64-bit
// hash. Element k of a tensor takes the cosine branch of pair k/2 when k is even, else the sine.
void normal_pair(uint64_t stream, uint64_t pair, double& z0, double& z1) {
  const uint64_t h = splitmix64(stream ^ splitmix64(pair));
  const double u1 = (static_cast<double>(h >> 40) + 0.5) / 16777216.0;
  const double u2 = (static_cast<double>(h & 0xffffff) + 0.5) / 16777216.0;
  const double r = std::sqrt(-2.0 * std::log(u1)), a = 2.0 * std::numbers::pi * u2;
  z0 = r * std::cos(a);
  z1 = r * std::sin(a);
}

bool is_norm(const TensorSpec& t) { return t.name.find("norm") != std::string::npos; }
bool is_bias(const TensorSpec& t) { return t.name.ends_with(".bias"); }

}  // namespace

const TensorSpec* UnitLayout::find(std::string_view n) const {
  for (const TensorSpec& t : tensors)
    if (t.name == n) return &t;
  return nullptr;
}

size_t ModelLayout::total_padded_numel() const {
  size_t n = 0;
  for (const UnitLayout& u : units) n += u.padded_numel;
  return n;
}

ModelLayout make_layout(const LlamaConfig& c, int world_size) {
  if (world_size < 1)
    throw InvalidArgument(fmt::format("world size must be >= 1, got {}", world_size));
  c.validate();
  ModelLayout m;
  m.world_size = world_size;
  m.tied = c.tie_word_embeddings;
  m.init_std = c.initializer_range;
  const int64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), inter = c.intermediate_size;

  UnitLayout embed{.index = 0, .kind = UnitKind::Embedding, .layer = -1, .name = "embed"};
  add_tensor(embed, "model.embed_tokens.weight", {c.vocab_size, h});
  m.units.push_back(std::move(embed));

  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    UnitLayout u{.index = static_cast<int>(l) + 1,
                 .kind = UnitKind::Decoder,
                 .layer = static_cast<int>(l),
                 .name = fmt::format("layers.{}", l)};
    add_tensor(u, p + "input_layernorm.weight", {h});
    add_tensor(u, p + "self_attn.q_proj.weight", {q, h});
    add_tensor(u, p + "self_attn.k_proj.weight", {kv, h});
    add_tensor(u, p + "self_attn.v_proj.weight", {kv, h});
    add_tensor(u, p + "self_attn.o_proj.weight", {h, q});
    add_tensor(u, p + "post_attention_layernorm.weight", {h});
    add_tensor(u, p + "mlp.gate_proj.weight", {inter, h});
    add_tensor(u, p + "mlp.up_proj.weight", {inter, h});
    add_tensor(u, p + "mlp.down_proj.weight", {h, inter});
    if (c.qk_norm()) {  // Qwen3: RMSNorm weights over each head of q and k
      add_tensor(u, p + "self_attn.q_norm.weight", {c.head_dim});
      add_tensor(u, p + "self_attn.k_norm.weight", {c.head_dim});
    }
    if (c.qkv_bias()) {  // Qwen2: biases of the q, k and v projections
      add_tensor(u, p + "self_attn.q_proj.bias", {q});
      add_tensor(u, p + "self_attn.k_proj.bias", {kv});
      add_tensor(u, p + "self_attn.v_proj.bias", {kv});
    }
    m.units.push_back(std::move(u));
  }

  UnitLayout head{.index = static_cast<int>(c.num_hidden_layers) + 1,
                  .kind = UnitKind::Head,
                  .layer = -1,
                  .name = "head"};
  add_tensor(head, "model.norm.weight", {h});
  if (!c.tie_word_embeddings) add_tensor(head, "lm_head.weight", {c.vocab_size, h});
  m.units.push_back(std::move(head));

  for (UnitLayout& u : m.units)
    u.padded_numel = round_up(u.numel, kPartitionAlignElems * static_cast<size_t>(world_size));
  return m;
}

void init_params(const ModelLayout& layout, int unit, uint64_t seed, size_t begin, size_t end,
                 float* out) {
  if (unit < 0 || unit >= static_cast<int>(layout.units.size()))
    throw InvalidArgument(fmt::format("init_params: unit {} out of range", unit));
  const UnitLayout& u = layout.units[unit];
  if (begin > end || end > u.padded_numel)
    throw InvalidArgument(
        fmt::format("init_params: range [{}, {}) outside unit {} slab of {} elements", begin, end,
                    u.name, u.padded_numel));
  std::fill(out, out + (end - begin), 0.0f);
  for (const TensorSpec& t : u.tensors) {
    const size_t lo = std::max(begin, t.offset), hi = std::min(end, t.offset + t.numel);
    if (lo >= hi) continue;
    if (is_norm(t)) {
      std::fill(out + (lo - begin), out + (hi - begin), 1.0f);
      continue;
    }
    if (is_bias(t)) continue;  // 0, as Hugging Face initialises a Linear's bias
    const uint64_t stream = splitmix64(seed) ^ fnv1a(t.name);
    const double sigma = layout.init_std;
    for (size_t i = lo; i < hi;) {
      const size_t k = i - t.offset;
      double z0, z1;
      normal_pair(stream, k / 2, z0, z1);
      if (k % 2 == 1) {
        out[i++ - begin] = static_cast<float>(sigma * z1);
        continue;
      }
      out[i++ - begin] = static_cast<float>(sigma * z0);
      if (i < hi) out[i++ - begin] = static_cast<float>(sigma * z1);
    }
  }
}

void convert_from_fp32(const float* src, void* dst, DType dtype, size_t n) {
  device::cpu::from_fp32(src, dst, dtype, static_cast<int64_t>(n));
}

void convert_to_fp32(const void* src, DType dtype, float* dst, size_t n) {
  device::cpu::to_fp32(src, dtype, dst, static_cast<int64_t>(n));
}

}  // namespace outcore::model
