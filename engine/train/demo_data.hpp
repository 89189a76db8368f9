// The built-in demo dataset: byte-level English-like text produced by a seeded generator,
// so the demo trains with no download. The text has structure at several scales a small
// model picks up quickly (spelling of a few hundred words, sentence templates, agreement,
// counting sequences, small sums, question/answer pairs), so a 10M-parameter Llama's loss
// falls visibly within minutes on two cores.
//
// Tokens are bytes (vocabulary 256); the text is 7-bit ASCII. The same seed gives the same
// bytes on every machine (no std:: distributions, no locale).
#pragma once

#include <cstdint>
#include <string>

namespace outcore::train {

inline constexpr int64_t kDemoVocabSize = 256;

struct DemoDataOptions {
  uint64_t seed = 20240520;
  size_t train_tokens = 4u << 20;  // 4 Mi bytes of training text
  size_t val_tokens = 256u << 10;  // 256 Ki bytes of validation text (a separate stream)
};

struct DemoDatasetFiles {
  std::string train;  // <dir>/demo_train.bin
  std::string val;    // <dir>/demo_val.bin
};

// Exactly `bytes` bytes of demo text from `seed`. Pure; thread-safe.
std::string demo_text(uint64_t seed, size_t bytes);

// Writes the train and validation token files (llm.c .bin, one token per byte) under `dir`,
// creating it when missing. Throws IoError naming the path on failure.
DemoDatasetFiles write_demo_dataset(const std::string& dir, const DemoDataOptions& options = {});

// Hugging Face config.json text of the model recommended for the demo: a Llama with hidden
// size 384, 6 layers, 6 query heads sharing 2 key/value heads, SwiGLU width 1152,
// vocabulary 256 (bytes), 256 positions; 10.5M parameters.
std::string demo_model_config_json();

// A DeepSpeed config for the demo sized for 2 cores: micro-batch 8 x 128 tokens, AdamW at
// 2e-3 with weight decay 0.1, WarmupCosineLR over `total_steps` with 5% warmup (at least 1
// step), gradient clipping 1.0, fp32, ZeRO stage 0.
std::string demo_ds_config_json(int64_t total_steps = 150);

// Sequence length the demo trains with (the ds config's micro-batch is 8 of these).
inline constexpr int64_t kDemoSeqLen = 128;

}  // namespace outcore::train
