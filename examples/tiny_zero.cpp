// tiny_zero: the ZeRO engine on its own. A tiny Llama (2 layers, hidden 64, 256-token
// vocabulary) trains for a few steps on synthetic token streams with ZeRO stage 3, on the
// simulated device (CpuDevice) of a single rank (LocalComm), with parameters and optimizer
// state offloaded to NVMe swap files (or host memory).
//
//   build/bin/tiny_zero [nvme|cpu|none] [DIR]   # where offloaded state lives (default nvme);
//                                               # swap files go under DIR (default $TMPDIR or /tmp)
//
// Prints the loss of every step. Exit 0 when the loss fell by a third, 1 otherwise or on error.
#include <stdlib.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/comm/local_comm.hpp"
#include "engine/config/config.hpp"
#include "engine/device/device.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/zero.hpp"

namespace fs = std::filesystem;
using namespace outcore;

constexpr int kSteps = 30;

// A fresh directory under `parent`, removed with everything in it at scope exit.
class ScratchDir {
 public:
  explicit ScratchDir(const fs::path& parent) {
    std::string tmpl = (parent / "tiny_zero.XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) throw IoError(tmpl, errno, "mkdtemp");
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A DeepSpeed config: stage 3, parameters and optimizer state on `offload` ("nvme": under `dir`).
config::Config make_config(const std::string& offload, const std::string& dir) {
  nlohmann::json ds = nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3}
  })");
  nlohmann::json& zero = ds["zero_optimization"];
  zero["offload_param"] = zero["offload_optimizer"] = {{"device", offload}};
  if (offload == "nvme") {
    zero["offload_param"]["nvme_path"] = zero["offload_optimizer"]["nvme_path"] = dir;
    // Every parameter partition in a swap file: DeepSpeed's default, 1e9 elements, would keep
    // all of a tiny model's parameters in host memory.
    zero["offload_param"]["max_in_cpu"] = 0;
  }
  config::Config cfg = config::parse_config(ds.dump(), "tiny_zero").config;
  config::resolve_auto(cfg, {});  // fills "auto" values and checks the batch arithmetic
  return cfg;
}

// One micro-batch: B sequences of T input tokens, each token's target the next one. A sequence
// starts anywhere and continues next = 3 * prev + 1 (mod 256): a rule the model can learn.
struct Batch {
  std::vector<int32_t> inputs, targets;
};

Batch make_batch(int64_t B, int64_t T, uint64_t seed) {
  Batch batch;
  for (int64_t b = 0; b < B; ++b) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    int32_t id = static_cast<int32_t>(seed >> 56);
    for (int64_t t = 0; t < T; ++t) {
      batch.inputs.push_back(id);
      id = (3 * id + 1) % 256;
      batch.targets.push_back(id);
    }
  }
  return batch;
}

int main(int argc, char** argv) {
  try {
    const std::string offload = argc > 1 ? argv[1] : "nvme";
    // Declared before the engine, so removed after the engine has deleted its swap files.
    ScratchDir dir(argc > 2 ? fs::path(argv[2]) : fs::temp_directory_path());
    const config::Config cfg = make_config(offload, dir.path());

    // As in a Hugging Face config.json (model::LlamaConfig::load reads one).
    const model::LlamaConfig llama{.hidden_size = 64,
                                   .intermediate_size = 176,
                                   .num_hidden_layers = 2,
                                   .num_attention_heads = 4,
                                   .num_key_value_heads = 2,
                                   .vocab_size = 256,
                                   .max_position_embeddings = 64,
                                   .head_dim = 16};
    const int64_t B = 4, T = 32;
    const model::LlamaModel model(llama, {.micro_batch = B, .seq_len = T});
    device::CpuDevice device;  // the simulated accelerator; {.memory_budget_bytes} caps it
    comm::LocalComm comm;      // one rank
    zero::ZeroEngine engine(cfg, model, device, comm, /*seed=*/42);
    std::printf("%.2fM parameters, ZeRO stage 3, offload %s\n", llama.num_parameters() / 1e6,
                offload.c_str());

    const double lr = cfg.optimizer.lr.value();  // constant here; a trainer follows a schedule
    std::vector<float> losses;
    for (int t = 1; t <= kSteps; ++t) {
      const Batch batch = make_batch(B, T, static_cast<uint64_t>(t));
      losses.push_back(engine.forward_backward(batch.inputs.data(), batch.targets.data(),
                                               /*loss_scale=*/1.0f, /*first_micro_batch=*/true));
      const zero::StepResult r = engine.step(zero::step_params(cfg, lr, t, /*loss_scale=*/1.0));
      std::printf("step %2d  loss %.4f  grad norm %.3f\n", t, losses.back(), r.grad_norm);
    }
    engine.wait_step();  // the last step's updates otherwise finish under the next forward
    const zero::TrafficStats io = engine.traffic();
    std::printf("NVMe traffic: %.1f MB read, %.1f MB written; device peak %.2f MB\n",
                io.nvme_read_bytes / 1e6, io.nvme_write_bytes / 1e6,
                engine.memory().device_peak_bytes / 1e6);
    const bool fell = losses.back() < losses.front() * 2 / 3;
    std::printf("loss %.4f -> %.4f: %s\n", losses.front(), losses.back(), fell ? "fell" : "FAILED");
    return fell ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tiny_zero: %s\n", e.what());
    return 1;
  }
}
