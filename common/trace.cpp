// Tracer state: one mutex over the event list, the tracks and the lane pools. Spans are
// appended when they end, so a lane pool sees them in order of their end times, which is what
// makes "first lane free at the span's start" a non-overlapping assignment.
#include "common/trace.hpp"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>

#include "common/error.hpp"
#include "common/open_file.hpp"

namespace outcore::trace {
namespace detail {
std::atomic<bool> g_enabled{false};
}
namespace {

using Clock = std::chrono::steady_clock;

struct Lane {
  uint32_t tid = 0;
  int64_t last_end_ns = 0;
};

struct State {
  std::mutex mu;
  uint64_t epoch = 0;                              // GUARDED_BY(mu); bumped by start()
  std::atomic<int64_t> origin_ns{0};               // steady clock at start()
  std::vector<Event> events;                       // GUARDED_BY(mu)
  std::vector<Track> tracks;                       // GUARDED_BY(mu)
  std::map<std::string, std::vector<Lane>> lanes;  // GUARDED_BY(mu)
};

State& state() {
  static State s;
  return s;
}

struct ThreadTrack {
  uint64_t epoch = 0;  // the start() this tid belongs to; 0 = none
  uint32_t tid = 0;
  std::string name;
};
thread_local ThreadTrack t_track;

int64_t clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

uint32_t new_track(State& s, std::string name) {
  const auto tid = static_cast<uint32_t>(s.tracks.size() + 1);
  s.tracks.push_back({tid, std::move(name)});
  return tid;
}

// REQUIRES: s.mu held.
uint32_t thread_tid(State& s) {
  if (t_track.epoch != s.epoch) {
    t_track.epoch = s.epoch;
    t_track.tid = new_track(s, "");
    s.tracks.back().name =
        t_track.name.empty() ? fmt::format("thread {}", t_track.tid) : t_track.name;
  }
  return t_track.tid;
}

// The first lane of `pool` free at `start`, made if none is. REQUIRES: s.mu held.
Lane& lane_for(State& s, const char* pool, int64_t start) {
  std::vector<Lane>& lanes = s.lanes[pool];
  for (Lane& l : lanes) {
    if (l.last_end_ns <= start) return l;
  }
  lanes.push_back({new_track(s, fmt::format("{} #{}", pool, lanes.size())), 0});
  return lanes.back();
}

void append_escaped(std::string& out, std::string_view s) {
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        } else {
          out += c;
        }
    }
  }
}

std::string quoted(std::string_view s) {
  std::string out = "\"";
  append_escaped(out, s);
  out += '"';
  return out;
}

// Nanoseconds as exact decimal microseconds.
std::string micros(int64_t ns) { return fmt::format("{}.{:03}", ns / 1000, ns % 1000); }

std::string event_json(const Event& e, int pid) {
  std::string args;
  auto add = [&](std::string_view key, const std::string& value) {
    args += args.empty() ? "" : ", ";
    args += fmt::format("\"{}\": {}", key, value);
  };
  if (e.bytes >= 0) add("bytes", std::to_string(e.bytes));
  if (e.unit >= 0) add("unit", std::to_string(e.unit));
  if (e.index >= 0) add("index", std::to_string(e.index));
  if (!e.file.empty()) add("file", quoted(e.file));
  return fmt::format(
      "{{\"ph\": \"X\", \"pid\": {}, \"tid\": {}, \"name\": {}, \"cat\": {}, \"ts\": {}, "
      "\"dur\": {}, \"args\": {{{}}}}}",
      pid, e.tid, quoted(e.name), quoted(e.cat), micros(e.start_ns), micros(e.dur_ns), args);
}

using Intervals = std::vector<std::pair<int64_t, int64_t>>;

// Sorted, disjoint union of the spans whose category is in `cats`.
Intervals merged(const std::vector<Event>& events, const std::vector<std::string>& cats) {
  Intervals v;
  for (const Event& e : events) {
    if (std::find(cats.begin(), cats.end(), e.cat) != cats.end())
      v.emplace_back(e.start_ns, e.start_ns + e.dur_ns);
  }
  std::sort(v.begin(), v.end());
  Intervals out;
  for (const auto& [b, e] : v) {
    if (!out.empty() && b <= out.back().second) {
      out.back().second = std::max(out.back().second, e);
    } else {
      out.emplace_back(b, e);
    }
  }
  return out;
}

int64_t total(const Intervals& v) {
  int64_t t = 0;
  for (const auto& [b, e] : v) t += e - b;
  return t;
}

int64_t intersection(const Intervals& a, const Intervals& b) {
  int64_t t = 0;
  for (size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    t +=
        std::max<int64_t>(0, std::min(a[i].second, b[j].second) - std::max(a[i].first, b[j].first));
    if (a[i].second < b[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  return t;
}

}  // namespace

void start() {
  State& s = state();
  std::lock_guard lock(s.mu);
  ++s.epoch;
  s.events.clear();
  s.tracks.clear();
  s.lanes.clear();
  s.origin_ns = clock_ns();
  detail::g_enabled.store(true, std::memory_order_relaxed);
}

void stop() { detail::g_enabled.store(false, std::memory_order_relaxed); }

int64_t now_ns() { return clock_ns() - state().origin_ns.load(std::memory_order_relaxed); }

void name_thread(std::string_view name) {
  t_track.name = name;
  if (!enabled()) return;
  State& s = state();
  std::lock_guard lock(s.mu);
  if (t_track.epoch == s.epoch) s.tracks[t_track.tid - 1].name = name;
}

void complete(const char* name, const char* cat, int64_t start_ns, const Args& args) {
  if (!enabled() || start_ns < 0) return;
  State& s = state();
  std::lock_guard lock(s.mu);
  if (!enabled()) return;
  const int64_t end = now_ns();  // read under the lock: lanes see spans in end order
  uint32_t tid;
  if (args.lanes != nullptr) {
    Lane& lane = lane_for(s, args.lanes, start_ns);
    lane.last_end_ns = end;
    tid = lane.tid;
  } else {
    tid = thread_tid(s);
  }
  s.events.push_back({name, cat, start_ns, std::max<int64_t>(0, end - start_ns), tid, args.bytes,
                      args.unit, args.index, std::string(args.file)});
}

std::vector<Event> events() {
  State& s = state();
  std::lock_guard lock(s.mu);
  return s.events;
}

std::vector<Track> tracks() {
  State& s = state();
  std::lock_guard lock(s.mu);
  return s.tracks;
}

size_t event_count() {
  State& s = state();
  std::lock_guard lock(s.mu);
  return s.events.size();
}

IoOverlap io_overlap(const std::vector<Event>& events, const std::vector<std::string>& cover) {
  const Intervals io = merged(events, {"io"});
  const int64_t busy = total(io);
  const int64_t exposed = busy - intersection(io, merged(events, cover));
  IoOverlap r;
  r.io_busy_s = static_cast<double>(busy) * 1e-9;
  r.io_exposed_s = static_cast<double>(exposed) * 1e-9;
  r.hidden_fraction = busy > 0 ? 1.0 - static_cast<double>(exposed) / static_cast<double>(busy) : 1;
  return r;
}

bool holds_trace_or_nothing(const std::string& path) {
  const std::string target = resolve_links(path);
  struct stat st {};
  if (::stat(target.c_str(), &st) != 0) return errno == ENOENT;
  if (!S_ISREG(st.st_mode)) return false;
  if (st.st_size == 0) return true;
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(target.c_str(), "rb"), &std::fclose);
  if (!f) return false;
  char head[64] = {};
  const size_t n = std::fread(head, 1, sizeof head - 1, f.get());
  const std::string_view text(head, n);
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos || text[first] != '{') return false;
  const size_t key = text.find_first_not_of(" \t\r\n", first + 1);
  return key != std::string_view::npos && text.substr(key).starts_with("\"traceEvents\"");
}

void write_json(const std::string& path, const std::vector<std::string>& other) {
  if (!holds_trace_or_nothing(path))
    throw InvalidArgument(fmt::format(
        "{}: exists and is not a trace file (it does not begin with {{\"traceEvents\"): the trace "
        "replaces only a trace, and was not written",
        path));
  const std::vector<Event> evs = events();
  const std::vector<Track> trs = tracks();
  const int pid = static_cast<int>(::getpid());
  // Through a temporary beside it and a rename: a failed write (a full disk) leaves no partial
  // trace under `path`, and whatever was there stays. A link is followed (the file it names is
  // replaced, not the link), and a file replaced keeps its mode. Events go to the file as they
  // are formatted: the JSON text is never held whole in memory.
  const std::string target = resolve_links(path);
  remove_killed_temporaries(target, "trace",
                            [](int fd) { return empty_or_begins_with(fd, "{\"traceEvents\""); });
  const std::string tmp = fmt::format("{}.tmp-{}", target, ::getpid());
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(tmp.c_str(), "wbx"), &std::fclose);
  if (!f) throw IoError(tmp, errno, "create trace file");  // exclusively: it is this run's
  uint64_t written = 0;
  const auto put = [&](const std::string& text) {
    if (std::fwrite(text.data(), 1, text.size(), f.get()) != text.size())
      throw IoError(path, written, text.size(), errno, "write trace file");
    written += text.size();
  };
  try {
    if (struct stat was{}; ::stat(target.c_str(), &was) == 0 && S_ISREG(was.st_mode))
      (void)::fchmod(::fileno(f.get()), was.st_mode & 07777);
    put(
        fmt::format("{{\"traceEvents\": [\n{{\"ph\": \"M\", \"pid\": {}, \"tid\": 0, \"name\": "
                    "\"process_name\", \"args\": {{\"name\": \"outcore\"}}}}",
                    pid));
    for (const Track& t : trs) {
      put(fmt::format(
          ",\n{{\"ph\": \"M\", \"pid\": {}, \"tid\": {}, \"name\": \"thread_name\", \"args\": "
          "{{\"name\": {}}}}}",
          pid, t.tid, quoted(t.name)));
      put(fmt::format(
          ",\n{{\"ph\": \"M\", \"pid\": {}, \"tid\": {}, \"name\": \"thread_sort_index\", "
          "\"args\": {{\"sort_index\": {}}}}}",
          pid, t.tid, t.tid));
    }
    for (const Event& e : evs) put(",\n" + event_json(e, pid));
    std::string end = "\n],\n\"displayTimeUnit\": \"ms\",\n\"otherData\": {";
    for (size_t i = 0; i < other.size(); ++i) end += (i ? ", " : "") + other[i];
    put(end + "}}\n");
    if (std::fflush(f.get()) != 0) throw IoError(path, 0, written, errno, "write trace file");
    FILE* raw = f.release();
    if (std::fclose(raw) != 0) throw IoError(path, 0, written, errno, "close trace file");
    if (std::rename(tmp.c_str(), target.c_str()) != 0)
      throw IoError(target, errno, "rename trace file into place");
  } catch (...) {
    f.reset();
    std::remove(tmp.c_str());
    throw;
  }
}

}  // namespace outcore::trace
