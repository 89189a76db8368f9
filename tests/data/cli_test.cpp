// `outcore tokenize` run as a user runs it: text, JSON lines and prompt/completion inputs, the
// files written (read back with engine/train's TokenFile), --skip-bad, one error line naming
// file:line with exit 2, --log-json, and output independent of --threads.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "common/lock_file.hpp"
#include "engine/data/tokenizer.hpp"
#include "engine/train/token_file.hpp"
#include "tests/common/run_command.hpp"
#include "tests/common/temp_dir.hpp"
#include "tests/data/tiny_tokenizer.hpp"

namespace outcore::data {
namespace {

using test::json;
using test::shell_quote;
namespace fs = std::filesystem;

struct CliResult {
  int rc = -1;
  std::string out, err;
};

class TokenizeCliTest : public ::testing::Test {
 protected:
  void SetUp() override { test::write_tiny_tokenizer_dir(dir_ / "tok"); }

  std::string input(const std::string& name, const std::string& bytes) {
    test::write_file(dir_ / name, bytes);
    return (dir_ / name).string();
  }

  // Runs `outcore tokenize --tokenizer DIR/tok <args>`.
  CliResult run(const std::string& args, const std::string& tokenizer = "tok") {
    const std::string out = (dir_ / "stdout").string(), err = (dir_ / "stderr").string();
    std::string ignored;
    CliResult r;
    r.rc =
        outcore::testing::run_command("(" + std::string(OUTCORE_CLI) + " tokenize --tokenizer " +
                                          shell_quote((dir_ / tokenizer).string()) + " " + args +
                                          " >" + shell_quote(out) + " 2>" + shell_quote(err) + ")",
                                      ignored);
    r.out = test::slurp(out);
    r.err = test::slurp(err);
    return r;
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  test::TempDir dir_{"tokenize-cli"};
};

int error_lines(const std::string& err) {
  int n = 0;
  std::istringstream in(err);
  for (std::string l; std::getline(in, l);) n += l.rfind("error:", 0) == 0;
  return n;
}

TEST_F(TokenizeCliTest, TextAndJsonLinesBecomeOneTokenFile) {
  const std::string text = input("a.txt", "the first\ndocument\n\nthe second\n");
  const std::string jsonl = input("b.jsonl", "{\"text\": \"and a third\"}\n");
  const CliResult r =
      run("--input " + shell_quote(text) + " " + shell_quote(jsonl) + " --out " +
          shell_quote(path("out")) + " --log-json " + shell_quote(path("log.jsonl")));
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("tokenized 3 documents (0 skipped as bad) from 2 files"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("out.bin (llm.c format"), std::string::npos) << r.out;
  const Tokenizer tok = Tokenizer::load(path("tok"));
  std::vector<uint32_t> want;
  for (const char* d : {"the first\ndocument", "the second", "and a third"}) {
    tok.encode(d, true, want);
    want.push_back(264);
  }
  const train::TokenFile f = train::TokenFile::open(path("out.bin"));
  ASSERT_EQ(f.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(f[i], want[i]) << i;
  // --log-json: JSON lines, the last one the totals.
  std::ifstream log(path("log.jsonl"));
  json last;
  for (std::string line; std::getline(log, line);) last = json::parse(line);
  EXPECT_EQ(last["event"], "done");
  EXPECT_EQ(last["documents"], 3);
  EXPECT_EQ(last["tokens"], want.size());
}

TEST_F(TokenizeCliTest, PromptCompletionPairsWriteTokensAndMask) {
  const std::string in =
      input("sft.jsonl", "{\"p\": \"the q\", \"c\": \"and a\"}\n{\"p\": \"x\", \"c\": \"y\"}\n");
  const CliResult r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("sft")) +
                          " --prompt-key p --completion-key c");
  ASSERT_EQ(r.rc, 0) << r.err;
  const train::TokenFile f = train::TokenFile::open(path("sft.bin"));
  const std::string mask = test::slurp(path("sft.mask"));
  ASSERT_EQ(mask.size(), f.size());
  // "the q" -> 't', 257, ' ', 'q' (mask 0); " and a"... "and a" -> 263, 261 (mask 1); EOS (1).
  EXPECT_EQ(f[0], static_cast<uint32_t>('t'));
  EXPECT_EQ(f[4], 263u);
  EXPECT_EQ(f[6], 264u);
  EXPECT_EQ(mask.substr(0, 7), std::string("\0\0\0\0\1\1\1", 7));
  EXPECT_NE(r.out.find("sft.mask (one byte per token; 5 of 10 tokens are training targets)"),
            std::string::npos)
      << r.out;
}

TEST_F(TokenizeCliTest, BadInputIsOneLineWithFileAndLineAndExit2) {
  test::write_file(dir_ / "out.bin", test::llmc_token_file({7, 8, 9}));
  const std::string in = input("bad.jsonl", "{\"text\": \"fine\"}\n{\"text\": \"fine\"}\n{oops}\n");
  const CliResult r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("out")));
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_EQ(error_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("error: " + in + ":3: not valid JSON"), std::string::npos) << r.err;
  EXPECT_EQ(test::slurp(dir_ / "out.bin"), test::llmc_token_file({7, 8, 9}));
  // --skip-bad: written, the bad line counted and named.
  const CliResult skipped =
      run("--skip-bad --input " + shell_quote(in) + " --out " + shell_quote(path("out")));
  ASSERT_EQ(skipped.rc, 0) << skipped.err;
  EXPECT_NE(skipped.out.find("tokenized 2 documents (1 skipped as bad)"), std::string::npos)
      << skipped.out;
  EXPECT_NE(skipped.err.find("skipped: " + in + ":3: not valid JSON"), std::string::npos)
      << skipped.err;
  EXPECT_NE(test::slurp(dir_ / "out.bin"), test::llmc_token_file({7, 8, 9}));
  // --log-json says how a failed job ended; every document bad is no output at all.
  test::write_file(dir_ / "out.bin", test::llmc_token_file({7, 8, 9}));
  const std::string all_bad = input("all_bad.jsonl", "{oops}\n[1]\n");
  const CliResult none = run("--skip-bad --input " + shell_quote(all_bad) + " --out " +
                             shell_quote(path("out")) + " --log-json " + shell_quote(path("log")));
  EXPECT_EQ(none.rc, 2) << none.err;
  EXPECT_NE(none.err.find("error: no tokens to write: every document was skipped as bad"),
            std::string::npos)
      << none.err;
  EXPECT_EQ(test::slurp(dir_ / "out.bin"), test::llmc_token_file({7, 8, 9}));
  std::ifstream log(path("log"));
  json last;
  for (std::string line; std::getline(log, line);) last = json::parse(line);
  EXPECT_EQ(last["event"], "error") << last.dump();
  EXPECT_NE(last.value("message", "").find("every document was skipped"), std::string::npos);
}

// A document longer than --max-document-mb (64 by default: tokenizing one takes several times
// its size in memory) is bad input naming its file and line, and the flag lets a longer one
// in.
TEST_F(TokenizeCliTest, ADocumentLongerThanTheLimitIsRefusedNamingItsLine) {
  std::string text = "first\n\n";
  for (int i = 0; i < 15000; ++i) text += "the quick brown fox jumps over the lazy dog. ";
  const std::string in = input("long.txt", text + "\n");  // one 675 KB document from line 3
  CliResult r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("long")) +
                    " --max-document-mb 1");
  ASSERT_EQ(r.rc, 0) << r.err;
  for (int i = 0; i < 15000; ++i) text += "the quick brown fox jumps over the lazy dog. ";
  test::write_file(in, text + "\n");  // 1.35 MB now
  r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("long")) +
          " --max-document-mb 1");
  EXPECT_EQ(r.rc, 2) << r.err;
  EXPECT_NE(r.err.find(in + ":3: a document longer than 1048576 bytes (documents are separated "
                            "by blank lines; --max-document-mb raises it)"),
            std::string::npos)
      << r.err;
  r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("long")) +
          " --max-document-mb 0");
  EXPECT_EQ(r.rc, 2) << r.err;
}

TEST_F(TokenizeCliTest, RefusedInvocationsExit2) {
  const std::string in = input("a.txt", "text\n");
  CliResult r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("out")), "nope");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("not a directory"), std::string::npos) << r.err;
  r = run("--input " + shell_quote(path("missing.txt")) + " --out " + shell_quote(path("out")));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("missing.txt: no such file"), std::string::npos) << r.err;
  const std::string victim = input("data.bin", "precious");
  r = run("--input " + shell_quote(victim) + " --out " + shell_quote(path("data")));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("refusing to overwrite an input"), std::string::npos) << r.err;
  EXPECT_EQ(test::slurp(victim), "precious");
  r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("o")) + " --prompt-key p");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--prompt-key needs --completion-key"), std::string::npos) << r.err;
  // Not into a swap directory: a run's swap file of that name would replace the output, and the
  // run's end would remove it.
  fs::create_directories(dir_.path() / "sw/outcore_swap/rank0/param");
  r = run("--input " + shell_quote(in) + " --out " +
          shell_quote(path("sw/outcore_swap/rank0/param/0")));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("inside the swap directory " + path("sw/outcore_swap")), std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(dir_.path() / "sw/outcore_swap/rank0/param/0.bin"));
  r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("o")) +
          " --prompt-key p --completion-key p");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--prompt-key and --completion-key are both \"p\""), std::string::npos)
      << r.err;
  // A prefix that names a directory would write the hidden files DIR/.bin.
  r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("o") + "/"));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("not a directory: add a name"), std::string::npos) << r.err;
  for (const char* dot : {"/.", "/.."}) {  // DIR/. would write DIR/..bin
    r = run("--input " + shell_quote(in) + " --out " + shell_quote(dir_.path().string() + dot));
    EXPECT_EQ(r.rc, 2) << dot;
    EXPECT_NE(r.err.find("not a directory: add a name"), std::string::npos) << r.err;
  }
  // --text-key on a file read as plain text would be dropped (its JSON tokenized as text).
  const std::string ndjson = input("docs.ndjson", "{\"body\": \"the\"}\n{\"body\": \"q\"}\n");
  const std::string lines_txt = input("docs.txt", "{\"body\": \"the\"}\n");
  r = run("--input " + shell_quote(lines_txt) + " --out " + shell_quote(path("k")) +
          " --text-key body");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--text-key body: " + lines_txt + " is read as plain text"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(path("k") + ".bin"));
  r = run("--input " + shell_quote(ndjson) + " --out " + shell_quote(path("k")) +
          " --text-key body");
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("tokenized 2 documents"), std::string::npos) << r.out;
  // A link at an output's name: renaming into place would replace the link.
  test::write_file(dir_ / "users.txt", "the user's file");
  std::filesystem::create_symlink(dir_ / "users.txt", path("linked.bin"));
  r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("linked")));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find(path("linked.bin") + " is a link"), std::string::npos) << r.err;
  EXPECT_TRUE(std::filesystem::is_symlink(path("linked.bin")));
  EXPECT_EQ(test::slurp(dir_ / "users.txt"), "the user's file");
  // An input with no document writes nothing.
  r = run("--input " + shell_quote(input("blank.txt", "\n  \n")) + " --out " +
          shell_quote(path("blank")));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("no tokens to write: the input holds no document"), std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(path("blank") + ".bin"));
  // A thread count no machine has is refused, not tried.
  r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("o")) +
          " --threads 10000000");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("--threads 10000000: 0 (all cores) to 1024"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(path("o") + ".bin"));
}

// --log-json never writes over the tokenizer's files (inputs too), nor over an output or the
// loss mask the job replaces or removes, whatever the path's spelling.
TEST_F(TokenizeCliTest, TheLogIsNeitherAnInputNorAnOutput) {
  const std::string in = input("a.txt", "text\n");
  const std::string tokenizer_json = test::slurp(path("tok/tokenizer.json"));
  CliResult r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("o")) +
                    " --log-json " + shell_quote(path("tok/tokenizer.json")));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.err.find("is the same file as --tokenizer"), std::string::npos) << r.err;
  EXPECT_EQ(test::slurp(path("tok/tokenizer.json")), tokenizer_json);
  const std::string mask = input("o.mask", "a mask of earlier pairs");
  for (const std::string& log :
       {path("o.mask"), dir_.path().string() + "/./o.bin", path("o.lock")}) {  // the job's lock
    r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("o")) + " --log-json " +
            shell_quote(log));
    EXPECT_EQ(r.rc, 2) << log;
    EXPECT_NE(r.err.find("refusing to overwrite one of the outputs"), std::string::npos) << r.err;
  }
  EXPECT_EQ(test::slurp(mask), "a mask of earlier pairs");
  EXPECT_FALSE(std::filesystem::exists(path("o.bin")));
}

// --log-json replaces only a log of this command (a user's file there is refused and kept, as
// is a checkpoint's `latest`), and neither the outputs nor the log may go into a checkpoint.
TEST_F(TokenizeCliTest, TheLogReplacesOnlyALogAndNothingGoesIntoACheckpoint) {
  const std::string in = input("a.txt", "text\n");
  const std::string notes = input("notes.txt", "my notes\n");
  const std::string chat = input("chat.jsonl", "{\"type\": \"chat\"}\n");
  for (const std::string& users : {notes, chat}) {
    const CliResult r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("o")) +
                            " --log-json " + shell_quote(users));
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_NE(r.err.find("--log-json " + users + ": exists and is not a log of outcore tokenize"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(error_lines(r.err), 1) << r.err;
    EXPECT_FALSE(std::filesystem::exists(path("o.bin")));
  }
  EXPECT_EQ(test::slurp(notes), "my notes\n");
  EXPECT_EQ(test::slurp(chat), "{\"type\": \"chat\"}\n");
  // An earlier job's log is replaced.
  for (int job = 0; job < 2; ++job) {
    const CliResult r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("o")) +
                            " --log-json " + shell_quote(path("log.jsonl")));
    ASSERT_EQ(r.rc, 0) << r.err;
  }
  // The second job's log alone: one "done", the last line.
  std::istringstream log(test::slurp(path("log.jsonl")));
  int done = 0;
  std::string last;
  for (std::string line; std::getline(log, line); last = line)
    done += json::parse(line)["event"] == "done";
  EXPECT_EQ(done, 1);
  EXPECT_EQ(json::parse(last)["event"], "done");

  // A checkpoint (an outcore manifest) in a save directory.
  const fs::path ck = dir_.path() / "ck", step = ck / "global_step3";
  fs::create_directories(step);
  test::write_file(step / "manifest.json", "{\"format\": \"outcore-checkpoint\"}\n");
  test::write_file(ck / "latest", "global_step3\n");
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"--out " + shell_quote((step / "tokens").string()), "inside checkpoint"},
      {"--out " + shell_quote(path("o2")) + " --log-json " + shell_quote((step / "log").string()),
       "inside checkpoint"},
      {"--out " + shell_quote(path("o2")) + " --log-json " + shell_quote((ck / "latest").string()),
       "a name that a save directory writes"},
      {"--out " + shell_quote(path("o2")) + " --log-json " +
           shell_quote((ck / "global_step4").string()),
       "a name that a save directory writes"}};
  for (const auto& [args, why] : refused) {
    const CliResult r = run("--input " + shell_quote(in) + " " + args);
    EXPECT_EQ(r.rc, 2) << args;
    EXPECT_NE(r.err.find(why), std::string::npos) << args << ": " << r.err;
  }
  EXPECT_EQ(test::slurp((ck / "latest").string()), "global_step3\n");
  EXPECT_FALSE(fs::exists(step / "tokens.bin"));
  EXPECT_FALSE(fs::exists(path("o2.bin")));
}

// The pid of a process that has ended.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) _exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

// One job at a time writes a prefix (two would pair one's tokens with the other's mask) and a
// log: another job meanwhile is refused naming the lock and writes nothing. A job then removes
// the temporaries that killed jobs left beside its outputs, and nothing else there: not a file
// of that name of a process still running, not one of its inputs, not a file with other names.
TEST_F(TokenizeCliTest, OneJobAtATimeWritesAPrefixAndALogAndKilledJobsTemporariesGo) {
  const std::string in = input("a.txt", "text\n");
  const std::vector<std::string> leftovers = {path(fmt::format("o.bin.tmp-{}", dead_pid())),
                                              path(fmt::format("o.mask.tmp-{}-2", dead_pid()))};
  for (const std::string& f : leftovers) test::write_file(f, "a killed job's partial output");
  const std::vector<std::string> users = {
      input("o.bin.tmp-notes", "mine"), input(fmt::format("o.bin.tmp-{}", ::getpid()), "live"),
      input(fmt::format("o.mask.tmp-{}", dead_pid()), "linked")};
  fs::create_hard_link(users[2], path("my_link"));
  {
    const LockFile held(path("o.lock"), "a job writing o.*", "outcore tokenize lock\n");
    const CliResult r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("o")));
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_NE(r.err.find("another tokenize job is writing them"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(path("o.bin")));
    for (const std::string& f : leftovers) EXPECT_TRUE(fs::exists(f)) << f;
  }
  {
    const int fd = ::open(path("log.jsonl").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // another job's log
    const CliResult r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("o")) +
                            " --log-json " + shell_quote(path("log.jsonl")));
    ::close(fd);
    EXPECT_EQ(r.rc, 2) << r.err;
    EXPECT_NE(r.err.find("another job is writing it"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(path("o.bin")));
  }
  // An input named as a killed job's temporary is read, and kept.
  const std::string named_like_one = input(fmt::format("o.bin.tmp-{}", dead_pid()), "corpus\n");
  const CliResult r = run("--input " + shell_quote(in) + " --input " + shell_quote(named_like_one) +
                          " --out " + shell_quote(path("o")));
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const std::string& f : leftovers) {
    EXPECT_FALSE(fs::exists(f)) << f;
    EXPECT_NE(r.err.find("removed " + f + ", left by a job that was stopped"), std::string::npos)
        << r.err;
  }
  EXPECT_EQ(test::slurp(users[0]), "mine");
  EXPECT_EQ(test::slurp(users[1]), "live");
  EXPECT_EQ(test::slurp(users[2]), "linked");
  EXPECT_EQ(test::slurp(named_like_one), "corpus\n");
  EXPECT_FALSE(fs::exists(path("o.lock")));
}

TEST_F(TokenizeCliTest, OutputDoesNotDependOnThreads) {
  std::string text;
  for (int d = 0; d < 2000; ++d)
    text += "document " + std::to_string(d) + " and the singing\nsecond line\n\n";
  const std::string in = input("many.txt", text);
  const std::string big = input("big.jsonl", json{{"text", text}}.dump() + "\n");
  for (const char* threads : {"1", "2"}) {
    const CliResult r =
        run("--input " + shell_quote(in) + " " + shell_quote(big) + " --out " +
            shell_quote(path(std::string("t") + threads)) + " --threads " + threads);
    ASSERT_EQ(r.rc, 0) << r.err;
  }
  EXPECT_EQ(test::slurp(path("t1.bin")), test::slurp(path("t2.bin")));
  EXPECT_EQ(train::TokenFile::open(path("t1.bin")).size(),
            train::TokenFile::open(path("t2.bin")).size());
}

TEST_F(TokenizeCliTest, LargeVocabularyWritesU32) {
  test::write_tiny_tokenizer_dir(dir_ / "big", 70000);
  const std::string in = input("a.txt", "the end\n");
  const CliResult r = run("--input " + shell_quote(in) + " --out " + shell_quote(path("o")), "big");
  ASSERT_EQ(r.rc, 0) << r.err;
  const train::TokenFile f = train::TokenFile::open(path("o.u32"));
  ASSERT_GT(f.size(), 0u);
  EXPECT_EQ(f[f.size() - 1], 70000u);
  EXPECT_FALSE(fs::exists(path("o.bin")));
}

// Whether process `pid` has a handler for SIGINT (SigCgt of /proc/<pid>/status).
bool catches_sigint(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("SigCgt:", 0) == 0)
      return ((std::stoull(line.substr(7), nullptr, 16) >> (SIGINT - 1)) & 1) != 0;
  return false;
}

// Ctrl-C in the middle: exit 130, the previous output as it was, no temporaries.
TEST_F(TokenizeCliTest, SigintStopsWithoutWritingAnything) {
  test::write_file(dir_ / "o.bin", test::llmc_token_file({7, 8, 9}));
  std::string text;
  const std::string block = "the singing and a quick brown fox then 12345 the end\n\n";
  while (text.size() < (size_t{80} << 20)) text += block;
  const std::string in = input("big.txt", text);
  const std::string tok = path("tok"), out = path("o");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::execl(OUTCORE_CLI, OUTCORE_CLI, "tokenize", "--tokenizer", tok.c_str(), "--input", in.c_str(),
            "--out", out.c_str(), "--threads", "1", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // Struck once it catches SIGINT (before, the signal's default action would end it: a loaded
  // machine can take longer than any fixed wait to start it).
  int status = 0;
  pid_t ended = 0;
  for (int i = 0; i < 12000 && ended == 0 && !catches_sigint(pid); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ended = ::waitpid(pid, &status, WNOHANG);
  }
  ASSERT_EQ(ended, 0) << "tokenize ended before it was interrupted";
  ::kill(pid, SIGINT);
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130);
  EXPECT_EQ(test::slurp(dir_ / "o.bin"), test::llmc_token_file({7, 8, 9}));
  for (const auto& e : fs::directory_iterator(dir_.path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
}

}  // namespace
}  // namespace outcore::data
