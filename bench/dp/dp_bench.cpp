// Data-parallel training under mpirun: what each rank sends per step against ZeRO's
// theoretical volumes, and tokens/s with the step time split into compute, communication and
// I/O.
//
//   build/bench/dp/dp_bench --dir /tmp/dp                     (world 1)
//   mpirun -np 2 build/bench/dp/dp_bench --dir /tmp/dp        (world 2)
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

Run run_config(int stage, bool nvme, const std::string& dir, const train::DemoDatasetFiles& data,
               int steps, int warmup, comm::Comm& c, comm::Comm& ctl) {
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
  const model::LlamaConfig mc = model::LlamaConfig::from_json(
      R"({"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 6,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256,
          "max_position_embeddings": 256})",
      "dp_bench model");
  config::AutoContext ctx;
  ctx.hidden_size = mc.hidden_size;
  ctx.total_steps = steps + warmup;
  ctx.world_size = c.world_size();
  config::resolve_auto(cfg, ctx);

  train::TrainerOptions o;
  o.train_data = data.train;
  o.steps = steps + warmup;
  o.seq_len = 256;
  o.progress_out = nullptr;
  o.comm = &c;
  o.control_comm = &ctl;
  Run r;
  comm::CommTraffic t0;
  std::chrono::steady_clock::time_point start;
  int done = 0;
  o.on_step = [&](const train::StepMetrics&) {
    if (++done == warmup) {
      t0 = c.traffic();
      start = std::chrono::steady_clock::now();
    }
  };
  train::Trainer tr(cfg, mc, o);
  if (warmup == 0) {  // measured from the first step
    t0 = c.traffic();
    start = std::chrono::steady_clock::now();
  }
  tr.run();
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const comm::CommTraffic t1 = c.traffic();
  r.step_s = wall / steps;
  r.tokens_per_s = static_cast<double>(tr.tokens_per_step()) * steps / wall;
  r.comm_s = (t1.seconds - t0.seconds) / steps;
  r.sent.all_gather = (t1.all_gather - t0.all_gather) / steps;
  r.sent.all_to_all = (t1.all_to_all - t0.all_to_all) / steps;
  r.sent.all_reduce = (t1.all_reduce - t0.all_reduce) / steps;
  r.sent.reduce_scatter = (t1.reduce_scatter - t0.reduce_scatter) / steps;
  r.sent.broadcast = (t1.broadcast - t0.broadcast) / steps;
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
  bool json = false;
  app.add_option("--dir", dir,
                 "directory in which each rank makes and removes one of its own (data, swap "
                 "files)");
  app.add_option("--steps", steps, "measured steps per configuration");
  app.add_option("--warmup", warmup, "steps before measuring");
  app.add_flag("--json", json, "one JSON line per configuration");
  CLI11_PARSE(app, argc, argv);
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
        "world %d, bf16 Llama (hidden 512, 6 layers), micro-batch 4 x 256 tokens per "
        "rank; state 'offload': stages 1-2 optimizer on the host, stage 3 parameters and "
        "optimizer in NVMe swap files\n"
        "%-5s %-6s %12s %12s %12s %9s %10s %8s %8s %8s %8s\n",
        world, "stage", "state", "all_to_all", "all_gather", "others", "x ZeRO", "tokens/s",
        "step s", "comm s", "io s", "compute");
  for (int stage : {1, 2, 3}) {
    const Run mem = run_config(stage, false, mine, data, steps, warmup, c, ctl);
    const Run disk = run_config(stage, true, mine, data, steps, warmup, c, ctl);
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
