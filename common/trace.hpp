// Process-wide tracing in Chrome's trace-event format (open the file in Perfetto or
// chrome://tracing). Off by default: a Span then costs one relaxed atomic load and a branch
// (no clock read, no allocation, no lock). On: each finished span is appended, under one short
// lock, as a complete event ("ph":"X") on a track: the calling thread's, or one lane of a named
// lane pool for work that overlaps on one thread (I/O requests, concurrent optimizer steps).
//
// Tracks: every thread that records gets its own track, named by name_thread() (or
// "thread <tid>"). A lane pool "P" has tracks "P #0", "P #1", ...; a span goes to the first lane
// whose previous span ended at or before this one's start, so spans on one lane never overlap.
// On a thread's own track spans nest (a step encloses its forward and backward spans) and
// never overlap otherwise, because a thread's spans are scopes.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace outcore::trace {

// Optional details of a span; negative numbers and empty strings are left out of the file.
struct Args {
  int64_t bytes = -1;          // bytes moved (I/O, copies)
  int32_t unit = -1;           // model unit
  int32_t index = -1;          // sub-group, micro-batch, ...
  std::string_view file = {};  // copied when the span is recorded
  // Record on a lane of this pool instead of the calling thread's track (a string literal or a
  // string that outlives the call; pools are told apart by content).
  const char* lanes = nullptr;
};

// One recorded span. Times are nanoseconds since start().
struct Event {
  const char* name = "";  // static strings (literals)
  const char* cat = "";
  int64_t start_ns = 0;
  int64_t dur_ns = 0;
  uint32_t tid = 0;
  int64_t bytes = -1;
  int32_t unit = -1;
  int32_t index = -1;
  std::string file;
};

// A track: a thread or one lane of a pool.
struct Track {
  uint32_t tid = 0;
  std::string name;
};

namespace detail {
extern std::atomic<bool> g_enabled;
}

// Whether spans are being recorded (any thread).
inline bool enabled() { return detail::g_enabled.load(std::memory_order_relaxed); }

// Drops everything recorded so far and starts recording. Threads keep the names they were given.
void start();
// Stops recording; what was recorded stays until the next start(). Spans still open are dropped.
void stop();
// Nanoseconds since start() (steady clock).
int64_t now_ns();

// Names the calling thread's track. Cheap and records nothing while tracing is off; the name is
// kept for the thread's lifetime and used whenever it records.
void name_thread(std::string_view name);

// Records a span [start_ns, now) with `name` and `cat` (string literals) on the calling thread's
// track or on args.lanes. Nothing happens when tracing is off or start_ns < 0.
void complete(const char* name, const char* cat, int64_t start_ns, const Args& args = {});

// Snapshots of what has been recorded (any thread; consistent with each other only when no
// thread is recording).
std::vector<Event> events();
std::vector<Track> tracks();
size_t event_count();

// How much of the I/O time ran under compute, from the recorded spans. I/O busy time is the
// wall time during which at least one "io" span was open; exposed time is the part of it during
// which no span of `cover` categories was open. hidden_fraction = 1 - exposed / busy (1 with no
// I/O).
struct IoOverlap {
  double io_busy_s = 0;
  double io_exposed_s = 0;
  double hidden_fraction = 1;
};
IoOverlap io_overlap(const std::vector<Event>& events, const std::vector<std::string>& cover);

// Whether `path` (links followed) names nothing, an empty file, or a trace file (its text begins
// with {"traceEvents", as write_json writes it): the only files a trace replaces.
bool holds_trace_or_nothing(const std::string& path);

// Writes {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}} to `path`: thread
// and process names as metadata events, then every span as a complete event (ts and dur in
// microseconds), and `other` (already-formatted JSON members, e.g. "\"k\": 1") in otherData.
// Replaces only what holds_trace_or_nothing accepts: InvalidArgument naming the path otherwise
// (a file put there during the run is kept). Throws IoError naming the path when it cannot be
// written.
void write_json(const std::string& path, const std::vector<std::string>& other = {});

// Times a scope on the calling thread's track (or args.lanes).
class Span {
 public:
  Span(const char* name, const char* cat, const Args& args = {})
      : name_(name), cat_(cat), args_(args), start_ns_(enabled() ? now_ns() : -1) {}
  ~Span() {
    if (start_ns_ >= 0) complete(name_, cat_, start_ns_, args_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;
  const char* cat_;
  Args args_;
  int64_t start_ns_;
};

}  // namespace outcore::trace

#define OUTCORE_TRACE_CAT2(a, b) a##b
#define OUTCORE_TRACE_CAT(a, b) OUTCORE_TRACE_CAT2(a, b)
// OUTCORE_TRACE_SPAN("forward", "compute", {.unit = u}): a span over the rest of the scope.
#define OUTCORE_TRACE_SPAN(...) \
  ::outcore::trace::Span OUTCORE_TRACE_CAT(outcore_trace_span_, __LINE__)(__VA_ARGS__)
