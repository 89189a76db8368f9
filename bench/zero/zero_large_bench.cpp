// Larger than RAM: a model whose training state (16 bytes per parameter) is well above this
// machine's RAM trains a few optimizer steps with ZeRO-3, parameters, optimizer state and
// gradient accumulators on NVMe, under a small device budget, reporting step time, I/O rates,
// the process's peak RSS and the loss.
//
//   zero_large_bench [--hidden 2560] [--intermediate 6912] [--layers 34] [--heads 20]
//                    [--kv-heads 4] [--vocab 32000] [--seq 128] [--micro 1] [--steps 3]
//                    [--nvme DIR] [--device-mb 2048] [--sub-group 10000000] [--lr 2e-3]
#include <fmt/format.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "engine/comm/local_comm.hpp"
#include "engine/config/config.hpp"
#include "engine/device/device.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/zero.hpp"

namespace {

using namespace outcore;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double peak_rss_gib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) * 1024.0 / (1ull << 30);  // ru_maxrss is in KiB
}

double mem_total_gib() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char key[64];
  unsigned long long kb = 0;
  double gib = 0;
  if (std::fscanf(f, "%63s %llu", key, &kb) == 2) gib = static_cast<double>(kb) / (1 << 20);
  std::fclose(f);
  return gib;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t hidden = 2560, intermediate = 6912, layers = 34, heads = 20, kv_heads = 4, vocab = 32000;
  int64_t seq = 128, micro = 1, device_mb = 2048, sub_group = 10'000'000;
  int steps = 3;
  double lr = 2e-3;
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
  app.add_option("--steps", steps);
  app.add_option("--nvme", nvme, "swap directory");
  app.add_option("--device-mb", device_mb, "device budget (outcore.device_memory_mb)");
  app.add_option("--sub-group", sub_group, "zero_optimization.sub_group_size");
  app.add_option("--lr", lr);
  CLI11_PARSE(app, argc, argv);

  model::LlamaConfig mc;
  mc.hidden_size = hidden;
  mc.intermediate_size = intermediate;
  mc.num_hidden_layers = layers;
  mc.num_attention_heads = heads;
  mc.num_key_value_heads = kv_heads;
  mc.head_dim = hidden / heads;
  mc.vocab_size = vocab;
  mc.max_position_embeddings = seq;
  const model::LlamaModel model(mc, {.micro_batch = micro,
                                     .seq_len = seq,
                                     .param_dtype = DType::BF16,
                                     .activation_checkpointing = true});
  std::filesystem::create_directories(nvme);
  config::Config cfg =
      config::parse_config(
          fmt::format(R"({{"train_micro_batch_size_per_gpu": {0}, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "bf16": {{"enabled": true}},
        "activation_checkpointing": {{"cpu_checkpointing": true}},
        "zero_optimization": {{"stage": 3, "sub_group_size": {1},
          "offload_param": {{"device": "nvme", "nvme_path": "{2}", "buffer_count": 3,
                             "max_in_cpu": 0}},
          "offload_optimizer": {{"device": "nvme", "nvme_path": "{2}", "buffer_count": 3,
                                 "pipeline_read": true, "pipeline_write": true}},
          "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 0}},
        "aio": {{"queue_depth": 16, "intra_op_parallelism": 2}},
        "outcore": {{"device_memory_mb": {3}}}}})",
                      micro, sub_group, nvme, device_mb),
          "zero_large_bench")
          .config;
  config::resolve_auto(cfg, {});
  const double params = static_cast<double>(mc.num_parameters());
  std::printf(
      "model: %.2fB parameters; training state %.1f GiB (16 B/param) = %.2fx this machine's "
      "%.1f GiB RAM\n",
      params / 1e9, params * 16 / (1ull << 30), params * 16 / (1ull << 30) / mem_total_gib(),
      mem_total_gib());

  device::CpuDevice dev({.memory_budget_bytes = cfg.outcore.device_memory_mb << 20});
  comm::LocalComm comm;
  zero::EngineOptions eo;
  eo.gradients = zero::GradientPlacement::kNvme;
  auto t0 = Clock::now();
  zero::ZeroEngine engine(cfg, model, dev, comm, 2024, eo);
  std::fputs(zero::format_plan(engine.plan()).c_str(), stdout);
  std::printf("initialised in %.1f s (peak RSS so far %.2f GiB)\n", seconds_since(t0),
              peak_rss_gib());
  std::fflush(stdout);

  const size_t n = static_cast<size_t>(model.tokens());
  for (int t = 1; t <= steps; ++t) {
    std::vector<int32_t> tok(n + 1);
    uint64_t x = static_cast<uint64_t>(t) * 2862933555777941757ull + 3037000493ull;
    for (size_t i = 0; i < tok.size(); ++i) {
      if (i % 32 == 0) {
        x = x * 2862933555777941757ull + 3037000493ull;
        tok[i] = static_cast<int32_t>((x >> 33) % vocab);
      } else {
        tok[i] = static_cast<int32_t>((int64_t{tok[i - 1]} * 5 + 3) % vocab);
      }
    }
    const zero::TrafficStats a = engine.traffic();
    const auto s0 = Clock::now();
    const float loss = engine.forward_backward(tok.data(), tok.data() + 1, 1.0f, true);
    const double fb = seconds_since(s0);
    const auto s1 = Clock::now();
    const zero::StepResult r = engine.step(zero::step_params(cfg, lr, t, 1.0));
    const double st = seconds_since(s1), total = seconds_since(s0);
    const zero::TrafficStats b = engine.traffic();
    std::printf(
        "step %d: loss %.4f%s, grad norm %.3f, %.1f s (fwd+bwd %.1f s, optimizer %.1f s), "
        "nvme read %.1f GB (%.2f GB/s), write %.1f GB (%.2f GB/s), peak RSS %.2f GiB, device "
        "peak %.0f MiB\n",
        t, loss, std::isfinite(loss) ? "" : " (NOT FINITE)", r.grad_norm, total, fb, st,
        (b.nvme_read_bytes - a.nvme_read_bytes) / 1e9,
        (b.nvme_read_bytes - a.nvme_read_bytes) / 1e9 / total,
        (b.nvme_write_bytes - a.nvme_write_bytes) / 1e9,
        (b.nvme_write_bytes - a.nvme_write_bytes) / 1e9 / total, peak_rss_gib(),
        engine.memory().device_peak_bytes / 1048576.0);
    std::fflush(stdout);
  }
  std::printf("pinned pool peak %.0f MiB of %.0f MiB\n",
              engine.memory().pinned_peak_bytes / 1048576.0,
              engine.memory().pinned_budget_bytes / 1048576.0);
  return 0;
}
