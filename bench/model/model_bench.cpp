// Forward+backward throughput of a Llama model on the CPU device, against OpenBLAS sgemm
// measured in the same run.
//
//   model_bench [--hidden 1024] [--layers 4] [--seq 512] [--batch 2] [--steps 5] [--threads N]
//               [--dtype fp32|bf16] [--compute fp32|bf16] [--checkpointing]
//               [--intermediate I] [--heads H] [--kv-heads K] [--device cpu|cuda] [--profile]
//
// Prints tokens/s, achieved GFLOP/s (model FLOPs: LlamaConfig::train_flops_per_token) and the
// ratio to sgemm GFLOP/s on a square 2048^3 product and on the model's MLP shape, each sgemm
// timed right after each model step (medians over steps). With --compute bf16 (bf16 parameters,
// every GEMM on bf16 operands) each step is followed by the same step in fp32 compute on the same
// parameters, and the median ratio of their tokens/s is printed too. With --device cuda (GPU 0,
// everything in GPU memory) the reference is the device's own bf16 GEMM (gemm_bf16, 8192^3,
// timed after each step) instead of sgemm: model TFLOPS over that peak. One Llama 3 8B layer:
//   model_bench --device cuda --compute bf16 --hidden 4096 --intermediate 14336 --heads 32
//               --kv-heads 8 --layers 1 --vocab 256 --seq 4096 --batch 1
// The head (output projection, loss and its gradients, one fused unit) is then timed alone: its
// time against its GEMMs' FLOPs (3 x 2 x hidden x vocab per token) at the reference rate, the
// issue's measure for Llama 3's 128256-token vocabulary (goal <= 1.3).
// --profile runs one more step through device::ProfilingBackend, which waits for each operation
// before the next, and prints where that step's time went per operation and shape (with the
// TFLOP/s of GEMMs and attention), then the attention's forward + backward TFLOP/s against the
// reference rate (the goal for the fused attention: >= 0.45 of the bf16 GEMM peak).
#include <cblas.h>
#include <tbb/global_control.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "engine/device/cpu/bf16_gemm.hpp"
#include "engine/device/device.hpp"
#include "engine/device/profiling_backend.hpp"
#include "engine/model/model.hpp"
#include "tools/blas/blas_kernels.hpp"
#include "tools/env_settings.hpp"

namespace {

using namespace outcore;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Best-of-`reps` GFLOP/s of C[m,n] = A[m,k] B[k,n]^T (the model's NT layout).
double sgemm_gflops(int m, int n, int k, int reps) {
  std::vector<float> a(size_t(m) * k, 0.01f), b(size_t(n) * k, 0.02f), c(size_t(m) * n);
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, b.data(), k,
                0.0f, c.data(), n);
    best = std::max(best, 2.0 * m * n * k / seconds_since(t0) / 1e9);
  }
  return best;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// One step of the model through a ProfilingBackend: the time per operation and shape, most
// first, against the median step time of the timed (unprofiled) steps; then the attention's
// forward + backward TFLOP/s against the reference rate (`ref_gflops`, named `ref`).
void print_profile(const model::LlamaConfig& c, const model::ModelOptions& o,
                   const std::shared_ptr<device::ComputeBackend>& backend,
                   const model::ModelBuffers& mb, model::ActivationBuffers& acts,
                   const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
                   double model_gflops, double ref_gflops, const char* ref) {
  const auto prof = std::make_shared<device::ProfilingBackend>(backend);
  model::LlamaModel m(c, o, prof);
  prof->reset();  // the constants uploaded above are not the step's
  model::train_micro_batch(m, mb, acts, tokens.data(), targets.data(), model::GradMode::Overwrite);
  const double step_flops = c.train_flops_per_token(o.seq_len) * double(o.micro_batch * o.seq_len);
  const double total = prof->total_seconds();
  std::printf(
      "profile of one step, each operation waited for: %.2f ms in %s (the timed steps' median: "
      "%.2f ms)\n",
      total * 1e3, backend->name().c_str(), step_flops / (model_gflops * 1e9) * 1e3);
  std::printf("%7s %10s %7s %9s  %s\n", "share", "ms", "calls", "TFLOP/s", "operation");
  const auto rows = prof->rows();
  const size_t shown = std::min<size_t>(rows.size(), 30);
  double rest = 0;
  for (size_t i = shown; i < rows.size(); ++i) rest += rows[i].seconds;
  for (size_t i = 0; i < shown; ++i) {
    const auto& r = rows[i];
    std::printf("%6.1f%% %10.3f %7lld ", 100.0 * r.seconds / total, r.seconds * 1e3,
                (long long)r.calls);
    if (r.flops > 0)
      std::printf("%9.1f", r.flops / r.seconds / 1e12);
    else
      std::printf("%9s", "");
    std::printf("  %s\n", r.op.c_str());
  }
  if (shown < rows.size())
    std::printf("%6.1f%% %10.3f %7s %9s  (%zu more)\n", 100.0 * rest / total, rest * 1e3, "", "",
                rows.size() - shown);
  double attn_s = 0, attn_flops = 0;
  for (const auto& r : rows) {
    if (r.op.rfind("attention_", 0) != 0) continue;
    attn_s += r.seconds;
    attn_flops += r.flops;
  }
  if (attn_s > 0) {
    const double tflops = attn_flops / attn_s / 1e12;
    std::printf(
        "attention forward + backward: %.3f ms, %.3g TFLOP/s (causal half), %.3f of the %s rate "
        "(goal >= 0.45)\n",
        attn_s * 1e3, tflops, tflops * 1e3 / ref_gflops, ref);
  }
}

}  // namespace

int main(int argc, char** argv) {
  outcore::tools::select_blas_kernels(argv);
  outcore::tools::apply_environment_settings();
  int64_t hidden = 1024, layers = 4, seq = 512, batch = 2, vocab = 32000;
  int steps = 5, threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::string dtype = "fp32", compute = "fp32";
  int64_t intermediate = 0, heads = 0, kv_heads = 0;
  bool checkpointing = false, profile = false;
  std::string device_kind = "cpu";
  CLI::App app("Llama forward+backward throughput vs the GEMM peak");
  app.add_option("--hidden", hidden, "hidden size");
  app.add_option("--intermediate", intermediate, "MLP size (default hidden * 11/4, rounded to 64)");
  app.add_option("--heads", heads, "attention heads (default hidden / 64)");
  app.add_option("--kv-heads", kv_heads, "key/value heads (default heads / 4)");
  app.add_option("--device", device_kind, "cpu (the host) or cuda (GPU 0)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--layers", layers, "decoder layers");
  app.add_option("--seq", seq, "sequence length");
  app.add_option("--batch", batch, "sequences per micro-batch");
  app.add_option("--vocab", vocab, "vocabulary size");
  app.add_option("--steps", steps, "timed steps (after one warm-up step)");
  app.add_option("--threads", threads,
                 "the CPU's threads: OpenBLAS's, oneDNN's (bf16 GEMMs) and oneTBB's (the CPU "
                 "backend's other kernels)")
      ->check(CLI::PositiveNumber);
  app.add_option("--dtype", dtype, "parameter storage")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--compute", compute, "compute dtype (bf16 implies --dtype bf16)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_flag("--checkpointing", checkpointing, "activation checkpointing");
  app.add_flag("--profile", profile,
               "one more step, each operation waited for, timed per operation and shape");
  CLI11_PARSE(app, argc, argv);

  try {
    openblas_set_num_threads(threads);
    device::cpu::set_bf16_gemm_threads(threads);
    const tbb::global_control tbb_threads(tbb::global_control::max_allowed_parallelism,
                                          static_cast<size_t>(threads));
    const bool bf16_compute = compute == "bf16";
    if (bf16_compute) dtype = "bf16";
    model::LlamaConfig c;
    c.hidden_size = hidden;
    c.intermediate_size = intermediate > 0 ? intermediate : (hidden * 11 / 4 + 63) / 64 * 64;
    c.num_hidden_layers = layers;
    c.num_attention_heads = heads > 0 ? heads : std::max<int64_t>(1, hidden / 64);
    c.num_key_value_heads =
        kv_heads > 0 ? kv_heads : std::max<int64_t>(1, c.num_attention_heads / 4);
    c.head_dim = hidden / c.num_attention_heads;
    c.vocab_size = vocab;
    c.max_position_embeddings = std::max<int64_t>(seq, 2048);
    c.validate();
    model::ModelOptions o{.micro_batch = batch,
                          .seq_len = seq,
                          .param_dtype = dtype == "bf16" ? DType::BF16 : DType::F32,
                          .compute_dtype = bf16_compute ? DType::BF16 : DType::F32,
                          .activation_checkpointing = checkpointing};
    const bool gpu = device_kind == "cuda";
    std::unique_ptr<device::Device> dev_owner;
    if (gpu) {
      const device::ProbeResult p = device::probe();
      if (!p.available) throw std::runtime_error("--device cuda: no usable GPU: " + p.summary());
      dev_owner = device::make_cuda_device();
    } else {
      dev_owner = std::make_unique<device::CpuDevice>();
    }
    device::Device& dev = *dev_owner;
    o.head_chunk_rows = model::head_rows_on(c, o, dev, 0);  // as outcore train on this device
    const std::shared_ptr<device::ComputeBackend> backend = device::make_backend(dev);
    model::LlamaModel m(c, o, backend);
    model::ModelOptions o_fp32 = o;
    o_fp32.compute_dtype = DType::F32;
    model::LlamaModel m_fp32(c, o_fp32, backend);  // the reference of --compute bf16
    std::fprintf(stderr,
                 "model: %.1fM parameters, %lld layers, hidden %lld, inter %lld, heads %lld/%lld, "
                 "vocab %lld\n",
                 c.num_parameters() / 1e6, (long long)layers, (long long)hidden,
                 (long long)c.intermediate_size, (long long)c.num_attention_heads,
                 (long long)c.num_key_value_heads, (long long)vocab);

    // Parameters (initialised), gradients, activations.
    const model::ModelLayout& L = m.layout();
    std::vector<device::DeviceBuffer> params, grads;
    model::ModelBuffers mb;
    auto copy = dev.create_stream("params");
    for (const model::UnitLayout& u : L.units) {
      std::vector<float> init(u.padded_numel);
      model::init_params(L, u.index, 1, 0, u.padded_numel, init.data());
      AlignedBuffer host(u.padded_numel * dtype_size(o.param_dtype));
      model::convert_from_fp32(init.data(), host.data(), o.param_dtype, u.padded_numel);
      params.push_back(dev.alloc(host.size(), "params"));
      copy->copy_h2d(params.back().data(), host.data(), host.size());
      copy->synchronize();
      grads.push_back(dev.alloc(u.padded_numel * sizeof(float), "grads"));
      mb.params.push_back(params.back().data());
      mb.grads.push_back(grads.back().as<float>());
    }
    model::ActivationBuffers acts(m, dev, false);
    std::unique_ptr<model::ActivationBuffers> acts_fp32;
    if (bf16_compute) acts_fp32 = std::make_unique<model::ActivationBuffers>(m_fp32, dev, false);
    std::vector<int32_t> tokens(batch * seq), targets(batch * seq);
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int32_t>((i * 7919) % vocab);
      targets[i] = static_cast<int32_t>((i * 104729 + 1) % vocab);
    }

    std::fprintf(stderr, "warm-up step...\n");
    float loss = model::train_micro_batch(m, mb, acts, tokens.data(), targets.data(),
                                          model::GradMode::Overwrite);
    if (bf16_compute)
      model::train_micro_batch(m_fp32, mb, *acts_fp32, tokens.data(), targets.data(),
                               model::GradMode::Overwrite);
    // The machine is shared and noisy: each timed step is followed by the sgemm references, so
    // model and reference see the same load, and the ratio is the median of per-step ratios.
    const double step_flops = c.train_flops_per_token(seq) * double(batch * seq);
    std::vector<double> model_g, square_g, mlp_g, ratio_sq, ratio_mlp, ratio_fp32;
    const int peak_n = 8192;  // the device's bf16 GEMM peak: gemm_bf16 on peak_n^3
    for (int s = 0; s < steps; ++s) {
      auto t0 = Clock::now();
      loss = model::train_micro_batch(m, mb, acts, tokens.data(), targets.data(),
                                      model::GradMode::Overwrite);
      const double dt = seconds_since(t0);
      model_g.push_back(step_flops / dt / 1e9);
      square_g.push_back(gpu ? device::gemm_flops(dev, *backend, DType::BF16, peak_n) / 1e9
                             : sgemm_gflops(2048, 2048, 2048, 2));
      mlp_g.push_back(
          gpu ? square_g.back()
              : sgemm_gflops(int(batch * seq), int(c.intermediate_size), int(hidden), 2));
      ratio_sq.push_back(model_g.back() / square_g.back());
      ratio_mlp.push_back(model_g.back() / mlp_g.back());
      if (bf16_compute) {
        t0 = Clock::now();
        model::train_micro_batch(m_fp32, mb, *acts_fp32, tokens.data(), targets.data(),
                                 model::GradMode::Overwrite);
        ratio_fp32.push_back(seconds_since(t0) / dt);
      }
      std::fprintf(stderr, "step %d/%d: %.3f s, loss %.4f, %.1f GFLOP/s, GEMM peak %.1f GFLOP/s\n",
                   s + 1, steps, dt, loss, model_g.back(), square_g.back());
    }
    const double gf = median(model_g);
    std::printf(
        "config: hidden %lld, layers %lld, seq %lld, batch %lld, vocab %lld, %s parameters, %s "
        "compute, %s, %d GEMM threads, %d steps, on %s\n",
        (long long)hidden, (long long)layers, (long long)seq, (long long)batch, (long long)vocab,
        dtype.c_str(), compute.c_str(), checkpointing ? "checkpointing" : "no checkpointing",
        threads, steps, backend->name().c_str());
    std::printf("model fwd+bwd:  %.0f tokens/s, %.1f GFLOP/s (%.3f GFLOP/token; medians)\n",
                gf * 1e9 / c.train_flops_per_token(seq), gf, c.train_flops_per_token(seq) / 1e9);
    if (gpu) {
      std::printf("gemm_bf16 %d^3 on the device: %.1f TFLOP/s   ratio model/peak %.3f\n", peak_n,
                  median(square_g) / 1e3, median(ratio_sq));
    } else {
      std::printf("sgemm 2048^3:   %.1f GFLOP/s   ratio model/sgemm %.2f\n", median(square_g),
                  median(ratio_sq));
      std::printf("sgemm %lldx%lldx%lld: %.1f GFLOP/s   ratio model/sgemm %.2f\n",
                  (long long)(batch * seq), (long long)c.intermediate_size, (long long)hidden,
                  median(mlp_g), median(ratio_mlp));
    }
    if (bf16_compute)
      std::printf("bf16 compute / fp32 compute tokens/s (same parameters): %.3f\n",
                  median(ratio_fp32));
    std::printf("device peak: %.1f MiB (parameters, gradients, activations%s)\n",
                dev.memory_stats().peak_bytes / 1048576.0, bf16_compute ? " of both models" : "");
    // The head alone, on the last step's input to it (median of `steps` calls, each finished).
    {
      const int head = m.num_units() - 1;
      const bool tied = c.tie_word_embeddings;
      acts.before_backward(head);
      std::vector<double> head_s;
      for (int s = 0; s < std::max(steps, 1); ++s) {
        const auto t0 = Clock::now();
        m.backward(head, {.params = mb.params[head],
                          .tied_params = tied ? mb.params[0] : nullptr,
                          .targets = targets.data(),
                          .input = acts.unit_input(head),
                          .grad_input = acts.grad(),
                          .grads = mb.grads[head],
                          .tied_grads = tied ? mb.grads[0] : nullptr,
                          .mode = model::GradMode::Overwrite,
                          .scratch = acts.scratch()});
        head_s.push_back(seconds_since(t0));
      }
      const double head_flops = 3.0 * 2.0 * double(hidden) * double(vocab) * double(batch * seq);
      const double at_peak = head_flops / (median(square_g) * 1e9);
      const std::string rows = o.head_chunk_rows > 0
                                   ? std::to_string(std::min(o.head_chunk_rows, batch * seq))
                                   : "16 MiB of logits";
      std::printf(
          "head (loss forward + backward, vocab %lld, %lld rows, %s per launch): %.3f ms = %.2fx "
          "its GEMMs' %.3f TFLOP at the %s rate (goal <= 1.3)\n",
          (long long)vocab, (long long)(batch * seq), rows.c_str(), median(head_s) * 1e3,
          median(head_s) / at_peak, head_flops / 1e12, gpu ? "bf16 GEMM peak" : "sgemm 2048^3");
    }
    if (profile)
      print_profile(c, o, backend, mb, acts, tokens, targets, median(model_g), median(square_g),
                    gpu ? "bf16 GEMM peak" : "sgemm 2048^3");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_bench: %s\n", e.what());
    return 1;
  }
}
