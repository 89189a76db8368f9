// `outcore train`, `outcore demo` and `outcore export`, run as a user runs them: exit codes,
// one clear message for bad input, a clean stop on SIGINT, the demo's metrics, and exported
// checkpoints that hold the trained weights and start new runs.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/lock_file.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/hf.hpp"
#include "engine/ckpt/safetensors.hpp"
#include "engine/data/tokenize_job.hpp"
#include "tests/trainer/trainer_test_util.hpp"

namespace outcore::train {
namespace {

using testing::DemoData;

std::string shell_quote(const std::string& s) { return "'" + s + "'"; }

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

int count_error_lines(const std::string& err) {
  int n = 0;
  for (const std::string& l : lines_of(err)) n += l.rfind("error:", 0) == 0;
  return n;
}

struct CliResult {
  int rc = -1;
  std::string out, err;
};

class TrainCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = data_.file("config.json");
    std::ofstream(model_) << testing::tiny_model_json().dump();
    config_ = write_config("ds.json", {});
  }

  // base_ds_json() with `patch` merged, written to `name`.
  std::string write_config(const std::string& name, const nlohmann::json& patch) {
    nlohmann::json j = testing::base_ds_json();
    if (!patch.is_null()) j.merge_patch(patch);
    std::string path = data_.file(name);
    std::ofstream(path) << j.dump(2);
    return path;
  }

  // Runs `outcore <args>` with OUTCORE_CONFIG unset (or set to `env_config`).
  CliResult run(const std::string& args, const std::string& env_config = "") {
    std::string cmd = env_config.empty() ? "env -u OUTCORE_CONFIG "
                                         : "env OUTCORE_CONFIG=" + shell_quote(env_config) + " ";
    const std::string out = data_.file("stdout"), err = data_.file("stderr");
    cmd +=
        shell_quote(OUTCORE_CLI) + " " + args + " >" + shell_quote(out) + " 2>" + shell_quote(err);
    int status = std::system(cmd.c_str());
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
  }

  std::string train_args(const std::string& extra) {
    return "train --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
           " --data " + shell_quote(data_.train()) + " --seq-len 32 " + extra;
  }

  // Runs a long NVMe training with a save directory, sends `sig` after step 2 and checks the
  // clean stop: exit 130, swap files removed, a checkpoint saved.
  void expect_clean_stop_on(int sig);

  // A training of the config in use (100000 steps, saving into `ckpt`, then `extra` flags), its
  // stdout into `out_path`; once its progress shows `at` (e.g. "step 2/"), `signal` is called
  // with its pid. Waits (at most 120 s) for it to end.
  struct SignalledRun {
    int status = 0;
    std::string err;
    bool sent = false;
  };
  // With `hook` ("NAME=VALUE"), outcore_with_test_hooks runs with it set; with `ignore`, the
  // process starts with that signal ignored (as nohup starts it with SIGHUP).
  SignalledRun signal_training(const std::string& at, const std::string& out_path,
                               const std::vector<const char*>& extra,
                               const std::function<void(pid_t)>& signal,
                               const std::string& hook = "", int ignore = 0);

  DemoData data_;
  std::string model_, config_;
};

TEST_F(TrainCliTest, TrainsAndPrintsTheSetupAndTheResult) {
  CliResult r = run(train_args("--steps 3 --val-data " + shell_quote(data_.val())));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("micro 4 x gas 1 x world 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("trained 3 steps (0 skipped)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("validation"), std::string::npos) << r.out;
  // Not a terminal: one progress line per step on stderr.
  EXPECT_NE(r.err.find("step 3/3 | loss"), std::string::npos) << r.err;
}

// The .mask beside --data (what `outcore tokenize` writes for prompt/completion data) is used
// unless --loss-mask says otherwise; the setup names it and the metrics count the trained
// targets; a mask of the wrong size exits 2 naming it.
TEST_F(TrainCliTest, ALossMaskBesideTheDataIsUsedAndNamed) {
  const std::string mask = train::mask_path_beside(data_.train());
  {
    const train::TokenFile f = train::TokenFile::open(data_.train());
    std::string bytes(f.size(), '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = i % 10 < 4 ? 1 : 0;
    std::ofstream(mask, std::ios::binary) << bytes;
  }
  const std::string metrics = data_.file("m.jsonl");
  CliResult r = run(train_args("--steps 2 --metrics " + shell_quote(metrics)));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("loss mask " + mask), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("| trained "), std::string::npos) << r.err;
  std::ifstream in(metrics);
  int steps = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j["type"] != "step") continue;
    ++steps;
    EXPECT_EQ(j["tokens"], 128);
    EXPECT_GT(j["tokens_trained"].get<int>(), 30);
    EXPECT_LT(j["tokens_trained"].get<int>(), 70);
  }
  EXPECT_EQ(steps, 2);

  const std::string ck = data_.file("ck_unmasked");
  CliResult off = run(train_args("--steps 1 --loss-mask none --save-dir " + shell_quote(ck)));
  ASSERT_EQ(off.rc, 0) << off.err;
  EXPECT_EQ(off.out.find("loss mask"), std::string::npos) << off.out;
  // Resumed on the same data, the run goes on without the mask it was told not to use, and
  // says that the mask beside the data goes unused.
  CliResult resumed =
      run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) + " --steps 2");
  ASSERT_EQ(resumed.rc, 0) << resumed.err;
  EXPECT_EQ(resumed.out.find("loss mask"), std::string::npos) << resumed.out;
  EXPECT_NE(resumed.err.find("without a loss mask, and so does this run: " + mask + " is not used"),
            std::string::npos)
      << resumed.err;

  // One target in the whole file: most steps train on none. Their loss is not shown, and the
  // run's summary is over the steps that had a target (or says there were none), never the
  // 0 of a step without one.
  {
    const train::TokenFile f = train::TokenFile::open(data_.train());
    std::string bytes(f.size(), '\0');
    bytes[bytes.size() / 2] = 1;
    std::ofstream(data_.file("one.mask"), std::ios::binary) << bytes;
  }
  CliResult sparse =
      run(train_args("--steps 3 --loss-mask " + shell_quote(data_.file("one.mask"))));
  ASSERT_EQ(sparse.rc, 0) << sparse.err;
  EXPECT_NE(sparse.err.find("| loss    -   |"), std::string::npos) << sparse.err;
  EXPECT_EQ(sparse.out.find("loss 0.0000 -> "), std::string::npos) << sparse.out;
  EXPECT_TRUE(sparse.out.find("loss: none (the loss mask left no target") != std::string::npos ||
              sparse.out.find("(first and last steps with a target") != std::string::npos)
      << sparse.out;

  std::ofstream(data_.file("short.mask"), std::ios::binary) << "\x01\x01";
  CliResult bad = run(train_args("--steps 1 --loss-mask " + shell_quote(data_.file("short.mask"))));
  EXPECT_EQ(bad.rc, 2) << bad.err;
  EXPECT_NE(bad.err.find("short.mask: a loss mask of 2 bytes"), std::string::npos) << bad.err;
  EXPECT_EQ(count_error_lines(bad.err), 1) << bad.err;
}

// A token file `outcore tokenize` was killed while putting in place with its mask (its commit
// marker beside it) is refused: the two may not belong together.
TEST_F(TrainCliTest, ATokenFileATokenizeJobLeftHalfCommittedIsRefused) {
  const std::string marker = data::tokenize_commit_marker(data_.train());
  std::ofstream(marker) << "outcore tokenize commit\npid 1\n";
  CliResult r = run(train_args("--steps 1"));
  std::filesystem::remove(marker);
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(data_.train() +
                       ": `outcore tokenize` was stopped while putting it and its "
                       "loss mask in place (" +
                       marker + " is there)"),
            std::string::npos)
      << r.err;
}

// A work directory the demo cannot make or write: one line naming --work-dir, exit 2, before
// it says it writes anything.
TEST_F(TrainCliTest, DemoWorkDirThatCannotBeMadeIsBadInput) {
  const std::string file = data_.file("a_file");
  std::ofstream(file) << "a user's file\n";
  const CliResult r = run("demo --steps 1 --work-dir " + shell_quote(file + "/demo"));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_TRUE(r.err.starts_with("error: --work-dir ")) << r.err;
  EXPECT_EQ(r.err.find("writing the demo"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(file), "a user's file\n");
}

// --comm local in a process an MPI launcher of several started: it trains alone, and says so.
TEST_F(TrainCliTest, CommLocalUnderALauncherOfSeveralProcessesSaysItTrainsAlone) {
  ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  CliResult r = run(train_args("--steps 1 --comm local"));
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("--comm local: this process was started by an MPI launcher of 2 "
                       "processes and trains alone"),
            std::string::npos)
      << r.err;
  r = run(train_args("--steps 1 --comm local"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err.find("MPI launcher"), std::string::npos) << r.err;
}

TEST_F(TrainCliTest, DeviceIsChosenOrRefusedByName) {
  CliResult cpu = run(train_args("--steps 1 --device cpu"));
  ASSERT_EQ(cpu.rc, 0) << cpu.err;
  EXPECT_NE(cpu.out.find("device     cpu,"), std::string::npos) << cpu.out;
  CliResult bad = run(train_args("--steps 1 --device tpu"));
  EXPECT_EQ(bad.rc, 2);
  EXPECT_EQ(count_error_lines(bad.err), 1) << bad.err;
  EXPECT_NE(bad.err.find("error: --device: got \"tpu\""), std::string::npos) << bad.err;
  // The demo refuses it before writing anything into its work directory.
  const std::string demo_dir = data_.file("demo_tpu");
  bad = run("demo --work-dir " + shell_quote(demo_dir) + " --device tpu");
  EXPECT_EQ(bad.rc, 2);
  EXPECT_EQ(lines_of(bad.err).size(), 1u) << bad.err;
  EXPECT_NE(bad.err.find("error: --device: got \"tpu\""), std::string::npos) << bad.err;
  EXPECT_FALSE(std::filesystem::exists(demo_dir));
  if (!device::probe().available) {
    // No GPU (or no CUDA in this build): auto takes the simulated device, cuda is refused.
    CliResult aut = run(train_args("--steps 1"));
    ASSERT_EQ(aut.rc, 0) << aut.err;
    EXPECT_NE(aut.out.find("device     cpu,"), std::string::npos) << aut.out;
    CliResult cuda = run(train_args("--steps 1 --device cuda"));
    EXPECT_EQ(cuda.rc, 2);
    EXPECT_EQ(count_error_lines(cuda.err), 1) << cuda.err;
    EXPECT_NE(cuda.err.find("error: --device cuda: no GPU"), std::string::npos) << cuda.err;
    CliResult demo = run("demo --work-dir " + shell_quote(data_.file("demo")) + " --device cuda");
    EXPECT_EQ(demo.rc, 2);
    EXPECT_NE(demo.err.find("error: --device cuda: no GPU"), std::string::npos) << demo.err;
  }
}

TEST_F(TrainCliTest, ConfigMayComeFromTheEnvironmentAndAutoFromTheCommandLine) {
  const std::string cfg = write_config(
      "auto.json",
      {{"train_micro_batch_size_per_gpu", "auto"}, {"optimizer", {{"params", {{"lr", "auto"}}}}}});
  const std::string args = "train --model " + shell_quote(model_) + " --data " +
                           shell_quote(data_.train()) + " --seq-len 32 --steps 2";
  CliResult missing = run(args, cfg);  // lr and micro-batch still "auto"
  EXPECT_EQ(missing.rc, 2);
  EXPECT_NE(missing.err.find("optimizer.params.lr"), std::string::npos) << missing.err;
  CliResult ok = run(args + " --lr 1e-3 --micro-batch-size 2", cfg);
  ASSERT_EQ(ok.rc, 0) << ok.err;
  EXPECT_NE(ok.out.find("AdamW lr 0.001"), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("micro 2 x gas 1"), std::string::npos) << ok.out;
  // A config named by the environment is named so when it is missing (not "--config").
  const CliResult absent = run(args, data_.file("absent.json"));
  EXPECT_EQ(absent.rc, 2);
  EXPECT_NE(absent.err.find("error: OUTCORE_CONFIG " + data_.file("absent.json")),
            std::string::npos)
      << absent.err;
}

TEST_F(TrainCliTest, MissingFilesExitTwoNamingTheFile) {
  const std::string nowhere = data_.file("no_such.bin");
  CliResult r = run(train_args("--steps 1 --val-data " + shell_quote(nowhere)));
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--val-data " + nowhere), std::string::npos) << r.err;

  r = run("train --model " + shell_quote(model_) + " --data " + shell_quote(data_.train()));
  EXPECT_EQ(r.rc, 2);  // no config anywhere
  EXPECT_NE(r.err.find("OUTCORE_CONFIG"), std::string::npos) << r.err;

  r = run("train --config " + shell_quote(config_) + " --data " + shell_quote(data_.train()));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--model is required"), std::string::npos) << r.err;
  // The command line parser's own refusals read as every other error does.
  for (const std::string bad : {"train --no-such-flag", "train --activation-checkpointing=maybe",
                                "tokenize --max-document-mb 0"}) {
    r = run(bad);
    EXPECT_EQ(r.rc, 2) << bad;
    EXPECT_TRUE(r.err.starts_with("error: ")) << bad << ": " << r.err;
    EXPECT_EQ(count_error_lines(r.err), 1) << bad << ": " << r.err;
  }
}

TEST_F(TrainCliTest, ConfigErrorsExitTwoNamingTheKey) {
  config_ = write_config("bad.json", {{"zero_optimization", {{"stage", 7}}}});
  CliResult r = run(train_args("--steps 1"));
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("zero_optimization.stage"), std::string::npos) << r.err;

  r = run(train_args("--steps many"));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--steps"), std::string::npos) << r.err;
}

TEST_F(TrainCliTest, InconsistentHeadsExitTwoNamingTheKey) {
  nlohmann::json m = testing::tiny_model_json();
  m["num_attention_heads"] = 5;  // 64 is not divisible by 5
  std::ofstream(model_) << m.dump();
  CliResult r = run(train_args("--steps 1"));
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("num_attention_heads"), std::string::npos) << r.err;
}

TEST_F(TrainCliTest, BadDataExitsTwoNamingTheFile) {
  const std::string short_file = data_.file("short.bin");
  write_llmc_tokens(short_file, std::vector<uint16_t>(50, 65));
  CliResult r = run("train --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
                    " --data " + shell_quote(short_file) + " --seq-len 32 --steps 1");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(short_file), std::string::npos) << r.err;

  const std::string oov = data_.file("oov.bin");
  std::vector<uint16_t> tokens(4096, 65);
  tokens[1000] = 300;  // vocabulary is 256
  write_llmc_tokens(oov, tokens);
  r = run("train --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
          " --data " + shell_quote(oov) + " --seq-len 32 --steps 1");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(oov), std::string::npos) << r.err;
}

TrainCliTest::SignalledRun TrainCliTest::signal_training(const std::string& at,
                                                         const std::string& out_path,
                                                         const std::vector<const char*>& extra,
                                                         const std::function<void(pid_t)>& signal,
                                                         const std::string& hook, int ignore) {
  SignalledRun r;
  int err_pipe[2];
  if (pipe(err_pipe) != 0) return r;
  const std::string ck = data_.file("ckpt");
  std::vector<const char*> argv = {OUTCORE_CLI,  "train",        "--config", config_.c_str(),
                                   "--model",    model_.c_str(), "--data",   data_.train().c_str(),
                                   "--seq-len",  "32",           "--steps",  "100000",
                                   "--save-dir", ck.c_str()};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return r;
  if (pid == 0) {
    dup2(err_pipe[1], STDERR_FILENO);
    const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(out, STDOUT_FILENO);
    close(err_pipe[0]);
    if (ignore != 0) ::signal(ignore, SIG_IGN);
    if (hook.empty()) {
      execv(OUTCORE_CLI, const_cast<char* const*>(argv.data()));
    } else {
      putenv(const_cast<char*>(hook.c_str()));
      argv[0] = OUTCORE_CLI_WITH_TEST_HOOKS;
      execv(OUTCORE_CLI_WITH_TEST_HOOKS, const_cast<char* const*>(argv.data()));
    }
    _exit(127);
  }
  close(err_pipe[1]);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (;;) {
    pollfd p{err_pipe[0], POLLIN, 0};
    if (std::chrono::steady_clock::now() > deadline || poll(&p, 1, 1000) < 0) break;
    if (!(p.revents & (POLLIN | POLLHUP))) continue;
    char buf[4096];
    const ssize_t n = read(err_pipe[0], buf, sizeof buf);
    if (n <= 0) break;
    r.err.append(buf, static_cast<size_t>(n));
    if (!r.sent && r.err.find(at) != std::string::npos) {
      signal(pid);
      r.sent = true;
    }
  }
  close(err_pipe[0]);
  if (!r.sent) kill(pid, SIGKILL);
  waitpid(pid, &r.status, 0);
  return r;
}

// SIGINT while training: the step in progress finishes, the swap files are removed, the
// result is printed and the exit code is 130.
void TrainCliTest::expect_clean_stop_on(int sig) {
  const std::string swap = data_.file("swap");
  config_ = write_config("nvme.json", testing::nvme_patch(swap));
  const std::string out_path = data_.file("sigint_stdout");
  const SignalledRun run = signal_training("step 2/", out_path, {}, [&](pid_t pid) {
    EXPECT_GT(testing::count_files(swap), 0);  // training with swap files
    kill(pid, sig);
  });
  const int status = run.status;
  const std::string& err = run.err;
  const bool sent = run.sent;
  ASSERT_TRUE(sent) << err;
  ASSERT_TRUE(WIFEXITED(status)) << err;
  EXPECT_EQ(WEXITSTATUS(status), 130) << err;
  EXPECT_NE(err.find("stopped after step"), std::string::npos) << err;
  EXPECT_NE(slurp(out_path).find("stopped after"), std::string::npos) << slurp(out_path);
  EXPECT_EQ(testing::count_files(swap), 0);
  // A checkpoint of the last finished step was saved before exiting, as the notice said, and
  // what a second signal would have cost.
  EXPECT_NE(err.find("saving a checkpoint (press Ctrl-C again to abort at once: nothing more is "
                     "saved, the last checkpoint completed is kept)"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("saved checkpoint"), std::string::npos) << err;
  const std::string latest = slurp(data_.file("ckpt") + "/latest");
  EXPECT_EQ(latest.rfind("global_step", 0), 0u) << latest;
}

TEST_F(TrainCliTest, SigintStopsCleanlyAndRemovesSwapFiles) { expect_clean_stop_on(SIGINT); }

// A closed ssh session or terminal (SIGHUP) stops the run like SIGTERM, not at once.
TEST_F(TrainCliTest, SighupStopsCleanlyAndRemovesSwapFiles) { expect_clean_stop_on(SIGHUP); }

TEST_F(TrainCliTest, SigtermStopsCleanlyAndRemovesSwapFiles) { expect_clean_stop_on(SIGTERM); }

// True while `sig`, sent to process `pid`, is pending there (/proc/<pid>/status SigPnd, ShdPnd):
// its handler has not been called yet.
bool signal_pending(pid_t pid, int sig) {
  for (const std::string& l : lines_of(slurp("/proc/" + std::to_string(pid) + "/status")))
    if ((l.rfind("SigPnd:", 0) == 0 || l.rfind("ShdPnd:", 0) == 0) &&
        (std::stoull(l.substr(7), nullptr, 16) & (uint64_t{1} << (sig - 1))) != 0)
      return true;
  return false;
}

// A second signal ends the run at once, by that signal, but not before its swap files are
// removed (the checkpoints saved so far stay).
TEST_F(TrainCliTest, ASecondSignalEndsTheRunAtOnceLeavingNoSwapFiles) {
  const std::string swap = data_.file("swap"), ck = data_.file("ckpt");
  config_ = write_config("nvme.json", testing::nvme_patch(swap));
  const SignalledRun run = signal_training(
      "step 3/", "/dev/null", {"--save-every", "1"},
      [&](pid_t pid) {
        EXPECT_GT(testing::count_files(swap), 0);
        // The first asks for the stop; once its handler has run (two pending ones would merge)
        // and past the time in which a repeat is the same press, the second ends the run (which
        // the hook keeps stopping, its swap files in place, for 20 s).
        kill(pid, SIGTERM);
        for (int i = 0; i < 5000 && signal_pending(pid, SIGTERM); ++i) usleep(200);
        usleep(500'000);
        kill(pid, SIGTERM);
      },
      "OUTCORE_TEST_STOP_DELAY_MS=20000");
  const int status = run.status;
  const std::string& err = run.err;
  const bool sent = run.sent;
  ASSERT_TRUE(sent) << err;
  ASSERT_TRUE(WIFSIGNALED(status)) << err;
  EXPECT_EQ(WTERMSIG(status), SIGTERM) << err;
  EXPECT_EQ(testing::count_files(swap), 0) << err;
  EXPECT_TRUE(std::filesystem::exists(ck + "/latest"));
  EXPECT_FALSE(std::filesystem::exists(ck + "/.lock")) << "the save directory's lock stays";
}

// One Ctrl-C delivered twice at once (coreutils `timeout` forwards the terminal's SIGINT, which
// reaches the run too; a closed terminal's SIGHUP comes from the kernel and from the shell) is
// one stop: the step finishes, a checkpoint is saved, exit 130. (Counted as two, it ended the run
// with no checkpoint, and a third left the swap files.)
TEST_F(TrainCliTest, OneSignalDeliveredTwiceAtOnceIsOneCleanStop) {
  for (int sig : {SIGINT, SIGHUP}) {
    const std::string swap = data_.file("swap"), ck = data_.file("ckpt");
    std::filesystem::remove_all(ck);
    config_ = write_config("nvme.json", testing::nvme_patch(swap));
    const SignalledRun run = signal_training("step 3/", "/dev/null", {}, [&](pid_t pid) {
      for (int i = 0; i < 2; ++i) {  // the second right after the first's handler ran
        kill(pid, sig);
        for (int j = 0; j < 5000 && signal_pending(pid, sig); ++j) usleep(200);
      }
    });
    ASSERT_TRUE(run.sent) << run.err;
    ASSERT_TRUE(WIFEXITED(run.status)) << sig << ": " << run.err;
    EXPECT_EQ(WEXITSTATUS(run.status), 130) << run.err;
    EXPECT_EQ(testing::count_files(swap), 0) << run.err;
    EXPECT_TRUE(std::filesystem::exists(ck + "/latest")) << sig << ": no checkpoint: " << run.err;
  }
}

// A run started with SIGHUP ignored (`nohup outcore train ...`) goes on when the terminal closes;
// SIGTERM still stops it.
TEST_F(TrainCliTest, ASignalIgnoredAtStartStaysIgnored) {
  const SignalledRun run = signal_training(
      "step 3/", "/dev/null", {},
      [&](pid_t pid) {
        kill(pid, SIGHUP);
        const std::string status = slurp("/proc/" + std::to_string(pid) + "/status");
        for (const std::string& l : lines_of(status)) {
          if (l.rfind("SigIgn:", 0) == 0) {
            EXPECT_NE(std::stoull(l.substr(7), nullptr, 16) & (uint64_t{1} << (SIGHUP - 1)), 0u)
                << "SIGHUP no longer ignored: " << l;
          }
        }
        usleep(300'000);  // time to have stopped on it, were it caught
        kill(pid, SIGTERM);
      },
      "", SIGHUP);
  ASSERT_TRUE(run.sent) << run.err;
  ASSERT_TRUE(WIFEXITED(run.status)) << run.err;
  EXPECT_EQ(WEXITSTATUS(run.status), 130) << run.err;
  EXPECT_EQ(run.err.find("stopping after the current step"),
            run.err.rfind("stopping after the current step"))
      << "one stop notice, SIGTERM's: " << run.err;
}

// A trace that cannot be written (a file-size limit here, a full disk elsewhere) keeps the run's
// result: it is printed, the failure said, and the command exits 1.
TEST_F(TrainCliTest, ATraceThatCannotBeWrittenKeepsTheResultAndExitsOne) {
  const std::string trace = data_.file("trace.json");
  const std::string out = data_.file("stdout"), err = data_.file("stderr"), rc = data_.file("rc");
  // The limit in a subshell whose output goes through a pipe: only the trace meets it.
  const int status = std::system(
      ("(trap '' XFSZ; ulimit -f 4; env -u OUTCORE_CONFIG " + shell_quote(OUTCORE_CLI) + " " +
       train_args("--steps 2 --trace " + shell_quote(trace)) + " 2>" + shell_quote(err) +
       "; echo $? >" + shell_quote(rc) + ") | cat >" + shell_quote(out))
          .c_str());
  ASSERT_EQ(status, 0);
  const std::string o = slurp(out), e = slurp(err);
  EXPECT_EQ(slurp(rc), "1\n") << e;
  EXPECT_NE(o.find("trained 2 steps"), std::string::npos) << o;
  EXPECT_NE(e.find("the trace was not written"), std::string::npos) << e;
  EXPECT_FALSE(std::filesystem::exists(trace));
}

// An output that names an input (the same file, also through a hard link) is refused before
// anything is written; an output in a missing directory too.
TEST_F(TrainCliTest, OutputPathsNeverOverwriteInputs) {
  const std::string before = slurp(data_.train());
  CliResult r = run(train_args("--steps 1 --metrics " + shell_quote(data_.train())));
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("is the same file as --data"), std::string::npos) << r.err;
  const std::string link = data_.file("link.jsonl");
  ASSERT_EQ(::link(config_.c_str(), link.c_str()), 0);
  r = run(train_args("--steps 1 --metrics " + shell_quote(link)));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("is the same file as --config"), std::string::npos) << r.err;
  r = run(train_args("--steps 1 --metrics " + shell_quote(model_)));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("is the same file as --model"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(data_.train()), before);  // untouched
  r = run(train_args("--steps 1 --metrics " + shell_quote(data_.file("no/such/dir/m.jsonl"))));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("does not exist"), std::string::npos) << r.err;
  r = run(train_args("--steps 1 --metrics " + shell_quote(data_.train() + "/m.jsonl")));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find(data_.train() + " is not a directory"), std::string::npos) << r.err;
  r = run(train_args("--steps 1 --save-dir " + shell_quote(data_.train())));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("is not a directory"), std::string::npos) << r.err;
  // A link to a process's descriptor (as /dev/stdout is), here the file stdout writes to: it
  // would be replaced by the trace.
  const std::string out_link = data_.file("stdout-link");
  ASSERT_EQ(::symlink("/proc/self/fd/1", out_link.c_str()), 0);
  r = run(train_args("--steps 1 --trace " + shell_quote(out_link)));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("is the file this command's stdout writes to"), std::string::npos) << r.err;
}

// A save directory holding the user's files whose names end like outcore's leftovers keeps
// them byte for byte (they used to be deleted as leftovers of an interrupted save).
TEST_F(TrainCliTest, SaveDirectoryKeepsTheUsersFiles) {
  namespace fs = std::filesystem;
  const std::string ck = data_.file("ckpt");
  fs::create_directories(ck + "/results.old");
  std::ofstream(ck + "/notes.tmp") << "my notes";
  std::ofstream(ck + "/results.old/model.pt") << "my model";
  CliResult r = run(train_args("--steps 2 --save-every 1 --keep 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(slurp(ck + "/notes.tmp"), "my notes");
  EXPECT_EQ(slurp(ck + "/results.old/model.pt"), "my model");
  EXPECT_EQ(r.err.find("removing"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(ck + "/latest"), "global_step2\n");
  EXPECT_FALSE(fs::exists(ck + "/global_step1"));  // pruned: outcore's own
  // A name outcore writes, held by something else: refused at start, untouched.
  fs::create_directories(ck + "/global_step7");
  std::ofstream(ck + "/global_step7/readme.txt") << "mine";
  r = run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) + " --steps 3");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("global_step7 is not outcore's"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(ck + "/global_step7/readme.txt"), "mine");
  // A save directory under a file, or a link to nowhere: bad input at start, named.
  const std::string a_file = data_.file("a_file"), dangling = data_.file("dangling");
  std::ofstream(a_file) << "mine";
  fs::create_symlink(data_.file("nowhere"), dangling);
  for (const std::string& dir : {a_file + "/ckpt", dangling}) {
    r = run(train_args("--steps 1 --save-dir " + shell_quote(dir)));
    EXPECT_EQ(r.rc, 2) << dir << ": " << r.err;
    EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("save directory " + dir), std::string::npos) << r.err;
  }
  EXPECT_EQ(slurp(a_file), "mine");
  EXPECT_FALSE(fs::exists(data_.file("nowhere")));
}

// A fresh run into a directory with another run's checkpoints is refused (it used to overwrite
// global_step<N> and prune the rest); --resume continues that run, --start-over replaces it.
TEST_F(TrainCliTest, AnotherRunsCheckpointsAreRefusedUnlessResumedOrStartedOver) {
  namespace fs = std::filesystem;
  const std::string ck = data_.file("ckpt");
  CliResult r = run(train_args("--steps 2 --save-every 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string before = slurp(ck + "/global_step2/rank0/optimizer.bin");
  r = run(train_args("--steps 2 --keep 1 --seed 7 --save-dir " + shell_quote(ck)));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("holds another run's checkpoints (global_step1, global_step2; latest "
                       "global_step2)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(slurp(ck + "/global_step2/rank0/optimizer.bin"), before);
  EXPECT_TRUE(fs::exists(ck + "/global_step1"));
  r = run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) + " --steps 3");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(fs::exists(ck + "/global_step1"));
  EXPECT_EQ(slurp(ck + "/latest"), "global_step3\n");
  // Resuming from an earlier checkpoint into the same directory would replace the later ones.
  const std::string third = slurp(ck + "/global_step3/rank0/optimizer.bin");
  r = run("train --resume " + shell_quote(ck + "/global_step1") + " --save-dir " + shell_quote(ck) +
          " --steps 3 --save-every 1");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("holds checkpoints after global_step1, the one this run resumes from "
                       "(global_step2, global_step3)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(slurp(ck + "/global_step3/rank0/optimizer.bin"), third);
  // --start-over takes that branch instead, keeping the checkpoint it resumes from.
  r = run("train --resume " + shell_quote(ck + "/global_step1") + " --start-over --save-dir " +
          shell_quote(ck) + " --steps 2");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(fs::exists(ck + "/global_step1"));
  EXPECT_FALSE(fs::exists(ck + "/global_step3"));
  EXPECT_EQ(slurp(ck + "/latest"), "global_step2\n");
  // A checkpoint this run may save over holds a user's file: refused before training.
  {
    std::ofstream(ck + "/global_step1/notes.txt") << "the user's notes";
    r = run(train_args("--steps 1 --seed 7 --start-over --save-dir " + shell_quote(ck)));
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_NE(r.err.find("global_step1 holds notes.txt, which is not a checkpoint file"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(r.err.find("step 1/"), std::string::npos) << r.err;  // nothing trained
    EXPECT_EQ(slurp(ck + "/global_step1/notes.txt"), "the user's notes");
    fs::remove(ck + "/global_step1/notes.txt");
  }
  r = run(train_args("--steps 1 --seed 7 --start-over --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(slurp(ck + "/latest"), "global_step1\n");
  EXPECT_FALSE(fs::exists(ck + "/global_step2"));
  EXPECT_FALSE(fs::exists(ck + "/global_step3"));
  r = run("train --resume " + shell_quote(ck) + " --steps 2");
  EXPECT_EQ(r.rc, 0) << r.err;
}

// --metrics and --trace never lie where a save writes (a save would replace them); beside the
// checkpoints they are fine.
TEST_F(TrainCliTest, OutputsNeverLieWhereTheCheckpointsAreWritten) {
  const std::string ck = data_.file("ckpt"), fresh = data_.file("fresh");
  std::filesystem::create_directories(fresh);
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string into_fresh = train_args("--steps 1 --save-dir " + shell_quote(fresh));
  const std::string resumed =
      "train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) + " --steps 2";
  const std::string saves_in = ": --save-dir ";
  const std::string step1 = std::filesystem::canonical(ck + "/global_step1").string();
  const std::tuple<std::string, std::string, std::string> cases[] = {
      {into_fresh, fresh + "/latest", saves_in + fresh + " writes there"},
      {into_fresh, fresh + "/global_step1", saves_in + fresh + " writes there"},
      {into_fresh, fresh + "/.lock", saves_in + fresh + " writes there"},
      // In any checkpoint, with or without a save directory: a file the checkpoint does not
      // list would keep it from being pruned or saved over.
      {resumed, ck + "/global_step1/m.jsonl", ": inside checkpoint " + step1},
      {"train --resume " + shell_quote(ck) + " --steps 2", ck + "/global_step1/rank0/t.json",
       ": inside checkpoint " + step1}};
  for (const auto& [args, out, why] : cases) {
    for (const char* flag : {"--metrics", "--trace"}) {
      r = run(args + " " + flag + " " + shell_quote(out));
      EXPECT_EQ(r.rc, 2) << flag << " " << out << ": " << r.err;
      EXPECT_NE(r.err.find(std::string(flag) + " " + out + why), std::string::npos) << r.err;
    }
  }
  // Nor through a link to a file there that does not exist yet (written through, it would).
  const std::string save_name = "a name that a save directory writes";
  const std::pair<std::string, std::string> linked[] = {
      {ck + "/global_step1/trace.json", "inside checkpoint " + step1},
      {ck + "/global_step3", save_name},
      {ck + "/latest.tmp", save_name}};
  for (const auto& [target, why] : linked) {
    const std::string link =
        data_.file("link_to_" + std::filesystem::path(target).filename().string());
    std::filesystem::create_symlink(target, link);
    for (const char* flag : {"--metrics", "--trace"}) {
      r = run("train --resume " + shell_quote(ck) + " --steps 2 " + flag + " " + shell_quote(link));
      EXPECT_EQ(r.rc, 2) << flag << " " << link << ": " << r.err;
      EXPECT_NE(r.err.find(std::string(flag) + " " + link + " (through a link to " + target +
                           "): " + why),
                std::string::npos)
          << r.err;
      EXPECT_FALSE(std::filesystem::exists(target)) << target;
    }
  }
  // Nor are a save directory inside a checkpoint, or an export into one or at a checkpoint's
  // name in a save directory.
  r = run("train --resume " + shell_quote(ck + "/global_step1") + " --steps 2 --save-dir " +
          shell_quote(ck + "/global_step1"));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("inside checkpoint " + step1), std::string::npos) << r.err;
  for (const std::string& out :
       {ck + "/global_step1/hf", ck + "/global_step9", ck + "/global_step9/", ck + "/latest.old"}) {
    r = run("export " + shell_quote(ck) + " " + shell_quote(out));
    EXPECT_EQ(r.rc, 2) << out << ": " << r.err;
    EXPECT_NE(r.err.find(out.find("hf") != std::string::npos ? "inside checkpoint"
                                                             : "a name the save directory"),
              std::string::npos)
        << r.err;
    EXPECT_FALSE(std::filesystem::exists(out)) << out;
  }
  // Nor an export into a swap directory, where a run's swap files and its end would take it.
  const std::string swap_out = data_.file("sw") + "/outcore_swap/rank0/param/hf";
  r = run("export " + shell_quote(ck) + " " + shell_quote(swap_out));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("inside the swap directory " + data_.file("sw") + "/outcore_swap"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(swap_out));
  EXPECT_TRUE(std::filesystem::is_empty(fresh));
  EXPECT_EQ(slurp(ck + "/latest"), "global_step1\n");
  r = run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) +
          " --steps 2 --metrics " + shell_quote(ck + "/metrics.jsonl"));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(slurp(ck + "/latest"), "global_step2\n");
}

// --metrics and --trace never name a file of --init-from's or --resume's, nor each other.
TEST_F(TrainCliTest, OutputsNeverNameAFileOfTheInitOrResumeInputs) {
  const std::string ck = data_.file("ckpt"), hf = data_.file("hf");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run("export " + shell_quote(ck) + " " + shell_quote(hf));
  ASSERT_EQ(r.rc, 0) << r.err;
  // A checkpoint given to --init-from: the message says how to continue it (also a save
  // directory whose `latest` is missing).
  for (const std::string& from : {ck, ck + "/global_step1", ck + " (no latest)"}) {
    const bool no_latest = from.ends_with("(no latest)");
    if (no_latest) std::filesystem::rename(ck + "/latest", data_.file("latest.kept"));
    r = run("train --init-from " + shell_quote(no_latest ? ck : from) + " --config " +
            shell_quote(config_) + " --model " + shell_quote(model_) + " --data " +
            shell_quote(data_.train()) + " --seq-len 32 --steps 1");
    if (no_latest) std::filesystem::rename(data_.file("latest.kept"), ck + "/latest");
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_NE(r.err.find("it is an outcore checkpoint: continue its run with --resume"),
              std::string::npos)
        << from << ": " << r.err;
  }
  const std::string weights = hf + "/model.safetensors",
                    state = ck + "/global_step1/trainer_state.json";
  const std::string weights_before = slurp(weights), state_before = slurp(state);
  r = run("train --init-from " + shell_quote(hf) + " --config " + shell_quote(config_) +
          " --data " + shell_quote(data_.train()) + " --seq-len 32 --steps 1 --trace " +
          shell_quote(weights));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("is the same file as --init-from"), std::string::npos) << r.err;
  r = run("train --resume " + shell_quote(ck) + " --steps 2 --metrics " + shell_quote(state));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("is the same file as --resume"), std::string::npos) << r.err;
  r = run("train --resume " + shell_quote(ck) + " --steps 2 --trace " +
          shell_quote(ck + "/latest"));
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(slurp(weights), weights_before);
  EXPECT_EQ(slurp(state), state_before);
  const std::string both = data_.file("both.json");
  r = run(train_args("--steps 1 --metrics " + shell_quote(both) + " --trace " + shell_quote(both)));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--trace " + both + " is the same file as --metrics"), std::string::npos)
      << r.err;
}

// A FIFO where a file is read (latest, manifest.json, model.safetensors, the index, the
// model config): one error naming it, exit 2, never a wait for a writer that never comes.
TEST_F(TrainCliTest, FifosInPlaceOfInputFilesAreRefusedNotWaitedFor) {
  namespace fs = std::filesystem;
  const std::string ck = data_.file("ckpt"), hf = data_.file("hf");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run("export " + shell_quote(ck) + " " + shell_quote(hf));
  ASSERT_EQ(r.rc, 0) << r.err;
  auto fifo_in_place_of = [](const std::string& path) {
    fs::remove(path);
    ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0) << path;
  };
  auto expect_refused = [&](const std::string& args, const std::string& path) {
    const std::string out = data_.file("stdout"), err = data_.file("stderr");
    const int status = std::system(("env -u OUTCORE_CONFIG timeout 60 " + shell_quote(OUTCORE_CLI) +
                                    " " + args + " >" + shell_quote(out) + " 2>" + shell_quote(err))
                                       .c_str());
    const CliResult res{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
    EXPECT_EQ(res.rc, 2) << args << "\n" << res.err;  // 124: it waited on the FIFO
    EXPECT_EQ(count_error_lines(res.err), 1) << res.err;
    EXPECT_NE(res.err.find(path), std::string::npos) << res.err;
    EXPECT_NE(res.err.find("FIFO"), std::string::npos) << res.err;
  };
  const std::string init_args = "train --config " + shell_quote(config_) + " --data " +
                                shell_quote(data_.train()) +
                                " --seq-len 32 --steps 1 --init-from " + shell_quote(hf);
  fifo_in_place_of(hf + "/model.safetensors");
  expect_refused(init_args, hf + "/model.safetensors");
  fs::remove(hf + "/model.safetensors");
  fifo_in_place_of(hf + "/model.safetensors.index.json");
  expect_refused(init_args, hf + "/model.safetensors.index.json");
  fifo_in_place_of(hf + "/config.json");
  expect_refused(init_args, hf + "/config.json");
  fs::copy_file(ck + "/global_step1/manifest.json", ck + "/global_step1/manifest.json.bak");
  fifo_in_place_of(ck + "/global_step1/manifest.json");
  expect_refused("export " + shell_quote(ck) + " " + shell_quote(data_.file("out")),
                 ck + "/global_step1/manifest.json");
  fifo_in_place_of(ck + "/latest");
  expect_refused("train --resume " + shell_quote(ck) + " --steps 2", ck + "/latest");
  // A save directory given as --init-from is named as one, with the ways to go on.
  const CliResult saves =
      run(init_args.substr(0, init_args.find(" --init-from ")) + " --init-from " + shell_quote(ck));
  EXPECT_EQ(saves.rc, 2) << saves.err;
  EXPECT_NE(saves.err.find("a save directory of outcore checkpoints"), std::string::npos)
      << saves.err;
  // A checkpoint file that is gone is "missing", bad input (exit 2), as verify() says it.
  fs::remove(ck + "/latest");
  fs::remove(ck + "/global_step1/manifest.json");
  fs::rename(ck + "/global_step1/manifest.json.bak", ck + "/global_step1/manifest.json");
  fs::remove(ck + "/global_step1/config.json");
  const CliResult gone =
      run("export " + shell_quote(ck + "/global_step1") + " " + shell_quote(data_.file("out2")));
  EXPECT_EQ(gone.rc, 2) << gone.err;
  EXPECT_NE(gone.err.find(ck + "/global_step1/config.json: missing"), std::string::npos)
      << gone.err;
}

// --trace writes a Chrome trace of an NVMe run and the result line says how much I/O it hid;
// a trace path naming an input is refused before anything runs.
TEST_F(TrainCliTest, TraceWritesAChromeTraceAndRefusesInputs) {
  const std::string nvme = write_config("nvme.json", testing::nvme_patch(data_.file("swap")));
  const std::string trace = data_.file("trace.json");
  CliResult r =
      run("train --config " + shell_quote(nvme) + " --model " + shell_quote(model_) + " --data " +
          shell_quote(data_.train()) + " --seq-len 32 --steps 2 --trace " + shell_quote(trace));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("trace      " + trace), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("hidden under forward/backward"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(the whole run, the training state's initialisation included)"),
            std::string::npos)
      << r.out;
  // A run in memory has no I/O to hide (it was "100.0% hidden").
  const CliResult in_memory =
      run(train_args("--steps 1 --trace " + shell_quote(data_.file("in_memory.json"))));
  ASSERT_EQ(in_memory.rc, 0) << in_memory.err;
  EXPECT_NE(in_memory.out.find("spans): no I/O to hide"), std::string::npos) << in_memory.out;
  const nlohmann::json j = nlohmann::json::parse(slurp(trace));
  EXPECT_GT(j.at("traceEvents").size(), 10u);
  EXPECT_TRUE(j.at("otherData").contains("io_hidden_under_compute"));
  const std::string before = slurp(data_.train());
  r = run(train_args("--steps 1 --trace " + shell_quote(data_.train())));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--trace " + data_.train() + " is the same file as --data"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(slurp(data_.train()), before);
  // Nor a file that is not a trace (a user's, another run's data or metrics), nor another save
  // directory's names: refused before the training, and kept.
  const std::string notes = data_.file("notes.txt");
  std::ofstream(notes) << "my notes\n";
  r = run(train_args("--steps 1 --trace " + shell_quote(notes)));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("--trace " + notes + ": exists and is not a trace file"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("step 1/"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(notes), "my notes\n");
  const std::string other = data_.file("other_ckpt");
  ASSERT_EQ(run(train_args("--steps 1 --save-dir " + shell_quote(other))).rc, 0);
  r = run(train_args("--steps 1 --trace " + shell_quote(other + "/latest")));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("a name that a save directory writes"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(other + "/latest"), "global_step1\n");
  // An earlier trace is replaced.
  r = run(train_args("--steps 1 --trace " + shell_quote(trace)));
  EXPECT_EQ(r.rc, 0) << r.err;
  // Another run writing the same trace (its lock held here): refused before the training, the
  // file as it was.
  const std::string earlier = slurp(trace);
  {
    const OutputLock other_run(trace, "trace file");
    r = run(train_args("--steps 1 --trace " + shell_quote(trace)));
  }
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("lock trace file (another run writes it at its end"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("step 1/"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(trace), earlier);
}

// Paths that cannot be written as given are bad input (exit 2), said before the training: a
// save directory through a loop of links, a trace name that is legal but leaves no room for the
// temporary outcore writes it through (an export's name: in
// TrainCliTest.ExportOfABadCheckpointOrIntoAFullDirectoryExitsTwo).
TEST_F(TrainCliTest, PathsThatCannotBeWrittenAsGivenAreBadInputSaidBeforeTraining) {
  const std::string loop = data_.file("loop1");
  std::filesystem::create_symlink(data_.file("loop2"), loop);
  std::filesystem::create_symlink(loop, data_.file("loop2"));
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(loop + "/ck")));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("Too many levels of symbolic links"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("step 1/"), std::string::npos) << r.err;

  const std::string long_name = data_.file(std::string(250, 't'));
  r = run(train_args("--steps 1 --trace " + shell_quote(long_name)));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("--trace " + long_name + ": a name of 250 bytes"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("Give a name of at most 243 bytes"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("step 1/"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(long_name));
}

// Outputs inside the swap directory (<nvme_path>/outcore_swap), whose files the run removes as
// stale swap files, are refused before the training, directly or through a link; numbers that
// are not whole or beyond their range are said to be.
TEST_F(TrainCliTest, OutputsInsideTheSwapDirectoryAreRefused) {
  namespace fs = std::filesystem;
  const std::string swap = data_.file("swap");
  const std::string inside = swap + "/outcore_swap/rank0/param";
  fs::create_directories(inside);
  config_ = write_config("nvme.json", testing::nvme_patch(swap));
  for (const char* flag : {"--metrics", "--trace"}) {
    const CliResult r =
        run(train_args(std::string("--steps 1 ") + flag + " " + shell_quote(inside + "/0.bin")));
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_NE(r.err.find(std::string(flag) + " " + inside + "/0.bin: inside the swap directory " +
                         fs::weakly_canonical(swap).string() + "/outcore_swap"),
              std::string::npos)
        << r.err;
    EXPECT_FALSE(fs::exists(inside + "/0.bin"));
  }
  const std::string link = data_.file("m_link.jsonl");
  fs::create_symlink(inside + "/.lock", link);
  CliResult r = run(train_args("--steps 1 --metrics " + shell_quote(link)));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("(through a link to " + inside + "/.lock): inside the swap directory"),
            std::string::npos)
      << r.err;
  // Beside outcore_swap, in the nvme_path itself: the user's, and fine.
  r = run(train_args("--steps 1 --metrics " + shell_quote(swap + "/m.jsonl")));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_TRUE(fs::exists(swap + "/m.jsonl"));
  for (const auto& [value, says] :
       {std::pair<std::string, std::string>{"99999999999999999999", "allowed: a whole number from"},
        {"1e3", "allowed: a whole number (no fraction, no exponent)"},
        {"ten", "allowed: a number"}}) {
    r = run(train_args("--steps " + value));
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_NE(r.err.find("--steps: got \"" + value + "\"; " + says), std::string::npos) << r.err;
  }
}

// No output and no swap path of a run takes a name that a save directory writes, nor goes
// inside a checkpoint: another run's save directory (recognised by its checkpoints, or by its
// run's lock before the first one), this run's own --save-dir, or a directory below such a
// name. Refused before the training, with nothing created there; the save directory itself may
// hold the swap files.
TEST_F(TrainCliTest, OutputsAndSwapPathsStayOffTheNamesOfSaveDirectories) {
  namespace fs = std::filesystem;
  const std::string other = data_.file("other_saves");
  ASSERT_EQ(run(train_args("--steps 1 --save-dir " + shell_quote(other))).rc, 0);
  auto refused = [&](const std::string& args, const std::string& says) {
    const CliResult r = run(args);
    EXPECT_EQ(r.rc, 2) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(says), std::string::npos) << args << "\n" << r.err;
    EXPECT_EQ(r.err.find("step 1/"), std::string::npos) << args << "\n" << r.err;
  };
  const std::string save_name = "a name that a save directory writes";
  refused(train_args("--steps 1 --metrics " + shell_quote(other + "/global_step2")),
          "--metrics " + other + "/global_step2: " + save_name);
  refused(train_args("--steps 1 --save-dir " + shell_quote(other + "/latest.tmp")),
          "--save-dir " + other + "/latest.tmp: " + save_name);
  // A save directory whose run has not saved yet: known by its run's lock.
  const std::string fresh = data_.file("fresh_saves");
  fs::create_directories(fresh);
  std::ofstream(fresh + "/.lock") << "outcore save directory lock\n";
  refused(train_args("--steps 1 --trace " + shell_quote(fresh + "/latest")), save_name);
  EXPECT_FALSE(fs::exists(fresh + "/latest"));
  // Swap paths: at this run's own save names, below another's, inside a checkpoint.
  const std::string mine = data_.file("my_saves");
  config_ = write_config("nvme_at_save.json", testing::nvme_patch(mine + "/global_step1"));
  refused(train_args("--steps 1 --save-dir " + shell_quote(mine)),
          "zero_optimization.offload_param.nvme_path " + mine + "/global_step1: --save-dir " +
              mine + " writes there");
  EXPECT_FALSE(fs::exists(mine));
  config_ = write_config("nvme_below.json", testing::nvme_patch(fresh + "/global_step3/swap"));
  refused(train_args("--steps 1"), "nvme_path " + fresh + "/global_step3/swap: below " + fresh +
                                       "/global_step3 is " + save_name);
  EXPECT_FALSE(fs::exists(fresh + "/global_step3"));
  // "link/.." is the link target's parent, as the kernel reads it.
  fs::create_directories(other + "/inner");
  const std::string link = data_.file("into_other");
  fs::create_symlink(other + "/inner", link);
  config_ = write_config("nvme_via_link.json", testing::nvme_patch(link + "/../global_step9"));
  refused(train_args("--steps 1"), "global_step9 is " + save_name);
  EXPECT_FALSE(fs::exists(other + "/global_step9"));
  config_ = write_config("ds_again.json", {});
  refused(train_args("--steps 1 --trace " + shell_quote(link + "/../global_step1.tmp")), save_name);
  EXPECT_FALSE(fs::exists(other + "/global_step1.tmp"));
  config_ = write_config("nvme_in_ckpt.json", testing::nvme_patch(other + "/global_step1/swap"));
  refused(train_args("--steps 1"), "nvme_path " + other + "/global_step1/swap: inside checkpoint");
  EXPECT_FALSE(fs::exists(other + "/global_step1/swap"));
  // Nor is the save directory inside the swap directory.
  config_ = write_config("nvme_around_save.json", testing::nvme_patch(fresh));
  refused(
      train_args("--steps 1 --save-dir " + shell_quote(fresh + "/outcore_swap/rank0/optimizer")),
      "inside the swap directory " + fresh + "/outcore_swap of");
  // The save directory itself holds them (named with a trailing slash before it exists), or a
  // directory in it whose name only starts like a checkpoint's: trained and saved.
  for (const std::string& swap : {mine + "/", mine + "/global_step_swap"}) {
    config_ = write_config("nvme_in_save_dir.json", testing::nvme_patch(swap));
    const CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(mine)));
    EXPECT_EQ(r.rc, 0) << swap << "\n" << r.err;
    EXPECT_TRUE(fs::exists(mine + "/global_step1")) << r.err;
    fs::remove_all(mine);
  }
}

// Runs `script` in a private mount namespace after mounting a tmpfs of `size` on `dir`, so a
// test can fill a real filesystem; false when this machine cannot (no privilege).
bool can_mount_tmpfs() {
  return std::system("unshare -m sh -c 'mount -t tmpfs -o size=1m tmpfs /mnt' >/dev/null 2>&1") ==
         0;
}

CliResult run_with_tmpfs(const std::string& size, const std::string& dir, const std::string& script,
                         const std::string& out, const std::string& err) {
  const std::string inner = "mkdir -p " + shell_quote(dir) + " && mount -t tmpfs -o size=" + size +
                            " tmpfs " + shell_quote(dir) + " && " + script;
  std::string quoted;  // inner, single-quoted for sh -c
  for (char c : inner) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  const std::string cmd = "env -u OUTCORE_CONFIG unshare -m sh -c '" + quoted + "' >" +
                          shell_quote(out) + " 2>" + shell_quote(err);
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
}

// An empty directory that is a mount point is refused before anything is written: the finished
// export is renamed onto its directory, which a mount point refuses (after the whole model).
TEST_F(TrainCliTest, ExportRefusesAMountPointBeforeWritingAnything) {
  if (!can_mount_tmpfs()) GTEST_SKIP() << "cannot mount a tmpfs here (needs CAP_SYS_ADMIN)";
  const std::string ck = data_.file("ckpt"), mnt = data_.file("mounted");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run_with_tmpfs("8m", mnt,
                     shell_quote(OUTCORE_CLI) + " export " + shell_quote(ck) + " " +
                         shell_quote(mnt) + "; echo rc=$?; ls -a " + shell_quote(mnt),
                     data_.file("stdout"), data_.file("stderr"));
  EXPECT_NE(r.out.find("rc=2"), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.err.find(mnt + ": is a mount point"), std::string::npos) << r.err;
  const std::filesystem::path beside = std::filesystem::path(mnt).parent_path();
  for (const auto& e : std::filesystem::directory_iterator(beside))
    EXPECT_EQ(e.path().filename().string().find("mounted.tmp-"), std::string::npos) << e.path();
}

// A demo stopped while it writes, in a work directory of an earlier version (its marker's first
// line alone): every file already there is recorded before the first one is written, so the
// next demo takes them as its own. Here the disk fills while the dataset is written.
TEST_F(TrainCliTest, ADemoStoppedInAnEarlierVersionsDirectoryLeavesItsFilesRecorded) {
  if (!can_mount_tmpfs()) GTEST_SKIP() << "cannot mount a tmpfs here (needs CAP_SYS_ADMIN)";
  const std::string src = data_.file("demo_src"), mnt = data_.file("demo_fs");
  CliResult r = run("demo --steps 1 --work-dir " + shell_quote(src));
  ASSERT_EQ(r.rc, 0) << r.err;
  // 9 MiB of files in a 14 MiB filesystem: the dataset's 8 MiB rewrite does not fit.
  const std::string w = mnt + "/w";
  const std::string script =
      "mkdir " + shell_quote(w) + " && cp " + shell_quote(src + "/config.json") + " " +
      shell_quote(src + "/ds_config.json") + " " + shell_quote(src + "/demo_train.bin") + " " +
      shell_quote(src + "/demo_val.bin") + " " + shell_quote(w) +
      " && echo 'outcore demo work directory' > " + shell_quote(w + "/.outcore-demo") + " && " +
      shell_quote(OUTCORE_CLI) + " demo --steps 1 --work-dir " + shell_quote(w) +
      "; echo \"demo exit $?\"; cat " + shell_quote(w + "/.outcore-demo");
  r = run_with_tmpfs("14m", mnt, script, data_.file("out"), data_.file("err"));
  EXPECT_NE(r.out.find("demo exit 1"), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << r.err;
  for (const char* name : {"config.json", "ds_config.json"})
    EXPECT_NE(r.out.find(std::string("file ") + name + " "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("writing demo_train.bin"), std::string::npos) << r.out;
}

// On a filesystem the swap files fill, the summary still reports the space they were checked
// against, not the space left after they were allocated.
TEST_F(TrainCliTest, SummaryOnASmallFilesystemSaysTheRunFits) {
  if (!can_mount_tmpfs()) GTEST_SKIP() << "cannot mount a tmpfs here (needs CAP_SYS_ADMIN)";
  const std::string mnt = data_.file("small_fs");
  config_ = write_config("small.json", testing::nvme_patch(mnt));
  CliResult r = run_with_tmpfs("3m", mnt, shell_quote(OUTCORE_CLI) + " " + train_args("--steps 1"),
                               data_.file("out"), data_.file("err"));
  ASSERT_EQ(r.rc, 0) << r.err;  // 2 MiB of swap files in a 3 MiB filesystem
  EXPECT_NE(r.out.find("trained 1 steps"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("DOES NOT FIT"), std::string::npos) << r.out;
}

// A disk that fills between two saves: the second save fails before writing data, the run
// exits 1 saying which checkpoint is kept, and that checkpoint still verifies (export checks
// every CRC).
TEST_F(TrainCliTest, FullDiskDuringASaveKeepsThePreviousCheckpoint) {
  if (!can_mount_tmpfs()) GTEST_SKIP() << "cannot mount a tmpfs here (needs CAP_SYS_ADMIN)";
  const std::string mnt = data_.file("ckpt_fs"), ck = mnt + "/ckpt";
  const std::string exported = data_.file("exported");
  const std::string script = shell_quote(OUTCORE_CLI) + " " +
                             train_args("--steps 3 --save-every 1 --save-dir " + shell_quote(ck)) +
                             "; echo \"train exit $?\"; cat " + shell_quote(ck + "/latest") + "; " +
                             shell_quote(OUTCORE_CLI) + " export " + shell_quote(ck) + " " +
                             shell_quote(exported) + " && echo exported";
  CliResult r = run_with_tmpfs("3m", mnt, script, data_.file("out"), data_.file("err"));
  EXPECT_NE(r.out.find("train exit 1"), std::string::npos) << r.out << r.err;
  EXPECT_NE(r.err.find("checkpoint global_step2 not saved into"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the previous checkpoint global_step1 is intact"), std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find("global_step1\nexported"), std::string::npos) << r.out;
}

// estimate and train agree on what fits and on the exit code of what does not.
TEST_F(TrainCliTest, EstimateAndTrainAgreeOnWhatFits) {
  const std::string est = "estimate --config " + shell_quote(config_) + " --model " +
                          shell_quote(model_) + " --seq-len 32";
  CliResult r = run(est);
  EXPECT_EQ(r.rc, 0) << r.err;
  // A device budget that holds the state but not the activations without checkpointing.
  config_ = write_config("tight.json", {{"outcore", {{"device_memory_mb", 20}}},
                                        {"train_micro_batch_size_per_gpu", 16}});
  const std::string tight = "estimate --config " + shell_quote(config_) + " --model " +
                            shell_quote(model_) + " --seq-len 128";
  r = run(tight);
  EXPECT_EQ(r.rc, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("does not fit: device"), std::string::npos) << r.err;
  const std::string train_tight = "train --config " + shell_quote(config_) + " --model " +
                                  shell_quote(model_) + " --data " + shell_quote(data_.train()) +
                                  " --seq-len 128 --steps 1";
  CliResult t = run(train_tight);
  EXPECT_EQ(t.rc, 2) << t.err;
  EXPECT_NE(t.err.find("device"), std::string::npos) << t.err;
  r = run(tight + " --activation-checkpointing");
  t = run(train_tight + " --activation-checkpointing");
  EXPECT_EQ(r.rc, 0) << r.err;  // checkpointing makes it fit, for both
  EXPECT_EQ(t.rc, 0) << t.err;
}

// Without drive rates, estimate measures the drive where the swap files would go, with the
// config's aio section, and leaves nothing there; with outcore.step_in_backward it says CPU
// Adam runs during the last backward.
TEST_F(TrainCliTest, EstimateMeasuresTheDriveUnderTheSwapDirectory) {
  const std::string swap = data_.file("swap_here");
  std::filesystem::create_directories(swap);
  if (std::filesystem::space(swap).available < (uint64_t{3} << 29))
    GTEST_SKIP() << "under 1.5 GiB free in " << swap << " for estimate's 512 MiB drive file";
  nlohmann::json patch = testing::nvme_patch(swap);
  config_ = write_config("nvme_here.json", patch);
  const std::string est = "estimate --config " + shell_quote(config_) + " --model " +
                          shell_quote(model_) +
                          " --seq-len 32 --device cpu --gemm-tflops 1 --attention-tflops 1";
  CliResult r = run(est);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("(measured: 512.0 MiB written, then read, in " + swap), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("unknown"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("without the drive"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::is_empty(swap));
  EXPECT_NE(r.out.find("runs under the next step's first forward"), std::string::npos) << r.out;
  // A swap directory training has yet to create: measured in its nearest existing parent.
  config_ = write_config("nvme_later.json", testing::nvme_patch(swap + "/later/swap"));
  r = run("estimate --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
          " --seq-len 32 --device cpu --gemm-tflops 1 --attention-tflops 1");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("read, in " + swap + " with the aio section"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::is_empty(swap));
  patch["outcore"]["step_in_backward"] = true;
  config_ = write_config("nvme_in_backward.json", patch);
  r = run("estimate --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
          " --seq-len 32 --device cpu --gemm-tflops 1 --attention-tflops 1 "
          "--drive-read-gbps 1 --drive-write-gbps 1");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("at 1.00 GB/s (--drive-read-gbps, --drive-write-gbps)"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("it runs during the backward of the step's last micro-batch"),
            std::string::npos)
      << r.out;
  // One drive rate alone would be dropped: refused.
  r = run("estimate --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
          " --seq-len 32 --device cpu --drive-write-gbps 5");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("go together"), std::string::npos) << r.err;
}

// A swap directory that training could not create on this machine (here on a read-only
// filesystem, mounted for the test where it may mount one): said on stderr, not only in the
// drive's line.
TEST_F(TrainCliTest, EstimateSaysWhenTheSwapDirectoryIsNotWritableHere) {
  const std::string ro = data_.file("read_only");
  std::filesystem::create_directories(ro);
  if (std::system(
          ("mount -t tmpfs -o ro,size=64m tmpfs " + shell_quote(ro) + " 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "cannot mount a read-only tmpfs here";
  struct Unmount {
    std::string dir;
    ~Unmount() { (void)std::system(("umount " + shell_quote(dir)).c_str()); }
  } unmount{ro};
  config_ = write_config("nvme_unwritable.json", testing::nvme_patch(ro + "/swap"));
  const CliResult r =
      run("estimate --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
          " --seq-len 32 --device cpu --gemm-tflops 1 --attention-tflops 1");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find(ro + "/swap is not a writable directory here: `outcore train` with this "
                            "config would fail on this machine"),
            std::string::npos)
      << r.err;
}

// Stage 3 with a live cap and reuse distance that let every slab go after its use: estimate
// says what keeping the gathered parameters through the step's micro-batches gives; a config
// that keeps them already gets no such line.
TEST_F(TrainCliTest, EstimateSaysWhatKeepingTheGatheredParametersGives) {
  nlohmann::json patch = testing::nvme_patch(data_.file("swap"));
  patch["gradient_accumulation_steps"] = 4;
  patch["zero_optimization"]["stage3_param_persistence_threshold"] = 0;  // no unit stays anyway
  patch["zero_optimization"]["stage3_max_live_parameters"] = 0;
  patch["zero_optimization"]["stage3_max_reuse_distance"] = 0;
  config_ = write_config("streamed.json", patch);
  const std::string est = "estimate --config " + shell_quote(config_) + " --model " +
                          shell_quote(model_) +
                          " --seq-len 32 --device cpu --gemm-tflops 1000 --attention-tflops 1000 "
                          "--drive-read-gbps 0.1 --drive-write-gbps 0.1";
  CliResult r = run(est);
  ASSERT_EQ(r.rc, 0) << r.err;
  const size_t at = r.out.find("with stage3_max_live_parameters ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
  double drive_kept = 0, drive_now = 0;
  const size_t d = line.find("drive ");
  ASSERT_NE(d, std::string::npos) << line;
  ASSERT_EQ(std::sscanf(line.c_str() + d, "drive %lf s instead of %lf s", &drive_kept, &drive_now),
            2)
      << line;
  EXPECT_LT(drive_kept, drive_now) << line;
  patch["zero_optimization"]["stage3_max_live_parameters"] = 1e12;
  patch["zero_optimization"]["stage3_max_reuse_distance"] = 1e12;
  config_ = write_config("kept.json", patch);
  r = run("estimate --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
          " --seq-len 32 --device cpu --gemm-tflops 1000 --attention-tflops 1000 "
          "--drive-read-gbps 0.1 --drive-write-gbps 0.1");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out.find("with stage3_max_live_parameters"), std::string::npos) << r.out;
}

// The compute time of estimate's bound line ("  compute  <s> s ..."); -1 when absent.
double estimated_compute_s(const std::string& out) {
  const size_t at = out.find("  compute  ");
  double s = -1;
  if (at == std::string::npos || std::sscanf(out.c_str() + at, "  compute %lf s", &s) != 1)
    return -1;
  return s;
}

// estimate's step bounds: with the rates given, the drive bounds a step of an NVMe config and
// the shape printed to hide it has more tokens per step and compute that covers the drive; a
// slow GEMM rate makes compute the bound; without drive rates the drive is named unknown.
TEST_F(TrainCliTest, EstimatePrintsTheStepBoundsAndTheShapeThatHidesTheTransfers) {
  config_ = write_config("nvme.json", testing::nvme_patch(data_.file("swap")));
  const std::string est = "estimate --config " + shell_quote(config_) + " --model " +
                          shell_quote(model_) + " --seq-len 32 --device cpu";
  CliResult r = run(est +
                    " --gemm-tflops 1000 --attention-tflops 1000 --drive-read-gbps 0.1 "
                    "--drive-write-gbps 0.1");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("bound "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("drive\n"), std::string::npos) << r.out;  // the bound line ends "drive"
  EXPECT_NE(r.out.find("(--gemm-tflops)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(--attention-tflops)"), std::string::npos) << r.out;
  // At 1000 TFLOP/s nothing this small hides a 0.1 GB/s drive: the closest shape is printed.
  EXPECT_NE(r.out.find("no shape up to micro-batch 64 x accumulation 128 hides them"),
            std::string::npos)
      << r.out;
  // The parameters are in swap files (max_in_cpu 0) and would fit in host memory: the drive's
  // time without their reads is printed.
  EXPECT_NE(r.out.find("with offload_param.max_in_cpu "), std::string::npos) << r.out;
  r = run(est +
          " --gemm-tflops 0.00001 --attention-tflops 0.00001 --drive-read-gbps 1 "
          "--drive-write-gbps 1");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("compute\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("with offload_param.max_in_cpu"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the transfers fit under compute"), std::string::npos) << r.out;
  // A rate where a larger micro-batch hides the drive.
  r = run(est +
          " --gemm-tflops 0.05 --attention-tflops 0.05 --drive-read-gbps 0.5 "
          "--drive-write-gbps 0.5");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("to hide the transfers under compute: train_micro_batch_size_per_gpu"),
            std::string::npos)
      << r.out;
  // CPU Adam over the optimizer's elements, at the rate measured here with the config's threads
  // unless given; a slow one bounds the step.
  EXPECT_NE(r.out.find("G elements/s (measured: fp32 moments, "), std::string::npos) << r.out;
  r = run(est +
          " --gemm-tflops 1 --attention-tflops 1 --drive-read-gbps 1 --drive-write-gbps 1 "
          "--cpu-adam-gelems 0.000001");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("at 1e-06 G elements/s (--cpu-adam-gelems)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("CPU Adam\n"), std::string::npos) << r.out;  // the bound line
  // A swap path running through a file has no drive to measure: refused, as train refuses it
  // (AnNvmePathThatIsNoDirectoryIsRefusedNamingTheKey).
  const std::string file = data_.file("a_file");
  std::ofstream(file) << "not a directory";
  config_ = write_config("nvme_nowhere.json", testing::nvme_patch(file + "/swap"));
  r = run("estimate --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
          " --seq-len 32 --device cpu --gemm-tflops 1 --attention-tflops 1");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.err.find(file + "/swap: is not a directory"), std::string::npos) << r.err;
  config_ = write_config("nvme.json", testing::nvme_patch(data_.file("swap")));
  // The attention at its own rate: a slower one adds its FLOPs' time at that rate.
  r = run(est + " --gemm-tflops 0.001 --attention-tflops 0.001");
  ASSERT_EQ(r.rc, 0) << r.err;
  const double same_rate = estimated_compute_s(r.out);
  ASSERT_GT(same_rate, 0) << r.out;
  r = run(est + " --gemm-tflops 0.001 --attention-tflops 0.000001");
  ASSERT_EQ(r.rc, 0) << r.err;
  const double slow_attention = estimated_compute_s(r.out);
  double attention_tflop = 0;
  const size_t line = r.out.find("    attention ");
  ASSERT_NE(line, std::string::npos) << r.out;
  ASSERT_EQ(std::sscanf(r.out.c_str() + line, "    attention %lf TFLOP", &attention_tflop), 1);
  EXPECT_NEAR(slow_attention - same_rate, attention_tflop / 1e-6 - attention_tflop / 1e-3,
              0.01 * slow_attention)
      << r.out;
  // Not given, the model's attention is measured on the device planned for (here the host).
  r = run(est + " --gemm-tflops 1");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("(measured: fp32 attention forward + backward, 32 tokens, 4 heads of 16 "
                       "over 2 kv heads, on the host)"),
            std::string::npos)
      << r.out;
  r = run(est + " --gemm-tflops -3");
  EXPECT_EQ(r.rc, 2) << r.out;
  r = run(est + " --gemm-tflops 1 --attention-tflops 0");
  EXPECT_EQ(r.rc, 2) << r.out;
  for (const char* bad : {"--gemm-tflops nan", "--attention-tflops nan", "--pcie-gbps inf",
                          "--drive-read-gbps -nan", "--cpu-adam-gelems 0"}) {
    r = run(est + " --gemm-tflops 1 " + bad);
    EXPECT_EQ(r.rc, 2) << bad << ": " << r.out;
    const std::string flag = std::string(bad).substr(0, std::string(bad).find(' '));
    EXPECT_NE(r.err.find(flag), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("step bounds"), std::string::npos) << bad;
  }
}

// estimate --gpu-memory-gb plans for a GPU this machine does not have (one to rent): the plan
// with the CUDA backend's workspaces, refused when the GPU is too small, and the step bounds
// from the rates given (none without them); it cannot go with --device cpu.
TEST_F(TrainCliTest, EstimatePlansForAGpuThatIsNotHere) {
  config_ = write_config("nvme.json", testing::nvme_patch(data_.file("swap")));
  const std::string est = "estimate --config " + shell_quote(config_) + " --model " +
                          shell_quote(model_) + " --seq-len 32";
  CliResult r = run(est + " --gpu-memory-gb 80");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("a GPU (--gpu-memory-gb 80): 80.00 GiB free"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("compute backend"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("limit 80.00 GiB (--gpu-memory-gb): fits"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("give --gemm-tflops and --pcie-gbps"), std::string::npos) << r.out;
  r = run(est +
          " --gpu-memory-gb 80 --gemm-tflops 900 --pcie-gbps 50 --drive-read-gbps 6 "
          "--drive-write-gbps 4");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("PCIe"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(--gemm-tflops)"), std::string::npos) << r.out;
  // That GPU's attention cannot be measured here: at the GEMM rate unless given, and said.
  EXPECT_NE(r.out.find("at the GEMM rate: give --attention-tflops"), std::string::npos) << r.out;
  r = run(est +
          " --gpu-memory-gb 80 --gemm-tflops 900 --attention-tflops 35 --pcie-gbps 50 "
          "--drive-read-gbps 6 --drive-write-gbps 4");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("at 35 TFLOP/s (--attention-tflops)"), std::string::npos) << r.out;
  // CPU Adam bounds the step: the optimizer state the GPU could step instead is priced.
  r = run(est +
          " --gpu-memory-gb 80 --gemm-tflops 900 --pcie-gbps 50 --drive-read-gbps 6 "
          "--drive-write-gbps 4 --cpu-adam-gelems 0.0001");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("CPU Adam\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("with offload_optimizer.device none (all the optimizer state on the GPU, "
                       "stepped there, which fits): CPU Adam 0.000 s instead of "),
            std::string::npos)
      << r.out;
  r = run(est + " --gpu-memory-gb 0.001");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.err.find("does not fit: device"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("but --gpu-memory-gb allows"), std::string::npos) << r.err;
  r = run(est + " --gpu-memory-gb 80 --device cpu");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.err.find("--gpu-memory-gb"), std::string::npos) << r.err;
  // That machine's RAM and swap space instead of this one's: checked against, and named.
  r = run(est + " --gpu-memory-gb 80 --host-memory-gb 0.001");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.err.find("but --host-memory-gb allows 1.0 MiB"), std::string::npos) << r.err;
  r = run(est + " --gpu-memory-gb 80 --nvme-free-gb 0.001");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.err.find("but --nvme-free-gb gives 1.0 MiB"), std::string::npos) << r.err;
  r = run(est +
          " --gpu-memory-gb 80 --host-memory-gb 3 --nvme-free-gb 5 --gemm-tflops 900 "
          "--pcie-gbps 50 --drive-read-gbps 6 --drive-write-gbps 4");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("limit 3.00 GiB (--host-memory-gb)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("limit 5.00 GiB (--nvme-free-gb): fits"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("PCIe"), std::string::npos) << r.out;
  // Sizes whose bytes round to 0 or overflow 64 bits are refused, not taken as "no limit", and
  // rates that would make a step's time 0, infinite or 300 digits long.
  for (const std::string bad :
       {"--gpu-memory-gb -1", "--gpu-memory-gb 1e-300", "--gpu-memory-gb 2e10",
        "--host-memory-gb 0", "--host-memory-gb nan", "--nvme-free-gb 1e300",
        "--gpu-memory-gb 1e308", "--gemm-tflops 1e-300", "--gemm-tflops 1e300",
        "--attention-tflops nan", "--pcie-gbps 1e-320", "--drive-read-gbps 1e-300",
        "--drive-write-gbps inf", "--host-memory-gb 0x10", "--drive-read-gbps 0x1p1"}) {
    r = run(est + " --gpu-memory-gb 80 " + bad);
    EXPECT_EQ(r.rc, 2) << bad << ": " << r.out;
    EXPECT_NE(r.err.find(bad.substr(0, bad.find(' '))), std::string::npos) << bad << ": " << r.err;
  }
}

// The README's fine-tuning path for a model larger than the GPU: Llama 3.1 8B at 4096 tokens,
// and at 32768, with configs/zero3_nvme_infinity.json as shipped fits an 80 GB GPU's device tier
// (here planned without one; host memory and the swap drive are this machine's and may not
// fit).
TEST_F(TrainCliTest, TheReadmesLlama8BPathFitsAn80GbGpu) {
  const std::string llama = data_.file("llama-3.1-8b.json");
  std::ofstream(llama) << nlohmann::json{
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_size", 4096},
      {"intermediate_size", 14336},
      {"num_hidden_layers", 32},
      {"num_attention_heads", 32},
      {"num_key_value_heads", 8},
      {"vocab_size", 128256},
      {"max_position_embeddings", 131072},
      {"rms_norm_eps", 1e-5},
      {"rope_theta", 500000.0},
      {"tie_word_embeddings",
       false}}.dump();
  // At the README's 4096 tokens, and at 32768 (the longest sequence one 80 GB GPU is to train,
  // with the config's activation checkpoints in host memory).
  for (const char* seq : {"4096", "32768"}) {
    const CliResult r =
        run("estimate --config " +
            shell_quote(std::string(OUTCORE_SOURCE_DIR) + "/configs/zero3_nvme_infinity.json") +
            " --model " + shell_quote(llama) + " --seq-len " + seq + " --gpu-memory-gb 80");
    EXPECT_EQ(r.err.find("does not fit: device"), std::string::npos) << seq << ": " << r.err;
    const size_t total = r.out.find("device  = total");
    ASSERT_NE(total, std::string::npos) << seq << ": " << r.out << r.err;
    const std::string line = r.out.substr(total, r.out.find('\n', total) - total);
    EXPECT_NE(line.find(": fits"), std::string::npos) << seq << ": " << r.out;
    EXPECT_NE(r.out.find("compute backend"), std::string::npos) << r.out;
  }
}

// outcore.log_level decides what is logged: debug shows the checkpoint writer's timings.
TEST_F(TrainCliTest, LogLevelFromTheConfigSetsWhatIsLogged) {
  const std::string ck = data_.file("ckpt");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err.find("debug:"), std::string::npos) << r.err;
  config_ = write_config("debug.json", {{"outcore", {{"log_level", "debug"}}}});
  r = run(train_args("--steps 2 --save-dir " + shell_quote(data_.file("ckpt_debug"))));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("checkpoint global_step2: prepared"), std::string::npos) << r.err;
  // "error" hides the config's own warnings too (an unknown key), as every other warning.
  config_ = write_config("quiet.json", {{"outcore", {{"log_level", "error"}}}, {"no_such_key", 1}});
  r = run(train_args("--steps 1"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err.find("no_such_key"), std::string::npos) << r.err;
  config_ = write_config("loud.json", {{"no_such_key", 1}});
  r = run(train_args("--steps 1"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("no_such_key: unknown key; ignored"), std::string::npos) << r.err;
}

// A parameter fetch buffer smaller than the largest partition in a swap file
// (offload_param.buffer_size) is bad input for both commands, before any swap file is made.
TEST_F(TrainCliTest, EstimateAndTrainRefuseATooSmallParameterBufferSize) {
  const std::string swap = data_.file("swap");
  nlohmann::json patch = testing::nvme_patch(swap);
  patch["zero_optimization"]["offload_param"]["buffer_size"] = 1000;
  config_ = write_config("small_buffer.json", patch);
  CliResult r = run("estimate --config " + shell_quote(config_) + " --model " +
                    shell_quote(model_) + " --seq-len 32");
  EXPECT_EQ(r.rc, 2) << r.out << r.err;
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("zero_optimization.offload_param.buffer_size: got 1000"), std::string::npos)
      << r.err;
  CliResult t = run(train_args("--steps 1"));
  EXPECT_EQ(t.rc, 2) << t.err;
  EXPECT_EQ(count_error_lines(t.err), 1) << t.err;
  // Found once the config is parsed, the error names the config file as the parse's errors do.
  for (const std::string& err : {r.err, t.err})
    EXPECT_NE(err.find(config_ + ": zero_optimization.offload_param.buffer_size: got 1000"),
              std::string::npos)
        << err;
  EXPECT_EQ(testing::count_files(swap), 0);
}

// estimate plans a run that saves (the save's buffers count): where only they do not fit, the
// refusal says that a run without --save-dir fits (train without it ran where estimate refused).
TEST_F(TrainCliTest, EstimateSaysWhenOnlyTheSavesBuffersDoNotFit) {
  const std::string est = "estimate --config " + shell_quote(config_) + " --model " +
                          shell_quote(model_) + " --seq-len 32 --device cpu --host-memory-gb ";
  // 153.6 MiB: the tiny run's state and the runtime's 64 MiB or so, not a save's 128 MiB ring.
  CliResult r = run(est + "0.15");
  EXPECT_EQ(r.rc, 2) << r.out << r.err;
  EXPECT_NE(r.out.find("checkpoint saves (--save-dir)"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("; a run without --save-dir (no checkpoint saves) fits"), std::string::npos)
      << r.err;
  r = run(est + "0.001");  // nothing fits in 1 MiB
  EXPECT_EQ(r.rc, 2) << r.out << r.err;
  EXPECT_EQ(r.err.find("without --save-dir"), std::string::npos) << r.err;
}

TEST_F(TrainCliTest, BadNumbersAreRefused) {
  const std::string base = "train --config " + shell_quote(config_) + " --model " +
                           shell_quote(model_) + " --data " + shell_quote(data_.train());
  // The flags that resolve "auto" values are named, not the config file they would go into.
  for (const std::string bad :
       {"--seq-len 0", "--lr inf", "--lr nan", "--weight-decay -inf", "--steps 0",
        "--eval-batches 0", "--lr -1", "--weight-decay -1", "--micro-batch-size 0",
        "--micro-batch-size 2000000", "--warmup-steps -1", "--gradient-accumulation-steps 0",
        "--train-batch-size 0"}) {
    const bool sets_steps = bad.rfind("--steps", 0) == 0;
    CliResult r = run(base + (sets_steps ? " " : " --steps 2 ") + bad);
    EXPECT_EQ(r.rc, 2) << bad << ": " << r.err;
    EXPECT_EQ(count_error_lines(r.err), 1) << bad << ": " << r.err;
    EXPECT_NE(r.err.find("error: " + bad.substr(0, bad.find(' ')) + ":"), std::string::npos)
        << r.err;
    EXPECT_EQ(r.err.find(config_), std::string::npos) << r.err;
  }
}

// A flag that would have no effect is refused, not dropped.
TEST_F(TrainCliTest, FlagsWithoutEffectAreRefused) {
  const std::string base = "train --config " + shell_quote(config_) + " --model " +
                           shell_quote(model_) + " --data " + shell_quote(data_.train()) +
                           " --steps 1";
  CliResult r = run(base + " --val-loss-mask " + shell_quote(data_.file("absent.mask")));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("error: --val-loss-mask " + data_.file("absent.mask") +
                       ": there is no --val-data"),
            std::string::npos)
      << r.err;
  r = run(base + " --val-fraction 0.1 --val-data " + shell_quote(data_.train()));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("error: --val-fraction 0.1 holds out --data's tail"), std::string::npos)
      << r.err;
  r = run(base + " --eval-batches 5");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("error: --eval-batches 5: there is no validation set for it"),
            std::string::npos)
      << r.err;
  // An empty value is a mistake, not "not given" (--save-dir '' saved nothing).
  for (const char* flag : {"--save-dir", "--seq-len", "--metrics"}) {
    r = run(base + " " + flag + " ''");
    EXPECT_EQ(r.rc, 2) << flag << ": " << r.err;
    EXPECT_NE(r.err.find(std::string(flag) + ": an empty value"), std::string::npos) << r.err;
  }
}

std::vector<nlohmann::json> step_records(const std::string& metrics) {
  std::vector<nlohmann::json> out;
  for (const std::string& l : lines_of(slurp(metrics))) {
    nlohmann::json j = nlohmann::json::parse(l);
    if (j["type"] == "step") out.push_back(j);
  }
  return out;
}

void expect_same_steps(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["step"], b[i]["step"]);
    EXPECT_EQ(a[i]["loss"], b[i]["loss"]) << "step " << i + 1;  // bit-identical doubles
    EXPECT_EQ(a[i]["grad_norm"], b[i]["grad_norm"]) << "step " << i + 1;
    EXPECT_EQ(a[i]["lr"], b[i]["lr"]) << "step " << i + 1;
  }
}

// Save after 3 steps, resume in a new process taking config, model and data from the
// checkpoint: the metrics of steps 1-6 equal an uninterrupted run's.
TEST_F(TrainCliTest, ResumeInANewProcessIsBitIdentical) {
  config_ = write_config("nvme.json", testing::nvme_patch(data_.file("swap")));
  CliResult r = run(train_args("--steps 6 --metrics " + shell_quote(data_.file("straight.jsonl"))));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string ck = data_.file("ckpt"), m = data_.file("resumed.jsonl");
  r = run(train_args("--steps 3 --save-dir " + shell_quote(ck) +
                     " --save-every 2 --keep 2 --metrics " + shell_quote(m)));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("saved checkpoint"), std::string::npos) << r.err;
  r = run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) +
          " --steps 6 --metrics " + shell_quote(m));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("resume     from " + ck + "/global_step3 at step 3"), std::string::npos)
      << r.out;
  expect_same_steps(step_records(data_.file("straight.jsonl")), step_records(m));
  EXPECT_EQ(slurp(ck + "/latest"), "global_step6\n");
  // Into its own save directory the run saves as it did (every 2 steps, the newest 2 kept).
  EXPECT_NE(r.out.find("every 2 steps and at the end, keep 2"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::exists(ck + "/global_step4"));
  EXPECT_FALSE(std::filesystem::exists(ck + "/global_step3"));
  // Without a save directory, the setup says the run saves nothing.
  r = run("train --resume " + shell_quote(ck) + " --steps 7");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("checkpoint none: this run saves nothing (outcore train saves with "
                       "--save-dir)"),
            std::string::npos)
      << r.out;
  // A metrics file other than the checkpoint's run's (here another run's) is written from its
  // start, as by a new run: it is not cut and extended as if it were this run's.
  const std::string own = slurp(m);
  r = run("train --resume " + shell_quote(ck) + " --steps 7 --metrics " +
          shell_quote(data_.file("straight.jsonl")));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("is not the metrics file of the run that saved"), std::string::npos)
      << r.err;
  const auto written = step_records(data_.file("straight.jsonl"));
  ASSERT_EQ(written.size(), 1u);
  EXPECT_EQ(written[0]["step"], 7);
  EXPECT_EQ(slurp(m), own);

  // A resume goes on with its run's seed: said only where --seed asks for another.
  const std::string seeded = data_.file("seeded");
  r = run(train_args("--steps 1 --seed 5 --save-dir " + shell_quote(seeded)));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run("train --resume " + shell_quote(seeded) + " --steps 2");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err.find("resuming with the checkpoint's seed"), std::string::npos) << r.err;
  r = run("train --resume " + shell_quote(seeded) + " --steps 2 --seed 6");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("resuming with the checkpoint's seed 5 (data order), not 6"),
            std::string::npos)
      << r.err;

  r = run("train --resume " + shell_quote(data_.file("nowhere")) + " --steps 6");
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("nowhere"), std::string::npos) << r.err;
}

// A run given its data by a relative path resumes on that same file from any directory: the
// checkpoint names it absolutely (a file of the same name where the resume starts is not it).
TEST_F(TrainCliTest, AResumeFromAnotherDirectoryReadsTheSameData) {
  namespace fs = std::filesystem;
  const fs::path a = data_.file("a"), b = data_.file("b");
  fs::create_directories(a);
  fs::create_directories(b);
  fs::copy_file(data_.train(), a / "data.bin");
  std::string other = slurp(data_.train());
  std::reverse(other.begin() + 1024, other.end());  // the header kept: tokens of another order
  std::ofstream(b / "data.bin", std::ios::binary) << other;
  const std::string ck = data_.file("ckpt");
  auto in = [&](const fs::path& dir, const std::string& args) {
    const std::string err = data_.file("stderr"), out = data_.file("stdout");
    const std::string cmd = "cd " + shell_quote(dir.string()) + " && env -u OUTCORE_CONFIG " +
                            shell_quote(OUTCORE_CLI) + " " + args + " >" + shell_quote(out) +
                            " 2>" + shell_quote(err);
    const int status = std::system(cmd.c_str());
    return CliResult{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
  };
  CliResult r = in(a, "train --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
                          " --data data.bin --seq-len 32 --steps 2 --save-dir " + shell_quote(ck));
  ASSERT_EQ(r.rc, 0) << r.err;
  const nlohmann::json state =
      nlohmann::json::parse(slurp(ck + "/global_step2/trainer_state.json"));
  EXPECT_EQ(state["train_data"], (a / "data.bin").string());
  r = in(b, "train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) + " --steps 3");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("train data " + (a / "data.bin").string()), std::string::npos) << r.out;
}

// Batch and warmup flags are never dropped silently: one the config leaves out is taken, one it
// contradicts is an error or a warning naming the key.
TEST_F(TrainCliTest, BatchAndWarmupFlagsTakeEffectOrAreSaidNotTo) {
  const std::string with_gas = config_;
  config_ = write_config("nogas.json", {{"gradient_accumulation_steps", nullptr}});
  CliResult r = run(train_args("--steps 1 --gradient-accumulation-steps 2"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("x gas 2 x world 1"), std::string::npos) << r.out;
  config_ = with_gas;  // gradient_accumulation_steps 1
  r = run(train_args("--steps 1 --gradient-accumulation-steps 2 --warmup-steps 7"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(
      r.err.find("--gradient-accumulation-steps 2 not used: gradient_accumulation_steps is 1"),
      std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("--warmup-steps 7 not used"), std::string::npos) << r.err;
  // A flag's value that breaks the batch arithmetic: the error names the flag it came from.
  r = run(train_args("--steps 1 --train-batch-size 999"));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("train_batch_size 999 came from --train-batch-size"), std::string::npos)
      << r.err;
}

// --lr is a WarmupLR schedule's peak where its warmup_max_lr is "auto", whatever number the
// optimizer's lr holds (the schedule sets the lr then): taken, and not said to be unused; where
// the schedule's peak is a number, --lr is said to be unused naming that key, even with the
// optimizer's lr "auto" (which it fills, to no effect).
TEST_F(TrainCliTest, TheLrFlagIsSaidUnusedOnlyWhereTheScheduleIgnoresIt) {
  const std::string m = data_.file("m.jsonl");
  auto warmup = [&](const nlohmann::json& max_lr, const nlohmann::json& lr) {
    return write_config(
        "warmup.json",
        {{"optimizer", {{"params", {{"lr", lr}}}}},
         {"scheduler",
          {{"type", "WarmupLR"},
           {"params",
            {{"warmup_num_steps", 1}, {"warmup_type", "linear"}, {"warmup_max_lr", max_lr}}}}}});
  };
  config_ = warmup("auto", 0.003);
  CliResult r = run(train_args("--steps 4 --lr 0.01 --metrics " + shell_quote(m)));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err.find("--lr"), std::string::npos) << r.err;
  const std::vector<nlohmann::json> steps = step_records(m);
  ASSERT_EQ(steps.size(), 4u);
  // DeepSpeed's stepping (lr_schedule.hpp): step 4 takes lr(2), past a warmup of max(2, 1).
  EXPECT_EQ(steps[3]["lr"].get<double>(), 0.01);
  config_ = warmup(0.002, "auto");
  r = run(train_args("--steps 1 --lr 0.01"));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("--lr 0.01 not used: scheduler.params.warmup_max_lr is 0.002"),
            std::string::npos)
      << r.err;
}

// --data naming the file the checkpoint trained on is the checkpoint's data: its validation
// split carries over, as when --data is left out, and so does how often and on how many
// micro-batches the run validates.
TEST_F(TrainCliTest, ResumingWithTheSameDataKeepsItsValidationSplit) {
  const std::string ck = data_.file("ckpt");
  CliResult r =
      run(train_args("--steps 2 --val-fraction 0.1 --eval-every 1 --eval-batches 1 "
                     "--save-dir " +
                     shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  auto line = [](const std::string& out) {
    const size_t at = out.find("train data ");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  const std::string split = line(r.out);
  ASSERT_FALSE(split.empty()) << r.out;
  auto val_tokens = [](const std::string& out, int step) {
    const std::string head = "val step " + std::to_string(step) + " | loss ";
    const size_t at = out.find(head);
    if (at == std::string::npos) return std::string();
    const size_t from = out.find(" | ", at + head.size()) + 3;
    return out.substr(from, out.find(" tokens", from) - from);
  };
  const std::string one_batch = val_tokens(r.out + r.err, 1);
  ASSERT_FALSE(one_batch.empty()) << r.out << r.err;
  r = run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) +
          " --steps 4 --data " + shell_quote(data_.train()));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(line(r.out), split) << r.out;
  EXPECT_EQ(val_tokens(r.out + r.err, 3), one_batch) << r.out << r.err;
  EXPECT_EQ(val_tokens(r.out + r.err, 4), one_batch) << r.out << r.err;
}

// A file the checkpoint names that is gone: the refusal says where the path came from and how
// to go on without it, and that way works.
TEST_F(TrainCliTest, AResumeWhoseValidationFileIsGoneSaysHowToGoOn) {
  const std::string ck = data_.file("ckpt"), val = data_.file("val.bin");
  std::filesystem::copy_file(data_.val(), val);
  CliResult r = run(
      train_args("--steps 1 --val-data " + shell_quote(val) + " --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  std::filesystem::remove(val);
  r = run("train --resume " + shell_quote(ck) + " --steps 2");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--val-data " + val + ": no such file; --val-data named by " + ck +
                       "/global_step1/trainer_state.json: give --val-data FILE, or "
                       "--val-fraction 0 to go on without validation"),
            std::string::npos)
      << r.err;
  r = run("train --resume " + shell_quote(ck) + " --steps 2 --val-fraction 0");
  EXPECT_EQ(r.rc, 0) << r.err;
}

// A resume reads its checkpoint's data in the format the run was given, and a run that wrote
// metrics is named when the resume writes none (not carried over: a resume from an earlier
// checkpoint would cut the later records of that log).
TEST_F(TrainCliTest, AResumeReadsItsDataAsItsRunDidAndNamesItsMetrics) {
  const std::string raw = data_.file("tokens.dat"), ck = data_.file("ckpt");
  const std::string m = data_.file("m.jsonl");
  std::string body = slurp(data_.train());
  std::ofstream(raw, std::ios::binary) << body.substr(1024);  // the tokens, raw u16
  CliResult r = run("train --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
                    " --data " + shell_quote(raw) + " --format u16 --seq-len 32 --steps 1 " +
                    "--metrics " + shell_quote(m) + " --save-dir " + shell_quote(ck));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string records = slurp(m);
  r = run("train --resume " + shell_quote(ck) + " --steps 2");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("give --metrics " + m + " to go on writing it"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(m), records);
}

// A copy of an earlier checkpoint, resumed elsewhere with its run's metrics file: the records
// that the run's later checkpoints (in the save directory the run wrote, not beside the copy)
// continue are refused to be cut, as they are for the checkpoint itself.
TEST_F(TrainCliTest, AResumeOfACheckpointsCopyNeverCutsRecordsItsRunsLaterCheckpointsContinue) {
  const std::string ck = data_.file("ckpt"), m = data_.file("m.jsonl");
  CliResult r = run(train_args("--steps 4 --save-every 2 --save-dir " + shell_quote(ck) +
                               " --metrics " + shell_quote(m)));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string records = slurp(m);
  const std::string copy = data_.file("copies") + "/global_step2";
  std::filesystem::create_directories(data_.file("copies"));
  std::filesystem::copy(ck + "/global_step2", copy, std::filesystem::copy_options::recursive);
  for (const std::string& from : {ck + "/global_step2", copy}) {
    r = run("train --resume " + shell_quote(from) + " --steps 6 --save-dir " +
            shell_quote(data_.file("branch")) + " --metrics " + shell_quote(m));
    EXPECT_EQ(r.rc, 2) << from << "\n" << r.err;
    EXPECT_NE(r.err.find("holds 2 records from step 3 on, which " + ck +
                         "/global_step4 of the same run continue"),
              std::string::npos)
        << from << "\n"
        << r.err;
    EXPECT_EQ(slurp(m), records) << from;
  }
}

// --activation-checkpointing=false over a config whose cpu_checkpointing turns it on: off, with
// no host checkpoints planned, and the key said to have no effect.
TEST_F(TrainCliTest, ActivationCheckpointingTurnedOffLeavesNoHostCheckpoints) {
  config_ =
      write_config("cpu_ckpt.json", {{"activation_checkpointing", {{"cpu_checkpointing", true}}}});
  CliResult on = run(train_args("--steps 1"));
  ASSERT_EQ(on.rc, 0) << on.err;
  EXPECT_NE(on.out.find("activation checkpointing on (checkpoints in host memory)"),
            std::string::npos)
      << on.out;
  EXPECT_NE(on.out.find("activation checkpoints (cpu_checkpointing)"), std::string::npos) << on.out;
  CliResult off = run(train_args("--steps 1 --activation-checkpointing=false"));
  ASSERT_EQ(off.rc, 0) << off.err;
  EXPECT_NE(off.out.find("activation checkpointing off\n"), std::string::npos) << off.out;
  EXPECT_EQ(off.out.find("activation checkpoints (cpu_checkpointing)"), std::string::npos)
      << off.out;
  EXPECT_NE(off.err.find("activation_checkpointing.cpu_checkpointing has no effect"),
            std::string::npos)
      << off.err;
}

// A resume on its checkpoint's config: a key the run left "auto" takes this run's flag again
// (--steps lengthens a schedule of "auto" total_num_steps: the learning rate goes on falling
// instead of sitting at its floor), a number there holds against a flag with a warning that
// names the checkpoint's file, a config given again has each change said, and
// --activation-checkpointing carries over.
TEST_F(TrainCliTest, AResumeTakesItsFlagsWhereItsRunDidAndSaysEveryConfigChange) {
  config_ = write_config("cosine.json",
                         {{"scheduler",
                           {{"type", "WarmupCosineLR"},
                            {"params", {{"total_num_steps", "auto"}, {"warmup_num_steps", 1}}}}}});
  const std::string ck = data_.file("ckpt"), m = data_.file("m.jsonl");
  CliResult r =
      run(train_args("--steps 2 --activation-checkpointing --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run("train --resume " + shell_quote(ck) + " --steps 4 --metrics " + shell_quote(m));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("scheduler.params.total_num_steps 2 -> 4"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("activation checkpointing on"), std::string::npos) << r.out;
  // With the config given again too (it has no activation_checkpointing section), and turned
  // off by the flag's =false.
  CliResult again =
      run("train --resume " + shell_quote(ck) + " --config " + shell_quote(config_) + " --steps 3");
  ASSERT_EQ(again.rc, 0) << again.err;
  EXPECT_NE(again.out.find("activation checkpointing on"), std::string::npos) << again.out;
  again = run("train --resume " + shell_quote(ck) + " --steps 3 --activation-checkpointing=false");
  ASSERT_EQ(again.rc, 0) << again.err;
  EXPECT_NE(again.out.find("activation checkpointing off"), std::string::npos) << again.out;
  std::map<int64_t, double> lr;
  for (const nlohmann::json& rec : step_records(m)) lr[rec["step"].get<int64_t>()] = rec["lr"];
  ASSERT_EQ(lr.size(), 2u) << slurp(m);
  EXPECT_GT(lr[3], lr[4]);  // over 2 steps both would be the floor
  r = run("train --resume " + shell_quote(ck) + " --steps 3 --lr 0.5");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("--lr 0.5 not used: optimizer.params.lr is 0.003 (the value in " + ck +
                       "/global_step2/ds_config.json, which the resume keeps: give --config FILE "
                       "to change it)"),
            std::string::npos)
      << r.err;
  const std::string clipped = write_config(
      "clipped.json", {{"gradient_clipping", 0.5},
                       {"scheduler",
                        {{"type", "WarmupCosineLR"},
                         {"params", {{"total_num_steps", "auto"}, {"warmup_num_steps", 1}}}}}});
  r = run("train --resume " + shell_quote(ck) + " --steps 3 --config " + shell_quote(clipped));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("differs from " + ck +
                       "/global_step2/ds_config.json: gradient_clipping "
                       "0.0 -> 0.5; scheduler.params.total_num_steps 2 -> 3"),
            std::string::npos)
      << r.err;
}

// An nvme_path with a file (or a link to nowhere) in its place or on its way is bad input: exit 2
// naming the key, from `train` and from `estimate` alike.
TEST_F(TrainCliTest, AnNvmePathThatIsNoDirectoryIsRefusedNamingTheKey) {
  const std::string file = data_.file("a_file"), dangling = data_.file("dangling");
  std::ofstream(file) << "mine";
  std::filesystem::create_symlink(data_.file("nowhere"), dangling);
  for (const std::string& path : {file, dangling, file + "/swap"}) {
    config_ = write_config("nvme.json", testing::nvme_patch(path));
    for (const std::string& cmd :
         {train_args("--steps 1"), "estimate --config " + shell_quote(config_) + " --model " +
                                       shell_quote(model_) + " --seq-len 32 --device cpu"}) {
      const CliResult r = run(cmd);
      EXPECT_EQ(r.rc, 2) << cmd << "\n" << r.err;
      EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
      EXPECT_NE(r.err.find("nvme_path"), std::string::npos) << r.err;
      EXPECT_NE(r.err.find(path + ": is not a directory"), std::string::npos) << r.err;
    }
  }
  // Planning for another machine's drive (--nvme-free-gb), the path is that machine's.
  const CliResult rented =
      run("estimate --config " + shell_quote(config_) + " --model " + shell_quote(model_) +
          " --seq-len 32 --device cpu --nvme-free-gb 100");
  EXPECT_EQ(rented.rc, 0) << rented.err;
  EXPECT_EQ(slurp(file), "mine");
  EXPECT_FALSE(std::filesystem::exists(data_.file("nowhere")));
}

// Started with its standard streams closed (`>&- 2>&-`, `<&- >&-`): the run trains and saves.
// The stop watcher's pipe took a closed stream's number, and the first message written there
// ended the process as a signal would (exit 247 or 237: nothing trained, nothing saved).
TEST_F(TrainCliTest, ARunStartedWithItsStreamsClosedTrainsAndSaves) {
  const std::string err = data_.file("closed_err");
  int k = 0;
  for (const std::string& closing : {std::string(" >&- 2>&-"), " <&- >&- 2>" + shell_quote(err)}) {
    const std::string ck = data_.file("ckpt" + std::to_string(k++));
    const std::string cmd = "env -u OUTCORE_CONFIG " + shell_quote(OUTCORE_CLI) + " " +
                            train_args("--steps 2 --save-dir " + shell_quote(ck)) + closing;
    const int status = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(status)) << closing << ": " << status;
    EXPECT_EQ(WEXITSTATUS(status), 0) << closing;
    EXPECT_EQ(slurp(ck + "/latest"), "global_step2\n") << closing;
  }
  EXPECT_NE(slurp(err).find("step 2/2"), std::string::npos) << slurp(err);
}

// Under an address-space limit (ulimit -v) too small for the run's threads, the run is refused
// naming the limit: it spun forever in OpenBLAS's allocation loop, a first Ctrl-C waiting for a
// step that never ended.
TEST_F(TrainCliTest, AnAddressSpaceLimitTooSmallIsRefusedNamingIt) {
  const std::string out = data_.file("as_out"), err = data_.file("as_err");
  const std::string cmd = "(ulimit -v 1000000; exec env -u OUTCORE_CONFIG timeout -k 5 60 " +
                          shell_quote(OUTCORE_CLI) + " " + train_args("--steps 3") + ") >" +
                          shell_quote(out) + " 2>" + shell_quote(err);
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 2) << slurp(err);
  EXPECT_NE(slurp(err).find("but ulimit -v (0.95 GiB, less the"), std::string::npos) << slurp(err);
  EXPECT_NE(slurp(err).find("`ulimit -v unlimited` lifts it"), std::string::npos) << slurp(err);
}

// A resume on the checkpoint's config: keys its run left "auto" are saved resolved, and draw no
// warning of a value set without effect (reduce_bucket_size "set to 4096, but it has no effect",
// which the user never set); a value the user set still does.
TEST_F(TrainCliTest, AResumeWarnsOnlyOfValuesTheUserSet) {
  config_ = write_config("auto.json", {{"zero_optimization",
                                        {{"stage", 3},
                                         {"reduce_bucket_size", "auto"},
                                         {"stage3_prefetch_bucket_size", "auto"},
                                         {"stage3_param_persistence_threshold", "auto"},
                                         {"allgather_bucket_size", 12345}}}});
  const std::string ck = data_.file("ckpt");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run("train --resume " + shell_quote(ck) + " --steps 2");
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const char* key :
       {"reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"})
    EXPECT_EQ(r.err.find(std::string("zero_optimization.") + key), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("zero_optimization.allgather_bucket_size: set to 12345"), std::string::npos)
      << r.err;
}

// A save killed (SIGKILL) part-way, at several points (test hooks of
// outcore_with_test_hooks): the previous checkpoint stays the one `latest` names and loads; the
// next run removes the leftovers with a warning and resumes.
TEST_F(TrainCliTest, KilledSaveLeavesThePreviousCheckpoint) {
  const std::string ck = data_.file("ckpt");
  CliResult r = run(train_args("--steps 2 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const std::string env :
       {"OUTCORE_TEST_CKPT_CRASH_AT=before-latest", "OUTCORE_TEST_CKPT_CRASH_AT=before-rename",
        "OUTCORE_TEST_CKPT_CRASH_AFTER_BYTES=200000", "OUTCORE_TEST_CKPT_CRASH_AFTER_BYTES=8192"}) {
    const std::string cmd = "env -u OUTCORE_CONFIG " + env + " " +
                            shell_quote(OUTCORE_CLI_WITH_TEST_HOOKS) + " train --resume " +
                            shell_quote(ck) + " --save-dir " + shell_quote(ck) +
                            " --steps 3 >/dev/null 2>&1";
    const int status = std::system(cmd.c_str());
    ASSERT_TRUE(WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) == 137))
        << env << " status " << status;
    EXPECT_EQ(slurp(ck + "/latest"), "global_step2\n") << env;
  }
  r = run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) + " --steps 3");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("left by an interrupted save"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("at step 2"), std::string::npos) << r.out;
  EXPECT_EQ(slurp(ck + "/latest"), "global_step3\n");
}

// A save killed before it was named latest, in a run writing a metrics file: the next resume
// replaces that checkpoint and cuts the records of its steps, which it trains again (it was
// refused for good: the metrics file "holds records ... which global_step3 of the same run
// continue").
TEST_F(TrainCliTest, ASaveKilledBeforeLatestWithAMetricsFileResumes) {
  const std::string ck = data_.file("ckpt"), metrics = data_.file("m.jsonl");
  CliResult r = run(
      train_args("--steps 2 --save-dir " + shell_quote(ck) + " --metrics " + shell_quote(metrics)));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string cmd = "env -u OUTCORE_CONFIG OUTCORE_TEST_CKPT_CRASH_AT=before-latest " +
                          shell_quote(OUTCORE_CLI_WITH_TEST_HOOKS) + " train --resume " +
                          shell_quote(ck) + " --save-dir " + shell_quote(ck) + " --metrics " +
                          shell_quote(metrics) + " --steps 3 >/dev/null 2>&1";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) == 137)) << status;
  ASSERT_EQ(slurp(ck + "/latest"), "global_step2\n");
  ASSERT_TRUE(std::filesystem::exists(ck + "/global_step3/manifest.json"));
  ASSERT_EQ(step_records(metrics).size(), 3u);
  r = run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) + " --metrics " +
          shell_quote(metrics) + " --steps 3");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("a save killed before it was named latest"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(ck + "/latest"), "global_step3\n");
  const std::vector<nlohmann::json> steps = step_records(metrics);
  ASSERT_EQ(steps.size(), 3u);
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i]["step"], i + 1);
}

// A --start-over with a metrics file killed once its first checkpoint was named latest, before
// it removed the replaced run's later checkpoints: resuming it continues (it was refused: the
// save directory took those for another branch of the run, naming the replaced run's newest to
// resume), and its first save removes them.
TEST_F(TrainCliTest, AStartOverKilledBeforeItRemovedTheOldCheckpointsResumes) {
  const std::string ck = data_.file("ckpt"), metrics = data_.file("m.jsonl");
  CliResult r = run(train_args("--steps 3 --save-every 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string cmd = "env -u OUTCORE_CONFIG OUTCORE_TEST_CKPT_CRASH_AT=after-latest " +
                          shell_quote(OUTCORE_CLI_WITH_TEST_HOOKS) + " " +
                          train_args("--steps 2 --seed 7 --start-over --save-every 1 --save-dir " +
                                     shell_quote(ck) + " --metrics " + shell_quote(metrics)) +
                          " >/dev/null 2>&1";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) == 137)) << status;
  ASSERT_EQ(slurp(ck + "/latest"), "global_step1\n");
  ASSERT_TRUE(std::filesystem::exists(ck + "/global_step3/manifest.json"));
  r = run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) + " --metrics " +
          shell_quote(metrics) + " --steps 2");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("global_step2, global_step3 in " + ck +
                       ": checkpoints of the run that global_step1 replaced"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(slurp(ck + "/latest"), "global_step2\n");
  EXPECT_FALSE(std::filesystem::exists(ck + "/global_step3"));
  const std::vector<nlohmann::json> steps = step_records(metrics);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[1]["step"], 2);
}

// A save of a step already saved, killed between its two renames (a filesystem that cannot
// exchange two directories): `latest` names a checkpoint that is only there as <tag>.old. An
// export reads it there, and a resume into the save directory continues from it (it was refused:
// "latest names checkpoint global_step3, which has no manifest.json", nothing repaired).
TEST_F(TrainCliTest, ASaveKilledBetweenItsRenamesLeavesTheCheckpointReadable) {
  const std::string ck = data_.file("ckpt");
  CliResult r = run(train_args("--steps 3 --save-every 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string cmd = "env -u OUTCORE_CONFIG OUTCORE_TEST_CKPT_CRASH_AT=between-renames " +
                          shell_quote(OUTCORE_CLI_WITH_TEST_HOOKS) + " train --resume " +
                          shell_quote(ck + "/global_step2") + " --save-dir " + shell_quote(ck) +
                          " --start-over --steps 3 >/dev/null 2>&1";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) == 137)) << status;
  ASSERT_FALSE(std::filesystem::exists(ck + "/global_step3"));
  ASSERT_TRUE(std::filesystem::exists(ck + "/global_step3.old"));
  r = run("export " + shell_quote(ck) + " " + shell_quote(data_.file("hf")));
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("global_step3.old: reading it there"), std::string::npos) << r.err;
  r = run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) + " --steps 4");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("at step 3"), std::string::npos) << r.out;
  EXPECT_EQ(slurp(ck + "/latest"), "global_step4\n");
  EXPECT_TRUE(std::filesystem::exists(ck + "/global_step3/manifest.json"));
  EXPECT_FALSE(std::filesystem::exists(ck + "/global_step3.old"));
  EXPECT_FALSE(std::filesystem::exists(ck + "/global_step3.tmp"));
}

// A save directory whose filesystem cannot hold one checkpoint is refused before the training
// (the save used to fail after it, and the trained steps went with the swap files).
TEST_F(TrainCliTest, ASaveDirectoryWithoutRoomForACheckpointIsRefusedBeforeTraining) {
  const std::string ck = data_.file("ckpt"), err = data_.file("room_err");
  auto train = [&](uint64_t free_bytes, const std::string& dir) {
    const std::string cmd =
        "env -u OUTCORE_CONFIG OUTCORE_TEST_SAVE_FREE_BYTES=" + std::to_string(free_bytes) + " " +
        shell_quote(OUTCORE_CLI_WITH_TEST_HOOKS) + " " +
        train_args("--steps 1 --save-dir " + shell_quote(dir)) + " >/dev/null 2>" +
        shell_quote(err);
    const int status = std::system(cmd.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  EXPECT_EQ(train(4096, ck), 2);
  std::string e = slurp(err);
  EXPECT_NE(e.find("save directory " + ck + ": a checkpoint of this run takes up to"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("the filesystem has 4096 bytes"), std::string::npos) << e;
  EXPECT_EQ(e.find("step 1/"), std::string::npos) << e;  // nothing trained
  EXPECT_FALSE(std::filesystem::exists(ck + "/latest"));
  EXPECT_EQ(train(uint64_t{1} << 40, ck), 0) << slurp(err);
  EXPECT_EQ(slurp(ck + "/latest"), "global_step1\n");
  // Room for the data files but not the JSON files beside them: refused before the training too
  // (the check counted the data alone, and the save failed after the training).
  uint64_t data_bytes = 0;
  for (const char* f : {"model.bin", "optimizer.bin"})
    data_bytes += std::filesystem::file_size(ck + "/global_step1/rank0/" + f);
  EXPECT_EQ(train(data_bytes, data_.file("ckpt2")), 2) << slurp(err);
  e = slurp(err);
  EXPECT_NE(e.find("takes up to"), std::string::npos) << e;
  EXPECT_EQ(e.find("step 1/"), std::string::npos) << e;
}

// A file-size limit (ulimit -f) below a checkpoint's size: the save fails as a write error does,
// naming the file, and nothing of it is left (SIGXFSZ ended the process mid-write, silently).
TEST_F(TrainCliTest, AFileSizeLimitFailsTheSaveWithAMessageAndLeavesNothing) {
  const std::string ck = data_.file("ckpt_fsize"), err = data_.file("fsize_err");
  const std::string cmd = "ulimit -f 64 && env -u OUTCORE_CONFIG " + shell_quote(OUTCORE_CLI) +
                          " " + train_args("--steps 1 --save-dir " + shell_quote(ck)) +
                          " >/dev/null 2>" + shell_quote(err);
  const int status = std::system(("bash -c " + shell_quote(cmd)).c_str());
  ASSERT_TRUE(WIFEXITED(status)) << "ended by signal " << WTERMSIG(status) << ": " << slurp(err);
  EXPECT_EQ(WEXITSTATUS(status), 1) << slurp(err);
  const std::string e = slurp(err);
  EXPECT_NE(e.find("File too large"), std::string::npos) << e;
  std::vector<std::string> left;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(ck, ec))
    left.push_back(entry.path().filename().string());
  EXPECT_TRUE(left.empty()) << left.front();
}

// A path another run holds (here the metrics file, locked by this process): refused at start as
// bad input (exit 2), naming it.
TEST_F(TrainCliTest, APathAnotherRunHoldsIsRefusedAsBadInput) {
  const std::string m = data_.file("held.jsonl");
  std::ofstream(m) << "{\"type\": \"start\"}\n";
  const int fd = ::open(m.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  const CliResult r = run(train_args("--steps 1 --metrics " + shell_quote(m)));
  ::close(fd);
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("another run is writing it"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("step 1/"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(m), "{\"type\": \"start\"}\n");
}

// --metrics naming a user's file that is not a metrics file: refused before the training, the
// file whole; an earlier run's metrics file is replaced.
TEST_F(TrainCliTest, MetricsNeverReplaceAUsersOtherFile) {
  const std::string notes = data_.file("notes.jsonl");
  std::ofstream(notes) << "my own notes\n";
  CliResult r = run(train_args("--steps 1 --metrics " + shell_quote(notes)));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find(notes + ": exists and is not a metrics file"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("step 1/"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(notes), "my own notes\n");
  const std::string m = data_.file("m.jsonl");
  for (int run_no = 0; run_no < 2; ++run_no) {
    r = run(train_args("--steps 1 --metrics " + shell_quote(m)));
    ASSERT_EQ(r.rc, 0) << r.err;
  }
  EXPECT_EQ(nlohmann::json::parse(lines_of(slurp(m))[0])["type"], "start");
  EXPECT_EQ(lines_of(slurp(m)).size(), 2u) << slurp(m);  // start + step 1, of the second run
}

// The README's demo, shortened: ZeRO-3 with NVMe swap, exit 0, one JSON line per step in
// its metrics file, falling loss, and no swap files left behind.
TEST_F(TrainCliTest, ShortDemoRunTrainsAndWritesMetrics) {
  const std::string dir = data_.file("demo");
  CliResult r = run("demo --work-dir " + shell_quote(dir) + " --steps 8");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("stage 3, parameters nvme"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("trained 8 steps"), std::string::npos) << r.out;
  std::vector<nlohmann::json> steps;
  for (const std::string& l : lines_of(slurp(dir + "/metrics.jsonl"))) {
    nlohmann::json j = nlohmann::json::parse(l);
    if (j["type"] == "step") steps.push_back(j);
  }
  ASSERT_EQ(steps.size(), 8u);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i]["step"], static_cast<int>(i + 1));
    EXPECT_TRUE(steps[i]["io"].contains("nvme")) << steps[i].dump();
  }
  EXPECT_LT(steps.back()["loss"].get<double>(), steps.front()["loss"].get<double>() - 0.3);
  EXPECT_EQ(testing::count_files(dir + "/swap"), 0);
  // "The same run by hand" is the same run: its losses, the validation's too, are the demo's.
  const std::string by_hand = "The same run by hand:\n  outcore ";
  const size_t at = r.out.find(by_hand);
  ASSERT_NE(at, std::string::npos) << r.out;
  const size_t from = at + by_hand.size();
  const std::string command = r.out.substr(from, r.out.find('\n', from) - from);
  auto losses = [&](const std::string& file) {
    std::vector<std::pair<std::string, double>> out;
    for (const std::string& l : lines_of(slurp(file))) {
      const nlohmann::json j = nlohmann::json::parse(l);
      if (j["type"] == "step" || j["type"] == "val") out.emplace_back(j["type"], j["loss"]);
    }
    return out;
  };
  const auto demo_losses = losses(dir + "/metrics.jsonl");
  const std::string again = data_.file("by_hand.jsonl");
  CliResult hand = run(command + " --metrics " + shell_quote(again));
  ASSERT_EQ(hand.rc, 0) << command << "\n" << hand.err;
  EXPECT_EQ(losses(again), demo_losses) << command;
  EXPECT_EQ(demo_losses.back().first, "val");
  // Its own work directory takes it again.
  r = run("demo --work-dir " + shell_quote(dir) + " --steps 1");
  EXPECT_EQ(r.rc, 0) << r.err;
}

// The demo never writes into a checkpoint or at a save directory's names (a file there keeps the
// checkpoint forever, or blocks a later save of that name): refused before anything is written.
TEST_F(TrainCliTest, DemoOutputsNeverLieInASaveDirectorysCheckpoints) {
  const std::string ck = data_.file("ckpt");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const std::string& args :
       {"--work-dir " + ck + "/global_step1", "--work-dir " + ck + "/global_step1/demo",
        "--work-dir " + ck + "/global_step5",
        "--work-dir " + data_.file("w") + " --trace " + ck + "/global_step1/trace.json"}) {
    r = run("demo --steps 1 " + args);
    EXPECT_EQ(r.rc, 2) << args << "\n" << r.err;
    EXPECT_EQ(count_error_lines(r.err), 1) << args << "\n" << r.err;
  }
  EXPECT_FALSE(std::filesystem::exists(ck + "/global_step5"));
  EXPECT_FALSE(std::filesystem::exists(ck + "/global_step1/demo"));
  EXPECT_FALSE(std::filesystem::exists(data_.file("w")));
  r = run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) + " --steps 2");
  EXPECT_EQ(r.rc, 0) << r.err;
}

// `demo --bf16`: bf16 parameters and compute, written into the config it shows, and the loss
// falls as in fp32.
TEST_F(TrainCliTest, ShortDemoRunInBf16Trains) {
  const std::string dir = data_.file("demo_bf16");
  CliResult r = run("demo --bf16 --work-dir " + shell_quote(dir) + " --steps 8");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("in bf16 (fp32 master weights"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("trained 8 steps"), std::string::npos) << r.out;
  const nlohmann::json ds = nlohmann::json::parse(slurp(dir + "/ds_config.json"));
  EXPECT_TRUE(ds["bf16"]["enabled"].get<bool>()) << ds.dump();
  std::vector<double> losses;
  for (const std::string& l : lines_of(slurp(dir + "/metrics.jsonl"))) {
    nlohmann::json j = nlohmann::json::parse(l);
    if (j["type"] == "step") losses.push_back(j["loss"].get<double>());
  }
  ASSERT_EQ(losses.size(), 8u);
  EXPECT_LT(losses.back(), losses.front() - 0.3);
}

// The demo writes its files only where nothing at their names is someone else's, never through
// a link, and its trace never over one of them.
TEST_F(TrainCliTest, DemoNeverWritesOverAUsersFiles) {
  namespace fs = std::filesystem;
  const std::string mine = data_.file("mine"), linked = data_.file("linked");
  const std::string victim = data_.file("victim.txt");
  fs::create_directories(mine);
  fs::create_directories(linked);
  std::ofstream(mine + "/config.json") << "USER";
  std::ofstream(mine + "/notes.txt") << "USER";
  std::ofstream(victim) << "VICTIM";
  fs::create_symlink(victim, linked + "/metrics.jsonl");
  CliResult r = run("demo --steps 1 --work-dir " + shell_quote(mine));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("holds config.json, which the demo did not write"), std::string::npos)
      << r.err;
  EXPECT_EQ(slurp(mine + "/config.json"), "USER");
  EXPECT_FALSE(fs::exists(mine + "/demo_train.bin"));
  r = run("demo --steps 1 --work-dir " + shell_quote(linked));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("holds metrics.jsonl, a symbolic link"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(victim), "VICTIM");
  fs::remove(mine + "/config.json");
  r = run("demo --steps 1 --work-dir " + shell_quote(mine) + " --trace " +
          shell_quote(mine + "/ds_config.json"));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(slurp(mine + "/notes.txt"), "USER");
  // Nor at its marker, its lock or in its swap directory: refused before the training (it
  // failed at the end, the trace unwritten).
  for (const char* name : {"/.outcore-demo", "/.demo.lock", "/swap", "/swap/t.json"}) {
    r = run("demo --steps 1 --work-dir " + shell_quote(mine) + " --trace " +
            shell_quote(mine + name));
    EXPECT_EQ(r.rc, 2) << name << ": " << r.err;
    EXPECT_EQ(r.err.find("step 1/"), std::string::npos) << name << ": " << r.err;
  }
  // A count beyond its type is said to be, not called no number.
  r = run("demo --steps 99999999999999999999 --work-dir " + shell_quote(mine));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("allowed: a whole number from"), std::string::npos) << r.err;
  // Files at the names of the temporaries an earlier version used: a user's file, and a link
  // to a file elsewhere. The demo trains, and both stay as they were.
  const std::string tmps = data_.file("tmps");
  fs::create_directories(tmps);
  std::ofstream(tmps + "/config.json.tmp") << "DRAFT";
  fs::create_symlink(victim, tmps + "/demo_train.bin.tmp");
  r = run("demo --steps 1 --work-dir " + shell_quote(tmps));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(slurp(tmps + "/config.json.tmp"), "DRAFT");
  EXPECT_EQ(slurp(victim), "VICTIM");
  EXPECT_EQ(fs::symlink_status(tmps + "/demo_train.bin").type(), fs::file_type::regular);
  // A demo running in the work directory (its lock held): another is refused before it writes
  // anything there (it used to rewrite the running demo's ds_config.json first).
  const std::string config_before = slurp(tmps + "/ds_config.json");
  {
    const LockFile running(tmps + "/.demo.lock", "a demo", "outcore demo lock\n");
    r = run("demo --steps 3 --bf16 --work-dir " + shell_quote(tmps));
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_NE(r.err.find("another demo is running in it"), std::string::npos) << r.err;
  }
  EXPECT_EQ(slurp(tmps + "/ds_config.json"), config_before);
  EXPECT_FALSE(fs::exists(tmps + "/.demo.lock"));
  // In a directory the demo used, a file the user changed or put at one of its names since is
  // kept, refused before anything is written; the demo's own files it replaces (with another
  // --steps, its ds_config.json differs).
  r = run("demo --steps 2 --work-dir " + shell_quote(tmps));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string ds_config_of_2 = slurp(tmps + "/ds_config.json");
  EXPECT_NE(ds_config_of_2, config_before);
  std::ofstream(tmps + "/config.json") << "MY OWN CONFIG";
  const std::string train_before = slurp(tmps + "/demo_train.bin");
  r = run("demo --steps 1 --work-dir " + shell_quote(tmps));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("holds config.json, changed since the demo wrote it"), std::string::npos)
      << r.err;
  EXPECT_EQ(slurp(tmps + "/config.json"), "MY OWN CONFIG");
  EXPECT_EQ(slurp(tmps + "/ds_config.json"), ds_config_of_2);
  EXPECT_EQ(slurp(tmps + "/demo_train.bin"), train_before);
  // A work directory of an earlier version (its marker's first line alone): its files are the
  // demo's, recorded by the next demo before it writes any, and from then on checked.
  fs::remove(tmps + "/config.json");
  std::ofstream(tmps + "/.outcore-demo") << "outcore demo work directory\n";
  r = run("demo --steps 1 --work-dir " + shell_quote(tmps));
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const char* name : {"config.json", "ds_config.json", "demo_train.bin", "demo_val.bin"})
    EXPECT_NE(slurp(tmps + "/.outcore-demo").find(std::string("file ") + name + " "),
              std::string::npos)
        << slurp(tmps + "/.outcore-demo");
  // Anything but a regular file at the marker's name is not the demo's marker.
  fs::rename(tmps + "/.outcore-demo", tmps + "/marker.keep");
  fs::create_directory(tmps + "/.outcore-demo");
  r = run("demo --steps 1 --work-dir " + shell_quote(tmps));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("holds .outcore-demo, which is not the demo's marker"), std::string::npos)
      << r.err;
  fs::remove(tmps + "/.outcore-demo");
  fs::rename(tmps + "/marker.keep", tmps + "/.outcore-demo");
  std::ofstream(tmps + "/demo_val.bin", std::ios::app) << "x";
  r = run("demo --steps 1 --work-dir " + shell_quote(tmps));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("holds demo_val.bin, changed since the demo wrote it"), std::string::npos)
      << r.err;
}

// Every model tensor of the tiny model, by Hugging Face name, with its unit's slab offset.
std::vector<std::pair<int, model::TensorSpec>> tiny_tensors() {
  std::vector<std::pair<int, model::TensorSpec>> out;
  for (const model::UnitLayout& u : model::make_layout(testing::tiny_model()).units)
    for (const model::TensorSpec& t : u.tensors) out.emplace_back(u.index, t);
  return out;
}

// Checks every tensor of the Hugging Face directory `hf` against the master weights of the
// checkpoint `ck`, rounded to `dtype` (exact for fp32), and that each is stored as `dtype`.
void expect_exported_master(const std::string& hf, const std::string& ck, DType dtype) {
  const ckpt::Checkpoint c = ckpt::Checkpoint::open(ck);
  const ckpt::HfWeights w = ckpt::HfWeights::open(hf, testing::tiny_model());
  for (const auto& [unit, t] : tiny_tensors()) {
    ASSERT_NE(w.entry(t.name), nullptr) << t.name;
    EXPECT_EQ(w.entry(t.name)->dtype, dtype) << t.name;
    std::vector<float> want(t.numel), got(t.numel);
    c.read_slab(unit, ckpt::ArrayKind::kMaster, t.offset, t.numel,
                std::as_writable_bytes(std::span(want)));
    w.read_unit_range(w.layout().units[unit], t.offset, t.numel, got.data());
    for (size_t i = 0; i < t.numel; ++i) {
      ASSERT_EQ(got[i], round_to(dtype, want[i])) << t.name << " element " << i;
    }
  }
}

// Train and save, export (fp32, the run's dtype), and start a new run from the export: the new
// run's first loss is that of the trained weights, not of a random start.
TEST_F(TrainCliTest, ExportedCheckpointStartsANewRunFromTheTrainedWeights) {
  const std::string ck = data_.file("ckpt"), hf = data_.file("hf");
  const std::string fresh = data_.file("fresh.jsonl"), init = data_.file("init.jsonl");
  CliResult r = run(
      train_args("--steps 3 --save-dir " + shell_quote(ck) + " --metrics " + shell_quote(fresh)));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run("export --checkpoint " + shell_quote(ck) + " --out " + shell_quote(hf));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("exported global_step3 (step 3"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::is_regular_file(hf + "/config.json"));
  EXPECT_TRUE(std::filesystem::is_regular_file(hf + "/model.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(hf + "/model.safetensors.index.json"));
  EXPECT_EQ(model::LlamaConfig::load(hf + "/config.json").to_json(),
            testing::tiny_model().to_json());
  expect_exported_master(hf, ck, DType::F32);

  // Keys of the model's config.json outcore does not act on travel with it, through the new
  // run's checkpoint to its export.
  nlohmann::json hf_config = nlohmann::json::parse(slurp(hf + "/config.json"));
  hf_config["eos_token_id"] = nlohmann::json::array({5, 6});
  std::ofstream(hf + "/config.json") << hf_config.dump();
  const std::string ck2 = data_.file("ckpt2"), hf2 = data_.file("hf2");
  r = run("train --init-from " + shell_quote(hf) + " --config " + shell_quote(config_) +
          " --data " + shell_quote(data_.train()) + " --seq-len 32 --steps 1 --metrics " +
          shell_quote(init) + " --save-dir " + shell_quote(ck2));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("init       weights from " + hf), std::string::npos) << r.out;
  r = run("export " + shell_quote(ck2) + " " + shell_quote(hf2));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(slurp(hf2 + "/config.json"))["eos_token_id"],
            nlohmann::json::array({5, 6}));
  const std::vector<nlohmann::json> a = step_records(fresh), b = step_records(init);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 1u);
  // Same seed, so the same first batch: only the starting weights differ.
  EXPECT_LT(b[0]["loss"].get<double>(), a[0]["loss"].get<double>() - 0.05);

  // The same first step in-process, the checkpoint's master weights put into a fresh engine by
  // hand (not through the import under test): the same loss, bit for bit.
  TrainerOptions o;
  o.train_data = data_.train();
  o.steps = 1;
  o.seq_len = 32;
  o.progress_out = nullptr;  // seed and CPU threads: outcore train's defaults
  Trainer tr(testing::make_config({}, testing::tiny_model()), testing::tiny_model(), o);
  const ckpt::Checkpoint c = ckpt::Checkpoint::open(ck);
  for (const model::UnitLayout& ul : tr.model().layout().units) {
    const size_t n = tr.engine().partition_numel(ul.index);  // the whole slab at world size 1
    std::vector<float> master(n), zeros(n);
    c.read_slab(ul.index, ckpt::ArrayKind::kMaster, 0, n,
                std::as_writable_bytes(std::span(master)));
    tr.engine().write_unit_state(ul.index, master, zeros, zeros);
  }
  EXPECT_EQ(b[0]["loss"].get<double>(), tr.train_step().loss);
}

// --dtype bf16 with a small --max-shard-size: shards and an index listing every tensor once,
// each tensor bf16 and equal to the rounded master weights.
TEST_F(TrainCliTest, ExportBf16ShardedListsEveryTensorOnce) {
  const std::string ck = data_.file("ckpt"), hf = data_.file("hf");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run("export --checkpoint " + shell_quote(ck) + " --out " + shell_quote(hf) +
          " --dtype bf16 --max-shard-size 40KB");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_FALSE(std::filesystem::exists(hf + "/model.safetensors"));
  EXPECT_EQ(nlohmann::json::parse(slurp(hf + "/config.json"))["torch_dtype"], "bfloat16");
  ASSERT_TRUE(std::filesystem::is_regular_file(hf + "/model.safetensors.index.json"));
  const nlohmann::json index = nlohmann::json::parse(slurp(hf + "/model.safetensors.index.json"));
  std::set<std::string> expected, shards;
  for (const auto& [unit, t] : tiny_tensors()) expected.insert(t.name);
  uint64_t total = 0;
  size_t listed = 0;
  for (const auto& [name, file] : index["weight_map"].items()) {
    ++listed;
    EXPECT_TRUE(expected.contains(name)) << name << " is not a model tensor";
    shards.insert(file.get<std::string>());
    const ckpt::SafetensorsFile f = ckpt::SafetensorsFile::open(hf + "/" + file.get<std::string>());
    const ckpt::SafetensorsEntry* e = f.find(name);
    ASSERT_NE(e, nullptr) << name << " not in " << file;
    EXPECT_EQ(e->dtype, DType::BF16) << name;
    total += e->bytes;
  }
  EXPECT_EQ(listed, expected.size()) << "a tensor listed twice or missing";
  EXPECT_GT(shards.size(), 2u);
  for (const std::string& s : shards) {
    size_t held = ckpt::SafetensorsFile::open(hf + "/" + s).tensors().size();
    for (const auto& [name, file] : index["weight_map"].items()) held -= file == s;
    EXPECT_EQ(held, 0u) << s << " holds tensors the index does not map to it";
  }
  EXPECT_EQ(total, testing::tiny_model().num_parameters() * 2);
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  expect_exported_master(hf, ck, DType::BF16);
}

// Bad input exits 2 with one error line naming the path, and writes nothing.
TEST_F(TrainCliTest, ExportOfABadCheckpointOrIntoAFullDirectoryExitsTwo) {
  const std::string ck = data_.file("ckpt"), hf = data_.file("hf");
  const std::string nowhere = data_.file("no_such_checkpoint");
  CliResult r = run("export --checkpoint " + shell_quote(nowhere) + " --out " + shell_quote(hf));
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(nowhere), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(hf));

  r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string full = data_.file("full");
  std::filesystem::create_directories(full);
  std::ofstream(full + "/keep.txt") << "x";
  r = run("export --checkpoint " + shell_quote(ck) + " --out " + shell_quote(full));
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find(full), std::string::npos) << r.err;
  EXPECT_EQ(slurp(full + "/keep.txt"), "x");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(full), {}), 1);

  // The output given both ways, and sizes that are not one: said plainly, nothing written.
  r = run("export " + shell_quote(ck) + " " + shell_quote(hf) + " --out " + shell_quote(hf + "2"));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("given twice: the argument out and --out are one option"), std::string::npos)
      << r.err;
  for (const char* size : {"1.5GB", "2PB", "0"}) {
    r = run("export " + shell_quote(ck) + " " + shell_quote(hf) + " --max-shard-size " + size);
    EXPECT_EQ(r.rc, 2) << size;
    EXPECT_NE(r.err.find("a whole number above 0 of bytes, or of B, KB, MB, GB, TB"),
              std::string::npos)
        << r.err;
  }
  EXPECT_FALSE(std::filesystem::exists(hf));

  // An output under a file, or under a link to nowhere: bad input, named, nothing written.
  const std::string a_file = data_.file("a_file"), dangling = data_.file("dangling");
  std::ofstream(a_file) << "mine";
  std::filesystem::create_symlink(data_.file("nowhere"), dangling);
  for (const std::string& out : {a_file + "/hf", dangling + "/hf"}) {
    r = run("export --checkpoint " + shell_quote(ck) + " --out " + shell_quote(out));
    EXPECT_EQ(r.rc, 2) << out << ": " << r.err;
    EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("a part of its path is a file"), std::string::npos) << r.err;
  }
  EXPECT_EQ(slurp(a_file), "mine");
  EXPECT_FALSE(std::filesystem::exists(data_.file("nowhere")));

  const std::string file = ck + "/global_step1/rank0/optimizer.bin";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    char c = 0;
    f.seekg(5000);
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(5000);
    f.write(&c, 1);
    ASSERT_TRUE(f.good()) << file;
  }
  r = run("export --checkpoint " + shell_quote(ck) + " --out " + shell_quote(hf));
  EXPECT_EQ(r.rc, 2);
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("rank0/optimizer.bin"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("CRC32C mismatch"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(hf));

  // A FIFO or a directory in the place of a checkpoint's file: named, exit 2, never waited on.
  for (const bool fifo : {true, false}) {
    std::filesystem::remove(file);
    if (fifo)
      ASSERT_EQ(::mkfifo(file.c_str(), 0644), 0);
    else
      std::filesystem::create_directory(file);
    r = run("export --checkpoint " + shell_quote(ck) + " --out " + shell_quote(hf));
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("rank0/optimizer.bin: not a regular file"), std::string::npos) << r.err;
    std::filesystem::remove(file);
  }
  // An output whose temporary's name would be too long: the reason named, nothing written.
  const std::string good = data_.file("ckpt_good"), long_name = data_.file(std::string(250, 'n'));
  r = run(train_args("--steps 1 --save-dir " + shell_quote(good)));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = run("export --checkpoint " + shell_quote(good) + " --out " + shell_quote(long_name));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("a name of 250 bytes, and outcore writes it through names up to 12 bytes "
                       "longer"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(long_name));

  // A checkpoint path with a name too long for the filesystem, given or in `latest`: bad input
  // (exit 2), the path and the reason named, for export and for a resume alike.
  std::ofstream(good + "/latest", std::ios::trunc) << std::string(300, 'a');
  for (const std::string& ck_path : {good, good + "/" + std::string(300, 'b')}) {
    for (const std::string& cmd : {"export " + shell_quote(ck_path) + " " + shell_quote(hf),
                                   train_args("--steps 2 --resume " + shell_quote(ck_path))}) {
      r = run(cmd);
      EXPECT_EQ(r.rc, 2) << cmd << ": " << r.err;
      EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
      EXPECT_NE(r.err.find("File name too long"), std::string::npos) << r.err;
      EXPECT_NE(r.err.find(std::string(255, ck_path == good ? 'a' : 'b')), std::string::npos)
          << r.err;
    }
  }
  EXPECT_FALSE(std::filesystem::exists(hf));
}

// `export CKPT .` replaces the working directory: the summary counts what it wrote there.
TEST_F(TrainCliTest, ExportIntoTheWorkingDirectoryCountsItsFiles) {
  const std::string ck = data_.file("ckpt"), here = data_.file("here");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  std::filesystem::create_directories(here);
  const std::string out = data_.file("stdout");
  const int status =
      std::system(("cd " + shell_quote(here) + " && " + shell_quote(OUTCORE_CLI) + " export " +
                   shell_quote(ck) + " . >" + shell_quote(out) + " 2>/dev/null")
                      .c_str());
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE(std::filesystem::exists(here + "/model.safetensors"));
  EXPECT_EQ(slurp(out).find(": 0 files"), std::string::npos) << slurp(out);
  EXPECT_NE(slurp(out).find(": 2 files"), std::string::npos) << slurp(out);
}

// Sets element `elem` of tensor `name` in the fp32 master weights of the checkpoint `ck` to
// `value`, and that file's CRC32C in the manifest to match, so the checkpoint still verifies.
void set_master_element(const std::string& ck, const std::string& name, uint64_t elem,
                        float value) {
  int unit = -1;
  uint64_t at = 0;
  for (const auto& [u, t] : tiny_tensors())
    if (t.name == name) unit = u, at = t.offset + elem;
  ASSERT_GE(unit, 0) << name;
  std::filesystem::path dir;
  ckpt::Manifest m;
  {
    const ckpt::Checkpoint c = ckpt::Checkpoint::open(ck);
    dir = c.dir();
    m = c.manifest();
  }
  for (ckpt::FileInfo& f : m.files) {
    for (const ckpt::Segment& s : f.segments) {
      if (s.unit != unit || s.array != ckpt::ArrayKind::kMaster || at < s.slab_begin ||
          at >= s.slab_begin + s.count)
        continue;
      const std::string path = (dir / f.path).string();
      {
        std::fstream out(path, std::ios::in | std::ios::out | std::ios::binary);
        out.seekp(static_cast<std::streamoff>(s.offset + (at - s.slab_begin) * 4));
        out.write(reinterpret_cast<const char*>(&value), 4);
        ASSERT_TRUE(out.good()) << path;
      }
      const std::string bytes = slurp(path);
      f.crc32c = ckpt::crc32c(std::as_bytes(std::span(bytes.data(), bytes.size())));
      std::ofstream(dir / ckpt::kManifestName, std::ios::binary | std::ios::trunc)
          << ckpt::manifest_text(m);
      return;
    }
  }
  FAIL() << "no master segment of " << ck << " holds " << name;
}

// A master weight beyond fp16's range: `export --dtype fp16` exits 2 with one error naming the
// tensor, the value and the dtypes that hold it, and leaves neither the directory nor its
// temporary; --dtype bf16 exports it.
TEST_F(TrainCliTest, ExportAsFp16OfAWeightBeyondItsRangeExitsTwoAndWritesNothing) {
  const std::string ck = data_.file("ckpt"), hf = data_.file("hf");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  const std::string name = "model.layers.0.mlp.down_proj.weight";
  set_master_element(ck, name, 7, 1e5f);
  r = run("export --checkpoint " + shell_quote(ck) + " --out " + shell_quote(hf) + " --dtype fp16");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("\"" + name + "\""), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("100000"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--dtype bf16"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(hf));
  const std::filesystem::path parent = std::filesystem::path(hf).parent_path();
  for (const auto& e : std::filesystem::directory_iterator(parent))
    EXPECT_FALSE(e.path().filename().string().starts_with("hf.")) << e.path() << " left behind";

  r = run("export --checkpoint " + shell_quote(ck) + " --out " + shell_quote(hf) + " --dtype bf16");
  ASSERT_EQ(r.rc, 0) << r.err;
  expect_exported_master(hf, ck, DType::BF16);
}

// A NaN among the --init-from weights: exit 2 before training, one error naming the tensor, the
// file and the element, not a NaN loss at step 1.
TEST_F(TrainCliTest, InitFromANonFiniteWeightExitsTwoNamingTensorAndFile) {
  const std::string hf = data_.file("hf_nan");
  std::filesystem::create_directories(hf);
  std::ofstream(hf + "/config.json") << testing::tiny_model_json().dump();
  const std::string name = "model.layers.1.self_attn.o_proj.weight";
  std::vector<ckpt::SafetensorsTensor> decl;
  uint64_t numel = 0, bad = 0;
  for (const auto& [unit, t] : tiny_tensors()) {
    decl.push_back({t.name, DType::F32, t.shape});
    if (t.name == name) bad = numel + 3;
    numel += t.numel;
  }
  std::vector<float> vals(numel, 0.02f);
  vals[bad] = std::numeric_limits<float>::quiet_NaN();
  {
    ckpt::SafetensorsWriter w(hf + "/model.safetensors", decl);
    w.append(std::as_bytes(std::span(vals)));
    w.close();
  }
  CliResult r = run("train --init-from " + shell_quote(hf) + " --config " + shell_quote(config_) +
                    " --data " + shell_quote(data_.train()) + " --seq-len 32 --steps 1");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("\"" + name + "\""), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(hf + "/model.safetensors"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("element 3 "), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("loss"), std::string::npos) << r.err;
}

// Runs `outcore_with_test_hooks export CK HF` in a child process with
// OUTCORE_TEST_EXPORT_PIECE_DELAY_MS=`delay_ms` (a sleep before each piece is read, after the
// check for a stop) and --max-shard-size 40KB (many shards, the first ones complete early);
// stderr goes to `err`.
pid_t start_slow_export(const std::string& ck, const std::string& hf, const std::string& err,
                        int delay_ms, const std::string& piece_log = "") {
  const std::string delay = "OUTCORE_TEST_EXPORT_PIECE_DELAY_MS=" + std::to_string(delay_ms);
  const std::string log = "OUTCORE_TEST_EXPORT_PIECE_LOG=" + piece_log;
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, STDERR_FILENO);
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, STDOUT_FILENO);
    putenv(const_cast<char*>(delay.c_str()));
    if (!piece_log.empty()) putenv(const_cast<char*>(log.c_str()));
    execl(OUTCORE_CLI_WITH_TEST_HOOKS, OUTCORE_CLI_WITH_TEST_HOOKS, "export", ck.c_str(),
          hf.c_str(), "--max-shard-size", "40KB", static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// Waits (at most 60 s) until the export `pid` has written a line to `piece_log` beyond the
// `seen` it held: the export has passed a check for a stop and sleeps. False if it ended.
bool wait_for_a_piece_after(const std::string& piece_log, size_t seen, pid_t pid) {
  for (int i = 0; i < 6000; ++i) {
    if (lines_of(slurp(piece_log)).size() > seen) return true;
    if (waitpid(pid, nullptr, WNOHANG) != 0) return false;
    usleep(10000);
  }
  return false;
}

// Waits (at most 60 s) until `dir` holds a finished *.safetensors file: the export is writing.
bool wait_for_a_shard(const std::string& dir, pid_t pid) {
  for (int i = 0; i < 6000; ++i) {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec))
      if (e.path().extension() == ".safetensors") return true;
    if (waitpid(pid, nullptr, WNOHANG) != 0) return false;
    usleep(10000);
  }
  return false;
}

// Waits (at most 5 s) until `sig`, sent to process `pid`, is no longer pending there: its handler
// has been called. False if it stays pending.
bool wait_until_delivered(pid_t pid, int sig) {
  for (int i = 0; i < 5000; ++i) {
    if (!signal_pending(pid, sig)) return true;
    usleep(1000);
  }
  return false;
}

// Entries next to `hf` whose names start with its name: the directory or its temporaries.
std::vector<std::string> export_leftovers(const std::string& hf) {
  std::vector<std::string> out;
  const std::filesystem::path p(hf);
  for (const auto& e : std::filesystem::directory_iterator(p.parent_path()))
    if (e.path().filename().string().starts_with(p.filename().string()))
      out.push_back(e.path().string());
  return out;
}

// SIGTERM (and SIGINT, SIGHUP alike) while export writes shards: exit 130 with one line saying
// it stopped, and neither the directory nor its temporary is left.
TEST_F(TrainCliTest, ExportStoppedBySigtermLeavesNothingAndExits130) {
  const std::string ck = data_.file("ckpt"), hf = data_.file("hf"), err = data_.file("export.err");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
    // 200 ms per piece: the pieces after the first shard take seconds, so the signal arrives
    // before the export's last check however late a loaded machine runs this test.
    const pid_t pid = start_slow_export(ck, hf, err, 200);
    ASSERT_GT(pid, 0);
    const std::string tmp = hf + ".tmp-" + std::to_string(pid);
    const bool writing = wait_for_a_shard(tmp, pid);
    kill(pid, sig);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(writing) << "no shard appeared in " << tmp << ": " << slurp(err);
    ASSERT_TRUE(WIFEXITED(status)) << "signal " << sig << " killed export: status " << status;
    EXPECT_EQ(WEXITSTATUS(status), 130) << slurp(err);
    const std::vector<std::string> lines = lines_of(slurp(err));
    ASSERT_EQ(lines.size(), 1u) << slurp(err);
    EXPECT_EQ(lines[0].rfind("stopped: ", 0), 0u) << lines[0];
    EXPECT_NE(lines[0].find("nothing is left at " + hf), std::string::npos) << lines[0];
    EXPECT_EQ(export_leftovers(hf), std::vector<std::string>()) << "signal " << sig;
  }
}

// A signal while export or train still reads its inputs (here during the start delay of
// outcore_with_test_hooks, once early signals are caught) stops them as one later would: exit
// 130, one line saying so, nothing written (it ended the process by the signal: exit 143 for
// SIGTERM). A second one ends the process by it.
TEST_F(TrainCliTest, ASignalWhileTheInputsAreReadStopsWithExit130) {
  const std::string ck = data_.file("ckpt"), hf = data_.file("hf"), err = data_.file("early.err");
  const std::string started = data_.file("started"), ck2 = data_.file("ckpt2");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  // `args` under outcore_with_test_hooks with a 3 s start delay; its status once `signals` were
  // sent after the start line appeared.
  auto signalled = [&](const std::string& args, std::initializer_list<int> signals) {
    std::filesystem::remove(started);
    const std::string cmd =
        "exec env -u OUTCORE_CONFIG OUTCORE_TEST_START_DELAY_MS=3000 "
        "OUTCORE_TEST_START_LOG=" +
        shell_quote(started) + " " + shell_quote(OUTCORE_CLI_WITH_TEST_HOOKS) + " " + args +
        " >/dev/null 2>" + shell_quote(err);
    const pid_t pid = fork();
    if (pid == 0) {
      execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    bool up = false;
    for (int i = 0; i < 6000 && !up; ++i) {
      up = slurp(started) == "started\n";
      if (!up) usleep(10000);
    }
    size_t sent = 0;
    for (int sig : signals) {
      kill(pid, sig);
      if (++sent < signals.size()) {
        EXPECT_TRUE(wait_until_delivered(pid, sig)) << sig;
        usleep(400'000);  // past the time in which a repeat is the same press
      }
    }
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(up) << "never started: " << slurp(err);
    return status;
  };
  int status = signalled("export " + shell_quote(ck) + " " + shell_quote(hf), {SIGTERM});
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status << ": " << slurp(err);
  EXPECT_EQ(WEXITSTATUS(status), 130) << slurp(err);
  EXPECT_EQ(lines_of(slurp(err)).size(), 1u) << slurp(err);
  EXPECT_EQ(export_leftovers(hf), std::vector<std::string>());
  status = signalled(train_args("--steps 3 --save-dir " + shell_quote(ck2)), {SIGHUP});
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status << ": " << slurp(err);
  EXPECT_EQ(WEXITSTATUS(status), 130) << slurp(err);
  EXPECT_NE(slurp(err).find("stopping"), std::string::npos) << slurp(err);
  // Stopped before its first step: no step trained, no checkpoint of one saved.
  if (std::filesystem::is_directory(ck2)) {
    for (const auto& e : std::filesystem::directory_iterator(ck2)) {
      EXPECT_FALSE(e.path().filename().string().starts_with("global_step")) << e.path();
    }
  }
  EXPECT_NE(slurp(err).find("nothing was trained"), std::string::npos) << slurp(err);
  status = signalled("export " + shell_quote(ck) + " " + shell_quote(hf), {SIGINT, SIGINT});
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << "status " << status;
  EXPECT_EQ(export_leftovers(hf), std::vector<std::string>());
}

// A second signal ends the export at once, its temporary directory removed (registered for
// cleanup); one left by an export killed outright (SIGKILL) is removed by the next export into
// the same directory (its pid runs no more and it holds only export files), but not one that
// holds other files or whose pid still runs.
TEST_F(TrainCliTest, ExportRemovesTheTemporaryOfAKilledExportOnly) {
  const std::string ck = data_.file("ckpt"), hf = data_.file("hf"), err = data_.file("export.err");
  CliResult r = run(train_args("--steps 1 --save-dir " + shell_quote(ck)));
  ASSERT_EQ(r.rc, 0) << r.err;
  // Each piece sleeps 4 s after the stop check. Both signals are sent once a shard is written
  // and the export has logged a piece after that: during that piece's sleep, before the next
  // check. (A signal sent when the shard appeared could reach the export before the check that
  // follows the shard, under load, and the export removed its temporary before the second.)
  const std::string piece_log = data_.file("pieces");
  const pid_t pid = start_slow_export(ck, hf, err, 4000, piece_log);
  ASSERT_GT(pid, 0);
  const std::string killed = hf + ".tmp-" + std::to_string(pid);
  const bool writing = wait_for_a_shard(killed, pid) &&
                       wait_for_a_piece_after(piece_log, lines_of(slurp(piece_log)).size(), pid);
  kill(pid, SIGINT);
  const bool taken = wait_until_delivered(pid, SIGINT);
  usleep(400'000);  // past the time in which a repeat is the same press
  kill(pid, SIGINT);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(writing) << slurp(err);
  ASSERT_TRUE(taken) << "the first SIGINT stayed pending";
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << "status " << status;
  EXPECT_FALSE(std::filesystem::exists(killed)) << "the second signal left the temporary";

  // Killed outright, an export leaves its temporary.
  const pid_t pid9 = start_slow_export(ck, hf, err, 4000, piece_log);
  ASSERT_GT(pid9, 0);
  const std::string killed9 = hf + ".tmp-" + std::to_string(pid9);
  ASSERT_TRUE(wait_for_a_shard(killed9, pid9)) << slurp(err);
  kill(pid9, SIGKILL);
  waitpid(pid9, &status, 0);
  ASSERT_TRUE(std::filesystem::is_directory(killed9));

  // A dead pid's directory holding a file export does not write, and a live pid's (this test's).
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  waitpid(dead, nullptr, 0);
  const std::string foreign = hf + ".tmp-" + std::to_string(dead);
  const std::string live = hf + ".tmp-" + std::to_string(getpid());
  for (const std::string& d : {foreign, live}) {
    std::filesystem::create_directories(d);
    std::ofstream(d + "/config.json") << "{}";
  }
  std::ofstream(foreign + "/notes.txt") << "mine";
  // And a dead pid's directory holding only what an export writes, but not its marker: a
  // user's model, kept.
  const pid_t dead2 = fork();
  if (dead2 == 0) _exit(0);
  waitpid(dead2, nullptr, 0);
  const std::string unmarked = hf + ".tmp-" + std::to_string(dead2);
  std::filesystem::create_directories(unmarked);
  std::ofstream(unmarked + "/config.json") << "{}";
  std::ofstream(unmarked + "/model.safetensors") << "weights";

  r = run("export " + shell_quote(ck) + " " + shell_quote(hf));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_FALSE(std::filesystem::exists(killed9));
  EXPECT_EQ(slurp(foreign + "/notes.txt"), "mine");
  EXPECT_EQ(slurp(unmarked + "/model.safetensors"), "weights");
  EXPECT_TRUE(std::filesystem::exists(live + "/config.json"));
  EXPECT_NE(r.err.find("warning: " + foreign), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("warning: " + unmarked), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(live), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(hf + "/" + ckpt::kExportScratchMarker));
  expect_exported_master(hf, ck, DType::F32);

  // A directory of the user's at the export's own temporary name (its pid, which `exec` keeps)
  // is refused, never emptied.
  const std::string other = data_.file("hf_other");
  const int refused = std::system(("sh -c 'mkdir " + other + ".tmp-$$ && echo THESIS > " + other +
                                   ".tmp-$$/thesis.txt && exec " + OUTCORE_CLI + " export " +
                                   shell_quote(ck) + " " + other + " 2>/dev/null'")
                                      .c_str());
  EXPECT_TRUE(WIFEXITED(refused) && WEXITSTATUS(refused) == 2) << refused;
  bool found = false;
  for (const auto& e : std::filesystem::directory_iterator(data_.file("")))
    if (e.path().filename().string().starts_with("hf_other.tmp-")) {
      found = true;
      EXPECT_EQ(slurp((e.path() / "thesis.txt").string()), "THESIS\n");
    }
  EXPECT_TRUE(found);
  EXPECT_FALSE(std::filesystem::exists(other));
}

// offload_param.buffer_count 1000000 passed `outcore config` and ended `outcore train` in
// std::bad_alloc. Now the config refuses it naming the key; and a count within bounds whose
// fetch buffers the machine cannot hold is refused by the plan (estimate and train), naming
// the key, before anything is allocated.
TEST_F(TrainCliTest, HugeBufferCountsAreRefusedNamingTheKey) {
  const std::string swap = data_.file("swap");
  nlohmann::json patch = testing::nvme_patch(swap);
  patch["zero_optimization"]["offload_param"]["buffer_count"] = 1000000;
  config_ = write_config("huge_count.json", patch);
  for (const std::string& cmd :
       {train_args("--steps 1"), "estimate --config " + shell_quote(config_) + " --model " +
                                     shell_quote(model_) + " --seq-len 32"}) {
    CliResult r = run(cmd);
    EXPECT_EQ(r.rc, 2) << cmd << ": " << r.err;
    EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("zero_optimization.offload_param.buffer_count: got 1000000"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(r.err.find("bad_alloc"), std::string::npos) << r.err;
  }

  // 4096 fetch buffers of a 256 MiB embedding partition: 1 TiB of pinned host memory.
  nlohmann::json big = testing::tiny_model_json();
  big["hidden_size"] = 2048;
  big["intermediate_size"] = 64;
  big["num_hidden_layers"] = 1;
  big["num_attention_heads"] = 16;
  big["num_key_value_heads"] = 16;
  big["vocab_size"] = 32768;
  std::ofstream(model_) << big.dump();
  patch["zero_optimization"]["offload_param"]["buffer_count"] = 4096;
  patch["zero_optimization"]["offload_param"]["buffer_size"] = 100000000;
  patch["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
  config_ = write_config("big_count.json", patch);
  for (const std::string& cmd : {"estimate --config " + shell_quote(config_) + " --model " +
                                     shell_quote(model_) + " --seq-len 32",
                                 train_args("--steps 1")}) {
    CliResult r = run(cmd);
    EXPECT_EQ(r.rc, 2) << cmd << ": " << r.err;
    EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("host: "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("the largest part, parameter fetch buffers (4096 x "), std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("is set by zero_optimization.offload_param.buffer_count"),
              std::string::npos)
        << r.err;
  }
  EXPECT_EQ(testing::count_files(swap), 0);
}

// A world size of 2^32 + 2 was planned as world size 2. Every integer flag of estimate is read
// as 64 bits and refused outside its range, naming the flag.
TEST_F(TrainCliTest, EstimateRefusesIntegersOutsideTheirRangeNamingTheFlag) {
  const std::string base =
      "estimate --config " + shell_quote(config_) + " --model " + shell_quote(model_);
  for (const std::string bad :
       {"--world-size 4294967298", "--world-size 18446744073709551618", "--world-size 1048577",
        "--world-size 0", "--micro-batch 4294967298", "--micro-batch 0", "--seq-len 4294967298",
        "--seq-len 129"}) {
    CliResult r = run(base + " " + bad);
    EXPECT_EQ(r.rc, 2) << bad << ": " << r.out << r.err;
    EXPECT_EQ(count_error_lines(r.err), 1) << bad << ": " << r.err;
    const std::string flag = bad.substr(0, bad.find(' ')), value = bad.substr(bad.find(' ') + 1);
    EXPECT_NE(r.err.find("error: " + flag + ": got"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(value), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("world size"), std::string::npos) << bad << ": planned anyway\n" << r.out;
  }
  // The largest world is planned (its padding may then not fit this machine's memory: the
  // simulated device's units padded for a million ranks are host memory here).
  CliResult most = run(base + " --world-size 1048576 --seq-len 32");
  EXPECT_TRUE(most.rc == 0 || most.err.starts_with("error: does not fit: ")) << most.err;
  EXPECT_NE(most.out.find("world size 1048576,"), std::string::npos) << most.out;
  // The ranks' traffic has no measured rate: the step bounds say they leave it out.
  CliResult two = run(base + " --world-size 2");
  ASSERT_EQ(two.rc, 0) << two.err;
  EXPECT_NE(two.out.find("network  not counted"), std::string::npos) << two.out;
}

bool have_mpirun() { return std::system("command -v mpirun >/dev/null 2>&1") == 0; }

// README: "checkpoints saved at one world size resume at another". A checkpoint of 2 ranks
// (micro 4 x gas 1 x world 2 = 8) resumed by one rank with the checkpoint's config keeps
// train_batch_size and the micro batch and takes gas 2, saying so in one line: the same global
// batch, so the steps equal those of one rank with gas 2 from the start. Where gas cannot be
// recomputed (3 ranks), and where --config does not fit the world size, the error names the
// file, the values and the way out; --gradient-accumulation-steps is that way out.
TEST_F(TrainCliTest, CheckpointOfTwoRanksResumesOnOne) {
  if (!have_mpirun()) GTEST_SKIP() << "mpirun not found";
  auto mpirun = [&](int np, const std::string& args) {
    const std::string out = data_.file("mpi_stdout"), err = data_.file("mpi_stderr");
    const std::string cmd =
        "env -u OUTCORE_CONFIG timeout 300 mpirun --allow-run-as-root --oversubscribe --bind-to "
        "none -np " +
        std::to_string(np) + " " + shell_quote(OUTCORE_CLI) + " " + args + " >" + shell_quote(out) +
        " 2>" + shell_quote(err);
    const int status = std::system(cmd.c_str());
    return CliResult{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out), slurp(err)};
  };
  const std::string ck = data_.file("ckpt"), resumed = data_.file("resumed.jsonl");
  const std::string straight = data_.file("straight.jsonl");
  const std::string gas2 = write_config("gas2.json", {{"gradient_accumulation_steps", 2}});
  CliResult r = run("train --config " + shell_quote(gas2) + " --model " + shell_quote(model_) +
                    " --data " + shell_quote(data_.train()) + " --seq-len 32 --steps 4 --metrics " +
                    shell_quote(straight));
  ASSERT_EQ(r.rc, 0) << r.err;
  r = mpirun(2, train_args("--steps 2 --save-dir " + shell_quote(ck) + " --metrics " +
                           shell_quote(resumed)));
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("micro 4 x gas 1 x world 2"), std::string::npos) << r.out;

  const std::string keep = data_.file("keep");  // the 2-rank checkpoint, for the cases below
  std::filesystem::copy(ck, keep, std::filesystem::copy_options::recursive);
  r = run("train --resume " + shell_quote(ck) + " --save-dir " + shell_quote(ck) +
          " --steps 4 --metrics " + shell_quote(resumed));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("micro 4 x gas 2 x world 1"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("ds_config.json: saved as train_batch_size 8 = micro 4 x gas 1 x world 2; "
                       "at world size 1 gradient_accumulation_steps is 2"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("different batch"), std::string::npos) << r.err;
  expect_same_steps(step_records(straight), step_records(resumed));

  r = mpirun(3, "train --resume " + shell_quote(keep) + " --steps 4");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find(keep + "/global_step2/ds_config.json: train_batch_size: saved as "
                              "train_batch_size 8 = micro 4 x gas 1 x world 2; at world size 3"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("--config FILE"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--gradient-accumulation-steps"), std::string::npos) << r.err;

  const std::string fixed =
      write_config("world2.json", {{"train_batch_size", 8}, {"gradient_accumulation_steps", 1}});
  r = run("train --resume " + shell_quote(keep) + " --config " + shell_quote(fixed) + " --steps 4");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(count_error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("error: " + fixed +
                       ": train_batch_size: train_batch_size 8 != micro 4 x "
                       "gas 1 x world 1 = 4"),
            std::string::npos)
      << r.err;

  r = run("train --resume " + shell_quote(keep) + " --steps 3 --gradient-accumulation-steps 1");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("micro 4 x gas 1 x world 1"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace outcore::train
