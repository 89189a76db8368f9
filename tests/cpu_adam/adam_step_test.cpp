// adam_step: every ISA against the scalar reference, closed forms, fused options, bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "test_util.hpp"

namespace outcore::cpu_adam {
namespace {

using testing::first_bit_difference;
using testing::IsaGuard;
using testing::random_floats;
using testing::supported_isas;
using testing::to_half;

// One optimizer state (moments kept both as fp32 and as bf16; a step uses one pair) plus the
// gradient storage for every dtype.
struct State {
  explicit State(size_t n, uint32_t seed)
      : p(random_floats(n, seed)), m(n, 0.0f), v(n, 0.0f), mh(n, 0), vh(n, 0), out(n, 0) {}
  Moments moments(DType t) {
    if (t == DType::BF16) return {mh.data(), vh.data(), t};
    return {m.data(), v.data(), t};
  }
  std::vector<float> p, m, v;
  std::vector<uint16_t> mh, vh, out;
};

struct Grads {
  Grads(size_t n, uint32_t seed)
      : f32(random_floats(n, seed, 0.1f)),
        bf16(to_half(f32, DType::BF16)),
        f16(to_half(f32, DType::F16)) {}
  GradIn in(DType t) const {
    if (t == DType::BF16) return {bf16.data(), t};
    if (t == DType::F16) return {f16.data(), t};
    return {f32.data(), t};
  }
  std::vector<float> f32;
  std::vector<uint16_t> bf16, f16;
};

enum class Decay { kNone, kL2, kDecoupled };

struct Combo {
  Formula formula;
  DType grad;
  int out;  // 0 none, 1 bf16, 2 fp16
  Decay decay;
  bool bias_correction;
  bool scaled;
  DType moments = DType::F32;
};

std::string describe(const Combo& c, size_t n) {
  return "formula=" + std::to_string(static_cast<int>(c.formula)) +
         " grad=" + std::string(dtype_name(c.grad)) + " out=" + std::to_string(c.out) +
         " decay=" + std::to_string(static_cast<int>(c.decay)) +
         " bc=" + std::to_string(c.bias_correction) + " scaled=" + std::to_string(c.scaled) +
         " moments=" + std::string(dtype_name(c.moments)) + " n=" + std::to_string(n);
}

AdamParams params_for(const Combo& c, uint64_t step) {
  AdamParams hp;
  hp.lr = 1e-3 * (1.0 + 0.25 * std::sin(static_cast<double>(step)));
  hp.weight_decay = c.decay == Decay::kNone ? 0.0 : 0.05;
  hp.adamw_mode = c.decay != Decay::kL2;
  hp.bias_correction = c.bias_correction;
  hp.formula = c.formula;
  hp.grad_scale = c.scaled ? 1.0 / 1024.0 * 0.7 : 1.0;
  hp.step = step;
  return hp;
}

ParamsOut out_for(int out, std::vector<uint16_t>& buf) {
  if (out == 0) return {};
  return {buf.data(), out == 1 ? DType::BF16 : DType::F16};
}

// Runs `steps` steps through adam_step (active ISA, optional executor) and through the
// reference, and expects bit-identical params, moments and copy-out after every step.
void expect_matches_reference(const Combo& c, size_t n, int steps, const Executor* ex) {
  SCOPED_TRACE(describe(c, n));
  State ours(n, 7 + static_cast<uint32_t>(n)), ref = ours;
  for (int t = 1; t <= steps; ++t) {
    const Grads g(n, 1000u * t + static_cast<uint32_t>(n));
    const AdamParams hp = params_for(c, t);
    adam_step(hp, n, ours.p.data(), g.in(c.grad), ours.moments(c.moments), out_for(c.out, ours.out),
              ex);
    adam_step_reference(hp, n, ref.p.data(), g.in(c.grad), ref.moments(c.moments),
                        out_for(c.out, ref.out));
    ASSERT_EQ(first_bit_difference(ours.p.data(), ref.p.data(), n), -1) << "params, step " << t;
    ASSERT_EQ(first_bit_difference(ours.m.data(), ref.m.data(), n), -1) << "exp_avg, step " << t;
    ASSERT_EQ(first_bit_difference(ours.v.data(), ref.v.data(), n), -1) << "exp_avg_sq, step " << t;
    ASSERT_EQ(first_bit_difference(ours.mh.data(), ref.mh.data(), n), -1)
        << "bf16 exp_avg, step " << t;
    ASSERT_EQ(first_bit_difference(ours.vh.data(), ref.vh.data(), n), -1)
        << "bf16 exp_avg_sq, step " << t;
    ASSERT_EQ(first_bit_difference(ours.out.data(), ref.out.data(), n), -1)
        << "copy-out, step " << t;
  }
}

std::vector<Combo> all_combos() {
  std::vector<Combo> out;
  for (Formula f : {Formula::kDeepSpeed, Formula::kPyTorch})
    for (DType g : {DType::F32, DType::BF16, DType::F16})
      for (int o : {0, 1, 2})
        for (Decay d : {Decay::kNone, Decay::kL2, Decay::kDecoupled})
          for (bool bc : {true, false})
            for (bool s : {false, true})
              for (DType m : {DType::F32, DType::BF16}) out.push_back({f, g, o, d, bc, s, m});
  return out;
}

TEST(AdamStep, EveryIsaMatchesScalarReferenceBitwiseOverManyStepsAndOddSizes) {
  const size_t sizes[] = {1, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 129, 1031};
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(std::string("isa=") + std::string(isa_name(isa)));
    IsaGuard guard(isa);
    for (const Combo& c : all_combos()) {
      for (size_t n : sizes) expect_matches_reference(c, n, 6, nullptr);
    }
  }
}

TEST(AdamStep, ThreadedStepMatchesReferenceBitwise) {
  const Executor two(2), three(3);
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(std::string("isa=") + std::string(isa_name(isa)));
    IsaGuard guard(isa);
    for (DType g : {DType::F32, DType::BF16, DType::F16}) {
      for (DType m : {DType::F32, DType::BF16}) {
        const Combo c{Formula::kDeepSpeed, g, 1, Decay::kDecoupled, true, true, m};
        expect_matches_reference(c, 300007, 3, &two);
        expect_matches_reference(c, 200001, 2, &three);
      }
    }
  }
}

// A bf16-moment step is the fp32-moment step from the same (widened) moments, with the new
// moments rounded to nearest even on store and the parameters updated from the unrounded ones.
TEST(AdamStep, Bf16MomentsAreTheFp32StepRoundedOnStore) {
  const size_t n = 1031;
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(std::string("isa=") + std::string(isa_name(isa)));
    IsaGuard guard(isa);
    for (Formula f : {Formula::kDeepSpeed, Formula::kPyTorch}) {
      const Combo c{f, DType::F32, 0, Decay::kDecoupled, true, false, DType::BF16};
      State s(n, 11);
      size_t rounded = 0;
      for (int t = 1; t <= 4; ++t) {
        const Grads g(n, 500u + t);
        const AdamParams hp = params_for(c, t);
        std::vector<float> p32 = s.p, m32(n), v32(n);
        for (size_t i = 0; i < n; ++i) m32[i] = bf16_to_fp32(s.mh[i]);
        for (size_t i = 0; i < n; ++i) v32[i] = bf16_to_fp32(s.vh[i]);
        adam_step(hp, n, p32.data(), g.in(DType::F32), m32.data(), v32.data());
        adam_step(hp, n, s.p.data(), g.in(DType::F32), s.moments(DType::BF16));
        ASSERT_EQ(first_bit_difference(s.p.data(), p32.data(), n), -1) << "params, step " << t;
        const std::vector<uint16_t> mr = to_half(m32, DType::BF16), vr = to_half(v32, DType::BF16);
        ASSERT_EQ(first_bit_difference(s.mh.data(), mr.data(), n), -1) << "exp_avg, step " << t;
        ASSERT_EQ(first_bit_difference(s.vh.data(), vr.data(), n), -1) << "exp_avg_sq, step " << t;
        for (size_t i = 0; i < n; ++i) rounded += bf16_to_fp32(s.mh[i]) != m32[i];
      }
      // The rounding matters: most new moments are not representable in bf16.
      EXPECT_GT(rounded, n);
    }
  }
}

TEST(AdamStep, SubRangeAtUnalignedOffsetTouchesOnlyItsElements) {
  constexpr size_t kTotal = 1000, kBegin = 3, kLen = 517;
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(std::string("isa=") + std::string(isa_name(isa)));
    IsaGuard guard(isa);
    State s(kTotal, 1), before = s;
    const Grads g(kTotal, 2);
    AdamParams hp;
    adam_step(hp, kLen, s.p.data() + kBegin, {g.f32.data() + kBegin, DType::F32},
              s.m.data() + kBegin, s.v.data() + kBegin, {s.out.data() + kBegin, DType::BF16});
    for (size_t i = 0; i < kTotal; ++i) {
      const bool inside = i >= kBegin && i < kBegin + kLen;
      if (inside) {
        if (g.f32[i] != 0.0f) {
          EXPECT_GT(s.v[i], 0.0f) << i;
        }
      } else {
        EXPECT_EQ(std::memcmp(&s.p[i], &before.p[i], 4), 0) << i;
        EXPECT_EQ(s.m[i], 0.0f) << i;
        EXPECT_EQ(s.v[i], 0.0f) << i;
        EXPECT_EQ(s.out[i], 0) << i;
      }
    }
  }
}

// An independent double-precision Adam written from the textbook formula (ds_config.md).
struct DoubleAdam {
  double p, m = 0.0, v = 0.0;
  void step(const AdamParams& hp, double g) {
    const double t = static_cast<double>(hp.step);
    if (!hp.adamw_mode) g += hp.weight_decay * p;
    m = hp.beta1 * m + (1 - hp.beta1) * g;
    v = hp.beta2 * v + (1 - hp.beta2) * g * g;
    const double bc1 = hp.bias_correction ? 1 - std::pow(hp.beta1, t) : 1.0;
    const double bc2 = hp.bias_correction ? 1 - std::pow(hp.beta2, t) : 1.0;
    if (hp.adamw_mode) p -= hp.lr * hp.weight_decay * p;
    p -= hp.lr * (m / bc1) / (std::sqrt(v / bc2) + hp.eps);
  }
};

TEST(AdamStep, AgreesWithDoublePrecisionTextbookAdam) {
  constexpr size_t n = 257;
  for (Formula f : {Formula::kDeepSpeed, Formula::kPyTorch}) {
    for (bool adamw : {true, false}) {
      for (bool bc : {true, false}) {
        SCOPED_TRACE("formula=" + std::to_string(static_cast<int>(f)) +
                     " adamw=" + std::to_string(adamw) + " bc=" + std::to_string(bc));
        State s(n, 11);
        std::vector<DoubleAdam> ref;
        for (float p : s.p) ref.push_back({p});
        for (uint64_t t = 1; t <= 30; ++t) {
          const Grads g(n, 500 + t);
          AdamParams hp;
          hp.lr = 1e-2 / static_cast<double>(t);
          hp.weight_decay = 0.1;
          hp.adamw_mode = adamw;
          hp.bias_correction = bc;
          hp.formula = f;
          hp.step = t;
          adam_step(hp, n, s.p.data(), g.in(DType::F32), s.m.data(), s.v.data());
          for (size_t i = 0; i < n; ++i) ref[i].step(hp, g.f32[i]);
        }
        // fp32 against double: a few ulps per step, plus an absolute floor for values that
        // cancel towards zero (scaled to the step size for p, to the array for m and v).
        double max_m = 0.0, max_v = 0.0;
        for (const auto& r : ref) max_m = std::max(max_m, std::abs(r.m));
        for (const auto& r : ref) max_v = std::max(max_v, std::abs(r.v));
        for (size_t i = 0; i < n; ++i) {
          EXPECT_NEAR(s.p[i], ref[i].p, 1e-6 * std::abs(ref[i].p) + 1e-7) << i;
          EXPECT_NEAR(s.m[i], ref[i].m, 1e-5 * std::abs(ref[i].m) + 1e-6 * max_m) << i;
          EXPECT_NEAR(s.v[i], ref[i].v, 1e-5 * std::abs(ref[i].v) + 1e-6 * max_v) << i;
        }
      }
    }
  }
}

TEST(AdamStep, FirstBiasCorrectedStepMovesEveryParamByLr) {
  // At t = 1 with bias correction, m_hat = g and v_hat = g^2, so p moves by lr * sign(g).
  constexpr size_t n = 100;
  for (Formula f : {Formula::kDeepSpeed, Formula::kPyTorch}) {
    std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f), g(n);
    for (size_t i = 0; i < n; ++i) g[i] = (i % 2 ? 1.0f : -1.0f) * (0.5f + static_cast<float>(i));
    AdamParams hp;
    hp.lr = 0.01;
    hp.formula = f;
    adam_step(hp, n, p.data(), {g.data(), DType::F32}, m.data(), v.data());
    for (size_t i = 0; i < n; ++i) {
      EXPECT_NEAR(p[i], g[i] > 0 ? 0.99f : 1.01f, 1e-6f) << i;
      EXPECT_FLOAT_EQ(m[i], 0.1f * g[i]) << i;
      EXPECT_FLOAT_EQ(v[i], 0.001f * g[i] * g[i]) << i;
    }
  }
}

TEST(AdamStep, FusedGradScaleEqualsPrescaledGradientsBitwise) {
  constexpr size_t n = 4099;
  const double scale = 0.37 / 65536.0;
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(std::string("isa=") + std::string(isa_name(isa)));
    IsaGuard guard(isa);
    for (DType gt : {DType::F32, DType::BF16, DType::F16}) {
      const Grads g(n, 99);
      std::vector<float> prescaled(n);
      for (size_t i = 0; i < n; ++i) {
        const float gi = gt == DType::F32    ? g.f32[i]
                         : gt == DType::BF16 ? bf16_to_fp32(g.bf16[i])
                                             : fp16_to_fp32(g.f16[i]);
        prescaled[i] = gi * static_cast<float>(scale);
      }
      State fused(n, 3), plain = fused;
      AdamParams hp;
      hp.weight_decay = 0.01;
      adam_step(hp, n, plain.p.data(), {prescaled.data(), DType::F32}, plain.m.data(),
                plain.v.data());
      hp.grad_scale = scale;
      adam_step(hp, n, fused.p.data(), g.in(gt), fused.m.data(), fused.v.data());
      EXPECT_EQ(first_bit_difference(fused.p.data(), plain.p.data(), n), -1);
      EXPECT_EQ(first_bit_difference(fused.m.data(), plain.m.data(), n), -1);
      EXPECT_EQ(first_bit_difference(fused.v.data(), plain.v.data(), n), -1);
    }
  }
}

TEST(AdamStep, CopyOutIsTheRoundedNewParams) {
  constexpr size_t n = 1000;
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    for (DType ot : {DType::BF16, DType::F16}) {
      SCOPED_TRACE(std::string(isa_name(isa)) + " " + std::string(dtype_name(ot)));
      State s(n, 5);
      const Grads g(n, 6);
      adam_step(AdamParams{}, n, s.p.data(), g.in(DType::F32), s.m.data(), s.v.data(),
                {s.out.data(), ot});
      for (size_t i = 0; i < n; ++i) {
        const uint16_t want = ot == DType::BF16 ? fp32_to_bf16(s.p[i]) : fp32_to_fp16(s.p[i]);
        ASSERT_EQ(s.out[i], want) << i;
      }
    }
  }
}

TEST(AdamStep, LargeCopyOutStreamedOrNotMatchesReference) {
  // Over 1 MiB of copy-out, an aligned output is written with non-temporal stores; a
  // misaligned one with plain stores. Both must give the reference's bits.
  constexpr size_t n = (size_t{1} << 20) + 37;
  const Grads g(n, 21);
  AlignedBuffer out_buf((n + 64) * 2), ref_out(n * 2);
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    for (size_t shift : {size_t{0}, size_t{1}}) {
      for (DType ot : {DType::BF16, DType::F16}) {
        SCOPED_TRACE(std::string(isa_name(isa)) + " shift=" + std::to_string(shift) + " " +
                     std::string(dtype_name(ot)));
        State s(n, 22), ref = s;
        uint16_t* out = out_buf.as<uint16_t>().data() + shift;
        AdamParams hp;
        hp.weight_decay = 0.01;
        adam_step(hp, n, s.p.data(), g.in(DType::BF16), s.m.data(), s.v.data(), {out, ot});
        adam_step_reference(hp, n, ref.p.data(), g.in(DType::BF16), ref.m.data(), ref.v.data(),
                            {ref_out.data(), ot});
        EXPECT_EQ(first_bit_difference(s.p.data(), ref.p.data(), n), -1);
        EXPECT_EQ(first_bit_difference(out, ref_out.as<uint16_t>().data(), n), -1);
      }
    }
  }
}

TEST(AdamStep, NonFiniteGradientPropagatesIntoTheState) {
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    State s(40, 8);
    std::vector<float> g(40, 0.5f);
    g[17] = std::nanf("");
    adam_step(AdamParams{}, 40, s.p.data(), {g.data(), DType::F32}, s.m.data(), s.v.data());
    EXPECT_TRUE(std::isnan(s.p[17]) && std::isnan(s.m[17]) && std::isnan(s.v[17]));
    EXPECT_TRUE(std::isfinite(s.p[16]) && std::isfinite(s.p[18]));
  }
}

// Expects `fn` to throw InvalidArgument mentioning `word`, with no array modified.
template <typename Fn>
void expect_rejected(Fn&& fn, const std::string& word) {
  State s(64, 1);
  const State before = s;
  const Grads g(64, 2);
  try {
    fn(s, g);
    ADD_FAILURE() << "no exception for " << word;
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
  }
  EXPECT_EQ(first_bit_difference(s.p.data(), before.p.data(), 64), -1);
  EXPECT_EQ(first_bit_difference(s.m.data(), before.m.data(), 64), -1);
}

TEST(AdamStep, RejectsInvalidHyperParametersBeforeTouchingMemory) {
  auto with = [](auto change) {
    return [change](State& s, const Grads& g) {
      AdamParams hp;
      change(hp);
      adam_step(hp, 64, s.p.data(), g.in(DType::F32), s.m.data(), s.v.data());
    };
  };
  expect_rejected(with([](AdamParams& h) { h.lr = -1e-3; }), "lr");
  expect_rejected(with([](AdamParams& h) { h.lr = NAN; }), "lr");
  expect_rejected(with([](AdamParams& h) { h.beta1 = 1.0; }), "beta1");
  expect_rejected(with([](AdamParams& h) { h.beta2 = -0.1; }), "beta2");
  expect_rejected(with([](AdamParams& h) { h.eps = -1.0; }), "eps");
  expect_rejected(with([](AdamParams& h) { h.weight_decay = INFINITY; }), "weight_decay");
  expect_rejected(with([](AdamParams& h) { h.step = 0; }), "step");
  expect_rejected(with([](AdamParams& h) { h.grad_scale = 1e300; }), "grad_scale");
  expect_rejected(with([](AdamParams& h) { h.formula = static_cast<Formula>(7); }), "formula");
}

TEST(AdamStep, RejectsBadBuffersBeforeTouchingMemory) {
  expect_rejected(
      [](State& s, const Grads& g) {
        adam_step({}, 64, nullptr, g.in(DType::F32), s.m.data(), s.v.data());
      },
      "params");
  expect_rejected(
      [](State& s, const Grads&) {
        adam_step({}, 64, s.p.data(), {nullptr, DType::F32}, s.m.data(), s.v.data());
      },
      "grads");
  expect_rejected(
      [](State& s, const Grads& g) {
        adam_step({}, 64, s.p.data(), {g.f32.data(), static_cast<DType>(9)}, s.m.data(),
                  s.v.data());
      },
      "dtype");
  expect_rejected(
      [](State& s, const Grads& g) {
        adam_step({}, 64, s.p.data(), g.in(DType::F32), s.m.data(), s.v.data(),
                  {s.out.data(), DType::F32});
      },
      "bf16 or fp16");
  expect_rejected(
      [](State& s, const Grads& g) {
        adam_step({}, 64, s.p.data(), g.in(DType::F32), {s.mh.data(), s.vh.data(), DType::F16});
      },
      "fp32 or bf16");
  expect_rejected(
      [](State& s, const Grads& g) {
        // exp_avg_sq starts 32 bf16 elements after exp_avg: the 64-element arrays overlap.
        adam_step({}, 64, s.p.data(), g.in(DType::F32), {s.m.data(), s.m.data() + 16, DType::BF16});
      },
      "overlap");
  expect_rejected(
      [](State& s, const Grads& g) {
        adam_step({}, 60, s.p.data(), g.in(DType::F32), s.m.data() + 2, s.m.data(), {});
      },
      "overlap");
  expect_rejected(
      [](State& s, const Grads& g) {
        adam_step({}, 64, s.p.data(), g.in(DType::F32), s.m.data(), s.v.data(),
                  {s.p.data() + 1, DType::BF16});
      },
      "overlap");
}

TEST(AdamStep, EmptyRangeIsANoOpEvenWithNullPointers) {
  adam_step({}, 0, nullptr, {nullptr, DType::BF16}, nullptr, nullptr, {nullptr, DType::BF16});
  const Executor two(2);
  adam_step({}, 0, nullptr, {nullptr, DType::F32}, nullptr, nullptr, {}, &two);
}

}  // namespace
}  // namespace outcore::cpu_adam
