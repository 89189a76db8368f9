// Loss masks through the Trainer (TrainerOptions::train_mask / val_mask): the step's loss is
// the mean over the targets trained on, masked targets change nothing they should not, and the
// arithmetic is the same on every stage and tier (world sizes: tests/dp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "engine/model/model.hpp"
#include "engine/train/data_loader.hpp"
#include "engine/train/trainer.hpp"
#include "tests/trainer/trainer_test_util.hpp"

namespace outcore::train {
namespace {

using testing::DemoData;
using testing::make_config;
using testing::nvme_patch;
using testing::quiet_options;
using testing::tiny_model;
using testing::Weights;
using testing::weights_of;

// Writes the mask of `tokens` whose byte i is keep(i) to `path`.
template <typename Keep>
void write_mask(const std::string& path, const std::string& tokens, Keep keep) {
  const TokenFile f = TokenFile::open(tokens);
  std::string bytes(f.size(), '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = keep(i) ? 1 : 0;
  std::FILE* out = std::fopen(path.c_str(), "wb");
  ASSERT_NE(out, nullptr) << path;
  ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), out), bytes.size());
  std::fclose(out);
}

// Prompt/completion-like: of every 40 tokens, the first 25 are a "prompt" (not trained on).
bool completion(size_t i) { return i % 40 >= 25; }

struct RunResult {
  std::vector<double> losses;
  std::vector<int64_t> trained;
  double val_loss = 0;
  Weights w;
};

RunResult train(const config::Config& cfg, TrainerOptions o) {
  const model::LlamaConfig mc = tiny_model();
  RunResult r;
  o.on_step = [&](const StepMetrics& m) { r.trained.push_back(m.tokens_trained); };
  Trainer t(cfg, mc, o);
  const TrainResult res = t.run();
  r.losses = res.losses;
  r.val_loss = res.final_val_loss.value_or(-1);
  r.w = weights_of(t);
  return r;
}

bool same_weights(const Weights& a, const Weights& b) {
  return a.master == b.master && a.params == b.params;
}

// The first step's loss is the mean cross-entropy over exactly the batch's unmasked targets:
// the engine's evaluation of the same batch (a mean over B*T rows, masked rows 0) scaled by
// B*T / trained. Its gradient is that mean's: the gradient norm equals the one of an engine
// given each micro-batch with the loss scale B*T / trained by hand.
TEST(LossMask, TheStepLossIsTheMeanOverTheTrainedTargets) {
  DemoData data;
  const std::string mask = data.file("train.mask");
  write_mask(mask, data.train(), completion);
  const model::LlamaConfig mc = tiny_model();
  const config::Config cfg = make_config({{"gradient_accumulation_steps", 2}}, mc);
  TrainerOptions o = quiet_options(data, 1);
  o.train_mask = mask;
  Trainer t(cfg, mc, o), by_hand(cfg, mc, o);

  // The same two micro-batches the trainer will take, and the engine's loss on them before
  // any update.
  const auto file = std::make_shared<const TokenFile>(TokenFile::open(data.train()));
  const auto m = std::make_shared<const MaskFile>(MaskFile::open(mask, *file));
  DataLoader l(file, {0, file->size()}, {.micro_batch = 4, .seq_len = 32, .seed = 7}, "train", m);
  const int64_t n = 4 * 32;
  std::vector<int32_t> in(n), tg(n);
  double sum = 0;
  uint64_t trained = 0;
  std::vector<std::vector<int32_t>> ins, tgs;
  for (int k = 0; k < 2; ++k) {
    trained += l.trained_targets(l.position());
    l.next(in, tg);
    sum += double(t.engine().evaluate(in.data(), tg.data())) * n;
    ins.push_back(in);
    tgs.push_back(tg);
  }
  ASSERT_GT(trained, 0u);
  ASSERT_LT(trained, 2u * n);
  for (int k = 0; k < 2; ++k)
    by_hand.engine().forward_backward(ins[k].data(), tgs[k].data(),
                                      static_cast<float>(double(n) / double(trained)), k == 0);
  const zero::StepResult want = by_hand.engine().step(zero::step_params(cfg, 1e-3, 1, 1.0));
  const StepMetrics s = t.train_step();
  EXPECT_EQ(s.tokens, 2 * n);
  EXPECT_EQ(s.tokens_trained, static_cast<int64_t>(trained));
  EXPECT_TRUE(s.masked);
  EXPECT_NEAR(s.loss, sum / static_cast<double>(trained), 1e-5 * s.loss);
  ASSERT_TRUE(s.grad_norm.has_value());
  EXPECT_EQ(*s.grad_norm, want.grad_norm);
  EXPECT_NE(format_step_line(s).find("trained"), std::string::npos) << format_step_line(s);
}

// Stage 0 in memory and stage 3 with parameters and optimizer state on NVMe train bit-identically
// with a mask, as without; the mask changes the run; a mask of all ones is no mask, bit for bit.
TEST(LossMask, Stage3OnNvmeEqualsStage0InMemoryAndAnAllOnesMaskIsNoMask) {
  DemoData data;
  const std::string mask = data.file("train.mask"), val_mask = data.file("val.mask"),
                    ones = data.file("ones.mask");
  write_mask(mask, data.train(), completion);
  write_mask(val_mask, data.val(), completion);
  write_mask(ones, data.train(), [](size_t) { return true; });
  const model::LlamaConfig mc = tiny_model();
  const nlohmann::json gas = {{"gradient_accumulation_steps", 2}};
  nlohmann::json s3 = nvme_patch(data.file("swap"));
  s3.merge_patch(gas);
  const config::Config stage0 = make_config(gas, mc), stage3 = make_config(s3, mc);

  TrainerOptions masked = quiet_options(data, 4), plain = quiet_options(data, 4);
  masked.train_mask = mask;
  masked.val_mask = val_mask;
  const RunResult a = train(stage0, masked), b = train(stage3, masked), c = train(stage0, plain);
  ASSERT_EQ(a.losses.size(), 4u);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(a.trained, b.trained);
  EXPECT_EQ(a.val_loss, b.val_loss);
  EXPECT_TRUE(same_weights(a.w, b.w)) << "stage 3 on NVMe differs from stage 0 in memory";
  EXPECT_NE(a.losses, c.losses);
  EXPECT_NE(a.val_loss, c.val_loss);
  EXPECT_FALSE(same_weights(a.w, c.w)) << "the mask changed nothing";
  for (int64_t t : a.trained) {
    EXPECT_GT(t, 0);
    EXPECT_LT(t, 2 * 4 * 32);
  }
  for (int64_t t : c.trained) EXPECT_EQ(t, 2 * 4 * 32);

  TrainerOptions all_ones = quiet_options(data, 4);
  all_ones.train_mask = ones;
  const RunResult d = train(stage0, all_ones);
  EXPECT_EQ(d.losses, c.losses);
  EXPECT_TRUE(same_weights(d.w, c.w));
}

// What a mask hides does not reach the weights. Windows are 32 inputs at stride 32 with one
// more token of targets, so token 32k is window k-1's last target and window k's first input,
// and nothing else. Mask every odd window entirely and the last target of every even one, then
// change the tokens at 32k for odd k in a copy of the file: those tokens are only a masked
// target and an input of a masked window, so the losses and the weights stay the same bit for
// bit. Without the mask the same change shows (the changed tokens are read).
TEST(LossMask, WhatTheMaskHidesDoesNotReachTheWeights) {
  DemoData data;
  const TokenFile f = TokenFile::open(data.train());
  std::vector<uint16_t> changed_tokens(f.size());
  auto hidden = [](size_t i) { return i % 32 == 0 && (i / 32) % 2 == 1; };
  auto keep = [&](size_t i) { return i > 0 && ((i - 1) / 32) % 2 == 0 && !hidden(i); };
  for (size_t i = 0; i < f.size(); ++i)
    changed_tokens[i] = static_cast<uint16_t>(hidden(i) ? (f[i] + 101) % 256 : f[i]);
  const std::string mask = data.file("hide.mask"), changed = data.file("changed.bin"),
                    changed_mask = data.file("changed.mask");
  write_llmc_tokens(changed, changed_tokens);
  write_mask(mask, data.train(), keep);
  write_mask(changed_mask, changed, keep);

  const model::LlamaConfig mc = tiny_model();
  const config::Config cfg = make_config({}, mc);
  TrainerOptions o1 = quiet_options(data, 3), o2 = quiet_options(data, 3);
  o1.val_data = o2.val_data = "";
  o2.train_data = changed;
  o1.train_mask = mask;
  o2.train_mask = changed_mask;
  const RunResult x = train(cfg, o1), y = train(cfg, o2);
  ASSERT_EQ(x.losses.size(), 3u);
  EXPECT_EQ(x.losses, y.losses);
  EXPECT_TRUE(same_weights(x.w, y.w)) << "a masked target reached the gradients";
  o1.train_mask = o2.train_mask = "";
  const RunResult u = train(cfg, o1), v = train(cfg, o2);
  EXPECT_NE(u.losses, v.losses) << "the changed tokens are never read: the test proves nothing";
}

TEST(LossMask, AMaskOfTheWrongSizeIsRefusedNamingBothFiles) {
  DemoData data;
  const std::string mask = data.file("val_for_train.mask");
  write_mask(mask, data.val(), completion);  // the validation file's size, not the training one
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 1);
  o.train_mask = mask;
  try {
    Trainer t(make_config({}, mc), mc, o);
    FAIL() << "accepted";
  } catch (const CorruptData& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("val_for_train.mask"), std::string::npos) << m;
    EXPECT_NE(m.find(data.train()), std::string::npos) << m;
  }
}

// A validation pass evaluates the set's first --eval-batches micro-batches: a mask with no
// trained target among them would leave the pass no loss (it once printed a perfect 0). It is
// refused naming the mask and the flag; with the pass reaching its targets it is taken.
TEST(LossMask, AValidationPassWithNoTrainedTargetIsRefused) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 1);
  o.eval_batches = 2;  // micro-batches of 4 x 32: targets [1, 257) of the validation file
  o.val_mask = data.file("late.mask");
  write_mask(o.val_mask, data.val(), [](size_t i) { return i >= 600 && i < 640; });
  try {
    Trainer t(make_config({}, mc), mc, o);
    FAIL() << "accepted";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("late.mask marks no target of the 2 micro-batches"), std::string::npos) << m;
    EXPECT_NE(m.find("tokens [1, 257)"), std::string::npos) << m;
    EXPECT_NE(m.find("--eval-batches"), std::string::npos) << m;
  }
  o.eval_batches = 8;
  const RunResult r = train(make_config({}, mc), o);
  EXPECT_GT(r.val_loss, 0.0);
}

}  // namespace
}  // namespace outcore::train
