// The model's causal attention alone, forward and backward, at Llama 3 8B's heads (32 of 128 over
// 8 kv heads) and several sequence lengths, against references measured in the same run: the
// device's bf16 GEMM peak (gemm_bf16 on n^3, the measure: goal >= 0.45 for forward +
// backward) and, with --reference, another implementation's time at the same shapes (PyTorch's
// scaled_dot_product_attention backends: bench/python/attention_reference.py).
//
//   attention_bench [--device cuda|cpu] [--seq 4096,16384] [--batch 1] [--heads 32]
//                   [--kv-heads 8] [--head-dim 128] [--compute bf16|fp32] [--reps 5] [--threads N]
//                   [--reference "python3 bench/python/attention_reference.py"]
//
// FLOPs are outcore's model FLOPs (device::attention_train_flops): per query-key pair at or
// below the diagonal, 4 * heads * head_dim forward and twice that backward, however many
// products an implementation does. Each pass is timed alone (the forward, then the backward of
// that forward), best of --reps after a warm-up, each ended by the backend's finish(); operands
// are seeded normal values (the same work as any data). The reference command is run once per
// sequence length with `--seq T --batch B --heads H --kv-heads K --head-dim D --reps R` appended
// and must print lines `sdpa NAME forward_ms F backward_ms B` (or `sdpa NAME unavailable:
// WHY`); each is printed with the ratio of its time to outcore's (above 1: outcore is faster).
#include <fmt/format.h>
#include <tbb/global_control.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/cpu/bf16_gemm.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "engine/device/device.hpp"
#include "tools/blas/blas_kernels.hpp"
#include "tools/env_settings.hpp"

namespace {

using namespace outcore;
using Attention = device::ComputeBackend::Attention;
using Clock = std::chrono::steady_clock;

// The buffers of one attention shape, on the device: what the decoder gives it.
struct Buffers {
  device::DeviceBuffer q, k, v, dattn, attn, attn_saved, dq, dk, dv, lse, scores, dprob, lowp;
};

Buffers make_buffers(device::Device& dev, device::ComputeBackend& be, const Attention& a) {
  const size_t q_elems = static_cast<size_t>(a.B * a.T * a.nh * a.hd);
  const size_t kv_elems = static_cast<size_t>(a.B * a.T * a.nkv * a.hd);
  const size_t es = dtype_size(a.dtype);
  const size_t block_floats = static_cast<size_t>(a.block * a.T);
  const size_t lowp_bytes = std::max<size_t>(
      1, static_cast<size_t>(device::ComputeBackend::attention_bf16_scratch(a)) * sizeof(uint16_t));
  const char* what = "attention_bench";
  Buffers b{dev.alloc(q_elems * es, what),
            dev.alloc(kv_elems * es, what),
            dev.alloc(kv_elems * es, what),
            dev.alloc(q_elems * es, what),
            dev.alloc(q_elems * sizeof(float), what),
            dev.alloc(a.dtype == DType::BF16 ? q_elems * es : 1, what),
            dev.alloc(q_elems * sizeof(float), what),
            dev.alloc(kv_elems * sizeof(float), what),
            dev.alloc(kv_elems * sizeof(float), what),
            dev.alloc(static_cast<size_t>(a.B * a.nh * a.T) * sizeof(float), what),
            dev.alloc(block_floats * sizeof(float), what),
            dev.alloc(block_floats * sizeof(float), what),
            dev.alloc(lowp_bytes, what)};
  // Seeded N(0, 1) operands in the compute dtype (the scores then spread as a model's do).
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (device::DeviceBuffer* buf : {&b.q, &b.k, &b.v, &b.dattn}) {
    const size_t n = buf->size() / es;
    std::vector<float> host(n);
    for (float& x : host) x = normal(rng);
    std::vector<std::byte> stored(buf->size());
    device::cpu::from_fp32(host.data(), stored.data(), a.dtype, static_cast<int64_t>(n));
    be.upload(buf->data(), stored.data(), stored.size());
  }
  return b;
}

void forward(device::ComputeBackend& be, const Attention& a, Buffers& b) {
  const bool bf16 = a.dtype == DType::BF16;
  be.attention_forward(a, b.q.data(), b.k.data(), b.v.data(), b.lse.as<float>(), b.attn.as<float>(),
                       b.scores.as<float>(), b.lowp.data(), bf16 ? b.attn_saved.data() : nullptr);
}

void backward(device::ComputeBackend& be, const Attention& a, Buffers& b) {
  const bool bf16 = a.dtype == DType::BF16;
  be.zero(b.dk.data(), b.dk.size());
  be.zero(b.dv.data(), b.dv.size());
  be.attention_backward(a, b.q.data(), b.k.data(), b.v.data(), b.lse.as<float>(),
                        bf16 ? b.attn_saved.data() : b.attn.data(), b.dattn.data(),
                        b.dq.as<float>(), b.dk.as<float>(), b.dv.as<float>(), b.scores.as<float>(),
                        b.dprob.as<float>(), b.lowp.data());
}

// Best seconds of `reps` runs of `body` after one warm-up, each ended by finish().
template <class Body>
double best_seconds(device::ComputeBackend& be, int reps, Body body) {
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {
    const auto t0 = Clock::now();
    body();
    be.finish();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r > 0) best = std::min(best, s);
  }
  return best;
}

struct Reference {
  std::string name;
  double forward_ms = 0, backward_ms = 0;
  std::string unavailable;  // why, when the backend did not run
};

// The reference command's lines for one shape.
std::vector<Reference> run_reference(const std::string& command, const Attention& a, int reps) {
  const std::string cmd =
      fmt::format("{} --seq {} --batch {} --heads {} --kv-heads {} --head-dim {} --reps {}",
                  command, a.T, a.B, a.nh, a.nkv, a.hd, reps);
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("--reference: cannot run: " + cmd);
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  std::vector<Reference> refs;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string tag, name, key1, key2;
    Reference r;
    if (!(words >> tag >> name) || tag != "sdpa") continue;
    r.name = name;
    if (words >> key1 && key1 == "unavailable:") {
      std::getline(words, r.unavailable);
    } else if (key1 == "forward_ms" && words >> r.forward_ms >> key2 && key2 == "backward_ms" &&
               words >> r.backward_ms) {
    } else {
      continue;
    }
    refs.push_back(r);
  }
  if (status != 0 || refs.empty())
    throw std::runtime_error(fmt::format(
        "--reference: `{}` exited with status {} and printed no `sdpa` line; its output:\n{}", cmd,
        status, out));
  return refs;
}

std::vector<int64_t> parse_list(const std::string& text) {
  std::vector<int64_t> v;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(std::stoll(item));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  outcore::tools::select_blas_kernels(argv);
  outcore::tools::apply_environment_settings();
  CLI::App app{"The model's causal attention, forward and backward, against the GEMM peak"};
  std::string device_kind = "cuda", seqs = "4096,16384", compute = "bf16", reference;
  int64_t batch = 1, heads = 32, kv_heads = 8, head_dim = 128;
  int reps = 5, threads = 0;
  app.add_option("--device", device_kind, "cuda (GPU 0) or cpu")
      ->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option("--seq", seqs, "sequence lengths, comma-separated");
  app.add_option("--batch", batch, "sequences")->check(CLI::PositiveNumber);
  app.add_option("--heads", heads, "query heads")->check(CLI::PositiveNumber);
  app.add_option("--kv-heads", kv_heads, "key / value heads")->check(CLI::PositiveNumber);
  app.add_option("--head-dim", head_dim, "head size")->check(CLI::PositiveNumber);
  app.add_option("--compute", compute, "operand dtype")->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_option("--reps", reps, "timed runs of each pass (best kept)")->check(CLI::PositiveNumber);
  app.add_option("--threads", threads,
                 "the CPU backend's threads (oneTBB's for attention's heads, oneDNN's for its "
                 "GEMMs; default: every processor)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--reference", reference,
                 "command timing another implementation at each shape (see the header)");
  CLI11_PARSE(app, argc, argv);

  try {
    std::vector<int64_t> ts;
    try {
      ts = parse_list(seqs);
    } catch (const std::exception&) {
      throw std::runtime_error("--seq " + seqs + ": comma-separated positive integers");
    }
    if (ts.empty() || std::any_of(ts.begin(), ts.end(), [](int64_t t) { return t < 1; }))
      throw std::runtime_error("--seq " + seqs + ": comma-separated positive integers");
    if (heads % kv_heads != 0)
      throw std::runtime_error(
          fmt::format("--heads {} is not a multiple of --kv-heads {}", heads, kv_heads));
    std::optional<tbb::global_control> tbb_threads;
    if (threads > 0) {
      tbb_threads.emplace(tbb::global_control::max_allowed_parallelism, threads);
      device::cpu::set_bf16_gemm_threads(threads);
    }
    const bool gpu = device_kind == "cuda";
    std::unique_ptr<device::Device> dev;
    if (gpu) {
      const device::ProbeResult p = device::probe();
      if (!p.available) throw std::runtime_error("--device cuda: no usable GPU: " + p.summary());
      dev = device::make_cuda_device();
    } else {
      dev = std::make_unique<device::CpuDevice>();
    }
    const std::shared_ptr<device::ComputeBackend> be = device::make_backend(*dev);
    const DType dtype = compute == "bf16" ? DType::BF16 : DType::F32;
    // The reference rate: the device's GEMM in the compute dtype on n^3 (8192 on a GPU).
    const int64_t peak_n = gpu ? 8192 : 1024;
    const double peak = device::gemm_flops(*dev, *be, dtype, peak_n);
    std::printf("%s, %s operands; GEMM peak (%s %lld^3): %.3g TFLOP/s\n", be->name().c_str(),
                std::string(dtype_name(dtype)).c_str(), dtype == DType::BF16 ? "gemm_bf16" : "gemm",
                (long long)peak_n, peak / 1e12);
    for (const int64_t t : ts) {
      const Attention a{.B = batch,
                        .T = t,
                        .nh = heads,
                        .nkv = kv_heads,
                        .hd = head_dim,
                        .block = std::min<int64_t>(t, 128),  // the decoder's block
                        .scale = 1.0f / std::sqrt(static_cast<float>(head_dim)),
                        .dtype = dtype};
      Buffers b = make_buffers(*dev, *be, a);
      const double flops = device::attention_train_flops(a);  // forward 1/3, backward 2/3
      const double fs = best_seconds(*be, reps, [&] { forward(*be, a, b); });
      forward(*be, a, b);  // the backward's inputs
      const double bs = best_seconds(*be, reps, [&] { backward(*be, a, b); });
      const double tflops = flops / (fs + bs) / 1e12;
      std::printf(
          "seq %lld (batch %lld, %lld heads of %lld over %lld kv heads, %s): forward %.3f ms "
          "%.3g TFLOP/s, backward %.3f ms %.3g TFLOP/s\n",
          (long long)t, (long long)batch, (long long)heads, (long long)head_dim,
          (long long)kv_heads,
          gpu && device::fused_attention_shape(a) ? "fused kernels" : "GEMMs head by head",
          fs * 1e3, flops / 3 / fs / 1e12, bs * 1e3, flops * 2 / 3 / bs / 1e12);
      std::printf(
          "attention seq %lld: forward + backward %.3g TFLOP/s, %.3f of the GEMM peak (goal >= "
          "0.45)\n",
          (long long)t, tflops, tflops * 1e12 / peak);
      if (reference.empty()) continue;
      for (const Reference& r : run_reference(reference, a, reps)) {
        if (!r.unavailable.empty()) {
          std::printf("reference seq %lld %s: unavailable:%s\n", (long long)t, r.name.c_str(),
                      r.unavailable.c_str());
          continue;
        }
        std::printf(
            "reference seq %lld %s: forward %.3f ms, backward %.3f ms; its time / outcore's: "
            "forward %.2f, backward %.2f, both %.2f\n",
            (long long)t, r.name.c_str(), r.forward_ms, r.backward_ms, r.forward_ms / (fs * 1e3),
            r.backward_ms / (bs * 1e3), (r.forward_ms + r.backward_ms) / ((fs + bs) * 1e3));
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
