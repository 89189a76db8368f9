// LlamaModel: unit dispatch, workspace sizes, activation buffers, whole-model helpers.
#include <cmath>
#include <numbers>

#include "common/trace.hpp"
#include "engine/model/unit_internal.hpp"

namespace outcore::model {
namespace {

void check_span(size_t have, size_t need, const std::string& unit, const char* what) {
  if (need > 0 && have < need)
    throw InvalidArgument(
        fmt::format("{}: {} buffer of {} bytes is too small (needs {})", unit, what, have, need));
}

// One base frequency after rope_scaling (see rope_inv_freq in model.hpp).
double scale_inv_freq(double inv_freq, const RopeScaling& s) {
  switch (s.type) {
    case RopeScalingType::None:
      return inv_freq;
    case RopeScalingType::Linear:
      return inv_freq / s.factor;
    case RopeScalingType::Llama3: {
      const double context = static_cast<double>(s.original_max_position_embeddings);
      const double wavelength = 2.0 * std::numbers::pi / inv_freq;
      if (wavelength < context / s.high_freq_factor) return inv_freq;
      if (wavelength > context / s.low_freq_factor) return inv_freq / s.factor;
      const double smooth =
          (context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      return (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq;
    }
  }
  return inv_freq;
}

}  // namespace

std::vector<double> rope_inv_freq(const LlamaConfig& config) {
  std::vector<double> inv_freq(static_cast<size_t>(config.head_dim / 2));
  for (size_t j = 0; j < inv_freq.size(); ++j) {
    const double base = std::pow(
        config.rope_theta, -2.0 * static_cast<double>(j) / static_cast<double>(config.head_dim));
    inv_freq[j] = scale_inv_freq(base, config.rope_scaling);
  }
  return inv_freq;
}

LlamaModel::LlamaModel(LlamaConfig config, ModelOptions options,
                       std::shared_ptr<device::ComputeBackend> backend)
    : config_(std::move(config)),
      options_(options),
      backend_(backend ? std::move(backend) : device::cpu_backend()) {
  config_.validate();
  if (options_.seq_len < 1 || options_.seq_len > config_.max_position_embeddings)
    throw InvalidArgument(
        fmt::format("sequence length {} is outside [1, max_position_embeddings {}]",
                    options_.seq_len, config_.max_position_embeddings));
  if (config_.sliding_window > 0 && options_.seq_len > config_.sliding_window)
    throw ConfigError(
        "sliding_window",
        fmt::format("{}: sequences of {} tokens are longer than the window; outcore's "
                    "attention has no window: train with a sequence length of at "
                    "most {}{}",
                    config_.sliding_window, options_.seq_len, config_.sliding_window,
                    config_.sliding_window == kMistralDefaultSlidingWindow
                        ? " (Hugging Face's default for a Mistral config.json without the key; "
                          "\"sliding_window\": null there means no window)"
                        : ""));
  if (options_.micro_batch < 1)
    throw InvalidArgument(fmt::format("micro batch must be >= 1, got {}", options_.micro_batch));
  // Every activation size below is computed in 64 bits: a micro-batch is a GEMM's rows (a BLAS
  // int), and its activations over all units stay far below 2^64 bytes.
  const double tokens = static_cast<double>(options_.micro_batch) * options_.seq_len;
  const double width =
      static_cast<double>(std::max({config_.hidden_size, config_.intermediate_size,
                                    config_.q_dim() + 2 * config_.kv_dim(), config_.vocab_size}));
  if (tokens > static_cast<double>(kMaxConfigDim))
    throw InvalidArgument(fmt::format(
        "micro batch {} x sequence length {} = {:.0f} tokens: at most {} (the rows of a GEMM)",
        options_.micro_batch, options_.seq_len, tokens, kMaxConfigDim));
  if (const double units = config_.num_hidden_layers + 2;
      tokens * width * units > kMaxActivationElems)
    throw InvalidArgument(fmt::format(
        "micro batch {} x sequence length {} = {:.0f} tokens: this model's activations cannot be "
        "sized for more than {:.0f} (tokens x its widest tensor, {:.0f}, x its {:.0f} units must "
        "stay within 2^50 elements)",
        options_.micro_batch, options_.seq_len, tokens,
        std::floor(kMaxActivationElems / (width * units)), width, units));
  if (options_.head_chunk_rows < 0)
    throw InvalidArgument(
        fmt::format("head chunk rows must be >= 0, got {}", options_.head_chunk_rows));
  if (options_.compute_dtype != DType::F32 &&
      (options_.compute_dtype != DType::BF16 || options_.param_dtype != DType::BF16))
    throw InvalidArgument(fmt::format(
        "compute dtype {} with parameters in {}: the compute dtype is fp32, or bf16 with bf16 "
        "parameters",
        dtype_name(options_.compute_dtype), dtype_name(options_.param_dtype)));
  layout_ = make_layout(config_, options_.world_size);
  if (options_.planning_only) return;
  const int64_t half = config_.head_dim / 2, T = options_.seq_len;
  const std::vector<double> inv_freq = rope_inv_freq(config_);
  rope_cos_.resize(T * half);
  rope_sin_.resize(T * half);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < half; ++j) {
      const double angle = static_cast<double>(t) * inv_freq[j];
      rope_cos_[t * half + j] = static_cast<float>(std::cos(angle));
      rope_sin_[t * half + j] = static_cast<float>(std::sin(angle));
    }
  }
  rope_cos_dev_ = backend_->constant(rope_cos_);
  rope_sin_dev_ = backend_->constant(rope_sin_);
  if (config_.qkv_bias()) {  // the column of ones the bias GEMMs broadcast and sum with
    ones_.assign(static_cast<size_t>(options_.micro_batch * options_.seq_len), 1.0f);
    ones_dev_ = backend_->constant(ones_);
  }
}

size_t LlamaModel::hidden_bytes() const {
  return sizeof(float) * static_cast<size_t>(tokens() * config_.hidden_size);
}

size_t LlamaModel::saved_bytes(int unit) const {
  if (layout_.units.at(unit).kind != UnitKind::Decoder || options_.activation_checkpointing)
    return 0;
  return detail::decoder_saved_bytes(config_, options_);
}

size_t LlamaModel::scratch_bytes() const {
  return std::max({detail::decoder_scratch_bytes(config_, options_),
                   detail::head_scratch_bytes(config_, options_),
                   detail::embedding_scratch_bytes(config_, options_)});
}

std::string LlamaModel::scratch_sized_by() const {
  const size_t decoder = detail::decoder_scratch_bytes(config_, options_);
  const size_t head = detail::head_scratch_bytes(config_, options_);
  const size_t embedding = detail::embedding_scratch_bytes(config_, options_);
  if (head >= decoder && head >= embedding)
    return fmt::format("{} rows of head logits", detail::head_chunk_rows(config_, options_));
  return decoder >= embedding ? "a decoder layer" : "the embedding";
}

device::WorkspaceShape LlamaModel::workspace_shape() const {
  using device::charged_bytes;
  return {.attention = detail::decoder_attention(config_, options_),
          .tokens = tokens(),
          .constant_bytes = constant_bytes()};
}

size_t LlamaModel::constant_bytes() const {
  using device::charged_bytes;
  const auto table = static_cast<size_t>(options_.seq_len * (config_.head_dim / 2));
  const size_t ones =
      config_.qkv_bias() ? static_cast<size_t>(options_.micro_batch * options_.seq_len) : 0;
  return 2 * charged_bytes(table * sizeof(float)) + charged_bytes(ones * sizeof(float));
}

template <class Args, class Run>
float LlamaModel::run_unit(const char* what, int unit, const Args& args, Run run) const {
  OUTCORE_TRACE_SPAN(what, "compute", {.unit = unit});
  if (options_.planning_only)
    throw InvalidArgument(fmt::format("{}: a model built for planning only cannot run", what));
  const UnitLayout& u = layout_.units.at(unit);
  check_span(args.scratch.size(), u.kind == UnitKind::Embedding ? 0 : scratch_bytes(), u.name,
             "scratch");
  check_span(args.saved.size(), saved_bytes(unit), u.name, "saved-activation");
  const detail::UnitContext ctx{config_,       options_,      *backend_, u, layout_.units.front(),
                                rope_cos_dev_, rope_sin_dev_, ones_dev_};
  const float loss = run(ctx, u.kind);
  if (!args.queued) backend_->finish();
  return loss;
}

float LlamaModel::forward(int unit, const ForwardArgs& args) const {
  return run_unit("forward", unit, args, [&](const detail::UnitContext& ctx, UnitKind kind) {
    switch (kind) {
      case UnitKind::Embedding:
        detail::embedding_forward(ctx, args);
        break;
      case UnitKind::Decoder:
        detail::decoder_forward(ctx, args);
        break;
      case UnitKind::Head:
        return detail::head_forward(ctx, args);
    }
    return 0.0f;
  });
}

float LlamaModel::backward(int unit, const BackwardArgs& args) const {
  return run_unit("backward", unit, args, [&](const detail::UnitContext& ctx, UnitKind kind) {
    switch (kind) {
      case UnitKind::Embedding:
        detail::embedding_backward(ctx, args);
        break;
      case UnitKind::Decoder:
        detail::decoder_backward(ctx, args);
        break;
      case UnitKind::Head:
        return detail::head_backward(ctx, args);
    }
    return 0.0f;
  });
}

ActivationPlan plan_activations(const LlamaModel& model, bool cpu_checkpointing,
                                bool device_host_accessible) {
  using device::charged_bytes;
  ActivationPlan p;
  const int L = static_cast<int>(model.config().num_hidden_layers);
  const uint64_t hb = model.hidden_bytes();
  p.checkpoint_bytes = static_cast<uint64_t>(L + 1) * hb;
  for (int u = 1; u <= L; ++u) p.saved_bytes += model.saved_bytes(u);
  p.grad_bytes = hb;
  p.scratch_bytes = model.scratch_bytes();
  p.device_bytes = charged_bytes(hb) + charged_bytes(p.scratch_bytes) +
                   static_cast<uint64_t>(L) * charged_bytes(model.saved_bytes(1));
  const uint64_t ckpt_charged = static_cast<uint64_t>(L + 1) * charged_bytes(hb);
  if (cpu_checkpointing)
    p.host_bytes = ckpt_charged;
  else
    p.device_bytes += ckpt_charged;
  if (cpu_checkpointing && !device_host_accessible) p.device_bytes += 2 * charged_bytes(hb);
  return p;
}

ActivationBuffers::ActivationBuffers(const LlamaModel& model, device::Device& device,
                                     bool cpu_checkpointing)
    : model_(model), device_(device), staged_(cpu_checkpointing && !device.host_accessible()) {
  const int L = static_cast<int>(model.config().num_hidden_layers);
  if (staged_) {
    for (int k = 0; k < 2; ++k) {
      staging_[k] = device.alloc(model.hidden_bytes(), "staged unit input");
      copied_[k] = device.create_event();
    }
    copy_ = device.create_stream("activation-checkpoints");
    if (model.backend().stream() != nullptr) computed_ = device.create_event();
  }
  for (int u = 1; u <= L + 1; ++u) {
    if (cpu_checkpointing) {
      host_inputs_.emplace_back(model.hidden_bytes());
    } else {
      device_inputs_.push_back(
          device.alloc(model.hidden_bytes(), fmt::format("input of unit {}", u)));
    }
  }
  for (int u = 1; u <= L; ++u)
    saved_.push_back(
        device.alloc(model.saved_bytes(u), fmt::format("saved activations of unit {}", u)));
  scratch_ = device.alloc(model.scratch_bytes(), "model scratch");
  grad_ = device.alloc(model.hidden_bytes(), "activation gradient");
  // Last, once nothing can throw but this: the destructor unregisters every buffer.
  for (size_t i = 0; staged_ && i < host_inputs_.size(); ++i) {
    try {
      device.register_host(host_inputs_[i].data(), model.hidden_bytes());
    } catch (...) {
      while (i-- > 0) device.unregister_host(host_inputs_[i].data());
      throw;
    }
  }
}

ActivationBuffers::~ActivationBuffers() {
  if (!staged_) return;
  // A failed pass may leave a checkpoint copy in flight: it ends before its memory is released.
  try {
    copy_->synchronize();
  } catch (const std::exception&) {  // the pass's own error is the one reported
  }
  for (AlignedBuffer& b : host_inputs_) device_.unregister_host(b.data());
}

float* ActivationBuffers::unit_input(int unit) {
  const size_t i = static_cast<size_t>(unit) - 1;
  if (unit < 1 || i >= std::max(host_inputs_.size(), device_inputs_.size()))
    throw InvalidArgument(fmt::format("activation buffers: unit {} has no input buffer", unit));
  if (staged_) return staging_[unit % 2].as<float>();
  return host_inputs_.empty() ? device_inputs_[i].as<float>() : host_inputs_[i].as<float>().data();
}

void ActivationBuffers::after_forward(int unit) {
  if (!staged_ || unit + 1 > static_cast<int>(host_inputs_.size())) return;
  prefetched_ = 0;
  const int out = (unit + 1) % 2;  // unit's output, unit+1's input: it reads, the copy reads
  after_compute();
  copy_->copy_d2h(host_inputs_[unit].data(), staging_[out].data(), model_.hidden_bytes());
  copy_->record(*copied_[out]);
  compute_waits(*copied_[unit % 2]);  // unit+1 writes its output there: once copied down
}

void ActivationBuffers::before_backward(int unit) {
  if (!staged_ || unit < 1 || unit > static_cast<int>(host_inputs_.size())) return;
  const auto bring_up = [&](int u) {
    after_compute();
    copy_->copy_h2d(staging_[u % 2].data(), host_inputs_[u - 1].data(), model_.hidden_bytes());
    copy_->record(*copied_[u % 2]);
  };
  if (prefetched_ != unit) bring_up(unit);
  compute_waits(*copied_[unit % 2]);
  // unit-1's buffer last held unit+1's input: the copy waits for its backward.
  prefetched_ = unit - 1;
  if (prefetched_ >= 1) bring_up(prefetched_);
}

void ActivationBuffers::compute_waits(device::Event& copied) {
  device::Stream* compute = model_.backend().stream();
  if (compute == nullptr)
    copied.synchronize();
  else
    compute->wait(copied);  // the host runs on; a failed copy fails the compute after it
}

void ActivationBuffers::after_compute() {
  device::Stream* compute = model_.backend().stream();
  if (compute == nullptr) return;
  compute->record(*computed_);
  copy_->wait(*computed_);
}

std::span<std::byte> ActivationBuffers::saved(int unit) {
  if (unit < 1 || unit > static_cast<int>(saved_.size())) return {};
  device::DeviceBuffer& b = saved_[unit - 1];
  return {static_cast<std::byte*>(b.data()), b.size()};
}

std::span<std::byte> ActivationBuffers::scratch() {
  return {static_cast<std::byte*>(scratch_.data()), scratch_.size()};
}

float* ActivationBuffers::grad() { return grad_.as<float>(); }

float train_micro_batch(const LlamaModel& model, const ModelBuffers& buffers,
                        ActivationBuffers& acts, const int32_t* tokens, const int32_t* targets,
                        GradMode mode, float loss_scale) {
  const int units = model.num_units(), head = units - 1;
  if (buffers.params.size() != static_cast<size_t>(units) ||
      buffers.grads.size() != static_cast<size_t>(units))
    throw InvalidArgument(
        fmt::format("train_micro_batch: need {} parameter and gradient slabs", units));
  model.forward(0, {.params = buffers.params[0], .tokens = tokens, .output = acts.unit_input(1)});
  acts.after_forward(0);
  for (int u = 1; u < head; ++u) {
    model.forward(u, {.params = buffers.params[u],
                      .input = acts.unit_input(u),
                      .output = acts.unit_input(u + 1),
                      .saved = acts.saved(u),
                      .scratch = acts.scratch()});
    acts.after_forward(u);
  }
  const bool tied = model.config().tie_word_embeddings;
  acts.before_backward(head);
  const float loss = model.backward(head, {.params = buffers.params[head],
                                           .tied_params = tied ? buffers.params[0] : nullptr,
                                           .targets = targets,
                                           .input = acts.unit_input(head),
                                           .grad_input = acts.grad(),
                                           .grads = buffers.grads[head],
                                           .tied_grads = tied ? buffers.grads[0] : nullptr,
                                           .mode = mode,
                                           .loss_scale = loss_scale,
                                           .scratch = acts.scratch()});
  for (int u = head - 1; u >= 1; --u) {
    acts.before_backward(u);
    model.backward(u, {.params = buffers.params[u],
                       .input = acts.unit_input(u),
                       .grad_output = acts.grad(),
                       .grad_input = acts.grad(),
                       .grads = buffers.grads[u],
                       .mode = mode,
                       .saved = acts.saved(u),
                       .scratch = acts.scratch()});
  }
  model.backward(0, {.params = buffers.params[0],
                     .tokens = tokens,
                     .grad_output = acts.grad(),
                     .grads = buffers.grads[0],
                     .mode = mode});
  return loss;
}

float eval_micro_batch(const LlamaModel& model, const ModelBuffers& buffers,
                       ActivationBuffers& acts, const int32_t* tokens, const int32_t* targets,
                       float* logits) {
  const int units = model.num_units(), head = units - 1;
  if (buffers.params.size() != static_cast<size_t>(units))
    throw InvalidArgument(fmt::format("eval_micro_batch: need {} parameter slabs", units));
  model.forward(0, {.params = buffers.params[0], .tokens = tokens, .output = acts.unit_input(1)});
  for (int u = 1; u < head; ++u)
    model.forward(u, {.params = buffers.params[u],
                      .input = acts.unit_input(u),
                      .output = acts.unit_input(u + 1),
                      .saved = acts.saved(u),
                      .scratch = acts.scratch()});
  const bool tied = model.config().tie_word_embeddings;
  return model.forward(head, {.params = buffers.params[head],
                              .tied_params = tied ? buffers.params[0] : nullptr,
                              .targets = targets,
                              .input = acts.unit_input(head),
                              .logits = logits,
                              .scratch = acts.scratch()});
}

}  // namespace outcore::model
