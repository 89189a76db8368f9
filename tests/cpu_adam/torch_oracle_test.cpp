// adam_step against torch.optim.Adam / AdamW (PyTorch run by /usr/bin/python3): 20 steps with
// weight decay, bias correction and a changing learning rate, both formulas, fp32 and bf16
// gradients, unscaling fused in, moments kept in fp32 or in bf16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cpu_adam/cpu_adam.hpp"
#include "test_util.hpp"
#include "tests/common/oracle_unavailable.hpp"

namespace outcore::cpu_adam {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kN = 10007;  // not a multiple of any vector width
constexpr uint32_t kSteps = 20;

struct OracleCase {
  std::string name;
  uint32_t n = 0, steps = 0, adamw = 0, bf16_grads = 0, bf16_moments = 0;
  double beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  std::vector<double> lr;
  std::vector<float> p0, grads, p, m, v;
};

template <typename T>
void read_into(std::ifstream& f, std::vector<T>& out, size_t count) {
  out.resize(count);
  f.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(count * sizeof(T)));
}

bool read_case(const fs::path& file, OracleCase& c) {
  std::ifstream f(file, std::ios::binary);
  char magic[8];
  f.read(magic, 8);
  if (!f || std::memcmp(magic, "OCADAM02", 8) != 0) return false;
  uint32_t u[5];
  double d[4];
  f.read(reinterpret_cast<char*>(u), sizeof(u));
  f.read(reinterpret_cast<char*>(d), sizeof(d));
  c.name = file.stem().string();
  c.n = u[0], c.steps = u[1], c.adamw = u[2], c.bf16_grads = u[3], c.bf16_moments = u[4];
  c.beta1 = d[0], c.beta2 = d[1], c.eps = d[2], c.weight_decay = d[3];
  read_into(f, c.lr, c.steps);
  read_into(f, c.p0, c.n);
  read_into(f, c.grads, size_t{c.n} * c.steps);
  read_into(f, c.p, c.n);
  read_into(f, c.m, c.n);
  read_into(f, c.v, c.n);
  return static_cast<bool>(f);
}

struct Result {
  std::vector<float> p, m, v;
};

// Which deliberate mistake to make (to prove the tolerance would catch one).
enum class Mistake { kNone, kNoBiasCorrection, kSwappedDecayMode, kStepOffByOne };

Result run_ours(const OracleCase& c, Formula formula, bool fuse_unscale, Mistake mistake) {
  Result r{c.p0, std::vector<float>(c.n, 0.0f), std::vector<float>(c.n, 0.0f)};
  constexpr double kLossScale = 1024.0;  // a power of two: scaling is exact
  std::vector<float> scaled(c.n);
  std::vector<uint16_t> bf16(c.n), m16(c.n, 0), v16(c.n, 0);
  for (uint32_t t = 1; t <= c.steps; ++t) {
    const float* g = c.grads.data() + size_t{t - 1} * c.n;
    AdamParams hp;
    hp.lr = c.lr[t - 1];
    hp.beta1 = c.beta1;
    hp.beta2 = c.beta2;
    hp.eps = c.eps;
    hp.weight_decay = c.weight_decay;
    hp.adamw_mode = (c.adamw != 0) != (mistake == Mistake::kSwappedDecayMode);
    hp.bias_correction = mistake != Mistake::kNoBiasCorrection;
    hp.step = t + (mistake == Mistake::kStepOffByOne ? 1 : 0);
    hp.formula = formula;
    GradIn in{g, DType::F32};
    if (fuse_unscale) {
      for (uint32_t i = 0; i < c.n; ++i) scaled[i] = g[i] * static_cast<float>(kLossScale);
      hp.grad_scale = 1.0 / kLossScale;
      in = {scaled.data(), DType::F32};
    }
    if (c.bf16_grads) {  // the oracle's gradients are bf16 values: pass them as bf16
      for (uint32_t i = 0; i < c.n; ++i)
        bf16[i] = fp32_to_bf16(static_cast<const float*>(in.data)[i]);
      in = {bf16.data(), DType::BF16};
    }
    if (c.bf16_moments) {
      adam_step(hp, c.n, r.p.data(), in, {m16.data(), v16.data(), DType::BF16});
    } else {
      adam_step(hp, c.n, r.p.data(), in, r.m.data(), r.v.data());
    }
  }
  if (c.bf16_moments) {
    for (uint32_t i = 0; i < c.n; ++i) r.m[i] = bf16_to_fp32(m16[i]);
    for (uint32_t i = 0; i < c.n; ++i) r.v[i] = bf16_to_fp32(v16[i]);
  }
  return r;
}

// Worst |ours - torch| / (rel * |torch| + floor) over an array. rel is 1e-6 with fp32 moments
// and kBf16Rel with bf16 ones. The floor covers values that cancel towards zero, where a
// relative error means nothing: for p, rel of the total distance the learning rate can move it;
// for m, rel of the largest gradient that element saw; for v, rel of the largest squared
// gradient. A ratio <= 1 is a pass.
//
// With bf16 moments an fp32 moment one ulp away from torch's can round to the neighbouring bf16
// value (a relative step of up to 2^-7), and the next steps carry that difference into p. Such
// flips are rare (measured over 20 steps of 10007 elements: worst 1.3e-5 relative in v, 8e-5 of
// the learning-rate floor in p), so the tolerance is 2^-10 (1/8 of a bf16 ulp): ten times the
// worst seen, and a wrong formula (a step number off by one) still misses by over 20 times.
constexpr double kBf16Rel = 1.0 / 1024.0;

struct Worst {
  double ratio = 0;
  size_t index = 0;
};

Worst worst_ratio(const std::vector<float>& ours, const std::vector<float>& ref,
                  const std::vector<double>& floor, double rel) {
  Worst w;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::abs(static_cast<double>(ours[i]) - ref[i]);
    const double tol = rel * std::abs(static_cast<double>(ref[i])) + floor[i];
    const double ratio = std::isnan(err) ? INFINITY : err / tol;
    if (ratio > w.ratio) w = {ratio, i};
  }
  return w;
}

struct Floors {
  double rel = 1e-6;
  std::vector<double> p, m, v;
};

Floors floors_for(const OracleCase& c) {
  const double rel = c.bf16_moments ? kBf16Rel : 1e-6;
  double lr_sum = 0;
  for (double lr : c.lr) lr_sum += lr;
  Floors f{rel, std::vector<double>(c.n, rel * lr_sum), std::vector<double>(c.n, 0.0),
           std::vector<double>(c.n, 0.0)};
  for (uint32_t t = 0; t < c.steps; ++t) {
    for (uint32_t i = 0; i < c.n; ++i) {
      const double g = std::abs(c.grads[size_t{t} * c.n + i]);
      f.m[i] = std::max(f.m[i], rel * g);
      f.v[i] = std::max(f.v[i], rel * g * g);
    }
  }
  return f;
}

double worst_of(const Result& r, const OracleCase& c, const Floors& f, std::string* report) {
  const Worst p = worst_ratio(r.p, c.p, f.p, f.rel), m = worst_ratio(r.m, c.m, f.m, f.rel),
              v = worst_ratio(r.v, c.v, f.v, f.rel);
  if (report) {
    char buf[512];
    std::snprintf(buf, sizeof(buf),
                  "p ratio %.3g at %zu (ours %.9g torch %.9g); m ratio %.3g at %zu; v ratio %.3g "
                  "at %zu",
                  p.ratio, p.index, r.p[p.index], c.p[p.index], m.ratio, m.index, v.ratio, v.index);
    *report = buf;
  }
  return std::max({p.ratio, m.ratio, v.ratio});
}

class TorchOracle : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(OUTCORE_PYTHON)) OUTCORE_ORACLE_UNAVAILABLE(OUTCORE_PYTHON " not found");
    dir_ = fs::temp_directory_path() / ("outcore_cpu_adam_oracle_" + std::to_string(getpid()));
    fs::create_directories(dir_);
    const std::string cmd = std::string(OUTCORE_PYTHON) + " " + OUTCORE_SOURCE_DIR +
                            "/tests/cpu_adam/torch_adam_oracle.py " + dir_.string() + " " +
                            std::to_string(kN) + " " + std::to_string(kSteps) + " 2>&1";
    std::string out;
    FILE* pipe = popen(cmd.c_str(), "r");
    ASSERT_NE(pipe, nullptr) << cmd;
    char buf[512];
    while (fgets(buf, sizeof(buf), pipe) != nullptr) out += buf;
    const int status = pclose(pipe);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 3) {
      OUTCORE_ORACLE_UNAVAILABLE("PyTorch is not importable by " OUTCORE_PYTHON ": " + out);
    }
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << cmd << "\n" << out;
    for (const char* name :
         {"adam_l2", "adamw", "adamw_bf16_grads", "adam_l2_bf16_moments", "adamw_bf16_moments"}) {
      OracleCase c;
      ASSERT_TRUE(read_case(dir_ / (std::string(name) + ".bin"), c)) << name;
      ASSERT_EQ(c.n, kN);
      ASSERT_EQ(c.steps, kSteps);
      cases_.push_back(std::move(c));
    }
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  fs::path dir_;
  std::vector<OracleCase> cases_;
};

// Runs every case whose moments are bf16 (`bf16_moments`) or fp32, both formulas, with and
// without the fused unscale, and expects each within its tolerance.
void expect_cases_match(const std::vector<OracleCase>& cases, bool bf16_moments) {
  int ran = 0;
  for (const OracleCase& c : cases) {
    if ((c.bf16_moments != 0) != bf16_moments) continue;
    ++ran;
    const Floors f = floors_for(c);
    for (Formula formula : {Formula::kDeepSpeed, Formula::kPyTorch}) {
      for (bool fuse_unscale : {false, true}) {
        std::string report;
        const double worst =
            worst_of(run_ours(c, formula, fuse_unscale, Mistake::kNone), c, f, &report);
        std::printf("%s formula=%d unscale=%d: %s\n", c.name.c_str(), static_cast<int>(formula),
                    fuse_unscale ? 1 : 0, report.c_str());
        EXPECT_LE(worst, 1.0) << c.name << " formula " << static_cast<int>(formula) << " unscale "
                              << fuse_unscale << ": " << report;
      }
    }
  }
  EXPECT_GE(ran, 2);
}

TEST_F(TorchOracle, MatchesTorchAdamAndAdamWWithinOnePpm) { expect_cases_match(cases_, false); }

// torch.optim with its state rounded to bf16 after every step against bf16 moments.
TEST_F(TorchOracle, Bf16MomentsMatchTorchWithBf16StateWithinAnEighthBf16Ulp) {
  expect_cases_match(cases_, true);
}

TEST_F(TorchOracle, ToleranceCatchesAWrongFormula) {
  for (const OracleCase& c : cases_) {
    const Floors f = floors_for(c);
    for (Mistake mistake :
         {Mistake::kNoBiasCorrection, Mistake::kSwappedDecayMode, Mistake::kStepOffByOne}) {
      std::string report;
      const double worst =
          worst_of(run_ours(c, Formula::kDeepSpeed, false, mistake), c, f, &report);
      std::printf("%s mistake=%d: %s\n", c.name.c_str(), static_cast<int>(mistake), report.c_str());
      EXPECT_GT(worst, 10.0) << c.name << " mistake " << static_cast<int>(mistake)
                             << " passed unnoticed: " << report;
    }
  }
}

}  // namespace
}  // namespace outcore::cpu_adam
