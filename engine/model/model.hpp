// engine/model: a Llama-family decoder split into units, with forward and backward per unit.
//
// Units, in execution order (forward 0..L+1, backward L+1..0), L = num_hidden_layers:
//   unit 0        embedding      model.embed_tokens.weight
//   unit 1..L     decoder layer  model.layers.{unit-1}.*  (9 tensors)
//   unit L+1      head           model.norm.weight, lm_head.weight (untied only)
//
// Each unit's parameters live in one flat slab (one per dtype: fp32 master, bf16/fp16 compute
// copy) described by a table of (Hugging Face name, shape, element offset). The table is the
// same for every dtype and every world size; only the padded tail differs (see ModelLayout).
//
// Tied embeddings (tie_word_embeddings): the weight lives only in the embedding unit. The head
// unit reads it through `tied_params` (the embedding unit's slab) and adds its gradient into
// the embedding unit's gradient slab through `tied_grads`. So with tied embeddings the
// embedding unit's parameters must be resident for the head (forward and backward), and its
// gradient slab must stay live from the head's backward to the embedding's backward; the
// embedding's backward then always accumulates onto what the head wrote (see BackwardArgs).
//
// Compute: each unit's math is written once as operations of a device::ComputeBackend
// (engine/device/compute_backend.hpp), run by the backend of the model's device: the CPU
// backend (host kernels and OpenBLAS sgemm on memory the host can dereference, a CpuDevice's
// buffers) or the CUDA backend (CUDA kernels and cuBLASLt on a CudaDevice's memory).
// Activations and gradients are fp32; parameters are fp32, or bf16/fp16 storage converted to
// fp32 into scratch one GEMM operand at a time (fp32 accumulation throughout); with the bf16
// compute dtype (ModelOptions::compute_dtype) every GEMM takes bf16 operands instead. Results
// are bit-identical run after run for the same inputs, backend and BLAS thread count.
//
// Memory: every byte the model touches is a caller-provided buffer whose size is known before
// anything is allocated (saved_bytes, scratch_bytes, plan_activations), so the placement
// planner can budget each tier; ActivationBuffers allocates them for one micro-batch.
//
// Threads: the caller's, plus OpenBLAS's inside fp32 GEMMs and oneDNN's OpenMP threads inside
// bf16 GEMMs on the CPU. The library sets neither OpenBLAS's thread count nor its kernels
// (programs pick the kernels: tools/blas/blas_kernels.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/aligned_buffer.hpp"
#include "common/dtype.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/device.hpp"

namespace outcore::model {

// ---------------------------------------------------------------------------------------------
// Configuration

// `rope_scaling` of config.json: how the rotary inverse frequencies are rescaled for a longer
// context. Only types that change nothing but inv_freq are implemented (see rope_inv_freq()).
enum class RopeScalingType : uint8_t {
  None,    // absent, null, or type "default": inv_freq[j] = rope_theta^(-2j / head_dim)
  Linear,  // "linear": inv_freq / factor (positions divided by factor)
  Llama3,  // "llama3" (Llama 3.1 and later): per-frequency blend, see rope_inv_freq()
};

struct RopeScaling {
  RopeScalingType type = RopeScalingType::None;
  double factor = 1.0;                           // Linear, Llama3: > 0
  double low_freq_factor = 1.0;                  // Llama3: > 0
  double high_freq_factor = 4.0;                 // Llama3: > low_freq_factor
  int64_t original_max_position_embeddings = 0;  // Llama3: > 0, the pre-scaling context
};

// The model families read from config.json's model_type: all Llama's architecture, Qwen2 with
// biases on the q, k and v projections, Qwen3 with an RMSNorm over each head of q and k before
// RoPE (self_attn.q_norm / k_norm).
enum class ModelType : uint8_t { kLlama, kMistral, kQwen2, kQwen3 };
// "Llama", "Mistral", "Qwen2" or "Qwen3".
const char* family_name(ModelType t);

// The sliding window of a Mistral config.json without the key (Hugging Face's MistralConfig).
inline constexpr int64_t kMistralDefaultSlidingWindow = 4096;

// A Hugging Face Llama config.json. Fields hold the file's values after defaults and checks.
// Only what the model implements is represented: a file asking for anything else (another
// model_type, bias terms, another activation, dropout, another rope_scaling type) is refused.
struct LlamaConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // absent in the file = num_attention_heads
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  int64_t head_dim = 0;              // absent = hidden_size / num_attention_heads
  double rope_theta = 10000.0;       // absent = 10000
  double rms_norm_eps = 1e-6;        // absent = 1e-6
  bool tie_word_embeddings = false;  // absent = false
  RopeScaling rope_scaling{};        // absent or null = None
  // The standard deviation of the initial weights (Hugging Face's; absent = 0.02). Kept in
  // hf_extra too, as before it acted, so that to_json and checkpoints stay as they were.
  double initializer_range = 0.02;
  // model_type ("llama", "mistral" or "qwen3"), written back by to_json. Mistral's
  // sliding_window (null = 0, none; absent = kMistralDefaultSlidingWindow, Hugging Face's
  // MistralConfig default) is kept; attention has no window, so a model with
  // one refuses sequences longer than it (LlamaModel), where the two are the same. Qwen3's is
  // used only with use_sliding_window true, which is refused.
  ModelType model_type = ModelType::kLlama;
  int64_t sliding_window = 0;
  // The keys of the source config.json that to_json does not write (bos_token_id,
  // eos_token_id, pad_token_id, initializer_range, ...), as a JSON object's text ("" = none):
  // kept for Hugging Face by to_hf_json. Not part of the architecture (to_json).
  std::string hf_extra{};
  bool qk_norm() const { return model_type == ModelType::kQwen3; }
  bool qkv_bias() const { return model_type == ModelType::kQwen2; }

  // Parses config.json text. Keys it does not act on are kept in hf_extra (HF files carry many).
  // Throws ConfigError naming `source` and the key (json_path(), e.g. "rope_scaling.factor") for
  // malformed JSON, a missing required key, a wrong type, an impossible or too large value (see
  // validate()), or a feature the model does not implement: model_type other than "llama",
  // "mistral", "qwen2" or "qwen3"; use_sliding_window true; attention_bias or mlp_bias true;
  // hidden_act other than "silu"; attention_dropout other than 0; rope_scaling (type in key
  // "rope_type", older files "type") other than null, "default", "linear" or "llama3" (dynamic,
  // yarn, longrope, ... are refused by name); transformers 5's rope_parameters (read as rope_theta
  // and rope_scaling are) per kind of layer, or contradicting rope_theta or rope_scaling; a qwen3
  // config without head_dim. Nothing is sized from the file before validate() has passed, so an
  // absurd file costs no memory.
  static LlamaConfig from_json(std::string_view text, std::string_view source = "config.json");
  // Reads and parses a file. Throws IoError when it cannot be read, ConfigError as above.
  static LlamaConfig load(const std::filesystem::path& path);

  // Throws ConfigError naming the key and its value when: a size is not positive; a dimension
  // (hidden_size, intermediate_size, heads, head_dim, vocab_size, max_position_embeddings,
  // q_dim) exceeds kMaxConfigDim, or num_hidden_layers exceeds kMaxConfigLayers; the
  // parameters of the embedding, of one layer or of the model exceed kMaxConfigParameters
  // (computed without overflow); num_attention_heads is not divisible by num_key_value_heads;
  // head_dim is odd (rotary needs pairs); rope_theta or rms_norm_eps is not positive and
  // finite; rope_scaling's factors are not positive and finite, low_freq_factor >=
  // high_freq_factor, or original_max_position_embeddings is not positive. Touches no memory
  // beyond the struct, so every size can be checked before anything is allocated.
  void validate() const;

  // The architecture as Hugging Face config.json text (its model_type and architectures;
  // Mistral's sliding_window; rope_theta; rope_scaling null or the object with "rope_type"),
  // which from_json reads back to an equal config.
  std::string to_json() const;
  // to_json's keys over hf_extra's: the config.json of a checkpoint and of an export, which
  // keeps what Hugging Face reads beyond the architecture (the special tokens' ids, ...).
  std::string to_hf_json() const;

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  int num_units() const { return static_cast<int>(num_hidden_layers) + 2; }

  // Parameters of the model, a tied weight counted once.
  uint64_t num_parameters() const;
  // Forward FLOPs per token for sequences of `seq_len`: 2 per multiply-add of every GEMM
  // (the embedding lookup counts 0), plus causal attention (each query attends to (t+1)
  // keys: 4 * q_dim * (seq_len + 1) / 2 per layer). Norms, RoPE, softmax are not counted.
  double forward_flops_per_token(int64_t seq_len) const;
  // The attention part of forward_flops_per_token: num_hidden_layers * 4 * q_dim * (seq_len +
  // 1) / 2 (the products q k^T and p v over the causal half). The rest is GEMMs.
  double attention_flops_per_token(int64_t seq_len) const;
  // Training FLOPs per token: 3x forward (backward = 2x forward), recomputation not counted.
  double train_flops_per_token(int64_t seq_len) const {
    return 3.0 * forward_flops_per_token(seq_len);
  }
  // What activation checkpointing adds per token: each decoder layer's forward again before its
  // backward, all but the down projection (LlamaModel's decoder backward), attention included.
  double recompute_flops_per_token(int64_t seq_len) const;
};

// Limits validate() enforces: far above any real model, and low enough that a valid config's
// parameter counts (elements and bytes, in size_t) and weight dimensions (BLAS int) fit their
// types. Activation sizes also depend on ModelOptions (micro_batch * seq_len) and are not
// covered here.
inline constexpr int64_t kMaxConfigDim = (int64_t{1} << 31) - 1;  // a 32-bit BLAS dimension
inline constexpr int64_t kMaxConfigLayers = 1000000;
inline constexpr uint64_t kMaxConfigParameters = uint64_t{1} << 48;
// LlamaModel's limit on the tokens of a micro-batch (micro_batch * seq_len): at most
// kMaxConfigDim (a GEMM's rows), and times the model's widest tensor (hidden, intermediate,
// q + k + v, vocabulary) times its units at most this many elements (4 PiB of fp32), so that
// every activation size, summed over the units, fits 64 bits.
inline constexpr double kMaxActivationElems = 0x1p50;

// The rotary inverse frequencies inv_freq[j], j < head_dim / 2, after rope_scaling:
// base[j] = rope_theta^(-2j / head_dim); Linear: base / factor; Llama3, with wavelength
// w = 2*pi / base[j] and L = original_max_position_embeddings: base if w < L / high_freq_factor,
// base / factor if w > L / low_freq_factor, else (1 - s) * base / factor + s * base with
// s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor). REQUIRES: a valid config.
std::vector<double> rope_inv_freq(const LlamaConfig& config);

// ---------------------------------------------------------------------------------------------
// Parameter layout

enum class UnitKind : uint8_t { Embedding, Decoder, Head };

// One tensor in a unit's slab.
struct TensorSpec {
  std::string name{};            // Hugging Face name, e.g. "model.layers.3.mlp.up_proj.weight"
  std::vector<int64_t> shape{};  // row-major; Linear weights are [out_features, in_features]
  size_t offset = 0;             // first element in the slab (a multiple of kTensorAlignElems)
  size_t numel = 0;
};

// Tensors start at multiples of this many elements (256 B in fp32), so kernels see aligned rows.
inline constexpr size_t kTensorAlignElems = 64;
// A slab is padded to a multiple of world_size * kPartitionAlignElems elements, so each rank's
// equal partition is a multiple of 4 KiB in both fp32 (8 KiB) and bf16/fp16 (4 KiB) and can be
// read or written with O_DIRECT as one request.
inline constexpr size_t kPartitionAlignElems = 2048;

struct UnitLayout {
  int index = 0;  // position in ModelLayout::units
  UnitKind kind = UnitKind::Decoder;
  int layer = -1;    // decoder layer number, -1 for embedding and head
  std::string name;  // "embed", "layers.3", "head"
  std::vector<TensorSpec> tensors{};
  size_t numel = 0;         // end of the last tensor (tensors plus alignment gaps)
  size_t padded_numel = 0;  // slab size in elements: numel rounded up as described above
  size_t partition_numel(int world_size) const { return padded_numel / world_size; }
  // The tensor named `name`, or nullptr.
  const TensorSpec* find(std::string_view name) const;
};

struct ModelLayout {
  int world_size = 1;
  bool tied = false;              // head reads the embedding unit's weight
  double init_std = 0.02;         // LlamaConfig::initializer_range
  std::vector<UnitLayout> units;  // embedding, layers..., head
  size_t total_padded_numel() const;
};

// The slab layout of `config` for ZeRO world size `world_size` (>= 1; InvalidArgument
// otherwise). Tensor offsets do not depend on world_size; only padded_numel does.
ModelLayout make_layout(const LlamaConfig& config, int world_size = 1);

// Writes the initial fp32 values of elements [begin, end) of `unit`'s slab to out[0..end-begin):
// N(0, layout.init_std) for the embedding and every Linear weight (Hugging Face's
// initializer_range), 1.0 for RMSNorm weights, 0 for biases,
// alignment gaps and padding. Each value depends only on (seed, tensor name, index in the
// tensor), so a rank can initialise its own partition alone, with the same result at any world
// size. InvalidArgument when the range is outside the slab.
void init_params(const ModelLayout& layout, int unit, uint64_t seed, size_t begin, size_t end,
                 float* out);

// Converts n fp32 values to `dtype` storage (round to nearest even) / back to fp32.
void convert_from_fp32(const float* src, void* dst, DType dtype, size_t n);
void convert_to_fp32(const void* src, DType dtype, float* dst, size_t n);

// ---------------------------------------------------------------------------------------------
// Forward and backward per unit

struct ModelOptions {
  int64_t micro_batch = 1;  // sequences per micro-batch (B)
  int64_t seq_len = 0;      // tokens per sequence (T), 1..max_position_embeddings
  // Storage dtype of the parameter slabs passed to forward/backward (F32, BF16 or F16).
  DType param_dtype = DType::F32;
  // F32: every operation in fp32 (bf16/fp16 weights widened exactly). BF16 (param_dtype must be
  // BF16), PyTorch autocast's rounding points: every GEMM takes bf16 operands (weights straight
  // from the slab, activations and gradients rounded to nearest even, attention's probabilities
  // and score gradients too) and accumulates in fp32 into fp32 outputs; RMSNorm, RoPE, SwiGLU,
  // softmax, the loss, residuals and gradient accumulation stay fp32.
  DType compute_dtype = DType::F32;
  // Rows of logits the head computes per GEMM and cross-entropy launch; 0: as many as 16 MiB of
  // fp32 logits hold (at least 16). A GPU takes thousands (head_rows_for_device).
  int64_t head_chunk_rows = 0;
  // Keep only unit inputs between forward and backward; backward recomputes the unit's
  // forward. Gradients are bit-identical to running without checkpointing.
  bool activation_checkpointing = false;
  int world_size = 1;  // for the layout's padding only
  // A model only planned for (`outcore estimate`): its RoPE and bias tables are not built
  // (their bytes are still counted), so planning takes no memory per token; its units refuse
  // to run.
  bool planning_only = false;
};

// The head_chunk_rows for a device with `device_bytes` of memory: as many rows as let the head's
// logits (fp32, and their bf16 copy in bf16 compute) take a sixteenth of it, at most 2 GiB; at
// least 16 rows, at most the micro-batch's tokens. Thousands of rows for a large vocabulary on
// a GPU (2790 at a 128256-token vocabulary in bf16 compute on an 80 GB GPU), so each GEMM reads the
// head weight once per thousands of tokens instead of once per 32.
int64_t head_rows_for_device(const LlamaConfig& c, const ModelOptions& o, uint64_t device_bytes);
// The head_chunk_rows a model on `device` takes (`outcore train`, the benchmarks): on a GPU,
// head_rows_for_device of head_sizing_bytes(budget_bytes, its memory size); elsewhere 0, the
// default.
int64_t head_rows_on(const LlamaConfig& c, const ModelOptions& o, const device::Device& device,
                     uint64_t budget_bytes);
// The device bytes the head's rows are sized from: the budget (0: none) or, when smaller or no
// budget is set, the GPU's memory size `device_total_bytes`. Never its free memory: the rows
// decide how the head's weight gradient is summed, so a run and its resume, or runs of one config
// on one GPU model, must take the same rows whatever else the GPU holds.
uint64_t head_sizing_bytes(uint64_t budget_bytes, uint64_t device_total_bytes);

enum class GradMode : uint8_t {
  Overwrite,   // grads = this micro-batch's gradient (every slab element written; padding 0)
  Accumulate,  // grads += this micro-batch's gradient (gradient accumulation)
};

// A head target that is not trained on (Hugging Face's -100 labels; any value < 0 is taken so).
inline constexpr int32_t kIgnoreTarget = -1;

// Inputs and outputs of one unit's forward. Pointers unused by the unit's kind must be null
// or are ignored. Token and target ids are host memory; everything else is memory of the
// model's device (what its backend computes on). Buffers must not overlap.
struct ForwardArgs {
  const void* params = nullptr;       // this unit's slab (param_dtype, padded_numel elements)
  const void* tied_params = nullptr;  // head, tied embeddings: the embedding unit's slab
  const int32_t* tokens = nullptr;    // embedding: [B*T] input ids, each in [0, vocab)
  // head: [B*T] next-token ids, each in [0, vocab) or kIgnoreTarget (any value < 0): a row
  // that is not trained on (a loss mask), contributing neither loss nor gradient.
  const int32_t* targets = nullptr;
  const float* input = nullptr;    // decoder, head: [B*T, hidden] (the previous unit's output)
  float* output = nullptr;         // embedding, decoder: [B*T, hidden]
  float* logits = nullptr;         // head, optional: [B*T, vocab] written when non-null
  std::span<std::byte> saved{};    // decoder: saved_bytes(unit) bytes, kept for backward
  std::span<std::byte> scratch{};  // scratch_bytes() bytes, clobbered
  // Return once the unit's work is queued on the backend's stream (ComputeBackend::stream()),
  // without waiting for it: the caller orders whatever reads, frees or rewrites the buffers
  // after events recorded there. The head's loss still waits for the unit (it is downloaded).
  bool queued = false;
};

// Inputs and outputs of one unit's backward.
struct BackwardArgs {
  const void* params = nullptr;  // as in ForwardArgs
  const void* tied_params = nullptr;
  const int32_t* tokens = nullptr;     // embedding: the forward's tokens
  const int32_t* targets = nullptr;    // head: the targets
  const float* input = nullptr;        // decoder, head: the forward's input (the checkpoint)
  const float* grad_output = nullptr;  // embedding, decoder: dLoss/d(output), [B*T, hidden]
  // decoder, head: receives dLoss/d(input), [B*T, hidden]. For a decoder it may equal
  // grad_output (computed in place).
  float* grad_input = nullptr;
  float* grads = nullptr;       // this unit's fp32 gradient slab (padded_numel elements)
  float* tied_grads = nullptr;  // head, tied: the embedding unit's fp32 gradient slab
  // Overwrite or add into grads (and tied_grads). With tied embeddings the embedding unit's
  // backward always adds (the head already wrote this micro-batch's share), whatever `mode`.
  GradMode mode = GradMode::Overwrite;
  // head: gradients are those of loss_scale * (sum of the cross-entropy of the rows whose
  // target is not ignored) / (B*T): without ignored targets, loss_scale * the mean. The trainer
  // passes dynamic_loss_scale x (B*T) / (targets trained on in the whole step, every rank).
  float loss_scale = 1.0f;
  std::span<const std::byte> saved{};  // decoder without checkpointing: what forward saved
  std::span<std::byte> scratch{};      // scratch_bytes() bytes, clobbered
  bool queued = false;                 // as in ForwardArgs
};

// An immutable model definition for one micro-batch shape. forward/backward are const and
// keep no state between calls (everything lives in the caller's buffers); calls must not run
// concurrently with each other (they use every BLAS thread, or the backend's one stream):
// serialize them. Each call has finished its work on the device when it returns, unless its
// arguments say `queued`.
class LlamaModel {
 public:
  // Computes through `backend` (nullptr: the CPU backend). Throws ConfigError (via
  // config.validate()) or InvalidArgument for a bad seq_len, micro_batch, param_dtype or
  // world_size.
  LlamaModel(LlamaConfig config, ModelOptions options,
             std::shared_ptr<device::ComputeBackend> backend = nullptr);

  device::ComputeBackend& backend() const { return *backend_; }

  const LlamaConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  const ModelLayout& layout() const { return layout_; }
  int num_units() const { return config_.num_units(); }
  int64_t tokens() const { return options_.micro_batch * options_.seq_len; }  // B*T
  UnitKind kind(int unit) const { return layout_.units.at(unit).kind; }

  // Bytes of one unit input/output (and of its gradient): B*T*hidden*4.
  size_t hidden_bytes() const;
  // Bytes a unit's forward saves for its backward: a decoder's internals without
  // checkpointing, else 0.
  size_t saved_bytes(int unit) const;
  // Bytes of the scratch workspace that any forward or backward call needs (the maximum over
  // units; includes the recompute space with checkpointing).
  size_t scratch_bytes() const;
  // Whose needs size scratch_bytes(), in words (the plan names it): "N rows of head logits" (N
  // per launch), "a decoder layer" or "the embedding".
  std::string scratch_sized_by() const;
  // What the model's computation asks of a backend's device memory besides the buffers above
  // (device::backend_workspace): the attention shape, the tokens staged, the constant tables.
  device::WorkspaceShape workspace_shape() const;
  // The bytes of the RoPE tables and the bias GEMMs' column of ones, as the backend charges
  // them (built or not: planning_only).
  size_t constant_bytes() const;

  // Runs unit `unit`'s forward. Returns the head's mean cross-entropy over its B*T rows, an
  // ignored target's row counting 0 (so a mean over B*T, not over the rows trained on), and writes
  // logits when asked), else 0. Throws InvalidArgument for a missing buffer, a buffer too
  // small, or a token / target id outside the vocabulary (naming its position and value).
  //
  // In training, the head's forward need not be called: its backward computes the loss
  // itself (fused with the gradient, chunk by chunk, never holding all logits).
  float forward(int unit, const ForwardArgs& args) const;

  // Runs unit `unit`'s backward, writing grads per args.mode and grad_input. For the head it
  // also computes and returns that mean cross-entropy (its forward is fused in); else returns
  // 0. With checkpointing, a decoder recomputes its forward from args.input first, exactly.
  // Throws as forward does.
  float backward(int unit, const BackwardArgs& args) const;

 private:
  // What forward and backward share around `run(ctx, kind)`, the unit's own call: the trace
  // span `what`, the checks of the scratch and saved spans, the unit's context, and finish()
  // unless args.queued.
  template <class Args, class Run>
  float run_unit(const char* what, int unit, const Args& args, Run run) const;

  LlamaConfig config_;
  ModelOptions options_;
  ModelLayout layout_;
  std::shared_ptr<device::ComputeBackend> backend_;
  std::vector<float> rope_cos_, rope_sin_;  // [seq_len, head_dim / 2], host
  const float* rope_cos_dev_ = nullptr;     // the same, in the backend's memory
  const float* rope_sin_dev_ = nullptr;
  std::vector<float> ones_;          // qkv_bias: micro_batch * seq_len ones, host
  const float* ones_dev_ = nullptr;  // the same, in the backend's memory
};

// ---------------------------------------------------------------------------------------------
// Activation memory for one micro-batch

// Bytes per tier of everything ActivationBuffers allocates, computable before allocating.
struct ActivationPlan {
  uint64_t checkpoint_bytes = 0;  // the L+1 unit inputs (decoder layers and head) kept to backward
  uint64_t saved_bytes = 0;       // all decoders' saved internals (0 with checkpointing)
  uint64_t grad_bytes = 0;        // one activation-gradient buffer (updated in place)
  uint64_t scratch_bytes = 0;     // the shared workspace
  // Charged device bytes (device::charged_bytes of each device allocation). The checkpoints
  // are on the device unless cpu_checkpointing, then they count in host_bytes (and, on a
  // device the host cannot read, two staging inputs on the device count in device_bytes).
  uint64_t device_bytes = 0;
  uint64_t host_bytes = 0;
};
ActivationPlan plan_activations(const LlamaModel& model, bool cpu_checkpointing,
                                bool device_host_accessible = true);

// The activation buffers of one micro-batch, allocated from `device` (budgeted), except the
// unit-input checkpoints, which live in host memory (outside the budget) with
// cpu_checkpointing. On a host-accessible device the model reads host checkpoints in place.
// On a device the host cannot read (a GPU), units compute on two device staging inputs
// (unit u's input is staging buffer u % 2): after_forward(u) copies unit u's output down to
// its host checkpoint, before_backward(u) copies unit u's checkpoint back up; both are no-ops
// in every other case, so a pass calls them unconditionally. The copies run on their own
// stream under the compute: unit u's output goes down while unit u+1 computes (one copy in
// flight per staging buffer), and before_backward(u) starts bringing unit u-1's checkpoint up
// while unit u's backward computes. Each copy first waits (on the device) for the compute queued
// on the model's backend so far, and the compute queued after it that writes or reads its
// staging buffer waits (on the device) for the copy, so the units may be queued without the
// host waiting for either (ForwardArgs::queued). REQUIRES: `device` outlives this object; units run
// in the order forward 1..L, backward L+1..1 (a pass's order). Throws OutOfMemory.
class ActivationBuffers {
 public:
  ActivationBuffers(const LlamaModel& model, device::Device& device, bool cpu_checkpointing);
  ~ActivationBuffers();

  // Input of unit `unit` (1..L+1), which is the output of unit-1: [B*T, hidden]. Device
  // memory (or the host checkpoint read in place, see above).
  float* unit_input(int unit);
  // Staged checkpoints only (else no-ops): after unit `unit`'s forward, starts the copy of its
  // output (the input of unit+1) to its host checkpoint, and makes the compute queued next
  // wait until the staging buffer unit+1 writes is free (its previous copy done);
  // before unit `unit`'s backward (1..L+1), makes the compute queued next wait until unit's
  // input is on the device, having started the copy of unit-1's. A failed copy fails the
  // compute that waits for it (its stream's error).
  void after_forward(int unit);
  void before_backward(int unit);
  // Saved internals of decoder unit `unit` (empty with checkpointing or for other units).
  std::span<std::byte> saved(int unit);
  std::span<std::byte> scratch();
  float* grad();  // [B*T, hidden], the activation gradient flowing backward

 private:
  // Staged: the next copy waits for every operation queued on the backend so far.
  void after_compute();
  // Staged: the operations queued on the backend next wait for `copied` (the host waits where
  // the backend has no stream).
  void compute_waits(device::Event& copied);
  const LlamaModel& model_;
  device::Device& device_;
  std::vector<device::DeviceBuffer> device_inputs_;
  std::vector<AlignedBuffer> host_inputs_;
  device::DeviceBuffer staging_[2];       // staged checkpoints: inputs of u % 2
  std::unique_ptr<device::Stream> copy_;  // staged checkpoints' copies
  // Staged: the last copy that reads or writes staging buffer k; the unit whose input a copy
  // already started bringing up (0: none).
  std::unique_ptr<device::Event> copied_[2];
  // Staged: recorded on the backend's stream before each copy, which waits for it (null when
  // the backend's operations finish when they return).
  std::unique_ptr<device::Event> computed_;
  int prefetched_ = 0;
  bool staged_ = false;
  std::vector<device::DeviceBuffer> saved_;
  device::DeviceBuffer scratch_, grad_;
};

// ---------------------------------------------------------------------------------------------
// Whole-model helpers (every unit's parameters resident; used by stage 0, tests, benchmarks)

// params[u] / grads[u]: unit u's parameter slab (param_dtype) / fp32 gradient slab.
struct ModelBuffers {
  std::vector<const void*> params;
  std::vector<float*> grads;
};

// Forward and backward of one micro-batch over all units; returns the mean cross-entropy.
// grads are written per `mode` (see GradMode; tied embeddings handled). `loss_scale` as in
// BackwardArgs. Throws as LlamaModel::forward/backward.
float train_micro_batch(const LlamaModel& model, const ModelBuffers& buffers,
                        ActivationBuffers& acts, const int32_t* tokens, const int32_t* targets,
                        GradMode mode, float loss_scale = 1.0f);

// Forward only; returns the mean cross-entropy, writing logits [B*T, vocab] when non-null.
float eval_micro_batch(const LlamaModel& model, const ModelBuffers& buffers,
                       ActivationBuffers& acts, const int32_t* tokens, const int32_t* targets,
                       float* logits = nullptr);

}  // namespace outcore::model
