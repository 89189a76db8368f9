// Training throughput with parameters and optimizer state on NVMe (ZeRO-3, offload_param and
// offload_optimizer nvme, device budget below the model's state) against the same model in
// memory (stage 0), measured in the same run.
//
//   zero_bench [--hidden 512] [--layers 8] [--vocab 8192] [--seq 256] [--micro 2] [--gas 4]
//              [--steps 6] [--dtype bf16|fp32] [--nvme DIR] [--device-fraction 0.25]
//              [--device cpu|cuda] [--trace FILE] [--ref-gib 1] [--clip 1.0]
//              [--step-in-backward] [--keep-params] [--recommended-shape]
//
// The model computes in the dtype `outcore train` takes for the config: bf16 with --dtype bf16
// (config::compute_dtype), fp32 with --dtype fp32.
//
// --recommended-shape trains at the micro-batch and accumulation `outcore estimate` recommends
// for the NVMe run on this machine (bench::recommend_shape: the fewest tokens per step whose
// compute covers every transfer within its device budget, else the closest), from the rates
// measured first (the drive under --nvme with a --ref-gib file, pinned copies on a GPU, the
// GEMM and the model's attention); --micro and --gas are then ignored. Where a GPU computes
// the default shape's step far faster than the drive moves its bytes, this is the shape at
// which the NVMe run can match the in-memory one.
//
// --keep-params keeps the NVMe runs' gathered parameters on the device through each step's
// micro-batches, as far as the budget holds them (stage3_max_live_parameters and
// stage3_max_reuse_distance 1e12, as configs/zero3_nvme_infinity.json); by default every use
// fetches again (reuse distance 0).
//
// --step-in-backward sets outcore.step_in_backward for the overlapped NVMe run: its optimizer
// step starts during the last backward of a step when the multiplier without clipping is
// expected to hold (--clip 0: always).
//
// Where the NVMe run cannot hide its I/O (a GPU computes the step faster than the drive moves
// its bytes), the ratio to the in-memory run measures the drive, not the engine: the drive is
// measured first (bench/zero/step_bounds.hpp, --ref-gib, 0 to skip) and the NVMe run's step is
// also set against the larger of the in-memory step and the drive's time for the step's bytes.
//
// With --device cuda the model computes on GPU 0 and the reference keeps everything in memory
// that a GPU run can: parameters on the GPU, optimizer state in host memory (stage 1,
// offload_optimizer cpu), since CPU Adam cannot step state on the device. On the simulated
// device (cpu, the default) the reference is stage 0.
//
// Three engines train the same data: in memory, NVMe with the optimizer step overlapping the
// next forward (the default), and NVMe with the sequential step (EngineOptions::overlap_step
// false), in turns of --block consecutive steps each so that all see the same machine load.
// A turn is timed from its first forward to the end of its last step (wait_step: an
// overlapped step's remaining updates count in the turn that started them); the overlap runs
// under the forward of the steps of the same turn. The ratio is the median of per-turn ratios
// and the ratio of total times. The losses of the three runs must be bit-identical.
//
// The process's CPU time (user + system, getrusage) is taken per turn too: with every
// hardware thread busy (cores busy ~= hardware threads), a run that needs more CPU seconds per
// step cannot be faster than (its CPU seconds / the other's) allows, whatever it overlaps.
#include <fmt/format.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "bench/common/scratch.hpp"
#include "bench/zero/step_bounds.hpp"
#include "common/error.hpp"
#include "common/trace.hpp"
#include "engine/comm/local_comm.hpp"
#include "engine/config/config.hpp"
#include "engine/device/device.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/zero.hpp"
#include "tools/blas/blas_kernels.hpp"
#include "tools/env_settings.hpp"

namespace {

using namespace outcore;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

config::Config make_config(const std::string& json) {
  config::Config cfg = config::parse_config(json, "zero_bench").config;
  config::resolve_auto(cfg, {});
  return cfg;
}

struct Runner {
  std::string name;
  config::Config cfg;
  std::unique_ptr<device::Device> dev;
  comm::LocalComm comm;
  std::unique_ptr<zero::ZeroEngine> engine;
  std::vector<double> turns;  // seconds of each timed turn
  std::vector<float> losses;
  double fb_seconds = 0, step_seconds = 0, cpu = 0;
  int in_backward = 0;  // steps whose updates started during the backward and stood

  Runner(std::string n, const std::string& json, const model::LlamaModel& model, uint64_t budget,
         bool cuda, bool overlap = true)
      : name(std::move(n)), cfg(make_config(json)) {
    if (cuda) {
      dev = device::make_cuda_device({.memory_budget_bytes = budget});
    } else {
      dev = std::make_unique<device::CpuDevice>(device::CpuDeviceOptions{budget});
    }
    zero::EngineOptions eo;
    eo.overlap_step = overlap;
    engine = std::make_unique<zero::ZeroEngine>(cfg, model, *dev, comm, 1234, eo);
  }

  // `count` consecutive steps from step `first`, timed as one turn.
  void train_turn(const model::LlamaModel& model, int first, int count, int64_t gas, bool timed) {
    const auto t0 = Clock::now();
    const double c0 = bench::cpu_seconds();
    for (int t = first; t < first + count; ++t) train_step(model, t, gas, timed);
    const auto tw = Clock::now();
    engine->wait_step();
    if (!timed) return;
    step_seconds += seconds_since(tw);
    turns.push_back(seconds_since(t0));
    cpu += bench::cpu_seconds() - c0;
  }

  void train_step(const model::LlamaModel& model, int t, int64_t gas, bool timed) {
    const size_t n = static_cast<size_t>(model.tokens());
    const auto t0 = Clock::now();
    const zero::StepParams sp = zero::step_params(cfg, 1e-3, static_cast<uint64_t>(t), 1.0);
    float loss = 0;
    for (int64_t k = 0; k < gas; ++k) {
      std::vector<int32_t> tok(n + 1);
      uint64_t x = static_cast<uint64_t>(t * 1000 + k) * 2862933555777941757ull + 3037000493ull;
      for (size_t i = 0; i < tok.size(); ++i) {
        if (i % 64 == 0) {
          x = x * 2862933555777941757ull + 3037000493ull;
          tok[i] = static_cast<int32_t>((x >> 33) % model.config().vocab_size);
        } else {
          tok[i] = static_cast<int32_t>((int64_t{tok[i - 1]} * 5 + 3) % model.config().vocab_size);
        }
      }
      if (k == gas - 1) engine->expect_step(sp);
      loss += engine->forward_backward(tok.data(), tok.data() + 1, 1.0f / gas, k == 0);
    }
    const auto t1 = Clock::now();
    const zero::StepResult r = engine->step(sp);
    if (!timed) return;
    if (r.in_backward == zero::StepResult::InBackward::kCommitted) ++in_backward;
    step_seconds += seconds_since(t1);
    fb_seconds += std::chrono::duration<double>(t1 - t0).count();
    losses.push_back(loss / gas);
  }
};

}  // namespace

int main(int argc, char** argv) {
  outcore::tools::select_blas_kernels(argv);
  outcore::tools::apply_environment_settings();
  int64_t hidden = 512, layers = 8, vocab = 8192, seq = 256, micro = 2, gas = 4;
  int steps = 6, warmup = 1, block = 3;
  double device_fraction = 0.25, ref_gib = 1;
  std::string dtype = "bf16", device_kind = "cpu", trace_file;
  std::string nvme = std::string(OUTCORE_BINARY_DIR) + "/zero_bench_swap";
  double clip = 1.0;
  bool step_in_backward = false;
  bool keep_params = false;
  bool recommended_shape = false;
  CLI::App app("ZeRO-3 with parameters and optimizer on NVMe vs the same model in memory");
  app.add_option("--hidden", hidden, "hidden size (heads = hidden/64, kv heads = heads/2)");
  app.add_option("--layers", layers, "decoder layers");
  app.add_option("--vocab", vocab, "vocabulary size");
  app.add_option("--seq", seq, "sequence length");
  app.add_option("--micro", micro, "sequences per micro-batch");
  app.add_option("--gas", gas, "micro-batches per optimizer step");
  app.add_option("--steps", steps, "timed steps per engine");
  app.add_option("--warmup", warmup, "untimed steps per engine first");
  app.add_option("--block", block, "consecutive steps per engine turn");
  app.add_option("--dtype", dtype, "bf16 or fp32");
  app.add_option("--nvme", nvme, "swap directory");
  app.add_option("--device-fraction", device_fraction,
                 "device budget of the NVMe run as a fraction of the model state (16 B/param)");
  app.add_option("--device", device_kind, "cpu (the simulated device) or cuda (GPU 0)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--ref-gib", ref_gib,
                 "size of the drive reference file in the swap directory (0: no drive bound)");
  app.add_option("--trace", trace_file,
                 "Chrome trace-event JSON of the NVMe run's last turn (overlapped step)");
  app.add_option("--clip", clip, "gradient_clipping (0: off)");
  app.add_flag("--step-in-backward", step_in_backward,
               "outcore.step_in_backward for the overlapped NVMe run");
  app.add_flag("--keep-params", keep_params,
               "keep the NVMe runs' gathered parameters on the device through each step "
               "(stage3_max_live_parameters and stage3_max_reuse_distance 1e12)");
  app.add_flag("--recommended-shape", recommended_shape,
               "train at the micro-batch and accumulation outcore estimate recommends for the "
               "NVMe run here (--micro and --gas ignored; needs --ref-gib > 0)");
  CLI11_PARSE(app, argc, argv);

  try {
    model::LlamaConfig mc;
    mc.hidden_size = hidden;
    mc.intermediate_size = hidden * 11 / 4 / 64 * 64;
    mc.num_hidden_layers = layers;
    mc.num_attention_heads = hidden / 64;
    mc.num_key_value_heads = std::max<int64_t>(1, hidden / 128);
    mc.head_dim = 64;
    mc.vocab_size = vocab;
    mc.max_position_embeddings = seq;
    const DType dt = dtype == "fp32" ? DType::F32 : DType::BF16;
    const bool cuda = device_kind == "cuda";
    // The model's backend computes on its own device object; the engines' devices (one budget
    // each) hand out memory of the same GPU.
    std::unique_ptr<device::Device> compute_dev;
    if (cuda) compute_dev = device::make_cuda_device();
    const uint64_t params = mc.num_parameters();
    const uint64_t budget = static_cast<uint64_t>(device_fraction * 16.0 * params);
    std::filesystem::create_directories(nvme);

    // The keys every run shares (micro and gas as they stand when it is called).
    auto common_json = [&] {
      return fmt::format(
          R"("train_micro_batch_size_per_gpu": {}, "gradient_accumulation_steps": {},
           "gradient_clipping": {}, "bf16": {{"enabled": {}}},
           "activation_checkpointing": {{"cpu_checkpointing": true}},)",
          micro, gas, clip, dt == DType::BF16 ? "true" : "false");
    };
    auto nvme_json = [&](const std::string& dir, bool in_backward = false) {
      std::filesystem::create_directories(dir);
      return "{" + common_json() +
             (in_backward ? R"("outcore": {"step_in_backward": true},)" : "") +
             fmt::format(R"("zero_optimization": {{"stage": 3,
                  "offload_param": {{"device": "nvme", "nvme_path": "{0}", "max_in_cpu": 0}},
                  "offload_optimizer": {{"device": "nvme", "nvme_path": "{0}",
                                         "pipeline_read": true, "pipeline_write": true}},
                  "stage3_max_reuse_distance": {1}, "stage3_max_live_parameters": {1},
                  "stage3_param_persistence_threshold": 0}},
                  "aio": {{"queue_depth": 16, "intra_op_parallelism": 2}}}})",
                         dir, keep_params ? "1000000000000" : "0");
    };
    if (recommended_shape) {
      if (ref_gib <= 0)
        throw InvalidArgument("--recommended-shape measures the drive: --ref-gib > 0");
      zero::LinkRates rates;
      std::unique_ptr<device::Device> dev, host;
      if (cuda) {
        dev = device::make_cuda_device({.memory_budget_bytes = budget});
      } else {
        dev = std::make_unique<device::CpuDevice>(device::CpuDeviceOptions{budget});
        host = std::make_unique<device::CpuDevice>();
      }
      const auto shape = bench::recommend_shape(
          mc, seq, dt, *dev, cuda ? *compute_dev : *host, budget, nvme, ref_gib,
          zero::GradientPlacement::kAuto, make_config(nvme_json(nvme, step_in_backward)), rates);
      if (!shape)
        throw InvalidArgument("no micro-batch up to 64 fits the NVMe run's device budget");
      micro = shape->first;
      gas = shape->second;
    }
    const model::LlamaModel model(mc,
                                  {.micro_batch = micro,
                                   .seq_len = seq,
                                   .param_dtype = dt,
                                   .compute_dtype = dt,
                                   .activation_checkpointing = true},
                                  cuda ? device::make_backend(*compute_dev) : nullptr);
    const std::string common = common_json();
    Runner mem(
        cuda ? "in memory (stage 1, optimizer in host memory)" : "in memory (stage 0)",
        "{" + common +
            (cuda ? R"("zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})"
                  : R"("zero_optimization": {"stage": 0}})"),
        model, 0, cuda);
    Runner ooc(step_in_backward ? "nvme (stage 3), optimizer step in backward"
                                : "nvme (stage 3, params+optimizer on NVMe)",
               nvme_json(nvme, step_in_backward), model, budget, cuda);
    // The sequential run's swap files: in a directory of its own under --nvme, removed whole.
    const bench::ScratchDir seq_dir(nvme, "zero_bench_sequential");
    Runner seq_step("nvme, sequential optimizer step", nvme_json(seq_dir.path().string()), model,
                    budget, cuda, false);
    std::printf("device: %s\n", ooc.dev->name().c_str());

    std::printf(
        "model: %.1fM parameters, hidden %ld, %ld layers, vocab %ld, %s, seq %ld x micro %ld x gas "
        "%ld = %ld tokens/step\n",
        params / 1e6, hidden, layers, vocab, dtype.c_str(), seq, micro, gas, seq * micro * gas);
    std::printf("nvme run: device budget %.1f MiB (%.2f of the 16 B/param state), swap under %s\n",
                budget / 1048576.0, device_fraction, nvme.c_str());
    std::optional<bench::DriveRates> drive;
    const zero::Plan& plan = ooc.engine->plan();
    const uint64_t plan_read = plan.per_step.nvme_read, plan_write = plan.per_step.nvme_write;
    if (ref_gib > 0) {
      const aio::Options aio = zero::aio_options(ooc.cfg.aio);
      constexpr uint64_t kSpan = 32ull << 20;
      const double read_fraction =
          plan_read + plan_write ? static_cast<double>(plan_read) / (plan_read + plan_write) : 0.5;
      drive = bench::measure_drive(nvme, static_cast<uint64_t>(ref_gib * (1ull << 30)), kSpan,
                                   read_fraction, aio);
      std::printf(
          "drive (aio engine as configured, %.2f GB per pass): write %.2f GB/s, read %.2f "
          "GB/s, mixed %.2f GB/s\n",
          drive->file_bytes / 1e9, drive->write_gbps, drive->read_gbps, drive->mixed_gbps);
    }
    std::vector<Runner*> runners = {&mem, &ooc, &seq_step};
    for (Runner* r : runners) r->train_turn(model, 1, warmup, gas, false);
    const zero::TrafficStats tr0 = ooc.engine->traffic();
    for (int t = warmup + 1; t <= warmup + steps; t += block) {
      const int count = std::min(block, warmup + steps + 1 - t);
      const bool last = t + block > warmup + steps;
      for (Runner* r : runners) {
        const bool traced = last && r == &ooc && !trace_file.empty();
        if (traced) {
          trace::name_thread("trainer");
          trace::start();
        }
        r->train_turn(model, t, count, gas, true);
        if (traced) {
          trace::stop();
          const std::vector<trace::Event> events = trace::events();
          const trace::IoOverlap hidden = trace::io_overlap(events, {"compute"});
          trace::write_json(trace_file, {fmt::format("\"io_hidden_under_compute\": {:.4f}",
                                                     hidden.hidden_fraction)});
          std::printf("trace %s: %zu spans; I/O busy %.2f s, %.1f%% of it under forward/backward\n",
                      trace_file.c_str(), events.size(), hidden.io_busy_s,
                      100 * hidden.hidden_fraction);
        }
      }
      std::printf(
          "steps %d-%d: in memory %.2f s, nvme %.2f s (sequential step %.2f s), ratio %.3f\n", t,
          t + count - 1, mem.turns.back(), ooc.turns.back(), seq_step.turns.back(),
          mem.turns.back() / ooc.turns.back());
      std::fflush(stdout);
    }
    const zero::TrafficStats tr1 = ooc.engine->traffic();
    double tm = 0, to = 0, ts = 0;
    std::vector<double> ratios, ratios_seq;
    for (size_t i = 0; i < mem.turns.size(); ++i) {
      tm += mem.turns[i];
      to += ooc.turns[i];
      ts += seq_step.turns[i];
      ratios.push_back(mem.turns[i] / ooc.turns[i]);
      ratios_seq.push_back(mem.turns[i] / seq_step.turns[i]);
    }
    const double tokens = static_cast<double>(seq * micro * gas * steps);
    auto same = [](const Runner& a, const Runner& b) {
      return a.losses.size() == b.losses.size() &&
             std::memcmp(a.losses.data(), b.losses.data(), a.losses.size() * sizeof(float)) == 0;
    };
    const bool identical = same(mem, ooc) && same(mem, seq_step);
    std::printf("\n%-44s %10s %10s %10s %12s %10s %10s\n", "run", "tokens/s", "fwd+bwd s", "step s",
                "device peak", "cpu s/step", "cores busy");
    for (Runner* r : runners) {
      const double wall = r == &mem ? tm : r == &ooc ? to : ts;
      std::printf("%-44s %10.1f %10.2f %10.2f %9.1f MiB %10.2f %10.2f\n", r->name.c_str(),
                  tokens / wall, r->fb_seconds / steps, r->step_seconds / steps,
                  r->engine->memory().device_peak_bytes / 1048576.0, r->cpu / steps, r->cpu / wall);
    }
    std::printf(
        "nvme traffic: read %.2f GB/s, write %.2f GB/s, h2d %.2f GB/s, d2h %.2f GB/s (%.2f GB "
        "read, "
        "%.2f GB written per step); pinned peak %.1f MiB\n",
        (tr1.nvme_read_bytes - tr0.nvme_read_bytes) / to / 1e9,
        (tr1.nvme_write_bytes - tr0.nvme_write_bytes) / to / 1e9,
        (tr1.h2d_bytes - tr0.h2d_bytes) / to / 1e9, (tr1.d2h_bytes - tr0.d2h_bytes) / to / 1e9,
        (tr1.nvme_read_bytes - tr0.nvme_read_bytes) / 1e9 / steps,
        (tr1.nvme_write_bytes - tr0.nvme_write_bytes) / 1e9 / steps,
        ooc.engine->memory().pinned_peak_bytes / 1048576.0);
    std::printf("losses bit-identical: %s (last %.4f)\n", identical ? "yes" : "NO",
                ooc.losses.back());
    if (step_in_backward)
      std::printf("optimizer step during backward: %d of %d timed steps stood\n", ooc.in_backward,
                  steps);
    std::printf(
        "tokens/s ratio nvme / in memory: median per turn %.3f, total %.3f (goal >= 0.97); with "
        "the "
        "sequential step: median %.3f, total %.3f\n",
        median(ratios), tm / to, median(ratios_seq), tm / ts);
    std::printf(
        "CPU seconds per step: in memory %.2f, nvme %.2f (%.2fx); %u hardware threads: when they "
        "are all busy the nvme run cannot exceed a ratio of about %.3f\n",
        mem.cpu / steps, ooc.cpu / steps, ooc.cpu / mem.cpu, std::thread::hardware_concurrency(),
        mem.cpu / ooc.cpu);
    if (drive) {
      const bench::IoBound io = bench::io_bound(*drive, plan_read, plan_write);
      const double step_mem = tm / steps, step_nvme = to / steps;
      std::printf(
          "drive's time for the NVMe run's %.2f GB read + %.2f GB written per step: serial %.3f s, "
          "mixed %.3f s; NVMe step %.3f s = %.2fx max(in-memory step %.3f s, mixed I/O bound), "
          "%.2fx with the serial bound\n",
          plan_read / 1e9, plan_write / 1e9, io.serial_s, io.mixed_s, step_nvme,
          step_nvme / std::max(step_mem, io.mixed_s), step_mem,
          step_nvme / std::max(step_mem, io.serial_s));
    }
    return identical ? 0 : 1;
  } catch (const std::exception& e) {  // bad input, no GPU, a failed step: one line, exit 1
    std::fprintf(stderr, "zero_bench: %s\n", e.what());
    return 1;
  }
}
