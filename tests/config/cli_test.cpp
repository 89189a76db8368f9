// The `outcore config` command, run as a user would: exit 0 with JSON on stdout, or exit 2
// with every error on stderr.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/config/config_test_util.hpp"

namespace outcore::config {
namespace {

namespace fs = std::filesystem;
using testing::source_path;

// `s` in single quotes for the shell (test paths hold no quotes).
std::string shell_quote(const std::string& s) {
  std::string q(1, '\'');
  q.append(s).push_back('\'');
  return q;
}

struct CliResult {
  int rc = -1;
  std::string out, err;
};

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "outcore_cli_XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }

  static std::string slurp(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  // Runs `outcore config <args>` with OUTCORE_CONFIG set to `env_config` (unset if empty).
  CliResult run(const std::string& args, const std::string& env_config = "") {
    return run_with("", args, env_config);
  }

  // Runs it with 4 GiB of address space and 60 s at most: input that used to exhaust memory
  // or never end fails the test (exit 1 or 124) instead of taking the machine down.
  CliResult run_bounded(const std::string& args) {
    return run_with("ulimit -v 4194304; timeout 60 ", args, "");
  }

  CliResult run_with(const std::string& prefix, const std::string& args,
                     const std::string& env_config) {
    std::string cmd =
        prefix + (env_config.empty() ? "env -u OUTCORE_CONFIG" : "env OUTCORE_CONFIG=");
    cmd.append(env_config.empty() ? "" : shell_quote(env_config)).append(" ");
    cmd.append(shell_quote(OUTCORE_CLI)).append(" config ").append(args);
    cmd.append(" >").append(shell_quote((dir_ / "out").string()));
    cmd.append(" 2>").append(shell_quote((dir_ / "err").string()));
    int status = std::system(cmd.c_str());
    CliResult r;
    r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(dir_ / "out");
    r.err = slurp(dir_ / "err");
    return r;
  }

  fs::path dir_;
};

TEST_F(CliTest, EveryExampleExitsZeroAndPrintsItsResolvedJson) {
  for (const char* name : {"zero2_cpu_offload", "zero3_cpu_offload", "zero3_nvme_infinity"}) {
    CliResult r = run(shell_quote(source_path(std::string("configs/") + name + ".json")));
    ASSERT_EQ(r.rc, 0) << name << "\n" << r.err;
    auto printed = nlohmann::ordered_json::parse(r.out);
    auto golden = nlohmann::ordered_json::parse(
        slurp(source_path(std::string("tests/config/golden/") + name + ".json")));
    // A schedule's total_num_steps "auto" stays "auto" here (the run's --steps sets it); the
    // golden files hold it resolved for 1000 steps.
    auto& params = golden["scheduler"]["params"];
    if (params.contains("total_num_steps") &&
        printed["scheduler"]["params"]["total_num_steps"] == "auto") {
      params["total_num_steps"] = "auto";
      EXPECT_NE(r.err.find("scheduler.params.total_num_steps is still \"auto\""), std::string::npos)
          << r.err;
    }
    EXPECT_EQ(printed, golden) << name;
  }
}

// Results that cannot be written (a full disk under stdout) fail the command.
TEST_F(CliTest, AResultThatCannotBeWrittenIsAFailure) {
  const std::string file = shell_quote(source_path("configs/zero3_nvme_infinity.json"));
  const std::string err = (dir_ / "err").string();
  const int status = std::system(
      (shell_quote(OUTCORE_CLI) + " config " + file + " >/dev/full 2>" + shell_quote(err)).c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  EXPECT_NE(slurp(err).find("writing the results to standard output failed"), std::string::npos)
      << slurp(err);
}

TEST_F(CliTest, BrokenFileExitsTwoWithEveryError) {
  std::string f = write("bad.json", R"({
    // two mistakes and a typo
    "zero_optimization": {"stage": 5, "offload_param": {"device": "nvme"}},
    "optimizer": {"type": "SGD"},
    "steps_per_prnt": 10
  })");
  CliResult r = run(shell_quote(f));
  EXPECT_EQ(r.rc, 2);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_NE(r.err.find("zero_optimization.stage: got 5"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("optimizer.type: got \"SGD\"; allowed: \"Adam\" or \"AdamW\""),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("steps_per_prnt: unknown key"), std::string::npos) << r.err;
}

TEST_F(CliTest, MalformedJsonExitsTwoWithLineAndColumn) {
  std::string f =
      write("malformed.json", "{\n  \"train_batch_size\": 8,\n  \"fp16\": {\"enabled\": tru}\n}\n");
  CliResult r = run(shell_quote(f));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("line 3, column 23"), std::string::npos) << r.err;
}

TEST_F(CliTest, MissingFileExitsTwo) {
  CliResult r = run(shell_quote((dir_ / "nope.json").string()));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("nope.json"), std::string::npos) << r.err;
}

TEST_F(CliTest, HundredThousandNestedBracketsExitTwoNamingTheLimit) {
  // Was: memory quadratic in depth, std::bad_alloc, exit 1.
  std::string f = write("deep.json", std::string(100000, '['));
  CliResult r = run_bounded(shell_quote(f));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("deep.json: objects and arrays nested deeper than 256 levels at line 1, "
                       "column 257"),
            std::string::npos)
      << r.err;
}

TEST_F(CliTest, NumericOverflowExitsTwoWithPathAndLine) {
  // Was: exit 1 with nlohmann's "[json.exception.out_of_range.406] number overflow ...".
  std::string f =
      write("overflow.json",
            "{\n  \"optimizer\": {\"type\": \"Adam\",\n    \"params\": {\"lr\": 1e400}}\n}\n");
  CliResult r = run(shell_quote(f));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find("overflow.json: optimizer.params.lr: numeric overflow at line 3, column 22"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("json.exception"), std::string::npos) << r.err;
  for (const char* bad : {"-1e400", "18446744073709551616", "-9223372036854775809"}) {
    std::string g = write("bad.json", std::string("{\"gradient_clipping\": ") + bad + "}");
    CliResult b = run(shell_quote(g));
    EXPECT_EQ(b.rc, 2) << bad << "\n" << b.err;
    EXPECT_NE(b.err.find("gradient_clipping: numeric overflow at line 1"), std::string::npos)
        << b.err;
  }
}

TEST_F(CliTest, EndlessOrSpecialFilesExitTwoNamingThePath) {
  // Was: /dev/zero read until memory ran out; a FIFO blocked for a writer.
  CliResult zero = run_bounded("/dev/zero");
  EXPECT_EQ(zero.rc, 2) << zero.err;
  EXPECT_NE(zero.err.find("/dev/zero: is a character device, not a regular file"),
            std::string::npos)
      << zero.err;

  std::string fifo = (dir_ / "pipe.json").string();
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  CliResult pipe = run_bounded(shell_quote(fifo));
  EXPECT_EQ(pipe.rc, 2) << pipe.err;
  EXPECT_NE(pipe.err.find("pipe.json: is a FIFO (named pipe), not a regular file"),
            std::string::npos)
      << pipe.err;

  CliResult dir = run_bounded(shell_quote(dir_.string()));
  EXPECT_EQ(dir.rc, 2) << dir.err;
  EXPECT_NE(dir.err.find("is a directory, not a regular file"), std::string::npos) << dir.err;

  // A regular file that never ends: pagemap reads on across the whole address space.
  struct stat st {};
  if (stat("/proc/self/pagemap", &st) == 0 && S_ISREG(st.st_mode) &&
      access("/proc/self/pagemap", R_OK) == 0) {
    CliResult endless = run_bounded("/proc/self/pagemap");
    EXPECT_EQ(endless.rc, 2) << endless.err;
    EXPECT_NE(endless.err.find("pagemap: the config file holds more than 64 MiB"),
              std::string::npos)
        << endless.err;
  }

  std::string big = write("big.json", "{}");
  fs::resize_file(big, (64 << 20) + 1);  // sparse
  CliResult large = run_bounded(shell_quote(big));
  EXPECT_EQ(large.rc, 2) << large.err;
  EXPECT_NE(large.err.find("big.json: the config file is 67108865 bytes; allowed: at most 64 MiB"),
            std::string::npos)
      << large.err;
}

TEST_F(CliTest, FileFromTheEnvironment) {
  std::string f = write("env.json", R"({"train_micro_batch_size_per_gpu": 3})");
  CliResult r = run("", f);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["train_batch_size"], 3);
  // A FILE argument wins over the environment.
  std::string other = write("other.json", R"({"train_micro_batch_size_per_gpu": 5})");
  CliResult r2 = run(shell_quote(other), f);
  ASSERT_EQ(r2.rc, 0) << r2.err;
  EXPECT_EQ(nlohmann::json::parse(r2.out)["train_batch_size"], 5);
  CliResult none = run("");
  EXPECT_EQ(none.rc, 2);
  EXPECT_NE(none.err.find("OUTCORE_CONFIG"), std::string::npos) << none.err;
}

TEST_F(CliTest, WorldSizeDrivesTheBatchArithmetic) {
  std::string f = source_path("configs/zero3_cpu_offload.json");  // batch 64, micro 4
  CliResult two = run(shell_quote(f) + " --world-size 2");
  ASSERT_EQ(two.rc, 0) << two.err;
  EXPECT_EQ(nlohmann::json::parse(two.out)["gradient_accumulation_steps"], 8);
  CliResult three = run(shell_quote(f) + " --world-size 3");
  EXPECT_EQ(three.rc, 2);
  EXPECT_NE(three.err.find("not a multiple of micro 4 x world 3"), std::string::npos) << three.err;
  CliResult bad = run(shell_quote(f) + " --world-size two");
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.err.find("--world-size"), std::string::npos) << bad.err;
  CliResult zero = run(shell_quote(f) + " --world-size 0");
  EXPECT_EQ(zero.rc, 2);
}

// Command-line values out of range are errors of the flag, not of the config file.
TEST_F(CliTest, FlagsOutOfRangeAreNamedNotTheFile) {
  const std::string f = source_path("tests/config/data/hf_zero3_auto.json");
  for (const std::string bad : {"--lr nan", "--lr -1", "--weight-decay inf", "--hidden-size 0",
                                "--total-steps 0", "--warmup-steps 0", "--train-batch-size -2"}) {
    CliResult r = run(shell_quote(f) + " " + bad);
    EXPECT_EQ(r.rc, 2) << bad;
    EXPECT_TRUE(r.out.empty()) << r.out;
    EXPECT_NE(r.err.find("error: " + bad.substr(0, bad.find(' ')) + ": got"), std::string::npos)
        << bad << ": " << r.err;
    EXPECT_EQ(r.err.find(f), std::string::npos) << r.err;
  }
}

// 2^32 + 2 is not world size 2: integers are read as 64 bits and refused past their range,
// naming the flag.
TEST_F(CliTest, WorldSizeAndMicroBatchBeyondTheirRangeAreRefusedNamingTheFlag) {
  std::string f = source_path("configs/zero3_cpu_offload.json");  // batch 64, micro 4
  for (const char* bad :
       {"--world-size 4294967298", "--world-size 1048577", "--world-size 18446744073709551618"}) {
    CliResult r = run(shell_quote(f) + " " + bad);
    EXPECT_EQ(r.rc, 2) << bad;
    EXPECT_TRUE(r.out.empty()) << r.out;
    EXPECT_NE(r.err.find("--world-size: got \"" + std::string(bad).substr(13) + "\""),
              std::string::npos)
        << r.err;
  }
  std::string a = source_path("tests/config/data/hf_zero3_auto.json");
  CliResult micro = run(shell_quote(a) + " --micro-batch-size 4294967298");
  EXPECT_EQ(micro.rc, 2);
  EXPECT_NE(micro.err.find("--micro-batch-size: got \"4294967298\"; allowed: an integer in "
                           "1..1048576"),
            std::string::npos)
      << micro.err;
  CliResult most = run(shell_quote(f) + " --world-size 16");  // 64 = 4 x 1 x 16
  ASSERT_EQ(most.rc, 0) << most.err;
  EXPECT_EQ(nlohmann::json::parse(most.out)["gradient_accumulation_steps"], 1);
}

TEST_F(CliTest, UserFileWithAutoValues) {
  std::string f = source_path("tests/config/data/hf_zero3_auto.json");
  CliResult plain = run(shell_quote(f));
  ASSERT_EQ(plain.rc, 0) << plain.err;
  auto j = nlohmann::json::parse(plain.out);
  EXPECT_EQ(j["optimizer"]["params"]["lr"], "auto");
  EXPECT_NE(plain.err.find("optimizer.params.lr is still \"auto\""), std::string::npos)
      << plain.err;

  CliResult resolved = run(shell_quote(f) +
                           " --hidden-size 1024 --lr 3e-5 --micro-batch-size 2 "
                           "--gradient-accumulation-steps 8 --total-steps 100 --warmup-steps 5 "
                           "--world-size 4");
  ASSERT_EQ(resolved.rc, 0) << resolved.err;
  auto r = nlohmann::json::parse(resolved.out);
  EXPECT_EQ(r["train_batch_size"], 2 * 8 * 4);
  EXPECT_EQ(r["optimizer"]["params"]["lr"], 3e-5);
  EXPECT_EQ(r["scheduler"]["params"]["warmup_max_lr"], 3e-5);
  EXPECT_EQ(r["zero_optimization"]["reduce_bucket_size"], 1024 * 1024);
  EXPECT_EQ(r["zero_optimization"]["stage3_param_persistence_threshold"], 10240);
  EXPECT_EQ(resolved.err.find("still \"auto\""), std::string::npos) << resolved.err;
}

}  // namespace
}  // namespace outcore::config
