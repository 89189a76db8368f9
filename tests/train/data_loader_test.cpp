// DataLoader: windows and targets, seeded order, epochs, resume, split, data-parallel
// sharding, loss masks, and the errors for short files, out-of-vocabulary tokens and bad masks.
#include "engine/train/data_loader.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "engine/model/model.hpp"
#include "tests/train/temp_dir.hpp"

namespace outcore::train {
namespace {

using testing::TempDir;

// A file whose token i is i % 251, so a token's value tells where it came from.
std::shared_ptr<const TokenFile> counting_file(const TempDir& dir, size_t n,
                                               const std::string& name = "c.bin") {
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = static_cast<uint16_t>(i % 251);
  write_llmc_tokens(dir.file(name), t);
  return std::make_shared<const TokenFile>(TokenFile::open(dir.file(name)));
}

struct Batch {
  std::vector<int32_t> in, tg;
  bool operator==(const Batch&) const = default;
};

Batch next(DataLoader& l) {
  Batch b{std::vector<int32_t>(l.tokens_per_batch()), std::vector<int32_t>(l.tokens_per_batch())};
  l.next(b.in, b.tg);
  return b;
}

std::vector<Batch> take(DataLoader& l, int n) {
  std::vector<Batch> v;
  for (int i = 0; i < n; ++i) v.push_back(next(l));
  return v;
}

TEST(DataLoader, InputsAreWindowsAndTargetsTheNextTokens) {
  TempDir dir;
  auto f = counting_file(dir, 1000);
  DataLoader l(f, {0, 1000}, {.micro_batch = 3, .seq_len = 16, .seed = 5});
  EXPECT_EQ(l.sequences(), 999u / 16);
  for (int step = 0; step < 5; ++step) {
    DataPosition pos = l.position();
    Batch b = next(l);
    for (int64_t r = 0; r < 3; ++r) {
      size_t start = l.sequence_at(pos, r) * 16;
      for (size_t t = 0; t < 16; ++t) {
        EXPECT_EQ(b.in[r * 16 + t], static_cast<int32_t>((start + t) % 251));
        EXPECT_EQ(b.tg[r * 16 + t], static_cast<int32_t>((start + t + 1) % 251));
      }
    }
  }
}

TEST(DataLoader, SameSeedSameBatchesDifferentSeedDifferent) {
  TempDir dir;
  auto f = counting_file(dir, 5000);
  DataLoaderOptions o{.micro_batch = 2, .seq_len = 8, .seed = 42};
  DataLoader a(f, {0, 5000}, o), b(f, {0, 5000}, o);
  EXPECT_EQ(take(a, 700), take(b, 700));  // spans several epochs (312 batches each)
  o.seed = 43;
  DataLoader c(f, {0, 5000}, o);
  DataLoader a2(f, {0, 5000}, {.micro_batch = 2, .seq_len = 8, .seed = 42});
  EXPECT_NE(take(a2, 10), take(c, 10));
}

TEST(DataLoader, AnEpochVisitsEverySequenceOnceAndEpochsDifferInOrder) {
  TempDir dir;
  auto f = counting_file(dir, 64 * 10 + 1);  // exactly 64 sequences of 10
  DataLoader l(f, {0, f->size()}, {.micro_batch = 4, .seq_len = 10, .seed = 7});
  ASSERT_EQ(l.sequences(), 64u);
  ASSERT_EQ(l.batches_per_epoch(), 16u);
  std::vector<uint64_t> e0, e1;
  for (uint64_t s = 0; s < 16; ++s)
    for (int b = 0; b < 4; ++b) {
      e0.push_back(l.sequence_at({0, s}, b));
      e1.push_back(l.sequence_at({1, s}, b));
    }
  std::vector<uint64_t> all(64);
  for (uint64_t i = 0; i < 64; ++i) all[i] = i;
  EXPECT_NE(e0, all);  // shuffled
  EXPECT_NE(e0, e1);   // reshuffled each epoch
  std::sort(e0.begin(), e0.end());
  std::sort(e1.begin(), e1.end());
  EXPECT_EQ(e0, all);
  EXPECT_EQ(e1, all);
}

TEST(DataLoader, PartialLastBatchIsDroppedAndTheEpochWraps) {
  TempDir dir;
  auto f = counting_file(dir, 10 * 7 + 1);  // 10 sequences of 7, B = 3 -> 3 batches
  DataLoader l(f, {0, f->size()}, {.micro_batch = 3, .seq_len = 7, .seed = 1});
  EXPECT_EQ(l.batches_per_epoch(), 3u);
  take(l, 2);
  EXPECT_EQ(l.position(), (DataPosition{0, 2}));
  take(l, 1);
  EXPECT_EQ(l.position(), (DataPosition{1, 0}));
}

TEST(DataLoader, WithoutShuffleSequencesComeInFileOrder) {
  TempDir dir;
  auto f = counting_file(dir, 200);
  DataLoader l(f, {0, 200}, {.micro_batch = 2, .seq_len = 10, .shuffle = false});
  Batch b = next(l);
  EXPECT_EQ(b.in[0], 0);
  EXPECT_EQ(b.in[10], 10);
  b = next(l);
  EXPECT_EQ(b.in[0], 20);
  EXPECT_EQ(b.tg[19], 40);
}

TEST(DataLoader, ResumingFromAPositionReplaysTheSameBatches) {
  TempDir dir;
  auto f = counting_file(dir, 3000);
  DataLoaderOptions o{.micro_batch = 4, .seq_len = 12, .seed = 99};
  DataLoader a(f, {0, 3000}, o);
  take(a, 70);  // past the first epoch (62 batches)
  nlohmann::json saved = to_json(a.position());
  std::vector<Batch> rest = take(a, 30);

  DataLoader b(f, {0, 3000}, o);
  b.seek(data_position_from_json(saved));
  EXPECT_EQ(b.position(), (DataPosition{1, 8}));
  EXPECT_EQ(take(b, 30), rest);
}

TEST(DataLoader, BadPositionsAreRejected) {
  TempDir dir;
  auto f = counting_file(dir, 500);
  DataLoader l(f, {0, 500}, {.micro_batch = 2, .seq_len = 10});
  EXPECT_THROW(l.seek({0, l.batches_per_epoch()}), InvalidArgument);
  // Said as a micro-batch (what the position counts), with the ways on.
  try {
    l.seek({0, l.batches_per_epoch() + 3});
    ADD_FAILURE() << "seek past the epoch";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(fmt::format("to micro-batch {} of epoch 0", l.batches_per_epoch() + 3)),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("--init-from"), std::string::npos) << what;
  }
  EXPECT_THROW(data_position_from_json({{"epoch", 1}}), InvalidArgument);
  EXPECT_THROW(data_position_from_json({{"epoch", -1}, {"step", 0}}), InvalidArgument);
}

TEST(DataLoader, TrainAndValidationSplitsDoNotOverlap) {
  TempDir dir;
  const size_t n = 4000;
  std::vector<uint16_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = i < 3600 ? 1 : 2;  // 1 = train region, 2 = val region
  write_llmc_tokens(dir.file("s.bin"), t);
  auto f = std::make_shared<const TokenFile>(TokenFile::open(dir.file("s.bin")));
  TokenSplit split = split_tokens(n, 0.1);
  EXPECT_EQ(split.train, (TokenRange{0, 3600}));
  EXPECT_EQ(split.val, (TokenRange{3600, 4000}));
  DataLoader train(f, split.train, {.micro_batch = 4, .seq_len = 20, .seed = 3});
  DataLoader val(f, split.val, {.micro_batch = 4, .seq_len = 20, .shuffle = false}, "val");
  for (int i = 0; i < 200; ++i) {
    Batch b = next(train);
    for (size_t k = 0; k < b.in.size(); ++k) {
      ASSERT_EQ(b.in[k], 1);
      ASSERT_EQ(b.tg[k], 1);
    }
  }
  for (int i = 0; i < 10; ++i) {
    Batch b = next(val);
    for (size_t k = 0; k < b.in.size(); ++k) {
      ASSERT_EQ(b.in[k], 2);
      ASSERT_EQ(b.tg[k], 2);
    }
  }
  EXPECT_EQ(split_tokens(n, 0.0).val.size(), 0u);
  EXPECT_THROW(split_tokens(n, 1.0), InvalidArgument);
  EXPECT_THROW(split_tokens(n, -0.1), InvalidArgument);
}

TEST(DataLoader, RanksTakeDisjointSequencesThatTogetherMakeTheWorldOneBatch) {
  TempDir dir;
  auto f = counting_file(dir, 8000);
  DataLoader r0(f, {0, 8000},
                {.micro_batch = 3, .seq_len = 10, .seed = 11, .rank = 0, .world_size = 2});
  DataLoader r1(f, {0, 8000},
                {.micro_batch = 3, .seq_len = 10, .seed = 11, .rank = 1, .world_size = 2});
  DataLoader one(f, {0, 8000}, {.micro_batch = 6, .seq_len = 10, .seed = 11});
  EXPECT_EQ(r0.batches_per_epoch(), one.batches_per_epoch());
  for (uint64_t s = 0; s < r0.batches_per_epoch(); s += 17) {
    std::vector<uint64_t> both, whole;
    for (int b = 0; b < 3; ++b) {
      both.push_back(r0.sequence_at({0, s}, b));
      both.push_back(r1.sequence_at({0, s}, b));
    }
    for (int b = 0; b < 6; ++b) whole.push_back(one.sequence_at({0, s}, b));
    std::sort(both.begin(), both.end());
    std::sort(whole.begin(), whole.end());
    EXPECT_EQ(std::adjacent_find(both.begin(), both.end()), both.end());
    EXPECT_EQ(both, whole);
  }
}

TEST(DataLoader, FileTooShortForOneBatchNamesFileAndNeed) {
  TempDir dir;
  auto f = counting_file(dir, 100, "short.bin");
  try {
    DataLoader l(f, {0, 100}, {.micro_batch = 4, .seq_len = 32});
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("short.bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find("100 tokens"), std::string::npos) << msg;
    EXPECT_NE(msg.find("at least 129 tokens"), std::string::npos) << msg;
  }
  // Exactly enough: B*T + 1 tokens.
  auto g = counting_file(dir, 129, "exact.bin");
  DataLoader ok(g, {0, 129}, {.micro_batch = 4, .seq_len = 32});
  EXPECT_EQ(ok.batches_per_epoch(), 1u);
  // A validation split too short says so.
  try {
    DataLoader v(g, {100, 129}, {.micro_batch = 1, .seq_len = 32}, "val");
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("val split"), std::string::npos) << e.what();
  }
}

TEST(DataLoader, OutOfVocabularyTokenNamesFileAndPosition) {
  TempDir dir;
  std::vector<uint16_t> t(1000, 5);
  t[612] = 1000;
  write_llmc_tokens(dir.file("v.bin"), t);
  auto f = std::make_shared<const TokenFile>(TokenFile::open(dir.file("v.bin")));
  try {
    DataLoader l(f, {0, 1000}, {.micro_batch = 2, .seq_len = 8, .vocab_size = 256});
    FAIL() << "no error";
  } catch (const CorruptData& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("v.bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find("position 612"), std::string::npos) << msg;
  }
  // The split that does not contain it loads.
  DataLoader ok(f, {0, 600}, {.micro_batch = 2, .seq_len = 8, .vocab_size = 256});
  EXPECT_GT(ok.batches_per_epoch(), 0u);
  // A token written in place after that check, while training reads the file, is named with the
  // file when a batch reads it (the model would name neither).
  std::vector<int32_t> in(16), tg(16);
  ok.next(in, tg);
  std::vector<uint16_t> changed(600, 999);
  std::FILE* out = std::fopen(dir.file("v.bin").c_str(), "r+b");
  std::fseek(out, 1024, SEEK_SET);
  std::fwrite(changed.data(), sizeof(uint16_t), changed.size(), out);
  std::fclose(out);
  try {
    ok.next(in, tg);
    FAIL() << "no error";
  } catch (const CorruptData& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("v.bin: token 999 at position "), std::string::npos) << msg;
    EXPECT_NE(msg.find("the file changed while training read it"), std::string::npos) << msg;
  }
}

TEST(DataLoader, BadOptionsAreRejected) {
  TempDir dir;
  auto f = counting_file(dir, 500);
  EXPECT_THROW(DataLoader(f, {0, 500}, {.micro_batch = 0, .seq_len = 8}), InvalidArgument);
  EXPECT_THROW(DataLoader(f, {0, 500}, {.micro_batch = 1, .seq_len = 0}), InvalidArgument);
  EXPECT_THROW(
      DataLoader(f, {0, 500}, {.micro_batch = 1, .seq_len = 8, .rank = 2, .world_size = 2}),
      InvalidArgument);
  EXPECT_THROW(DataLoader(f, {0, 501}, {.micro_batch = 1, .seq_len = 8}), InvalidArgument);
  EXPECT_THROW(DataLoader(nullptr, {0, 1}, {.micro_batch = 1, .seq_len = 8}), InvalidArgument);
  DataLoader l(f, {0, 500}, {.micro_batch = 2, .seq_len = 8});
  std::vector<int32_t> small(15), ok(16);
  EXPECT_THROW(l.next(small, ok), InvalidArgument);
}

}  // namespace
}  // namespace outcore::train

namespace outcore::train {
namespace {

// A mask beside `tokens` whose byte i is keep(i).
template <typename Keep>
std::shared_ptr<const MaskFile> write_mask(const TempDir& dir, const TokenFile& tokens, Keep keep,
                                           const std::string& name = "c.mask") {
  std::string bytes(tokens.size(), '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = keep(i) ? 1 : 0;
  std::FILE* f = std::fopen(dir.file(name).c_str(), "wb");
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  return std::make_shared<const MaskFile>(MaskFile::open(dir.file(name), tokens));
}

TEST(DataLoader, AMaskedTargetIsIgnoredAndCounted) {
  TempDir dir;
  auto f = counting_file(dir, 1000);
  auto keep = [](size_t i) { return i % 7 < 3; };
  auto mask = write_mask(dir, *f, keep);
  DataLoader plain(f, {0, 1000}, {.micro_batch = 2, .seq_len = 16, .seed = 5, .world_size = 1});
  DataLoader l(f, {0, 1000}, {.micro_batch = 2, .seq_len = 16, .seed = 5, .world_size = 1}, "train",
               mask);
  EXPECT_TRUE(l.has_mask());
  EXPECT_FALSE(plain.has_mask());
  uint64_t ones = 0;  // the targets of the 62 whole sequences of 16: tokens [1, 993)
  for (size_t i = 1; i < 1 + 62 * 16; ++i) ones += keep(i) ? 1 : 0;
  EXPECT_EQ(l.targets_in_split(), ones);
  for (int step = 0; step < 4; ++step) {
    const DataPosition pos = l.position();
    EXPECT_EQ(plain.trained_targets(pos), 32u);
    const uint64_t want = l.trained_targets(pos);
    const Batch a = next(plain), b = next(l);
    EXPECT_EQ(a.in, b.in);
    uint64_t trained = 0;
    for (int64_t r = 0; r < 2; ++r) {
      const size_t start = l.sequence_at(pos, r) * 16;
      for (size_t t = 0; t < 16; ++t) {
        const size_t i = static_cast<size_t>(r) * 16 + t;
        EXPECT_EQ(b.tg[i], keep(start + t + 1) ? a.tg[i] : model::kIgnoreTarget) << i;
        trained += keep(start + t + 1) ? 1 : 0;
      }
    }
    EXPECT_EQ(trained, want);
    EXPECT_EQ(l.trained_targets_all_ranks(pos), want);  // one rank
  }
}

TEST(DataLoader, EveryRankCountsTheWholeStepsTrainedTargetsAlike) {
  TempDir dir;
  auto f = counting_file(dir, 3000);
  auto mask = write_mask(dir, *f, [](size_t i) { return (i / 5) % 3 != 0; });
  std::vector<std::unique_ptr<DataLoader>> ranks;
  for (int r = 0; r < 3; ++r)
    ranks.push_back(std::make_unique<DataLoader>(
        f, TokenRange{0, 3000},
        DataLoaderOptions{.micro_batch = 2, .seq_len = 10, .seed = 9, .rank = r, .world_size = 3},
        "train", mask));
  DataPosition pos{};
  for (int step = 0; step < 60; ++step, pos = ranks[0]->advanced(pos)) {
    uint64_t sum = 0;
    for (const auto& l : ranks) sum += l->trained_targets(pos);
    for (const auto& l : ranks) EXPECT_EQ(l->trained_targets_all_ranks(pos), sum);
  }
  // advanced() wraps into the next epoch as next() does
  const uint64_t per_epoch = ranks[0]->batches_per_epoch();
  EXPECT_EQ(ranks[0]->advanced({0, per_epoch - 1}), (DataPosition{1, 0}));
  EXPECT_EQ(ranks[0]->advanced({2, 1}, 2 * per_epoch + 1), (DataPosition{4, 2}));
}

TEST(DataLoader, BadMasksAreRejectedNamingTheFile) {
  TempDir dir;
  auto f = counting_file(dir, 1000);
  {  // a size that is not the token count
    std::FILE* out = std::fopen(dir.file("short.mask").c_str(), "wb");
    std::fputs("\x01\x01", out);
    std::fclose(out);
    try {
      MaskFile::open(dir.file("short.mask"), *f);
      FAIL();
    } catch (const CorruptData& e) {
      EXPECT_NE(std::string(e.what()).find("short.mask: a loss mask of 2 bytes"), std::string::npos)
          << e.what();
    }
  }
  {  // a byte that is not 0 or 1
    auto bad = write_mask(
        dir, *f, [](size_t) { return true; }, "bad.mask");
    std::FILE* out = std::fopen(dir.file("bad.mask").c_str(), "r+b");
    std::fseek(out, 123, SEEK_SET);
    std::fputc(7, out);
    std::fclose(out);
    auto reopened = std::make_shared<const MaskFile>(MaskFile::open(dir.file("bad.mask"), *f));
    try {
      DataLoader l(f, {0, 1000}, {.micro_batch = 1, .seq_len = 8}, "train", reopened);
      FAIL();
    } catch (const CorruptData& e) {
      EXPECT_NE(std::string(e.what()).find("byte 7 at position 123"), std::string::npos)
          << e.what();
    }
  }
  {  // a byte changed in place after the check, while training reads the file
    auto changed = write_mask(
        dir, *f, [](size_t) { return true; }, "changed.mask");
    DataLoader l(f, {0, 1000}, {.micro_batch = 2, .seq_len = 8}, "train", changed);
    std::vector<int32_t> in(16), tg(16);
    l.next(in, tg);
    std::FILE* out = std::fopen(dir.file("changed.mask").c_str(), "r+b");
    std::fseek(out, 0, SEEK_SET);
    for (int i = 0; i < 1000; ++i) std::fputc(7, out);
    std::fclose(out);
    try {
      l.next(in, tg);
      FAIL() << "a mask byte of 7 was read as a target";
    } catch (const CorruptData& e) {
      EXPECT_NE(std::string(e.what()).find("changed.mask: byte 7 at position "), std::string::npos)
          << e.what();
    }
    EXPECT_THROW((void)l.trained_in_first(1), CorruptData);
  }
  {  // nothing to train on
    auto none = write_mask(
        dir, *f, [](size_t i) { return i == 0; }, "none.mask");
    try {
      DataLoader l(f, {0, 1000}, {.micro_batch = 1, .seq_len = 8}, "train", none);
      FAIL();
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("marks no target of the train split"), std::string::npos)
          << e.what();
    }
  }
  {  // targets only in the tail no whole sequence reaches: 124 sequences of 8 end at token 993
    auto tail = write_mask(
        dir, *f, [](size_t i) { return i >= 993; }, "tail.mask");
    try {
      DataLoader l(f, {0, 1000}, {.micro_batch = 1, .seq_len = 8}, "train", tail);
      FAIL();
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("124 sequences (tokens [1, 993))"), std::string::npos)
          << e.what();
    }
    auto one = write_mask(
        dir, *f, [](size_t i) { return i == 992; }, "one.mask");
    DataLoader l(f, {0, 1000}, {.micro_batch = 1, .seq_len = 8}, "train", one);
    EXPECT_EQ(l.targets_in_split(), 1u);
  }
  EXPECT_EQ(mask_path_beside("data/sft.u32"), "data/sft.mask");
  EXPECT_EQ(mask_path_beside("sft.bin"), "sft.mask");
}

}  // namespace
}  // namespace outcore::train
