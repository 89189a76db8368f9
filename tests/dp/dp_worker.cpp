// Run under `mpirun -np W` (or alone for a world of one): trains the tiny Llama of the trainer
// tests with one of the configurations below and writes what must not depend on the world
// size to --out (rank 0): every step's loss and grad norm as exact bits, then every unit's
// master weights and parameters over its numel (padding differs with the world size). Also
// checks, on every rank, that the engine's Comm sent exactly the bytes the plan predicts per
// step, and that no collective runs as a host function of a device stream (on a GPU those share
// the CUDA runtime's one callback thread). Exit 0 when done, 3 when the traffic differs from the
// plan.
//
//   dp_worker --case s3_nvme_fp32 --gas 2 --steps 10 --train T --val V --swap DIR --out FILE
//             [--save-dir D --save-every K] [--resume CKPT] [--device cpu|discrete|cuda]
//             [--mask M --val-mask VM]   (loss masks of --train and --val)
//             [--eio-read N]   (the last rank's Nth swap read fails with EIO)
//
// `--device discrete` trains on the simulated discrete device (a GPU's data movement: the
// ranks' collectives run on pinned host memory, gradients copied back, parameters gathered on
// the host and copied up whole); `--device cuda` on the machine's first GPU, shared by the ranks.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "common/cleanup.hpp"
#include "common/error.hpp"
#include "engine/comm/local_comm.hpp"
#include "engine/comm/mpi_comm.hpp"
#include "engine/device/device.hpp"
#include "engine/train/trainer.hpp"
#include "tests/trainer/trainer_test_util.hpp"
#include "tests/zero/eio_on_nth.hpp"
#include "tools/blas/blas_kernels.hpp"

namespace outcore::train::testing {
namespace {

struct Args {
  std::string name, train, val, swap, out, save_dir, resume, mask, val_mask;
  int64_t save_every = 0;
  int64_t gas = 1, steps = 10;
  std::string device = "cpu";  // cpu, discrete or cuda
  uint64_t eio_read = 0;       // > 0: the last rank's eio_read-th swap read fails
};

nlohmann::json case_patch(const std::string& name, const std::string& swap, int64_t gas) {
  nlohmann::json p = {{"gradient_accumulation_steps", gas}};
  auto zero = [&](nlohmann::json z) { p["zero_optimization"] = std::move(z); };
  if (name == "s1_nvme_fp32") {
    zero({{"stage", 1}, {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", swap}}}});
  } else if (name == "s2_cpu_bf16") {
    zero({{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}});
    p["bf16"] = {{"enabled", true}};
    p["gradient_clipping"] = 0.05;  // clips: the norm must agree to the bit
  } else if (name == "s3_nvme_fp32" || name == "s3_nvme_bf16" ||
             name == "s3_nvme_bf16_in_backward") {
    zero({{"stage", 3},
          {"stage3_param_persistence_threshold", 0},
          {"stage3_max_live_parameters", 500000},
          {"stage3_prefetch_bucket_size", 500000},
          {"stage3_max_reuse_distance", 0},
          {"offload_param", {{"device", "nvme"}, {"nvme_path", swap}, {"max_in_cpu", 0}}},
          {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", swap}}}});
    p["gradient_clipping"] = 0.05;
    p["outcore"] = {{"device_memory_mb", 9}};  // below one rank's share of the state
    if (name != "s3_nvme_fp32") p["bf16"] = {{"enabled", true}};
    if (name == "s3_nvme_bf16_in_backward") {  // every step starts during the backward
      p["gradient_clipping"] = 0.0;
      p["outcore"]["step_in_backward"] = true;
    }
  } else if (name == "s1_none_bf16") {
    zero({{"stage", 1}});  // all the optimizer state on the device
    p["bf16"] = {{"enabled", true}};
    p["gradient_clipping"] = 0.05;
  } else if (name == "s0_fp16") {
    zero({{"stage", 0}});
    p["fp16"] = {{"enabled", true}};  // started from a scale of 2^132 below: overflows at first
  } else {
    throw InvalidArgument("unknown case " + name);
  }
  return p;
}

template <typename T>
void put(std::ofstream& f, const T& v) {
  f.write(reinterpret_cast<const char*>(&v), sizeof v);
}

int train_and_write(const Args& a, comm::Comm* c, comm::Comm* ctl);

// The engine's Comm: every collective is the inner Comm's, refused when it would run as a host
// function of a device stream (its traffic is counted by the inner Comm).
class OffStreamComm final : public comm::Comm {
 public:
  explicit OffStreamComm(comm::Comm& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  void all_gather(std::span<const float> send, std::span<float> recv) override {
    check("all_gather");
    inner_.all_gather(send, recv);
  }
  void all_gather_bytes(std::span<const std::byte> send, std::span<std::byte> recv) override {
    check("all_gather_bytes");
    inner_.all_gather_bytes(send, recv);
  }
  void reduce_scatter(std::span<const float> send, std::span<float> recv,
                      comm::ReduceOp op) override {
    check("reduce_scatter");
    inner_.reduce_scatter(send, recv, op);
  }
  void all_reduce(std::span<float> data, comm::ReduceOp op) override {
    check("all_reduce");
    inner_.all_reduce(data, op);
  }
  void all_reduce(std::span<double> data, comm::ReduceOp op) override {
    check("all_reduce");
    inner_.all_reduce(data, op);
  }
  void broadcast(std::span<float> data, int root) override {
    check("broadcast");
    inner_.broadcast(data, root);
  }
  void broadcast_bytes(std::span<std::byte> data, int root) override {
    check("broadcast_bytes");
    inner_.broadcast_bytes(data, root);
  }
  void all_to_all(std::span<float> data) override {
    check("all_to_all");
    inner_.all_to_all(data);
  }
  void barrier() override {
    check("barrier");
    inner_.barrier();
  }
  void abort(int exit_code) override { inner_.abort(exit_code); }
  std::string_view name() const override { return inner_.name(); }

 private:
  static void check(const char* what) {
    if (device::in_host_function())
      throw Error(fmt::format("dp_worker: {} ran as a host function of a device stream", what));
  }
  comm::Comm& inner_;
};

// As `outcore train` does: a rank that fails removes its swap files and ends the job.
int run(const Args& a) {
  comm::LocalComm local, local_control;
  std::unique_ptr<comm::MpiComm> mpi, mpi_control;
  comm::Comm* c = &local;
  comm::Comm* ctl = &local_control;
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) {
    mpi = std::make_unique<comm::MpiComm>();
    mpi_control = std::make_unique<comm::MpiComm>();
    c = mpi.get();
    ctl = mpi_control.get();
  }
  std::printf("dp_worker: rank %d of %d started\n", c->rank(), c->world_size());
  std::fflush(stdout);
  try {
    return train_and_write(a, c, ctl);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_worker: rank %d of %d: error: %s\n", c->rank(), c->world_size(),
                 e.what());
    std::fflush(stderr);
    cleanup::remove_registered_files();
    c->abort(1);
    return 1;
  }
}

int train_and_write(const Args& a, comm::Comm* c, comm::Comm* ctl) {
  const int rank = c->rank(), world = c->world_size();

  // Stage 3 gets a model whose state (42 MiB) is several times the device budget per rank.
  nlohmann::json mj = tiny_model_json();
  if (a.name.rfind("s3_", 0) == 0)
    mj.merge_patch({{"hidden_size", 128}, {"intermediate_size", 1024}, {"num_hidden_layers", 6}});
  const model::LlamaConfig mc = model::LlamaConfig::from_json(mj.dump(), "dp model");
  nlohmann::json j = base_ds_json();
  j.merge_patch(case_patch(a.name, a.swap, a.gas));
  config::Config cfg = config::parse_config(j.dump(), "dp_worker config").config;
  config::AutoContext ctx;
  ctx.hidden_size = mc.hidden_size;
  ctx.total_steps = a.steps;
  ctx.world_size = world;
  config::resolve_auto(cfg, ctx);

  TrainerOptions o;
  o.train_data = a.train;
  o.val_data = a.val;
  o.train_mask = a.mask;
  o.val_mask = a.val_mask;
  o.steps = a.steps;
  o.seed = 7;
  o.seq_len = 32;
  o.eval_batches = 5;  // not a multiple of 2 or 3: ranks evaluate unequal shares of it
  o.progress_out = nullptr;
  o.activation_checkpointing = a.name.rfind("s3_", 0) == 0;
  o.engine.cpu_threads = 1;
  if (a.eio_read > 0 && rank == world - 1)
    o.engine.io_backend = std::make_shared<zero::test::EioOnNth>(a.eio_read, false);
  OffStreamComm engine_comm(*c);
  o.comm = &engine_comm;
  o.control_comm = ctl;
  o.save_dir = a.save_dir;
  o.save_every = a.save_every;
  o.resume_from = a.resume;
  o.discrete = a.device == "discrete";
  if (a.device == "cuda")
    o.device = device::DeviceKind::Cuda;  // GPU 0
  else if (a.device != "cpu" && a.device != "discrete")
    throw InvalidArgument("--device: got " + a.device + "; allowed: cpu, discrete, cuda");
  std::vector<double> losses, norms;
  int bad_traffic = 0;
  std::unique_ptr<Trainer> tr;
  uint64_t last_sent = 0;
  zero::TrafficStats last;
  o.on_step = [&](const StepMetrics& m) {
    losses.push_back(m.loss);
    norms.push_back(m.grad_norm.value_or(-1.0));
    tr->engine().wait_step();  // the step's updates otherwise finish under the next pass
    const uint64_t sent = c->traffic().total();
    const uint64_t planned = tr->engine().plan().per_step.comm;
    // A checkpoint saved after the previous step read the state too: not a step's traffic.
    const bool after_save = a.save_every > 0 && m.step > 1 && (m.step - 1) % a.save_every == 0;
    if (sent - last_sent != planned && !after_save) {
      std::fprintf(stderr, "dp_worker: rank %d step %lld: comm sent %llu bytes, plan says %llu\n",
                   rank, static_cast<long long>(m.step),
                   static_cast<unsigned long long>(sent - last_sent),
                   static_cast<unsigned long long>(planned));
      bad_traffic = 1;
    }
    last_sent = sent;
    // Every rank's tier traffic per step is the plan's too (outcore estimate --world-size W);
    // a skipped step (overflow) moves no more than that: it runs no optimizer (no state read or
    // written, no gradients brought to a device that steps them).
    const zero::TrafficStats now = tr->engine().traffic();
    const zero::TrafficBytes& p = tr->engine().plan().per_step;
    const uint64_t got[4] = {now.nvme_read_bytes - last.nvme_read_bytes,
                             now.nvme_write_bytes - last.nvme_write_bytes,
                             now.h2d_bytes - last.h2d_bytes, now.d2h_bytes - last.d2h_bytes};
    const uint64_t want[4] = {p.nvme_read, p.nvme_write, p.h2d, p.d2h};
    const char* names[4] = {"nvme read", "nvme write", "host->device", "device->host"};
    for (int k = 0; k < 4; ++k)
      if ((m.skipped ? got[k] > want[k] : got[k] != want[k]) && !after_save) {
        std::fprintf(stderr, "dp_worker: rank %d step %lld: %s %llu bytes, plan says %llu\n", rank,
                     static_cast<long long>(m.step), names[k],
                     static_cast<unsigned long long>(got[k]),
                     static_cast<unsigned long long>(want[k]));
        bad_traffic = 1;
      }
    last = now;
  };
  tr = std::make_unique<Trainer>(cfg, mc, o);
  if (a.name == "s0_fp16" && a.resume.empty()) {
    // A scale beyond fp32's range: the first steps overflow and are skipped, halving it.
    LossScalerState st = tr->loss_scaler().state();
    st.cur_scale = std::ldexp(1.0, 132);
    tr->loss_scaler().load_state(st);
  }
  last_sent = c->traffic().total();
  last = tr->engine().traffic();
  const TrainResult r = tr->run();
  const double val = r.final_val_loss.value_or(-1.0);
  const Weights w = weights_of(*tr);  // collective
  if (rank == 0) {
    std::ofstream f(a.out, std::ios::binary | std::ios::trunc);
    for (size_t i = 0; i < losses.size(); ++i) {
      put(f, losses[i]);
      put(f, norms[i]);
    }
    put(f, val);
    const model::ModelLayout& layout = tr->model().layout();
    const size_t psz = dtype_size(tr->engine().param_dtype());
    for (size_t u = 0; u < layout.units.size(); ++u) {
      f.write(reinterpret_cast<const char*>(w.master[u].data()),
              static_cast<std::streamsize>(layout.units[u].numel * sizeof(float)));
      f.write(reinterpret_cast<const char*>(w.params[u].data()),
              static_cast<std::streamsize>(layout.units[u].numel * psz));
    }
    if (!f) throw IoError(a.out, EIO, "write result");
    std::printf("dp_worker: %zu steps, loss %.6f -> %.6f, validation %.6f\n", losses.size(),
                losses.front(), losses.back(), val);
  }
  tr.reset();
  return bad_traffic ? 3 : 0;
}

}  // namespace
}  // namespace outcore::train::testing

int main(int argc, char** argv) {
  outcore::tools::select_openmp_waiting(argv);  // a rank among several on this machine
  outcore::train::testing::Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--case")
      a.name = v;
    else if (k == "--gas")
      a.gas = std::stoll(v);
    else if (k == "--steps")
      a.steps = std::stoll(v);
    else if (k == "--train")
      a.train = v;
    else if (k == "--val")
      a.val = v;
    else if (k == "--swap")
      a.swap = v;
    else if (k == "--out")
      a.out = v;
    else if (k == "--save-dir")
      a.save_dir = v;
    else if (k == "--save-every")
      a.save_every = std::stoll(v);
    else if (k == "--resume")
      a.resume = v;
    else if (k == "--mask")
      a.mask = v;
    else if (k == "--val-mask")
      a.val_mask = v;
    else if (k == "--device")
      a.device = v;
    else if (k == "--eio-read")
      a.eio_read = std::stoull(v);
  }
  try {
    return outcore::train::testing::run(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dp_worker: error: %s\n", e.what());
    return 1;
  }
}
