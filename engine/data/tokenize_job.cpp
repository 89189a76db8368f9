#include "engine/data/tokenize_job.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <tbb/parallel_for.h>
#include <tbb/parallel_pipeline.h>
#include <tbb/task_arena.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string_view>

#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "common/lock_file.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "engine/data/staged_file.hpp"
#include "engine/data/utf8.hpp"

namespace outcore::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

static_assert(std::endian::native == std::endian::little, "token files are little-endian");

// llm.c's token file, as engine/train/token_file.hpp reads it (a layer above this one).
constexpr uint64_t kLlmcVocabLimit = 65536;
constexpr int32_t kLlmcMagic = 20240520;
constexpr int32_t kLlmcVersion = 1;
constexpr size_t kLlmcHeaderInts = 256;
// Batches in flight at once: one being read, two being tokenized, one being written.
constexpr size_t kBatchesInFlight = 4;
// A batch is tokenized in segments of whole documents of about this many bytes, one task each.
constexpr size_t kSegmentBytes = size_t{256} << 10;

struct BadEntry {
  uint64_t line;
  std::string reason;
};

// The encoded documents of consecutive documents of a batch: their tokens (and mask) one after
// the other, and the bad ones left out, in order.
struct Segment {
  size_t first = 0, end = 0;  // documents [first, end) of the batch
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;
  std::vector<BadEntry> bad;
  uint64_t documents = 0;  // encoded (not bad)
};

// A batch on its way through the pipeline.
struct Work {
  std::unique_ptr<Batch> batch;
  std::vector<Segment> segments;
};

// The 1-based line of byte `at` of a document starting on `line`, and a message for an
// ill-formed sequence there.
std::pair<uint64_t, std::string> utf8_error(std::string_view text, size_t at, uint64_t line) {
  size_t line_start = 0;
  for (size_t i = 0; i < at; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return {line, fmt::format("ill-formed UTF-8 (byte 0x{:02X} at byte {} of the line)",
                            static_cast<unsigned char>(text[at]), at - line_start + 1)};
}

// "an array", "a number", "null".
std::string with_article(std::string_view type) {
  if (type == "null") return "null";
  std::string out = type.front() == 'a' || type.front() == 'o' ? "an " : "a ";
  out += type;
  return out;
}

class DocumentEncoder {
 public:
  DocumentEncoder(const Tokenizer& tokenizer, const TokenizeOptions& options)
      : tokenizer_(tokenizer),
        options_(options),
        pairs_(!options.prompt_key.empty()),
        eos_(tokenizer.eos_id()) {}

  bool pairs() const { return pairs_; }

  // Appends the document's tokens (and mask) to `out`, or records why it is bad (leaving
  // nothing of it in out.tokens).
  void encode(std::string_view text, uint64_t line, InputFormat format, Segment& out) const {
    const size_t invalid = find_invalid_utf8(text);
    if (invalid != text.size()) {
      auto [bad_line, reason] = utf8_error(text, invalid, line);
      out.bad.push_back({bad_line, std::move(reason)});
      return;
    }
    const size_t tokens_before = out.tokens.size(), mask_before = out.mask.size();
    try {
      if (format == InputFormat::kText) {
        encode_text(text, out.tokens);
        ++out.documents;
        return;
      }
      std::string bad;
      if (encode_json(text, out, bad)) {
        ++out.documents;
      } else {
        out.bad.push_back({line, std::move(bad)});
      }
    } catch (const Error& e) {  // the tokenizer cannot encode it (a pattern's match limit)
      out.tokens.resize(tokens_before);
      out.mask.resize(mask_before);
      out.bad.push_back({line, e.what()});
    }
  }

 private:
  // A JSON line's text or pair; false with `bad` set when the line is not what is expected.
  bool encode_json(std::string_view text, Segment& out, std::string& bad) const {
    // A file holding one JSON array of objects (what some datasets ship as .json) is not JSON
    // lines: said so, with the way to convert it.
    const size_t first = text.find_first_not_of(" \t\r");
    const char* const array_hint =
        first != std::string_view::npos && text[first] == '['
            ? "; .json and .jsonl inputs are JSON lines, one object per line, not one JSON array "
              "(convert it with jq -c '.[]')"
            : "";
    json j;
    try {
      j = json::parse(text);
    } catch (const json::exception& e) {  // parse errors, numbers out of range (1e400)
      bad = "not valid JSON: " + json_message(e) + array_hint;
      return false;
    }
    if (!j.is_object()) {
      bad = fmt::format("a JSON line must be an object, not {}{}", with_article(j.type_name()),
                        array_hint);
      return false;
    }
    if (!pairs_) {
      const std::string* s = string_at(j, options_.text_key, bad);
      if (s) encode_text(*s, out.tokens);
      return s != nullptr;
    }
    const std::string* prompt = string_at(j, options_.prompt_key, bad);
    const std::string* completion = prompt ? string_at(j, options_.completion_key, bad) : nullptr;
    if (completion) encode_pair(*prompt, *completion, out);
    return completion != nullptr;
  }

  // j[key] when it is a string; else nullptr with `bad` set.
  static const std::string* string_at(const json& j, const std::string& key, std::string& bad) {
    const auto it = j.find(key);
    if (it == j.end()) {
      bad = fmt::format("no key \"{}\"", key);
      return nullptr;
    }
    if (!it->is_string()) {
      bad = fmt::format("\"{}\" is {}, not a string", key, with_article(it->type_name()));
      return nullptr;
    }
    return &it->get_ref<const std::string&>();
  }

  void encode_text(std::string_view text, std::vector<uint32_t>& tokens) const {
    const size_t start = tokens.size();
    tokenizer_.encode(text, true, tokens);
    if (eos_ && (tokens.size() == start || tokens.back() != *eos_)) tokens.push_back(*eos_);
  }

  void encode_pair(std::string_view prompt, std::string_view completion, Segment& out) const {
    std::vector<uint32_t>& tokens = out.tokens;
    // The one sequence prompt + completion, encoded whole with the template's special tokens
    // around it (BOS before, a converted Llama 2's EOS after: never between the two). The mask's
    // boundary is where it first differs from the prompt's own encoding: a token that joins the
    // prompt's end to the completion's start (" Paris" of "Answer: " + "Paris") is a target.
    const size_t start = tokens.size();
    std::vector<uint32_t> prompt_tokens;
    tokenizer_.encode(prompt, Tokenizer::Specials::kBefore, prompt_tokens);
    std::string joined;
    joined.reserve(prompt.size() + completion.size());
    joined.append(prompt).append(completion);
    tokenizer_.encode(joined, Tokenizer::Specials::kAround, tokens);
    size_t boundary = 0;
    const size_t common = std::min(prompt_tokens.size(), tokens.size() - start);
    while (boundary < common && tokens[start + boundary] == prompt_tokens[boundary]) ++boundary;
    const size_t completion_start = start + boundary;
    out.mask.resize(completion_start, 0);
    if (eos_ && (tokens.size() == completion_start || tokens.back() != *eos_))
      tokens.push_back(*eos_);
    out.mask.resize(tokens.size(), 1);
  }

  const Tokenizer& tokenizer_;
  const TokenizeOptions& options_;
  bool pairs_;
  std::optional<uint32_t> eos_;
};

void check_options(const TokenizeOptions& o, const std::vector<std::string>& outputs) {
  if (o.inputs.empty()) throw InvalidArgument("tokenize: no input files");
  if (o.out_prefix.empty()) throw InvalidArgument("tokenize: no output prefix");
  // The longest name a job writes: the commit marker's temporary.
  check_derived_name_fits(o.out_prefix,
                          std::string(".tokenize-commit") + std::string(kTemporarySuffix), "--out");
  if (o.threads < 0 || o.threads > kMaxTokenizeThreads)
    throw InvalidArgument(
        fmt::format("tokenize: {} threads: 0 (all cores) to {}", o.threads, kMaxTokenizeThreads));
  if (o.prompt_key.empty() != o.completion_key.empty())
    throw InvalidArgument("tokenize: prompt/completion pairs need both keys");
  for (const std::string& in : o.inputs) {
    const InputFormat f = input_format_of(in);
    if (!o.prompt_key.empty() && f != InputFormat::kJsonLines)
      throw InvalidArgument(
          fmt::format("{}: prompt/completion pairs are read from JSON lines "
                      "(.jsonl, .json or .ndjson), not plain text",
                      in));
    if (o.doc_per_file && f != InputFormat::kText)
      throw InvalidArgument(
          fmt::format("{}: one document per file applies to plain text, not JSON lines", in));
  }
  // A file given twice (two spellings, a link) is read twice: its documents appear twice.
  std::map<std::pair<dev_t, ino_t>, const std::string*> seen;
  for (const std::string& in : o.inputs) {
    struct stat st {};
    if (::stat(in.c_str(), &st) != 0) continue;  // the reader names it
    const auto [it, fresh] = seen.emplace(std::pair{st.st_dev, st.st_ino}, &in);
    if (!fresh)
      log::warn("tokenize: {} is {}: its documents are written twice", in,
                *it->second == in ? std::string("given twice") : "the same file as " + *it->second);
  }
  std::error_code ec;
  for (const std::string& out : outputs) {
    for (const std::string& in : o.inputs) {
      if (same_file(out, in))
        throw InvalidArgument(fmt::format("output {} would overwrite input {}", out, in));
    }
    // Outputs are renamed into place: that would replace a link, not write the file it names.
    if (fs::is_symlink(out, ec))
      throw InvalidArgument(fmt::format(
          "output {} is a link: the job renames its outputs into place, which would replace the "
          "link, not write the file it names; give --out the file's own directory",
          out));
    if (fs::exists(out, ec) && !fs::is_regular_file(out, ec))
      throw InvalidArgument(fmt::format("output {} exists and is not a regular file", out));
    const fs::path dir = fs::absolute(out).parent_path();
    if (!fs::is_directory(dir, ec))
      throw InvalidArgument(
          fmt::format("output {}: directory {} does not exist", out, dir.string()));
  }
}

// Whether the raw 32-bit tokens of `in` (size bytes, a multiple of 4) look like token ids: the
// first and last MiB of them all below 2^24, far above any tokenizer's vocabulary. A user's
// file of another kind fails it: four bytes of text make a number above 2^24, and a binary
// file's random words do almost always.
bool raw_tokens_plausible(std::ifstream& in, uint64_t size) {
  constexpr uint64_t kSpan = uint64_t{1} << 20;
  constexpr uint32_t kLimit = uint32_t{1} << 24;
  std::vector<uint32_t> words(kSpan / sizeof(uint32_t));
  for (const uint64_t at : {uint64_t{0}, size > kSpan ? size - kSpan : uint64_t{0}}) {
    const uint64_t n = std::min(kSpan, size - at);
    if (!in.seekg(static_cast<std::streamoff>(at)) ||
        !in.read(reinterpret_cast<char*>(words.data()), static_cast<std::streamsize>(n)))
      return false;
    if (std::any_of(words.begin(), words.begin() + static_cast<std::ptrdiff_t>(n / 4),
                    [](uint32_t w) { return w >= kLimit; }))
      return false;
  }
  return true;
}

// The token count of an existing token file `path` of the kind this job writes (llm.c's .bin
// from its header, which its size must match; raw .u32 from its size, with token ids where it
// begins and ends), or nullopt when it is not one.
std::optional<uint64_t> token_count_of(const std::string& path, bool llmc) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) return std::nullopt;
  if (!llmc) {
    if (size % sizeof(uint32_t) != 0) return std::nullopt;
    std::ifstream in(path, std::ios::binary);
    if (!in || !raw_tokens_plausible(in, size)) return std::nullopt;
    return size / 4;
  }
  std::array<int32_t, 3> head{};
  std::ifstream in(path, std::ios::binary);
  if (!in.read(reinterpret_cast<char*>(head.data()), sizeof head) || head[0] != kLlmcMagic ||
      head[1] != kLlmcVersion || head[2] < 0 ||
      size != kLlmcHeaderInts * sizeof(int32_t) + static_cast<uint64_t>(head[2]) * sizeof(uint16_t))
    return std::nullopt;
  return static_cast<uint64_t>(head[2]);
}

// A second name for `path` beside it ("<path>.old-<pid>[-k]", never one that exists), or "" when
// there is no file at `path`. Throws IoError when the link cannot be made (a filesystem without
// hard links): the job then changes nothing.
std::string link_aside(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return {};
  for (int k = 0;; ++k) {
    std::string aside = fmt::format("{}.old-{}", path, ::getpid());
    if (k > 0) aside += fmt::format("-{}", k);
    if (::link(path.c_str(), aside.c_str()) == 0) return aside;
    if (errno != EEXIST || k >= 100)
      throw IoError(path, errno,
                    fmt::format("link to {} (kept until the outputs are in place)", aside));
  }
}

// The commit marker's first line (tokenize_commit_marker): a file there without it is not a job's.
constexpr std::string_view kCommitMarkerText = "outcore tokenize commit\n";
// What PREFIX.lock holds while a job writes PREFIX.* (a file there holding anything else is a
// user's: locked, never written or removed).
constexpr std::string_view kPrefixLockText = "outcore tokenize lock\n";

// The commit marker (tokenize_commit_marker): kCommitMarkerText, then one "pid N" line for the
// job that wrote it and one for each killed job whose leftovers may still lie beside the
// outputs. Its writer holds an flock on it while it commits: a marker that can be locked is a
// killed job's (a pid alone could be reused after a reboot, or be another namespace's).
struct FoundMarker {
  std::vector<pid_t> pids;
};

// A commit marker this job wrote and holds locked. Written under a temporary name, locked, and
// renamed into place: a marker already there is replaced whole or not at all.
class CommitMarker {
 public:
  CommitMarker(std::string path, const std::vector<pid_t>& pids) : path_(std::move(path)) {
    std::string text(kCommitMarkerText);
    for (const pid_t pid : pids) text += fmt::format("pid {}\n", pid);
    const std::string tmp = fmt::format("{}.tmp-{}", path_, ::getpid());
    ::unlink(tmp.c_str());  // this pid's, from a run before a reboot
    fd_ = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd_ < 0) throw IoError(tmp, errno, "create the tokenize commit marker");
    int err = 0;
    if (::flock(fd_, LOCK_EX) != 0) err = errno;
    for (size_t done = 0; err == 0 && done < text.size();) {
      const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) err = n < 0 ? errno : ENOSPC;
      done += n > 0 ? static_cast<size_t>(n) : 0;
    }
    if (err == 0 && ::fsync(fd_) != 0) err = errno;
    if (err == 0 && ::rename(tmp.c_str(), path_.c_str()) != 0) err = errno;
    if (err != 0) {
      ::close(fd_);
      ::unlink(tmp.c_str());
      throw IoError(tmp, err, "write the tokenize commit marker " + path_);
    }
    // Durable before the commit it guards (a failure leaves the marker: train refuses the pair).
    try {
      fsync_parent_directory(path_);
    } catch (...) {
      ::close(fd_);  // and its lock: the destructor of a constructor that throws never runs
      fd_ = -1;
      throw;
    }
  }
  // Unlocks; the marker stays unless remove() ran (a failed commit leaves it for the next job).
  ~CommitMarker() {
    if (fd_ >= 0) ::close(fd_);
  }
  CommitMarker(const CommitMarker&) = delete;
  CommitMarker& operator=(const CommitMarker&) = delete;
  // Removes the marker (still locked: no other job takes it for a killed one's meanwhile).
  void remove() {
    if (::unlink(path_.c_str()) != 0 && errno != ENOENT)
      log::warn("tokenize: cannot remove the commit marker {}: {}", path_, std::strerror(errno));
    try {
      fsync_parent_directory(path_);
    } catch (const IoError& e) {
      // The pair is committed; a marker back after a crash only makes train ask for a rerun.
      log::warn("tokenize: {}", e.what());
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// The marker at `path` of a job killed while committing, or nullopt when there is none.
// InvalidArgument when a job still holds it (it is committing now), and when the file there is
// not a marker (a user's: kept).
std::optional<FoundMarker> read_commit_marker(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return std::nullopt;
  if (!fs::is_regular_file(fs::symlink_status(path, ec)))
    throw InvalidArgument(fmt::format(
        "{} is where this job keeps its commit marker, and it is not a file: move it away", path));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;  // its job just finished
    throw IoError(path, errno, "open the tokenize commit marker");
  }
  const bool held = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  std::string text(4096, '\0');
  const ssize_t n = held ? 0 : ::pread(fd, text.data(), text.size(), 0);
  ::close(fd);
  if (held)
    throw InvalidArgument(fmt::format(
        "{}: a tokenize job is putting these outputs in place now: wait for it to end, or choose "
        "another --out",
        path));
  text.resize(n > 0 ? static_cast<size_t>(n) : 0);
  if (!text.starts_with(kCommitMarkerText))
    throw InvalidArgument(fmt::format(
        "{} is where this job keeps its commit marker, and it holds something else: move it "
        "away or choose another --out",
        path));
  FoundMarker m;
  std::istringstream in(text.substr(kCommitMarkerText.size()));
  for (std::string line; std::getline(in, line);) {
    char* end = nullptr;
    const long pid = line.starts_with("pid ") ? std::strtol(line.c_str() + 4, &end, 10) : 0;
    if (pid > 0 && pid <= INT32_MAX && end != nullptr && *end == '\0')
      m.pids.push_back(static_cast<pid_t>(pid));
  }
  return m;
}

// Removes the commit markers' temporaries "<marker>.tmp-<pid>" that jobs killed before renaming
// them into place left (no marker names such a job): regular files that hold a marker's text and
// that no job holds locked (a marker's writer locks its temporary before writing it).
void remove_marker_temporaries(const std::string& marker) {
  const fs::path path(marker);
  const fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  const std::string head = path.filename().string() + ".tmp-";
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string entry = it->path().filename().string();
    if (!entry.starts_with(head) || entry.size() == head.size() ||
        entry.find_first_not_of("0123456789", head.size()) != std::string::npos)
      continue;
    const int fd = ::open(it->path().c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;  // a link, or gone
    struct stat st {};
    std::string text(kCommitMarkerText.size(), '\0');
    const bool ours =
        ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && ::flock(fd, LOCK_EX | LOCK_NB) == 0 &&
        ::pread(fd, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size()) &&
        text == kCommitMarkerText;
    if (ours && ::unlink(it->path().c_str()) == 0)
      log::warn("tokenize: removed {}, left by a job that was stopped", it->path().string());
    ::close(fd);
  }
}

// The files the job reads (by device and inode): never removed as leftovers, whatever their
// names.
std::vector<FileId> input_ids(const TokenizeOptions& options) {
  std::vector<FileId> ids;
  for (const std::string& in : options.inputs)
    if (FileId id; file_id_of(in, id)) ids.push_back(id);
  return ids;
}

// Removes what the killed jobs `pids` left beside `token_file` (any extension's token file of
// that prefix, its mask, the marker): the temporaries "<name>.tmp-<pid>[-<k>]", and with
// `asides` the earlier mask's second names "<mask>.old-<pid>[-<k>]". Names are rebuilt from the
// prefix and the pids and looked up in the directory (a marker never names a file), and only
// regular files there are removed: never one of `inputs`, nor one with other names (links).
void remove_leftovers(const std::string& token_file, const std::vector<pid_t>& pids, bool asides,
                      const std::vector<FileId>& inputs) {
  const fs::path target = fs::absolute(token_file);
  const fs::path dir = target.parent_path();
  const std::string stem = target.stem().string();
  const std::vector<std::string> names = {
      stem + ".bin", stem + ".u32", stem + ".mask", target.filename().string(),
      fs::path(tokenize_commit_marker(target.string())).filename().string()};
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string entry = it->path().filename().string();
    bool ours = false;
    for (const pid_t pid : pids)
      for (const std::string& name : names)
        for (const char* kind : {".tmp-", ".old-"}) {
          if (std::string_view(kind) == ".old-" && (!asides || name != stem + ".mask")) continue;
          const std::string head = name + kind + std::to_string(pid);
          if (!entry.starts_with(head)) continue;
          const std::string_view rest = std::string_view(entry).substr(head.size());
          ours = ours || rest.empty() ||
                 (rest.size() > 1 && rest[0] == '-' &&
                  rest.find_first_not_of("0123456789", 1) == std::string_view::npos);
        }
    struct stat st {};
    if (!ours || ::fstatat(dfd, entry.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode) || st.st_nlink != 1)
      continue;
    const FileId id{st.st_dev, st.st_ino};
    if (std::find(inputs.begin(), inputs.end(), id) == inputs.end() &&
        ::unlinkat(dfd, entry.c_str(), 0) == 0)
      log::warn("tokenize: removed {}, left by a job that was stopped", (dir / entry).string());
  }
  ::close(dfd);
}

// The pids in the names of the temporaries "<name>.tmp-<pid>[-<k>]" beside `token_file` (any
// extension's token file of that prefix, its mask) that name no live process: with the prefix's
// lock held, those of jobs that were killed (remove_leftovers removes them).
std::vector<pid_t> pids_of_temporaries(const std::string& token_file) {
  const fs::path target = fs::absolute(token_file);
  const std::string stem = target.stem().string();
  std::vector<pid_t> pids;
  std::error_code ec;
  for (fs::directory_iterator it(target.parent_path(), ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string entry = it->path().filename().string();
    for (const char* ext : {".bin", ".u32", ".mask"}) {
      const std::string head = stem + ext + ".tmp-";
      if (!entry.starts_with(head)) continue;
      const std::string_view rest = std::string_view(entry).substr(head.size());
      const std::string_view digits = rest.substr(0, rest.find('-'));
      if (digits.empty() || digits.size() > 9 ||
          digits.find_first_not_of("0123456789") != std::string_view::npos)
        continue;
      const auto pid = static_cast<pid_t>(std::stol(std::string(digits)));
      // This job's own pid (PID 1 in a container, where jobs always have it) is one of a killed
      // job's too: this one holds the prefix's lock and has made no temporary yet.
      const bool alive = pid > 0 && pid != ::getpid() && (::kill(pid, 0) == 0 || errno != ESRCH);
      if (!alive && std::find(pids.begin(), pids.end(), pid) == pids.end()) pids.push_back(pid);
    }
  }
  return pids;
}

// Appends tokens to the token file (and mask), counting; checks what llm.c can hold.
class OutputWriter {
 public:
  // `stale_mask`: a loss mask an earlier job wrote beside the token file this one replaces
  // without a mask (removed at commit, before the token file is renamed into place: the mask
  // of other tokens never pairs with these); empty when there is none.
  // `interrupted`: the marker of a job killed while committing into these outputs (its
  // leftovers are removed, and the marker, once this job's pair is in place).
  // `inputs`: the job's input files, never removed as a killed job's leftovers.
  OutputWriter(const std::vector<std::string>& outputs, bool llmc, bool mask,
               std::string stale_mask, FileId stale_mask_id, std::optional<FoundMarker> interrupted,
               std::vector<FileId> inputs)
      : llmc_(llmc),
        tokens_(outputs[0]),
        stale_mask_(std::move(stale_mask)),
        stale_mask_id_(stale_mask_id),
        interrupted_(std::move(interrupted)),
        inputs_(std::move(inputs)) {
    if (mask) mask_.emplace(outputs[1]);
    if (llmc_) {
      const std::array<int32_t, kLlmcHeaderInts> header{};
      tokens_.append(header.data(), sizeof(header));
    }
  }

  void write(const Segment& d) {
    if (llmc_) {
      if (count_ + d.tokens.size() > static_cast<uint64_t>(INT32_MAX))
        throw InvalidArgument(
            fmt::format("{}: more than {} tokens, the most an llm.c token file "
                        "counts; split the input",
                        tokens_.target(), INT32_MAX));
      narrow_.resize(d.tokens.size());
      for (size_t i = 0; i < d.tokens.size(); ++i) {
        if (d.tokens[i] >= kLlmcVocabLimit)
          throw CorruptData(fmt::format("token id {} does not fit the 16 bits of {}", d.tokens[i],
                                        tokens_.target()));
        narrow_[i] = static_cast<uint16_t>(d.tokens[i]);
      }
      tokens_.append(narrow_.data(), narrow_.size() * sizeof(uint16_t));
    } else {
      tokens_.append(d.tokens.data(), d.tokens.size() * sizeof(uint32_t));
    }
    if (mask_) {
      mask_->append(d.mask.data(), d.mask.size());
      for (uint8_t m : d.mask) targets_ += m;
    }
    count_ += d.tokens.size();
  }

  // Completes the header, fsyncs everything, then renames the files over their targets. The
  // loss mask at the mask's path (the one this job's mask replaces, or the stale one it removes)
  // is first linked aside, and put back when a rename fails before the token file's: a failed
  // job leaves the earlier token file and its mask as they were.
  void commit() {
    if (llmc_) {
      std::array<int32_t, kLlmcHeaderInts> header{};
      header[0] = kLlmcMagic;
      header[1] = kLlmcVersion;
      header[2] = static_cast<int32_t>(count_);
      tokens_.write_at(0, header.data(), sizeof(header));
    }
    tokens_.finish();
    if (mask_) mask_->finish();
    const std::string mask_path = mask_ ? mask_->target() : stale_mask_;
    // Two files change: a marker says so until both have (a kill in between leaves it). It
    // names this job and the killed jobs whose leftovers are still to go, and is in place
    // before anything this job could leave behind (the earlier mask's second name).
    std::optional<CommitMarker> marker;
    if (!mask_path.empty() || interrupted_) {
      std::vector<pid_t> pids{::getpid()};
      if (interrupted_)
        pids.insert(pids.end(), interrupted_->pids.begin(), interrupted_->pids.end());
      marker.emplace(tokenize_commit_marker(tokens_.target()), pids);
    }
    std::string aside;
    try {
      if (!mask_path.empty()) aside = link_aside(mask_path);
    } catch (...) {
      if (marker && !interrupted_) marker->remove();  // nothing changed
      throw;
    }
    try {
      if (mask_) mask_->commit();
      if (!stale_mask_.empty()) {
        // Only the mask checked at the start: a file put at its name since is someone else's.
        FileId now;
        if (file_id_of(stale_mask_, now) && now != stale_mask_id_)
          throw InvalidArgument(fmt::format(
              "{} was replaced while the job ran, and is not the loss mask of the token file "
              "this job replaces any more: it is kept, and {} is not written; move it away and "
              "run the job again",
              stale_mask_, tokens_.target()));
        if (::unlink(stale_mask_.c_str()) != 0 && errno != ENOENT)
          throw IoError(stale_mask_, errno, "remove the loss mask of the token file replaced");
      }
      tokens_.commit();
    } catch (...) {
      bool restored = true;  // the earlier pair (or the new one) is in place again
      if (!tokens_.committed() && !aside.empty()) {
        // The token file is the earlier one still: its mask goes back (atomically over the
        // new one, if that was renamed in), or stays where it still is (the second name then
        // goes: a rename between two names of one file does nothing).
        struct stat at {};
        struct stat kept {};
        const bool still_there = ::stat(mask_path.c_str(), &at) == 0 &&
                                 ::stat(aside.c_str(), &kept) == 0 && at.st_dev == kept.st_dev &&
                                 at.st_ino == kept.st_ino;
        if (still_there) {
          ::unlink(aside.c_str());
        } else if (::rename(aside.c_str(), mask_path.c_str()) != 0) {
          restored = false;
          log::warn("tokenize: the loss mask {} is kept as {} ({})", mask_path, aside,
                    std::strerror(errno));
        }
      } else if (!tokens_.committed() && mask_ && mask_->committed()) {
        // There was no mask before: none pairs with the old file.
        restored = ::unlink(mask_path.c_str()) == 0 || errno == ENOENT;
      } else if (!aside.empty()) {
        ::unlink(aside.c_str());
      }
      // The marker stays where the pair may be mixed: a killed job's pair this one did not
      // replace, or one it could not put back.
      if (marker && restored && !interrupted_) marker->remove();
      throw;
    }
    if (!aside.empty()) ::unlink(aside.c_str());
    if (interrupted_)
      remove_leftovers(tokens_.target(), interrupted_->pids, /*asides=*/true, inputs_);
    if (marker) marker->remove();
  }
  uint64_t count() const { return count_; }
  uint64_t targets() const { return targets_; }

 private:
  bool llmc_;
  StagedFile tokens_;
  std::string stale_mask_;
  FileId stale_mask_id_;  // the file at stale_mask_ when the job started
  std::optional<FoundMarker> interrupted_;
  std::vector<FileId> inputs_;
  std::optional<StagedFile> mask_;
  std::vector<uint16_t> narrow_;
  uint64_t count_ = 0, targets_ = 0;
};

}  // namespace

std::vector<std::string> tokenize_outputs(const TokenizeOptions& options, uint64_t vocab_size) {
  std::vector<std::string> out{options.out_prefix +
                               (vocab_size <= kLlmcVocabLimit ? ".bin" : ".u32")};
  if (!options.prompt_key.empty()) out.push_back(options.out_prefix + ".mask");
  return out;
}

TokenizeResult run_tokenize_job(const Tokenizer& tokenizer, const TokenizeOptions& options) {
  const auto start = Clock::now();
  const std::vector<std::string> outputs = tokenize_outputs(options, tokenizer.vocab_size());
  check_options(options, outputs);
  // One job at a time into a prefix (two would pair one's tokens with the other's mask), held to
  // the end; then what jobs killed before it left there (never renamed into place) goes.
  const LockFile lock(options.out_prefix + ".lock",
                      fmt::format("lock the outputs {}.* (another tokenize job is writing them)",
                                  options.out_prefix),
                      kPrefixLockText, /*register_cleanup=*/true);
  const std::vector<FileId> inputs = input_ids(options);
  remove_leftovers(outputs[0], pids_of_temporaries(outputs[0]), /*asides=*/false, inputs);
  const bool llmc = tokenizer.vocab_size() <= kLlmcVocabLimit;
  const DocumentEncoder encoder(tokenizer, options);
  DocumentReader reader(options.inputs, {.doc_per_file = options.doc_per_file,
                                         .chunk_bytes = options.chunk_bytes,
                                         .max_document_bytes = options.max_document_bytes});
  // A job killed while putting its token file and mask in place left its marker: a job still
  // running is not raced; a dead one's pair may be mixed, and this job replaces both (its mask,
  // old or new, is the dead job's to remove), removing what it left.
  const std::string marker = tokenize_commit_marker(outputs[0]);
  const std::optional<FoundMarker> interrupted = read_commit_marker(marker);
  remove_marker_temporaries(marker);
  if (interrupted) {
    log::warn(
        "tokenize: {}: a job was stopped while putting {} and its loss mask in place, which may "
        "not belong together: this job replaces both",
        marker, outputs[0]);
    // Its temporaries are of no use (its earlier mask's second name goes once this job's pair
    // is in place).
    remove_leftovers(outputs[0], interrupted->pids, /*asides=*/false, inputs);
  }
  // A file at the token file's path that is not a token file (a user's draft named thesis.bin)
  // is never replaced: an llm.c file with its header and the size it gives, a raw .u32 whole
  // tokens. A killed job's pair is always whole token files (renamed into place).
  {
    std::error_code ec;
    const fs::file_status st = fs::symlink_status(outputs[0], ec);
    if (fs::exists(st) && fs::is_regular_file(st) && !token_count_of(outputs[0], llmc))
      throw InvalidArgument(fmt::format(
          "{} exists and is not a token file ({}): this job does not replace it; move it away "
          "or choose another --out",
          outputs[0],
          llmc ? "no llm.c header giving its size"
               : "not a whole number of 32-bit tokens, or values no token id takes"));
  }
  // PREFIX.mask is the loss mask of PREFIX.bin or PREFIX.u32 (the data loader pairs it with
  // either): with the token file of the other extension beside it, it may be that file's, which
  // this job must neither replace nor remove.
  const std::string mask = options.out_prefix + ".mask";
  std::error_code ec;
  const bool mask_exists = fs::exists(fs::symlink_status(mask, ec));
  const std::string other = options.out_prefix + (llmc ? ".u32" : ".bin");
  if (mask_exists && fs::exists(fs::symlink_status(other, ec)))
    throw InvalidArgument(fmt::format(
        "{} may be the loss mask of {}, which this job does not replace (it writes {}): choose "
        "another --out, or move one of them away",
        mask, other, outputs[0]));
  // Replacing a token file whose loss mask lies beside it: a pairs job writes its own mask over
  // it, plain text removes it. A file at PREFIX.mask that is not that file's mask (no token
  // file there, or one of another count) is someone else's: never written over nor removed,
  // and never left to be paired with the new tokens.
  std::string stale_mask;
  FileId stale_mask_id;
  if (mask_exists) {
    const char* fate = encoder.pairs() ? "this job would write its mask over it"
                                       : "it would be taken as the new tokens' mask";
    if (!fs::is_regular_file(fs::symlink_status(mask, ec)))
      throw InvalidArgument(fmt::format(
          "{} is not a file this job can replace or remove (a link or a directory), and {}: "
          "move it away or choose another --out",
          mask, encoder.pairs() ? "this job would write its mask there" : fate));
    const std::optional<uint64_t> count = token_count_of(outputs[0], llmc);
    const uintmax_t mask_bytes = fs::file_size(mask, ec);
    if (!interrupted && (!count || ec || mask_bytes != *count))
      throw InvalidArgument(fmt::format(
          "{} is not the loss mask of a token file this job replaces ({}): {}; move it away or "
          "choose another --out",
          mask,
          count
              ? fmt::format("{} holds {} tokens, the mask {} bytes", outputs[0], *count, mask_bytes)
          : fs::exists(fs::symlink_status(outputs[0], ec))
              ? fmt::format("{} is not a token file", outputs[0])
              : fmt::format("there is no {}", outputs[0]),
          fate));
  }
  if (!encoder.pairs() && mask_exists) {
    stale_mask = mask;
    if (!file_id_of(stale_mask, stale_mask_id))
      throw IoError(stale_mask, errno, "stat the loss mask of the token file replaced");
    for (const std::string& in : options.inputs)
      if (!stale_mask.empty() && same_file(stale_mask, in))
        throw InvalidArgument(fmt::format(
            "{} is an input, and the loss mask this output replaces would be removed with it: "
            "choose another --out",
            in));
  }
  OutputWriter writer(outputs, llmc, encoder.pairs(), stale_mask, stale_mask_id, interrupted,
                      inputs);

  TokenizeProgress progress;
  auto last_report = start;
  auto seconds = [&start] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  auto stopped = [&options] {
    return options.stop != nullptr && options.stop->load(std::memory_order_relaxed);
  };

  auto read = [&](tbb::flow_control& fc) -> std::shared_ptr<Work> {
    if (stopped()) throw Interrupted("tokenize interrupted by a signal");
    std::unique_ptr<Batch> b = reader.next();
    if (!b) {
      fc.stop();
      return nullptr;
    }
    auto w = std::make_shared<Work>();
    w->batch = std::move(b);
    return w;
  };
  auto encode = [&](std::shared_ptr<Work> w) {
    const Batch& b = *w->batch;
    const InputFormat format = input_format_of(reader.files()[b.file]);
    for (size_t i = 0; i < b.docs.size();) {
      Segment& seg = w->segments.emplace_back();
      seg.first = i;
      for (size_t bytes = 0; i < b.docs.size() && bytes < kSegmentBytes; ++i)
        bytes += b.docs[i].size;
      seg.end = i;
    }
    tbb::parallel_for(size_t{0}, w->segments.size(), [&](size_t k) {
      Segment& seg = w->segments[k];
      for (size_t i = seg.first; i < seg.end; ++i) {
        const Document& d = b.docs[i];
        encoder.encode(std::string_view(b.bytes).substr(d.offset, d.size), d.line, format, seg);
      }
    });
    return w;
  };
  auto write = [&](std::shared_ptr<Work> w) {
    if (stopped()) throw Interrupted("tokenize interrupted by a signal");
    const std::string& file = reader.files()[w->batch->file];
    for (const Segment& seg : w->segments) {
      for (const BadEntry& e : seg.bad) {
        BadDocument bad(file, e.line, e.reason);
        if (!options.skip_bad) throw bad;
        ++progress.skipped;
        if (options.on_skipped) options.on_skipped(bad);
      }
      writer.write(seg);
      progress.documents += seg.documents;
    }
    progress.tokens = writer.count();
    progress.bytes_read = w->batch->bytes_read;
    if (options.on_progress && Clock::now() - last_report >= options.progress_interval) {
      last_report = Clock::now();
      progress.seconds = seconds();
      options.on_progress(progress);
    }
  };

  const int threads = options.threads > 0 ? options.threads : tbb::info::default_concurrency();
  tbb::task_arena arena(threads);
  arena.execute([&] {
    tbb::parallel_pipeline(
        kBatchesInFlight,
        tbb::make_filter<void, std::shared_ptr<Work>>(tbb::filter_mode::serial_in_order, read) &
            tbb::make_filter<std::shared_ptr<Work>, std::shared_ptr<Work>>(
                tbb::filter_mode::parallel, encode) &
            tbb::make_filter<std::shared_ptr<Work>, void>(tbb::filter_mode::serial_in_order,
                                                          write));
  });
  if (stopped()) throw Interrupted("tokenize interrupted by a signal");
  if (writer.count() == 0)
    throw InvalidArgument(fmt::format("no tokens to write: {}",
                                      progress.skipped > 0 ? "every document was skipped as bad"
                                                           : "the input holds no document"));
  // The last progress before the commit: a callback that fails (a log that cannot be written)
  // fails the job with nothing written.
  progress.seconds = seconds();
  if (options.on_progress) options.on_progress(progress);
  writer.commit();

  TokenizeResult result;
  result.totals = progress;
  result.totals.seconds = seconds();  // with the commit's fsyncs and renames
  result.targets = writer.targets();
  result.token_file = outputs[0];
  result.mask_file = encoder.pairs() ? outputs[1] : "";
  result.removed_mask = stale_mask;
  result.llmc = llmc;
  return result;
}

}  // namespace outcore::data
