// Demo dataset: deterministic, byte tokens with learnable structure, written as llm.c
// files; the recommended model and DeepSpeed configs.
#include "engine/train/demo_data.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>

#include "common/error.hpp"
#include "engine/train/data_loader.hpp"
#include "engine/train/token_file.hpp"
#include "tests/train/temp_dir.hpp"

namespace outcore::train {
namespace {

using testing::TempDir;

TEST(DemoData, SameSeedSameTextOtherSeedOtherText) {
  std::string a = demo_text(1, 100000), b = demo_text(1, 100000), c = demo_text(2, 100000);
  EXPECT_EQ(a.size(), 100000u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // A shorter request is a prefix of a longer one.
  EXPECT_EQ(demo_text(1, 5000), a.substr(0, 5000));
}

TEST(DemoData, TextIsPrintableAsciiWithDocuments) {
  std::string t = demo_text(3, 200000);
  for (char ch : t) {
    auto c = static_cast<unsigned char>(ch);
    ASSERT_TRUE(c == '\n' || (c >= 32 && c < 127)) << "byte " << int(c);
  }
  EXPECT_GT(std::count(t.begin(), t.end(), '\n'), 100);
}

// Entropy in nats of the next byte given the previous k bytes, estimated on the text.
double conditional_entropy(const std::string& t, size_t k) {
  std::unordered_map<std::string, std::array<uint32_t, 256>> counts;
  for (size_t i = k; i < t.size(); ++i)
    counts[t.substr(i - k, k)][static_cast<unsigned char>(t[i])]++;
  double h = 0;
  double n = static_cast<double>(t.size() - k);
  for (const auto& [ctx, c] : counts) {
    double total = 0;
    for (uint32_t x : c) total += x;
    for (uint32_t x : c)
      if (x > 0) h -= x / n * std::log(x / total);
  }
  return h;
}

TEST(DemoData, HasStructureAModelCanLearn) {
  // Uniform bytes are ln 256 = 5.55 nats. Context must help a lot: the byte distribution
  // alone is English-like (~3 nats) and a few bytes of context bring it near 1 nat.
  std::string t = demo_text(4, 1 << 20);
  double h0 = conditional_entropy(t, 0);
  double h3 = conditional_entropy(t, 3);
  EXPECT_LT(h0, 3.5);
  EXPECT_LT(h3, 1.2);
  EXPECT_LT(h3, h0 / 2.5);
}

TEST(DemoData, WritesTrainAndValidationFilesALoaderReads) {
  TempDir dir;
  DemoDataOptions o{.seed = 9, .train_tokens = 50000, .val_tokens = 5000};
  DemoDatasetFiles files = write_demo_dataset(dir.file("demo"), o);
  auto train = std::make_shared<const TokenFile>(TokenFile::open(files.train));
  auto val = std::make_shared<const TokenFile>(TokenFile::open(files.val));
  ASSERT_EQ(train->size(), 50000u);
  ASSERT_EQ(val->size(), 5000u);
  std::string text = demo_text(9, 50000);
  for (size_t i = 0; i < text.size(); i += 997)
    EXPECT_EQ((*train)[i], static_cast<unsigned char>(text[i]));
  // Validation is a different stream, not a copy of the training text's start.
  std::string val_text(val->size(), ' ');
  for (size_t i = 0; i < val->size(); ++i) val_text[i] = static_cast<char>((*val)[i]);
  EXPECT_NE(val_text, text.substr(0, val->size()));
  DataLoader l(train, {0, train->size()},
               {.micro_batch = 8, .seq_len = kDemoSeqLen, .seed = 1, .vocab_size = kDemoVocabSize});
  EXPECT_GT(l.batches_per_epoch(), 40u);
  // Writing again gives identical bytes.
  DemoDatasetFiles again = write_demo_dataset(dir.file("demo2"), o);
  auto t2 = TokenFile::open(again.train);
  for (size_t i = 0; i < t2.size(); ++i) ASSERT_EQ(t2[i], (*train)[i]);
}

TEST(DemoData, ModelConfigIsASmallGqaLlama) {
  auto j = nlohmann::json::parse(demo_model_config_json());
  int64_t h = j["hidden_size"], inter = j["intermediate_size"], layers = j["num_hidden_layers"];
  int64_t heads = j["num_attention_heads"], kv = j["num_key_value_heads"], vocab = j["vocab_size"];
  EXPECT_EQ(vocab, kDemoVocabSize);
  EXPECT_EQ(h % heads, 0);
  EXPECT_EQ(heads % kv, 0);
  EXPECT_LT(kv, heads);  // grouped key/value heads
  EXPECT_GE(j["max_position_embeddings"].get<int64_t>(), kDemoSeqLen);
  int64_t head_dim = h / heads;
  int64_t per_layer = h * heads * head_dim * 2 + h * kv * head_dim * 2 + 3 * h * inter + 2 * h;
  int64_t params = layers * per_layer + vocab * h * (j["tie_word_embeddings"] ? 1 : 2) + h;
  EXPECT_GE(params, 10'000'000);
  EXPECT_LE(params, 30'000'000);
}

TEST(DemoData, DeepSpeedConfigIsConsistent) {
  auto j = nlohmann::json::parse(demo_ds_config_json(400));
  EXPECT_EQ(j["scheduler"]["params"]["total_num_steps"], 400);
  EXPECT_EQ(j["scheduler"]["params"]["warmup_num_steps"], 20);
  EXPECT_EQ(j["train_micro_batch_size_per_gpu"], 8);
  EXPECT_EQ(
      nlohmann::json::parse(demo_ds_config_json(3))["scheduler"]["params"]["warmup_num_steps"], 1);
  EXPECT_THROW(demo_ds_config_json(0), InvalidArgument);
}

}  // namespace
}  // namespace outcore::train
