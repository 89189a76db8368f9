// cpu_adam_step: the cpu_adam layer alone. Takes a few AdamW steps on a small fp32 parameter
// vector with cpu_adam::adam_step (the best kernel this CPU runs: AVX-512, AVX2 or scalar) and
// the same steps with the textbook update written out below in double, then compares them.
//
//   build/bin/cpu_adam_step        # OUTCORE_CPU_ADAM_ISA=scalar|avx2|avx512 forces a kernel
//
// The loss is 0.5 * |p - target|^2, so the gradient is p - target and each step moves the
// parameters toward the target. Exit 0 when kernel and reference agree to fp32 rounding.
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cpu_adam/cpu_adam.hpp"
#include "tools/env_settings.hpp"

using namespace outcore;

constexpr size_t kN = 1001;  // not a multiple of any vector width: the tail loop runs too
constexpr int kSteps = 5;

double loss(const std::vector<float>& p, const std::vector<float>& target) {
  double sum = 0;
  for (size_t i = 0; i < kN; ++i) sum += 0.5 * (p[i] - target[i]) * (p[i] - target[i]);
  return sum;
}

void print(const char* what, const std::vector<float>& p) {
  std::printf("%-22s p[0..3] = %+.6f %+.6f %+.6f %+.6f\n", what, p[0], p[1], p[2], p[3]);
}

int main() {
  outcore::tools::apply_environment_settings();
  try {
    const cpu_adam::AdamParams base{.lr = 0.05, .weight_decay = 0.01};  // adamw_mode: AdamW
    std::vector<float> p(kN), target(kN), grad(kN), exp_avg(kN), exp_avg_sq(kN);
    for (size_t i = 0; i < kN; ++i) {
      p[i] = static_cast<float>(std::sin(0.1 * i));
      target[i] = static_cast<float>(std::cos(0.05 * i));
    }
    std::vector<double> ref_p(p.begin(), p.end()), ref_m(kN), ref_v(kN);
    std::printf("kernel: %s\n", std::string(cpu_adam::isa_name(cpu_adam::active_isa())).c_str());
    print("before:", p);
    const double loss_before = loss(p, target);

    for (int t = 1; t <= kSteps; ++t) {
      for (size_t i = 0; i < kN; ++i) grad[i] = p[i] - target[i];
      cpu_adam::AdamParams hp = base;
      hp.step = static_cast<uint64_t>(t);  // bias corrections use beta^t
      cpu_adam::adam_step(hp, kN, p.data(), {grad.data(), DType::F32}, exp_avg.data(),
                          exp_avg_sq.data());

      // Reference: AdamW (Loshchilov & Hutter) with bias correction, same gradients, in double.
      const double bc1 = 1 - std::pow(hp.beta1, t), bc2 = 1 - std::pow(hp.beta2, t);
      for (size_t i = 0; i < kN; ++i) {
        const double g = grad[i];
        ref_m[i] = hp.beta1 * ref_m[i] + (1 - hp.beta1) * g;
        ref_v[i] = hp.beta2 * ref_v[i] + (1 - hp.beta2) * g * g;
        const double update = (ref_m[i] / bc1) / (std::sqrt(ref_v[i] / bc2) + hp.eps);
        ref_p[i] -= hp.lr * (hp.weight_decay * ref_p[i] + update);
      }
    }

    print(("after " + std::to_string(kSteps) + " AdamW steps:").c_str(), p);
    double max_err = 0;
    for (size_t i = 0; i < kN; ++i) max_err = std::fmax(max_err, std::fabs(p[i] - ref_p[i]));
    const double tolerance = 1e-6;  // fp32 rounding; a wrong formula errs by about lr = 0.05
    const double loss_after = loss(p, target);
    std::printf("loss 0.5*|p - target|^2: %.3f -> %.3f\n", loss_before, loss_after);
    std::printf("max |kernel - reference| = %.2e (tolerance %.0e): %s\n", max_err, tolerance,
                max_err <= tolerance ? "ok" : "FAILED");
    return max_err <= tolerance && loss_after < loss_before ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cpu_adam_step: %s\n", e.what());
    return 1;
  }
}
