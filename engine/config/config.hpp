// engine/config: DeepSpeed's JSON config read into typed, validated structs.
//
// A file goes through three steps:
//   1. parse_config() / load_config_file(): lenient JSON (comments, trailing commas), every
//      key checked for type and range, defaults filled in. All errors are collected and
//      thrown together as one ConfigValidationError; unknown keys become warnings.
//   2. resolve_auto(): fills the values written as "auto" from model facts and the command
//      line, then runs the batch-size arithmetic for the world size.
//   3. The engine reads the structs. A value still "auto" (or unset) when read through
//      AutoOr::value() throws a ConfigError naming its JSON path.
//
// Every key to_json prints either acts or, set to a value other than its default, draws a
// warning naming its path and why it has no effect (key_effects.hpp lists the keys, with the
// test of each one's effect): nothing a user sets is dropped silently. outcore's own keys are
// in the "outcore" section (OutcoreConfig).
//
// Every struct is a plain value type: copyable, no hidden state, safe to read from many
// threads at once once no thread writes it. Field defaults below are DeepSpeed 0.19.6's
// (see shared/reference/deepspeed_facts.md); where outcore differs it says so.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.hpp"
#include "common/error.hpp"

namespace outcore::config {

// A value the config may give as "auto" (Hugging Face convention), leave unset, or set.
// `path` is the JSON path of the key; it is a string literal owned by the program.
template <typename T>
class AutoOr {
 public:
  // Unset, no default: value() throws until set() or resolution.
  explicit constexpr AutoOr(const char* path) : path_(path) {}
  // Set to a default value.
  constexpr AutoOr(T default_value, const char* path) : value_(default_value), path_(path) {}

  bool is_auto() const { return auto_; }
  bool has_value() const { return !auto_ && value_.has_value(); }
  bool is_unset() const { return !auto_ && !value_.has_value(); }
  const char* path() const { return path_; }

  // Returns the value. Throws ConfigError naming path() when it is "auto" (not resolved)
  // or unset.
  const T& value() const {
    if (!has_value()) throw_missing();
    return *value_;
  }
  // The value if set, else `fallback` (also when "auto").
  T value_or(T fallback) const { return has_value() ? *value_ : fallback; }

  void set(T v) {
    value_ = std::move(v);
    auto_ = false;
  }
  void set_auto() {
    value_.reset();
    auto_ = true;
  }
  void reset() {
    value_.reset();
    auto_ = false;
  }

  bool operator==(const AutoOr& o) const { return auto_ == o.auto_ && value_ == o.value_; }

 private:
  [[noreturn]] void throw_missing() const;

  std::optional<T> value_;
  bool auto_ = false;
  const char* path_;
};

// One problem found in a config: where (JSON path, may be empty for file-level problems)
// and what ("got 4; allowed: 0, 1, 2 or 3").
struct ConfigIssue {
  std::string json_path;
  std::string message;
  // "json_path: message", or message alone when the path is empty.
  std::string to_string() const;
  bool operator==(const ConfigIssue&) const = default;
};

using ConfigWarning = ConfigIssue;

// Every error found in one config, thrown at once. what() is
// "<source>: N errors:\n  <path>: <message>\n  ..." (a single error fits on one line:
// "<source>: <path>: <message>"). json_path() is empty: each issue carries its own path.
// From parse_config, issues are in the order their keys appear in the file.
class ConfigValidationError : public ConfigError {
 public:
  ConfigValidationError(std::string source, std::vector<ConfigIssue> issues);
  const std::vector<ConfigIssue>& issues() const { return issues_; }
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::vector<ConfigIssue> issues_;
};

// ---- fp16 / bf16 ----------------------------------------------------------------------

struct FP16Config {
  AutoOr<bool> enabled{false, "fp16.enabled"};  // "auto": AutoContext::fp16, else false
  bool auto_cast = false;
  double loss_scale = 0;         // 0 = dynamic loss scaling; > 0 = this static scale
  int initial_scale_power = 16;  // dynamic scaling starts at 2^power; 0..63
  int loss_scale_window = 1000;  // clean steps before the scale doubles; >= 1
  int hysteresis = 2;            // overflows tolerated before halving; >= 1
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1;  // floor of the dynamic scale; > 0
  bool fp16_master_weights_and_grads = false;

  bool dynamic_loss_scale() const { return loss_scale == 0; }
};

struct BF16Config {                             // section "bf16", legacy name "bfloat16"
  AutoOr<bool> enabled{false, "bf16.enabled"};  // "auto": AutoContext::bf16, else false
  bool immediate_grad_update = false;
  bool check_grad_overflow = true;
  bool bf16_master_weights_and_grads = false;
  bool bf16_optimizer_states = false;  // requires bf16_master_weights_and_grads
};

// ---- optimizer -------------------------------------------------------------------------

// Only Adam and AdamW are supported (case-insensitive in the file); every other DeepSpeed
// or torch optimizer name is an error listing these two.
enum class OptimizerType { kAdam, kAdamW };

struct OptimizerConfig {
  // An absent "optimizer" section means Adam with the defaults below (decoupled decay).
  OptimizerType type = OptimizerType::kAdam;
  AutoOr<double> lr{1e-3, "optimizer.params.lr"};  // "auto": AutoContext::lr
  AutoOr<std::array<double, 2>> betas{{0.9, 0.999}, "optimizer.params.betas"};  // each in [0,1)
  AutoOr<double> eps{1e-8, "optimizer.params.eps"};                             // > 0
  AutoOr<double> weight_decay{0.0, "optimizer.params.weight_decay"};            // >= 0
  bool bias_correction = true;
  // With type Adam: true = decoupled (AdamW) decay, false = classic L2. DeepSpeed's default
  // is true, so "Adam" decays like AdamW unless the file says `"adam_w_mode": false`.
  bool adam_w_mode = true;
  // DeepSpeedCPUAdam's fp32_optimizer_states: false keeps the Adam moments in bf16 (see
  // adam_moments_bf16).
  bool fp32_optimizer_states = true;

  // True when weight decay is decoupled (AdamW semantics).
  bool decoupled_weight_decay() const { return type == OptimizerType::kAdamW || adam_w_mode; }
};

// ---- scheduler -------------------------------------------------------------------------

enum class SchedulerType { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR, kOneCycle };
enum class WarmupType { kLog, kLinear };

// WarmupLR and WarmupDecayLR.
struct WarmupLRParams {
  AutoOr<double> warmup_min_lr{0.0, "scheduler.params.warmup_min_lr"};  // "auto": 0
  // Unset with WarmupLR: the optimizer's lr (resolve_auto copies it in). WarmupDecayLR's
  // default is 0.001 (DeepSpeed's signature), filled in at parse time. "auto": the lr.
  AutoOr<double> warmup_max_lr{"scheduler.params.warmup_max_lr"};
  AutoOr<int64_t> warmup_num_steps{1000, "scheduler.params.warmup_num_steps"};  // >= 1
  WarmupType warmup_type = WarmupType::kLog;
  // WarmupDecayLR only, required there. "auto": AutoContext::total_steps.
  AutoOr<int64_t> total_num_steps{"scheduler.params.total_num_steps"};
};

struct WarmupCosineLRParams {
  AutoOr<int64_t> total_num_steps{"scheduler.params.total_num_steps"};  // required
  double warmup_min_ratio = 0.0;
  AutoOr<int64_t> warmup_num_steps{1000, "scheduler.params.warmup_num_steps"};
  double cos_min_ratio = 0.0001;
  WarmupType warmup_type = WarmupType::kLog;
};

struct OneCycleParams {
  std::optional<double> cycle_min_lr;  // required
  std::optional<double> cycle_max_lr;  // required, >= cycle_min_lr
  double decay_lr_rate = 0;
  int64_t cycle_first_step_size = 2000;           // >= 1
  std::optional<int64_t> cycle_second_step_size;  // unset = cycle_first_step_size
  int64_t cycle_first_stair_count = 0;
  std::optional<int64_t> cycle_second_stair_count;  // unset = cycle_first_stair_count
  int64_t decay_step_size = 0;                      // 0 = no decay after the cycle
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8;
  double cycle_max_mom = 0.9;
  double decay_mom_rate = 0;
};

struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;  // absent section: constant lr
  WarmupLRParams warmup;                      // meaningful for kWarmupLR / kWarmupDecayLR
  WarmupCosineLRParams cosine;                // meaningful for kWarmupCosineLR
  OneCycleParams one_cycle;                   // meaningful for kOneCycle
};

// ---- zero_optimization -----------------------------------------------------------------

enum class OffloadDevice { kNone, kCpu, kNvme };

// Most buffers offload_param.buffer_count / offload_optimizer.buffer_count may ask for: each is
// a pinned allocation of a whole partition or sub-group, so more is a typo, not tuning.
inline constexpr int64_t kMaxOffloadBufferCount = 4096;

// Stage 3 only (ignored with a warning below stage 3, as DeepSpeed ignores it).
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;               // required when device is nvme; empty = unset
  int64_t buffer_count = 5;            // 1..kMaxOffloadBufferCount
  int64_t buffer_size = 100'000'000;   // elements per buffer; >= 1
  int64_t max_in_cpu = 1'000'000'000;  // elements kept in host memory with nvme; >= 0
  bool pin_memory = true;              // default true since DeepSpeed 2026-08
};

// Stages 1-3. Below stage 3 DeepSpeed treats device nvme as cpu; outcore does the same and
// warns (swap files need stage 3).
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;     // required when device is nvme; empty = unset
  int64_t buffer_count = 4;  // 1..kMaxOffloadBufferCount
  bool pin_memory = true;
  bool pipeline_read = false;
  bool pipeline_write = false;
  bool fast_init = false;
  double ratio = 1.0;  // fraction of optimizer work on the CPU, [0, 1]; < 1 needs stage 3
  // Share of the hardware threads CPU Adam uses, (0, 1]: while it runs, the rest stay free for
  // the host's data path (gradient sums and norms, swap checksums: a pool of its own over every
  // hardware thread, zero::data_path_threads), the aio, fetch and gradient-lane threads and the
  // data loader. DeepSpeed reads it only with super_offload (default 0.8 there); here it applies
  // whenever given, and its absence means every hardware thread.
  double cpuadam_cores_perc = 1.0;
};

struct ZeroConfig {
  int stage = 0;  // 0 off, 1 optimizer state, 2 + gradients, 3 + parameters partitioned
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  AutoOr<int64_t> reduce_bucket_size{500'000'000, "zero_optimization.reduce_bucket_size"};
  bool allgather_partitions = true;
  int64_t allgather_bucket_size = 500'000'000;
  bool overlap_comm = false;  // absent in the file: true at stage 3, false otherwise
  bool load_from_fp32_weights = true;
  bool elastic_checkpoint = false;
  int64_t sub_group_size = 1'000'000'000;  // elements per optimizer step group; >= 1
  // Each stage3_* key is also accepted without the prefix ("prefetch_bucket_size").
  AutoOr<int64_t> stage3_prefetch_bucket_size{50'000'000,
                                              "zero_optimization.stage3_prefetch_bucket_size"};
  AutoOr<int64_t> stage3_param_persistence_threshold{
      100'000, "zero_optimization.stage3_param_persistence_threshold"};
  int64_t stage3_model_persistence_threshold = std::numeric_limits<int64_t>::max();
  int64_t stage3_max_live_parameters = 1'000'000'000;
  int64_t stage3_max_reuse_distance = 1'000'000'000;
  bool stage3_gather_16bit_weights_on_model_save = false;  // legacy alias: ..._fp16_...
  int64_t stage3_module_granularity_threshold = 0;
  bool stage3_use_all_reduce_for_fetch_params = false;
  bool stage3_allgather_sequential = false;
  bool round_robin_gradients = false;
  bool ignore_unused_parameters = true;
  bool use_multi_rank_bucket_allreduce = true;
  // Accepted for compatibility; outcore implements none of these and warns when they are
  // set to anything but their default.
  int64_t mics_shard_size = -1;
  int64_t zero_hpz_partition_size = 1;
  bool zero_quantized_weights = false;
  bool zero_quantized_gradients = false;
  bool zero_quantized_nontrainable_weights = false;

  // Legacy "cpu_offload": true / "cpu_offload_param": true map onto these.
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
};

// ---- aio -------------------------------------------------------------------------------

// The ranges aio::Engine accepts.
inline constexpr int64_t kMaxAioBlockSize = int64_t{1} << 30;  // 1 GiB
inline constexpr int64_t kMaxAioQueueDepth = 4096;
inline constexpr int64_t kMaxAioThreads = 256;

// Booleans may be the strings "true"/"false" (as DeepSpeed's tuning tool prints them).
struct AioConfig {
  int64_t block_size = 1'048'576;  // bytes per I/O request; a multiple of 4096, at most 1 GiB
  int64_t queue_depth = 8;         // requests in flight; 1..kMaxAioQueueDepth
  // Threads splitting each request; 1..kMaxAioThreads. Also read as "thread_count" (older
  // DeepSpeed) and "num_threads" (ds_nvme_tune's output); giving two of the names is an error.
  int64_t intra_op_parallelism = 1;
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;  // accepted; outcore has no GDS path and warns when true
};

// ---- activation_checkpointing ----------------------------------------------------------

struct ActivationCheckpointingConfig {
  bool partition_activations = false;
  bool cpu_checkpointing = false;
  bool contiguous_memory_optimization = false;  // needs partition_activations + number_...
  std::optional<int64_t> number_checkpoints;    // unset = null
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
};

// ---- outcore's own keys ("outcore" section) --------------------------------------------

// Most MiB outcore.device_memory_mb / pinned_memory_mb may give (1 PiB).
inline constexpr uint64_t kMaxMemoryMb = uint64_t{1} << 30;

struct OutcoreConfig {
  // Budget of the device in MiB, simulated or a GPU; 0 = unlimited (a GPU's own memory still
  // limits, and the planner caps the budget by its free memory).
  uint64_t device_memory_mb = 0;
  bool swap_checksum = true;  // CRC32C per swap block, checked on every read
  std::string metrics_file;   // JSON-lines metrics per step; empty = none
  // Cap of the pinned host pool (allocated whole at start, at the plan's size within the cap);
  // 0 = sized from the plan.
  uint64_t pinned_memory_mb = 0;
  std::string log_level = "info";  // trace, debug, info, warn, error, critical or off
  // Start each unit's NVMe optimizer step during the last backward of a step, as soon as its
  // gradients are final, when the multiplier without clipping is expected to hold (a second
  // copy of the optimizer state on NVMe keeps the old state until the norm confirms it).
  bool step_in_backward = false;
  // The model's compute dtype (engine/model ModelOptions::compute_dtype): "fp32", "bf16" (GEMMs
  // on bf16 operands with fp32 accumulation, as PyTorch autocast; needs bf16.enabled) or "auto"
  // (bf16 when bf16.enabled, else fp32). See compute_dtype().
  std::string compute_dtype = "auto";
};

// ---- the whole config ------------------------------------------------------------------

struct Config {
  // Batch keys: train_batch_size = train_micro_batch_size_per_gpu x
  // gradient_accumulation_steps x world_size. Unset or "auto" until resolve_auto();
  // after it, all three are set unless one stayed "auto" without a value to fill it.
  AutoOr<int64_t> train_batch_size{"train_batch_size"};
  AutoOr<int64_t> train_micro_batch_size_per_gpu{
      "train_micro_batch_size_per_gpu"};  // 1..kMaxMicroBatch
  AutoOr<int64_t> gradient_accumulation_steps{"gradient_accumulation_steps"};

  AutoOr<double> gradient_clipping{1.0, "gradient_clipping"};  // global L2 norm; 0 = off
  std::optional<int64_t> steps_per_print;  // unset = no progress line; else >= 1
  bool wall_clock_breakdown = false;
  bool memory_breakdown = false;
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;  // > 0
  bool zero_allow_untested_optimizer = false;

  FP16Config fp16;
  BF16Config bf16;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero_optimization;
  AioConfig aio;
  ActivationCheckpointingConfig activation_checkpointing;
  OutcoreConfig outcore;
};

// ---- parsing ---------------------------------------------------------------------------

// Limits on config input. Past one of them a config is a ConfigValidationError naming the
// limit, so a broken or hostile file costs time and memory linear in its size.
inline constexpr size_t kMaxConfigBytes = size_t{64} << 20;  // text / file size: 64 MiB
inline constexpr size_t kMaxConfigDepth = 256;  // objects and arrays nested in each other
// Unknown-key warnings and duplicate-key errors listed one by one; past this many, one
// more issue at the end counts the rest ("and N more unknown keys ...").
inline constexpr size_t kMaxListedPerKind = 20;

struct ParsedConfig {
  Config config;
  // One per unknown key (and per accepted-but-ignored setting), each naming its JSON
  // path, in file order; unknown keys past the first kMaxListedPerKind are counted in one
  // last warning with an empty path. Also logged with log::warn, unless the parse was told not
  // to (a library caller that hands them back, such as the Python module's estimate).
  std::vector<ConfigWarning> warnings;
};

// Parses DeepSpeed JSON text. Accepts // and /* */ comments, trailing commas, integers
// written as integral floats (2e8). `source` names the text in messages (a file path).
// Throws ConfigValidationError listing every problem: malformed JSON (with line:column),
// duplicate keys (the first kMaxListedPerKind, then a count), wrong types, out-of-range
// values, unsupported optimizer/scheduler types, fp16 and bf16 both enabled, nvme offload
// without nvme_path. Also thrown, alone: text longer than kMaxConfigBytes; nesting deeper
// than kMaxConfigDepth (with line:column); a number beyond the range of a double (1e400)
// or an integer literal beyond 64 bits (with its JSON path and line:column). Batch sizes
// are not checked here (they need the world size): see resolve_auto / resolve_batch_sizes.
// Time and memory are linear in the size of the text.
// Thread-safe (no shared state besides the logger).
ParsedConfig parse_config(std::string_view text, std::string_view source = "<config>",
                          bool log_warnings = true);

// A config a checkpoint saved (to_json of its run's Config, every key written at its value or
// default), parsed as parse_config does, less the warnings about keys written at their defaults
// that another key overrides (the optimizer's lr and betas beside a scheduler that sets them):
// the saved config writes every key, so a default value there is no user's. Non-default values
// are warned about as in any config.
ParsedConfig parse_saved_config(std::string_view text, std::string_view source,
                                bool log_warnings = true);

// Reads and parses a file. Only a regular file of at most kMaxConfigBytes is read: a
// directory, FIFO, device or socket is refused without reading from it, and a larger (or
// endless) file is refused after reading at most kMaxConfigBytes + 1 bytes. These and an
// unreadable file are a ConfigValidationError whose source() is the path, with the OS
// error or the limit (so tools report them as bad input).
ParsedConfig load_config_file(const std::string& path, bool log_warnings = true);

// The message of `e`, with "<file>: " before it when it is about a key of a DeepSpeed config (one
// of the sections and top-level keys to_json prints) and does not name `file` already: so that
// the errors of checks made once the config is parsed (the engine's placement) name the file,
// as the parse's own do. `file` empty: the message as it is.
std::string message_naming_config_file(const ConfigError& e, const std::string& file);

// ---- resolution ------------------------------------------------------------------------

// Most data-parallel ranks a config is resolved or planned for (the planner and the model
// layout count ranks in an int; past this a world size is a typo or a truncated number).
inline constexpr int64_t kMaxWorldSize = int64_t{1} << 20;
// Most sequences per micro-batch (train_micro_batch_size_per_gpu): tokens per micro-batch
// times the model's widths must stay far inside 64 bits.
inline constexpr int64_t kMaxMicroBatch = int64_t{1} << 20;

// Facts "auto" values are resolved from. Every field is optional; an "auto" whose source
// is missing stays "auto". Only "auto" values are filled: a concrete value in the file wins.
struct AutoContext {
  int64_t world_size = 1;                   // data-parallel ranks; 1..kMaxWorldSize
  std::optional<int64_t> hidden_size;       // model hidden size, for the zero bucket sizes
  std::optional<double> lr;                 // optimizer lr and warmup_max_lr
  std::optional<double> weight_decay;       // default for "auto": 0
  std::optional<double> gradient_clipping;  // default for "auto": 1.0
  std::optional<bool> fp16;                 // default for "auto": false
  std::optional<bool> bf16;                 // default for "auto": false
  std::optional<int64_t> train_batch_size;
  std::optional<int64_t> micro_batch_size;  // 1..kMaxMicroBatch
  std::optional<int64_t> gradient_accumulation_steps;
  std::optional<int64_t> total_steps;   // scheduler total_num_steps
  std::optional<int64_t> warmup_steps;  // scheduler warmup_num_steps
};

// Fills "auto" values from `ctx`:
//   batch keys <- ctx batch sizes, then resolve_batch_sizes(cfg, ctx.world_size), in which
//     a batch key still "auto" counts as not given;
//   gradient_clipping <- ctx or 1.0; fp16/bf16.enabled <- ctx or false;
//   optimizer lr <- ctx.lr; betas/eps <- DeepSpeed defaults; weight_decay <- ctx or 0;
//   scheduler warmup_min_lr <- 0, warmup_max_lr <- ctx.lr or the optimizer's lr,
//     warmup_num_steps <- ctx.warmup_steps, total_num_steps <- ctx.total_steps;
//   reduce_bucket_size <- hidden^2, stage3_prefetch_bucket_size <- 0.9 hidden^2,
//     stage3_param_persistence_threshold <- 10 hidden.
// Throws ConfigValidationError listing every inconsistency found (batch arithmetic,
// fp16+bf16 both enabled after resolution, bad ctx values). Values it cannot fill stay
// "auto"; list them with unresolved_auto().
void resolve_auto(Config& cfg, const AutoContext& ctx);

// DeepSpeed's batch arithmetic for `world_size` ranks (see reference table): infers the
// missing batch keys; a key that is "auto" counts as missing. If neither train_batch_size
// nor the micro batch is known and one of them is "auto", nothing is inferred (they stay
// "auto"). Throws ConfigValidationError when none is given, on a mismatch (the message shows
// the arithmetic: "train_batch_size 32 != micro 4 x gas 2 x world 2 = 16"), when a
// division leaves a remainder or infers a micro batch above kMaxMicroBatch, and for a
// world size outside 1..kMaxWorldSize.
void resolve_batch_sizes(Config& cfg, int64_t world_size);

// JSON paths of every value still "auto" (file order of sections), empty when none.
std::vector<std::string> unresolved_auto(const Config& cfg);

// Throws ConfigValidationError naming every value still "auto" or a batch key still unset,
// with what supplies it ("pass --lr"); call once before training starts.
void require_resolved(const Config& cfg);

// ---- output ----------------------------------------------------------------------------

// Whether the Adam moments (exp_avg, exp_avg_sq) are stored in bf16 in every tier: set by
// optimizer.params.fp32_optimizer_states: false or bf16.bf16_optimizer_states: true. Master
// weights stay fp32 either way.
bool adam_moments_bf16(const Config& cfg);

// The model's compute dtype: outcore.compute_dtype, "auto" read as bf16 when bf16.enabled and
// fp32 otherwise (parse_config refuses "bf16" without bf16.enabled).
DType compute_dtype(const Config& cfg);

// The config as DeepSpeed-compatible JSON with every section and its effective defaults.
// "auto" values print as "auto", unset optional values as null; parse_config() of the
// result gives back an equal Config. Used by `outcore config` and saved with checkpoints.
nlohmann::ordered_json to_json(const Config& cfg);

// Names as written in files: "Adam", "AdamW", "WarmupLR", "cpu", "log", ...
std::string_view to_string(OptimizerType t);
std::string_view to_string(SchedulerType t);
std::string_view to_string(OffloadDevice d);
std::string_view to_string(WarmupType t);

// ---- template out-of-line --------------------------------------------------------------

[[noreturn]] void throw_unresolved(const char* path, bool is_auto);

template <typename T>
void AutoOr<T>::throw_missing() const {
  throw_unresolved(path_, auto_);
}

}  // namespace outcore::config
