// engine/ckpt checkpoints without an engine: CRC32C, the manifest, writing and re-slicing
// reads, corruption and truncation of every file, the save directory (lock, leftovers,
// latest, pruning), a full disk, and crashes at several points of a save.
#include "engine/ckpt/ckpt.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include "aio/aio.hpp"
#include "common/cleanup.hpp"
#include "common/error.hpp"
#include "common/lock_file.hpp"
#include "engine/ckpt/file_util.hpp"
#include "tests/common/error_of.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/common/temp_dir.hpp"

namespace outcore::ckpt {
namespace {

namespace fs = std::filesystem;
using outcore::test::TempDir;

// Opening a directory whose checkpoints are this run's.
const SaveDirOptions kContinue{.existing = ExistingCheckpoints::kContinue};

using outcore::test::error_of;

TEST(CkptCrc, MatchesTheStandardCheckValue) {
  const std::string s = "123456789";
  EXPECT_EQ(crc32c(std::as_bytes(std::span(s.data(), s.size()))), 0xE3069283u);
  // Continuation equals one pass.
  const auto all = std::as_bytes(std::span(s.data(), s.size()));
  EXPECT_EQ(crc32c(all.subspan(4), crc32c(all.first(4))), crc32c(all));
  EXPECT_EQ(crc32c({}), 0u);
}

// A synthetic "model" of 3 units whose slab element i of unit u, array a has value
// u * 1e6 + a * 1e5 + i (exact in fp32 for these sizes); padding is zero.
struct Synthetic {
  std::vector<UnitInfo> units{
      {"embed", 5000, 6144}, {"layers.0", 12000, 12288}, {"head", 70, 2048}};
  static float value(int u, int a, uint64_t i) {
    return static_cast<float>(u * 1000000 + a * 100000) + static_cast<float>(i % 90000);
  }
};

// Writes a checkpoint of `s` cut into `world` rank partitions (slab padded to a multiple of
// world * 2048), as a world-size-`world` run would.
SaveResult write_synthetic(SaveDir& dir, const std::string& tag, int world, WriterOptions wo = {},
                           const Synthetic& s = {}) {
  CheckpointWriter w(dir, tag, wo);
  w.add_text_file("trainer_state.json", "{\"steps_done\": 7}\n");
  Manifest man;
  man.step = 7;
  man.world_size = world;
  man.zero_stage = 3;
  man.param_dtype = DType::BF16;
  std::vector<std::vector<uint64_t>> part(s.units.size());
  for (size_t u = 0; u < s.units.size(); ++u) {
    const uint64_t g = static_cast<uint64_t>(world) * 2048;
    const uint64_t padded = (s.units[u].numel + g - 1) / g * g;
    man.units.push_back({s.units[u].name, s.units[u].numel, padded});
    part[u] = {padded / static_cast<uint64_t>(world)};
  }
  std::vector<int> fo, fp;
  for (int r = 0; r < world; ++r) {
    std::vector<Segment> opt, par;
    for (size_t u = 0; u < s.units.size(); ++u) {
      const uint64_t n = part[u][0];
      for (ArrayKind a : {ArrayKind::kMaster, ArrayKind::kExpAvg, ArrayKind::kExpAvgSq})
        opt.push_back({static_cast<int>(u), a, DType::F32, r * n, n, 0});
      par.push_back({static_cast<int>(u), ArrayKind::kParams, DType::BF16, r * n, n, 0});
    }
    fo.push_back(
        w.add_data_file("rank" + std::to_string(r) + "/optimizer.bin", r, "optimizer", opt));
    fp.push_back(w.add_data_file("rank" + std::to_string(r) + "/model.bin", r, "model", par));
  }
  w.prepare();
  for (int r = 0; r < world; ++r) {
    for (size_t u = 0; u < s.units.size(); ++u) {
      const uint64_t n = part[u][0], b = r * n;
      for (int a = 0; a < 3; ++a) {
        std::span<std::byte> buf = w.stage(fo[r], static_cast<int>(3 * u) + a);
        float* f = reinterpret_cast<float*>(buf.data());
        for (uint64_t i = 0; i < n; ++i)
          f[i] = b + i < s.units[u].numel ? Synthetic::value(static_cast<int>(u), a, b + i) : 0.f;
        w.submit(fo[r], static_cast<int>(3 * u) + a);
      }
      std::span<std::byte> buf = w.stage(fp[r], static_cast<int>(u));
      uint16_t* h = reinterpret_cast<uint16_t*>(buf.data());
      for (uint64_t i = 0; i < n; ++i)
        h[i] = b + i < s.units[u].numel
                   ? fp32_to_bf16(Synthetic::value(static_cast<int>(u), 3, b + i))
                   : 0;
      w.submit(fp[r], static_cast<int>(u));
    }
  }
  return w.commit(man);
}

void flip_byte(const fs::path& p, uint64_t offset) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  char c = 0;
  f.seekg(static_cast<std::streamoff>(offset));
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x01);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

TEST(CkptReadWrite, ResliceAtAnyWorldSize) {
  // Saved at world 1, 2 and 3; each read back as slab ranges of other world sizes (and
  // unaligned ranges) gives the same values, padding as zero.
  TempDir tmp("ckpt");
  Synthetic s;
  for (int world : {1, 2, 3}) {
    SaveDir dir(tmp / ("w" + std::to_string(world)));
    write_synthetic(dir, "global_step7", world);
    Checkpoint ck = Checkpoint::open(dir.path());
    ck.verify();
    EXPECT_EQ(ck.manifest().world_size, world);
    for (int target : {1, 2, 4}) {
      for (size_t u = 0; u < s.units.size(); ++u) {
        const uint64_t g = static_cast<uint64_t>(target) * 2048;
        const uint64_t padded = (s.units[u].numel + g - 1) / g * g, n = padded / target;
        for (int r = 0; r < target; ++r) {
          std::vector<float> out(n);
          ck.read_slab(static_cast<int>(u), ArrayKind::kExpAvg, r * n, n,
                       std::as_writable_bytes(std::span(out)));
          for (uint64_t i = 0; i < n; ++i) {
            const uint64_t e = r * n + i;
            const float want =
                e < s.units[u].numel ? Synthetic::value(static_cast<int>(u), 1, e) : 0.f;
            ASSERT_EQ(out[i], want)
                << "world " << world << " -> " << target << " unit " << u << " element " << e;
          }
        }
      }
    }
    // An unaligned range crossing rank files, in bf16.
    std::vector<uint16_t> h(3001);
    ck.read_slab(1, ArrayKind::kParams, 4097, h.size(), std::as_writable_bytes(std::span(h)));
    for (size_t i = 0; i < h.size(); ++i)
      ASSERT_EQ(h[i], fp32_to_bf16(Synthetic::value(1, 3, 4097 + i))) << i;
  }
}

TEST(CkptReadWrite, OpenResolvesLatestAndReportsBadPaths) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save");
  write_synthetic(dir, "global_step7", 1);
  EXPECT_EQ(dir.latest(), "global_step7");
  EXPECT_EQ(Checkpoint::open(tmp / "save").dir(), tmp / "save" / "global_step7");
  EXPECT_EQ(Checkpoint::open(tmp / "save" / "global_step7").manifest().step, 7);
  EXPECT_THROW(Checkpoint::open(tmp / "nothing"), InvalidArgument);
  fs::create_directories(tmp / "empty");
  EXPECT_THROW(Checkpoint::open(tmp / "empty"), InvalidArgument);
  std::ofstream(tmp / "save" / "latest") << "global_step9\n";
  // A checkpoint latest names gone: the message names the newest one still there.
  const std::string gone = error_of([&] { Checkpoint::open(tmp / "save"); });
  EXPECT_NE(gone.find("names checkpoint global_step9, which has no manifest.json; the newest "
                      "checkpoint there is global_step7: resume it with --resume " +
                      (tmp / "save" / "global_step7").string()),
            std::string::npos)
      << gone;
  std::ofstream(tmp / "save" / "latest") << "../../etc\n";
  EXPECT_THROW(Checkpoint::open(tmp / "save"), CorruptData);
  // Control characters (a NUL, a terminal's escape sequences) are refused and shown escaped.
  std::ofstream(tmp / "save" / "latest", std::ios::trunc | std::ios::binary)
      << std::string("global_step7\0junk\x1b[2J", 21);
  const std::string what = error_of([&] { Checkpoint::open(tmp / "save"); });
  EXPECT_NE(what.find("(\"global_step7\\x00junk\\x1b[2J\")"), std::string::npos) << what;
  EXPECT_EQ(what.find('\x1b'), std::string::npos) << what;
  // A save stopped before it was complete (<tag>.tmp/ with its marker) was never reported saved:
  // not opened.
  const fs::path unfinished = tmp / "save" / "global_step8.tmp";
  fs::copy(tmp / "save" / "global_step7", unfinished, fs::copy_options::recursive);
  std::ofstream(unfinished / ".outcore-save") << "outcore checkpoint in progress\n";
  for (const fs::path& named :
       {unfinished, fs::path(unfinished.string() + "/"), unfinished / "."}) {
    const std::string m = error_of([&] { Checkpoint::open(named); });
    EXPECT_NE(m.find("an unfinished save"), std::string::npos) << named << ": " << m;
  }
}

// A reader holds what it opened: a run saving into the save directory may prune the checkpoint
// it reads (--keep) or replace it (a save of the same step) meanwhile. One pruned between the
// read of `latest` and the opening of its files is passed over for the one `latest` names then,
// one replaced while it was opened is opened again; a file missing from a checkpoint that stays
// where `latest` names it is named, not retried.
TEST(CkptReadWrite, AReaderKeepsWhatItOpenedWhileARunPrunesOrReplacesIt) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save", {.keep = 1});
  write_synthetic(dir, "global_step3", 1);
  auto expect_readable = [](const Checkpoint& ck, const std::string& context) {
    EXPECT_NO_THROW(ck.verify()) << context;
    EXPECT_EQ(ck.read_text("trainer_state.json"), "{\"steps_done\": 7}\n") << context;
    std::vector<float> out(3000);
    ck.read_slab(1, ArrayKind::kMaster, 100, out.size(), std::as_writable_bytes(std::span(out)));
    for (size_t i = 0; i < out.size(); ++i)
      ASSERT_EQ(out[i], Synthetic::value(1, 0, 100 + i)) << context << ": element " << i;
  };
  const Checkpoint pruned = Checkpoint::open(tmp / "save");
  ASSERT_EQ(pruned.manifest().tag, "global_step3");
  write_synthetic(dir, "global_step5", 1);
  ASSERT_FALSE(fs::exists(tmp / "save" / "global_step3"));
  expect_readable(pruned, "pruned after it was opened");

  const Checkpoint replaced = Checkpoint::open(tmp / "save");
  write_synthetic(dir, "global_step5", 1);
  expect_readable(replaced, "replaced after it was opened");

  std::vector<std::string> chosen;
  ReaderOptions o;
  o.before_files_open = [&](const fs::path& d) {
    chosen.push_back(d.filename().string());
    // the first time a checkpoint is chosen, the next save: global_step9 (pruning global_step5),
    // then the same step again (replacing it)
    if (chosen.size() == 1) write_synthetic(dir, "global_step9", 1);
  };
  const Checkpoint reopened = Checkpoint::open(tmp / "save", o);
  EXPECT_EQ(chosen, (std::vector<std::string>{"global_step5", "global_step9"}));
  EXPECT_EQ(reopened.manifest().tag, "global_step9");
  expect_readable(reopened, "opened again at the newer checkpoint");

  chosen.clear();
  const Checkpoint replaced_while_opened = Checkpoint::open(tmp / "save", o);  // replaces it
  EXPECT_EQ(chosen, (std::vector<std::string>{"global_step9", "global_step9"}));
  expect_readable(replaced_while_opened, "opened again after it was replaced");

  fs::remove(tmp / "save" / "global_step9" / "rank0" / "model.bin");
  chosen.clear();
  o.before_files_open = [&](const fs::path& d) { chosen.push_back(d.filename().string()); };
  const std::string what = error_of([&] { Checkpoint::open(tmp / "save", o); });
  EXPECT_NE(what.find("global_step9/rank0/model.bin: missing"), std::string::npos) << what;
  EXPECT_EQ(chosen.size(), 1u);
}

TEST(CkptCorruption, AFlippedByteInAnyFileIsNamed) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save");
  write_synthetic(dir, "global_step7", 2);
  const fs::path ck_dir = tmp / "save" / "global_step7";
  const Manifest m = Checkpoint::open(ck_dir).manifest();
  for (const FileInfo& f : m.files) {
    for (uint64_t off : {uint64_t{0}, f.bytes / 2, f.bytes - 1}) {
      flip_byte(ck_dir / f.path, off);
      const std::string msg = error_of([&] { Checkpoint::open(ck_dir).verify(); });
      // A data file's header (its magic at offset 0) is checked when the checkpoint opens.
      const bool header = !f.segments.empty() && off == 0;
      EXPECT_NE(msg.find(f.path + (header ? ": not an outcore checkpoint data file"
                                          : ": CRC32C mismatch: expected")),
                std::string::npos)
          << f.path << " at " << off << ": " << msg;
      if (!header) {
        EXPECT_NE(msg.find("actual"), std::string::npos) << msg;
      }
      flip_byte(ck_dir / f.path, off);
    }
  }
  Checkpoint::open(ck_dir).verify();  // restored
  // The manifest checks itself: any flipped byte.
  const uint64_t msize = fs::file_size(ck_dir / "manifest.json");
  for (uint64_t off : {uint64_t{3}, msize / 3, msize / 2, msize - 5}) {
    flip_byte(ck_dir / "manifest.json", off);
    EXPECT_THROW(Checkpoint::open(ck_dir), CorruptData) << "offset " << off;
    flip_byte(ck_dir / "manifest.json", off);
  }
}

// A data file written in place after the checkpoint was opened and checked (a resume or an
// export reading it while someone overwrites it): the read that follows is refused, naming it.
TEST(CkptCorruption, AFileWrittenAfterItsCheckIsRefusedByTheReadThatFollows) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save");
  write_synthetic(dir, "global_step7", 1);
  const fs::path ck_dir = tmp / "save" / "global_step7";
  // Saved an hour ago: a write now moves the modification time whatever the clock's grain.
  for (const char* f : {"rank0/optimizer.bin", "rank0/model.bin"})
    fs::last_write_time(ck_dir / f, fs::file_time_type::clock::now() - std::chrono::hours(1));
  const Checkpoint ck = Checkpoint::open(ck_dir);
  ck.verify();
  std::vector<float> out(3000);
  const auto bytes = std::as_writable_bytes(std::span(out));
  ck.read_slab(1, ArrayKind::kMaster, 100, out.size(), bytes);
  EXPECT_EQ(out[0], Synthetic::value(1, 0, 100));

  const Segment* seg = nullptr;
  for (const Segment& s : ck.manifest().find("rank0/optimizer.bin")->segments)
    if (s.unit == 1 && s.array == ArrayKind::kMaster) seg = &s;
  ASSERT_NE(seg, nullptr);
  flip_byte(ck_dir / "rank0/optimizer.bin", seg->offset + 100 * sizeof(float) + 2);
  const std::string msg =
      error_of([&] { ck.read_slab(1, ArrayKind::kMaster, 100, out.size(), bytes); });
  EXPECT_NE(msg.find("rank0/optimizer.bin: written while the checkpoint was read"),
            std::string::npos)
      << msg;
  // The files not written are read as before.
  std::vector<uint16_t> params(3000);
  ck.read_slab(1, ArrayKind::kParams, 100, params.size(),
               std::as_writable_bytes(std::span(params)));
  EXPECT_EQ(params[0], fp32_to_bf16(Synthetic::value(1, 3, 100)));
}

TEST(CkptCorruption, TruncatedFilesAreNamedWithBothSizes) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save");
  write_synthetic(dir, "global_step7", 1);
  const fs::path ck_dir = tmp / "save" / "global_step7";
  fs::resize_file(ck_dir / "rank0/model.bin", 8192);
  const std::string msg = error_of([&] { Checkpoint::open(ck_dir).verify(); });
  EXPECT_NE(msg.find("rank0/model.bin: size: expected"), std::string::npos) << msg;
  EXPECT_NE(msg.find("actual 8192"), std::string::npos) << msg;
  fs::resize_file(ck_dir / "manifest.json", 100);
  EXPECT_THROW(Checkpoint::open(ck_dir), CorruptData);
}

// A data file of another rank, or of another save of the same sizes, put in place of one is
// refused when the checkpoint is opened: an export without its CRC check (--no-verify) would
// otherwise write those weights.
TEST(CkptCorruption, AnotherRanksOrSavesFileInItsPlaceIsRefusedOnOpen) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save");
  write_synthetic(dir, "global_step6", 2);
  write_synthetic(dir, "global_step7", 2);
  const fs::path ck_dir = tmp / "save" / "global_step7";
  ASSERT_NO_THROW(Checkpoint::open(ck_dir));
  const fs::path opt = ck_dir / "rank0/optimizer.bin", kept = tmp / "kept.bin";
  fs::copy_file(opt, kept);
  fs::copy_file(tmp / "save/global_step6/rank0/optimizer.bin", opt,
                fs::copy_options::overwrite_existing);
  std::string msg = error_of<CorruptData>([&] { Checkpoint::open(ck_dir); });
  EXPECT_NE(msg.find("rank0/optimizer.bin: rank 0's file of global_step6"), std::string::npos)
      << msg;
  fs::copy_file(kept, opt, fs::copy_options::overwrite_existing);
  ASSERT_NO_THROW(Checkpoint::open(ck_dir));
  fs::rename(ck_dir / "rank0/model.bin", tmp / "model0.bin");
  fs::rename(ck_dir / "rank1/model.bin", ck_dir / "rank0/model.bin");
  fs::rename(tmp / "model0.bin", ck_dir / "rank1/model.bin");
  msg = error_of<CorruptData>([&] { Checkpoint::open(ck_dir); });
  EXPECT_NE(msg.find("model.bin: rank 1's file of global_step7, where the manifest lists rank 0's"),
            std::string::npos)
      << msg;
}

// A manifest edited by hand, its CRC recomputed: a segment in a data file's header (or off its
// alignment, or on another segment's bytes) is refused naming the file, never read as weights.
TEST(CkptCorruption, SegmentsInTheHeaderUnalignedOrOverlappingAreRefused) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save");
  write_synthetic(dir, "global_step7", 1);
  const fs::path manifest = tmp / "save" / "global_step7" / "manifest.json";
  std::stringstream text;
  text << std::ifstream(manifest).rdbuf();
  const Manifest good = parse_manifest(text.str(), manifest.string());
  for (const uint64_t offset : {uint64_t{0}, uint64_t{4096 + 512}}) {
    Manifest m = good;
    FileInfo* data = nullptr;
    for (FileInfo& f : m.files)
      if (!f.segments.empty()) data = &f;
    ASSERT_NE(data, nullptr);
    data->segments.front().offset = offset;
    std::ofstream(manifest, std::ios::trunc) << manifest_text(m);
    const std::string msg = error_of([&] { Checkpoint::open(tmp / "save" / "global_step7"); });
    EXPECT_NE(msg.find(data->path + ": segment at offset " + std::to_string(offset) + " is " +
                       (offset == 0 ? "inside the file's 4096-byte header" : "not 4096-aligned")),
              std::string::npos)
        << msg;
  }
  Manifest m = good;
  FileInfo* data = nullptr;
  for (FileInfo& f : m.files)
    if (f.segments.size() > 1) data = &f;
  ASSERT_NE(data, nullptr);
  data->segments[1].offset = data->segments[0].offset;  // the next array read from the first's
  std::ofstream(manifest, std::ios::trunc) << manifest_text(m);
  const std::string msg = error_of([&] { Checkpoint::open(tmp / "save" / "global_step7"); });
  EXPECT_NE(msg.find(data->path + ": segments overlap at byte offset " +
                     std::to_string(data->segments[0].offset)),
            std::string::npos)
      << msg;
}

// Something that appears at `latest.tmp` while a run saves (a user's file, a link to one) is
// never written through nor replaced: the save that would update `latest` fails, `latest`
// keeps naming the previous checkpoint, and the file the link names is untouched. An empty
// `latest.tmp` (outcore's, from a rename that failed) is replaced.
// A save directory moved away under its run: the run's next save, and its pruning, never go into
// a directory made at the old name since (another run's); the save fails naming the path, and
// the moved directory keeps the run's checkpoints.
TEST(CkptSaveDir, ASaveDirectoryMovedUnderItsRunIsNeverSavedIntoOrPrunedAtItsOldName) {
  TempDir tmp("ckpt");
  std::optional<SaveDir> dir(std::in_place, tmp / "save", SaveDirOptions{.keep = 1});
  write_synthetic(*dir, "global_step1", 1);
  fs::rename(tmp / "save", tmp / "moved");
  {
    SaveDir other(tmp / "save", {.keep = 5});  // another run at the old name
    write_synthetic(other, "global_step1", 1);
    write_synthetic(other, "global_step2", 1);
  }
  const std::string what = error_of([&] { write_synthetic(*dir, "global_step3", 1); });
  EXPECT_NE(what.find("no longer the directory this run locked"), std::string::npos) << what;
  EXPECT_NE(what.find((tmp / "save").string()), std::string::npos) << what;
  EXPECT_TRUE(fs::exists(tmp / "save" / "global_step1"));
  EXPECT_TRUE(fs::exists(tmp / "save" / "global_step2"));
  EXPECT_FALSE(fs::exists(tmp / "save" / "global_step3"));
  EXPECT_FALSE(fs::exists(tmp / "save" / "global_step3.tmp"));
  EXPECT_EQ(Checkpoint::open(tmp / "save").manifest().tag, "global_step2");
  EXPECT_EQ(Checkpoint::open(tmp / "moved").manifest().tag, "global_step1");
  // Removed without a replacement: the same.
  fs::remove_all(tmp / "save");
  EXPECT_NE(error_of([&] {
              write_synthetic(*dir, "global_step4", 1);
            }).find("no longer the directory this run locked"),
            std::string::npos);
  // Its end never removes the lock of a run at the old name.
  {
    SaveDir third(tmp / "save");
    dir.reset();
    EXPECT_TRUE(fs::exists(tmp / "save" / ".lock"));
  }
}

TEST(CkptSaveDir, ALinkAtLatestTmpIsNeverWrittenThrough) {
  TempDir tmp("ckpt");
  const fs::path victim = tmp / "victim.txt";
  std::ofstream(victim) << "precious\n";
  SaveDir dir(tmp / "save");
  write_synthetic(dir, "global_step3", 1);
  fs::create_symlink(victim, tmp / "save" / "latest.tmp");
  const std::string msg = error_of([&] { write_synthetic(dir, "global_step5", 1); });
  EXPECT_NE(msg.find("latest.tmp is not outcore's"), std::string::npos) << msg;
  std::stringstream kept;
  kept << std::ifstream(victim).rdbuf();
  EXPECT_EQ(kept.str(), "precious\n");
  EXPECT_EQ(dir.latest(), "global_step3");
  fs::remove(tmp / "save" / "latest.tmp");
  std::ofstream(tmp / "save" / "latest.tmp").flush();  // empty: outcore's
  write_synthetic(dir, "global_step7", 1);
  EXPECT_EQ(dir.latest(), "global_step7");
  EXPECT_FALSE(fs::exists(tmp / "save" / "latest.tmp"));
}

TEST(CkptSaveDir, LockLeftoversLatestAndKeep) {
  TempDir tmp("ckpt");
  {
    SaveDir dir(tmp / "save", {.keep = 2});
    EXPECT_THROW(SaveDir second(tmp / "save"), IoError);  // one run per save directory
    for (int step : {3, 5, 7}) write_synthetic(dir, "global_step" + std::to_string(step), 1);
    EXPECT_EQ(dir.latest(), "global_step7");
    EXPECT_FALSE(fs::exists(tmp / "save" / "global_step3"));
    EXPECT_TRUE(fs::exists(tmp / "save" / "global_step5"));
  }
  // Another process cannot take the lock either.
  {
    SaveDir dir(tmp / "save", kContinue);
    pid_t pid = fork();
    if (pid == 0) {
      try {
        SaveDir other(tmp / "save");
        _exit(0);
      } catch (const IoError&) {
        _exit(3);
      }
    }
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_EQ(WEXITSTATUS(status), 3);
  }
  // Leftovers of an interrupted save go; checkpoints and latest stay.
  fs::create_directories(tmp / "save" / "global_step9.tmp");  // a save killed after mkdir
  std::ofstream(tmp / "save" / "latest.tmp") << "global_step9\n";
  {
    SaveDir dir(tmp / "save", kContinue);
    EXPECT_FALSE(fs::exists(tmp / "save" / "global_step9.tmp"));
    EXPECT_FALSE(fs::exists(tmp / "save" / "latest.tmp"));
    EXPECT_EQ(dir.latest(), "global_step7");
    // Saving a tag that exists replaces it whole.
    write_synthetic(dir, "global_step5", 1);
    EXPECT_EQ(dir.latest(), "global_step5");
    Checkpoint::open(tmp / "save").verify();
  }
}

TEST(CkptFaults, DiskFullAndIoErrorsKeepThePreviousCheckpoint) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save");
  write_synthetic(dir, "global_step1", 1);
  for (aio::Fault::Kind kind : {aio::Fault::Kind::kEnospc, aio::Fault::Kind::kEio}) {
    auto fault = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
    aio::Fault f;
    f.kind = kind;
    f.nth = 6;
    f.direction = 1;
    fault->add_fault(f);
    WriterOptions wo;
    wo.backend = fault;
    const std::string msg = error_of([&] { write_synthetic(dir, "global_step2", 1, wo); });
    EXPECT_NE(msg.find("global_step2.tmp/rank0/"), std::string::npos) << msg;
    EXPECT_NE(msg.find(kind == aio::Fault::Kind::kEnospc ? "No space left" : "Input/output"),
              std::string::npos)
        << msg;
    EXPECT_EQ(fault->faults_fired(), 1u);
    EXPECT_FALSE(fs::exists(tmp / "save" / "global_step2.tmp"));
    EXPECT_FALSE(fs::exists(tmp / "save" / "global_step2"));
    EXPECT_EQ(dir.latest(), "global_step1");
    Checkpoint::open(tmp / "save").verify();
  }
}

// A backend that counts the requests in flight (prepared and not yet reaped) across its queues.
class InFlightCounter : public aio::IoBackend {
 public:
  explicit InFlightCounter(std::shared_ptr<aio::IoBackend> inner) : inner_(std::move(inner)) {}
  std::unique_ptr<aio::IoQueue> make_queue(unsigned depth) override {
    return std::make_unique<Queue>(inner_->make_queue(depth), in_flight_);
  }
  std::string name() const override { return inner_->name(); }
  int in_flight() const { return in_flight_.load(); }

 private:
  class Queue : public aio::IoQueue {
   public:
    Queue(std::unique_ptr<aio::IoQueue> q, std::atomic<int>& n) : q_(std::move(q)), n_(n) {}
    bool prepare(const aio::IoRequest& r) override {
      const bool ok = q_->prepare(r);
      n_ += ok ? 1 : 0;
      return ok;
    }
    int submit() override { return q_->submit(); }
    int reap(std::span<aio::IoCompletion> out, std::chrono::nanoseconds timeout) override {
      const int got = q_->reap(out, timeout);
      n_ -= got > 0 ? got : 0;
      return got;
    }
    int register_buffers(std::span<const std::span<std::byte>> bufs) override {
      return q_->register_buffers(bufs);
    }
    int unregister_buffers() override { return q_->unregister_buffers(); }
    int register_file(int slot, int fd) override { return q_->register_file(slot, fd); }

   private:
    std::unique_ptr<aio::IoQueue> q_;
    std::atomic<int>& n_;
  };
  std::shared_ptr<aio::IoBackend> inner_;
  std::atomic<int> in_flight_{0};
};

// A failed read while verify() has the file's next chunk in flight: the error is reported after
// that read landed, never with it still writing into the buffers verify() frees. The first read
// fails at once; the others complete 300 ms late.
TEST(CkptFaults, AFailedReadDuringTheCheckLeavesNoReadInFlight) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save");
  Synthetic big;
  big.units = {{"layers.0", 3u << 20, 3u << 20}};  // optimizer.bin: 36 MiB, two 32 MiB reads
  write_synthetic(dir, "global_step1", 1, {}, big);
  auto faults = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
  // Reads 1 and 2: the two data files' headers, checked when the checkpoint opens; the
  // check's first read fails.
  faults->add_fault({.kind = aio::Fault::Kind::kEio, .nth = 3, .direction = 0});
  faults->add_fault({.kind = aio::Fault::Kind::kDelay,
                     .nth = 4,
                     .every = 1,
                     .direction = 0,
                     .delay = std::chrono::milliseconds{300}});
  auto counter = std::make_shared<InFlightCounter>(faults);
  ReaderOptions ro;
  ro.backend = counter;
  const Checkpoint ck = Checkpoint::open(tmp / "save", ro);
  const std::string msg = error_of([&] { ck.verify(); });
  EXPECT_EQ(counter->in_flight(), 0) << "verify() returned with reads in flight";
  EXPECT_NE(msg.find("optimizer.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Input/output"), std::string::npos) << msg;
  EXPECT_GE(faults->faults_fired(), 2u);  // the failed read and at least one late one
}

TEST(CkptFaults, RealFullDiskFailsBeforeAnyDataIsWritten) {
  // A tmpfs of 1 MiB would need mount privileges; instead a checkpoint larger than the free
  // space of the test directory's filesystem is declared and refused at prepare().
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save");
  CheckpointWriter w(dir, "global_step1");
  Segment s{0, ArrayKind::kMaster, DType::F32, 0, uint64_t{1} << 60, 0};
  w.add_data_file("rank0/optimizer.bin", 0, "optimizer", {s});
  try {
    w.prepare();
    FAIL() << "prepare() accepted 4 EiB";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC);
    EXPECT_NE(std::string(e.what()).find("bytes needed"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(dir.latest().has_value());
}

// Runs a save of global_step2 into `dir` opened with `options` in a child process that kills
// itself (SIGKILL) at `hooks`; returns the signal.
int crash_child(const fs::path& dir, const WriterOptions& hooks,
                const SaveDirOptions& options = kContinue) {
  pid_t pid = fork();
  if (pid == 0) {
    try {
      SaveDir d(dir, options);
      write_synthetic(d, "global_step2", 1, hooks);
    } catch (...) {
      _exit(4);
    }
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFSIGNALED(status) ? WTERMSIG(status) : -WEXITSTATUS(status);
}

TEST(CkptFaults, CrashAtAnyPointLeavesALoadableCheckpoint) {
  TempDir tmp("ckpt");
  {
    SaveDir d(tmp / "save");
    write_synthetic(d, "global_step1", 1);
  }
  struct Point {
    uint64_t bytes;
    const char* at;
    const char* expect_latest;
  };
  const Point points[] = {{4096, "", "global_step1"},
                          {100000, "", "global_step1"},
                          {0, "before-rename", "global_step1"},
                          {0, "before-latest", "global_step1"},
                          {0, "after-latest", "global_step2"}};
  for (const Point& p : points) {
    WriterOptions hooks;
    hooks.crash_after_bytes = p.bytes;
    hooks.crash_at = p.at;
    ASSERT_EQ(crash_child(tmp / "save", hooks), SIGKILL) << p.bytes << " " << p.at;
    // The next start removes the leftovers and finds a valid latest.
    SaveDir d(tmp / "save", kContinue);
    EXPECT_EQ(d.latest(), p.expect_latest) << p.bytes << " " << p.at;
    Checkpoint ck = Checkpoint::open(tmp / "save");
    ck.verify();
    for (const fs::directory_entry& e : fs::directory_iterator(tmp / "save")) {
      EXPECT_NE(e.path().extension(), ".tmp") << "leftover " << e.path();
      EXPECT_NE(e.path().extension(), ".old") << "leftover " << e.path();
    }
  }
}

// A save of a step already saved (a run that starts over, or goes on from an earlier checkpoint,
// and saves that step again) replaces it: a kill at any point of the replacement leaves `latest`
// naming a loadable checkpoint of that step, and no leftover. (Replaced by two renames, a kill
// between them left `latest` naming a missing directory and the old checkpoint as `<tag>.old`,
// which the next start removed: both checkpoints lost.)
// A --start-over killed once its first save was named latest, before it removed the checkpoints
// of the run it replaces: its save lists them (Manifest::replaces), so a resume of it removes
// them once it saves, rather than refusing them as another branch of the run.
TEST(CkptFaults, AStartOverKilledBeforeItRemovedTheReplacedCheckpointsResumes) {
  TempDir tmp("ckpt");
  {
    SaveDir d(tmp / "save");
    write_synthetic(d, "global_step4", 1);
    write_synthetic(d, "global_step6", 1);
  }
  WriterOptions hooks;
  hooks.crash_at = "after-latest";
  ASSERT_EQ(crash_child(tmp / "save", hooks, {.existing = ExistingCheckpoints::kReplace}), SIGKILL);
  EXPECT_EQ(read_latest_tag(tmp / "save" / "latest"), "global_step2");
  EXPECT_EQ(replaced_by(tmp / "save" / "global_step2"),
            (std::vector<std::string>{"global_step4", "global_step6"}));
  {
    SaveDir d(tmp / "save",
              {.existing = ExistingCheckpoints::kContinue, .resumed_tag = "global_step2"});
    EXPECT_TRUE(fs::exists(tmp / "save" / "global_step6"));  // until this run saves
    write_synthetic(d, "global_step3", 1);
    EXPECT_FALSE(fs::exists(tmp / "save" / "global_step4"));
    EXPECT_FALSE(fs::exists(tmp / "save" / "global_step6"));
    // The save that removed them lists them too (a kill before they went is met the same way);
    // the next lists none.
    EXPECT_EQ(replaced_by(tmp / "save" / "global_step3"),
              (std::vector<std::string>{"global_step4", "global_step6"}));
    write_synthetic(d, "global_step5", 1);
  }
  Checkpoint::open(tmp / "save" / "global_step2").verify();
  EXPECT_TRUE(replaced_by(tmp / "save" / "global_step5").empty());
  EXPECT_EQ(read_latest_tag(tmp / "save" / "latest"), "global_step5");
}

TEST(CkptFaults, AKillWhileReplacingACheckpointOfTheSameStepLeavesItLoadable) {
  for (const char* at : {"before-rename", "between-renames", "after-exchange", "after-latest"}) {
    TempDir tmp("ckpt");
    {
      SaveDir d(tmp / "save");
      write_synthetic(d, "global_step2", 1);
    }
    WriterOptions hooks;
    hooks.crash_at = at;
    ASSERT_EQ(crash_child(tmp / "save", hooks), SIGKILL) << at;
    if (std::string_view(at) == "between-renames") {
      // Read before a save directory puts it back (an export, a resume): whole under its .old
      // name, read there with a warning naming it and the leftover beside it.
      outcore::test::LogCapture log;
      Checkpoint old = Checkpoint::open(tmp / "save");
      EXPECT_EQ(old.dir(), tmp / "save" / "global_step2.old");
      old.verify();
      EXPECT_NE(log.text().find("left as " + (tmp / "save" / "global_step2.old").string() +
                                ": reading it there"),
                std::string::npos)
          << log.text();
      EXPECT_NE(log.text().find("global_step2.tmp: what a save in progress or interrupted leaves"),
                std::string::npos)
          << log.text();
    }
    SaveDir d(tmp / "save", kContinue);
    EXPECT_EQ(d.latest(), "global_step2") << at;
    Checkpoint ck = Checkpoint::open(tmp / "save");
    EXPECT_EQ(ck.dir(), tmp / "save" / "global_step2") << at;
    ck.verify();
    for (const fs::directory_entry& e : fs::directory_iterator(tmp / "save")) {
      EXPECT_NE(e.path().extension(), ".tmp") << at << ": leftover " << e.path();
      EXPECT_NE(e.path().extension(), ".old") << at << ": leftover " << e.path();
    }
  }
}

// A process ended at once during a save (a second Ctrl-C's watcher removes the files registered
// for cleanup) takes the save's data with it, leaving a leftover the next open removes; a
// committed save leaves nothing of its own registered; a removal just before the rename puts
// nothing in place.
TEST(CkptFaults, AProcessEndedAtOnceDuringASaveLeavesOnlyARecognisedLeftover) {
  TempDir tmp("ckpt");
  {
    SaveDir d(tmp / "save");
    CheckpointWriter w(d, "global_step1", {});
    w.add_text_file("trainer_state.json", "{}\n");
    w.add_data_file("rank0/model.bin", 0, "model",
                    {{0, ArrayKind::kParams, DType::F32, 0, 4096, 0}});
    w.prepare();
    ASSERT_TRUE(fs::exists(tmp / "save" / "global_step1.tmp" / "rank0" / "model.bin"));
    cleanup::remove_registered_files(cleanup::Scope::kAll);
    // Only the marker stays (never registered: other ranks' files may be there too), which makes
    // what is left a recognised leftover.
    std::vector<std::string> left;
    for (const fs::directory_entry& e :
         fs::recursive_directory_iterator(tmp / "save" / "global_step1.tmp"))
      left.push_back(e.path().filename().string());
    EXPECT_EQ(left, std::vector<std::string>{".outcore-save"});
  }
  {
    SaveDir d(tmp / "save");
    EXPECT_FALSE(fs::exists(tmp / "save" / "global_step1.tmp")) << "the next open removes it";
    write_synthetic(d, "global_step2", 1);
  }
  EXPECT_EQ(cleanup::remove_registered_files(cleanup::Scope::kAll), 0u);
  Checkpoint::open(tmp / "save").verify();
  // A removal between the check and the rename (the process ending at once): the commit puts
  // nothing in place, and the checkpoint of that step already there stays.
  {
    SaveDir d(tmp / "save", kContinue);
    WriterOptions hooks;
    hooks.crash_at = "removal-before-rename";
    EXPECT_THROW(write_synthetic(d, "global_step2", 1, hooks), Interrupted);
  }
  Checkpoint ck = Checkpoint::open(tmp / "save");
  EXPECT_EQ(ck.dir(), tmp / "save" / "global_step2");
  ck.verify();
}

// A first save killed after its checkpoint is in place but before `latest` names it: the save
// directory still opens, at that checkpoint (its newest), and a run continues it.
TEST(CkptFaults, AFirstSaveKilledBeforeLatestStillOpensAtItsCheckpoint) {
  TempDir tmp("ckpt");
  WriterOptions hooks;
  hooks.crash_at = "before-latest";
  ASSERT_EQ(crash_child(tmp / "save", hooks), SIGKILL);
  ASSERT_FALSE(fs::exists(tmp / "save" / "latest"));
  Checkpoint ck = Checkpoint::open(tmp / "save");
  EXPECT_EQ(ck.dir(), tmp / "save" / "global_step2");
  ck.verify();
  SaveDir d(tmp / "save", SaveDirOptions{.existing = ExistingCheckpoints::kContinue,
                                         .resumed_tag = "global_step2"});
  EXPECT_FALSE(d.latest().has_value());
  // An empty directory, or one holding only other files, is still neither.
  fs::create_directories(tmp / "other" / "global_step3");
  EXPECT_THROW(Checkpoint::open(tmp / "other"), InvalidArgument);
  // One holding only an interrupted save's leftover says so.
  fs::create_directories(tmp / "other" / "global_step5.tmp");
  std::ofstream(tmp / "other" / "global_step5.tmp" / ".outcore-save") << "a save";
  const std::string neither = error_of([&] { Checkpoint::open(tmp / "other"); });
  EXPECT_NE(neither.find(
                "it holds only what a save in progress or interrupted leaves (global_step5.tmp)"),
            std::string::npos)
      << neither;
  // The newest by step, not by name (global_step9 sorts after global_step10), warned once.
  {
    SaveDir two(tmp / "two");
    write_synthetic(two, "global_step9", 1);
    write_synthetic(two, "global_step10", 1);
  }
  fs::remove(tmp / "two" / "latest");
  outcore::test::LogCapture log;
  EXPECT_EQ(Checkpoint::open(tmp / "two").dir(), tmp / "two" / "global_step10");
  EXPECT_EQ(Checkpoint::open(tmp / "two").dir(), tmp / "two" / "global_step10");
  EXPECT_EQ(outcore::test::LogCapture::count(log.text(), "the newest checkpoint there"), 1u)
      << log.text();
}

// A checkpoint under another step's name (renamed by hand) is refused, naming both, instead of
// being resumed as that step and saved over.
TEST(CkptFaults, ACheckpointUnderAnotherStepsNameIsRefused) {
  TempDir tmp("ckpt");
  {
    SaveDir d(tmp / "save");
    write_synthetic(d, "global_step2", 1);
    write_synthetic(d, "global_step3", 1);
  }
  fs::rename(tmp / "save" / "global_step2", tmp / "save" / "swap");
  fs::rename(tmp / "save" / "global_step3", tmp / "save" / "global_step2");
  fs::rename(tmp / "save" / "swap", tmp / "save" / "global_step3");
  const std::string msg = error_of([&] { Checkpoint::open(tmp / "save"); });
  EXPECT_NE(msg.find("the checkpoint of global_step2 (step 7) under the name global_step3"),
            std::string::npos)
      << msg;
  EXPECT_THROW(Checkpoint::open(tmp / "save" / "global_step2"), CorruptData);
  // A copy under a name of the user's opens.
  fs::rename(tmp / "save" / "global_step2", tmp / "mine");
  EXPECT_NO_THROW(Checkpoint::open(tmp / "mine"));
}

// The user's files of a directory tree: relative path -> contents ("/" for a directory).
using Files = std::map<std::string, std::string>;

void make_files(const fs::path& root, const Files& files) {
  for (const auto& [rel, text] : files) {
    const fs::path p = root / rel;
    if (text == "/") {
      fs::create_directories(p);
      continue;
    }
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
  }
}

// Every file of `files` still there with the same bytes.
void expect_files(const fs::path& root, const Files& files, const std::string& context) {
  for (const auto& [rel, text] : files) {
    const fs::path p = root / rel;
    if (text == "/") {
      EXPECT_TRUE(fs::is_directory(p)) << context << ": " << rel << " is gone";
      continue;
    }
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    EXPECT_TRUE(in.good() || in.eof()) << context << ": " << rel << " is gone";
    EXPECT_EQ(ss.str(), text) << context << ": " << rel << " changed";
  }
}

// The lock file is outcore's only while a run holds it: a refused open, a run that ends and a
// run that saved nothing leave the directory as they found it; a user's `.lock` stays as it was.
TEST(CkptSaveDir, TheLockFileAndAnEmptyDirectoryGoWithTheRun) {
  TempDir tmp("ckpt");
  const fs::path save = tmp / "save";
  { SaveDir dir(save); }
  EXPECT_FALSE(fs::exists(save)) << "a save directory this run created and left empty";
  {
    SaveDir dir(save);
    EXPECT_TRUE(fs::exists(save / ".lock"));
    write_synthetic(dir, "global_step1", 1);
  }
  EXPECT_FALSE(fs::exists(save / ".lock"));
  EXPECT_TRUE(fs::exists(save / "global_step1"));
  // Refused (another run's checkpoints): nothing added.
  EXPECT_THROW(SaveDir dir(save), InvalidArgument);
  EXPECT_FALSE(fs::exists(save / ".lock"));
  // A directory that existed stays, empty or not.
  fs::create_directories(tmp / "mine");
  { SaveDir dir(tmp / "mine"); }
  EXPECT_TRUE(fs::is_directory(tmp / "mine"));
  EXPECT_TRUE(fs::is_empty(tmp / "mine"));
  // A `.lock` outcore did not write is locked, and kept with its contents.
  const Files user = {{".lock", "the user's lock notes\n"}};
  make_files(tmp / "theirs", user);
  {
    SaveDir dir(tmp / "theirs");
    EXPECT_THROW(SaveDir second(tmp / "theirs"), IoError);
    write_synthetic(dir, "global_step1", 1);
  }
  expect_files(tmp / "theirs", user, "a user's .lock");
  // A run that ended removed its lock while holding it: the next run takes a new one, and a
  // second run is still kept out.
  {
    SaveDir dir(save, kContinue);
    EXPECT_THROW(SaveDir second(save, kContinue), IoError);
  }
  {
    SaveDir again(save, kContinue);
    EXPECT_THROW(SaveDir second(save, kContinue), PathBusy);  // exit 2 (train_session)
  }
  // A lock left by a killed run (outcore's marker), or by an earlier version (empty), is taken
  // and removed; a partial marker is not outcore's.
  for (const std::string& left : {std::string("outcore save directory lock\n"), std::string()}) {
    std::ofstream(save / ".lock", std::ios::binary) << left;
    { SaveDir dir(save, kContinue); }
    EXPECT_FALSE(fs::exists(save / ".lock")) << "left: '" << left << "'";
  }
  std::ofstream(save / ".lock", std::ios::binary) << "outcore save";
  { SaveDir dir(save, kContinue); }
  EXPECT_TRUE(fs::exists(save / ".lock"));
  fs::remove(save / ".lock");
  // Nor is an empty thing that is not a regular file.
  ASSERT_EQ(::mkfifo((save / ".lock").c_str(), 0600), 0);
  { SaveDir dir(save, kContinue); }
  EXPECT_EQ(fs::symlink_status(save / ".lock").type(), fs::file_type::fifo);
  fs::remove(save / ".lock");
  // The release of the holder between another run's open of the lock file and its flock: that
  // run finds the path naming a new file (a third run's) and is kept out, instead of holding
  // the unlinked one beside the third.
  {
    auto first = std::make_unique<SaveDir>(save, kContinue);
    std::unique_ptr<SaveDir> third;
    outcore::internal::set_lock_open_hook([&] {
      first.reset();
      third = std::make_unique<SaveDir>(save, kContinue);
    });
    EXPECT_THROW(SaveDir second(save, kContinue), PathBusy);
    ASSERT_TRUE(third);
    EXPECT_TRUE(fs::exists(save / ".lock"));
  }
  // Other ranks neither lock nor remove. One whose directory has no rank 0 lock in it (a
  // directory of its own node, not the one rank 0 opened) is refused at once, not at the first
  // save, and the directory stays.
  try {
    SaveDir rank1(tmp / "ranks", {.primary = false});
    ADD_FAILURE() << "a directory rank 0 did not open was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0's lock file .lock is not there"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(fs::is_directory(tmp / "ranks"));
  {
    SaveDir rank0(tmp / "ranks");
    { SaveDir rank1(tmp / "ranks", {.primary = false}); }
    EXPECT_TRUE(fs::exists(tmp / "ranks" / ".lock"));  // rank 1's going leaves rank 0's lock
    size_t entries = 0;                                // and nothing of its writability check
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(tmp / "ranks")) ++entries;
    EXPECT_EQ(entries, 1u);
  }
}

TEST(CkptSaveDir, EntriesThatAreNotOutcoresAreNeverTouched) {
  // Names that end like outcore's leftovers, or start like its checkpoints, but are not them.
  const Files user = {{"notes.tmp", "my notes\n"},
                      {"results.old/model.pt", "weights"},
                      {"a.old", "x"},
                      {"global_step.tmp/f", "y"},
                      {"global_stepX/manifest.json", "{}"},
                      {"latest.bak", "global_step1\n"},
                      {"data/global_step1.tmp/rank0/optimizer.bin", "z"},
                      {"global_step7.tmp.txt", "w"},
                      // outcore writes no leading zero: global_step01 is not global_step1
                      {"global_step01/notes", "v"},
                      {"global_step002.tmp", "u"}};
  TempDir tmp("ckpt");
  make_files(tmp / "save", user);
  {
    SaveDir dir(tmp / "save", {.keep = 1});
    for (int step : {1, 2, 3}) write_synthetic(dir, "global_step" + std::to_string(step), 1);
    EXPECT_EQ(dir.latest(), "global_step3");
    EXPECT_FALSE(fs::exists(tmp / "save" / "global_step1"));  // pruned: outcore's own
  }
  expect_files(tmp / "save", user, "after saves and pruning");
  Checkpoint::open(tmp / "save").verify();
}

TEST(CkptSaveDir, NamesOutcoreWritesHeldBySomethingElseAreRefused) {
  const std::pair<std::string, Files> cases[] = {
      {"global_step6", {{"global_step6/readme.txt", "mine"}}},
      {"global_step5.tmp", {{"global_step5.tmp/user.txt", "mine"}}},
      {"global_step2.old", {{"global_step2.old/rank0/model.bin", "mine"}}},
      {"latest", {{"latest", "my latest thoughts\n"}}},
      {"latest", {{"latest/x", "a directory"}}},
      {"latest.tmp", {{"latest.tmp", "not a tag\n"}}},
      // one word, but no checkpoint's name: a user's note
      {"latest.tmp", {{"latest.tmp", "compare-lr-with-run-7\n"}}},
      {"latest", {{"latest", "v2-final\n"}}},
  };
  for (const auto& [name, files] : cases) {
    TempDir tmp("ckpt");
    make_files(tmp / "save", files);
    const std::string msg = error_of([&] { SaveDir dir(tmp / "save"); });
    EXPECT_NE(
        msg.find("save directory " + (tmp / "save").string() + ": " + name + " is not outcore's"),
        std::string::npos)
        << msg;
    expect_files(tmp / "save", files, name);
    // The lock was let go: once the entry is moved away, the directory opens.
    fs::rename(tmp / "save" / name, tmp / "moved");
    SaveDir dir(tmp / "save");
  }
}

// The checkpoint's small files are created, never written through: a link at the path, or a
// file already there, fails the write and is kept as it was (as is the file a link names).
TEST(CkptFiles, WriteFileDurablyOnlyCreates) {
  TempDir tmp("ckpt");
  auto text_of = [](const fs::path& p) {
    std::stringstream t;
    t << std::ifstream(p).rdbuf();
    return t.str();
  };
  std::ofstream(tmp / "victim") << "keep";
  fs::create_symlink(tmp / "victim", tmp / "link");
  EXPECT_THROW(write_file_durably(tmp / "link", "new"), IoError);
  EXPECT_EQ(text_of(tmp / "victim"), "keep");
  EXPECT_EQ(fs::symlink_status(tmp / "link").type(), fs::file_type::symlink);
  EXPECT_THROW(write_file_durably(tmp / "victim", "new"), IoError);
  EXPECT_EQ(text_of(tmp / "victim"), "keep");
  write_file_durably(tmp / "fresh", "new");
  EXPECT_EQ(text_of(tmp / "fresh"), "new");
}

// A committed checkpoint that still holds a save marker (an earlier version left its text in
// every checkpoint; a removal killed before its rename leaves the current one) is pruned and
// saved over like any other: the marker is replaced, not refused.
TEST(CkptSaveDir, ACheckpointHoldingAMarkerIsPrunedAndSavedOver) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save", {.keep = 1});
  write_synthetic(dir, "global_step1", 1);
  std::ofstream(tmp / "save" / "global_step1" / ".outcore-save")
      << "outcore checkpoint in progress\n";
  write_synthetic(dir, "global_step2", 1);
  EXPECT_FALSE(fs::exists(tmp / "save" / "global_step1"));
  std::ofstream(tmp / "save" / "global_step2" / ".outcore-save")
      << "outcore checkpoint in progress\ndirectory 1:2\n";
  write_synthetic(dir, "global_step2", 1);  // the same tag again: the old one replaced whole
  EXPECT_EQ(dir.latest(), "global_step2");
  EXPECT_FALSE(fs::exists(tmp / "save" / "global_step2" / ".outcore-save"));
  Checkpoint::open(tmp / "save").verify();
}

// A user's copy of a checkpoint under a name a save or a removal uses for its leftovers
// (`<tag>.old`, `<tag>.tmp`) is refused, never removed: committed checkpoints hold no marker, a
// marker names the directory it was written into (a copy is another), and an earlier version's
// marker counts only in a directory without a manifest. An empty `latest.tmp` (a save killed
// between creating and writing it) is a leftover.
TEST(CkptSaveDir, ACopyOfACheckpointUnderALeftoverNameIsRefusedNotRemoved) {
  enum class Marker { kNone, kEarlierVersions, kTheOriginals };
  for (const Marker marker : {Marker::kNone, Marker::kEarlierVersions, Marker::kTheOriginals}) {
    for (const char* suffix : {".old", ".tmp"}) {
      SCOPED_TRACE(std::string(suffix) + " marker " + std::to_string(static_cast<int>(marker)));
      TempDir tmp("ckpt");
      const fs::path original = tmp / "save" / "global_step2";
      {
        SaveDir dir(tmp / "save");
        write_synthetic(dir, "global_step2", 1);
      }
      EXPECT_FALSE(fs::exists(original / ".outcore-save"));
      if (marker == Marker::kEarlierVersions) {
        std::ofstream(original / ".outcore-save") << "outcore checkpoint in progress\n";
      } else if (marker == Marker::kTheOriginals) {  // as a failed removal of it leaves
        struct stat st {};
        ASSERT_EQ(::lstat(original.c_str(), &st), 0);
        std::ofstream(original / ".outcore-save") << "outcore checkpoint in progress\ndirectory "
                                                  << st.st_dev << ":" << st.st_ino << "\n";
      }
      const fs::path copy = tmp / "save" / (std::string("global_step2") + suffix);
      fs::copy(original, copy, fs::copy_options::recursive);
      const std::string msg = error_of([&] { SaveDir dir(tmp / "save", kContinue); });
      EXPECT_NE(msg.find(copy.filename().string() + " is not outcore's"), std::string::npos) << msg;
      Checkpoint::open(copy, {.aio = {}, .backend = nullptr, .unfinished_save = true})
          .verify();  // untouched
      fs::rename(copy, tmp / "backup");
      SaveDir dir(tmp / "save", kContinue);
    }
  }
  TempDir tmp("ckpt");
  {
    SaveDir dir(tmp / "save");
    write_synthetic(dir, "global_step2", 1);
  }
  std::ofstream(tmp / "save" / "latest.tmp").flush();  // empty
  SaveDir dir(tmp / "save", kContinue);
  EXPECT_FALSE(fs::exists(tmp / "save" / "latest.tmp"));
  EXPECT_EQ(dir.latest(), "global_step2");
}

TEST(CkptSaveDir, AnotherRunsCheckpointsAreRefusedUnlessContinuedOrReplaced) {
  TempDir tmp("ckpt");
  {
    SaveDir dir(tmp / "save");
    write_synthetic(dir, "global_step2", 1);
    write_synthetic(dir, "global_step4", 1);
  }
  const std::string msg = error_of([&] { SaveDir dir(tmp / "save", {.keep = 1}); });
  EXPECT_NE(msg.find("holds another run's checkpoints (global_step2, global_step4; latest "
                     "global_step4)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("--resume"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--start-over"), std::string::npos) << msg;
  EXPECT_TRUE(fs::exists(tmp / "save" / "global_step2" / "manifest.json"));
  EXPECT_TRUE(fs::exists(tmp / "save" / "global_step4" / "manifest.json"));
  {
    // Replacing: the other run's checkpoints stay until this run's first one is saved.
    SaveDir dir(tmp / "save", {.existing = ExistingCheckpoints::kReplace});
    EXPECT_TRUE(fs::exists(tmp / "save" / "global_step4"));
    write_synthetic(dir, "global_step1", 1);
    EXPECT_FALSE(fs::exists(tmp / "save" / "global_step2"));
    EXPECT_FALSE(fs::exists(tmp / "save" / "global_step4"));
    EXPECT_EQ(dir.latest(), "global_step1");
  }
  Checkpoint::open(tmp / "save").verify();
}

// A run that may save a step whose checkpoint holds a user's file is refused before it trains
// (the save would be refused after the training), naming the checkpoint and the file.
TEST(CkptSaveDir, ARunThatWouldSaveOverAUsersFileIsRefusedAtStart) {
  TempDir tmp("ckpt");
  {
    SaveDir dir(tmp / "save");
    for (const char* tag : {"global_step1", "global_step3"}) write_synthetic(dir, tag, 1);
  }
  make_files(tmp / "save", {{"global_step3/NOTES.md", "notes\n"}});
  SaveDir dir(tmp / "save", {.existing = ExistingCheckpoints::kReplace});
  const std::string msg = error_of([&] { dir.check_can_save(1, 5); });
  EXPECT_NE(msg.find("global_step3 holds NOTES.md, which is not a checkpoint file, and this run "
                     "may save step 3 (steps 1 to 5)"),
            std::string::npos)
      << msg;
  EXPECT_NO_THROW(dir.check_can_save(1, 2));  // global_step1 holds only a save's files
  EXPECT_NO_THROW(dir.check_can_save(4, 9));
  EXPECT_NE(error_of([&] { dir.check_can_save(3, 3); }).find("may save step 3 (steps 3 to 3)"),
            std::string::npos);
  EXPECT_TRUE(fs::exists(tmp / "save" / "global_step3" / "NOTES.md"));
}

// The room for a run's checkpoints is checked before it trains: the free space (statvfs's, or
// the test hook's) against the checkpoint's bytes.
TEST(CkptSaveDir, ARunWhoseCheckpointDoesNotFitIsRefusedAtStart) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save");
  WriterOptions hooks;
  hooks.free_bytes = 1000;
  EXPECT_NO_THROW(dir.check_room(1000, 1, hooks));
  const std::string msg = error_of([&] { dir.check_room(1001, 1, hooks); });
  EXPECT_NE(msg.find("save directory " + (tmp / "save").string() +
                     ": a checkpoint of this run takes up to 1001 bytes"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("the filesystem has 1000 bytes"), std::string::npos) << msg;
  EXPECT_THROW(dir.check_room(1001, 1, hooks), OutOfMemory);
  EXPECT_THROW(dir.check_room(uint64_t{1} << 62, 1, {}), OutOfMemory);  // this filesystem's free
  EXPECT_NO_THROW(dir.check_room(1, 1, {}));
  // Every checkpoint kept: room for fewer than the run's saves is a warning, not a refusal.
  {
    outcore::test::LogCapture log;
    EXPECT_NO_THROW(dir.check_room(400, 5, hooks));
    EXPECT_NE(log.text().find("room for 2 of this run's 5 checkpoints"), std::string::npos)
        << log.text();
  }
  // A save sees the same free space.
  const std::string save = error_of([&] { write_synthetic(dir, "global_step1", 1, hooks); });
  EXPECT_NE(save.find("bytes needed, 1000 bytes free"), std::string::npos) << save;
}

// With --keep K a save directory holds K + 1 checkpoints just before a save prunes: a run is
// refused at start when they cannot fit, counting those already there.
TEST(CkptSaveDir, KeepNeedsRoomForOneMoreThanItKeeps) {
  TempDir tmp("ckpt");
  WriterOptions hooks;
  hooks.free_bytes = 1000;
  SaveDir dir(tmp / "save", SaveDirOptions{.keep = 2});
  EXPECT_NO_THROW(dir.check_room(300, 3, hooks));  // 3 at once, room for 3
  const std::string msg = error_of([&] { dir.check_room(400, 3, hooks); });
  EXPECT_NE(msg.find("room for 2 of the 3 more it holds at once (--keep 2, 0 here now)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("save 3 would fail"), std::string::npos) << msg;
  EXPECT_NO_THROW(dir.check_room(400, 2, hooks));  // a run of two saves never holds three
  write_synthetic(dir, "global_step1", 1);
  EXPECT_NO_THROW(dir.check_room(400, 3, hooks));  // one is here already: two more fit
  write_synthetic(dir, "global_step2", 1);
  // Two here and two saves with keep 2: three at once, one more: fits.
  EXPECT_NO_THROW(dir.check_room(900, 2, hooks));
  // keep 3, two here, two saves: four at once, two more: 400 fits twice, 600 once.
  SaveDir keep3(tmp / "save3", SaveDirOptions{.keep = 3});
  write_synthetic(keep3, "global_step1", 1);
  write_synthetic(keep3, "global_step2", 1);
  EXPECT_NO_THROW(keep3.check_room(400, 2, hooks));
  EXPECT_THROW(keep3.check_room(600, 2, hooks), OutOfMemory);
}

// Replacing another run's checkpoints (--start-over): they go after the first save, but the
// checkpoint resumed from stays among the newest K.
TEST(CkptSaveDir, ReplacedCheckpointsCountAsFreedAfterTheFirstSave) {
  TempDir tmp("ckpt");
  WriterOptions hooks;
  hooks.free_bytes = 1000;
  {
    SaveDir first(tmp / "save");
    write_synthetic(first, "global_step1", 1);
    write_synthetic(first, "global_step2", 1);
  }
  // keep 3, three saves, two here of which one is resumed: four at once, two more.
  {
    SaveDir replacing(tmp / "save", SaveDirOptions{.keep = 3,
                                                   .existing = ExistingCheckpoints::kReplace,
                                                   .resumed_tag = "global_step1"});
    EXPECT_NO_THROW(replacing.check_room(450, 3, hooks));
    EXPECT_THROW(replacing.check_room(550, 3, hooks), OutOfMemory);
  }
  // None resumed: three at once, one more.
  SaveDir replacing_all(tmp / "save",
                        SaveDirOptions{.keep = 3, .existing = ExistingCheckpoints::kReplace});
  EXPECT_NO_THROW(replacing_all.check_room(550, 3, hooks));
  EXPECT_THROW(replacing_all.check_room(1001, 3, hooks), OutOfMemory);
}

// A checkpoint someone put a file into (notes, an evaluation's results, an export) is the
// user's too: pruning, replacing and saving over it keep it whole, and leave nothing behind
// that would block the directory.
TEST(CkptSaveDir, CheckpointsHoldingAUsersFilesAreNeverRemoved) {
  const Files notes = {{"global_step1/NOTES.md", "notes\n"},
                       {"global_step1/evals/run1/r.json", "{}"},
                       {"global_step2/hf/model.safetensors", "exported"},
                       {"global_step3/rank0/extra.bin", "mine"}};
  TempDir tmp("ckpt");
  {
    SaveDir dir(tmp / "save");
    for (const char* tag : {"global_step1", "global_step2", "global_step3"})
      write_synthetic(dir, tag, 1);
  }
  make_files(tmp / "save", notes);
  {
    SaveDir dir(tmp / "save", {.keep = 1, .existing = ExistingCheckpoints::kContinue});
    write_synthetic(dir, "global_step4", 1);  // 1, 2 and 3 are beyond --keep
    EXPECT_EQ(dir.latest(), "global_step4");
    // Saving over a checkpoint holding a user's file is refused, naming it.
    const std::string msg = error_of([&] { write_synthetic(dir, "global_step3", 1); });
    EXPECT_NE(msg.find("global_step3 is not outcore's (a checkpoint holding rank0/extra.bin"),
              std::string::npos)
        << msg;
    EXPECT_EQ(dir.latest(), "global_step4");
  }
  expect_files(tmp / "save", notes, "after pruning and a refused save");
  for (const char* tag : {"global_step1", "global_step2", "global_step3", "global_step4"}) {
    EXPECT_FALSE(fs::exists(tmp / "save" / (std::string(tag) + ".old"))) << tag;
    EXPECT_TRUE(fs::exists(tmp / "save" / tag / "manifest.json")) << tag;
  }
  Checkpoint::open(tmp / "save" / "global_step1").verify();
  {
    // Replacing another run's checkpoints keeps those holding a user's file, too.
    SaveDir dir(tmp / "save", {.existing = ExistingCheckpoints::kReplace});
    write_synthetic(dir, "global_step9", 1);
    EXPECT_FALSE(fs::exists(tmp / "save" / "global_step4"));
  }
  expect_files(tmp / "save", notes, "after replacing");
  // Once the user's files are gone, the checkpoint is pruned as any other.
  fs::remove_all(tmp / "save" / "global_step1" / "NOTES.md");
  fs::remove_all(tmp / "save" / "global_step1" / "evals");
  {
    SaveDir dir(tmp / "save", {.keep = 1, .existing = ExistingCheckpoints::kContinue});
    write_synthetic(dir, "global_step10", 1);
  }
  EXPECT_FALSE(fs::exists(tmp / "save" / "global_step1"));
  EXPECT_TRUE(fs::exists(tmp / "save" / "global_step2" / "hf" / "model.safetensors"));
}

// Resuming from an earlier checkpoint of the save directory would make this run's saves replace
// the later ones (another branch of the run): refused, naming them; --start-over replaces them
// but keeps the checkpoint resumed from.
TEST(CkptSaveDir, ResumingFromAnEarlierCheckpointNeverReplacesLaterOnes) {
  TempDir tmp("ckpt");
  {
    SaveDir dir(tmp / "save");
    for (const char* tag : {"global_step2", "global_step4", "global_step6"})
      write_synthetic(dir, tag, 1);
  }
  const std::string msg = error_of([&] {
    SaveDir dir(tmp / "save",
                {.existing = ExistingCheckpoints::kContinue, .resumed_tag = "global_step2"});
  });
  EXPECT_NE(msg.find("holds checkpoints after global_step2, the one this run resumes from "
                     "(global_step4, global_step6)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("--start-over"), std::string::npos) << msg;
  for (const char* tag : {"global_step2", "global_step4", "global_step6"})
    Checkpoint::open(tmp / "save" / tag).verify();
  {
    SaveDir dir(tmp / "save",
                {.existing = ExistingCheckpoints::kContinue, .resumed_tag = "global_step6"});
  }
  {
    // A save killed after its rename, before latest named it: the later checkpoint is this
    // run's own, replaced by its next saves.
    std::ofstream(tmp / "save" / "latest", std::ios::trunc) << "global_step4\n";
    SaveDir dir(tmp / "save",
                {.existing = ExistingCheckpoints::kContinue, .resumed_tag = "global_step4"});
  }
  // Not so where it cannot be one: several later checkpoints (a killed save leaves one), or one
  // written before the checkpoint latest names (another run's, left by a --start-over killed
  // before it removed them). Refused, naming the newest to resume from.
  {
    std::ofstream(tmp / "save" / "latest", std::ios::trunc) << "global_step2\n";
    const std::string several = error_of([&] {
      SaveDir dir(tmp / "save",
                  {.existing = ExistingCheckpoints::kContinue, .resumed_tag = "global_step2"});
    });
    EXPECT_NE(several.find("(global_step4, global_step6)"), std::string::npos) << several;
    EXPECT_NE(several.find("--resume " + (tmp / "save" / "global_step6").string()),
              std::string::npos)
        << several;
    std::ofstream(tmp / "save" / "latest", std::ios::trunc) << "global_step4\n";
    const fs::path manifest6 = tmp / "save" / "global_step6" / "manifest.json";
    const fs::file_time_type was = fs::last_write_time(manifest6);
    fs::last_write_time(manifest6,
                        fs::last_write_time(tmp / "save" / "global_step4" / "manifest.json") -
                            std::chrono::seconds(10));
    const std::string older = error_of([&] {
      SaveDir dir(tmp / "save",
                  {.existing = ExistingCheckpoints::kContinue, .resumed_tag = "global_step4"});
    });
    EXPECT_NE(older.find("holds checkpoints after global_step4"), std::string::npos) << older;
    fs::last_write_time(manifest6, was);
    std::ofstream(tmp / "save" / "latest", std::ios::trunc) << "global_step6\n";
  }
  {
    SaveDir dir(tmp / "save",
                {.existing = ExistingCheckpoints::kReplace, .resumed_tag = "global_step2"});
    write_synthetic(dir, "global_step3", 1);
    EXPECT_EQ(dir.latest(), "global_step3");
  }
  EXPECT_TRUE(fs::exists(tmp / "save" / "global_step2" / "manifest.json"));
  EXPECT_FALSE(fs::exists(tmp / "save" / "global_step4"));
  EXPECT_FALSE(fs::exists(tmp / "save" / "global_step6"));
}

// A save group of one process standing for two ranks, whose "rank 1" reports files it never
// wrote (or wrote into another directory): the commit must not call that a checkpoint.
TEST(CkptWriter, ACheckpointIsCommittedOnlyOnceEveryFileReadsBack) {
  TempDir tmp("ckpt");
  SaveDir dir(tmp / "save");
  write_synthetic(dir, "global_step1", 1);
  SaveGroup group;
  group.rank = 0;
  group.world = 2;
  group.barrier = [] {};
  group.all_gather = [](const std::string& mine) {
    Manifest theirs = Manifest::from_json(nlohmann::json::parse(mine), "rank 0");
    for (FileInfo& f : theirs.files) {
      if (f.rank < 0) continue;
      f.rank = 1;
      f.path.replace(0, 5, "rank1");
      for (Segment& sg : f.segments) sg.slab_begin += 2048;  // disjoint slab ranges
    }
    return std::vector<std::string>{mine, theirs.to_json().dump()};
  };
  WriterOptions wo;
  wo.group = &group;
  // One rank's partition of the synthetic model, declared as rank 0 of 2.
  CheckpointWriter w(dir, "global_step2", wo);
  w.add_text_file("trainer_state.json", "{}\n");
  Manifest man;
  man.step = 2;
  man.world_size = 2;
  man.zero_stage = 3;
  man.param_dtype = DType::F32;
  man.units.push_back({"only", 4096, 4096});
  const int f = w.add_data_file("rank0/optimizer.bin", 0, "optimizer",
                                {{0, ArrayKind::kMaster, DType::F32, 0, 2048, 0},
                                 {0, ArrayKind::kExpAvg, DType::F32, 0, 2048, 0},
                                 {0, ArrayKind::kExpAvgSq, DType::F32, 0, 2048, 0},
                                 {0, ArrayKind::kParams, DType::F32, 0, 2048, 0}});
  w.prepare();
  for (int seg = 0; seg < 4; ++seg) {
    std::span<std::byte> b = w.stage(f, seg);
    std::memset(b.data(), 0, b.size());
    w.submit(f, seg);
  }
  const std::string msg = error_of([&] { w.commit(man); });
  EXPECT_NE(msg.find("rank1/optimizer.bin: missing"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(tmp / "save" / "global_step2"));
  EXPECT_EQ(dir.latest(), "global_step1");
}

// Runs `body` in a child process; returns the signal that ended it, or minus its exit code.
int in_child(const std::function<void()>& body) {
  pid_t pid = fork();
  if (pid == 0) {
    try {
      body();
    } catch (...) {
      _exit(4);
    }
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFSIGNALED(status) ? WTERMSIG(status) : -WEXITSTATUS(status);
}

TEST(CkptSaveDir, RandomUserFilesAndKillsDuringSavesAndPruningLoseNothing) {
  // The user's entries come from names near outcore's; some of them are names outcore writes
  // (refused at open, untouched). Each round kills a run of saves (with pruning) at a random
  // point; the next open must find every user file as it was and a `latest` that loads.
  const std::vector<std::string> harmless = {"notes.tmp",
                                             "results.old/model.pt",
                                             "x.old",
                                             "global_step.tmp/a",
                                             "global_stepZ/b",
                                             "latest.bak",
                                             "sub/global_step1/manifest.json",
                                             "sub/latest",
                                             "global_step1.tmp.d/c",
                                             "old.tmp/rank0/optimizer.bin",
                                             ".lock.d/e"};
  const std::vector<std::string> conflicting = {
      "global_step9/readme.txt", "global_step3.tmp/user.txt", "global_step2.old/rank0/model.bin",
      "latest", "latest.tmp"};
  std::mt19937 rng(20261126);
  const int rounds = 24;
  int refused = 0, killed = 0;
  for (int round = 0; round < rounds; ++round) {
    const std::string context = "round " + std::to_string(round);
    TempDir tmp("ckpt");
    const fs::path save = tmp / "save";
    Files user;
    for (const std::string& name : harmless)
      if (rng() % 2 == 0) user[name] = "user " + name + " " + std::to_string(rng());
    const bool conflict = rng() % 4 == 0;
    if (conflict) user[conflicting[rng() % conflicting.size()]] = "user " + std::to_string(rng());
    make_files(save, user);
    if (conflict) {
      EXPECT_THROW(SaveDir dir(save, kContinue), InvalidArgument) << context;
      expect_files(save, user, context);
      ++refused;
      continue;
    }
    const int keep = 1 + static_cast<int>(rng() % 2);
    {
      SaveDir dir(save, {.keep = keep});
      write_synthetic(dir, "global_step1", 1);
    }
    WriterOptions hooks;
    switch (rng() % 3) {
      case 0:
        hooks.crash_after_bytes = 4096 + rng() % 400000;
        break;
      case 1: {
        const char* points[] = {"before-rename", "before-latest", "after-latest"};
        hooks.crash_at = points[rng() % 3];
        break;
      }
      default:
        hooks.crash_after_removals = 1 + rng() % 14;
    }
    const int end = in_child([&] {
      SaveDir dir(save, {.keep = keep, .existing = ExistingCheckpoints::kContinue});
      for (int step : {2, 3, 4})
        write_synthetic(dir, "global_step" + std::to_string(step), 1, hooks);
    });
    EXPECT_TRUE(end == SIGKILL || end == 0) << context << ": " << end;
    killed += end == SIGKILL;
    SaveDir dir(save, {.keep = keep, .existing = ExistingCheckpoints::kContinue});
    ASSERT_TRUE(dir.latest().has_value()) << context;
    Checkpoint::open(save).verify();
    expect_files(save, user, context);
    std::set<std::string> user_top;  // the user's entries of the save directory itself
    for (const auto& [rel, text] : user) user_top.insert(rel.substr(0, rel.find('/')));
    for (const fs::directory_entry& e : fs::directory_iterator(save)) {
      const std::string name = e.path().filename().string();
      if (user_top.count(name) || name.rfind("global_step", 0) != 0) continue;
      EXPECT_EQ(name.find('.'), std::string::npos) << context << ": leftover " << name;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GT(killed, rounds / 3);
}

}  // namespace
}  // namespace outcore::ckpt
