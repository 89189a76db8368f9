// Every example in configs/ (and the user file in tests/config/data/) resolves to the JSON
// stored in tests/config/golden/. To regenerate after an intended change, run the test with
// OUTCORE_UPDATE_GOLDEN=1 and review the diff.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/config/config_test_util.hpp"

namespace outcore::config {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
using testing::dump;
using testing::source_path;

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Compares `actual` with golden/<name>.json, or rewrites it when OUTCORE_UPDATE_GOLDEN is set.
void expect_golden(const std::string& name, const Json& actual) {
  fs::path golden = fs::path(source_path("tests/config/golden")) / (name + ".json");
  if (std::getenv("OUTCORE_UPDATE_GOLDEN")) {
    std::ofstream(golden) << actual.dump(2) << "\n";
    return;
  }
  ASSERT_TRUE(fs::exists(golden)) << "no golden file " << golden
                                  << "; run with OUTCORE_UPDATE_GOLDEN=1 to create it";
  Json expected = Json::parse(read_text(golden));
  EXPECT_EQ(actual, expected) << "resolved " << name << ":\n"
                              << actual.dump(2) << "\ngolden:\n"
                              << expected.dump(2);
}

std::vector<fs::path> example_configs() {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(source_path("configs"))) {
    if (e.path().extension() == ".json") files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

TEST(Golden, ThereAreThreeExamples) {
  auto files = example_configs();
  ASSERT_EQ(files.size(), 3u);
  for (const char* want :
       {"zero2_cpu_offload.json", "zero3_cpu_offload.json", "zero3_nvme_infinity.json"}) {
    EXPECT_TRUE(std::find(files.begin(), files.end(), fs::path(source_path("configs")) / want) !=
                files.end())
        << want;
  }
}

TEST(Golden, EveryExampleMatchesItsGolden) {
  for (const fs::path& file : example_configs()) {
    SCOPED_TRACE(file.string());
    ParsedConfig p = load_config_file(file.string());
    EXPECT_TRUE(p.warnings.empty()) << "examples must load without warnings:\n" << dump(p.warnings);
    AutoContext ctx;
    ctx.total_steps = 1000;  // as `outcore train --steps 1000` (total_num_steps "auto")
    resolve_auto(p.config, ctx);
    EXPECT_TRUE(unresolved_auto(p.config).empty());
    EXPECT_NO_THROW(require_resolved(p.config));
    expect_golden(file.stem().string(), to_json(p.config));
  }
}

TEST(Golden, ExamplesSayWhatTheyChose) {
  Config z2 = load_config_file(source_path("configs/zero2_cpu_offload.json")).config;
  EXPECT_EQ(z2.zero_optimization.stage, 2);
  EXPECT_EQ(z2.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  Config z3 = load_config_file(source_path("configs/zero3_cpu_offload.json")).config;
  EXPECT_EQ(z3.zero_optimization.stage, 3);
  EXPECT_EQ(z3.zero_optimization.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(z3.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  Config inf = load_config_file(source_path("configs/zero3_nvme_infinity.json")).config;
  EXPECT_EQ(inf.zero_optimization.stage, 3);
  EXPECT_EQ(inf.zero_optimization.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(inf.zero_optimization.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_FALSE(inf.zero_optimization.offload_param.nvme_path.empty());
}

TEST(Golden, UserFileWithAutoResolved) {
  ParsedConfig p = load_config_file(source_path("tests/config/data/hf_zero3_auto.json"));
  AutoContext ctx;
  ctx.world_size = 2;
  ctx.hidden_size = 2048;
  ctx.lr = 1e-5;
  ctx.micro_batch_size = 4;
  ctx.gradient_accumulation_steps = 2;
  ctx.total_steps = 300;
  ctx.warmup_steps = 10;
  ctx.bf16 = true;
  resolve_auto(p.config, ctx);
  expect_golden("hf_zero3_auto", to_json(p.config));
}

// Printing and parsing again gives the same config: what is saved with a checkpoint can be
// loaded back. Checked for every example, the defaults and a file with unresolved "auto".
TEST(Golden, ToJsonRoundTrips) {
  std::vector<std::string> texts = {"{}",
                                    read_text(source_path("tests/config/data/hf_zero3_auto.json")),
                                    R"({"scheduler": {"type": "OneCycle", "params": {
                                        "cycle_min_lr": 0.1, "cycle_max_lr": 1,
                                        "cycle_second_step_size": 7}},
                                        "activation_checkpointing": {"number_checkpoints": 4}})"};
  for (const fs::path& file : example_configs()) texts.push_back(read_text(file));
  for (const std::string& text : texts) {
    ParsedConfig first = parse_config(text);
    Json printed = to_json(first.config);
    ParsedConfig second = parse_config(printed.dump());
    // Printed values of keys without effect (now explicit) are warned about, as are the
    // optimizer's lr and betas a scheduler overrides (now written) and what the first parse
    // warned about; nothing else.
    for (const ConfigWarning& w : second.warnings) {
      bool before = false;
      for (const ConfigWarning& f : first.warnings) before |= f.to_string() == w.to_string();
      const bool overridden =
          (w.json_path == "optimizer.params.lr" || w.json_path == "optimizer.params.betas") &&
          w.message.find("no effect in this config") != std::string::npos;
      EXPECT_TRUE(before || overridden ||
                  w.message.find("no effect in outcore") != std::string::npos)
          << w.to_string();
    }
    EXPECT_EQ(to_json(second.config), printed);
    EXPECT_EQ(unresolved_auto(second.config), unresolved_auto(first.config));
  }
}

}  // namespace
}  // namespace outcore::config
