#include "engine/train/metrics.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/json_lines.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"

namespace outcore::train {
namespace {

std::string si(double v) {  // 12.3k, 4.56M
  double a = std::fabs(v);
  if (a >= 1e9) return fmt::format("{:.2f}G", v / 1e9);
  if (a >= 1e6) return fmt::format("{:.2f}M", v / 1e6);
  if (a >= 1e3) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

std::string bytes_iec(uint64_t b) {
  double v = static_cast<double>(b);
  if (v >= double(1ull << 30)) return fmt::format("{:.2f} GiB", v / double(1ull << 30));
  if (v >= double(1ull << 20)) return fmt::format("{:.1f} MiB", v / double(1ull << 20));
  if (v >= 1024.0) return fmt::format("{:.1f} KiB", v / 1024.0);
  return fmt::format("{} B", b);
}

nlohmann::ordered_json number_or_null(double v) {
  return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr);
}

}  // namespace

std::string format_step_line(const StepMetrics& m) {
  std::string s = m.total_steps > 0 ? fmt::format("step {}/{}", m.step, m.total_steps)
                                    : fmt::format("step {}", m.step);
  // A step whose loss mask left no target has no loss to show (its recorded 0 is no figure).
  const std::string loss =
      m.masked && m.tokens_trained == 0 ? std::string("   -  ") : fmt::format("{:.4f}", m.loss);
  s += fmt::format(" | loss {} | lr {:.3e} | {} tok/s | {:.1f} GFLOP/s | mem {}", loss, m.lr,
                   si(m.tokens_per_s), m.gflops_per_s, bytes_iec(m.device_mem_peak_bytes));
  if (m.masked) s += fmt::format(" | trained {} tok", si(static_cast<double>(m.tokens_trained)));
  if (m.grad_norm) s += fmt::format(" | gnorm {:.3f}", *m.grad_norm);
  if (m.loss_scale) s += fmt::format(" | scale {}", *m.loss_scale);
  for (const TierIo& t : m.io) {
    s += fmt::format(" | {} r {:.2f} w {:.2f} GB/s", t.tier, t.read_gb_per_s, t.write_gb_per_s);
  }
  if (m.skipped) s += " | SKIPPED (overflow)";
  return s;
}

std::string format_validation_line(const ValidationMetrics& m) {
  const std::string trained =
      m.masked ? fmt::format(", {} trained", si(static_cast<double>(m.tokens_trained))) : "";
  const std::string loss =
      m.masked && m.tokens_trained == 0 ? std::string("   -  ") : fmt::format("{:.4f}", m.loss);
  return fmt::format("val step {} | loss {} | {} tokens{} | {:.2f} s", m.step, loss,
                     si(static_cast<double>(m.tokens)), trained, m.time_s);
}

nlohmann::ordered_json to_json(const StepMetrics& m) {
  nlohmann::ordered_json j;
  j["type"] = "step";
  j["step"] = m.step;
  if (m.total_steps > 0) j["total_steps"] = m.total_steps;
  // A step whose loss mask left no target has no loss: null, as a loss that is not finite.
  j["loss"] =
      m.masked && m.tokens_trained == 0 ? nlohmann::ordered_json(nullptr) : number_or_null(m.loss);
  j["lr"] = m.lr;
  if (m.beta1) j["beta1"] = *m.beta1;
  j["tokens_per_s"] = m.tokens_per_s;
  j["tokens"] = m.tokens;
  j["tokens_trained"] = m.tokens_trained;
  j["gflops_per_s"] = m.gflops_per_s;
  j["device_mem_peak_bytes"] = m.device_mem_peak_bytes;
  j["step_time_s"] = m.step_time_s;
  j["elapsed_s"] = m.elapsed_s;
  if (m.grad_norm) j["grad_norm"] = number_or_null(*m.grad_norm);
  if (m.loss_scale) j["loss_scale"] = *m.loss_scale;
  j["skipped"] = m.skipped;
  if (!m.in_backward.empty()) j["step_in_backward"] = m.in_backward;
  if (!m.io.empty()) {
    nlohmann::ordered_json io = nlohmann::ordered_json::object();
    for (const TierIo& t : m.io) {
      io[t.tier] = {{"read_gb_per_s", t.read_gb_per_s}, {"write_gb_per_s", t.write_gb_per_s}};
    }
    j["io"] = std::move(io);
  }
  return j;
}

nlohmann::ordered_json to_json(const ValidationMetrics& m) {
  nlohmann::ordered_json j;
  j["type"] = "val";
  j["step"] = m.step;
  j["loss"] =
      m.masked && m.tokens_trained == 0 ? nlohmann::ordered_json(nullptr) : number_or_null(m.loss);
  j["tokens"] = m.tokens;
  j["tokens_trained"] = m.tokens_trained;
  j["time_s"] = m.time_s;
  return j;
}

// ---- ProgressDisplay --------------------------------------------------------------------

namespace {
// Columns of the terminal behind `out`, or 0 when unknown.
int terminal_columns(std::FILE* out) {
  winsize ws{};
  if (ioctl(fileno(out), TIOCGWINSZ, &ws) == 0) return ws.ws_col;
  return 0;
}
}  // namespace

ProgressDisplay::ProgressDisplay(std::FILE* out, Mode mode, int64_t keep_every)
    : out_(out), mode_(mode), keep_every_(keep_every) {
  if (mode_ == Mode::kAuto) mode_ = isatty(fileno(out_)) ? Mode::kRefresh : Mode::kLines;
}

ProgressDisplay::~ProgressDisplay() { finish(); }

void ProgressDisplay::step(const StepMetrics& m) {
  std::string line = format_step_line(m);
  if (mode_ == Mode::kLines) {
    // Every keep_every-th step (steps_per_print), and the first, the last and a skipped one.
    if (keep_every_ <= 0 || m.step % keep_every_ == 0 || m.step == 1 || m.step == m.total_steps ||
        m.skipped)
      std::fprintf(out_, "%s\n", line.c_str());
  } else {
    bool keep = keep_every_ > 0 && m.step % keep_every_ == 0;
    // A line that wraps cannot be redrawn in place: cut the transient one to the width.
    int cols = terminal_columns(out_);
    if (!keep && cols > 1 && line.size() >= static_cast<size_t>(cols)) line.resize(cols - 1);
    std::fprintf(out_, "\r\x1b[2K%s%s", line.c_str(), keep ? "\n" : "");
    line_pending_ = !keep;
  }
  std::fflush(out_);
}

void ProgressDisplay::print_whole_line(std::string_view line) {
  if (line_pending_) std::fputs("\r\x1b[2K", out_);
  std::fprintf(out_, "%.*s\n", static_cast<int>(line.size()), line.data());
  line_pending_ = false;
  std::fflush(out_);
}

void ProgressDisplay::validation(const ValidationMetrics& m) {
  print_whole_line(format_validation_line(m));
}

void ProgressDisplay::message(std::string_view line) { print_whole_line(line); }

void ProgressDisplay::finish() {
  if (!line_pending_) return;
  std::fputc('\n', out_);
  std::fflush(out_);
  line_pending_ = false;
}

// ---- MetricsWriter ----------------------------------------------------------------------

namespace {

// Whether the open file `fd` is empty or a metrics file: its first line a JSON record whose
// "type" is one a MetricsWriter writes ("start", "step" or "val"; a user's JSON lines with
// another "type" are not metrics).
bool holds_metrics_or_nothing(int fd) {
  return first_json_line_is(fd, "type", {"start", "step", "val"});
}

// Where to cut metrics file `fd` for a run resumed at step `resumed_at`: the offset of its
// first record whose "step" is later, and the number of records from there; -1 when none.
std::pair<off_t, int64_t> records_after(int fd, int64_t resumed_at) {
  std::pair<off_t, int64_t> cut{-1, 0};
  std::string pending;
  std::vector<char> buf(1 << 20);
  off_t at = 0, line_start = 0;
  for (;;) {
    const ssize_t n = ::pread(fd, buf.data(), buf.size(), at);
    if (n <= 0) break;
    at += n;
    pending.append(buf.data(), static_cast<size_t>(n));
    size_t begin = 0;
    for (size_t eol; (eol = pending.find('\n', begin)) != std::string::npos; begin = eol + 1) {
      if (cut.first >= 0) {
        ++cut.second;
      } else {
        const nlohmann::json r = nlohmann::json::parse(
            std::string_view(pending).substr(begin, eol - begin), nullptr, false);
        if (r.is_object() && r.contains("step") && r["step"].is_number_integer() &&
            r["step"].get<int64_t>() > resumed_at) {
          cut = {line_start, 1};
        }
      }
      line_start += static_cast<off_t>(eol + 1 - begin);
    }
    pending.erase(0, begin);
  }
  // A last record cut short (a crash while writing it): cut too, or the next record would
  // continue its line.
  if (cut.first < 0 && !pending.empty()) cut = {line_start, 1};
  return cut;
}

MetricsResume resume_at(int64_t step) {
  MetricsResume r;
  r.step = step;
  return r;
}

}  // namespace

MetricsWriter::MetricsWriter(const std::string& path, bool append, int64_t resumed_at)
    : MetricsWriter(path, append, resume_at(resumed_at)) {}

MetricsWriter::MetricsWriter(const std::string& path, const MetricsResume& resume)
    : MetricsWriter(path, true, resume) {}

MetricsWriter::MetricsWriter(const std::string& path, bool append, const MetricsResume& resume)
    : path_(path), resumed_at_(resume.step) {
  const int64_t resumed_at = resume.step;
  // Read too where it is a file (its first line is checked): a device or FIFO only written.
  struct stat st {};
  const bool missing = ::stat(path.c_str(), &st) != 0;
  const bool regular = missing || S_ISREG(st.st_mode);
  const int flags = (regular ? O_RDWR : O_WRONLY) | O_CLOEXEC | (append ? O_APPEND : 0);
  // Created here (exclusively: a file that appears meanwhile is opened as it is) is removed
  // again by a writer that never wrote a record.
  fd_ = missing ? ::open(path.c_str(), flags | O_CREAT | O_EXCL, 0644) : -1;
  created_ = fd_ >= 0;
  if (fd_ < 0) fd_ = ::open(path.c_str(), flags | O_CREAT, 0644);
  if (fd_ < 0) throw IoError(path, errno, "open metrics file");
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) return;  // nothing to lock, cut or keep
  auto fail = [this](auto&& error) {
    remove_if_unwritten();
    ::close(fd_);
    fd_ = -1;
    throw error;
  };
  // One run at a time: another one's records would interleave with these, and a fresh run
  // would cut them.
  if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) {
    locked_ = true;
  } else {
    if (errno == EWOULDBLOCK)
      fail(PathBusy(path,
                    "lock metrics file (another run is writing it: give each run its own "
                    "metrics file)"));
    log::warn(
        "{}: the metrics file cannot be locked ({}): a second run writing it would not be "
        "stopped",
        path, errno_string(errno));
  }
  // A run replaces (fresh) or extends (resumed) a metrics file, never a user's other file.
  if (!holds_metrics_or_nothing(fd_))
    fail(InvalidArgument(fmt::format(
        "{}: exists and is not a metrics file (its first line is not a JSON record of "
        "\"type\" start, step or val): a run {} only a metrics file; move it away or name "
        "another file",
        path, append ? "appends to" : "replaces")));
  if (append) {
    // The record its run wrote last before the checkpoint, where it wrote it: else the file is
    // another run's, or was cut since, and this run's records would be mixed with its.
    if (!resume.last_record.empty()) {
      const std::string want = resume.last_record + "\n";
      std::string got(want.size(), '\0');
      const bool there =
          resume.bytes >= want.size() &&
          ::pread(fd_, got.data(), got.size(), static_cast<off_t>(resume.bytes - want.size())) ==
              static_cast<ssize_t>(got.size()) &&
          got == want;
      if (!there)
        fail(InvalidArgument(fmt::format(
            "{}: does not hold the records of the run that saved the checkpoint resumed (its "
            "record of step {} is not where that run wrote it): another run has written the "
            "file since; this run would mix its records with that one's. Move it away or give "
            "--metrics another file",
            path, resumed_at)));
    }
    // Cut at the first record: a run that fails to start leaves the file as it was.
    if (resumed_at >= 0) std::tie(cut_at_, cut_records_) = records_after(fd_, resumed_at);
    if (cut_at_ >= 0 && !resume.later_checkpoints.empty())
      fail(InvalidArgument(fmt::format(
          "{}: holds {} records from step {} on, which {} of the same run continue: resuming "
          "step {} would drop them. Give --metrics another file for this run",
          path, cut_records_, resumed_at + 1, resume.later_checkpoints, resumed_at)));
    return;
  }
  // Emptied at the first record: a run that fails to start leaves the file as it was.
  empty_first_ = st.st_size > 0;
}

MetricsWriter::~MetricsWriter() {
  if (fd_ < 0) return;
  remove_if_unwritten();
  ::close(fd_);
}

void MetricsWriter::remove_if_unwritten() noexcept {
  // A run that never started leaves nothing: the file this created, while it holds the lock
  // (one that lost the lock to another run leaves that run's file), and only if the path still
  // names it (a file moved there since is someone else's).
  FileId mine;
  if (created_ && locked_ && !wrote_ && file_id_of(fd_, mine)) unlink_if_same(path_, mine);
}

void MetricsWriter::write_json(const nlohmann::ordered_json& record) {
  if (fd_ < 0) throw InvalidArgument(fmt::format("{}: metrics file already closed", path_));
  if (empty_first_) {
    if (::ftruncate(fd_, 0) != 0) throw IoError(path_, errno, "truncate metrics file");
    empty_first_ = false;
  }
  if (cut_at_ >= 0) {
    if (::ftruncate(fd_, cut_at_) != 0) throw IoError(path_, errno, "truncate metrics file");
    log::warn(
        "{}: {} records from the first of a step after {} on removed: an earlier run went on "
        "past the checkpoint this run resumes, and this run records those steps again",
        path_, cut_records_, resumed_at_);
    cut_at_ = -1;
  }
  std::string line = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  line += '\n';
  // A record is whole or absent: after a short write (a full disk) the file is cut back to
  // where the record started, so readers never see half a line.
  const off_t start = ::lseek(fd_, 0, SEEK_END);
  const char* p = line.data();
  size_t n = line.size();
  while (n > 0) {
    ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = w < 0 ? errno : EIO;
      if (start >= 0 && n != line.size() && ::ftruncate(fd_, start) != 0)
        log::warn("{}: cannot remove a partial metrics record: {}", path_, errno_string(errno));
      throw IoError(path_, err, "write metrics record");
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  wrote_ = true;  // only once a record is whole: a file created for none is removed again
  line.pop_back();
  last_record_ = std::move(line);
  end_ = static_cast<uint64_t>(start) + last_record_.size() + 1;
}

void MetricsWriter::close() {
  if (fd_ < 0) return;
  int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0 && errno != EINVAL) {
    int err = errno;
    ::close(fd);
    throw IoError(path_, err, "fsync metrics file");
  }
  if (::close(fd) != 0) throw IoError(path_, errno, "close metrics file");
}

}  // namespace outcore::train
