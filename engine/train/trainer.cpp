// Trainer: construction (model, data, engine, schedule, scaler) and the training loop.
#include "engine/train/trainer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>

#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "engine/comm/local_comm.hpp"
#include "engine/data/tokenize_job.hpp"
#include "engine/device/device.hpp"
#include "engine/train/checkpointing.hpp"

namespace outcore::train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// DeepSpeed enables checkpointing from the model code; a config that tunes it (or keeps
// checkpoints on the host) only makes sense with it on.
bool config_wants_checkpointing(const config::ActivationCheckpointingConfig& a) {
  return a.cpu_checkpointing || a.partition_activations || a.number_checkpoints.has_value();
}

double gb_per_s(uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

// The weights of `dir` were trained with `theirs`; refuse a model that differs in anything
// (not only shapes: rope_theta, rms_norm_eps, rope_scaling, tied embeddings change the math).
void check_same_model(const model::LlamaConfig& theirs, const model::LlamaConfig& ours,
                      const std::string& dir) {
  const nlohmann::json a = nlohmann::json::parse(theirs.to_json());
  const nlohmann::json b = nlohmann::json::parse(ours.to_json());
  for (const auto& [key, value] : a.items()) {
    const auto it = b.find(key);
    if (it == b.end() || *it != value)
      throw ConfigError(key, fmt::format("{}/config.json has {}, the model config {}: the "
                                         "weights were made for another model",
                                         dir, json_brief(value),
                                         it == b.end() ? std::string("nothing") : json_brief(*it)));
  }
}

// `p` made absolute (not normalised: "link/../x" is x beside link's target, not beside link);
// "" stays "".
std::string absolute_path(const std::string& p) {
  std::error_code ec;
  const std::filesystem::path a =
      p.empty() ? std::filesystem::path() : std::filesystem::absolute(p, ec);
  return ec ? p : a.string();
}

// The tokens of the training file a checkpoint trained on ({0, 0} when it does not say): its
// train_split, or (checkpoints before it) what its val_fraction made of its train_tokens.
TokenRange saved_train_split(const nlohmann::json& state) {
  if (const auto split = state.find("train_split"); split != state.end())
    return {split->at(0).get<size_t>(), split->at(1).get<size_t>()};
  const uint64_t tokens = state.value("train_tokens", uint64_t{0});
  const double fraction = state.value("val_fraction", 0.0);
  if (tokens == 0) return {};
  if (fraction == 0.0 || !state.value("val_data", std::string()).empty()) return {0, tokens};
  return split_tokens(tokens, fraction).train;
}

// A fingerprint of a token file's content, cheap to take on a large file: CRC32C of 16
// stretches of kStretch tokens spread over it (the first and the last among them), so that a
// file of the same length holding other tokens is told apart from the one a checkpoint trained
// on, reading at most 1 MiB of it.
uint32_t data_fingerprint(const TokenFile& f) {
  constexpr size_t kStretches = 16, kStretch = 16384;
  std::vector<int32_t> tokens;
  uint32_t crc = 0;
  const size_t n = f.size();
  for (size_t k = 0; k < kStretches; ++k) {
    const size_t len = std::min(kStretch, n);
    const size_t begin = n <= kStretch ? 0 : (n - kStretch) / (kStretches - 1) * k;
    tokens.resize(len);
    f.read(begin, tokens);
    crc = ckpt::crc32c(std::as_bytes(std::span<const int32_t>(tokens)), crc);
    if (n <= kStretch) break;
  }
  return crc;
}

// OneCycle's momentum decay raises beta1 without bound (as DeepSpeed's does): a run that would
// reach beta1 >= 1, where Adam is undefined, is refused before it starts rather than failing at
// that step. Step k uses the schedule at index k - 2; beta1 grows monotonically after the cycle.
void check_betas_through(const LrSchedule& schedule, int64_t steps) {
  auto bad = [&](int64_t i) {
    const std::optional<Betas> b = schedule.betas_at(i);
    return b && !(b->beta1 < 1.0);
  };
  if (steps < 2 || !bad(steps - 2)) return;
  int64_t lo = -1, hi = steps - 2;  // !bad(lo) (the cycle keeps beta1 < 1), bad(hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (bad(mid) ? hi : lo) = mid;
  }
  throw ConfigError(
      "scheduler.params.decay_mom_rate",
      fmt::format("OneCycle's momentum decay takes Adam's beta1 to {} at step {} of the {} steps "
                  "asked for (cycle_max_mom x (1 + decay_mom_rate x steps since the cycle / "
                  "decay_step_size)); Adam needs beta1 < 1: lower decay_mom_rate, or set "
                  "cycle_momentum to false",
                  schedule.betas_at(hi)->beta1, hi + 2, steps));
}

// A schedule that decays to 0 before the run's last step (WarmupDecayLR with warmup_min_lr 0,
// WarmupCosineLR with cos_min_ratio 0, past total_num_steps): those steps update no weight, as
// in DeepSpeed, which runs them silently. Said once at the start. The zeros of a warmup's first
// steps are not a decay: only a tail of zeros after a non-zero lr is.
void warn_lr_zero_tail(const LrSchedule& schedule, int64_t steps) {
  const int64_t last = steps - 2;  // step k uses index k - 2
  if (last < 1 || schedule.lr_at(last) != 0.0) return;
  int64_t first = last;  // of the tail of zeros; a long tail is looked back over 10^7 indices
  const int64_t stop = std::max<int64_t>(0, last - 10'000'000);
  while (first > stop && schedule.lr_at(first - 1) == 0.0) --first;
  if (first == stop) return;  // zeros from the first index, or a tail longer than looked at
  log::warn(
      "{} reaches lr 0 at step {} of the {} steps asked for: steps {} to {} update no weight "
      "(scheduler.params.total_num_steps ends the schedule)",
      schedule.name(), first + 2, steps, first + 2, steps);
}

// A decaying schedule longer than the run (total_num_steps above the steps asked for, as in a
// config written for another run): the run ends at a higher lr than the schedule's end, which
// DeepSpeed does silently. Said once at the start; "auto" makes total_num_steps the run's steps.
void warn_schedule_longer_than_run(const config::SchedulerConfig& s, const LrSchedule& schedule,
                                   int64_t steps) {
  int64_t total = 0;
  if (s.type == config::SchedulerType::kWarmupDecayLR)
    total = s.warmup.total_num_steps.value_or(0);
  else if (s.type == config::SchedulerType::kWarmupCosineLR)
    total = s.cosine.total_num_steps.value_or(0);
  if (total <= steps) return;
  // Step k uses index k - 2 (lr_schedule.hpp).
  log::warn(
      "{}: scheduler.params.total_num_steps {} is more than the {} steps asked for: the last step "
      "trains at lr {:.3g}, where the schedule decays on to lr {:.3g} at step {} (set "
      "total_num_steps to the run's steps, or to \"auto\" for that)",
      schedule.name(), total, steps, schedule.lr_at(std::max<int64_t>(-1, steps - 2)),
      schedule.lr_at(total - 2), total);
}

// A checkpoint's ds_config.json and config.json (trainer_state empty): what a save writes, and
// what the save directory's room is checked for at start.
CheckpointTexts config_texts(const config::Config& cfg, const model::LlamaConfig& model) {
  return {config::to_json(cfg).dump(2) + "\n", model.to_hf_json(), {}};
}

}  // namespace

DType param_dtype(const config::Config& cfg) {
  if (cfg.bf16.enabled.value()) return DType::BF16;
  if (cfg.fp16.enabled.value()) return DType::F16;
  return DType::F32;
}

int64_t default_seq_len(const model::LlamaConfig& model_config) {
  return std::min<int64_t>(model_config.max_position_embeddings, 1024);
}

struct Trainer::Devices {
  std::unique_ptr<device::Device> owned;
  device::Device& device;
  comm::LocalComm local, local_control;
  comm::Comm* comm;
  comm::Comm* control;
  Devices(uint64_t budget_bytes, const TrainerOptions& o)
      : owned(make_device(budget_bytes, o)),
        device(*owned),
        comm(o.comm != nullptr ? o.comm : &local),
        control(o.control_comm != nullptr ? o.control_comm : &local_control) {}

  static std::unique_ptr<device::Device> make_device(uint64_t budget_bytes,
                                                     const TrainerOptions& o) {
    if (o.device == device::DeviceKind::Cuda)
      return device::make_cuda_device({.ordinal = o.gpu, .memory_budget_bytes = budget_bytes});
    return std::make_unique<device::CpuDevice>(
        device::CpuDeviceOptions{.memory_budget_bytes = budget_bytes, .discrete = o.discrete});
  }
};

Trainer::Trainer(const config::Config& cfg, const model::LlamaConfig& model_config,
                 TrainerOptions options)
    : cfg_(cfg), opts_(std::move(options)) {
  config::require_resolved(cfg_);
  if (opts_.steps < 1) {
    throw InvalidArgument(fmt::format("steps must be >= 1, got {}", opts_.steps));
  }
  if (opts_.eval_batches < 1) {
    throw InvalidArgument(fmt::format("eval_batches must be >= 1, got {}", opts_.eval_batches));
  }
  if (opts_.eval_every < 0) {
    throw InvalidArgument(fmt::format("eval_every must be >= 0, got {}", opts_.eval_every));
  }
  model_config.validate();
  const int64_t seq_len = opts_.seq_len > 0 ? opts_.seq_len : default_seq_len(model_config);
  if (opts_.seq_len < 0 || seq_len > model_config.max_position_embeddings) {
    throw InvalidArgument(
        fmt::format("sequence length {} is outside 1..{} (the model's max_position_embeddings)",
                    opts_.seq_len, model_config.max_position_embeddings));
  }
  gas_ = cfg_.gradient_accumulation_steps.value();
  if (!opts_.resume_from.empty() && !opts_.init_from.empty())
    throw InvalidArgument("resume and init-from exclude each other: a resumed run has its weights");
  std::optional<ckpt::Checkpoint> ck;
  if (!opts_.resume_from.empty()) open_resume_checkpoint(ck, model_config, seq_len);

  if ((opts_.comm == nullptr) != (opts_.control_comm == nullptr))
    throw InvalidArgument("comm and control_comm are given together or not at all");
  if (opts_.comm != nullptr && (opts_.comm->world_size() != opts_.control_comm->world_size() ||
                                opts_.comm->rank() != opts_.control_comm->rank()))
    throw InvalidArgument("comm and control_comm must span the same ranks");
  devices_ = std::make_unique<Devices>(cfg_.outcore.device_memory_mb << 20, opts_);
  // Every rank resumes one checkpoint: each opens its own, and a run saving into a save
  // directory may move its `latest` between their openings.
  if (ck && world_size() > 1) {
    const std::vector<std::string> tags = comm::all_gather_strings(control(), ck->manifest().tag);
    if (std::any_of(tags.begin(), tags.end(), [&](const std::string& t) { return t != tags[0]; })) {
      std::string which;
      for (size_t r = 0; r < tags.size(); ++r)
        which += fmt::format("{}rank {}: {}", r == 0 ? "" : ", ", r, tags[r]);
      throw InvalidArgument(fmt::format(
          "the ranks resumed different checkpoints of {} ({}): was another run saving there? "
          "Resume again, or from one checkpoint directory",
          opts_.resume_from, which));
    }
  }
  model::ModelOptions mo;
  mo.micro_batch = cfg_.train_micro_batch_size_per_gpu.value();
  mo.seq_len = seq_len;
  mo.param_dtype = param_dtype(cfg_);
  mo.compute_dtype = config::compute_dtype(cfg_);
  mo.activation_checkpointing = opts_.activation_checkpointing.value_or(
      config_wants_checkpointing(cfg_.activation_checkpointing));
  if (!mo.activation_checkpointing && cfg_.activation_checkpointing.cpu_checkpointing) {
    // Turned off by the option (--activation-checkpointing=false): no checkpoints to keep in
    // host memory, none planned.
    if (rank() == 0)
      log::warn(
          "activation_checkpointing.cpu_checkpointing has no effect: activation checkpointing is "
          "turned off (--activation-checkpointing=false)");
    cfg_.activation_checkpointing.cpu_checkpointing = false;
  }
  mo.world_size = devices_->comm->world_size();
  mo.head_chunk_rows =
      model::head_rows_on(model_config, mo, devices_->device, cfg_.outcore.device_memory_mb << 20);
  model_ =
      std::make_unique<model::LlamaModel>(model_config, mo, device::make_backend(devices_->device));

  open_data();
  schedule_ = make_lr_schedule(cfg_);
  check_betas_through(*schedule_, opts_.steps);
  if (rank() == 0) {
    warn_lr_zero_tail(*schedule_, opts_.steps);
    warn_schedule_longer_than_run(cfg_.scheduler, *schedule_, opts_.steps);
  }
  scaler_ = make_loss_scaler(cfg_);
  // Hugging Face weights are checked against the model before any swap file exists.
  std::optional<ckpt::HfWeights> init_weights;
  if (!opts_.init_from.empty()) {
    const std::filesystem::path theirs = std::filesystem::path(opts_.init_from) / "config.json";
    if (std::filesystem::exists(theirs))
      check_same_model(model::LlamaConfig::load(theirs), model_config, opts_.init_from);
    init_weights.emplace(ckpt::HfWeights::open(opts_.init_from, model_config, param_dtype(cfg_)));
  }
  // The trace file: locked before any long work (another run writing it at its end would
  // replace this one's, or this one its).
  if (!opts_.trace_file.empty() && rank() == 0)
    trace_lock_ = std::make_unique<OutputLock>(opts_.trace_file, "trace file");
  // The metrics file: locked, and checked to be one (or nothing), before any long work.
  const std::string metrics_path =
      opts_.metrics_file.empty() ? cfg_.outcore.metrics_file : opts_.metrics_file;
  // A resumed run goes on writing its checkpoint's run's file (cut after the step resumed). A
  // file other than that one while that one is still there (another run's, perhaps) is written
  // afresh, as by a new run; where the run's file is gone (its directory moved), the file named
  // is taken for it.
  bool continues = !resumed_from_.empty();
  if (!metrics_path.empty() && continues) {
    const auto it = resume_state_.find("metrics_file");
    const std::string theirs =
        it != resume_state_.end() && it->is_string() ? it->get<std::string>() : "";
    std::error_code ec;
    if (!theirs.empty() && std::filesystem::exists(theirs, ec) &&
        !same_file(metrics_path, theirs)) {
      continues = false;
      if (rank() == 0)
        log::info(
            "metrics: {} is not the metrics file of the run that saved {} ({}): written "
            "from its start",
            metrics_path, resumed_from_, theirs);
    }
  }
  if (!metrics_path.empty() && rank() == 0) {  // rank 0 writes for the job
    if (continues) {
      MetricsResume r;
      r.step = ck ? ck->manifest().step : -1;
      if (const auto b = resume_state_.find("metrics_bytes");
          b != resume_state_.end() && b->is_number_unsigned())
        r.bytes = b->get<uint64_t>();
      if (const auto l = resume_state_.find("metrics_last_record");
          l != resume_state_.end() && l->is_string())
        r.last_record = l->get<std::string>();
      // Later checkpoints of its run beside the one resumed, and in the directory its run saved
      // into (the checkpoint resumed may be a copy elsewhere), but not those a --start-over in
      // that directory removes: this run is a branch, and their steps' records are that run's.
      std::vector<std::filesystem::path> run_dirs;
      if (ck) {
        run_dirs.push_back(ck->dir().parent_path());
        if (const auto d = resume_state_.find("save_dir");
            d != resume_state_.end() && d->is_string() && !d->get<std::string>().empty())
          run_dirs.emplace_back(d->get<std::string>());
      }
      std::vector<std::string> seen;
      for (const std::filesystem::path& run_dir : run_dirs) {
        const std::string at = resolved_path(run_dir.string());
        if (at.empty() || std::find(seen.begin(), seen.end(), at) != seen.end()) continue;
        seen.push_back(at);
        std::error_code ec;
        if (opts_.start_over && !opts_.save_dir.empty() &&
            std::filesystem::equivalent(run_dir, opts_.save_dir, ec))
          continue;
        // A save of its run killed before it was named latest is not one: the save directory
        // replaces it, and its steps' records are cut and written again, as the steps are.
        const std::optional<std::string> killed =
            ckpt::killed_save_after(run_dir, ck->dir().filename().string());
        for (const auto& [step, dir] : ckpt::checkpoints_in(run_dir))
          if (step > ck->manifest().step && dir.filename().string() != killed)
            r.later_checkpoints += (r.later_checkpoints.empty() ? "" : ", ") + dir.string();
      }
      metrics_writer_.emplace(metrics_path, r);
    } else {
      metrics_writer_.emplace(metrics_path);
    }
  }
  if (!opts_.save_dir.empty()) {
    // Rank 0 locks, checks and cleans the directory before the other ranks use it.
    ckpt::SaveDirOptions so{.keep = opts_.keep,
                            .existing = existing_checkpoints(),
                            .resumed_tag = resumed_tag_in_save_dir()};
    // Every rank has read its resumed checkpoint before rank 0's opening may move it (a
    // checkpoint read under <tag>.old goes back to <tag>).
    if (world_size() > 1 && ck) control().barrier();
    if (rank() == 0) {
      save_dir_ = std::make_unique<ckpt::SaveDir>(opts_.save_dir, so);
      save_dir_->check_can_save(ck ? ck->manifest().step + 1 : 1, opts_.steps);
    }
    if (world_size() > 1) {
      control().barrier();
      so.primary = false;
      if (rank() != 0) save_dir_ = std::make_unique<ckpt::SaveDir>(opts_.save_dir, so);
      save_group_.rank = rank();
      save_group_.world = world_size();
      save_group_.barrier = [this] { control().barrier(); };
      save_group_.all_gather = [this](const std::string& mine) {
        return comm::all_gather_strings(control(), mine);
      };
    }
  }
  // Read under <tag>.old until the save directory's opening put it back as <tag>: read there.
  if (std::error_code ec;
      ck && resumed_from_ != ck->dir().string() && !std::filesystem::exists(ck->dir(), ec)) {
    const ckpt::Manifest was = ck->manifest();
    ck.emplace(ckpt::Checkpoint::open(resumed_from_, {zero::aio_options(cfg_.aio), nullptr}));
    if (ck->manifest().tag != was.tag || ck->manifest().step != was.step)
      throw CorruptData(
          fmt::format("{}: holds step {} where {} was read before its save "
                      "directory was opened",
                      resumed_from_, ck->manifest().step, was.tag));
  }
  zero::EngineOptions eo = opts_.engine;
  if (eo.stop_requested == nullptr) eo.stop_requested = opts_.stop_requested;
  if (save_dir_) eo.save_piece_elems = opts_.checkpoint_io.piece_elems;  // planned host memory
  if (opts_.progress_out != nullptr && !eo.on_init_unit) {
    // Minutes for a large model: shown once it takes a while, a line at most every second.
    std::FILE* out = opts_.progress_out;
    const double after = opts_.init_progress_after_s;
    const Clock::time_point start = Clock::now();
    auto shown = std::make_shared<double>(-1.0);
    eo.on_init_unit = [out, after, start, shown](size_t done, size_t units) {
      const double s = seconds_since(start);
      if (s < after || (done < units && *shown >= 0 && s - *shown < 1.0)) return;
      *shown = s;
      std::fprintf(out, "initialising the training state: %zu of %zu units, %.0f s\n", done, units,
                   s);
      std::fflush(out);
    };
  }
  engine_ = std::make_unique<zero::ZeroEngine>(cfg_, *model_, devices_->device, *devices_->comm,
                                               opts_.seed, eo);
  // The swap files are in place: a save directory on the same filesystem sees what they left.
  // Before the restore or import, which can take long and do not change the free space.
  if (save_dir_ && rank() == 0)
    save_dir_->check_room(checkpoint_bytes(*engine_, world_size(), cfg_.zero_optimization.stage,
                                           opts_.checkpoint_io.piece_elems,
                                           [&] {
                                             const CheckpointTexts t =
                                                 config_texts(cfg_, model_->config());
                                             return t.ds_config.size() + t.model_config.size();
                                           }()),
                          saves_of_run(ck ? ck->manifest().step : 0), opts_.checkpoint_io);
  if (ck) {
    restore(*ck);
  } else if (init_weights) {
    import_hf_weights(*init_weights, *engine_);
  }
  last_traffic_ = engine_->traffic();
  inputs_.resize(static_cast<size_t>(model_->tokens()));
  targets_.resize(static_cast<size_t>(model_->tokens()));
}

Trainer::~Trainer() = default;

int64_t Trainer::saves_of_run(int64_t done) const {
  const int64_t last = opts_.steps, every = opts_.save_every;
  if (last <= done) return 1;
  // Every save_every steps after `done`, and at the end unless that step was one of them.
  const int64_t periodic = every > 0 ? last / every - done / every : 0;
  return periodic + (every > 0 && last % every == 0 ? 0 : 1);
}

std::string Trainer::resumed_tag_in_save_dir() const {
  if (resumed_from_.empty()) return {};
  std::filesystem::path from = resolved_path(resumed_from_);
  if (from.empty()) {  // not resolvable (an absolute path beyond PATH_MAX): as given
    from = std::filesystem::path(resumed_from_).lexically_normal();
    if (!from.has_filename()) from = from.parent_path();
  }
  std::error_code ec;
  const std::filesystem::path dir = from.has_parent_path() ? from.parent_path() : ".";
  if (!std::filesystem::equivalent(dir, opts_.save_dir, ec)) return {};
  return from.filename().string();
}

ckpt::ExistingCheckpoints Trainer::existing_checkpoints() const {
  if (opts_.start_over) return ckpt::ExistingCheckpoints::kReplace;
  // Resuming from a checkpoint of the save directory continues the run that saved it there.
  if (!resumed_tag_in_save_dir().empty()) return ckpt::ExistingCheckpoints::kContinue;
  return ckpt::ExistingCheckpoints::kRefuse;
}

const device::Device& Trainer::device() const { return devices_->device; }
int Trainer::world_size() const { return devices_->comm->world_size(); }
int Trainer::rank() const { return devices_->comm->rank(); }
comm::Comm& Trainer::comm() const { return *devices_->comm; }
comm::Comm& Trainer::control() const { return *devices_->control; }

double Trainer::sum_in_global_order(std::span<const float> values, int64_t count) const {
  const size_t w = static_cast<size_t>(world_size());
  const size_t k = values.size();
  std::vector<float> all(w * k);
  control().all_gather(values, all);
  double sum = 0;
  for (size_t i = 0; i < k; ++i)
    for (size_t r = 0; r < w; ++r)
      if (static_cast<int64_t>(i * w + r) < count) sum += all[r * k + i];
  return sum;
}

namespace {
// A token file `outcore tokenize` was killed while putting in place with its mask (its commit
// marker is beside it): the two may not belong together. InvalidArgument naming both.
void refuse_interrupted_tokenize(const std::string& path) {
  if (path.empty()) return;
  std::error_code ec;
  // Beside the name given and beside the file it names (through links).
  const std::filesystem::path real = std::filesystem::canonical(path, ec);
  for (const std::string& at : {path, ec ? path : real.string()}) {
    const std::string marker = data::tokenize_commit_marker(at);
    if (std::filesystem::exists(std::filesystem::symlink_status(marker, ec)))
      throw InvalidArgument(fmt::format(
          "{}: `outcore tokenize` was stopped while putting it and its loss mask in place ({} is "
          "there): they may not belong together; run the tokenize job again into that --out",
          path, marker));
  }
}
}  // namespace

void Trainer::open_data() {
  if (opts_.train_data.empty()) throw InvalidArgument("no training data file given");
  refuse_interrupted_tokenize(opts_.train_data);
  refuse_interrupted_tokenize(opts_.val_data);
  auto train_file =
      std::make_shared<const TokenFile>(TokenFile::open(opts_.train_data, opts_.token_format));
  auto open_mask = [](const std::string& path, const TokenFile& tokens) {
    return path.empty() ? nullptr : std::make_shared<const MaskFile>(MaskFile::open(path, tokens));
  };
  std::shared_ptr<const MaskFile> train_mask = open_mask(opts_.train_mask, *train_file);
  TokenRange train_range{0, train_file->size()};
  std::shared_ptr<const TokenFile> val_file;
  std::shared_ptr<const MaskFile> val_mask;
  TokenRange val_range;
  if (!opts_.val_data.empty()) {
    if (same_file(opts_.val_data, opts_.train_data))
      log::warn(
          "the validation data {} is the training data: the validation loss is over tokens the "
          "run trains on (--val-fraction holds out a part of it instead)",
          opts_.val_data);
    val_file =
        std::make_shared<const TokenFile>(TokenFile::open(opts_.val_data, opts_.token_format));
    val_mask = open_mask(opts_.val_mask, *val_file);
    val_range = {0, val_file->size()};
  } else if (opts_.val_fraction != 0.0) {
    TokenSplit split = split_tokens(train_file->size(), opts_.val_fraction);
    train_range = split.train;
    val_range = split.val;
    val_file = train_file;
    val_mask = train_mask;
  }
  if (!opts_.val_mask.empty() && opts_.val_data.empty()) {
    throw InvalidArgument(fmt::format(
        "a validation loss mask ({}) was given without its validation data file", opts_.val_mask));
  }
  DataLoaderOptions lo;
  lo.micro_batch = model_->options().micro_batch;
  lo.seq_len = model_->options().seq_len;
  lo.seed = opts_.seed;
  lo.shuffle = true;
  lo.rank = devices_->comm->rank();
  lo.world_size = devices_->comm->world_size();
  lo.vocab_size = static_cast<uint64_t>(model_->config().vocab_size);
  train_loader_ = std::make_unique<DataLoader>(train_file, train_range, lo, "train", train_mask);
  if (val_file) {
    // Indexed by global micro-batch: validate() has rank r read micro-batches r, r + W, ...,
    // so that the pass is the set's first n micro-batches at any world size.
    lo.shuffle = false;
    lo.rank = 0;
    lo.world_size = 1;
    val_loader_ = std::make_unique<DataLoader>(val_file, val_range, lo, "validation", val_mask);
  }
  // A pass whose micro-batches hold no trained target would have no loss to report.
  if (val_loader_ && val_loader_->has_mask() &&
      val_loader_->trained_in_first(static_cast<uint64_t>(eval_micro_batches())) == 0) {
    const uint64_t T = static_cast<uint64_t>(lo.seq_len), first = val_loader_->range().begin + 1;
    throw InvalidArgument(fmt::format(
        "the validation loss mask {} marks no target of the {} micro-batches a validation pass "
        "evaluates (tokens [{}, {}) of {}) as trained: raise --eval-batches, or mark targets "
        "there",
        val_loader_->mask()->path(), eval_micro_batches(), first,
        first + static_cast<uint64_t>(eval_micro_batches()) * lo.micro_batch * T,
        val_loader_->file().path()));
  }
  if (val_loader_ && rank() == 0 && eval_micro_batches() < opts_.eval_batches)
    log::info(
        "validation: the set holds {} micro-batches (fewer than eval_batches {}); each "
        "validation evaluates them all",
        eval_micro_batches(), opts_.eval_batches);
  if (opts_.eval_every > 0 && !val_loader_) {
    throw InvalidArgument(
        fmt::format("validation every {} steps needs a validation set (--val-data or "
                    "--val-fraction)",
                    opts_.eval_every));
  }
}

void Trainer::open_resume_checkpoint(std::optional<ckpt::Checkpoint>& ck,
                                     const model::LlamaConfig& model_config, int64_t seq_len) {
  ck.emplace(ckpt::Checkpoint::open(opts_.resume_from, {zero::aio_options(cfg_.aio), nullptr}));
  const std::string src = ck->dir().string();
  check_checkpoint_model(ck->manifest(), model::make_layout(model_config, 1), src);
  ck->verify();
  // Shapes alone would let other heads, another rope_theta or rms_norm_eps reinterpret the
  // weights: the checkpoint's model config is compared whole.
  check_same_model(
      model::LlamaConfig::from_json(ck->read_text("config.json"), src + "/config.json"),
      model_config, src);
  const std::string state_path = (ck->dir() / "trainer_state.json").string();
  resume_state_ = parse_json_file(ck->read_text("trainer_state.json"), state_path,
                                  {.max_depth = kMaxJsonFileDepth, .on_repeated_key = {}},
                                  [](const std::string& why) { throw CorruptData(why); });
  try {
    const int64_t steps_then = ck->manifest().step;  // restore() checks steps_done against it
    if (opts_.steps < steps_then)
      throw InvalidArgument(fmt::format(
          "{} is at step {}, beyond the {} steps asked for (--steps is the run's whole length, "
          "counted from its start: give more than {} to train on)",
          src, steps_then, opts_.steps, steps_then));
    const int64_t micro = resume_state_.at("micro_batch").get<int64_t>();
    const int64_t seq = resume_state_.at("seq_len").get<int64_t>();
    const int world = resume_state_.at("world_size").get<int>();
    const int64_t micro_now = cfg_.train_micro_batch_size_per_gpu.value();
    const int world_now = opts_.comm != nullptr ? opts_.comm->world_size() : 1;
    // The data position counts micro-batches of micro x world sequences: it carries over to
    // another world size when the sequences consumed fill whole micro-batches of the new one.
    const uint64_t step_in_epoch =
        resume_state_.at("data").at("step").get<uint64_t>() * static_cast<uint64_t>(world);
    if (micro != micro_now || seq != seq_len ||
        step_in_epoch % static_cast<uint64_t>(world_now) != 0) {
      // What would carry it over: the same micro-batch and sequence length, at a world size
      // that divides the micro-batches consumed.
      std::string worlds;
      for (uint64_t w = 1, shown = 0; w <= 64 && shown < 6; ++w)
        if (step_in_epoch % w == 0) worlds += (shown++ ? ", " : "") + std::to_string(w);
      if (step_in_epoch == 0) worlds = "any";
      throw InvalidArgument(fmt::format(
          "{}: saved with micro-batch {} x sequence length {} x world size {} ({} micro-batches "
          "into the epoch); this run has {} x {} x {}: the data position cannot carry over. "
          "Resume with --micro-batch-size {} --seq-len {} at a world size dividing {} ({})",
          src, micro, seq, world, step_in_epoch, micro_now, seq_len, world_now, micro, seq,
          step_in_epoch, worlds));
    }
    resume_state_["data"]["step"] = step_in_epoch / static_cast<uint64_t>(world_now);
    const int64_t gas_then = resume_state_.at("gradient_accumulation_steps").get<int64_t>();
    if (gas_then * world != gas_ * world_now)
      log::warn(
          "resuming with {} micro-batches per step (gas {} x world {}); the checkpoint used {} "
          "(gas {} x world {}): the run continues with a different batch",
          gas_ * world_now, gas_, world_now, gas_then * world, gas_then, world);
    const uint64_t seed = resume_state_.at("seed").get<uint64_t>();
    if (seed != opts_.seed)
      log::warn("resuming with the checkpoint's seed {} (data order), not {}", seed, opts_.seed);
    opts_.seed = seed;
    // The validation its run recorded last stands for this run when it is of the same set.
    const bool same_validation =
        resume_state_.value("val_data", std::string()) == absolute_path(opts_.val_data) &&
        resume_state_.value("val_mask", std::string()) == absolute_path(opts_.val_mask) &&
        resume_state_.value("val_fraction", 0.0) == opts_.val_fraction &&
        resume_state_.value("eval_batches", int64_t{0}) == opts_.eval_batches;
    validated_step_ = same_validation ? resume_state_.value("validated_step", int64_t{-1}) : -1;

  } catch (const nlohmann::json::exception& e) {  // a key missing or of another type
    throw CorruptData(fmt::format("{}: {}", state_path, e.what()));
  }
  resumed_from_ = src;
  // A checkpoint read under <tag>.old (a save killed between two renames, Checkpoint::open) in
  // the save directory is resumed as <tag>: the name the directory's opening puts it back under.
  const std::string tag = ck->manifest().tag;
  std::error_code ec;
  if (ck->dir().filename() == tag + ".old" && !opts_.save_dir.empty() &&
      std::filesystem::equivalent(ck->dir().parent_path(), opts_.save_dir, ec))
    resumed_from_ = (ck->dir().parent_path() / tag).string();
}

void Trainer::restore(const ckpt::Checkpoint& ck) {
  load_engine_checkpoint(ck, *engine_);
  const std::string state_path = (ck.dir() / "trainer_state.json").string();
  try {
    steps_done_ = resume_state_.at("steps_done").get<int64_t>();
    const nlohmann::json& adam = resume_state_.at("adam_steps");
    // Both counts agree with the manifest's step (the optimizer steps taken, skipped overflow
    // steps aside), or the file was edited: refused naming it, before any step runs.
    if (steps_done_ != ck.manifest().step || !adam.is_number_unsigned() ||
        adam.get<uint64_t>() > static_cast<uint64_t>(steps_done_))
      throw CorruptData(fmt::format(
          "{}: steps_done {} and adam_steps {} disagree with the manifest's step {} (adam_steps "
          "is at most steps_done)",
          state_path, steps_done_, json_brief(adam), ck.manifest().step));
    adam_steps_ = adam.get<uint64_t>();
    // Values the scheduler or the loss scaler refuses (bad, or not the config's) name the file.
    auto named = [&state_path](auto&& load) {
      try {
        load();
      } catch (const InvalidArgument& e) {
        throw InvalidArgument(fmt::format("{}: {}", state_path, e.what()));
      } catch (const CorruptData& e) {
        throw CorruptData(fmt::format("{}: {}", state_path, e.what()));
      }
    };
    named([&] { schedule_->load_state_json(resume_state_.at("scheduler")); });
    named([&] { scaler_.load_state_json(resume_state_.at("loss_scaler")); });
    train_loader_->seek(data_position_from_json(resume_state_.at("data")));
    const uint64_t tokens_then = resume_state_.value("train_tokens", uint64_t{0});
    const TokenRange range = train_loader_->range();
    const auto fingerprint = resume_state_.find("train_fingerprint");
    if (tokens_then != 0 && tokens_then != train_loader_->file().size()) {
      log::warn(
          "the training data {} holds {} tokens; the checkpoint was saved over {}: the data "
          "order continues from the saved position over other tokens",
          opts_.train_data, train_loader_->file().size(), tokens_then);
    } else if (fingerprint != resume_state_.end() && fingerprint->is_number_unsigned() &&
               fingerprint->get<uint64_t>() != data_fingerprint(train_loader_->file())) {
      log::warn(
          "the training data {} holds other tokens than the file the checkpoint was saved over "
          "(as many, but not the same): the data order continues from the saved position over "
          "other tokens",
          opts_.train_data);
    } else if (const TokenRange then = saved_train_split(resume_state_);
               then.end != 0 && then != range) {
      // The same file, split otherwise (--val-fraction): tokens trained on may now be
      // validation tokens, and the order runs over other sequences.
      log::warn(
          "the training split is tokens [{}, {}) of {}; the checkpoint trained on [{}, {}): the "
          "data order continues over other sequences{}",
          range.begin, range.end, opts_.train_data, then.begin, then.end,
          then.end > range.end
              ? ", and the validation loss is now partly over tokens already trained on"
              : "");
    }
  } catch (const nlohmann::json::exception& e) {
    throw CorruptData(fmt::format("{}: {}", state_path, e.what()));
  }
  last_saved_step_ = steps_done_;
}

nlohmann::ordered_json Trainer::state_json() const {
  nlohmann::ordered_json j;
  j["steps_done"] = steps_done_;
  j["adam_steps"] = adam_steps_;
  j["scheduler"] = schedule_->state_json();
  j["loss_scaler"] = scaler_.state_json();
  j["data"] = to_json(train_loader_->position());
  // What the position indexes: a resume over other tokens is told so (restore).
  j["train_tokens"] = train_loader_->file().size();
  j["train_fingerprint"] = data_fingerprint(train_loader_->file());
  j["train_split"] = {train_loader_->range().begin, train_loader_->range().end};
  j["seed"] = opts_.seed;
  j["micro_batch"] = model_->options().micro_batch;
  j["seq_len"] = model_->options().seq_len;
  j["gradient_accumulation_steps"] = gas_;
  j["world_size"] = world_size();
  // Absolute: a resume started from another directory reads the same files, not ones of the
  // same names there.
  const auto absolute = absolute_path;
  j["train_data"] = absolute(opts_.train_data);
  j["val_data"] = absolute(opts_.val_data);
  j["train_mask"] = absolute(opts_.train_mask);
  j["val_mask"] = absolute(opts_.val_mask);
  j["val_fraction"] = opts_.val_fraction;
  // How the run saves: a resume into the same save directory keeps it (outcore train). Where:
  // a resume of a copy of this checkpoint finds the run's later checkpoints there.
  j["save_dir"] = absolute(opts_.save_dir);
  j["save_every"] = opts_.save_every;
  j["keep"] = opts_.keep;
  // How it validates: a resume keeps it (outcore train).
  j["eval_every"] = opts_.eval_every;
  j["eval_batches"] = opts_.eval_batches;
  j["validated_step"] = validated_step_;
  // What the command line chose beyond the config: a resume keeps it (outcore train).
  j["activation_checkpointing"] = opts_.activation_checkpointing.value_or(false);
  j["token_format"] = std::string(to_string(opts_.token_format));
  // Where the run wrote its metrics: a resume names it when it writes none (outcore train).
  j["metrics_file"] =
      absolute(opts_.metrics_file.empty() ? cfg_.outcore.metrics_file : opts_.metrics_file);
  // Its last record and where it ends: a resume appends only to a file that still holds them.
  if (metrics_writer_ && !metrics_writer_->last_record().empty()) {
    j["metrics_bytes"] = metrics_writer_->end();
    j["metrics_last_record"] = metrics_writer_->last_record();
  }
  j["config_auto_keys"] = opts_.config_auto_keys;
  return j;
}

ckpt::SaveResult Trainer::save_checkpoint() {
  if (!save_dir_) throw InvalidArgument("save_checkpoint: no save directory was given");
  CheckpointTexts texts = config_texts(cfg_, model_->config());
  texts.trainer_state = state_json().dump(2) + "\n";
  ckpt::WriterOptions wo = opts_.checkpoint_io;
  wo.aio = zero::aio_options(cfg_.aio);
  if (world_size() > 1) wo.group = &save_group_;
  ckpt::SaveResult r =
      save_engine_checkpoint(*save_dir_, ckpt::tag_for_step(steps_done_), steps_done_, *engine_,
                             rank(), world_size(), cfg_.zero_optimization.stage, texts, wo);
  last_saved_step_ = steps_done_;
  last_traffic_ = engine_->traffic();  // the save's reads and writes are no step's
  return r;
}

bool Trainer::has_validation() const { return val_loader_ != nullptr; }

StepMetrics Trainer::train_step(bool wait_for_update) {
  OUTCORE_TRACE_SPAN("step", "step", {.index = static_cast<int32_t>(steps_done_ + 1)});
  const Clock::time_point t0 = Clock::now();
  const double scale = scaler_.scale();
  // The mean over every rank's micro-batches: 1/world is part of the loss scale. With a loss
  // mask, the mean over the step's trained targets (every rank's, counted alike on each):
  // each micro-batch's head divides by B*T, so the scale carries B*T / trained.
  const int64_t micro_batches = gas_ * world_size();
  const auto all_targets = static_cast<uint64_t>(tokens_per_step());
  uint64_t trained = 0;
  DataPosition at = train_loader_->position();
  for (int64_t k = 0; k < gas_; ++k, at = train_loader_->advanced(at))
    trained += train_loader_->trained_targets_all_ranks(at);
  const double per_token = static_cast<double>(model_->tokens()) / static_cast<double>(trained);
  const float micro_scale =
      trained == all_targets ? static_cast<float>(scale / static_cast<double>(micro_batches))
      : trained == 0         ? 0.0f  // every target masked: nothing to learn from this step
                             : static_cast<float>(scale * per_token);
  std::vector<float> losses(static_cast<size_t>(gas_));
  const double lr = schedule_->lr();
  zero::StepParams sp = zero::step_params(cfg_, lr, adam_steps_ + 1, scale);
  if (std::optional<Betas> b = schedule_->betas()) {
    sp.beta1 = b->beta1;
    sp.beta2 = b->beta2;
  }
  for (int64_t k = 0; k < gas_; ++k) {
    train_loader_->next(inputs_, targets_);
    if (k == gas_ - 1) engine_->expect_step(sp);  // outcore.step_in_backward
    losses[k] = engine_->forward_backward(inputs_.data(), targets_.data(), micro_scale, k == 0);
  }
  const double loss_sum = sum_in_global_order(losses, micro_batches);
  if (!std::isfinite(loss_sum) && !sp.check_overflow) {
    // Nothing would skip this update: stop before non-finite gradients reach the weights.
    throw Error(fmt::format(
        "step {}: the training loss is {} and no overflow check guards this precision ({}); "
        "the weights were not updated (lower the learning rate, or resume from a checkpoint)",
        steps_done_ + 1, loss_sum, dtype_name(model_->options().param_dtype)));
  }
  const zero::StepResult r = [&] {
    OUTCORE_TRACE_SPAN("optimizer step", "step");
    return engine_->step(sp);
  }();
  const LossScaleUpdate u = scaler_.update(r.overflow);
  if (!r.overflow) {
    schedule_->step();
    ++adam_steps_;
  }
  ++steps_done_;
  const bool bf16 = cfg_.bf16.enabled.value();
  last_message_ = !r.overflow ? std::string()
                  : bf16      ? std::string(
                                    "OVERFLOW! Skipping step (bf16: the gradients are "
                                         "not finite; bf16.check_grad_overflow).")
                  : u.message.empty() ? std::string("OVERFLOW! Skipping step")
                                      : u.message;
  // With no loss scale to lower (bf16, or a static fp16 scale) the skipped steps differ only in
  // their batches: so many in a row mean a diverged run, or weights holding inf or NaN.
  skipped_in_a_row_ = r.overflow ? skipped_in_a_row_ + 1 : 0;
  if (!scaler_.dynamic() && skipped_in_a_row_ >= kMaxSkippedInARow)
    throw Error(fmt::format(
        "step {}: the gradients were not finite in {} steps in a row ({} to {}), each skipped "
        "by the overflow check with {}: the run has diverged, or the weights hold inf or NaN; "
        "they are those before step {} (lower the learning rate, check the initial weights, or "
        "resume from a checkpoint)",
        steps_done_, skipped_in_a_row_, steps_done_ - skipped_in_a_row_ + 1, steps_done_,
        bf16 ? "no loss scale to lower (bf16)" : "a static loss scale (fp16.loss_scale)",
        steps_done_ - skipped_in_a_row_ + 1));

  if (wait_for_update) {
    OUTCORE_TRACE_SPAN("update wait", "step");
    engine_->wait_step();
  }
  StepMetrics m;
  m.step = steps_done_;
  m.total_steps = opts_.steps;
  m.loss = trained == all_targets ? loss_sum / static_cast<double>(micro_batches)
           : trained == 0         ? 0.0
                                  : loss_sum * per_token;
  m.tokens = static_cast<int64_t>(all_targets);
  m.tokens_trained = static_cast<int64_t>(trained);
  m.masked = train_loader_->has_mask();
  m.lr = lr;
  if (schedule_->betas()) m.beta1 = sp.beta1;
  m.step_time_s = seconds_since(t0);
  const double tokens = static_cast<double>(tokens_per_step());
  m.tokens_per_s = m.step_time_s > 0 ? tokens / m.step_time_s : 0;
  m.gflops_per_s =
      m.tokens_per_s * model_->config().train_flops_per_token(model_->options().seq_len) / 1e9;
  m.device_mem_peak_bytes = engine_->memory().device_peak_bytes;
  if (!r.overflow) m.grad_norm = r.grad_norm;
  if (cfg_.fp16.enabled.value()) m.loss_scale = scale;
  m.skipped = r.overflow;
  switch (r.in_backward) {
    case zero::StepResult::InBackward::kNone:
      break;
    case zero::StepResult::InBackward::kCommitted:
      m.in_backward = "committed";
      break;
    case zero::StepResult::InBackward::kRedone:
      m.in_backward = "redone";
      break;
    case zero::StepResult::InBackward::kRestored:
      m.in_backward = "restored";
      break;
  }

  const zero::TrafficStats now = engine_->traffic();
  const zero::Placement& p = engine_->plan().placement;
  if (p.params == zero::Tier::kNvme || p.optimizer == zero::Tier::kNvme) {
    m.io.push_back(
        {"nvme", gb_per_s(now.nvme_read_bytes - last_traffic_.nvme_read_bytes, m.step_time_s),
         gb_per_s(now.nvme_write_bytes - last_traffic_.nvme_write_bytes, m.step_time_s)});
  }
  if (p.params != zero::Tier::kDevice || p.optimizer != zero::Tier::kDevice ||
      p.gradients != zero::Tier::kDevice) {
    // "host": read = host -> device copies, write = device -> host copies.
    m.io.push_back({"host", gb_per_s(now.h2d_bytes - last_traffic_.h2d_bytes, m.step_time_s),
                    gb_per_s(now.d2h_bytes - last_traffic_.d2h_bytes, m.step_time_s)});
  }
  last_traffic_ = now;
  return m;
}

ValidationMetrics Trainer::validate() {
  if (!val_loader_) throw InvalidArgument("validate: there is no validation set");
  OUTCORE_TRACE_SPAN("validate", "step");
  const Clock::time_point t0 = Clock::now();
  // The first n micro-batches of the set, whatever the world size: rank r evaluates global
  // micro-batches r, r + W, ... (every rank the same count: evaluation is collective; a rank
  // past the n-th evaluates the first again, left out of the sums).
  const int64_t w = world_size();
  const int64_t n = eval_micro_batches();
  std::vector<float> losses(static_cast<size_t>((n + w - 1) / w));
  std::vector<float> trained(losses.size());  // exact: at most B*T < 2^24 each
  for (size_t i = 0; i < losses.size(); ++i) {
    const int64_t g = static_cast<int64_t>(i) * w + rank();
    val_loader_->seek({0, static_cast<uint64_t>(g < n ? g : 0)});
    trained[i] = static_cast<float>(val_loader_->trained_targets(val_loader_->position()));
    val_loader_->next(inputs_, targets_);
    losses[i] = engine_->evaluate(inputs_.data(), targets_.data());
  }
  ValidationMetrics v;
  v.step = steps_done_;
  v.tokens = n * model_->tokens();
  v.tokens_trained = static_cast<int64_t>(sum_in_global_order(trained, n));
  v.masked = val_loader_->has_mask();
  // Each micro-batch's loss is a mean over its B*T rows, a masked row counting 0. open_data
  // refuses a mask that leaves a pass no trained target: NaN (never a perfect 0) if one did.
  v.loss = v.tokens_trained == v.tokens ? sum_in_global_order(losses, n) / static_cast<double>(n)
           : v.tokens_trained == 0
               ? std::numeric_limits<double>::quiet_NaN()
               : sum_in_global_order(losses, n) * static_cast<double>(model_->tokens()) /
                     static_cast<double>(v.tokens_trained);
  v.time_s = seconds_since(t0);
  // Its parameter reads are no step's (nor the last step's optimizer work, where that step did
  // not wait for it: run()'s steps do).
  last_traffic_ = engine_->traffic();
  return v;
}

int64_t Trainer::eval_micro_batches() const {
  return std::min<int64_t>(
      opts_.eval_batches,
      static_cast<int64_t>(val_loader_->sequences() / val_loader_->options().micro_batch));
}

int64_t Trainer::tokens_per_step() const { return model_->tokens() * gas_ * world_size(); }

bool Trainer::stop_requested() const {
  float stop =
      opts_.stop_requested != nullptr && opts_.stop_requested->load(std::memory_order_relaxed)
          ? 1.0f
          : 0.0f;
  if (world_size() > 1) control().all_reduce(std::span<float>(&stop, 1), comm::ReduceOp::kMax);
  return stop != 0.0f;
}

// Stops tracing and writes the file, with the overlap figures in its otherData.
static TrainResult::Trace write_trace(const std::string& path) {
  trace::stop();
  const TrainResult::Trace t = [&] {  // the copy of the events goes before write_json makes its own
    const std::vector<trace::Event> events = trace::events();
    return TrainResult::Trace{path, events.size(), trace::io_overlap(events, {"compute"}),
                              trace::io_overlap(events, {"compute", "optimizer"})};
  }();
  trace::write_json(
      path, {fmt::format("\"io_busy_s\": {:.6f}", t.under_compute.io_busy_s),
             fmt::format("\"io_hidden_under_compute\": {:.6f}", t.under_compute.hidden_fraction),
             fmt::format("\"io_hidden_under_compute_or_optimizer\": {:.6f}",
                         t.under_compute_or_optimizer.hidden_fraction)});
  return t;
}

TrainResult Trainer::run() {
  const bool tracing = !opts_.trace_file.empty() && rank() == 0;
  struct StopTrace {
    bool on;
    ~StopTrace() {
      if (on) trace::stop();
    }
  } stop_trace{tracing};
  if (tracing) {
    trace::name_thread("trainer");
    trace::start();
  }
  try {
    return run_steps(tracing);
  } catch (...) {
    // The trace is most wanted when the run fails: written up to the failure (a file at the
    // path from an earlier run would otherwise pass for this one's).
    if (tracing) {
      try {
        const TrainResult::Trace t = write_trace(opts_.trace_file);
        log::warn("trace of the run up to its failure written to {} ({} events)", t.path, t.events);
      } catch (const std::exception& e) {
        log::warn("trace: {}; no trace of the failed run was written", e.what());
      }
    }
    throw;
  }
}

TrainResult Trainer::run_steps(bool tracing) {
  std::optional<ProgressDisplay> display;
  const int64_t print_every = cfg_.steps_per_print.value_or(0);
  if (opts_.progress_out != nullptr) {
    display.emplace(opts_.progress_out, opts_.progress_mode, print_every);
  }
  std::optional<MetricsWriter>& writer = metrics_writer_;
  if (writer) writer->write_json(start_record());

  TrainResult res;
  // A record that cannot be written ends the metrics, not the run (its state is sound, and a
  // full log partition must not cost the steps since the last checkpoint).
  auto record = [&](const auto& m) {
    if (!writer) return;
    try {
      writer->write(m);
    } catch (const Error& e) {
      res.metrics_error = e.what();
      log::warn("metrics: {}; no more records are written to {}, and training goes on", e.what(),
                writer->path());
      writer.reset();
    }
  };
  const Clock::time_point t0 = Clock::now();
  // validated_step_: a resume whose checkpoint's run validated its step on the same set does
  // not validate it again (a second record of it would be a duplicate).
  auto run_validation = [&] {
    ValidationMetrics v = validate();
    res.final_val_loss = v.loss;
    validated_step_ = v.step;
    if (display) display->validation(v);
    record(v);
  };

  auto save = [&] {
    ckpt::SaveResult r;
    const std::optional<std::string> latest_before = save_dir_->latest();
    const bool there_before =
        ckpt::is_checkpoint_dir(save_dir_->path() / ckpt::tag_for_step(steps_done_));
    try {
      r = save_checkpoint();
    } catch (const Error& e) {
      // What failed, and what the user still has.
      const std::string tag = ckpt::tag_for_step(steps_done_);
      if (!save_dir_->still_here())  // what is at its name now is not this run's
        throw Error(fmt::format(
            "checkpoint {} not saved: {} is no longer the save directory this run locked "
            "(moved, removed or replaced since the run started); nothing was saved into or "
            "pruned from what is there now, and the run's earlier checkpoints are where its "
            "directory went",
            tag, save_dir_->path().string()));
      const std::optional<std::string> kept = save_dir_->latest();
      if (kept == tag && latest_before != tag)  // named latest by this save; what came after failed
        throw Error(fmt::format(
            "checkpoint {} in {} is written and latest names it, but its save did not complete: "
            "{} (it may not survive a crash of the machine; check the drive)",
            tag, save_dir_->path().string(), e.what()));
      // The first save, written but not named latest: a resume of the directory reads it.
      if (!kept && !there_before && ckpt::is_checkpoint_dir(save_dir_->path() / tag))
        throw Error(fmt::format(
            "checkpoint {} is written into {}, but its save did not complete: {}; --resume {} "
            "reads it (check the drive: it may not survive a crash of the machine)",
            tag, save_dir_->path().string(), e.what(), save_dir_->path().string()));
      // With --start-over, until this run's first save, latest names the replaced run's.
      const bool theirs =
          kept && opts_.start_over && res.checkpoints.empty() && resumed_tag_in_save_dir() != *kept;
      throw Error(fmt::format(
          "checkpoint {} not saved into {}: {}; {}", tag, save_dir_->path().string(), e.what(),
          !kept    ? std::string("no earlier checkpoint exists")
          : theirs ? fmt::format("{}, the checkpoint latest names, of the run this one starts "
                                 "over, is intact (--start-over removes that run's checkpoints "
                                 "once this run has saved one)",
                                 *kept)
                   : fmt::format("the previous checkpoint {} is intact", *kept)));
    }
    const std::string msg =
        fmt::format("saved checkpoint {} ({:.1f} MB in {:.2f} s, {:.2f} GB/s)", r.path.string(),
                    static_cast<double>(r.bytes) / 1e6, r.seconds,
                    r.seconds > 0 ? static_cast<double>(r.bytes) / r.seconds / 1e9 : 0.0);
    if (display) {
      display->message(msg);
    } else if (rank() == 0) {  // rank 0 speaks for the job
      log::info("{}", msg);
    }
    res.checkpoints.push_back(std::move(r));
  };

  while (steps_done_ < opts_.steps) {
    const int64_t next = steps_done_ + 1;
    const bool validates = val_loader_ && opts_.eval_every > 0 && next % opts_.eval_every == 0;
    const bool saves = save_dir_ && opts_.save_every > 0 && next % opts_.save_every == 0;
    StepMetrics m = train_step(validates || saves || next >= opts_.steps);
    m.elapsed_s = seconds_since(t0);
    res.steps += 1;
    res.losses.push_back(m.loss);
    res.targets.push_back(m.tokens_trained);
    res.tokens += static_cast<uint64_t>(tokens_per_step());
    res.wall_s += m.step_time_s;
    if (m.skipped) ++res.skipped_steps;
    if (m.in_backward == "committed") ++res.in_backward_committed;
    if (m.in_backward == "redone") ++res.in_backward_redone;
    if (m.in_backward == "restored") ++res.in_backward_restored;
    if (display) {
      if (m.skipped) display->message(fmt::format("step {}: {}", m.step, last_message_));
      display->step(m);  // which lines stay (steps_per_print) is the display's to decide
    } else if (m.skipped) {
      log::warn("step {}: {}", m.step, last_message_);
    }
    record(m);
    if (opts_.on_step) opts_.on_step(m);
    if (val_loader_ && opts_.eval_every > 0 && m.step % opts_.eval_every == 0) run_validation();
    if (save_dir_ && opts_.save_every > 0 && m.step % opts_.save_every == 0) save();
    if (steps_done_ < opts_.steps && stop_requested()) {
      res.stopped = true;
      if (display) display->message(fmt::format("stopped after step {} (interrupted)", m.step));
      break;
    }
  }
  if (val_loader_ && !res.stopped && validated_step_ != steps_done_) run_validation();
  if (save_dir_ && last_saved_step_ != steps_done_) save();
  // The last step's overlapped work (Adam under the next forward, its writes) ends here: its
  // failure fails the run, and the traffic read below includes it.
  engine_->wait_step();

  if (display) display->finish();
  if (writer) {
    try {
      writer->close();
    } catch (const Error& e) {
      res.metrics_error = e.what();
    }
  }
  res.tokens_per_s = res.wall_s > 0 ? static_cast<double>(res.tokens) / res.wall_s : 0;
  res.gflops_per_s =
      res.tokens_per_s * model_->config().train_flops_per_token(model_->options().seq_len) / 1e9;
  res.memory = engine_->memory();
  res.traffic = engine_->traffic();
  if (tracing) {
    try {
      res.trace = write_trace(opts_.trace_file);
    } catch (const Error& e) {  // a full disk: the run's result still stands
      res.trace_error = e.what();
    }
  }
  return res;
}

}  // namespace outcore::train
