// The README's fine-tuning path, command by command, on a tiny model: a Hugging Face model
// directory (config.json, model.safetensors, tokenizer.json) -> `outcore tokenize` of
// prompt/completion JSON lines -> `outcore train --init-from` it (ZeRO-3, the mask beside the
// tokens) -> `outcore export` -> the exported directory loaded by PyTorch (tests/ckpt/oracle/
// hf_oracle.py's reader), whose loss on the completions is below the original model's.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <vector>

#include "engine/train/token_file.hpp"
#include "tests/common/oracle_unavailable.hpp"
#include "tests/common/run_command.hpp"
#include "tests/common/temp_dir.hpp"
#include "tests/data/tiny_tokenizer.hpp"

namespace outcore::data {
namespace {

using test::json;
using test::shell_quote;
namespace fs = std::filesystem;

// Runs `cmd` (stdout and stderr to `log`), returning its exit code.
int run(const std::string& cmd, const fs::path& log) {
  std::string ignored;
  return outcore::testing::run_command(cmd + " >" + shell_quote(log.string()) + " 2>&1", ignored);
}

// The mean cross-entropy PyTorch computes with the weights of `hf_dir` on `inputs`/`targets`
// ([n, seq] int32, one micro-batch of n), or NaN when the script fails.
double pytorch_loss(const fs::path& hf_dir, const fs::path& inputs, const fs::path& targets,
                    int64_t n, int64_t seq, const fs::path& out) {
  const std::string cmd =
      fmt::format("{} {}/tests/ckpt/oracle/hf_oracle.py loss {} {} {} {} {} {}", OUTCORE_PYTHON,
                  OUTCORE_SOURCE_DIR, shell_quote(hf_dir.string()), shell_quote(inputs.string()),
                  shell_quote(targets.string()), n, seq, shell_quote(out.string()));
  if (run(cmd, out.string() + ".log") != 0) return std::nan("");
  std::ifstream f(out, std::ios::binary);
  double loss = std::nan("");
  f.read(reinterpret_cast<char*>(&loss), sizeof(loss));
  return loss;
}

TEST(ReadmePath, TokenizeTrainExportAndLoadInPyTorch) {
  if (std::system(OUTCORE_PYTHON " -c 'import torch' >/dev/null 2>&1") != 0)
    OUTCORE_ORACLE_UNAVAILABLE("no PyTorch for " OUTCORE_PYTHON);
  test::TempDir tmp{"readme-path"};
  const fs::path dir = tmp.path(), model = dir / "case" / "hf";
  const std::string cli = OUTCORE_CLI;

  // A random tiny Llama written by the reference (a vocabulary of 320 covers the tokenizer's
  // 265 ids), with the tokenizer files beside its weights.
  fs::create_directories(dir / "case");
  const json config = {{"model_type", "llama"},
                       {"architectures", {"LlamaForCausalLM"}},
                       {"hidden_size", 64},
                       {"intermediate_size", 176},
                       {"num_hidden_layers", 2},
                       {"num_attention_heads", 4},
                       {"num_key_value_heads", 2},
                       {"vocab_size", 320},
                       {"max_position_embeddings", 128},
                       {"rms_norm_eps", 1e-5},
                       {"tie_word_embeddings", false}};
  test::write_file(dir / "case" / "case.json", json{{"config", config},
                                                    {"dtype", "float32"},
                                                    {"shards", 1},
                                                    {"seed", 5},
                                                    {"batch", 1},
                                                    {"seq", 8}}
                                                   .dump());
  test::write_file(dir / "case" / "tokens.bin", std::string(8 * sizeof(int32_t), '\0'));
  ASSERT_EQ(run(fmt::format("{} {}/tests/ckpt/oracle/hf_oracle.py make {}", OUTCORE_PYTHON,
                            OUTCORE_SOURCE_DIR, shell_quote((dir / "case").string())),
                dir / "make.log"),
            0)
      << test::slurp(dir / "make.log");
  test::write_tiny_tokenizer_dir(model);

  // Prompt/completion pairs the model can learn: the completion repeats the prompt's word.
  std::string jsonl;
  const std::vector<std::string> words = {"the",  "cat",   "and",   "dog",  "ran",  "in",
                                          "sing", "apple", "stand", "tree", "hand", "bird"};
  for (int i = 0; i < 1500; ++i) {
    const std::string& w = words[static_cast<size_t>(i * 7 % words.size())];
    jsonl +=
        json{{"prompt", "Repeat: " + w}, {"completion", " " + w + " " + w + "."}}.dump() + "\n";
  }
  test::write_file(dir / "sft.jsonl", jsonl);
  fs::create_directories(dir / "data");

  // 1. outcore tokenize
  ASSERT_EQ(
      run(fmt::format("{} tokenize --tokenizer {} --input {} --prompt-key prompt "
                      "--completion-key completion --out {}",
                      cli, shell_quote(model.string()), shell_quote((dir / "sft.jsonl").string()),
                      shell_quote((dir / "data" / "sft").string())),
          dir / "tokenize.log"),
      0)
      << test::slurp(dir / "tokenize.log");
  ASSERT_TRUE(fs::exists(dir / "data" / "sft.bin"));
  ASSERT_TRUE(fs::exists(dir / "data" / "sft.mask"));

  // 2. outcore train --init-from the model directory, ZeRO-3 with everything in host memory
  test::write_file(dir / "ds.json", R"({
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                          "offload_optimizer": {"device": "cpu"}}
  })");
  ASSERT_EQ(
      run(fmt::format("{} train --init-from {} --config {} --data {} --seq-len 32 "
                      "--steps 40 --save-dir {}",
                      cli, shell_quote(model.string()), shell_quote((dir / "ds.json").string()),
                      shell_quote((dir / "data" / "sft.bin").string()),
                      shell_quote((dir / "ckpt").string())),
          dir / "train.log"),
      0)
      << test::slurp(dir / "train.log");
  const std::string train_log = test::slurp(dir / "train.log");
  EXPECT_NE(train_log.find("loss mask " + (dir / "data" / "sft.mask").string()), std::string::npos)
      << train_log;
  EXPECT_NE(train_log.find("| trained "), std::string::npos) << train_log;

  // 3. outcore export
  ASSERT_EQ(run(fmt::format("{} export {} {}", cli, shell_quote((dir / "ckpt").string()),
                            shell_quote((dir / "tuned").string())),
                dir / "export.log"),
            0)
      << test::slurp(dir / "export.log");

  // 4. PyTorch loads both directories; the tuned one predicts the data better.
  const train::TokenFile tokens = train::TokenFile::open((dir / "data" / "sft.bin").string());
  const int64_t n = 8, seq = 32;
  ASSERT_GT(tokens.size(), static_cast<size_t>(n * seq + 1));
  std::vector<int32_t> in(n * seq), tg(n * seq);
  tokens.read(0, in);
  tokens.read(1, tg);
  test::write_file(dir / "in.bin",
                   std::string(reinterpret_cast<const char*>(in.data()), in.size() * 4));
  test::write_file(dir / "tg.bin",
                   std::string(reinterpret_cast<const char*>(tg.data()), tg.size() * 4));
  const double before = pytorch_loss(model, dir / "in.bin", dir / "tg.bin", n, seq, dir / "l0.bin");
  const double after =
      pytorch_loss(dir / "tuned", dir / "in.bin", dir / "tg.bin", n, seq, dir / "l1.bin");
  ASSERT_TRUE(std::isfinite(before)) << test::slurp(dir / "l0.bin.log");
  ASSERT_TRUE(std::isfinite(after)) << test::slurp(dir / "l1.bin.log");
  std::printf("[ readme   ] PyTorch loss on the data: %.4f before, %.4f after\n", before, after);
  EXPECT_LT(after, before - 1.0) << "PyTorch's loss on the data: " << before << " -> " << after;
}

}  // namespace
}  // namespace outcore::data
