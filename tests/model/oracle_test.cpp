// Logits, loss and every parameter gradient against an independent float64 PyTorch reference
// (tests/model/oracle/llama_oracle.py run by /usr/bin/python3), on small random configs.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numbers>

#include "tests/common/numeric.hpp"
#include "tests/common/oracle_unavailable.hpp"
#include "tests/model/model_harness.hpp"

namespace outcore::model {
namespace {

namespace fs = std::filesystem;
using testing::Harness;

struct OracleCase {
  std::string name;
  LlamaConfig config;
  int64_t batch, seq;
  DType dtype;
  float loss_scale;
  DType compute = DType::F32;  // ModelOptions::compute_dtype
  // A loss mask (kIgnoreTarget targets): the first sequence's first half masked, every other
  // sequence masked but for its last two targets.
  bool masked = false;
};

// `c` as Qwen3 (q_norm and k_norm over each head; head_dim given, as Qwen3's configs do).
LlamaConfig qwen3(LlamaConfig c) {
  c.model_type = ModelType::kQwen3;
  c.rope_theta = 1e6;
  return c;
}

// `c` as Qwen2 (biases on q, k and v).
LlamaConfig qwen2(LlamaConfig c) {
  c.model_type = ModelType::kQwen2;
  return c;
}

// `c` with rope_theta `theta` and rope_scaling `s`.
LlamaConfig with_rope(LlamaConfig c, double theta, RopeScaling s) {
  c.rope_theta = theta;
  c.rope_scaling = s;
  return c;
}

// Llama 3.1's factors with a 256-token original context: at head_dim 32 and theta 5e5 the
// wavelengths (6.3 * 2.27^j) put 3 frequencies in the kept regime (< 64), 2 in the blended one
// and 11 in the divided one (> 256), and 64 positions turn the divided ones measurably.
const RopeScaling kLlama3Scaling{.type = RopeScalingType::Llama3,
                                 .factor = 8.0,
                                 .low_freq_factor = 1.0,
                                 .high_freq_factor = 4.0,
                                 .original_max_position_embeddings = 256};

std::vector<OracleCase> cases() {
  using testing::small_config;
  const RopeScaling linear{.type = RopeScalingType::Linear, .factor = 4.0};
  return {
      // grouped KV heads (2 query heads per kv head), untied, two layers
      {"gqa_untied", small_config(32, 48, 2, 4, 2, 61, false), 2, 9, DType::F32, 1.0f},
      // tied embeddings, plain multi-head attention, scaled loss
      {"mha_tied", small_config(32, 40, 1, 2, 2, 50, true), 1, 7, DType::F32, 3.0f},
      // one kv head (MQA), head_dim given (q_dim 32 != hidden 24), two attention blocks
      {"mqa_head_dim", small_config(24, 40, 1, 4, 1, 37, false, 8), 1, 150, DType::F32, 1.0f},
      // bf16 storage, tied, GQA; two logit row chunks and two vocabulary blocks in the head
      {"bf16_tied_chunks", small_config(64, 96, 1, 4, 2, 20000, true), 2, 120, DType::BF16, 1.0f},
      // rope_scaling linear (every frequency divided by 4)
      {"rope_linear", with_rope(small_config(32, 48, 1, 4, 2, 61, false), 10000.0, linear), 2, 24,
       DType::F32, 1.0f},
      // rope_scaling llama3, all three frequency regimes (see kLlama3Scaling)
      {"rope_llama3",
       with_rope(small_config(64, 96, 1, 2, 1, 53, false, 32), 500000.0, kLlama3Scaling), 1, 64,
       DType::F32, 1.0f},
      // Qwen3: per-head q/k norms, head_dim 16 with q_dim 64 != hidden 48, tied, fp32 and bf16
      {"qwen3", qwen3(small_config(48, 96, 2, 4, 2, 61, true, 16)), 2, 20, DType::F32, 1.0f},
      {"qwen3_bf16_compute", qwen3(small_config(48, 96, 2, 4, 2, 61, true, 16)), 1, 40, DType::BF16,
       1.0f, DType::BF16},
      // Qwen2: q, k, v biases, GQA, untied, fp32 and bf16 compute
      {"qwen2", qwen2(small_config(32, 48, 2, 4, 2, 61, false)), 2, 17, DType::F32, 1.0f},
      {"qwen2_bf16_compute", qwen2(small_config(32, 48, 2, 4, 2, 61, false)), 2, 24, DType::BF16,
       1.0f, DType::BF16},
      // bf16 compute: GQA, untied, two layers, two attention blocks, scaled loss
      {"bf16_compute_gqa", small_config(64, 96, 2, 4, 2, 61, false), 1, 130, DType::BF16, 2.0f,
       DType::BF16},
      // bf16 compute: tied, two logit row chunks in the head
      {"bf16_compute_tied_chunks", small_config(64, 96, 1, 4, 2, 20000, true), 2, 120, DType::BF16,
       1.0f, DType::BF16},
      // a loss mask: untied GQA; tied with two logit row chunks, one almost all masked
      {"masked_gqa", small_config(32, 48, 2, 4, 2, 61, false), 2, 9, DType::F32, 2.0f, DType::F32,
       true},
      {"masked_tied_chunks", small_config(64, 96, 1, 4, 2, 20000, true), 2, 120, DType::F32, 1.0f,
       DType::F32, true},
  };
}

void write_file(const fs::path& p, const void* data, size_t bytes) {
  std::ofstream f(p, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!f) throw std::runtime_error("cannot write " + p.string());
}

std::vector<double> read_doubles(const fs::path& p) {
  std::ifstream f(p, std::ios::binary | std::ios::ate);
  if (!f) return {};
  std::vector<double> v(static_cast<size_t>(f.tellg()) / sizeof(double));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()),
         static_cast<std::streamsize>(v.size() * sizeof(double)));
  return v;
}

// One case's outputs from outcore and the reference's result file.
struct CaseRun {
  OracleCase c;
  std::unique_ptr<Harness> h{};
  std::vector<float> logits{};
  float loss = 0, eval_loss = 0;
  std::vector<double> ref{};
  std::vector<double> ref_fp32{};  // bf16 compute: the reference without bf16 rounding
};

class OracleTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system(OUTCORE_PYTHON " -c 'import torch' >/dev/null 2>&1") != 0) {
      skip_reason_ = "no PyTorch for " OUTCORE_PYTHON;
      return;
    }
    dir_ = fs::temp_directory_path() / fmt::format("outcore_model_oracle_{}", ::getpid());
    fs::create_directories(dir_);
    std::string cmd = OUTCORE_PYTHON " " OUTCORE_SOURCE_DIR "/tests/model/oracle/llama_oracle.py";
    for (const OracleCase& c : cases()) {
      runs_.push_back(run_outcore(c));
      cmd += " " + (dir_ / c.name).string();
    }
    if (std::system(cmd.c_str()) != 0) {
      failure_ = "the reference script failed: " + cmd;
      return;
    }
    for (CaseRun& r : runs_) {
      r.ref = read_doubles(dir_ / r.c.name / "result.bin");
      if (r.c.compute != DType::F32) r.ref_fp32 = read_doubles(dir_ / r.c.name / "result_fp32.bin");
    }
  }
  static void TearDownTestSuite() {
    runs_.clear();
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  void SetUp() override {
    if (!skip_reason_.empty()) OUTCORE_ORACLE_UNAVAILABLE(skip_reason_);
    ASSERT_TRUE(failure_.empty()) << failure_;
  }

  static CaseRun run_outcore(const OracleCase& c) {
    CaseRun r{c};
    ModelOptions o{.micro_batch = c.batch,
                   .seq_len = c.seq,
                   .param_dtype = c.dtype,
                   .compute_dtype = c.compute};
    auto layout = make_layout(c.config);
    r.h = std::make_unique<Harness>(c.config, o, testing::random_params(layout, 1234));
    const size_t n = static_cast<size_t>(c.batch * c.seq);
    auto tokens = testing::random_ids(n + 1, c.config.vocab_size, 99);
    std::vector<int32_t> in(tokens.begin(), tokens.end() - 1), tg(tokens.begin() + 1, tokens.end());
    if (c.masked) {
      for (int64_t i = 0; i < c.batch * c.seq; ++i) {
        const int64_t s = i / c.seq, t = i % c.seq;
        if (s == 0 ? t < c.seq / 2 : t < c.seq - 2) tg[static_cast<size_t>(i)] = kIgnoreTarget;
      }
    }
    // Poison the gradients: Overwrite must replace every element.
    for (auto& g : r.h->grads) std::fill(g.begin(), g.end(), 123.0f);
    r.loss = r.h->train(in, tg, GradMode::Overwrite, c.loss_scale);
    r.logits.resize(n * c.config.vocab_size);
    r.eval_loss = r.h->eval(in, tg, r.logits.data());

    const fs::path d = dir_ / c.name;
    fs::create_directories(d);
    const std::string cfg = c.config.to_json();
    write_file(d / "config.json", cfg.data(), cfg.size());
    nlohmann::json cj = {{"batch", c.batch},
                         {"seq", c.seq},
                         {"loss_scale", c.loss_scale},
                         {"compute", dtype_name(c.compute)}};
    std::vector<float> flat;
    for (const UnitLayout& u : r.h->model.layout().units) {
      for (const TensorSpec& t : u.tensors) {
        cj["tensors"].push_back({{"name", t.name}, {"shape", t.shape}});
        const float* p = r.h->master[u.index].data() + t.offset;  // values the model used
        flat.insert(flat.end(), p, p + t.numel);
      }
    }
    const std::string cs = cj.dump();
    write_file(d / "case.json", cs.data(), cs.size());
    write_file(d / "params.bin", flat.data(), flat.size() * 4);
    write_file(d / "tokens.bin", in.data(), in.size() * 4);
    write_file(d / "targets.bin", tg.data(), tg.size() * 4);
    return r;
  }

  static inline fs::path dir_;
  static inline std::string skip_reason_, failure_;
  static inline std::vector<CaseRun> runs_;
};

using outcore::test::scaled_error;

// The llama3 case exercises every branch: frequencies kept, blended and divided.
TEST(OracleCases, Llama3CaseHasFrequenciesInAllThreeRegimes) {
  const double L = 256, d = 32, theta = 500000.0;
  int kept = 0, blended = 0, divided = 0;
  for (int j = 0; j < d / 2; ++j) {
    const double wavelength = 2 * std::numbers::pi * std::pow(theta, 2 * j / d);
    kept += wavelength < L / 4;
    divided += wavelength > L / 1;
    blended += wavelength >= L / 4 && wavelength <= L / 1;
  }
  EXPECT_EQ(kept, 3);
  EXPECT_EQ(blended, 2);
  EXPECT_EQ(divided, 11);
  EXPECT_EQ(kLlama3Scaling.original_max_position_embeddings, L);
}

TEST_F(OracleTest, LogitsLossAndEveryGradientMatch) {
  for (const CaseRun& r : runs_) {
    if (r.c.compute != DType::F32) continue;  // BF16ComputeMatchesTheReferenceRoundingAlike
    SCOPED_TRACE(r.c.name);
    const size_t nlog = r.logits.size();
    size_t expect = nlog + 1;
    for (const UnitLayout& u : r.h->model.layout().units)
      for (const TensorSpec& t : u.tensors) expect += t.numel;
    ASSERT_EQ(r.ref.size(), expect) << "result.bin has the wrong size";

    const double logit_err = scaled_error(r.logits.data(), r.ref.data(), nlog);
    EXPECT_LT(logit_err, 5e-6) << "logits";
    const double ref_loss = r.ref[nlog];
    EXPECT_NEAR(r.loss, ref_loss, 2e-6 * std::abs(ref_loss)) << "training loss";
    EXPECT_NEAR(r.eval_loss, ref_loss, 2e-6 * std::abs(ref_loss)) << "evaluation loss";

    size_t at = nlog + 1;
    double worst = 0;
    std::string worst_name;
    for (const UnitLayout& u : r.h->model.layout().units) {
      const std::vector<float>& g = r.h->grads[u.index];
      for (const TensorSpec& t : u.tensors) {
        const double e = scaled_error(g.data() + t.offset, r.ref.data() + at, t.numel);
        EXPECT_LT(e, 2e-5) << t.name;
        if (e > worst) worst = e, worst_name = t.name;
        at += t.numel;
      }
      // Overwrite replaced the poison in alignment gaps and padding with zeros.
      std::vector<bool> covered(u.padded_numel, false);
      for (const TensorSpec& t : u.tensors)
        std::fill(covered.begin() + t.offset, covered.begin() + t.offset + t.numel, true);
      for (size_t i = 0; i < u.padded_numel; ++i)
        if (!covered[i]) {
          ASSERT_EQ(g[i], 0.0f) << u.name << " element " << i;
        }
    }
    std::printf("[ oracle   ] %-18s logits %.2e  loss %.2e  worst gradient %.2e (%s)\n",
                r.c.name.c_str(), logit_err, std::abs(r.loss - ref_loss) / std::abs(ref_loss),
                worst, worst_name.c_str());
  }
}

// bf16 compute against the reference that rounds every product's operands to bf16 alike: the
// logits, the loss and every gradient close to it, and several times closer than to the same
// reference without the rounding (so the rounding points are the reference's, not fp32's).
// What remains is summation order (fp32 here, float64 there) moving a value across a bf16
// rounding boundary now and then.
TEST_F(OracleTest, BF16ComputeMatchesTheReferenceRoundingAlike) {
  int cases = 0;
  for (const CaseRun& r : runs_) {
    if (r.c.compute == DType::F32) continue;
    ++cases;
    SCOPED_TRACE(r.c.name);
    const size_t nlog = r.logits.size();
    ASSERT_EQ(r.ref.size(), r.ref_fp32.size()) << "result_fp32.bin has the wrong size";
    ASSERT_GT(r.ref.size(), nlog + 1);
    const double logit_err = scaled_error(r.logits.data(), r.ref.data(), nlog);
    const double logit_fp32 = scaled_error(r.ref_fp32.data(), r.ref.data(), nlog);
    EXPECT_LT(logit_err, 4e-3) << "logits";
    EXPECT_LT(logit_err, 0.25 * logit_fp32) << "logits: no closer to bf16 rounding than fp32 is";
    const double ref_loss = r.ref[nlog];
    EXPECT_NEAR(r.loss, ref_loss, 1e-3 * std::abs(ref_loss)) << "training loss";
    EXPECT_NEAR(r.eval_loss, ref_loss, 1e-3 * std::abs(ref_loss)) << "evaluation loss";

    size_t at = nlog + 1;
    double worst = 0, worst_fp32 = 0;
    std::string worst_name;
    for (const UnitLayout& u : r.h->model.layout().units) {
      const std::vector<float>& g = r.h->grads[u.index];
      for (const TensorSpec& t : u.tensors) {
        const double e = scaled_error(g.data() + t.offset, r.ref.data() + at, t.numel);
        const double e32 = scaled_error(r.ref_fp32.data() + at, r.ref.data() + at, t.numel);
        EXPECT_LT(e, 1.5e-2) << t.name;
        EXPECT_LT(e, 0.5 * e32) << t.name << ": no closer to bf16 rounding than fp32 is";
        if (e > worst) worst = e, worst_fp32 = e32, worst_name = t.name;
        at += t.numel;
      }
    }
    std::printf(
        "[ oracle   ] %-24s logits %.2e (fp32 %.2e)  loss %.2e  worst gradient %.2e (fp32 "
        "%.2e, %s)\n",
        r.c.name.c_str(), logit_err, logit_fp32, std::abs(r.loss - ref_loss) / std::abs(ref_loss),
        worst, worst_fp32, worst_name.c_str());
  }
  EXPECT_EQ(cases, 4);
}

}  // namespace
}  // namespace outcore::model
