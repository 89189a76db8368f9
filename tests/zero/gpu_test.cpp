// The model and the ZeRO engine on a GPU (label gpu: `ctest -L gpu`; each test skips, saying
// why, where no GPU can be used). Tolerances: the CUDA backend computes the same per-element
// arithmetic as the CPU backend but reduces in block trees and GEMMs in cuBLASLt's order, so a
// micro-batch's loss agrees within 1e-4 relative and each unit's gradient within 1e-3 of its
// norm; between placements on the GPU (same kernels, same order) results are bit-identical.
// In bf16 compute both backends round the same GEMM operands, but a summation-order difference
// that moves a value across a bf16 rounding boundary changes it by a bf16 ulp (2^-8 relative),
// and that propagates: 2e-3 relative on the loss, 2e-2 of each unit's gradient norm.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>

#include "tests/zero/eio_backend.hpp"
#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    const device::ProbeResult p = device::probe();
    if (!p.available) GTEST_SKIP() << "no usable GPU: " << p.summary();
  }
};

// One micro-batch's forward and backward through the CUDA backend against the CPU backend;
// the head in one launch for the micro-batch's 32 rows, and in two of 16.
TEST_F(Gpu, MicroBatchMatchesTheCpuBackend) {
  struct Case {
    DType dt, compute;
    int64_t head_rows;  // ModelOptions::head_chunk_rows (0: every row at once here)
  };
  const Case cases[] = {{DType::F32, DType::F32, 0},
                        {DType::BF16, DType::F32, 0},
                        {DType::BF16, DType::BF16, 0},
                        {DType::BF16, DType::BF16, 16},
                        {DType::F32, DType::F32, 16}};
  for (const auto& [dt, compute, head_rows] : cases) {
    SCOPED_TRACE(std::string(dtype_name(dt)) + " parameters, " + std::string(dtype_name(compute)) +
                 " compute, head rows " + std::to_string(head_rows));
    const double loss_tol = compute == DType::BF16 ? 2e-3 : 1e-4;
    const double grad_tol = compute == DType::BF16 ? 2e-2 : 1e-3;
    model::ModelOptions options = tiny_options(dt);
    options.compute_dtype = compute;
    options.head_chunk_rows = head_rows;
    auto gpu = device::make_cuda_device();
    device::CpuDevice cpu;
    const model::LlamaModel on_gpu(tiny_config(true), options, device::make_backend(*gpu));
    const model::LlamaModel on_cpu(tiny_config(true), options);
    const model::ModelLayout& layout = on_cpu.layout();
    std::vector<std::vector<std::byte>> host_params;
    std::vector<device::DeviceBuffer> gp, gg;
    model::ModelBuffers cb, gb;
    std::vector<std::vector<float>> cgrads;
    auto copy = gpu->create_stream("test");
    for (const model::UnitLayout& u : layout.units) {
      std::vector<float> master(u.padded_numel);
      model::init_params(layout, u.index, 5, 0, u.padded_numel, master.data());
      host_params.emplace_back(u.padded_numel * dtype_size(dt));
      model::convert_from_fp32(master.data(), host_params.back().data(), dt, u.padded_numel);
      gp.push_back(gpu->alloc(host_params.back().size(), "params"));
      copy->copy_h2d(gp.back().data(), host_params.back().data(), host_params.back().size());
      gg.push_back(gpu->alloc(u.padded_numel * sizeof(float), "grads"));
      cgrads.emplace_back(u.padded_numel);
      cb.params.push_back(host_params.back().data());
      cb.grads.push_back(cgrads.back().data());
      gb.params.push_back(gp.back().data());
      gb.grads.push_back(gg.back().as<float>());
    }
    copy->synchronize();
    model::ActivationBuffers ca(on_cpu, cpu, false), ga(on_gpu, *gpu, false);
    const size_t n = static_cast<size_t>(on_cpu.tokens());
    const std::vector<int32_t> tok = make_tokens(n + 1, on_cpu.config().vocab_size, 3, n + 1);
    const float lc = model::train_micro_batch(on_cpu, cb, ca, tok.data(), tok.data() + 1,
                                              model::GradMode::Overwrite);
    const float lg = model::train_micro_batch(on_gpu, gb, ga, tok.data(), tok.data() + 1,
                                              model::GradMode::Overwrite);
    EXPECT_NEAR(lg, lc, loss_tol * std::abs(lc));
    for (size_t u = 0; u < layout.units.size(); ++u) {
      std::vector<float> g(layout.units[u].padded_numel);
      copy->copy_d2h(g.data(), gg[u].data(), g.size() * sizeof(float));
      copy->synchronize();
      double diff = 0, norm = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        diff += (g[i] - cgrads[u][i]) * double(g[i] - cgrads[u][i]);
        norm += double(cgrads[u][i]) * cgrads[u][i];
      }
      EXPECT_LE(std::sqrt(diff), grad_tol * std::sqrt(norm) + 1e-12) << "unit " << u;
    }
  }
}

// Stage 3 with parameters and optimizer state in swap files, under a device budget below the
// model's state, trains bit-identically to stage 1 with the optimizer in host memory on the
// same GPU, and within tolerance of the simulated discrete device.
TEST_F(Gpu, Stage3NvmeIsBitIdenticalToStage1AndCloseToTheCpu) {
  const DType dt = DType::BF16;
  const std::string dir = swap_dir("gpu_stage3").string();
  const config::Config s3 =
      make_config(config_json({3, "nvme", "nvme"}, dt, dir, ", \"stage3_max_reuse_distance\": 0"));
  const config::Config s1 = make_config(config_json({1, "none", "cpu"}, dt, dir));
  // Below the tiny model's 16 B/param state (2.4 MiB), above the plan's peak (1.3 MiB: the
  // largest step's slabs and buffers).
  const uint64_t budget = 3u << 19;
  ASSERT_LT(budget, 16 * tiny_config(true).num_parameters());
  auto g3 = device::make_cuda_device({.memory_budget_bytes = budget});
  const model::LlamaModel m3(tiny_config(true), tiny_options(dt), device::make_backend(*g3));
  const RunResult r3 = train_on(*g3, s3, m3, 3);
  EXPECT_LE(r3.memory.device_peak_bytes, budget);
  auto g1 = device::make_cuda_device();
  const model::LlamaModel m1(tiny_config(true), tiny_options(dt), device::make_backend(*g1));
  const RunResult r1 = train_on(*g1, s1, m1, 3);
  expect_bit_identical(r1, r3, "stage 1 vs stage 3 on the GPU");

  device::CpuDevice sim({.memory_budget_bytes = budget, .discrete = true});
  const model::LlamaModel ms(tiny_config(true), tiny_options(dt), device::make_backend(sim));
  const RunResult rs = train_on(sim, s3, ms, 3);
  for (size_t i = 0; i < rs.losses.size(); ++i)
    EXPECT_NEAR(r3.losses[i], rs.losses[i], 1e-3 * std::abs(rs.losses[i])) << "step " << i + 1;
}

// A read of a parameter swap file that fails while the GPU trains (on the fetch stream, before
// the copy up) fails the pass with the file's name, as on the simulated device.
TEST_F(Gpu, EioWhilePrefetchingParametersFailsThePassNamingTheFile) {
  auto gpu = device::make_cuda_device();
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16),
                                device::make_backend(*gpu));
  const std::string dir = swap_dir("gpu_fault_param").string();
  const config::Config cfg = make_config(config_json({3, "nvme", "cpu"}, DType::BF16, dir));
  auto eio = std::make_shared<EioOnNth>(4, false);
  const char* where = "";
  const std::string msg = run_until_error_on(*gpu, cfg, model, {.io_backend = eio}, 3, &where);
  EXPECT_NE(msg, "") << "the injected read error was not reported";
  EXPECT_STREQ(where, "forward_backward");
  EXPECT_NE(msg.find(dir), std::string::npos) << msg;
  EXPECT_EQ(eio->fired(), 1u);
}

// Recomputing each layer's forward in backward gives the same gradients, bit for bit, as keeping
// its activations (model.hpp's promise), on the GPU too: the activations carved after the saved
// ones have the alignment they have apart from them, so each GEMM gets the same cuBLASLt
// algorithm. 13 tokens per sequence make arrays that are not multiples of 256 bytes (26 rows of
// 4-byte statistics: 104 bytes), which a 64-byte carving shifted.
TEST_F(Gpu, ActivationCheckpointingIsBitIdentical) {
  for (const DType compute : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(std::string(dtype_name(compute)) + " compute");
    const config::Config cfg = make_config(config_json({0}, DType::BF16, ""));
    RunResult runs[2];
    for (const bool checkpointing : {false, true}) {
      model::ModelOptions o = tiny_options(DType::BF16);
      o.seq_len = 13;
      o.compute_dtype = compute;
      o.activation_checkpointing = checkpointing;
      auto gpu = device::make_cuda_device();
      const model::LlamaModel m(tiny_config(false), o, device::make_backend(*gpu));
      runs[checkpointing] = train_on(*gpu, cfg, m, 3);
    }
    expect_bit_identical(runs[0], runs[1], "activation checkpointing off vs on");
  }
}

// The head's rows per launch, which decide how its weight gradient is summed, come from the
// GPU's memory size and the budget, not from its free memory: a run and its resume take the same
// rows whatever else the GPU holds.
TEST_F(Gpu, TheHeadsRowsDoNotChangeWithWhatTheGpuHolds) {
  model::LlamaConfig llama3 = tiny_config(false);
  llama3.vocab_size = 128256;
  const model::ModelOptions o{
      .micro_batch = 4, .seq_len = 4096, .param_dtype = DType::BF16, .compute_dtype = DType::BF16};
  auto gpu = device::make_cuda_device();
  const uint64_t total = gpu->total_memory_bytes();
  ASSERT_GE(total, gpu->free_memory_bytes());
  ASSERT_GT(total, 0u);
  const int64_t rows = model::head_rows_on(llama3, o, *gpu, 0);
  const int64_t budgeted = model::head_rows_on(llama3, o, *gpu, uint64_t{4} << 30);
  EXPECT_EQ(rows, model::head_rows_for_device(llama3, o, total));
  EXPECT_EQ(budgeted, model::head_rows_for_device(llama3, o, uint64_t{4} << 30));
  // Another tenant leaves 8 GiB free: below the 32 GiB at which 2 GiB of logits is a sixteenth,
  // so rows sized from free memory would be fewer.
  const uint64_t free = gpu->free_memory_bytes();
  ASSERT_GT(free, uint64_t{9} << 30) << "too little free GPU memory to hold most of it";
  const device::DeviceBuffer held = gpu->alloc(free - (uint64_t{8} << 30), "another tenant");
  ASSERT_LT(gpu->free_memory_bytes(), uint64_t{32} << 30);
  EXPECT_EQ(model::head_rows_on(llama3, o, *gpu, 0), rows);
  EXPECT_EQ(model::head_rows_on(llama3, o, *gpu, uint64_t{4} << 30), budgeted);
}

}  // namespace
}  // namespace outcore::zero::test
