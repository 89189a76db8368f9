// Data-parallel training under mpirun: what each rank sends per step against ZeRO's
// theoretical volumes, and tokens/s with the step time split into compute, communication and
// I/O.
//
//   build/bench/dp/dp_bench --dir /tmp/dp                     (world 1)
//   mpirun -np 2 build/bench/dp/dp_bench --dir /tmp/dp        (world 2)
//   [--hidden 512] [--layers 6] [--seq 256] [--steps 4] [--warmup 1] [--json]
//
// For each ZeRO stage 1, 2, 3 it trains the same model twice, state in memory and offloaded
// (stages 1-2: optimizer in host memory; stage 3: parameters and optimizer in NVMe swap
// files), and prints per
// rank and step:
//   - bytes sent by each collective (comm::CommTraffic), and the elements moved against
//     ZeRO's volumes of (world-1)/world x {2 psi (stages 1-2), 3 psi (stage 3)}, psi the padded
//     parameter count: gradients are exchanged in fp32 (all_to_all, per micro-batch),
//     parameters gathered in their dtype;
//   - tokens/s of the job; the step time split into communication (time inside collectives),
//     offload (offloaded run minus in-memory run: I/O and host copies) and compute (the rest
//     of the in-memory step).
// Rank 0 prints; one JSON line per configuration with --json.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "bench/common/scratch.hpp"
#include "engine/comm/mpi_comm.hpp"
#include "engine/config/config.hpp"
#include "engine/train/demo_data.hpp"
#include "engine/train/trainer.hpp"
#include "tools/blas/blas_kernels.hpp"
#include "tools/env_settings.hpp"

namespace {

using namespace outcore;
namespace fs = std::filesystem;

struct Run {
  double step_s = 0, tokens_per_s = 0, comm_s = 0;
  comm::CommTraffic sent;  // per step
  uint64_t padded = 0;
  int param_bytes = 4;
};

// The model's size (--hidden, --layers, --seq).
struct Shape {
  int hidden = 512, layers = 6, seq = 256;
};

Run run_config(int stage, bool nvme, const std::string& dir, const train::DemoDatasetFiles& data,
               const Shape& shape, int steps, int warmup, comm::Comm& c, comm::Comm& ctl) {
  const std::string swap = dir + "/swap";
  fs::create_directories(swap);
  nlohmann::json z = {{"stage", stage}};
  if (nvme && stage == 3) {
    z["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", swap}};
    z["offload_param"] = {{"device", "nvme"}, {"nvme_path", swap}};
  } else if (nvme) {
    z["offload_optimizer"] = {{"device", "cpu"}};  // NVMe optimizer state needs stage 3
  }
  const nlohmann::json ds = {{"train_micro_batch_size_per_gpu", 4},
                             {"gradient_accumulation_steps", 1},
                             {"bf16", {{"enabled", true}}},
                             {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}},
                             {"zero_optimization", z}};
  config::Config cfg = config::parse_config(ds.dump(), "dp_bench").config;
  // Llama's proportions: intermediate about 2.75 x hidden (a multiple of 64), heads of 64.
  const int intermediate = (shape.hidden * 11 / 4 + 63) / 64 * 64;
  const model::LlamaConfig mc = model::LlamaConfig::from_json(
      nlohmann::json{{"hidden_size", shape.hidden},
                     {"intermediate_size", intermediate},
                     {"num_hidden_layers", shape.layers},
                     {"num_attention_heads", shape.hidden / 64},
                     {"num_key_value_heads", std::max(1, shape.hidden / 128)},
                     {"vocab_size", 256},
                     {"max_position_embeddings", shape.seq}}
          .dump(),
      "dp_bench model");
  config::AutoContext ctx;
  ctx.hidden_size = mc.hidden_size;
  ctx.total_steps = steps + warmup;
  ctx.world_size = c.world_size();
  config::resolve_auto(cfg, ctx);

  train::TrainerOptions o;
  o.train_data = data.train;
  o.steps = steps + warmup;
  o.seq_len = shape.seq;
  o.progress_out = nullptr;
  o.comm = &c;
  o.control_comm = &ctl;
  Run r;
  // Time (and the seconds inside collectives) from the end of the last warm-up step to the end
  // of the run. Bytes over the whole run (from the trainer's start), per step: a step's publication
  // (all_gather, stages 1-2) runs after its on_step, under the next step's forward, so a window
  // that starts at an on_step would take in a step more of it (and, being asynchronous, part of
  // one).
  comm::CommTraffic before, t0;
  std::chrono::steady_clock::time_point start;
  int done = 0;
  o.on_step = [&](const train::StepMetrics&) {
    if (++done == warmup) {
      t0 = c.traffic();
      start = std::chrono::steady_clock::now();
    }
  };
  train::Trainer tr(cfg, mc, o);
  before = t0 = c.traffic();  // after the initial parameters' gather
  if (warmup == 0) start = std::chrono::steady_clock::now();
  tr.run();
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const comm::CommTraffic t1 = c.traffic();
  const auto run_steps = static_cast<uint64_t>(steps + warmup);
  r.step_s = wall / steps;
  r.tokens_per_s = static_cast<double>(tr.tokens_per_step()) * steps / wall;
  r.comm_s = (t1.seconds - t0.seconds) / steps;
  r.sent.all_gather = (t1.all_gather - before.all_gather) / run_steps;
  r.sent.all_to_all = (t1.all_to_all - before.all_to_all) / run_steps;
  r.sent.all_reduce = (t1.all_reduce - before.all_reduce) / run_steps;
  r.sent.reduce_scatter = (t1.reduce_scatter - before.reduce_scatter) / run_steps;
  r.sent.broadcast = (t1.broadcast - before.broadcast) / run_steps;
  r.padded = tr.engine().plan().padded_elems;
  r.param_bytes = 2;
  return r;
}

}  // namespace

static int run_bench(int argc, char** argv) {
  outcore::tools::select_blas_kernels(argv);
  outcore::tools::apply_environment_settings();
  CLI::App app{"data-parallel training: bytes per collective vs ZeRO volumes, tokens/s split"};
  std::string dir = "/tmp/outcore_dp_bench";
  int steps = 4, warmup = 1;
  Shape shape;
  bool json = false;
  app.add_option("--dir", dir,
                 "directory in which each rank makes and removes one of its own (data, swap "
                 "files)");
  app.add_option("--steps", steps, "measured steps per configuration");
  app.add_option("--warmup", warmup, "steps before measuring");
  app.add_option("--hidden", shape.hidden, "hidden size, a multiple of 64 (default 512)")
      ->check(CLI::Range(64, 1 << 16));
  app.add_option("--layers", shape.layers, "decoder layers (default 6)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--seq", shape.seq, "tokens per sequence (default 256)")
      ->check(CLI::Range(2, 1 << 16));
  app.add_flag("--json", json, "one JSON line per configuration");
  CLI11_PARSE(app, argc, argv);
  if (shape.hidden % 64 != 0) {
    std::fprintf(stderr, "dp_bench: --hidden %d: allowed: a multiple of 64\n", shape.hidden);
    return 2;
  }
  comm::MpiComm c, ctl;
  const int rank = c.rank(), world = c.world_size();
  // Each rank writes in a directory of its own under --dir, removed whole at the end.
  const bench::ScratchDir scratch(dir, fmt::format("dp_bench-rank{}", rank));
  const std::string mine = scratch.path().string();
  train::DemoDataOptions dopt;
  dopt.train_tokens = 4u << 20;
  dopt.val_tokens = 0;
  const train::DemoDatasetFiles data = train::write_demo_dataset(mine + "/data", dopt);
  if (rank == 0 && !json)
    std::printf(
        "world %d, bf16 Llama (hidden %d, %d layers), micro-batch 4 x %d tokens per "
        "rank; state 'offload': stages 1-2 optimizer on the host, stage 3 parameters and "
        "optimizer in NVMe swap files\n"
        "%-5s %-6s %12s %12s %12s %9s %10s %8s %8s %8s %8s\n",
        world, shape.hidden, shape.layers, shape.seq, "stage", "state", "all_to_all", "all_gather",
        "others", "x ZeRO", "tokens/s", "step s", "comm s", "io s", "compute");
  for (int stage : {1, 2, 3}) {
    const Run mem = run_config(stage, false, mine, data, shape, steps, warmup, c, ctl);
    const Run disk = run_config(stage, true, mine, data, shape, steps, warmup, c, ctl);
    for (const auto& [name, r] : {std::pair{"memory", mem}, std::pair{"offload", disk}}) {
      const double w = world;
      const double zero_elems =
          (stage == 3 ? 3.0 : 2.0) * static_cast<double>(r.padded) * (w - 1) / w;
      const double moved_elems = static_cast<double>(r.sent.all_to_all) / 4.0 +
                                 static_cast<double>(r.sent.all_gather) / r.param_bytes;
      const double ratio = zero_elems > 0 ? moved_elems / zero_elems : 0.0;
      const uint64_t others = r.sent.all_reduce + r.sent.reduce_scatter + r.sent.broadcast;
      const double io = std::string(name) == "offload" ? std::max(0.0, r.step_s - mem.step_s) : 0.0;
      const double compute = std::max(0.0, mem.step_s - mem.comm_s);
      if (rank != 0) continue;
      if (json) {
        std::printf("%s\n", nlohmann::json{{"world", world},
                                           {"stage", stage},
                                           {"state", name},
                                           {"all_to_all_bytes", r.sent.all_to_all},
                                           {"all_gather_bytes", r.sent.all_gather},
                                           {"other_bytes", others},
                                           {"elements_vs_zero", ratio},
                                           {"tokens_per_s", r.tokens_per_s},
                                           {"step_s", r.step_s},
                                           {"comm_s", r.comm_s},
                                           {"io_s", io},
                                           {"compute_s", compute}}
                                .dump()
                                .c_str());
      } else {
        std::printf("%-5d %-6s %12llu %12llu %12llu %9.3f %10.0f %8.3f %8.3f %8.3f %8.3f\n", stage,
                    name, static_cast<unsigned long long>(r.sent.all_to_all),
                    static_cast<unsigned long long>(r.sent.all_gather),
                    static_cast<unsigned long long>(others), ratio, r.tokens_per_s, r.step_s,
                    r.comm_s, io, compute);
      }
      std::fflush(stdout);
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  return outcore::bench::main_removing_scratch("dp_bench", run_bench, argc, argv);
}
