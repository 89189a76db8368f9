// bench_cpu_adam: a fused Adam step over N fp32 parameters (moments fp32 or bf16) against the
// memory roofline (a kernel with exactly Adam's traffic, timed in the same run on the same
// arrays), the scalar path, and torch.optim.Adam(foreach=True) run as a subprocess. Best of --reps
// for each. Results on stdout, progress on stderr.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/aligned_buffer.hpp"
#include "common/dtype.hpp"
#include "common/error.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "roofline.hpp"
#include "tools/env_settings.hpp"

namespace outcore::bench {
namespace {

using cpu_adam::Executor;
using cpu_adam::Isa;

struct Arrays {
  explicit Arrays(size_t n)
      : n(n), p(n * 4), g(n * 4), m(n * 4), v(n * 4), m16(n * 2), v16(n * 2), out(n * 2) {
    // Gradients positive so that the roofline's in-place updates keep m and v positive.
    uint32_t s = 12345;
    auto next = [&s] { return (s = s * 1664525u + 1013904223u) >> 8; };
    float *pp = P(), *gp = G(), *mp = M(), *vp = V();
    uint16_t *mh = M16(), *vh = V16();
    for (size_t i = 0; i < n; ++i) {
      pp[i] = static_cast<float>(next()) * (2.0f / 16777216.0f) - 1.0f;
      gp[i] = 1e-4f + static_cast<float>(next()) * (1e-3f / 16777216.0f);
      mp[i] = 0.0f;
      vp[i] = 1e-8f;
      mh[i] = fp32_to_bf16(mp[i]);
      vh[i] = fp32_to_bf16(vp[i]);
    }
  }
  float* P() { return p.as<float>().data(); }
  float* G() { return g.as<float>().data(); }
  float* M() { return m.as<float>().data(); }
  float* V() { return v.as<float>().data(); }
  uint16_t* M16() { return m16.as<uint16_t>().data(); }
  uint16_t* V16() { return v16.as<uint16_t>().data(); }
  uint16_t* Out() { return out.as<uint16_t>().data(); }
  cpu_adam::Moments moments(bool bf16) {
    if (bf16) return {M16(), V16(), DType::BF16};
    return {M(), V(), DType::F32};
  }

  size_t n;
  AlignedBuffer p, g, m, v, m16, v16, out;
};

template <typename Fn>
double seconds(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs the torch benchmark script; returns params/s, or 0 if torch is unavailable or failed.
double torch_params_per_s(size_t n, unsigned threads, int reps) {
  const std::string cmd = std::string(OUTCORE_PYTHON) + " " + OUTCORE_SOURCE_DIR +
                          "/bench/cpu_adam/torch_adam_bench.py " + std::to_string(n) + " " +
                          std::to_string(threads) + " " + std::to_string(reps);
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return 0.0;
  char line[256];
  double rate = 0.0;
  while (fgets(line, sizeof(line), pipe) != nullptr) {
    std::sscanf(line, "torch_adam_params_per_s %lf", &rate);
  }
  const int status = pclose(pipe);
  if (status != 0) {
    std::fprintf(stderr, "bench_cpu_adam: '%s' failed (status %d); torch column left empty\n",
                 cmd.c_str(), status);
    return 0.0;
  }
  return rate;
}

struct Row {
  std::string config;
  double ours = 0, roof = 0, roof_plain = 0, roof_stream = 0, avx2 = 0, scalar = 0, torch = 0;
  double paired = 0;  // median over reps of roofline time / ours, each pair timed back to back
};

struct Options {
  size_t n = 100'000'000;
  int reps = 5;
  std::vector<unsigned> threads{1, 2};
  bool torch = true;
  int torch_reps = 3;
  bool scalar = true;
};

struct Rooflines {
  RooflineFn f32;
  RooflineBf16MomentsFn bf16_moments;
};

// One configuration: roofline (plain and, with a copy-out, streaming stores for it), the
// active ISA, AVX2 if it is not the active one, and scalar; interleaved rep by rep so that
// drift on a shared machine hits all of them alike.
Row measure(Arrays& a, const Executor& ex, bool copy_out, bool bf16_moments,
            cpu_adam::Formula formula, const Options& opt, const Rooflines& roof_fns,
            const std::string& name) {
  const Isa best = cpu_adam::active_isa();
  cpu_adam::AdamParams hp;
  hp.weight_decay = 0.01;
  hp.formula = formula;
  const cpu_adam::ParamsOut out =
      copy_out ? cpu_adam::ParamsOut{a.Out(), DType::BF16} : cpu_adam::ParamsOut{};
  auto adam = [&](Isa isa) {
    cpu_adam::set_isa(isa);
    ++hp.step;
    const double s = seconds([&] {
      cpu_adam::adam_step(hp, a.n, a.P(), {a.G(), DType::F32}, a.moments(bf16_moments), out, &ex);
    });
    cpu_adam::set_isa(best);
    return s;
  };
  auto roof = [&](bool stream) {
    return seconds([&] {
      ex.for_chunks(a.n, 64, 0, [&](size_t, size_t b, size_t e) {
        uint16_t* o = copy_out ? a.Out() + b : nullptr;
        if (bf16_moments) {
          roof_fns.bf16_moments(e - b, a.P() + b, a.G() + b, a.M16() + b, a.V16() + b, o, stream);
        } else {
          roof_fns.f32(e - b, a.P() + b, a.G() + b, a.M() + b, a.V() + b, o, stream);
        }
      });
    });
  };
  double t_ours = 1e30, t_plain = 1e30, t_stream = 1e30, t_avx2 = 1e30, t_scalar = 1e30;
  std::vector<double> pair_ratios;
  adam(best);  // warm up: page tables, TBB workers
  roof(false);
  for (int r = 0; r < opt.reps; ++r) {
    std::fprintf(stderr, "\r  %s: rep %d/%d", name.c_str(), r + 1, opt.reps);
    const double plain = roof(false);
    const double ours = adam(best);
    const double streamed = copy_out ? roof(true) : 1e30;
    t_plain = std::min(t_plain, plain);
    t_ours = std::min(t_ours, ours);
    t_stream = std::min(t_stream, streamed);
    pair_ratios.push_back(std::min(plain, streamed) / ours);
    if (best == Isa::kAvx512) t_avx2 = std::min(t_avx2, adam(Isa::kAvx2));
    if (opt.scalar && r < std::max(1, opt.reps / 2))
      t_scalar = std::min(t_scalar, adam(Isa::kScalar));
  }
  std::fprintf(stderr, "\n");
  const double n = static_cast<double>(a.n);
  Row row;
  row.config = name;
  row.ours = n / t_ours;
  row.roof_plain = n / t_plain;
  row.roof_stream = copy_out ? n / t_stream : 0.0;
  row.roof = std::max(row.roof_plain, row.roof_stream);
  row.avx2 = best == Isa::kAvx512 ? n / t_avx2 : 0.0;
  row.scalar = opt.scalar ? n / t_scalar : 0.0;
  std::sort(pair_ratios.begin(), pair_ratios.end());
  row.paired = pair_ratios[pair_ratios.size() / 2];
  return row;
}

void print_rows(const std::vector<Row>& rows) {
  std::printf("\n%-26s %9s %9s %6s %6s %9s %9s %9s %9s %9s\n", "config (G params/s)", "ours",
              "roofline", "frac", "paired", "avx2", "scalar", "x scalar", "torch", "x torch");
  for (const Row& r : rows) {
    auto g = [](double x) { return x / 1e9; };
    std::printf("%-26s %9.3f %9.3f %6.3f %6.3f", r.config.c_str(), g(r.ours), g(r.roof),
                r.ours / r.roof, r.paired);
    r.avx2 > 0 ? std::printf(" %9.3f", g(r.avx2)) : std::printf(" %9s", "-");
    r.scalar > 0 ? std::printf(" %9.3f %8.2fx", g(r.scalar), r.ours / r.scalar)
                 : std::printf(" %9s %9s", "-", "-");
    r.torch > 0 ? std::printf(" %9.3f %8.2fx\n", g(r.torch), r.ours / r.torch)
                : std::printf(" %9s %9s\n", "-", "-");
  }
  std::printf(
      "\nfrac: best ours / best roofline. paired: median over reps of roofline time / ours time,\n"
      "each pair run back to back. roofline: m = m*0.5 + g; v = v*0.5 + g; p = p + g (28 B/param;\n"
      "bf16 moments: 20 B/param; +2 B copy-out, best of plain and streaming stores). avx2: our\n"
      "AVX2 path. x torch: against torch.optim.Adam(foreach=True), fp32 moments, no copy-out, "
      "same\n"
      "thread count.\n");
  for (const Row& r : rows) {
    if (r.roof_stream > 0) {
      std::printf("  %s: copy-out roofline plain %.3f, streaming %.3f G params/s\n",
                  r.config.c_str(), r.roof_plain / 1e9, r.roof_stream / 1e9);
    }
  }
}

int run(const Options& opt) {
  const Isa best = cpu_adam::active_isa();
  const bool avx512 = cpu_adam::isa_supported(Isa::kAvx512);
  const Rooflines roof_fns{avx512 ? roofline_avx512 : roofline_avx2,
                           avx512 ? roofline_bf16_moments_avx512 : roofline_bf16_moments_avx2};
  std::printf("bench_cpu_adam: n = %zu fp32 params, best of %d reps, active ISA %s\n", opt.n,
              opt.reps, std::string(cpu_adam::isa_name(best)).c_str());
  std::fprintf(stderr, "allocating and filling %.1f GB...\n",
               static_cast<double>(opt.n) * 22 / 1e9);
  Arrays a(opt.n);
  std::vector<Row> rows;
  for (unsigned t : opt.threads) {
    const Executor ex(t);
    const std::string th = std::to_string(t) + (t == 1 ? " thread" : " threads");
    const auto ds = cpu_adam::Formula::kDeepSpeed;
    rows.push_back(measure(a, ex, false, false, ds, opt, roof_fns, th + ", fp32"));
    rows.push_back(measure(a, ex, true, false, ds, opt, roof_fns, th + ", +bf16 out"));
    rows.push_back(measure(a, ex, false, false, cpu_adam::Formula::kPyTorch, opt, roof_fns,
                           th + ", torch formula"));
    rows.push_back(measure(a, ex, false, true, ds, opt, roof_fns, th + ", bf16 moments"));
    rows.push_back(measure(a, ex, true, true, ds, opt, roof_fns, th + ", bf16 m + out"));
    if (opt.torch) {
      std::fprintf(stderr, "  torch.optim.Adam(foreach=True), %s...\n", th.c_str());
      const double torch = torch_params_per_s(opt.n, t, opt.torch_reps);
      for (size_t k = rows.size() - 5; k < rows.size(); ++k) rows[k].torch = torch;
    }
  }
  print_rows(rows);
  return 0;
}

}  // namespace
}  // namespace outcore::bench

int main(int argc, char** argv) {
  outcore::tools::apply_environment_settings();
  outcore::bench::Options opt;
  CLI::App app{"Fused CPU Adam against the memory roofline, the scalar path and PyTorch"};
  app.add_option("--n", opt.n, "parameters per step")
      ->check(CLI::Range(size_t{1}, size_t{1} << 34));
  app.add_option("--reps", opt.reps, "repetitions (best is reported)")->check(CLI::Range(1, 1000));
  app.add_option("--threads", opt.threads, "thread counts to measure")->check(CLI::Range(1u, 256u));
  app.add_option("--torch-reps", opt.torch_reps, "PyTorch steps timed")->check(CLI::Range(1, 100));
  bool no_torch = false, no_scalar = false;
  app.add_flag("--no-torch", no_torch, "skip the PyTorch comparison");
  app.add_flag("--no-scalar", no_scalar, "skip the scalar path");
  CLI11_PARSE(app, argc, argv);
  opt.torch = !no_torch;
  opt.scalar = !no_scalar;
  try {
    return outcore::bench::run(opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cpu_adam: %s\n", e.what());
    return 1;
  }
}
