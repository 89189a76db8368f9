// `outcore estimate --config ds.json --model config.json [--micro-batch B] [--seq-len T]
// [--world-size W] [--activation-checkpointing] [--device auto|cpu|cuda] [--gpu-memory-gb G]`:
// the placement plan of this config and model (bytes each tier holds at its peak, bytes moved
// per optimizer step) against what this machine offers, computed as `outcore train` computes
// it; on a GPU, its free memory (cudaMemGetInfo) caps the device budget as it does in training
// (--gpu-memory-gb: a GPU of G GiB free that need not be here, e.g. one to rent, with the CUDA
// backend's workspaces as on a real one; --host-memory-gb and --nvme-free-gb: that machine's
// host memory and swap space instead of this one's). Exit 0 when it fits,
// 2 when it does not (the reason on stderr, as `outcore train` refuses it) or on bad input.
// Then what bounds a step (engine/zero/step_bounds.hpp): its compute, the GEMMs at the GEMM rate
// measured here on the device (or --gemm-tflops) and the attention at the rate of the model's
// attention measured there (or --attention-tflops; at the GEMM rate for a GPU that is not here
// and no flag, said), its host<->device copies at the PCIe rate measured on a GPU (or --pcie-gbps),
// its NVMe bytes at the drive's rates (--drive-read-gbps and --drive-write-gbps, else measured
// here under the config's nvme_path with its aio settings, see measure_drive), which one is
// largest, and the smallest micro-batch and
// gradient_accumulation_steps that put the transfers under compute within the device budget.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <new>
#include <optional>
#include <string>

#include "aio/aio.hpp"
#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "engine/config/config.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/device.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/plan.hpp"
#include "engine/zero/step_bounds.hpp"
#include "engine/zero/zero.hpp"
#include "tools/aio_bench/measure.hpp"
#include "tools/outcore/commands.hpp"
#include "tools/outcore/launch.hpp"
#include "tools/outcore/swap_path.hpp"

namespace outcore::cli {
namespace {

// Numbers arrive as text and are checked here, so bad values exit 2 like any bad input.
struct EstimateArgs {
  std::string config_file, model_file, micro_batch, seq_len, world_size;
  double gemm_tflops = 0, attention_tflops = 0, pcie_gbps = 0, drive_read_gbps = 0,
         drive_write_gbps = 0, cpu_adam_gelems = 0;
  double gpu_memory_gb = 0;  // > 0: plan for a GPU with this much free memory, here or not
  // > 0: the host memory / swap space of the machine planned for, instead of this one's
  double host_memory_gb = 0, nvme_free_gb = 0;
  std::string device = "auto";
  bool activation_checkpointing = false;
};

struct EstimateOptions {
  std::string config_file;
  std::string model_file;
  int64_t micro_batch = 0;  // 0: the config's train_micro_batch_size_per_gpu, else 1
  int64_t seq_len = 0;      // 0: min(max_position_embeddings, 1024)
  int64_t world_size = 1;
};

// An integer in 1..max from `text` (empty: `fallback`), read as 64 bits so that no value
// wraps into range. Throws InvalidArgument naming `flag` and the range.
int64_t positive(const std::string& text, const char* flag, int64_t fallback, int64_t max) {
  if (text.empty()) return fallback;
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || ptr != end || v < 1 || v > max)
    throw InvalidArgument(std::string(flag) + ": got \"" + text + "\"; allowed: an integer in 1.." +
                          std::to_string(max));
  return v;
}

// A rate or size flag: a finite number from `min` to `max` (so that a step's time is a number
// of seconds, not zero, infinite or 300 digits long, and a GPU's bytes a whole number above 0
// that fits in 64 bits; CLI::Range would let "nan" through).
CLI::Validator finite_in(double min, double max, const char* unit) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        double v = 0;
        // Decimal only: strtod (under lexical_cast) would read 0x10 as 16.
        const bool decimal = text.find_first_of("xX") == std::string::npos;
        if (decimal && CLI::detail::lexical_cast(text, v) && std::isfinite(v) && v >= min &&
            v <= max)
          return {};
        return fmt::format("got \"{}\"; allowed: {} from {:g} to {:g}", text, unit, min, max);
      },
      fmt::format("{} in [{:g}, {:g}]", unit, min, max));
}

// Where each rate comes from: a flag or a measurement, in words.
struct RateSources {
  std::string gemm = "--gemm-tflops", attention = "--attention-tflops", pcie = "--pcie-gbps",
              adam = "--cpu-adam-gelems", drive = "--drive-read-gbps, --drive-write-gbps";
  std::string drive_unknown;  // why the drive was not measured (the drive's line says it)
};

// The swap directory whose drive bounds the step: the optimizer state's when it is on NVMe
// (most of the bytes), else the parameters'.
std::string swap_dir_of(const zero::Plan& plan) {
  return plan.optimizer_nvme_path.empty() ? plan.param_nvme_path : plan.optimizer_nvme_path;
}

// The drive under `nvme_path` at the swap's aio settings `opt`: one pass of writes, then one
// of reads, over a file of `bytes`, streamed as the swap streams (aio_bench's measure_engine),
// in `nvme_path` or, while training has yet to create it, its nearest existing parent (`dir`
// says which). The file is unlinked as soon as it is open, so nothing is left whatever ends
// the process. Where the file system refuses O_DIRECT (the swap files fall back to buffered
// I/O too) the writes are timed through fdatasync and the cache dropped before the reads
// (`buffered`). nullopt, with the reason in `why`, where no such directory is writable here or
// it lacks twice `bytes` of free space.
struct DriveRates {
  double read_bytes = 0, write_bytes = 0;
  std::string dir;
  bool buffered = false;
};
std::optional<DriveRates> measure_drive(const std::string& nvme_path, const aio::Options& opt,
                                        uint64_t bytes, std::string& why) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // Up to the nearest part that is there (a dangling link or an unreadable part stops the walk:
  // training could not create the directory through it either).
  const fs::path at = nvme_path.empty() ? fs::path() : nearest_existing_part(nvme_path).path;
  const std::string dir = at.string();
  if (at.empty() || !fs::is_directory(at, ec) || ::access(dir.c_str(), W_OK | X_OK) != 0) {
    why = fmt::format("nvme_path {} is not a writable directory here", nvme_path);
    return std::nullopt;
  }
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0 ||
      static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize < 2 * bytes) {
    why = fmt::format("{} has less than {} free to measure the drive with", dir,
                      zero::format_bytes(2 * bytes));
    return std::nullopt;
  }
  const fs::path path = at / fmt::format(".outcore-estimate-drive.{}.tmp", ::getpid());
  aio::File file =
      aio::File::open(path, {.access = aio::Access::kReadWrite, .create = true, .exclusive = true});
  ::unlink(path.c_str());
  file.preallocate(bytes);
  AlignedBuffer buffer(size_t{32} << 20);
  const std::span<std::byte> span(buffer.data(), buffer.size());
  const aio_bench::Result w = aio_bench::measure_engine(
      file, span, opt, {.write = true, .file_size = bytes, .register_buffer = false}, nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  if (!file.direct()) file.fdatasync();
  const std::chrono::duration<double> synced = std::chrono::steady_clock::now() - t0;
  if (!file.direct()) ::posix_fadvise(file.fd(), 0, 0, POSIX_FADV_DONTNEED);
  const aio_bench::Result r = aio_bench::measure_engine(
      file, span, opt, {.write = false, .file_size = bytes, .register_buffer = false}, nullptr);
  return DriveRates{.read_bytes = r.gbps * 1e9,
                    .write_bytes = static_cast<double>(w.bytes) / (w.seconds + synced.count()),
                    .dir = dir,
                    .buffered = !file.direct()};
}

void print_bounds(const zero::StepTimes& t, const zero::Plan& plan, const zero::LinkRates& r,
                  const RateSources& src) {
  std::printf("\nstep bounds (per rank and optimizer step: micro-batches %lld x %lld tokens)\n",
              static_cast<long long>(plan.micro_batches_per_step),
              static_cast<long long>(plan.tokens_per_micro_batch));
  std::printf("  compute  %8.3f s   %.3g TFLOP: GEMMs %.3f s, attention %.3f s\n", t.compute_s,
              t.flops / 1e12, t.gemm_s, t.attention_s);
  std::printf("    GEMMs     %.3g TFLOP at %.3g TFLOP/s (%s)\n",
              (t.flops - t.attention_flops) / 1e12, r.gemm_flops / 1e12, src.gemm.c_str());
  std::printf("    attention %.3g TFLOP at %.3g TFLOP/s (%s)\n", t.attention_flops / 1e12,
              (r.attention_flops > 0 ? r.attention_flops : r.gemm_flops) / 1e12,
              src.attention.c_str());
  if (r.pcie_bytes > 0)
    std::printf("  PCIe     %8.3f s   %s at %.1f GB/s (%s)\n", t.pcie_s,
                zero::format_bytes(plan.per_step.h2d + plan.per_step.d2h).c_str(),
                r.pcie_bytes / 1e9, src.pcie.c_str());
  else
    std::printf("  PCIe        none    (the device is host memory)\n");
  const uint64_t nvme = plan.per_step.nvme_read + plan.per_step.nvme_write;
  if (nvme == 0)
    std::printf("  drive       none    (no swap files)\n");
  else if (!t.drive_known)
    std::printf(
        "  drive     unknown   %s read, %s written%s: give --drive-read-gbps and "
        "--drive-write-gbps (`aio_bench --path DIR` measures them)\n",
        zero::format_bytes(plan.per_step.nvme_read).c_str(),
        zero::format_bytes(plan.per_step.nvme_write).c_str(),
        src.drive_unknown.empty() ? "" : (" (" + src.drive_unknown + ")").c_str());
  else
    std::printf("  drive    %8.3f s   %s read at %.2f GB/s, %s written at %.2f GB/s (%s)\n",
                t.drive_s, zero::format_bytes(plan.per_step.nvme_read).c_str(),
                r.drive_read_bytes / 1e9, zero::format_bytes(plan.per_step.nvme_write).c_str(),
                r.drive_write_bytes / 1e9, src.drive.c_str());
  if (r.adam_elems > 0)
    std::printf("  CPU Adam %8.3f s   %.4g G elements at %.3g G elements/s (%s); %s\n", t.adam_s,
                static_cast<double>(t.adam_elems) / 1e9, r.adam_elems / 1e9, src.adam.c_str(),
                plan.step_in_backward
                    ? "it runs during the backward of the step's last micro-batch "
                      "(outcore.step_in_backward), and what is left of it under the next "
                      "step's first forward"
                    : "it runs under the next step's first forward, which waits for it");
  if (plan.world_size > 1)
    std::printf(
        "  network  not counted  %s per rank sent to the other %d ranks each step: no rate is "
        "measured for it, and the bound below leaves it out\n",
        zero::format_bytes(plan.per_step.comm).c_str(), plan.world_size - 1);
  std::printf("  bound    %8.3f s   %s%s\n", t.bound_s(), t.bound().c_str(),
              t.drive_known ? "" : " (without the drive)");
}

// A suggestion is printed only for a gain its line can show: at least 1% of what it improves and
// a millisecond (each time is printed to the millisecond, so the two figures differ).
bool noticeably_less(double now_s, double was_s) {
  return was_s - now_s >= std::max(0.001, 0.01 * was_s);
}

// The step of `changed` (the config with one setting changed) at the plan's batch shape (and the
// model's head rows), on the same device and rates; nullopt when it does not fit.
std::optional<zero::StepTimes> times_with(const config::Config& changed,
                                          const model::LlamaModel& model, const zero::Plan& plan,
                                          const zero::PlanOptions& po,
                                          const zero::LinkRates& rates) {
  return zero::shape_times(changed, model.config(), model.options(), model.options().micro_batch,
                           plan.micro_batches_per_step, po, po.device_limit_bytes, 0, rates);
}

// Stage 3 reads the parameters in swap files twice per micro-batch (forward and backward).
// Where the drive bounds the step and every parameter partition would fit in host memory, says
// so: offload_param.max_in_cpu covering them all drops those reads (as in DeepSpeed, the
// partitions then stay in pinned host memory).
void print_params_in_host_memory(const config::Config& cfg, const model::LlamaModel& model,
                                 const zero::Plan& plan, const zero::StepTimes& t,
                                 const zero::PlanOptions& po, const zero::LinkRates& rates) {
  if (plan.param_nvme_bytes == 0 || t.bound() != "drive") return;
  config::Config all = cfg;
  uint64_t elements = 0;
  for (const model::UnitLayout& u : model.layout().units) elements += u.padded_numel;
  all.zero_optimization.offload_param.max_in_cpu = static_cast<int64_t>(elements);
  const auto times = times_with(all, model, plan, po, rates);
  if (!times || !noticeably_less(times->drive_s, t.drive_s)) return;
  std::printf(
      "  with offload_param.max_in_cpu %llu (every parameter partition in host memory, which "
      "fits): drive %.3f s instead of %.3f s, bound %.3f s (%s)\n",
      static_cast<unsigned long long>(elements), times->drive_s, t.drive_s, times->bound_s(),
      times->bound().c_str());
}

// Stage 3 gathers a unit's parameters again whenever stage3_max_live_parameters or
// stage3_max_reuse_distance let its slab go between two uses, in every micro-batch. Where a
// transfer bounds the step, says what both raised would give (the live cap to the model's
// elements, the reuse distance to twice that, longer than any pass): every
// gathered slab the device memory holds (the plan gives them what is left before the gradient
// sums) stays there through the step's micro-batches, each crossing once per step.
void print_params_kept_on_device(const config::Config& cfg, const model::LlamaModel& model,
                                 const zero::Plan& plan, const zero::StepTimes& t,
                                 const zero::PlanOptions& po, const zero::LinkRates& rates) {
  const config::ZeroConfig& z = cfg.zero_optimization;
  if (z.stage != 3 || t.bound() == "compute") return;
  uint64_t elements = 0;
  for (const model::UnitLayout& u : model.layout().units) elements += u.padded_numel;
  // Every slab at once; a reuse distance longer than a pass, which needs each unit at most
  // twice (forward and backward).
  const auto live = static_cast<int64_t>(elements);
  const auto reuse = static_cast<int64_t>(2 * elements);
  if (z.stage3_max_live_parameters >= live && z.stage3_max_reuse_distance >= reuse) return;
  config::Config kept = cfg;
  kept.zero_optimization.stage3_max_live_parameters = std::max(z.stage3_max_live_parameters, live);
  kept.zero_optimization.stage3_max_reuse_distance = std::max(z.stage3_max_reuse_distance, reuse);
  const auto times = times_with(kept, model, plan, po, rates);
  if (!times || !noticeably_less(times->bound_s(), t.bound_s())) return;
  const std::string pcie = rates.pcie_bytes > 0 ? fmt::format("PCIe {:.3f} s instead of {:.3f} s, ",
                                                              times->pcie_s, t.pcie_s)
                                                : std::string();
  std::printf(
      "  with stage3_max_live_parameters %lld and stage3_max_reuse_distance %lld (the gathered "
      "parameters kept on the device through the step's micro-batches, as far as its memory "
      "holds them): %sdrive %.3f s instead of %.3f s, bound %.3f s (%s)\n",
      static_cast<long long>(kept.zero_optimization.stage3_max_live_parameters),
      static_cast<long long>(kept.zero_optimization.stage3_max_reuse_distance), pcie.c_str(),
      times->drive_s, t.drive_s, times->bound_s(), times->bound().c_str());
}

// Stage 3 on a GPU with the optimizer offloaded: where CPU Adam bounds the step, or the drive
// with the optimizer state in swap files, says what keeping optimizer state on the GPU gives
// (stepped there by Adam on the device, decision 036): the last units' (offload_optimizer.ratio
// below the config's, in tenths) or all of it (offload_optimizer.device none), whichever that
// fits bounds the step least, the least state on the GPU on a tie.
void print_optimizer_on_device(const config::Config& cfg, const model::LlamaModel& model,
                               const zero::Plan& plan, const zero::StepTimes& t,
                               const zero::PlanOptions& po, const zero::LinkRates& rates) {
  const config::OffloadOptimizerConfig& oo = cfg.zero_optimization.offload_optimizer;
  if (cfg.zero_optimization.stage != 3 || plan.device_host_accessible ||
      oo.device == config::OffloadDevice::kNone)
    return;
  const std::string bound = t.bound();
  if (bound != "CPU Adam" && !(bound == "drive" && oo.device == config::OffloadDevice::kNvme))
    return;
  std::optional<zero::StepTimes> best;
  std::string what;
  const auto consider = [&](const std::optional<zero::StepTimes>& times, std::string described) {
    if (times && times->bound_s() < (best ? best->bound_s() : t.bound_s())) {
      best = times;
      what = std::move(described);
    }
  };
  for (int tenths = 9; tenths >= 1; --tenths) {
    config::Config c = cfg;
    c.zero_optimization.offload_optimizer.ratio = tenths / 10.0;
    if (c.zero_optimization.offload_optimizer.ratio >= oo.ratio) continue;
    const std::optional<zero::StepTimes> times = times_with(c, model, plan, po, rates);
    if (times && times->adam_elems == 0) continue;  // all on the GPU: `none` below says so
    consider(times, fmt::format("offload_optimizer.ratio {:g} (the optimizer state of the last "
                                "units on the GPU, stepped there, which fits)",
                                tenths / 10.0));
  }
  config::Config none = cfg;
  none.zero_optimization.offload_optimizer.device = config::OffloadDevice::kNone;
  none.zero_optimization.offload_optimizer.ratio = 1.0;
  consider(times_with(none, model, plan, po, rates),
           "offload_optimizer.device none (all the optimizer state on the GPU, stepped there, "
           "which fits)");
  if (!best || !noticeably_less(best->bound_s(), t.bound_s())) return;
  std::printf(
      "  with %s: CPU Adam %.3f s instead of %.3f s, PCIe %.3f s instead of %.3f s, drive %.3f s "
      "instead of %.3f s, bound %.3f s (%s)\n",
      what.c_str(), best->adam_s, t.adam_s, best->pcie_s, t.pcie_s, best->drive_s, t.drive_s,
      best->bound_s(), best->bound().c_str());
}

// A swap directory training could not create here (a file or a link to nowhere in its place or
// on its way): refused as train refuses it (the engine's make_swap_dir), naming the key.
void check_swap_path(const std::string& path, const char* key) {
  namespace fs = std::filesystem;
  if (path.empty()) return;
  const ExistingPart at = nearest_existing_part(path);
  // An entry that cannot be looked at (permissions, a loop of links) is left to the plan's
  // free-space check, which names its error.
  if (at.type == fs::file_type::none || at.type == fs::file_type::unknown) return;
  std::error_code ec;
  const fs::file_type t = fs::status(at.path, ec).type();  // through a link: dangling, not_found
  if (t == fs::file_type::directory || t == fs::file_type::none || t == fs::file_type::unknown)
    return;
  throw ConfigError(key, fmt::format("{}: is not a directory (a swap directory goes there)", path));
}

int run_estimate(const EstimateArgs& a) {
  config::Config cfg;
  std::optional<model::LlamaModel> model;
  EstimateOptions o;
  try {
    if (a.config_file.empty() || a.model_file.empty())
      throw InvalidArgument("estimate needs --config FILE and --model FILE");
    if ((a.drive_read_gbps > 0) != (a.drive_write_gbps > 0))  // one rate would be dropped
      throw InvalidArgument(
          "--drive-read-gbps and --drive-write-gbps go together: give both, or neither to "
          "measure the drive");
    o.config_file = a.config_file;
    o.model_file = a.model_file;
    o.micro_batch = positive(a.micro_batch, "--micro-batch", 0, config::kMaxMicroBatch);
    o.seq_len = positive(a.seq_len, "--seq-len", 0, model::kMaxConfigDim);
    o.world_size = positive(a.world_size, "--world-size", 1, config::kMaxWorldSize);
    cfg = config::load_config_file(o.config_file).config;
    const model::LlamaConfig mc = model::LlamaConfig::load(o.model_file);
    if (o.seq_len > mc.max_position_embeddings)
      throw InvalidArgument(
          fmt::format("--seq-len: got {}; allowed: 1..{} (max_position_embeddings of {})",
                      o.seq_len, mc.max_position_embeddings, o.model_file));
    const model::ModelOptions mo =
        zero::estimate_model_options(cfg, mc,
                                     {.world_size = o.world_size,
                                      .micro_batch = o.micro_batch,
                                      .seq_len = o.seq_len,
                                      .activation_checkpointing = a.activation_checkpointing});
    model.emplace(mc, mo);
  } catch (const Error& e) {  // unreadable or malformed input
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  // --gpu-memory-gb: a GPU that need not be here (one to rent): its memory from the flag, its
  // rates from --gemm-tflops and --pcie-gbps.
  const bool absent_gpu = a.gpu_memory_gb > 0;
  if (absent_gpu && a.device != "auto" && a.device != "cuda") {
    std::fprintf(stderr, "error: --gpu-memory-gb plans for a GPU; it cannot go with --device %s\n",
                 a.device.c_str());
    return 2;
  }
  const std::optional<DeviceChoice> dev =
      absent_gpu ? std::optional<DeviceChoice>(DeviceChoice{
                       .kind = device::DeviceKind::Cuda,
                       .description = fmt::format("a GPU (--gpu-memory-gb {:g})", a.gpu_memory_gb)})
                 : choose_device(a.device);
  if (!dev) return 2;
  zero::PlanOptions po{.world_size = static_cast<int>(o.world_size)};
  po.host_memory_bytes = static_cast<uint64_t>(a.host_memory_gb * double(uint64_t{1} << 30));
  po.nvme_free_bytes = static_cast<uint64_t>(a.nvme_free_gb * double(uint64_t{1} << 30));
  std::unique_ptr<device::Device> gpu;  // the GPU planned for (its free memory, then its rates)
  uint64_t head_bytes = 0;  // what the head's rows are sized from (model::head_sizing_bytes)
  if (dev->kind == device::DeviceKind::Cuda) {
    try {
      const uint64_t budget = cfg.outcore.device_memory_mb << 20;
      if (!absent_gpu) gpu = device::make_cuda_device({.ordinal = dev->gpu});
      const uint64_t given = static_cast<uint64_t>(a.gpu_memory_gb * (1ull << 30));
      const uint64_t free = absent_gpu ? given : gpu->free_memory_bytes();
      head_bytes = model::head_sizing_bytes(budget, absent_gpu ? given : gpu->total_memory_bytes());
      po.device_limit_bytes = budget > 0 ? std::min(budget, free) : free;
      po.device_reserve_bytes = zero::device_reserve_bytes(budget, free);
      po.device_host_accessible = false;
      po.device_in_host_memory = false;
      // The head's rows per launch on this GPU, as training chooses them.
      const model::LlamaConfig mc = model->config();  // copied: emplace destroys the old model
      model::ModelOptions mo = model->options();
      mo.head_chunk_rows = model::head_rows_for_device(mc, mo, head_bytes);
      model.emplace(mc, mo);
      po.compute_workspace_bytes = zero::cuda_workspace_bytes(*model);
      std::string limit_text;
      if (budget > free)
        limit_text = ", capping the config's budget of " + zero::format_bytes(budget);
      else if (budget > 0)
        limit_text = ", budget " + zero::format_bytes(budget);
      std::printf("device     %s: %s free%s\n", dev->description.c_str(),
                  zero::format_bytes(free).c_str(), limit_text.c_str());
    } catch (const Error& e) {
      std::fprintf(stderr, "error: --device cuda: %s\n", e.what());
      return 2;
    }
  }
  // A run that saves checkpoints (as the plan's checkpoint line assumes): their buffers count.
  po.save_piece_elems = 0;
  const zero::Plan plan = zero::make_plan(cfg, *model, po);
  if (po.nvme_free_bytes == 0) {  // this machine's drive, not a rented one's (--nvme-free-gb)
    check_swap_path(plan.param_nvme_path, "zero_optimization.offload_param.nvme_path");
    check_swap_path(plan.optimizer_nvme_path, "zero_optimization.offload_optimizer.nvme_path");
  }
  zero::PlanLimits limits = zero::system_limits(cfg, plan);
  if (po.device_limit_bytes > 0) limits.device = po.device_limit_bytes;
  zero::apply_machine(limits, po);  // another machine's RAM and disk (one to rent)
  if (dev->kind == device::DeviceKind::Cuda &&
      (cfg.outcore.device_memory_mb == 0 || po.device_limit_bytes < cfg.outcore.device_memory_mb
                                                                        << 20))
    limits.device_by = absent_gpu ? "--gpu-memory-gb" : "the GPU's free memory";
  std::fputs(zero::format_plan(plan, &limits).c_str(), stdout);
  try {
    zero::check_fits(plan, limits);
  } catch (const OutOfMemory& e) {
    // The plan counts a save's buffers (a run with --save-dir): where only they do not fit, a
    // run that saves nothing does.
    std::string without_saves;
    zero::PlanOptions no_saves = po;
    no_saves.save_piece_elems = std::nullopt;
    try {
      zero::check_fits(zero::make_plan(cfg, *model, no_saves), limits);
      without_saves = "; a run without --save-dir (no checkpoint saves) fits";
    } catch (const Error&) {
    }
    std::fprintf(stderr, "error: does not fit: %s%s\n", e.what(), without_saves.c_str());
    return 2;
  }

  zero::LinkRates rates{.gemm_flops = a.gemm_tflops * 1e12,
                        .attention_flops = a.attention_tflops * 1e12,
                        .pcie_bytes = a.pcie_gbps * 1e9,
                        .drive_read_bytes = a.drive_read_gbps * 1e9,
                        .drive_write_bytes = a.drive_write_gbps * 1e9,
                        .adam_elems = a.cpu_adam_gelems * 1e9};
  RateSources src;
  if (absent_gpu && (rates.gemm_flops <= 0 || rates.pcie_bytes <= 0)) {
    std::printf(
        "\nstep bounds: give --gemm-tflops and --pcie-gbps (the GPU is not measured here)\n");
    return 0;
  }
  if (absent_gpu && rates.attention_flops <= 0)
    src.attention =
        "at the GEMM rate: give --attention-tflops (`outcore doctor` measures it on a GPU)";
  try {
    // The rates of the device planned for, where it is here: a GPU, else the host.
    std::unique_ptr<device::Device> host;
    device::Device* here = gpu.get();
    if (here == nullptr && !absent_gpu) here = (host = std::make_unique<device::CpuDevice>()).get();
    if (here != nullptr) {
      const std::string on = gpu != nullptr ? gpu->name() : "the host";
      const zero::RateShapes at = zero::rate_shapes(*here);
      if (rates.gemm_flops <= 0)
        src.gemm = fmt::format("measured: {} GEMM {}^3 on {}",
                               dtype_name(model->options().compute_dtype), at.gemm_n, on);
      if (rates.attention_flops <= 0) {
        const device::ComputeBackend::Attention a =
            zero::rate_attention(*model, at.attention_tokens);
        src.attention = fmt::format(
            "measured: {} attention forward + backward, {} tokens, {} heads of {} over {} kv "
            "heads, on {}",
            dtype_name(a.dtype), a.T, a.nh, a.hd, a.nkv, on);
      }
      zero::measure_compute_rates(*here, *model, rates);
    }
    if (gpu != nullptr && rates.pcie_bytes <= 0) {
      rates.pcie_bytes = device::copy_bytes_per_second(*gpu);
      src.pcie = "measured: pinned copies of 256 MiB";
    }
    // The drive, where the swap directory is on this machine and no rate is given.
    if (plan.per_step.nvme_read + plan.per_step.nvme_write > 0 && rates.drive_read_bytes <= 0 &&
        rates.drive_write_bytes <= 0) {
      constexpr uint64_t kDriveBytes = uint64_t{512} << 20;
      const std::string nvme_path = swap_dir_of(plan);
      if (absent_gpu) {
        src.drive_unknown = "the drive of the machine with the GPU is not measured here";
      } else {
        try {
          if (const auto measured = measure_drive(nvme_path, zero::aio_options(cfg.aio),
                                                  kDriveBytes, src.drive_unknown)) {
            rates.drive_read_bytes = measured->read_bytes;
            rates.drive_write_bytes = measured->write_bytes;
            src.drive = fmt::format("measured: {} written, then read, in {} with the aio section{}",
                                    zero::format_bytes(kDriveBytes), measured->dir,
                                    measured->buffered ? ", buffered (no O_DIRECT there)" : "");
          } else if (src.drive_unknown.find("is not a writable directory here") !=
                     std::string::npos) {
            // A plan for this machine that its training could not follow: said, not only in
            // the drive's line.
            log::warn(
                "{}: `outcore train` with this config would fail on this machine "
                "(`outcore doctor --nvme-path {}` says why)",
                src.drive_unknown, nvme_path);
          }
        } catch (const Error& e) {  // the drive stays unknown, saying why
          src.drive_unknown = fmt::format("measuring it failed: {}", e.what());
        }
      }
    }
    if (rates.adam_elems <= 0 && zero::cpu_adam_elems(plan) > 0) {
      // The host stepping the optimizer state is this machine, whichever GPU is planned for.
      try {
        rates.adam_elems = zero::measure_adam_rate(cfg, model->options().param_dtype);
      } catch (const std::bad_alloc&) {
        throw Error("measuring CPU Adam's rate: out of memory (give --cpu-adam-gelems)");
      }
      const auto& oo = cfg.zero_optimization.offload_optimizer;
      src.adam = fmt::format(
          "measured: {} moments, {} threads (offload_optimizer.cpuadam_cores_perc {:g})",
          config::adam_moments_bf16(cfg) ? "bf16" : "fp32", zero::cpu_threads_for(cfg),
          oo.cpuadam_cores_perc);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "error: measuring the device's rates: %s\n", e.what());
    return 1;
  }
  const zero::StepTimes t = zero::step_times(plan, *model, rates);
  print_bounds(t, plan, rates, src);
  if (!t.drive_known) return 0;  // what hides the transfers depends on the drive
  print_params_in_host_memory(cfg, *model, plan, t, po, rates);
  print_params_kept_on_device(cfg, *model, plan, t, po, rates);
  print_optimizer_on_device(cfg, *model, plan, t, po, rates);
  if (t.transfers_hidden()) {
    std::printf("  the transfers fit under compute at this micro-batch and accumulation\n");
    return 0;
  }
  // The fewest tokens per step whose compute covers every transfer, within the device budget.
  const std::optional<zero::ShapeChoice> shown = zero::choose_shape(
      cfg, model->config(), model->options(), po, po.device_limit_bytes, head_bytes, rates);
  if (!shown) {
    std::printf("  no micro-batch up to 64 fits the device budget\n");
    return 0;
  }
  std::printf(
      "  %s: train_micro_batch_size_per_gpu %lld, gradient_accumulation_steps %lld "
      "(%lld tokens per step): compute %.3f s, PCIe %.3f s, drive %.3f s\n",
      shown->hides ? "to hide the transfers under compute"
                   : "no shape up to micro-batch 64 x accumulation 128 hides them; the closest",
      static_cast<long long>(shown->micro), static_cast<long long>(shown->gas),
      static_cast<long long>(shown->micro * shown->gas * model->options().seq_len),
      shown->times.compute_s, shown->times.pcie_s, shown->times.drive_s);
  return 0;
}

}  // namespace

void add_estimate_command(CLI::App& app, int& rc) {
  auto o = std::make_shared<EstimateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "estimate", "Print where each byte of training state lives and the traffic per step");
  cmd->add_option("--config", o->config_file, "DeepSpeed JSON config (required)");
  cmd->add_option("--model", o->model_file, "Hugging Face config.json of the model (required)");
  cmd->add_option("--micro-batch", o->micro_batch,
                  "sequences per micro-batch to plan for, in place of the config's (its "
                  "gradient_accumulation_steps kept, train_batch_size following; where the "
                  "config sets neither, as train's --micro-batch-size; default: the config's, "
                  "else 1)");
  cmd->add_option("--seq-len", o->seq_len,
                  "tokens per sequence (default: min(max_position, 1024))");
  cmd->add_option("--world-size", o->world_size, "data-parallel ranks (default 1)");
  cmd->add_option("--device", o->device,
                  "plan for: auto (a GPU when there is one, else the simulated device), cpu, "
                  "cuda (the GPU's free memory caps the device budget)");
  cmd->add_option("--gpu-memory-gb", o->gpu_memory_gb,
                  "plan for a GPU with this many GiB free that this machine need not have (one "
                  "to rent); the step bounds then need --gemm-tflops and --pcie-gbps, and take "
                  "--attention-tflops")
      ->check(finite_in(1.0 / 1024, 1e6, "GiB"));
  cmd->add_option("--host-memory-gb", o->host_memory_gb,
                  "plan for a machine with this many GiB of host memory available (one to rent) "
                  "instead of this one's (MemAvailable, or what a memory cgroup leaves); it also "
                  "decides whether gradient sums go to swap files")
      ->check(finite_in(1.0 / 1024, 1e7, "GiB"));
  cmd->add_option("--nvme-free-gb", o->nvme_free_gb,
                  "plan for swap directories with this many GiB free, on one drive (one to "
                  "rent), instead of the free space under this machine's nvme_path")
      ->check(finite_in(1.0 / 1024, 1e7, "GiB"));
  cmd->add_option("--gemm-tflops", o->gemm_tflops,
                  "the device's GEMM rate in the compute dtype (default: measured here)")
      ->check(finite_in(1e-6, 1e6, "TFLOP/s"));
  cmd->add_option("--attention-tflops", o->attention_tflops,
                  "the model FLOP/s of the model's attention on the device, forward + backward "
                  "(default: measured here; for --gpu-memory-gb, the GEMM rate)")
      ->check(finite_in(1e-6, 1e6, "TFLOP/s"));
  cmd->add_option("--pcie-gbps", o->pcie_gbps,
                  "host<->device GB/s (default: measured on a GPU; none for the host device)")
      ->check(finite_in(1e-6, 1e5, "GB/s"));
  cmd->add_option("--drive-read-gbps", o->drive_read_gbps,
                  "the swap drive's read GB/s (with --drive-write-gbps; default: measured under "
                  "nvme_path)")
      ->check(finite_in(1e-6, 1e5, "GB/s"));
  cmd->add_option("--drive-write-gbps", o->drive_write_gbps,
                  "the swap drive's write GB/s (with --drive-read-gbps)")
      ->check(finite_in(1e-6, 1e5, "GB/s"));
  cmd->add_option("--cpu-adam-gelems", o->cpu_adam_gelems,
                  "CPU Adam's rate in G elements/s (default: measured here with the config's "
                  "threads and moments)")
      ->check(finite_in(1e-6, 1e6, "G elements/s"));
  cmd->add_flag("--activation-checkpointing", o->activation_checkpointing,
                "plan with activation checkpointing (as `outcore train "
                "--activation-checkpointing`; on anyway when the config's "
                "activation_checkpointing section asks for cpu_checkpointing)");
  cmd->callback([o, &rc] {
    try {
      rc = run_estimate(*o);
    } catch (const ConfigError& e) {  // a config key the plan refuses: named with the file
      std::fprintf(stderr, "error: %s\n",
                   config::message_naming_config_file(e, o->config_file).c_str());
      rc = 2;
    }
  });
}

}  // namespace outcore::cli
