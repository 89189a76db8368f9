// Checkpoint save and load throughput against the drive, and peak RSS of each phase.
//
// A ZeRO-3 engine with parameters, optimizer state and gradients on NVMe (the larger-than-RAM
// setup of bench/zero/zero_large_bench) is saved to a checkpoint, verified, and loaded back;
// then its master weights are exported to Hugging Face safetensors. The drive's sequential
// write and read are measured in the same run on a scratch file of --ref-gib GiB with fio
// (io_uring, O_DIRECT, the config's block size and queue depth) when it is installed, and with
// outcore's aio engine otherwise. Ratios: save GB/s / drive write GB/s, load GB/s / drive read.
// Peak RSS is measured per phase (the kernel's high-water mark reset through
// /proc/self/clear_refs) and reported as growth over the RSS before the phase.
//
//   ckpt_bench [--hidden 2560] [--intermediate 6912] [--layers 20] [--heads 20] [--kv-heads 4]
//              [--vocab 32000] [--dir DIR] [--ref-gib 8] [--no-export]
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "bench/common/scratch.hpp"
#include "common/aligned_buffer.hpp"
#include "common/log.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/hf.hpp"
#include "engine/comm/local_comm.hpp"
#include "engine/config/config.hpp"
#include "engine/device/device.hpp"
#include "engine/model/model.hpp"
#include "engine/train/checkpointing.hpp"
#include "engine/zero/zero.hpp"
#include "tools/aio_bench/measure.hpp"
#include "tools/blas/blas_kernels.hpp"
#include "tools/env_settings.hpp"

namespace {

using namespace outcore;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// VmRSS or VmHWM of this process in bytes.
uint64_t status_bytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string k;
  uint64_t kb = 0;
  while (in >> k) {
    if (k == key) {
      in >> kb;
      return kb * 1024;
    }
    in.ignore(1 << 20, '\n');
  }
  return 0;
}

// Measures a phase: wall time and the peak RSS growth over the RSS at its start.
struct Phase {
  Clock::time_point t0 = Clock::now();
  uint64_t rss0;
  Phase() {
    std::ofstream("/proc/self/clear_refs") << "5";  // reset VmHWM to the current RSS
    rss0 = status_bytes("VmRSS:");
    t0 = Clock::now();
  }
  double seconds() const { return seconds_since(t0); }
  double peak_growth_gib() const {
    const uint64_t hwm = status_bytes("VmHWM:");
    return hwm > rss0 ? static_cast<double>(hwm - rss0) / (1ull << 30) : 0.0;
  }
};

struct DriveRef {
  double write_gbps = 0, read_gbps = 0;
  std::string tool;
};

DriveRef measure_drive(const fs::path& dir, double gib, const aio::Options& opt) {
  const uint64_t size = static_cast<uint64_t>(gib * (1ull << 30)) / (64ull << 20) * (64ull << 20);
  const fs::path path = dir / "drive_reference.bin";
  DriveRef ref;
  aio::File f = aio::File::open(
      path, {.access = aio::Access::kReadWrite, .create = true, .truncate = true, .direct = true});
  f.preallocate(size);
  AlignedBuffer buf(64ull << 20);
  auto never = [] { return false; };
  aio_bench::Workload w{.write = true, .file_size = size};
  if (aio_bench::fio_available()) {
    ref.tool = "fio";
    ref.write_gbps = aio_bench::measure_fio(path.string(), opt, w, never).gbps;
    w.write = false;
    ref.read_gbps = aio_bench::measure_fio(path.string(), opt, w, never).gbps;
  } else {
    ref.tool = "aio engine";
    ref.write_gbps = aio_bench::measure_engine(f, {buf.data(), buf.size()}, opt, w, never).gbps;
    w.write = false;
    ref.read_gbps = aio_bench::measure_engine(f, {buf.data(), buf.size()}, opt, w, never).gbps;
  }
  f.close();
  fs::remove(path);
  return ref;
}

// The writer alone: the optimizer file a save writes, filled without reading any state.
void writer_alone(const fs::path& root, const model::LlamaModel& model, const aio::Options& aio,
                  double ref_write_gbps) {
  ckpt::SaveDir sd(root / "writer_only");
  ckpt::WriterOptions wo;
  wo.aio = aio;
  wo.verify = false;  // the writes alone; a save's read-back is timed with the save below
  ckpt::CheckpointWriter w(sd, "global_step0", wo);
  std::vector<ckpt::Segment> segs;
  constexpr uint64_t kPiece = uint64_t{8} << 20;  // as engine/train/checkpointing.cpp
  for (const model::UnitLayout& ul : model.layout().units)
    for (uint64_t b = 0; b < ul.padded_numel; b += kPiece)
      for (int k = 0; k < 3; ++k)
        segs.push_back({ul.index, static_cast<ckpt::ArrayKind>(k), DType::F32, b,
                        std::min(kPiece, ul.padded_numel - b), 0});
  const int f = w.add_data_file("rank0/optimizer.bin", 0, "optimizer", segs);
  Phase p;
  w.prepare();
  const double t_prep = p.seconds();
  double bytes = 0;
  for (int i = 0; i < static_cast<int>(segs.size()); ++i) {
    std::span<std::byte> b = w.stage(f, i);
    std::memset(b.data(), i, b.size());
    w.submit(f, i);
    bytes += static_cast<double>(b.size());
  }
  ckpt::Manifest man;
  for (const model::UnitLayout& ul : model.layout().units)
    man.units.push_back({ul.name, ul.numel, ul.padded_numel});
  try {
    w.commit(man);
  } catch (const Error&) {
    // The manifest lacks the params segments; the data is written and synced by then.
  }
  const double s = p.seconds();
  std::printf("writer alone: %.1f GB in %.1f s = %.2f GB/s = %.2fx drive write (prepare %.2f s)\n",
              bytes / 1e9, s, bytes / s / 1e9, bytes / s / 1e9 / ref_write_gbps, t_prep);
  fs::remove_all(root / "writer_only");
}

}  // namespace

static int run_bench(int argc, char** argv) {
  outcore::tools::select_blas_kernels(argv);
  outcore::tools::apply_environment_settings();
  int64_t hidden = 2560, intermediate = 6912, layers = 20, heads = 20, kv_heads = 4, vocab = 32000;
  double ref_gib = 0;
  std::string offload = "nvme";
  bool no_export = false;
  int rounds = 2;
  std::string dir = std::string(OUTCORE_BINARY_DIR) + "/ckpt_bench";
  CLI::App app("checkpoint save / verify / load / export throughput vs the drive, peak RSS");
  app.add_option("--hidden", hidden);
  app.add_option("--intermediate", intermediate);
  app.add_option("--layers", layers);
  app.add_option("--heads", heads);
  app.add_option("--kv-heads", kv_heads);
  app.add_option("--vocab", vocab);
  app.add_option("--dir", dir,
                 "directory on the drive in which a scratch directory of the benchmark's own "
                 "(swap, checkpoint, export) is made and removed");
  app.add_option("--ref-gib", ref_gib,
                 "size of the drive reference file (default: the checkpoint's size, so that no "
                 "cache holds it)");
  app.add_option("--offload", offload,
                 "where parameters and optimizer state live: nvme (the save reads them from the "
                 "same drive) or cpu (host memory: the save only writes)")
      ->check(CLI::IsMember({"nvme", "cpu"}));
  app.add_flag("--no-export", no_export, "skip the safetensors export");
  app.add_option("--rounds", rounds, "drive reference + save + verify + load, repeated");
  CLI11_PARSE(app, argc, argv);
  if (const char* l = std::getenv("OUTCORE_LOG_LEVEL")) log::init(l);

  model::LlamaConfig mc;
  mc.hidden_size = hidden;
  mc.intermediate_size = intermediate;
  mc.num_hidden_layers = layers;
  mc.num_attention_heads = heads;
  mc.num_key_value_heads = kv_heads;
  mc.head_dim = hidden / heads;
  mc.vocab_size = vocab;
  mc.max_position_embeddings = 128;
  const model::LlamaModel model(mc, {.micro_batch = 1,
                                     .seq_len = 128,
                                     .param_dtype = DType::BF16,
                                     .activation_checkpointing = true});
  // Everything goes in a directory of its own under --dir, removed whole at the end.
  const bench::ScratchDir scratch(dir, "ckpt_bench");
  const fs::path root = scratch.path();
  fs::create_directories(root / "swap");
  config::Config cfg =
      config::parse_config(
          fmt::format(R"({{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "bf16": {{"enabled": true}},
        "zero_optimization": {{"stage": 3, "sub_group_size": 10000000,
          "offload_param": {{"device": "{1}", "nvme_path": "{0}", "buffer_count": 3{2}}},
          "offload_optimizer": {{"device": "{1}", "nvme_path": "{0}", "buffer_count": 3,
                                 "pipeline_read": true, "pipeline_write": true}}}},
        "aio": {{"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 1}},
        "outcore": {{"device_memory_mb": 2048}}}})",
                      (root / "swap").string(), offload,
                      // nvme: every parameter partition in a swap file, none in host memory
                      offload == "nvme" ? R"(, "max_in_cpu": 0)" : ""),
          "ckpt_bench")
          .config;
  config::resolve_auto(cfg, {});
  const aio::Options aio = zero::aio_options(cfg.aio);
  const double params = static_cast<double>(mc.num_parameters());
  if (ref_gib <= 0) ref_gib = std::max(1.0, params * 14 / (1ull << 30));
  std::printf(
      "model: %.2fB parameters, training state %.1f GiB (18 B/param with fp32 gradient "
      "accumulators); checkpoint %.1f GB (14 B/param)\n",
      params / 1e9, params * 18 / (1ull << 30), params * 14 / 1e9);

  if (std::getenv("CKPT_BENCH_WRITER_FIRST")) writer_alone(root, model, aio, 1.0);
  device::CpuDevice dev({.memory_budget_bytes = cfg.outcore.device_memory_mb << 20});
  comm::LocalComm comm;
  zero::EngineOptions eo;
  eo.gradients =
      offload == "nvme" ? zero::GradientPlacement::kNvme : zero::GradientPlacement::kAuto;
  auto t0 = Clock::now();
  zero::ZeroEngine engine(cfg, model, dev, comm, 2024, eo);
  std::printf("engine initialised in %.1f s, RSS %.2f GiB\n", seconds_since(t0),
              static_cast<double>(status_bytes("VmRSS:")) / (1ull << 30));
  std::fflush(stdout);

  {
    // What streaming the state out of its tiers costs alone (the save's producer side).
    size_t cap = 0;
    for (int u = 0; u < model.num_units(); ++u) cap = std::max(cap, engine.partition_numel(u));
    AlignedBuffer a(cap * 4), b(cap * 4), c(cap * 4), d(cap * 2);
    Phase p;
    double bytes = 0;
    for (int u = 0; u < model.num_units(); ++u) {
      const size_t n = engine.partition_numel(u);
      engine.read_unit_state(u, a.as<float>().first(n), b.as<float>().first(n),
                             c.as<float>().first(n));
      engine.read_param_partition(u, {d.data(), n * 2});
      bytes += n * 14.0;
    }
    const double s = p.seconds();
    std::printf("state read from its tiers alone: %.1f GB in %.1f s = %.2f GB/s\n", bytes / 1e9, s,
                bytes / s / 1e9);
  }
  std::optional<ckpt::Checkpoint> ck_holder;
  for (int round = 1; round <= rounds; ++round) {
    std::printf("-- round %d\n", round);
    fs::remove_all(root / "ckpt");
    const DriveRef ref = measure_drive(root, ref_gib, aio);
    std::printf(
        "drive (%s, %.0f GiB sequential, 1 MiB blocks, queue depth 32): write %.2f GB/s, "
        "read %.2f GB/s\n",
        ref.tool.c_str(), ref_gib, ref.write_gbps, ref.read_gbps);
    std::fflush(stdout);
    writer_alone(root, model, aio, ref.write_gbps);
    const train::CheckpointTexts texts{config::to_json(cfg).dump(2), mc.to_json(), "{}\n"};
    ckpt::SaveResult saved;
    {
      ckpt::SaveDir sd(root / "ckpt");
      ckpt::WriterOptions wo;
      wo.aio = aio;
      Phase p;
      saved = train::save_engine_checkpoint(sd, "global_step0", 0, engine, 0, 1, 3, texts, wo);
      const double s = p.seconds(), gbps = static_cast<double>(saved.bytes) / s / 1e9;
      std::printf("save:   %.1f GB in %.1f s = %.2f GB/s = %.2fx drive write; peak RSS +%.2f GiB\n",
                  saved.bytes / 1e9, s, gbps, gbps / ref.write_gbps, p.peak_growth_gib());
      std::fflush(stdout);
    }
    ck_holder.emplace(ckpt::Checkpoint::open(root / "ckpt", {aio, nullptr}));
    ckpt::Checkpoint& ck = *ck_holder;
    {
      Phase p;
      ck.verify();
      const double s = p.seconds(), gbps = static_cast<double>(saved.bytes) / s / 1e9;
      std::printf("verify: %.1f GB in %.1f s = %.2f GB/s = %.2fx drive read; peak RSS +%.2f GiB\n",
                  saved.bytes / 1e9, s, gbps, gbps / ref.read_gbps, p.peak_growth_gib());
      std::fflush(stdout);
    }
    {
      Phase p;
      const uint64_t before = ck.bytes_read();
      train::load_engine_checkpoint(ck, engine);
      const double s = p.seconds();
      const double gb = static_cast<double>(ck.bytes_read() - before) / 1e9;
      std::printf(
          "load:   %.1f GB in %.1f s = %.2f GB/s = %.2fx drive read%s; peak RSS +%.2f GiB\n", gb, s,
          gb / s, gb / s / ref.read_gbps, offload == "nvme" ? " (while writing it to swap)" : "",
          p.peak_growth_gib());
      std::fflush(stdout);
    }
  }
  if (!no_export) {
    Phase p;
    ckpt::ExportOptions eo2;
    eo2.dtype = DType::BF16;
    ckpt::write_hf_model(
        mc,
        [&](int unit, uint64_t begin, uint64_t count, float* out) {
          ck_holder->read_slab(unit, ckpt::ArrayKind::kMaster, begin, count,
                               {reinterpret_cast<std::byte*>(out), count * 4});
        },
        root / "export", eo2);
    const double s = p.seconds();
    std::printf(
        "export: %.1f GB of bf16 safetensors in %.1f s (%.2f GB/s written); peak RSS "
        "+%.2f GiB\n",
        params * 2 / 1e9, s, params * 2 / 1e9 / s, p.peak_growth_gib());
  }
  return 0;
}

int main(int argc, char** argv) {
  return outcore::bench::main_removing_scratch("ckpt_bench", run_bench, argc, argv);
}
