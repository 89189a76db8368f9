// run_tokenize_job: how inputs become documents (blank lines, \r\n, chunk boundaries, one per
// file, JSON lines), the document layout and loss mask, the output formats (read back with
// engine/train's TokenFile), bad input (named by file and line; skipped and counted on request;
// existing outputs untouched), refused options, stops, and output that does not depend on the
// thread count or the chunk size.
#include "engine/data/tokenize_job.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <random>
#include <utility>

#include "common/cleanup.hpp"
#include "common/error.hpp"
#include "engine/data/staged_file.hpp"
#include "engine/train/token_file.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/common/temp_dir.hpp"
#include "tests/data/tiny_tokenizer.hpp"

namespace outcore::data {
namespace {

using test::json;
namespace fs = std::filesystem;
constexpr uint32_t kEos = 264;

class TokenizeJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    test::write_tiny_tokenizer_dir(dir_ / "tok");
    tokenizer_.emplace(Tokenizer::load((dir_ / "tok").string()));
  }

  std::string input(const std::string& name, const std::string& bytes) {
    const fs::path p = dir_ / name;
    test::write_file(p, bytes);
    return p.string();
  }

  TokenizeOptions options(std::vector<std::string> inputs, const std::string& out = "out") {
    TokenizeOptions o;
    o.inputs = std::move(inputs);
    o.out_prefix = (dir_ / out).string();
    o.threads = 2;
    return o;
  }

  // encode(text, special) + EOS: a text document's layout.
  std::vector<uint32_t> doc(std::string_view text) const {
    std::vector<uint32_t> ids;
    tokenizer_->encode(text, true, ids);
    if (ids.empty() || ids.back() != kEos) ids.push_back(kEos);
    return ids;
  }

  static std::vector<uint32_t> concat(const std::vector<std::vector<uint32_t>>& docs) {
    std::vector<uint32_t> all;
    for (const auto& d : docs) all.insert(all.end(), d.begin(), d.end());
    return all;
  }

  static std::vector<uint32_t> tokens_of(const std::string& path) {
    const train::TokenFile f = train::TokenFile::open(path);
    std::vector<uint32_t> out(f.size());
    for (size_t i = 0; i < f.size(); ++i) out[i] = f[i];
    return out;
  }

  // Every file in the directory whose name holds ".tmp-".
  std::vector<std::string> temporaries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_.path()))
      if (e.path().filename().string().find(".tmp-") != std::string::npos)
        out.push_back(e.path().string());
    return out;
  }

  test::TempDir dir_{"tokenize-job"};
  std::optional<Tokenizer> tokenizer_;
};

TEST_F(TokenizeJobTest, TextDocumentsAreRunsOfNonBlankLines) {
  const std::string in =
      input("a.txt",
            "the first\nline two\n\n\n  \t\nsecond\r\nstill second\r\n\r\nthird <|endoftext|>\n\n");
  const TokenizeResult r = run_tokenize_job(*tokenizer_, options({in}));
  EXPECT_EQ(r.totals.documents, 3u);
  EXPECT_TRUE(r.llmc);
  EXPECT_EQ(r.token_file, (dir_ / "out.bin").string());
  EXPECT_EQ(r.mask_file, "");
  // The line breaks inside a document stay; the last one goes. A document that ends with the
  // EOS text gets no second EOS.
  EXPECT_EQ(tokens_of(r.token_file),
            concat({doc("the first\nline two"), doc("second\r\nstill second"),
                    doc("third <|endoftext|>")}));
  EXPECT_EQ(r.totals.tokens, tokens_of(r.token_file).size());
  EXPECT_FALSE(fs::exists(dir_ / "out.mask"));
  EXPECT_TRUE(temporaries().empty());
}

// Documents cut from random text at every chunk size and thread count give the same file.
TEST_F(TokenizeJobTest, OutputIsTheSameForAnyChunkSizeAndThreadCount) {
  std::mt19937 rng(3);
  std::string text;
  std::vector<std::vector<uint32_t>> want;
  const char* words[] = {"the", "singing", "and", "a", "then", "\xC3\xA9t\xC3\xA9", "42"};
  for (int d = 0; d < 300; ++d) {
    std::string body;
    const int lines = 1 + static_cast<int>(rng() % 4);
    for (int l = 0; l < lines; ++l) {
      if (l > 0) body += rng() % 2 ? "\n" : "\r\n";
      for (int w = 0; w < 1 + static_cast<int>(rng() % 9); ++w)
        body += std::string(w ? " " : "") + words[rng() % 7];
    }
    text += body + (rng() % 3 ? "\n\n" : "\n \t\n\r\n");
    want.push_back(doc(body));
  }
  const std::string in = input("many.txt", text);
  std::string first;
  for (size_t chunk : {size_t{5}, size_t{64}, size_t{4096}, size_t{1} << 20}) {
    for (int threads : {1, 2}) {
      TokenizeOptions o = options({in}, "out");
      o.chunk_bytes = chunk;
      o.threads = threads;
      const TokenizeResult r = run_tokenize_job(*tokenizer_, o);
      EXPECT_EQ(r.totals.documents, want.size()) << chunk << " " << threads;
      const std::string bytes = test::slurp(r.token_file);
      if (first.empty()) {
        first = bytes;
        EXPECT_EQ(tokens_of(r.token_file), concat(want));
      }
      EXPECT_EQ(bytes, first) << "chunk " << chunk << ", threads " << threads;
    }
  }
}

// The same file given twice is read twice, and said so.
TEST_F(TokenizeJobTest, AnInputGivenTwiceIsWarnedAbout) {
  const std::string in = input("a.txt", "the end\n");
  fs::create_symlink(in, dir_ / "link.txt");
  outcore::test::LogCapture log;
  const TokenizeResult r =
      run_tokenize_job(*tokenizer_, options({in, in, (dir_ / "link.txt").string()}));
  EXPECT_EQ(tokens_of(r.token_file), concat({doc("the end"), doc("the end"), doc("the end")}));
  EXPECT_NE(log.text().find(in + " is given twice: its documents are written twice"),
            std::string::npos)
      << log.text();
  EXPECT_NE(log.text().find("link.txt is the same file as " + in), std::string::npos) << log.text();
}

TEST_F(TokenizeJobTest, DocPerFileMakesEachFileOneDocument) {
  const std::string a = input("a.txt", "one\n\ntwo\n"), b = input("b.txt", "three"),
                    empty = input("c.txt", "");
  TokenizeOptions o = options({a, b, empty});
  o.doc_per_file = true;
  const TokenizeResult r = run_tokenize_job(*tokenizer_, o);
  EXPECT_EQ(r.totals.documents, 2u);
  EXPECT_EQ(tokens_of(r.token_file), concat({doc("one\n\ntwo\n"), doc("three")}));
}

TEST_F(TokenizeJobTest, JsonLinesTakeTheTextKey) {
  const std::string in = input(
      "d.jsonl",
      "{\"text\": \"the first\", \"id\": 1}\n\n   \n{\"body\": \"x\", \"text\": \"a\\nb\"}\r\n"
      "{\"text\": \"\"}");
  const TokenizeResult r = run_tokenize_job(*tokenizer_, options({in}));
  EXPECT_EQ(r.totals.documents, 3u);
  EXPECT_EQ(tokens_of(r.token_file), concat({doc("the first"), doc("a\nb"), doc("")}));
  TokenizeOptions o = options({in});
  o.text_key = "body";
  o.skip_bad = true;
  const TokenizeResult body = run_tokenize_job(*tokenizer_, o);
  EXPECT_EQ(body.totals.documents, 1u);
  EXPECT_EQ(body.totals.skipped, 2u);
  EXPECT_EQ(tokens_of(body.token_file), doc("x"));
}

// A pair is encoded as the one text prompt + completion (as TRL does); its tokens up to the first
// that differs from the prompt's own encoding (special tokens added) are not targets, the rest and
// EOS are: a token that joins the prompt's end to the completion's start is a target.
TEST_F(TokenizeJobTest, PromptCompletionPairsWriteAMask) {
  const std::string in = input("sft.jsonl",
                               "{\"q\": \"the question\", \"a\": \" an answer\"}\n"
                               "{\"q\": \"and \", \"a\": \"the end<|endoftext|>\"}\n");
  TokenizeOptions o = options({in}, "sft");
  o.prompt_key = "q";
  o.completion_key = "a";
  const TokenizeResult r = run_tokenize_job(*tokenizer_, o);
  std::vector<uint32_t> want;
  std::vector<uint8_t> mask;
  auto add = [&](std::string_view prompt, std::string_view completion, bool eos) {
    std::vector<uint32_t> p, c;
    tokenizer_->encode(prompt, true, p);
    tokenizer_->encode(completion, false, c);
    if (eos) c.push_back(kEos);
    want.insert(want.end(), p.begin(), p.end());
    want.insert(want.end(), c.begin(), c.end());
    mask.insert(mask.end(), p.size(), 0);
    mask.insert(mask.end(), c.size(), 1);
  };
  add("the question", " an answer", true);  // the prompt's tokens, then the completion's
  // "and " + "the end": " the" (one token) joins the prompt's space to the completion's word.
  add("and", " the end<|endoftext|>", false);
  std::vector<uint32_t> joined;
  tokenizer_->encode(" the", false, joined);
  ASSERT_EQ(joined.size(), 1u);  // the merge this case is about
  EXPECT_EQ(tokens_of(r.token_file), want);
  EXPECT_EQ(r.mask_file, (dir_ / "sft.mask").string());
  const std::string bytes = test::slurp(r.mask_file);
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), mask);
  EXPECT_EQ(r.targets, static_cast<uint64_t>(std::count(mask.begin(), mask.end(), 1)));
}

// A template that puts BOS before and EOS after every text (a converted Llama 2 tokenizer with
// add_eos_token): a pair is encoded as one sequence, BOS prompt completion EOS, never with the
// template's EOS between prompt and completion; a text document keeps both.
TEST_F(TokenizeJobTest, APairIsEncodedAsOneSequenceUnderATemplateEndingInEos) {
  json t = test::tiny_tokenizer();
  t["added_tokens"].push_back({{"id", 265},
                               {"content", "<|bos|>"},
                               {"single_word", false},
                               {"lstrip", false},
                               {"rstrip", false},
                               {"normalized", false},
                               {"special", true}});
  t["model"]["vocab"]["<|bos|>"] = 265;
  auto special = [](const char* name, uint32_t id) {
    return json{{"id", name}, {"ids", {id}}, {"tokens", {name}}};
  };
  t["post_processor"] = {
      {"type", "TemplateProcessing"},
      {"single",
       {{{"SpecialToken", {{"id", "<|bos|>"}, {"type_id", 0}}}},
        {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
        {{"SpecialToken", {{"id", "<|endoftext|>"}, {"type_id", 0}}}}}},
      {"pair", json::array()},
      {"special_tokens",
       {{"<|bos|>", special("<|bos|>", 265)}, {"<|endoftext|>", special("<|endoftext|>", kEos)}}}};
  test::write_tokenizer_dir(dir_ / "bos_eos", t, json{{"eos_token", "<|endoftext|>"}});
  const Tokenizer tok = Tokenizer::load((dir_ / "bos_eos").string());
  const std::string in = input("pairs.jsonl", "{\"q\": \"the question\", \"a\": \" an answer\"}\n");
  TokenizeOptions o = options({in}, "bos_eos_out");
  o.prompt_key = "q";
  o.completion_key = "a";
  const TokenizeResult r = run_tokenize_job(tok, o);
  std::vector<uint32_t> prompt, completion;
  tok.encode("the question", false, prompt);
  tok.encode(" an answer", false, completion);
  std::vector<uint32_t> want = {265};
  want.insert(want.end(), prompt.begin(), prompt.end());
  want.insert(want.end(), completion.begin(), completion.end());
  want.push_back(kEos);  // the template's, once, at the end
  EXPECT_EQ(tokens_of(r.token_file), want);
  std::vector<uint8_t> mask(1 + prompt.size(), 0);
  mask.resize(want.size(), 1);
  const std::string bytes = test::slurp(r.mask_file);
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), mask);
  // A text document: the template around it, and no second EOS.
  std::vector<uint32_t> text = {265};
  tok.encode("the end", false, text);
  text.push_back(kEos);
  const TokenizeResult plain =
      run_tokenize_job(tok, options({input("t.txt", "the end\n")}, "bos_eos_text"));
  EXPECT_EQ(tokens_of(plain.token_file), text);
}

// A leftover named with this job's own pid (a job that ran as the same pid before, as every job
// in a container does as PID 1) is a killed job's: removed, not stepped around forever.
TEST_F(TokenizeJobTest, ALeftoverOfThisJobsOwnPidIsRemoved) {
  const std::string leftover = (dir_ / fmt::format("own.bin.tmp-{}", ::getpid())).string();
  test::write_file(leftover, "a killed job's partial output");
  const TokenizeResult r = run_tokenize_job(*tokenizer_, options({input("o.txt", "x\n")}, "own"));
  EXPECT_EQ(tokens_of(r.token_file), doc("x"));
  EXPECT_FALSE(fs::exists(leftover));
  for (const auto& e : fs::directory_iterator(dir_.path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
}

// A job killed between putting its token file and its mask in place leaves its commit marker
// (tokenize_commit_marker), which names its pid: the next job into the prefix replaces both
// files, removing the mask whatever its size, and removes the killed job's leftovers, found by
// the names it makes (never a path the marker holds, a link, a directory or another name);
// a job that fails its own commit then leaves the marker, naming both jobs. A marker a running
// job holds locked, or a file there that is not a marker, stops the job.
TEST_F(TokenizeJobTest, AJobKilledWhileCommittingIsRepairedByTheNext) {
  TokenizeOptions o =
      options({input("sft.jsonl", "{\"q\": \"the question\", \"a\": \"an answer\"}\n")}, "k");
  o.prompt_key = "q";
  o.completion_key = "a";
  const TokenizeResult r = run_tokenize_job(*tokenizer_, o);
  const std::string marker = tokenize_commit_marker(r.token_file);
  EXPECT_EQ(marker, (dir_ / "k.tokenize-commit").string());
  EXPECT_FALSE(fs::exists(marker));  // gone after a commit
  // A killed job's state: another mask (a size the token file does not have), its marker, and
  // its leftovers.
  const std::string pid = "4194000";  // above any pid this test starts; never checked as one
  test::write_file(r.mask_file, "\x01\x01\x01");
  const std::string aside = r.mask_file + ".old-" + pid, temp = r.token_file + ".tmp-" + pid,
                    temp2 = r.mask_file + ".tmp-" + pid + "-1";
  fs::create_directories(dir_ / "elsewhere");
  const std::string victim = (dir_ / "elsewhere" / "victim").string();
  test::write_file(victim, "the user's");
  const std::vector<std::string> kept = {
      (dir_ / ("k.other.tmp-" + pid)).string(),  // another name
      r.token_file + ".tmp-" + pid + "-x"};      // not a temporary's suffix
  for (const std::string& f : kept) test::write_file(f, "left");
  // Another killed job's temporary (the marker does not name it): with the prefix's lock held,
  // no job is writing it, and it goes too.
  const std::string other_pid = r.token_file + ".tmp-" + pid + "5";
  for (const std::string& f : {aside, temp, temp2, other_pid}) test::write_file(f, "left");
  fs::create_symlink(victim, r.token_file + ".tmp-" + pid + "-2");  // a link: kept, as its file
  fs::create_directories(r.mask_file + ".old-" + pid + "-3");       // a directory: kept
  test::write_file(marker, "outcore tokenize commit\npid " + pid + "\nleftover " + victim + "\n");
  const std::string text = input("t.txt", "the end\n");
  const TokenizeResult again = run_tokenize_job(*tokenizer_, options({text}, "k"));
  EXPECT_EQ(again.removed_mask, r.mask_file);
  EXPECT_FALSE(fs::exists(r.mask_file));
  EXPECT_FALSE(fs::exists(marker));
  for (const std::string& f : {aside, temp, temp2, other_pid}) EXPECT_FALSE(fs::exists(f)) << f;
  for (const std::string& f : kept) EXPECT_TRUE(fs::exists(f)) << f;
  EXPECT_TRUE(fs::is_symlink(r.token_file + ".tmp-" + pid + "-2"));
  EXPECT_TRUE(fs::is_directory(r.mask_file + ".old-" + pid + "-3"));
  EXPECT_EQ(test::slurp(victim), "the user's");
  EXPECT_EQ(tokens_of(again.token_file), doc("the end"));
  // A job killed after writing its marker under the temporary name and before renaming it: no
  // marker names it; the next job removes that temporary, and keeps a file of that name that
  // is not a marker's, one another job holds locked, and one of another name.
  const std::string marker_temp = marker + ".tmp-" + pid;
  const std::string users = marker + ".tmp-" + pid + "1", other_name = marker + ".tmp-" + pid + "x";
  const std::string held = marker + ".tmp-" + pid + "2";
  test::write_file(marker_temp, "outcore tokenize commit\npid " + pid + "\n");
  test::write_file(users, "the user's");
  test::write_file(other_name, "outcore tokenize commit\n");
  test::write_file(held, "outcore tokenize commit\n");
  const int lock_fd = ::open(held.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(lock_fd, 0);
  ASSERT_EQ(::flock(lock_fd, LOCK_EX), 0);
  run_tokenize_job(*tokenizer_, options({text}, "k"));
  EXPECT_FALSE(fs::exists(marker_temp));
  EXPECT_EQ(test::slurp(users), "the user's");
  EXPECT_TRUE(fs::exists(other_name));
  EXPECT_TRUE(fs::exists(held));
  ::close(lock_fd);
  for (const std::string& f : {users, other_name, held}) fs::remove(f);

  // A job that finds a killed job's marker and fails its own commit (the token file's name is
  // a directory now) leaves a marker naming both: the pair may still be mixed.
  test::write_file(marker, "outcore tokenize commit\npid " + pid + "\n");
  const std::string moved = again.token_file + ".moved";
  TokenizeOptions failing = o;
  failing.progress_interval = std::chrono::milliseconds(0);
  failing.on_progress = [&](const TokenizeProgress&) {
    if (fs::exists(moved)) return;
    fs::rename(again.token_file, moved);
    fs::create_directories(fs::path(again.token_file) / "sub");
  };
  EXPECT_THROW(run_tokenize_job(*tokenizer_, failing), IoError);
  ASSERT_TRUE(fs::exists(marker));
  const std::string left = test::slurp(marker);
  EXPECT_NE(left.find("pid " + std::to_string(getpid()) + "\n"), std::string::npos) << left;
  EXPECT_NE(left.find("pid " + pid + "\n"), std::string::npos) << left;
  fs::remove_all(again.token_file);
  fs::rename(moved, again.token_file);

  // A marker its job holds locked (committing now) stops the job; so does a file there that is
  // not a marker. Both are kept, as is the token file.
  const std::string before = test::slurp(again.token_file);
  for (const bool locked : {true, false}) {
    const std::string content =
        locked ? "outcore tokenize commit\npid 1\n" : std::string("the user's notes\n");
    test::write_file(marker, content);
    const int fd = ::open(marker.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    if (locked) {
      ASSERT_EQ(::flock(fd, LOCK_EX), 0);
    }
    try {
      run_tokenize_job(*tokenizer_, options({text}, "k"));
      ADD_FAILURE() << "the job ran past " << content;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(locked ? "is putting these outputs in place now"
                                                  : "it holds something else"),
                std::string::npos)
          << e.what();
    }
    ::close(fd);
    EXPECT_EQ(test::slurp(marker), content);
    EXPECT_EQ(test::slurp(again.token_file), before);
  }
  fs::remove(marker);
}

// Plain text written over pairs' output: the pairs' mask goes (train would otherwise pair it
// with the new tokens); a failed job leaves both old files as they were.
TEST_F(TokenizeJobTest, TextReplacingPairsRemovesTheirMask) {
  const std::string pairs = input("sft.jsonl", "{\"q\": \"the question\", \"a\": \"an answer\"}\n");
  TokenizeOptions o = options({pairs}, "data");
  o.prompt_key = "q";
  o.completion_key = "a";
  const TokenizeResult first = run_tokenize_job(*tokenizer_, o);
  ASSERT_TRUE(fs::exists(first.mask_file));
  const std::string old_tokens = test::slurp(first.token_file);
  const std::string old_mask = test::slurp(first.mask_file);

  const std::string bad = input("bad.jsonl", "{\"text\": \"fine\"}\n{\"text\": 3}\n");
  EXPECT_THROW(run_tokenize_job(*tokenizer_, options({bad}, "data")), BadDocument);
  EXPECT_EQ(test::slurp(first.token_file), old_tokens);
  EXPECT_EQ(test::slurp(first.mask_file), old_mask);

  const std::string text = input("text.jsonl", "{\"text\": \"the question an answer\"}\n");
  const TokenizeResult second = run_tokenize_job(*tokenizer_, options({text}, "data"));
  EXPECT_EQ(second.token_file, first.token_file);
  EXPECT_EQ(second.mask_file, "");
  EXPECT_EQ(second.removed_mask, first.mask_file);
  EXPECT_FALSE(fs::exists(first.mask_file));
  EXPECT_EQ(tokens_of(second.token_file), doc("the question an answer"));
  // With no mask there, nothing is removed or reported.
  EXPECT_EQ(run_tokenize_job(*tokenizer_, options({text}, "data")).removed_mask, "");
  // The mask checked at the start is the one removed: a file moved to its name while the job
  // runs is kept, and the job fails leaving the earlier token file.
  {
    const TokenizeResult pairs_out = run_tokenize_job(*tokenizer_, o);
    const std::string tokens_before = test::slurp(pairs_out.token_file);
    TokenizeOptions swapped = options({text}, "data");
    swapped.progress_interval = std::chrono::milliseconds(0);
    bool moved = false;
    swapped.on_progress = [&](const TokenizeProgress&) {
      if (std::exchange(moved, true)) return;
      std::ofstream(dir_ / "users.mask") << "the user's file";
      fs::rename(dir_ / "users.mask", pairs_out.mask_file);
    };
    try {
      run_tokenize_job(*tokenizer_, swapped);
      ADD_FAILURE() << "a file moved to PREFIX.mask during the job was removed";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(pairs_out.mask_file + " was replaced while the job ran"),
                std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(moved);
    EXPECT_EQ(test::slurp(pairs_out.mask_file), "the user's file");
    EXPECT_EQ(test::slurp(pairs_out.token_file), tokens_before);
    fs::remove(pairs_out.mask_file);
  }
  // A file at PREFIX.mask that is an input is never removed: refused.
  const std::string named_mask = input("data.mask", "plain text in a file named like a mask\n");
  EXPECT_THROW(run_tokenize_job(*tokenizer_, options({named_mask}, "data")), InvalidArgument);
  EXPECT_EQ(test::slurp(named_mask), "plain text in a file named like a mask\n");
  // Nor is a PREFIX.mask that is not the loss mask of the token file replaced: with no token
  // file beside it, or with one of another token count. Refused, naming it; both files kept.
  const std::string users = "the user's own mask";
  for (const bool with_tokens : {false, true}) {
    SCOPED_TRACE(with_tokens ? "beside a token file of another count" : "with no token file");
    const fs::path prefix = dir_ / (with_tokens ? "mine" : "lone");
    if (with_tokens) {
      ASSERT_NO_THROW(run_tokenize_job(*tokenizer_, options({text}, "mine")));
    }
    const std::string tokens_before =
        with_tokens ? test::slurp(prefix.string() + ".bin") : std::string();
    std::ofstream(prefix.string() + ".mask") << users;
    try {
      run_tokenize_job(*tokenizer_, options({text}, prefix.filename().string()));
      ADD_FAILURE() << "a mask that is not the replaced token file's was removed";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(prefix.string() + ".mask is not the loss mask"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(test::slurp(prefix.string() + ".mask"), users);
    if (with_tokens) {
      EXPECT_EQ(test::slurp(prefix.string() + ".bin"), tokens_before);
    } else {
      EXPECT_FALSE(fs::exists(prefix.string() + ".bin"));
    }
  }
  // A link at PREFIX.mask (the data loader would follow it) is refused, the link and its file
  // kept.
  const fs::path linked = dir_ / "linked";
  ASSERT_NO_THROW(run_tokenize_job(*tokenizer_, options({text}, "linked")));
  std::ofstream(dir_ / "elsewhere.mask") << users;
  fs::create_symlink(dir_ / "elsewhere.mask", linked.string() + ".mask");
  EXPECT_THROW(run_tokenize_job(*tokenizer_, options({text}, "linked")), InvalidArgument);
  EXPECT_TRUE(fs::is_symlink(linked.string() + ".mask"));
  EXPECT_EQ(test::slurp((dir_ / "elsewhere.mask").string()), users);
}

// Pairs write their mask over PREFIX.mask only where it is the loss mask of the token file they
// replace: a user's file there (with no token file, or beside one of another count), or a link,
// is refused naming it, and every file is kept.
TEST_F(TokenizeJobTest, PairsWriteOverOnlyTheMaskOfTheTokenFileTheyReplace) {
  const std::string pairs = input("sft.jsonl", "{\"q\": \"the question\", \"a\": \"an answer\"}\n");
  const auto pairs_job = [&](const std::string& prefix) {
    TokenizeOptions o = options({pairs}, prefix);
    o.prompt_key = "q";
    o.completion_key = "a";
    return o;
  };
  // Their own earlier pair is replaced.
  const TokenizeResult first = run_tokenize_job(*tokenizer_, pairs_job("data"));
  EXPECT_NO_THROW(run_tokenize_job(*tokenizer_, pairs_job("data")));
  EXPECT_EQ(test::slurp(first.mask_file).size(), tokens_of(first.token_file).size());

  const std::string users = "the user's own notes, not a loss mask";  // not the tokens' count
  const std::string text = input("text.jsonl", "{\"text\": \"the question an answer\"}\n");
  for (const char* what : {"no token file", "a token file of another count", "a link"}) {
    SCOPED_TRACE(what);
    const std::string w = what;
    const fs::path prefix = dir_ / (w == "no token file" ? "lone" : w == "a link" ? "ln" : "mine");
    if (w != "no token file") {
      ASSERT_NO_THROW(run_tokenize_job(*tokenizer_, options({text}, prefix.filename().string())));
    }
    const std::string tokens_before =
        w == "no token file" ? std::string() : test::slurp(prefix.string() + ".bin");
    const fs::path users_file =
        w == "a link" ? dir_ / "elsewhere.txt" : fs::path(prefix.string() + ".mask");
    std::ofstream(users_file) << users;
    if (w == "a link") {
      // A link to a file of the right size: still not the mask's own file.
      test::write_file(users_file, std::string(tokens_of(prefix.string() + ".bin").size(), 'x'));
      fs::create_symlink(users_file, prefix.string() + ".mask");
    }
    const std::string user_bytes = test::slurp(users_file);
    try {
      run_tokenize_job(*tokenizer_, pairs_job(prefix.filename().string()));
      ADD_FAILURE() << "pairs wrote their mask over " << prefix.string() << ".mask";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(
          std::string(e.what()).find(
              prefix.string() + (w == "a link" ? ".mask is a link" : ".mask is not the loss mask")),
          std::string::npos)
          << e.what();
    }
    EXPECT_EQ(test::slurp(users_file), user_bytes);
    if (w == "a link") {
      EXPECT_TRUE(fs::is_symlink(prefix.string() + ".mask"));
    }
    if (w == "no token file") {
      EXPECT_FALSE(fs::exists(prefix.string() + ".bin"));
    } else {
      EXPECT_EQ(test::slurp(prefix.string() + ".bin"), tokens_before);
    }
  }
}

// A job whose token file cannot be renamed into place (here a directory took its name while
// the job ran) leaves the earlier token file and its loss mask as they were, whether it
// replaced that mask (pairs) or was to remove it (plain text), and leaves no file of its own.
TEST_F(TokenizeJobTest, AFailedCommitLeavesTheEarlierTokensAndMaskAsTheyWere) {
  const std::string pairs = input("sft.jsonl", "{\"q\": \"the question\", \"a\": \"an answer\"}\n");
  TokenizeOptions first = options({pairs}, "data");
  first.prompt_key = "q";
  first.completion_key = "a";
  const TokenizeResult r = run_tokenize_job(*tokenizer_, first);
  const std::string old_mask = test::slurp(r.mask_file);
  const std::string old_tokens = test::slurp(r.token_file);
  const std::string other = input("other.jsonl", "{\"q\": \"and\", \"a\": \"ends here\"}\n");
  // What fails: the token file's rename (a directory took its name while the job ran), or the
  // new mask's (its temporary went), with pairs or plain text written over the pairs.
  for (const auto& [text, mask_fails] : {std::pair{false, false}, {true, false}, {false, true}}) {
    SCOPED_TRACE(std::string(text ? "plain text over pairs" : "pairs over pairs") +
                 (mask_fails ? ", the mask's rename failing" : ", the token file's failing"));
    TokenizeOptions o = options({other}, "data");
    if (!text) {
      o.prompt_key = "q";
      o.completion_key = "a";
    } else {
      o.text_key = "a";
    }
    o.progress_interval = std::chrono::seconds(0);
    const fs::path moved = dir_ / "data.bin.moved";
    bool done = false;
    o.on_progress = [&](const TokenizeProgress&) {  // before the commit
      if (std::exchange(done, true)) return;
      if (mask_fails) {
        for (const std::string& t : temporaries())
          if (fs::path(t).filename().string().starts_with("data.mask.tmp-")) fs::remove(t);
        return;
      }
      fs::rename(r.token_file, moved);
      fs::create_directory(r.token_file);
      test::write_file(fs::path(r.token_file) / "a file", "keeps the directory non-empty");
    };
    EXPECT_THROW(run_tokenize_job(*tokenizer_, o), IoError);
    if (!mask_fails) {
      fs::remove_all(r.token_file);
      fs::rename(moved, r.token_file);
    }
    EXPECT_EQ(test::slurp(r.mask_file), old_mask);
    EXPECT_EQ(test::slurp(r.token_file), old_tokens);
    for (const auto& e : fs::directory_iterator(dir_.path()))
      EXPECT_EQ(e.path().filename().string().find(".old-"), std::string::npos) << e.path();
    EXPECT_TRUE(temporaries().empty());
  }
}

// PREFIX.mask beside the token file of the other extension (a vocabulary on the other side of
// 65536) may be that file's mask: a job writing PREFIX.u32 neither replaces nor removes it.
TEST_F(TokenizeJobTest, AMaskBesideTheOtherExtensionsTokenFileIsLeftAlone) {
  const std::string pairs = input("sft.jsonl", "{\"q\": \"the question\", \"a\": \"an answer\"}\n");
  TokenizeOptions o = options({pairs}, "data");
  o.prompt_key = "q";
  o.completion_key = "a";
  const TokenizeResult r = run_tokenize_job(*tokenizer_, o);
  const std::string old_mask = test::slurp(r.mask_file);
  test::write_tiny_tokenizer_dir(dir_ / "big", 70000);
  const Tokenizer big = Tokenizer::load((dir_ / "big").string());
  EXPECT_THROW(run_tokenize_job(big, options({input("a.txt", "the end\n")}, "data")),
               InvalidArgument);
  EXPECT_THROW(run_tokenize_job(big, o), InvalidArgument);
  EXPECT_EQ(test::slurp(r.mask_file), old_mask);
  EXPECT_FALSE(fs::exists(dir_ / "data.u32"));
}

TEST_F(TokenizeJobTest, LargeVocabulariesWriteRawUint32) {
  test::write_tiny_tokenizer_dir(dir_ / "big", 70000);
  const Tokenizer big = Tokenizer::load((dir_ / "big").string());
  EXPECT_EQ(big.vocab_size(), 70001u);
  const TokenizeResult r = run_tokenize_job(big, options({input("a.txt", "the end\n")}));
  EXPECT_FALSE(r.llmc);
  EXPECT_EQ(r.token_file, (dir_ / "out.u32").string());
  std::vector<uint32_t> want;
  big.encode("the end", true, want);
  want.push_back(70000);
  EXPECT_EQ(tokens_of(r.token_file), want);
  EXPECT_EQ(fs::file_size(r.token_file), 4 * want.size());
  // A user's file at that name whose size is a whole number of 32-bit words is not a token file
  // for that: its words are no token ids. It is kept; the job's own file is replaced.
  for (const std::string& user :
       {std::string("userbin\n"), std::string("\xff\xfe\xfd\xfc\x00\x01\x02\x03", 8)}) {
    test::write_file(dir_ / "mine.u32", user);
    EXPECT_THROW(run_tokenize_job(big, options({input("a.txt", "the end\n")}, "mine")),
                 InvalidArgument);
    EXPECT_EQ(test::slurp(dir_ / "mine.u32"), user);
  }
  const TokenizeResult again = run_tokenize_job(big, options({input("a.txt", "the end\n")}));
  EXPECT_EQ(tokens_of(again.token_file), want);
}

// Each kind of bad input names the file and the line, and leaves an existing output as it was.
TEST_F(TokenizeJobTest, BadInputNamesFileAndLineAndTouchesNothing) {
  test::write_file(dir_ / "out.bin", test::llmc_token_file({7, 8, 9}));
  struct Case {
    std::string name, bytes, want;
  };
  const std::vector<Case> cases = {
      {"utf8.txt", "good\n\nfirst line\nsecond \xFF line\n",
       "utf8.txt:4: ill-formed UTF-8 (byte 0xFF at byte 8 of the line)"},
      {"json.jsonl", "{\"text\": \"ok\"}\n\n{\"text\": oops}\n", "json.jsonl:3: not valid JSON"},
      {"key.jsonl", "{\"text\": \"ok\"}\n{\"other\": 1}\n", "key.jsonl:2: no key \"text\""},
      {"type.jsonl", "{\"text\": 5}\n", "type.jsonl:1: \"text\" is a number, not a string"},
      {"array.jsonl", "[1, 2]\n", "array.jsonl:1: a JSON line must be an object, not an array"},
      {"pretty.json", "[\n  {\"text\": \"ok\"}\n]\n",
       "; .json and .jsonl inputs are JSON lines, one object per line, not one JSON array "
       "(convert it with jq -c '.[]')"},
      {"utf8.jsonl", "{\"text\": \"\xC3\"}\n", "utf8.jsonl:1: ill-formed UTF-8"},
  };
  for (const Case& c : cases) {
    const std::string in = input(c.name, c.bytes);
    try {
      run_tokenize_job(*tokenizer_, options({input("first.txt", "fine\n"), in}));
      ADD_FAILURE() << c.name << ": no error";
    } catch (const BadDocument& e) {
      EXPECT_NE(std::string(e.what()).find(c.want), std::string::npos)
          << "want \"" << c.want << "\" in: " << e.what();
      EXPECT_EQ(e.file(), in);
    }
    EXPECT_EQ(test::slurp(dir_ / "out.bin"), test::llmc_token_file({7, 8, 9})) << c.name;
    EXPECT_TRUE(temporaries().empty()) << c.name;
    EXPECT_EQ(test::slurp(in), c.bytes) << "an input was changed";
  }
}

TEST_F(TokenizeJobTest, SkipBadLeavesOutAndCountsBadDocuments) {
  const std::string in =
      input("mixed.jsonl",
            "{\"text\": \"one\"}\n{bad\n{\"text\": \"two\"}\n{\"text\": \"\xFF\"}\n"
            "{\"no\": 1}\n{\"text\": \"three\"}\n{\"text\": \"x\", \"n\": 1e400}\n");
  TokenizeOptions o = options({in});
  o.skip_bad = true;
  std::vector<uint64_t> lines;
  std::string overflow;
  o.on_skipped = [&](const BadDocument& b) {
    lines.push_back(b.line());
    if (b.line() == 7) overflow = b.what();
  };
  const TokenizeResult r = run_tokenize_job(*tokenizer_, o);
  EXPECT_EQ(r.totals.documents, 3u);
  EXPECT_EQ(r.totals.skipped, 4u);
  EXPECT_EQ(lines, (std::vector<uint64_t>{2, 4, 5, 7}));
  // A number beyond double's range is a bad line like any other (named, and skippable).
  EXPECT_NE(overflow.find("mixed.jsonl:7: not valid JSON: number overflow"), std::string::npos)
      << overflow;
  EXPECT_EQ(tokens_of(r.token_file), concat({doc("one"), doc("two"), doc("three")}));
}

// A document the tokenizer cannot encode (a pre-tokenizer pattern's match limit reached on it)
// is a bad document like any other: named by file and line, and skipped with skip_bad.
TEST_F(TokenizeJobTest, ADocumentTheTokenizerCannotEncodeIsABadDocument) {
  json j = test::tiny_tokenizer();
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", "(a|aa)+$"}}}, {"behavior", "Isolated"}},
        j["pre_tokenizer"]}}};
  test::write_tokenizer_dir(dir_ / "slow", j);
  const Tokenizer slow = Tokenizer::load((dir_ / "slow").string());
  const std::string in = input("docs.txt", "the end\n\n" + std::string(60, 'a') + "b\n\nthe end\n");
  try {
    run_tokenize_job(slow, options({in}));
    ADD_FAILURE() << "no error";
  } catch (const BadDocument& e) {
    EXPECT_EQ(e.line(), 3u);
    EXPECT_NE(e.reason().find("match limit"), std::string::npos) << e.what();
  }
  TokenizeOptions o = options({in});
  o.skip_bad = true;
  const TokenizeResult r = run_tokenize_job(slow, o);
  EXPECT_EQ(r.totals.documents, 2u);
  EXPECT_EQ(r.totals.skipped, 1u);
}

TEST_F(TokenizeJobTest, RefusedOptionsWriteNothing) {
  const std::string text = input("a.txt", "text\n"), jsonl = input("a.jsonl", "{}\n");
  auto refused = [&](TokenizeOptions o, const std::string& want) {
    try {
      run_tokenize_job(*tokenizer_, o);
      ADD_FAILURE() << "no error; want " << want;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  TokenizeOptions o = options({text});
  o.prompt_key = "q";
  refused(o, "need both keys");
  o.completion_key = "a";
  refused(o, "pairs are read from JSON lines");
  o = options({jsonl});
  o.doc_per_file = true;
  refused(o, "applies to plain text");
  refused(options({}), "no input files");
  // An output that is an input: the input is left as it was.
  const std::string victim = input("victim.bin", "precious");
  refused(options({victim}, "victim"), "would overwrite input");
  EXPECT_EQ(test::slurp(victim), "precious");
  refused(options({text}, "no/such/dir/out"), "does not exist");
  fs::create_directories(dir_ / "isdir.bin");
  refused(options({text}, "isdir"), "not a regular file");
  // A file at the output's name that is not a token file (a user's, named alike) is kept: only
  // a token file is replaced.
  test::write_file(dir_ / "thesis.bin", "my thesis draft, not a token file\n");
  refused(options({text}, "thesis"), "thesis.bin exists and is not a token file");
  EXPECT_EQ(test::slurp(dir_ / "thesis.bin"), "my thesis draft, not a token file\n");
  TokenizeOptions whole = options({text}, "whole");
  run_tokenize_job(*tokenizer_, whole);
  const std::string first = test::slurp(dir_ / "whole.bin");
  test::write_file(dir_ / "whole.bin", first + "x");  // a byte past the header's count
  refused(whole, "whole.bin exists and is not a token file");
  test::write_file(dir_ / "whole.bin", first);
  run_tokenize_job(*tokenizer_, whole);  // a token file is replaced
  EXPECT_EQ(test::slurp(dir_ / "whole.bin"), first);
  EXPECT_TRUE(temporaries().empty());
}

TEST_F(TokenizeJobTest, OversizedDocumentsAreRefused) {
  TokenizeOptions o = options({input("big.txt", "short\n\n" + std::string(100, 'x') + "\n")});
  o.max_document_bytes = 50;
  o.chunk_bytes = 16;
  EXPECT_THROW(run_tokenize_job(*tokenizer_, o), BadDocument);
  o.inputs = {input("big.jsonl", "{\"text\": \"" + std::string(100, 'x') + "\"}\n")};
  EXPECT_THROW(run_tokenize_job(*tokenizer_, o), BadDocument);
  EXPECT_TRUE(temporaries().empty());
}

TEST_F(TokenizeJobTest, AStopRequestWritesNothing) {
  test::write_file(dir_ / "out.bin", test::llmc_token_file({7, 8, 9}));
  std::atomic<bool> stop{true};
  TokenizeOptions o = options({input("a.txt", "some text\n")});
  o.stop = &stop;
  EXPECT_THROW(run_tokenize_job(*tokenizer_, o), Interrupted);
  EXPECT_EQ(test::slurp(dir_ / "out.bin"), test::llmc_token_file({7, 8, 9}));
  EXPECT_TRUE(temporaries().empty());
}

TEST_F(TokenizeJobTest, ProgressIsReported) {
  TokenizeOptions o = options({input("a.txt", "one\n\ntwo\n")});
  std::vector<TokenizeProgress> seen;
  o.on_progress = [&seen](const TokenizeProgress& p) { seen.push_back(p); };
  const TokenizeResult r = run_tokenize_job(*tokenizer_, o);
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back().documents, 2u);
  EXPECT_EQ(seen.back().tokens, r.totals.tokens);
  EXPECT_EQ(seen.back().bytes_read, 9u);
}

}  // namespace
}  // namespace outcore::data

namespace outcore::data {
namespace {

// A staged output's temporary is registered for cleanup while it is one (a process ended at
// once by a second signal removes it); once committed, a cleanup never touches the target.
TEST(StagedFileTest, TheTemporaryIsRemovedByACleanupAndTheCommittedTargetIsNot) {
  test::TempDir dir("staged");
  const std::string target = (dir / "out.bin").string();
  {
    StagedFile f(target);
    f.append("abc", 3);
    f.finish();
    EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
    EXPECT_EQ(cleanup::remove_registered_files(), 1u);
    EXPECT_TRUE(fs::is_empty(dir.path()));
  }
  StagedFile g(target);
  g.append("xyz", 3);
  g.finish();
  g.commit();
  EXPECT_EQ(cleanup::remove_registered_files(), 0u);
  EXPECT_TRUE(fs::exists(target));
}

}  // namespace
}  // namespace outcore::data
