// Larger than RAM: a model whose training state (16 bytes per parameter) is well above this
// machine's RAM trains a few optimizer steps with ZeRO-3, parameters, optimizer state and
// gradient accumulators on NVMe, under a small device budget, reporting step time, I/O rates,
// the process's peak RSS and the loss.
//
// Each step's time is set against two bounds measured in the same run, before the first step
// (bench/zero/step_bounds.hpp): the I/O bound, the drive's time for the plan's NVMe bytes per
// step at the rates outcore's aio engine reaches on a --ref-gib file in the swap directory
// (config block size, queue depth and threads), reads and writes one after the other, fully
// overlapped, and mixed as measured; and the compute bound, forward+backward of the step's
// tokens with every unit in memory, summed from the median time of the embedding, one decoder
// layer and the head; and the CPU Adam bound, the elements CPU Adam steps at the rate
// zero::measure_adam_rate measures with the engine's threads. The ratio is step / max(I/O
// bound, compute bound, CPU Adam bound), with the mixed figure as the I/O bound (reads and
// writes share the drive, as in a step). A step runs from its forward's
// start to the next step's (the last one: to wait_step's return), so the optimizer work that
// overlaps the next forward counts once: single steps are skewed by it (the first lacks its
// updates, the last waits for its own), the mean over the steps is exact.
//
// With --device cuda the model computes on GPU 0 (the engine's device budget --device-mb,
// e.g. 70000 for a 7B model on an 80 GB GPU with --hidden 4096 --intermediate 11008
// --layers 32 --heads 32 --kv-heads 32), the compute bound is the same units in GPU memory, a
// third bound is measured, PCIe (the plan's host<->device bytes per step at the rate of pinned
// 256 MiB copies, device::copy_bytes_per_second), and the summary prints model TFLOP/s streamed
// and in memory (and MFU with --peak-tflops). The model computes in --compute (bf16 by default,
// as `outcore train` with this config; figures recorded before it existed are fp32 compute). --gas
// G runs G micro-batches per step (the gradient sums of the units that fit stay on the GPU until
// the last one, decision 024);
// On a GPU the head computes as many rows per launch as `outcore train` there (head_rows_on;
// figures recorded before 2026-11-27 used 16 MiB of logits per launch).
// --grads host keeps the gradient accumulators in host memory instead of swap files;
// --param-in-cpu N keeps parameter partitions up to N elements in host memory (max_in_cpu).
//
//   zero_large_bench [--hidden 2560] [--intermediate 6912] [--layers 34] [--heads 20]
//                    [--kv-heads 4] [--vocab 32000] [--seq 128] [--micro 1] [--gas 1]
//                    [--steps 3] [--nvme DIR] [--device-mb 2048] [--sub-group 10000000]
//                    [--lr 2e-3] [--ref-gib 4] [--compute-reps 3] [--skip-bounds]
//                    [--device cpu|discrete|cuda] [--grads nvme|host] [--param-in-cpu 0]
//                    [--compute bf16|fp32] [--peak-tflops T] [--bf16-moments] [--trace FILE]
//                    [--clip 1.0] [--step-in-backward] [--keep-params] [--recommended-shape]
//                    [--cpuadam-cores-perc 1.0] [--offload-ratio 1.0]
//
// --recommended-shape trains at the micro-batch and accumulation `outcore estimate` recommends on
// this machine (zero::choose_shape: the fewest tokens per step whose compute covers every
// transfer within the device budget, else the closest), from the rates measured first: the
// GEMM rate at 4096^3 (1024^3 on the host) in the compute dtype, the model's attention on one
// sequence of up to 4096 tokens (512 on the host), pinned copies on a device the host cannot read,
// and the drive's read and write rates through the aio engine (--ref-gib);
// --micro and --gas are then ignored.
// --keep-params keeps the gathered parameters on the device between uses and through the
// micro-batches of a step, as far as the budget holds them (stage3_max_live_parameters and
// stage3_max_reuse_distance 1e12; by default 0, so every use fetches again).
// --step-in-backward sets outcore.step_in_backward: each unit's optimizer step starts during
// the backward when the multiplier without clipping is expected to hold (--clip 0, or the last
// step's norm below it); a step prints whether its tentative updates stood or were redone.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench/zero/step_bounds.hpp"
#include "common/error.hpp"
#include "common/trace.hpp"
#include "engine/comm/local_comm.hpp"
#include "engine/config/config.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/device.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/step_bounds.hpp"
#include "engine/zero/zero.hpp"
#include "tools/blas/blas_kernels.hpp"
#include "tools/env_settings.hpp"

namespace {

using namespace outcore;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// A "Key: N kB" line of /proc/self/status (VmRSS, VmHWM) in GiB; 0 when absent.
double status_gib(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string k;
  double kb = 0;
  while (in >> k) {
    if (k == key) {
      in >> kb;
      return kb / (1 << 20);
    }
    in.ignore(1 << 20, '\n');
  }
  return 0;
}

double peak_rss_gib() { return status_gib("VmHWM:"); }
// Restarts the peak (VmHWM) from the current RSS, so that the steps' peak is not the bounds'.
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

double mem_total_gib() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kb = 0;
  in >> key >> kb;  // the first line is MemTotal
  return kb / (1 << 20);
}

// The step's input ids: runs of an affine sequence restarted from a pseudo-random id every 32
// tokens, so the loss can fall within a few steps.
std::vector<int32_t> step_tokens(int step, size_t n, int64_t vocab) {
  std::vector<int32_t> tok(n);
  uint64_t x = static_cast<uint64_t>(step) * 2862933555777941757ull + 3037000493ull;
  for (size_t i = 0; i < n; ++i) {
    if (i % 32 == 0) {
      x = x * 2862933555777941757ull + 3037000493ull;
      tok[i] = static_cast<int32_t>((x >> 33) % vocab);
    } else {
      tok[i] = static_cast<int32_t>((int64_t{tok[i - 1]} * 5 + 3) % vocab);
    }
  }
  return tok;
}

struct Bounds {
  bench::IoBound io;
  bench::ComputeTimes compute;
  double pcie_s = 0;      // the plan's host<->device bytes at the measured copy rate (0: no bus)
  double adam_s = 0;      // CPU Adam over the elements it steps, at the rate measured here
  double write_gbps = 0;  // the drive's write rate
  double others_s() const { return std::max({compute.step_s(), pcie_s, adam_s}); }
  double larger_serial_s() const { return std::max(io.serial_s, others_s()); }
  double larger_overlapped_s() const { return std::max(io.overlapped_s, others_s()); }
  double larger_mixed_s() const { return std::max(io.mixed_s, others_s()); }
};

Bounds measure_bounds(const zero::Plan& plan, const model::LlamaModel& model,
                      device::Device& compute_dev, const config::Config& cfg,
                      const std::string& dir, double ref_gib, int compute_reps,
                      bool engine_dev_host_accessible) {
  const uint64_t read = plan.per_step.nvme_read, write = plan.per_step.nvme_write;
  const aio::Options aio = zero::aio_options(cfg.aio);
  constexpr uint64_t kSpan = 32ull << 20;
  const double read_fraction = read + write ? static_cast<double>(read) / (read + write) : 0.5;
  std::printf(
      "measuring the drive: %.1f GiB file in %s, aio block %zu KiB, queue depth %u x %u "
      "threads, %llu MiB spans ...\n",
      ref_gib, dir.c_str(), aio.block_size >> 10, aio.queue_depth, aio.thread_count,
      static_cast<unsigned long long>(kSpan >> 20));
  std::fflush(stdout);
  const bench::DriveRates rates = bench::measure_drive(
      dir, static_cast<uint64_t>(ref_gib * (1ull << 30)), kSpan, read_fraction, aio);
  Bounds b{bench::io_bound(rates, read, write),
           bench::measure_compute(model, compute_dev, plan.micro_batches_per_step, compute_reps,
                                  cfg.activation_checkpointing.cpu_checkpointing)};
  b.write_gbps = rates.write_gbps;
  if (!engine_dev_host_accessible) {
    // On the compute bound's device (the engine's has its budget), or a simulated discrete one.
    std::unique_ptr<device::Device> sim;
    device::Device* link = &compute_dev;
    if (compute_dev.host_accessible()) {
      sim = std::make_unique<device::CpuDevice>(device::CpuDeviceOptions{.discrete = true});
      link = sim.get();
    }
    const double rate = device::copy_bytes_per_second(*link);
    const uint64_t bytes = plan.per_step.h2d + plan.per_step.d2h;
    b.pcie_s = static_cast<double>(bytes) / rate;
    std::printf(
        "PCIe bound (plan: %.2f GB up + %.2f GB down per step at %.1f GB/s, pinned 256 MiB "
        "copies): %.2f s\n",
        plan.per_step.h2d / 1e9, plan.per_step.d2h / 1e9, rate / 1e9, b.pcie_s);
  }
  {
    // CPU Adam over what it steps (zero::step_times: the offloaded elements on a GPU), at the
    // engine's threads and moments (zero::measure_adam_rate).
    const zero::LinkRates r{.adam_elems =
                                zero::measure_adam_rate(cfg, model.options().param_dtype)};
    const zero::StepTimes t = zero::step_times(plan, model, r);
    b.adam_s = t.adam_s;
    std::printf("CPU Adam bound (plan: %.3g G elements at %.3g G elements/s): %.2f s\n",
                static_cast<double>(t.adam_elems) / 1e9, r.adam_elems / 1e9, b.adam_s);
  }
  std::printf(
      "drive (aio engine, %.2f GB per pass): write %.2f GB/s, read %.2f GB/s, mixed %.2f GB/s "
      "(%.0f%% reads)\n",
      rates.file_bytes / 1e9, rates.write_gbps, rates.read_gbps, rates.mixed_gbps,
      read_fraction * 100);
  std::printf(
      "I/O bound (plan: %.2f GB read + %.2f GB written per step): serial %.2f s, overlapped "
      "%.2f s, mixed %.2f s\n",
      read / 1e9, write / 1e9, b.io.serial_s, b.io.overlapped_s, b.io.mixed_s);
  std::printf(
      "compute bound (in memory, median of %d): %.2f s = %lld x (embed %.3f s + %lld x decoder "
      "%.3f s + head %.3f s)\n",
      compute_reps, b.compute.step_s(), static_cast<long long>(b.compute.micro_batches),
      b.compute.embed_s, static_cast<long long>(b.compute.layers), b.compute.decoder_s,
      b.compute.head_s);
  std::fflush(stdout);
  return b;
}

// The compute time `outcore estimate` plans for this run's step (zero::step_times, from the GEMM
// and attention rates in `rates`, measured on `compute_dev` where still 0) against the compute
// bound measured from the units, and the same with the attention counted at the GEMM rate.
void print_planned_compute(const zero::Plan& plan, const model::LlamaModel& model,
                           device::Device& compute_dev, double measured_s, zero::LinkRates rates) {
  zero::measure_compute_rates(compute_dev, model, rates);
  const zero::StepTimes t = zero::step_times(plan, model, rates);
  rates.attention_flops = 0;
  const zero::StepTimes gemm_only = zero::step_times(plan, model, rates);
  std::printf(
      "planned compute (outcore estimate): %.2f s = GEMMs %.2f s at %.1f TFLOP/s + attention "
      "%.2f s at %.2f TFLOP/s: %.2fx the measured compute bound (%.2f s); with the attention at "
      "the GEMM rate %.2f s (%.2fx)\n",
      t.compute_s, t.gemm_s, rates.gemm_flops / 1e12, t.attention_s,
      t.attention_s > 0 ? t.attention_flops / t.attention_s / 1e12 : 0.0, t.compute_s / measured_s,
      measured_s, gemm_only.compute_s, gemm_only.compute_s / measured_s);
  std::fflush(stdout);
}

// The settings of the config the benchmark trains with.
struct ConfigSettings {
  int64_t micro = 1, gas = 1, sub_group = 10'000'000, device_mb = 2048, param_in_cpu = 0;
  std::string nvme, compute = "bf16";
  bool bf16_moments = false, step_in_backward = false, keep_params = false;
  double clip = 1.0;
  double cpuadam_cores_perc = 1.0;  // offload_optimizer.cpuadam_cores_perc
  double offload_ratio = 1.0;       // offload_optimizer.ratio
};

config::Config make_config(const ConfigSettings& s) {
  config::Config cfg =
      config::parse_config(
          fmt::format(
              R"({{"train_micro_batch_size_per_gpu": {0}, "gradient_accumulation_steps": {7},
        "gradient_clipping": {5}, "bf16": {{"enabled": true}},{4}
        "activation_checkpointing": {{"cpu_checkpointing": true}},
        "zero_optimization": {{"stage": 3, "sub_group_size": {1},
          "offload_param": {{"device": "nvme", "nvme_path": "{2}", "buffer_count": 3,
                             "max_in_cpu": {8}}},
          "offload_optimizer": {{"device": "nvme", "nvme_path": "{2}", "buffer_count": 3,
                                 "pipeline_read": true, "pipeline_write": true,
                                 "cpuadam_cores_perc": {11}, "ratio": {12}}},
          "stage3_max_reuse_distance": {10}, "stage3_max_live_parameters": {10},
          "stage3_param_persistence_threshold": 0}},
        "aio": {{"queue_depth": 16, "intra_op_parallelism": 2}},
        "outcore": {{"device_memory_mb": {3}, "step_in_backward": {6},
                    "compute_dtype": "{9}"}}}})",
              s.micro, s.sub_group, s.nvme, s.device_mb,
              s.bf16_moments
                  ? R"( "optimizer": {"type": "AdamW", "params": {"fp32_optimizer_states": false}},)"
                  : "",
              s.clip, s.step_in_backward, s.gas, s.param_in_cpu, s.compute,
              s.keep_params ? "1000000000000" : "0", s.cpuadam_cores_perc, s.offload_ratio),
          "zero_large_bench")
          .config;
  config::resolve_auto(cfg, {});
  return cfg;
}

}  // namespace

int main(int argc, char** argv) {
  outcore::tools::select_blas_kernels(argv);
  outcore::tools::apply_environment_settings();
  int64_t hidden = 2560, intermediate = 6912, layers = 34, heads = 20, kv_heads = 4, vocab = 32000;
  int64_t seq = 128, micro = 1, gas = 1, device_mb = 2048, sub_group = 10'000'000;
  int64_t param_in_cpu = 0;
  std::string grads = "nvme";
  std::string compute = "bf16";
  int steps = 3, compute_reps = 3;
  double lr = 2e-3, ref_gib = 4;
  bool skip_bounds = false;
  std::string device_kind = "cpu";
  double peak_tflops = 0;
  double cpuadam_cores_perc = 1.0;
  bool bf16_moments = false;
  double clip = 1.0;
  bool step_in_backward = false;
  bool keep_params = false;
  bool recommended_shape = false;
  std::string trace_file;
  std::string nvme = std::string(OUTCORE_BINARY_DIR) + "/zero_large_swap";
  CLI::App app("ZeRO-3 with everything on NVMe for a model larger than RAM");
  app.add_option("--hidden", hidden);
  app.add_option("--intermediate", intermediate);
  app.add_option("--layers", layers);
  app.add_option("--heads", heads);
  app.add_option("--kv-heads", kv_heads);
  app.add_option("--vocab", vocab);
  app.add_option("--seq", seq);
  app.add_option("--micro", micro);
  app.add_option("--gas", gas, "gradient_accumulation_steps")->check(CLI::Range(1, 1024));
  app.add_option("--grads", grads, "where the fp32 gradient accumulators live")
      ->check(CLI::IsMember({"nvme", "host"}));
  app.add_option("--compute", compute, "outcore.compute_dtype: GEMM operands in bf16 or fp32")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_option("--param-in-cpu", param_in_cpu, "offload_param.max_in_cpu (elements)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", steps);
  app.add_option("--nvme", nvme, "swap directory");
  app.add_option("--device-mb", device_mb, "device budget (outcore.device_memory_mb)");
  app.add_option("--sub-group", sub_group, "zero_optimization.sub_group_size");
  app.add_option("--lr", lr);
  app.add_option("--ref-gib", ref_gib, "size of the drive reference file in the swap directory");
  app.add_option("--compute-reps", compute_reps, "timed passes of the compute bound's units");
  app.add_flag("--skip-bounds", skip_bounds, "measure neither the I/O nor the compute bound");
  app.add_option("--device", device_kind,
                 "cpu (the simulated device), discrete (the simulated device as a GPU: the host "
                 "cannot read it) or cuda (GPU 0: the model computes there, the compute bound is "
                 "the same units in GPU memory)")
      ->check(CLI::IsMember({"cpu", "discrete", "cuda"}));
  app.add_option("--trace", trace_file,
                 "Chrome trace-event JSON of the steps (tools/trace_svg.py draws the last one)");
  app.add_flag("--bf16-moments", bf16_moments,
               "Adam moments in bf16 (optimizer.params.fp32_optimizer_states false): 8 B of "
               "optimizer state per parameter read and written per step instead of 12");
  app.add_option("--clip", clip, "gradient_clipping (0: off)");
  app.add_flag("--step-in-backward", step_in_backward,
               "outcore.step_in_backward: start the optimizer step during the backward");
  app.add_flag("--recommended-shape", recommended_shape,
               "the micro-batch and accumulation outcore estimate recommends for this machine's "
               "measured rates (instead of --micro and --gas)");
  app.add_flag("--keep-params", keep_params,
               "keep gathered parameters on the device through the step's micro-batches, as far "
               "as the budget holds them (stage3_max_live_parameters and "
               "stage3_max_reuse_distance 1e12)");
  app.add_option("--peak-tflops", peak_tflops,
                 "the device's peak TFLOP/s for the GEMMs' dtype (the config's compute dtype, "
                 "bf16): prints MFU");
  app.add_option("--cpuadam-cores-perc", cpuadam_cores_perc,
                 "offload_optimizer.cpuadam_cores_perc: the share of the hardware threads CPU "
                 "Adam uses (gradient sums and norms have every thread, in a pool of their own)")
      ->check(CLI::Range(0.01, 1.0));
  double offload_ratio = 1.0;
  app.add_option("--offload-ratio", offload_ratio,
                 "offload_optimizer.ratio: below 1 the last units' optimizer state stays on the "
                 "device and is stepped there")
      ->check(CLI::Range(0.0, 1.0));
  CLI11_PARSE(app, argc, argv);
  auto settings = [&] {
    return ConfigSettings{.micro = micro,
                          .gas = gas,
                          .sub_group = sub_group,
                          .device_mb = device_mb,
                          .param_in_cpu = param_in_cpu,
                          .nvme = nvme,
                          .compute = compute,
                          .bf16_moments = bf16_moments,
                          .step_in_backward = step_in_backward,
                          .keep_params = keep_params,
                          .clip = clip,
                          .cpuadam_cores_perc = cpuadam_cores_perc,
                          .offload_ratio = offload_ratio};
  };

  try {
    model::LlamaConfig mc;
    mc.hidden_size = hidden;
    mc.intermediate_size = intermediate;
    mc.num_hidden_layers = layers;
    mc.num_attention_heads = heads;
    mc.num_key_value_heads = kv_heads;
    mc.head_dim = hidden / heads;
    mc.vocab_size = vocab;
    mc.max_position_embeddings = seq;
    const uint64_t budget = static_cast<uint64_t>(device_mb) << 20;
    std::unique_ptr<device::Device> dev, compute_dev;
    if (device_kind == "cuda") {
      dev = device::make_cuda_device({.memory_budget_bytes = budget});
      compute_dev = device::make_cuda_device();
    } else {
      // discrete: the simulated GPU (every transfer a stream copy); the compute bound runs on
      // host memory through the same backend.
      dev = std::make_unique<device::CpuDevice>(device::CpuDeviceOptions{
          .memory_budget_bytes = budget, .discrete = device_kind == "discrete"});
      compute_dev = std::make_unique<device::CpuDevice>();
    }
    std::printf("device: %s\n", dev->name().c_str());
    zero::LinkRates rates;  // measured for the recommended shape, reused for the planned compute
    if (recommended_shape) {
      const auto shape = bench::recommend_shape(
          mc, seq, DType::BF16, *dev, *compute_dev, budget, nvme, ref_gib,
          grads == "host" ? zero::GradientPlacement::kHost : zero::GradientPlacement::kNvme,
          make_config(settings()), rates);
      if (!shape) {
        std::fprintf(stderr, "error: no micro-batch up to 64 fits the device budget\n");
        return 2;
      }
      micro = shape->first;
      gas = shape->second;
    }
    const config::Config cfg = make_config(settings());
    model::ModelOptions mo{.micro_batch = micro,
                           .seq_len = seq,
                           .param_dtype = DType::BF16,
                           .compute_dtype = config::compute_dtype(cfg),
                           .activation_checkpointing = true};
    mo.head_chunk_rows = model::head_rows_on(mc, mo, *dev, budget);  // as outcore train
    const model::LlamaModel model(mc, mo, device::make_backend(*dev));
    std::filesystem::create_directories(nvme);
    const double params = static_cast<double>(mc.num_parameters());
    std::printf(
        "model: %.2fB parameters; training state %.1f GiB (16 B/param) = %.2fx this machine's "
        "%.1f GiB RAM\n",
        params / 1e9, params * 16 / (1ull << 30), params * 16 / (1ull << 30) / mem_total_gib(),
        mem_total_gib());

    comm::LocalComm comm;
    zero::EngineOptions eo;
    eo.gradients =
        grads == "host" ? zero::GradientPlacement::kHost : zero::GradientPlacement::kNvme;
    const auto t0 = Clock::now();
    zero::ZeroEngine engine(cfg, model, *dev, comm, 2024, eo);
    std::fputs(zero::format_plan(engine.plan()).c_str(), stdout);
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    std::printf(
        "engine CPU threads %u of %u for CPU Adam, %u for gradient sums and norms "
        "(cpuadam_cores_perc %g)\n",
        engine.cpu_threads(), hw, engine.data_threads(), cpuadam_cores_perc);
    const double init_s = seconds_since(t0);
    const uint64_t init_written = engine.traffic().nvme_write_bytes;
    std::printf("initialised in %.1f s, %.2f GB written (peak RSS so far %.2f GiB)\n", init_s,
                init_written / 1e9, peak_rss_gib());
    std::fflush(stdout);

    std::optional<Bounds> bounds;
    if (!skip_bounds) {
      bounds = measure_bounds(engine.plan(), model, *compute_dev, cfg, nvme, ref_gib, compute_reps,
                              dev->host_accessible());
      print_planned_compute(engine.plan(), model, *compute_dev, bounds->compute.step_s(), rates);
      compute_dev.reset();  // its memory (and blocks kept for reuse) is not the run's
      reset_peak_rss();
    }

    const size_t n = static_cast<size_t>(model.tokens());
    const zero::TrafficStats traffic0 = engine.traffic();
    zero::TrafficStats a = traffic0;
    const auto run0 = Clock::now();
    const double cpu0 = bench::cpu_seconds();
    auto s0 = run0;
    if (!trace_file.empty()) {
      trace::name_thread("trainer");
      trace::start();
    }
    for (int t = 1; t <= steps; ++t) {
      OUTCORE_TRACE_SPAN("step", "step", {.index = t});
      const zero::StepParams sp = zero::step_params(cfg, lr, t, 1.0);
      float loss = 0;
      for (int64_t k = 0; k < gas; ++k) {
        const std::vector<int32_t> tok =
            step_tokens(static_cast<int>((t - 1) * gas + k + 1), n + 1, vocab);
        if (k == gas - 1) engine.expect_step(sp);
        loss += engine.forward_backward(tok.data(), tok.data() + 1, 1.0f / static_cast<float>(gas),
                                        k == 0) /
                static_cast<float>(gas);
      }
      const double fb = seconds_since(s0);
      const auto s1 = Clock::now();
      const zero::StepResult r = engine.step(sp);
      const double st = seconds_since(s1);
      if (t == steps) engine.wait_step();
      const auto s2 = Clock::now();
      const double total = std::chrono::duration<double>(s2 - s0).count();
      const zero::TrafficStats b = engine.traffic();
      const double rd = (b.nvme_read_bytes - a.nvme_read_bytes) / 1e9;
      const double wr = (b.nvme_write_bytes - a.nvme_write_bytes) / 1e9;
      std::printf(
          "step %d: loss %.6f%s, grad norm %.6f, %.2f s (fwd+bwd %.2f s, optimizer %.2f s%s), "
          "nvme read %.2f GB (%.2f GB/s), write %.2f GB (%.2f GB/s), peak RSS %.2f GiB, device "
          "peak %.0f MiB",
          t, loss, std::isfinite(loss) ? "" : " (NOT FINITE)", r.grad_norm, total, fb, st,
          t == steps ? fmt::format(", its overlapped end {:.2f} s", total - fb - st).c_str() : "",
          rd, rd / total, wr, wr / total, peak_rss_gib(),
          engine.memory().device_peak_bytes / 1048576.0);
      if (bounds) std::printf(", %.2fx the larger bound", total / bounds->larger_mixed_s());
      if (r.in_backward == zero::StepResult::InBackward::kCommitted)
        std::printf(", stepped during backward");
      else if (r.in_backward == zero::StepResult::InBackward::kRedone)
        std::printf(", stepped during backward and redone (clipped)");
      std::printf("\n");
      std::fflush(stdout);
      a = b;
      s0 = s2;
    }
    if (!trace_file.empty()) {
      trace::stop();
      const std::vector<trace::Event> events = trace::events();
      const trace::IoOverlap hidden = trace::io_overlap(events, {"compute"});
      trace::write_json(
          trace_file, {fmt::format("\"io_hidden_under_compute\": {:.4f}", hidden.hidden_fraction)});
      std::printf("trace %s: %zu spans; I/O busy %.1f s, %.1f%% of it under forward/backward\n",
                  trace_file.c_str(), events.size(), hidden.io_busy_s,
                  100 * hidden.hidden_fraction);
    }
    std::printf("pinned pool peak %.0f MiB of %.0f MiB\n",
                engine.memory().pinned_peak_bytes / 1048576.0,
                engine.memory().pinned_budget_bytes / 1048576.0);
    // The plan's host need (host tier, the pinned pool whole, a simulated device's memory) against
    // what the process held at its peak, libraries and all.
    const double need_gib =
        static_cast<double>(zero::host_need_bytes(engine.plan())) / (1ull << 30);
    std::printf("peak RSS %.2f GiB = %.2fx the plan's host need %.2f GiB\n", peak_rss_gib(),
                peak_rss_gib() / need_gib, need_gib);
    if (bounds && steps > 0) {
      // A step's updates finish under the next forward, so single steps are skewed (the first
      // lacks its updates, the last waits for them); their mean is exact.
      const double mean = std::chrono::duration<double>(s0 - run0).count() / steps;
      const double cpu = (bench::cpu_seconds() - cpu0) / steps;
      const zero::TrafficBytes& per_step = engine.plan().per_step;
      std::printf(
          "summary over %d steps: step %.2f s (mean), nvme read %.2f GB, write %.2f GB per step "
          "(plan %.2f / %.2f); I/O bound serial %.2f s, overlapped %.2f s, mixed %.2f s; compute "
          "bound %.2f s; PCIe bound %.2f s; CPU Adam bound %.2f s\n",
          steps, mean, (a.nvme_read_bytes - traffic0.nvme_read_bytes) / 1e9 / steps,
          (a.nvme_write_bytes - traffic0.nvme_write_bytes) / 1e9 / steps, per_step.nvme_read / 1e9,
          per_step.nvme_write / 1e9, bounds->io.serial_s, bounds->io.overlapped_s,
          bounds->io.mixed_s, bounds->compute.step_s(), bounds->pcie_s, bounds->adam_s);
      std::printf(
          "step / max(I/O bound, compute bound, PCIe bound, CPU Adam bound) = %.2f with the "
          "drive's mixed "
          "read/write time (goal <= 1.10), %.2f with its serial time, %.2f if it read and wrote "
          "at full speed at once\n",
          mean / bounds->larger_mixed_s(), mean / bounds->larger_serial_s(),
          mean / bounds->larger_overlapped_s());
      // The compute bound is measured with the cores to itself; a step shares them with the
      // I/O's CRCs and copies, the gradient work and Adam: all threads busy = CPU-bound.
      // Initialisation writes the swap files once: its time against the drive's for those bytes.
      std::printf("initialisation: %.1f s = %.2fx the drive's time to write its %.2f GB\n", init_s,
                  init_s / (init_written / 1e9 / bounds->write_gbps), init_written / 1e9);
      std::printf("CPU seconds per step: %.1f (%.2f of %u hardware threads busy)\n", cpu,
                  cpu / mean, std::thread::hardware_concurrency());
      // Model FLOPs (3x forward, recomputation not counted) per second, streamed vs in memory.
      const double flops = mc.train_flops_per_token(seq) * static_cast<double>(micro * seq) *
                           static_cast<double>(engine.plan().micro_batches_per_step);
      const double streamed = flops / mean / 1e12,
                   resident = flops / bounds->compute.step_s() / 1e12;
      std::printf("model TFLOP/s: %.3f streamed, %.3f with the units in memory (%.2f of it)",
                  streamed, resident, streamed / resident);
      if (peak_tflops > 0)
        std::printf("; MFU %.1f%% streamed, %.1f%% in memory (peak %.1f TFLOP/s)",
                    100 * streamed / peak_tflops, 100 * resident / peak_tflops, peak_tflops);
      std::printf("\n");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero_large_bench: %s\n", e.what());
    return 1;
  }
}
