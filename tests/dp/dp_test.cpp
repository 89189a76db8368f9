// Data parallelism across processes (mpirun, oversubscribed on a small machine):
// - W ranks with gas G train bit-identically to one rank with gas W*G over the same samples
//   (losses, grad norms, validation, master weights, parameters), for ZeRO stages 0-3 with
//   optimizer and parameters in memory, host memory and NVMe swap files, fp32, bf16, fp16;
// - each rank's Comm sends exactly the bytes the plan predicts (checked inside dp_worker);
// - a rank that fails or is killed ends the job: every rank exits non-zero within a bounded
//   time and the survivors leave no swap files.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <thread>

#include "tests/dp/dp_fixture.hpp"
#include "tools/outcore/stop_signals.hpp"

namespace outcore::train::testing {
namespace {

TEST_F(DataParallel, Stage1OptimizerNvmeWorld2MatchesWorld1) { expect_same("s1_nvme_fp32", 2, 2); }
TEST_F(DataParallel, Stage2CpuBf16World3MatchesWorld1) { expect_same("s2_cpu_bf16", 3, 1); }
TEST_F(DataParallel, Stage3NvmeWorld2MatchesWorld1) { expect_same("s3_nvme_fp32", 2, 1); }
TEST_F(DataParallel, Stage3NvmeBf16World3MatchesWorld1) { expect_same("s3_nvme_bf16", 3, 2); }
// outcore.step_in_backward on every rank: each steps its own partitions during the backward and
// the ranks reach the same verdict from the same norm.
TEST_F(DataParallel, Stage3StepInBackwardWorld2MatchesWorld1) {
  expect_same("s3_nvme_bf16_in_backward", 2, 2);
}
// Ranks on a device the host cannot read (a GPU's data path, simulated): the same bits, and
// every rank's traffic per step equal to the plan (checked inside dp_worker).
TEST_F(DataParallel, DiscreteDeviceStage1World2MatchesWorld1) {
  expect_same("s1_nvme_fp32", 2, 2, "--device discrete");
}
TEST_F(DataParallel, DiscreteDeviceStage2World3MatchesWorld1) {
  expect_same("s2_cpu_bf16", 3, 1, "--device discrete");
}
TEST_F(DataParallel, DiscreteDeviceStage3NvmeWorld2MatchesWorld1) {
  expect_same("s3_nvme_bf16", 2, 2, "--device discrete");
}
// All the optimizer state on a device the host cannot read (stage 0 and 1, offload none): Adam
// on the device from gradients reduced on the host (decision 036), on every rank.
TEST_F(DataParallel, DiscreteDeviceStage0And1OptimizerOnTheDeviceWorld2MatchesWorld1) {
  expect_same("s0_fp16", 2, 1, "--device discrete");
  expect_same("s1_none_bf16", 2, 2, "--device discrete");
}
// Loss masks: every rank divides by the step's trained targets of all ranks, so two ranks
// train as one; and the mask changes the run (it is read).
TEST_F(DataParallel, LossMaskWorld2MatchesWorld1) {
  expect_same("s1_nvme_fp32", 2, 2, "", mask_args());
  if (!have_mpirun_) return;
  EXPECT_NE(train("s1_nvme_fp32", 1, 4, 10, mask_args()), train("s1_nvme_fp32", 1, 4))
      << "the loss mask changed nothing";
}
TEST_F(DataParallel, Stage0Fp16WithOverflowWorld2MatchesWorld1) {
  expect_same("s0_fp16", 2, 1);
  // The run starts from a loss scale beyond fp32's range: its first step was skipped (grad
  // norm recorded as -1) and its last was not.
  const std::string r = read_all(dir_->file("s0_fp16_w2_g1.bin"));
  ASSERT_GE(r.size(), 20 * sizeof(double));
  double first_norm = 0, last_norm = 0;
  std::memcpy(&first_norm, r.data() + sizeof(double), sizeof(double));
  std::memcpy(&last_norm, r.data() + 19 * sizeof(double), sizeof(double));
  EXPECT_EQ(first_norm, -1.0);
  EXPECT_GT(last_norm, 0.0);
}

// A swap read that fails on one rank while its comm lane waits for it in a host gather (two
// ranks on the simulated discrete device, parameters in swap files; the last rank's third read,
// a fetch of the first forward): that rank fails naming the file, and the job ends instead of
// the other rank waiting in the gather for good.
TEST_F(DataParallel, FailedReadInAHostGatherEndsTheJobNamingTheFile) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  const std::string swap = dir_->file("swap_eio_gather");
  fs::create_directories(swap);
  const std::string cmd = fmt::format(
      "{} {} --case s3_nvme_bf16 --gas 2 --steps 3 --train {} --val {} --swap {} --out {} "
      "--device discrete --eio-read 3",
      mpirun(2), OUTCORE_DP_WORKER, files_->train, files_->val, swap, dir_->file("eio.bin"));
  std::string output;
  const int rc = run_command(cmd, output);
  EXPECT_NE(rc, 0) << output;
  const size_t error = output.find("dp_worker: rank 1 of 2: error:");
  ASSERT_NE(error, std::string::npos) << output;
  const std::string line = output.substr(error, output.find('\n', error) - error);
  EXPECT_NE(line.find(swap), std::string::npos) << line;
  EXPECT_EQ(output.find("dp_worker: 3 steps"), std::string::npos) << output;
}

// `outcore train` under mpirun, 2 ranks, stage 3 with parameters and optimizer state in swap
// files; `strike(rank 1's pid, swap dir)` is called once the run has taken a few steps.
// Returns mpirun's exit status and output.
template <typename Strike>
int run_cli_job(const fs::path& work, Strike&& strike, std::string& output,
                const std::string& extra = "", int ranks = 2) {
  const fs::path swap = work / "swap";
  fs::create_directories(swap);
  std::ofstream(work / "model.json") << R"({"hidden_size": 64, "intermediate_size": 176,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-5})";
  std::ofstream(work / "ds.json") << fmt::format(R"({{"train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1, "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
    "zero_optimization": {{"stage": 3,
      "offload_param": {{"device": "nvme", "nvme_path": "{0}", "max_in_cpu": 0}},
      "offload_optimizer": {{"device": "nvme", "nvme_path": "{0}"}}}}}})",
                                                 swap.string());
  const std::string metrics = (work / "metrics.jsonl").string();
  int rc = -1;
  std::thread job([&] {
    rc = run_command(
        fmt::format("timeout 120 mpirun --allow-run-as-root --oversubscribe --bind-to none -np {} "
                    "{} train --config {} --model {} --data {} --seq-len 32 --steps 1000000 "
                    "--metrics {} {}",
                    ranks, OUTCORE_CLI, (work / "ds.json").string(), (work / "model.json").string(),
                    DataParallelFiles::train(), metrics, extra),
        output);
  });
  // Rank 1: the outcore process whose environment says OMPI_COMM_WORLD_RANK=1 and whose
  // command line names this job's metrics file, once the run has taken a few steps.
  pid_t victim = 0, launcher = 0;
  for (int i = 0; i < 600 && victim == 0 && rc == -1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const std::string text = read_all(metrics);
    if (std::count(text.begin(), text.end(), '\n') < 4) continue;
    for (const auto& e : fs::directory_iterator("/proc")) {
      const std::string name = e.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      const std::string cmd = read_all((e.path() / "cmdline").string());
      const std::string env = read_all((e.path() / "environ").string());
      if (cmd.rfind("mpirun", 0) == 0 && cmd.find(metrics) != std::string::npos)
        launcher = std::stoi(name);
      if (cmd.find(metrics) != std::string::npos && cmd.find("mpirun") == std::string::npos &&
          env.find(fmt::format("OMPI_COMM_WORLD_RANK={}", ranks - 1) + '\0') != std::string::npos)
        victim = std::stoi(name);
    }
  }
  if (victim != 0) {
    try {
      strike(victim, launcher, swap);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "striking rank 1 failed: " << e.what();
    }
  }
  job.join();
  if (victim == 0) ADD_FAILURE() << "rank 1 never appeared or never trained:\n" << output;
  return rc;
}

// A rank whose swap files are cut short (as a failing drive would) fails with an I/O error
// naming itself, and ends the job: every rank exits non-zero (no hang: `timeout` would answer
// 124) and neither leaves a swap file.
TEST_F(DataParallel, FailingRankEndsEveryRankAndLeavesNoSwapFiles) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  const fs::path work = dir_->file("failing");
  std::string output;
  const int rc = run_cli_job(
      work,
      [](pid_t, pid_t, const fs::path& swap) {
        // The first cut can make rank 1 fail and remove its files while this loop runs: the
        // files are listed first and each cut ignores a file that is already gone.
        std::vector<fs::path> files;
        std::error_code ec;
        for (fs::recursive_directory_iterator it(swap / "outcore_swap" / "rank1", ec), end;
             !ec && it != end; it.increment(ec))
          if (it->path().extension() == ".bin") files.push_back(it->path());
        ASSERT_FALSE(files.empty()) << "rank 1 has no swap files to cut";
        for (const fs::path& f : files) fs::resize_file(f, 4096, ec);
      },
      output);
  EXPECT_NE(rc, 0) << output;
  EXPECT_NE(rc, 124) << "the job hung after a rank failed:\n" << output;
  EXPECT_NE(output.find("error: rank 1 of 2:"), std::string::npos) << output;
  EXPECT_EQ(count_bin_files(work / "swap"), 0) << "swap files left:\n" << output;
}

// A rank killed by SIGKILL mid-run: mpirun ends the job, the survivor exits non-zero and
// removes its swap files (the killed rank cannot).
TEST_F(DataParallel, KilledRankEndsTheJobAndTheSurvivorRemovesItsSwapFiles) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  const fs::path work = dir_->file("killed");
  std::string output;
  const int rc = run_cli_job(
      work, [](pid_t victim, pid_t, const fs::path&) { ::kill(victim, SIGKILL); }, output);
  EXPECT_NE(rc, 0) << output;
  EXPECT_NE(rc, 124) << "the job hung after rank 1 was killed:\n" << output;
  EXPECT_EQ(count_bin_files(work / "swap" / "outcore_swap" / "rank0"), 0)
      << "the surviving rank left swap files:\n"
      << output;
  EXPECT_GT(count_bin_files(work / "swap" / "outcore_swap" / "rank1"), 0)
      << "the killed rank cannot have removed its files: was it killed at all?";
}

// SIGUSR1 to mpirun (which forwards it to every rank): all ranks stop after the same step,
// save one checkpoint together, remove their swap files and exit 130.
TEST_F(DataParallel, Sigusr1ToMpirunStopsEveryRankCleanlyWithACheckpoint) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  const fs::path work = dir_->file("usr1");
  std::string output;
  const int rc = run_cli_job(
      work, [](pid_t, pid_t launcher, const fs::path&) { ::kill(launcher, SIGUSR1); }, output,
      fmt::format("--save-dir {}", (work / "ckpt").string()));
  EXPECT_EQ(rc, 130) << output;
  EXPECT_EQ(count_bin_files(work / "swap"), 0) << output;
  const std::string latest = read_all((work / "ckpt" / "latest").string());
  ASSERT_FALSE(latest.empty()) << output;
  const fs::path ck = work / "ckpt" / latest.substr(0, latest.find('\n'));
  EXPECT_TRUE(fs::exists(ck / "rank0" / "optimizer.bin")) << output;
  EXPECT_TRUE(fs::exists(ck / "rank1" / "optimizer.bin")) << output;
  EXPECT_NE(output.find("stopped after"), std::string::npos) << output;
}

// Ctrl-C on mpirun: mpirun sends SIGTERM to every rank and SIGKILL a second later; the ranks
// remove their swap files at once, so nothing is left whichever signal ends them.
TEST_F(DataParallel, SigintToMpirunLeavesNoSwapFiles) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  const fs::path work = dir_->file("sigint");
  std::string output;
  const int rc = run_cli_job(
      work, [](pid_t, pid_t launcher, const fs::path&) { ::kill(launcher, SIGINT); }, output);
  EXPECT_NE(rc, 0) << output;
  EXPECT_NE(rc, 124) << output;
  EXPECT_EQ(count_bin_files(work / "swap"), 0) << output;
}

// Whether process `pid` has ended: no such process, or one that ended and awaits its parent
// (orphaned, it is reaped by whatever the machine's first process is, perhaps never).
bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  const std::string stat = read_all("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || (paren + 2 < stat.size() && stat[paren + 2] == 'Z');
}

// mpirun running `ranks` ranks killed once they train: the last rank must neither outlive it
// by a minute nor leave a swap file.
void expect_killed_mpirun_leaves_nothing(const fs::path& work, int ranks) {
  std::string output;
  pid_t last = 0;
  run_cli_job(
      work,
      [&](pid_t victim, pid_t launcher, const fs::path&) {
        last = victim;
        ::kill(launcher, SIGKILL);
      },
      output, "", ranks);
  ASSERT_NE(last, 0) << output;
  bool gone = false;
  for (int i = 0; i < 600 && !gone; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    gone = process_gone(last) && count_bin_files(work / "swap") == 0;
  }
  if (!gone) ::kill(last, SIGKILL);
  EXPECT_TRUE(gone) << "a rank outlived mpirun by a minute, or left swap files:\n" << output;
}

// mpirun killed (SIGKILL, as a second Ctrl-C ends it): the ranks, its children, end at once
// (their parent-death signal), never train on unsupervised, and leave no swap file.
TEST_F(DataParallel, KilledMpirunLeavesNoRankRunningAndNoSwapFiles) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  expect_killed_mpirun_leaves_nothing(dir_->file("launcher_killed"), 2);
}

// The same with one rank: mpirun starting a single process protects it as it does several.
TEST_F(DataParallel, KilledMpirunOfOneRankLeavesItNotRunningAndNoSwapFiles) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  expect_killed_mpirun_leaves_nothing(dir_->file("launcher_killed_np1"), 1);
}

// The parent-death signal comes once for each of mpirun's threads as they end, a few in a row:
// the repeats change nothing, the rank still removes its swap files before it ends. (As SIGTERM
// the third ended the rank at once and left them, one run in six.)
TEST_F(DataParallel, TheLaunchersDeathSignalRepeatedStillRemovesTheRanksSwapFiles) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  const fs::path work = dir_->file("launcher_gone_repeated");
  std::string output;
  const int rc = run_cli_job(
      work,
      [](pid_t victim, pid_t, const fs::path&) {
        for (int i = 0; i < 4; ++i) ::kill(victim, cli::launcher_gone_signal());
      },
      output);
  EXPECT_NE(rc, 0) << output;
  EXPECT_NE(rc, 124) << "the job hung after rank 1 ended:\n" << output;
  EXPECT_EQ(count_bin_files(work / "swap" / "outcore_swap" / "rank1"), 0)
      << "rank 1 left swap files:\n"
      << output;
}

TEST_F(DataParallel, CheckpointOfTwoRanksResumesOnOne) {
  expect_resume_across_worlds("s2_cpu_bf16", 2, 1, 2, 6);
}
TEST_F(DataParallel, CheckpointOfOneRankResumesOnTwoWithNvmeState) {
  expect_resume_across_worlds("s3_nvme_fp32", 1, 2, 2, 4);
}
TEST_F(DataParallel, CheckpointOfThreeRanksResumesOnTwo) {
  expect_resume_across_worlds("s1_nvme_fp32", 3, 2, 6, 4);
}

// The model and DeepSpeed config of a small CLI job in `work` (ZeRO `stage`, state in memory),
// and the `outcore train` arguments that use them.
std::string cli_job_args(const fs::path& work, int stage, const std::string& lr = "1e-3") {
  fs::create_directories(work);
  std::ofstream(work / "model.json") << R"({"hidden_size": 64, "intermediate_size": 176,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-5})";
  const std::string ds = (work / ("ds_" + lr + ".json")).string();
  std::ofstream(ds) << fmt::format(R"({{"train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1, "optimizer": {{"type": "AdamW", "params": {{"lr": {}}}}},
    "zero_optimization": {{"stage": {}}}}})",
                                   lr, stage);
  return fmt::format("{} train --config {} --model {} --data {}", OUTCORE_CLI, ds,
                     (work / "model.json").string(), DataParallelFiles::train());
}

std::string mpmd(const std::string& rank0, const std::string& rank1) {
  return fmt::format(
      "timeout 120 mpirun --allow-run-as-root --oversubscribe --bind-to none -np 1 {} : -np 1 {}",
      rank0, rank1);
}

// Ranks started with different settings end together before training, naming what differs
// and each rank's value, instead of training inconsistently or hanging.
TEST_F(DataParallel, RanksStartedWithDifferentSettingsEndNamingTheSetting) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  const fs::path work = dir_->file("disagree");
  const std::string base = cli_job_args(work, 2);
  struct Case {
    std::string rank1, expect;
  };
  const Case cases[] = {
      {base + " --seq-len 32 --steps 2", "--seq-len (rank 0: \"16\", rank 1: \"32\")"},
      {cli_job_args(work, 2, "2e-3") + " --seq-len 16 --steps 2", "config.optimizer.params.lr"},
      {base + " --seq-len 16 --steps 3", "--steps"},
      {base + " --seq-len 16 --steps 2 --save-dir " + (work / "other").string(), "--save-dir"},
      {base + " --seq-len 16 --steps 2 --metrics " + (work / "m.jsonl").string(), "--metrics"},
  };
  for (const Case& c : cases) {
    std::string output;
    const int rc = run_command(mpmd(base + " --seq-len 16 --steps 2", c.rank1), output);
    EXPECT_NE(rc, 0) << c.rank1 << "\n" << output;
    EXPECT_NE(rc, 124) << "the job hung: " << c.rank1 << "\n" << output;
    EXPECT_NE(output.find("error: the ranks were started with different settings"),
              std::string::npos)
        << output;
    EXPECT_NE(output.find(c.expect), std::string::npos) << c.expect << "\n" << output;
    EXPECT_EQ(output.find("step 1"), std::string::npos) << "trained anyway:\n" << output;
  }
  EXPECT_FALSE(fs::exists(work / "other"));
  // One relative --save-dir from two working directories is two directories.
  fs::create_directories(work / "a");
  fs::create_directories(work / "b");
  const std::string job = base + " --seq-len 16 --steps 2 --save-dir ck";
  std::string output;
  const int rc = run_command(mpmd("-wdir " + (work / "a").string() + " " + job,
                                  "-wdir " + (work / "b").string() + " " + job),
                             output);
  EXPECT_NE(rc, 0) << output;
  EXPECT_NE(output.find("--save-dir (rank 0: "), std::string::npos) << output;
  EXPECT_EQ(output.find("step 1"), std::string::npos) << "trained anyway:\n" << output;
}

// A rank that refuses its own inputs before the ranks compare their settings (a config that does
// not parse, an output path it may not write) ends the job, naming them; the other rank waited
// in the comparison forever.
TEST_F(DataParallel, ARankRefusingItsInputsEndsTheJob) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  const fs::path work = dir_->file("refusing");
  const std::string base = cli_job_args(work, 2) + " --seq-len 16 --steps 2";
  std::ofstream(work / "bad.json") << "{bad json";
  const std::string bad_config = fmt::format(
      "{} train --config {} --model {} --data {} --seq-len 16 --steps 2", OUTCORE_CLI,
      (work / "bad.json").string(), (work / "model.json").string(), DataParallelFiles::train());
  struct Case {
    std::string rank1, expect;
  };
  const Case cases[] = {
      {bad_config, (work / "bad.json").string() + ": "},
      {base + " --trace " + (work / "model.json").string(), "--trace"},
  };
  for (const Case& c : cases) {
    std::string output;
    const int rc = run_command(mpmd(base, c.rank1), output);
    EXPECT_NE(rc, 0) << c.rank1 << "\n" << output;
    EXPECT_NE(rc, 124) << "the job hung: " << c.rank1 << "\n" << output;
    EXPECT_NE(output.find("error: " + c.expect), std::string::npos) << c.expect << "\n" << output;
    EXPECT_EQ(output.find("step 1"), std::string::npos) << "trained anyway:\n" << output;
  }
}

// On several nodes one path can name two files: a data file of the same path and size whose
// contents differ is named too (rank 1 sees another file there through a mount of its own).
TEST_F(DataParallel, RanksWhoseDataDiffersInContentsEndNamingTheFile) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  if (std::system("unshare -m true > /dev/null 2>&1") != 0)
    GTEST_SKIP() << "unshare -m needs root: no mount namespace for rank 1";
  const fs::path work = dir_->file("disagree_contents");
  const std::string base = cli_job_args(work, 2);
  const std::string data = DataParallelFiles::train();
  const fs::path other = work / "other_tokens.bin";
  fs::copy_file(data, other, fs::copy_options::overwrite_existing);
  {
    std::fstream f(other, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(100);
    const char byte = static_cast<char>(f.get() ^ 1);
    f.seekp(100);
    f.put(byte);
  }
  const std::string job = base + " --seq-len 16 --steps 2";
  std::string output;
  const int rc = run_command(
      mpmd(job, fmt::format("unshare -m sh -c 'mount --bind {} {} && exec \"$@\"' sh {}",
                            other.string(), data, job)),
      output);
  EXPECT_NE(rc, 0) << output;
  EXPECT_NE(output.find("--data (rank 0: "), std::string::npos) << output;
  EXPECT_NE(output.find("sampled CRC32C"), std::string::npos) << output;
  EXPECT_EQ(output.find("step 1"), std::string::npos) << "trained anyway:\n" << output;
}

// Stage 0 keeps the whole state on every rank: the checkpoint of 2 ranks holds it once and
// loads (it used to hold every slab twice and never load, while saying "saved").
TEST_F(DataParallel, Stage0CheckpointOfTwoRanksLoads) {
  if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
  const fs::path work = dir_->file("stage0_ckpt");
  const std::string args = cli_job_args(work, 0) + " --seq-len 16";
  const std::string ckpt = (work / "ckpt").string();
  std::string output;
  int rc = run_command(mpirun(2) + " " + args + " --steps 2 --save-dir " + ckpt, output);
  ASSERT_EQ(rc, 0) << output;
  EXPECT_NE(output.find("saved checkpoint"), std::string::npos) << output;
  EXPECT_FALSE(fs::exists(work / "ckpt" / "global_step2" / "rank1" / "optimizer.bin"));
  rc = run_command(mpirun(2) + " " + args + " --steps 3 --resume " + ckpt + " --save-dir " + ckpt,
                   output);
  EXPECT_EQ(rc, 0) << output;
  rc = run_command(
      fmt::format("timeout 120 {} export {} {}", OUTCORE_CLI, ckpt, (work / "hf").string()),
      output);
  EXPECT_EQ(rc, 0) << output;
}

}  // namespace
}  // namespace outcore::train::testing
