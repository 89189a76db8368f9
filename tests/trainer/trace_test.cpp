// `TrainerOptions::trace_file` (outcore train --trace): a short stage-3 run with parameters and
// optimizer state on NVMe writes a Chrome trace that parses, whose spans close and do not
// overlap on a track, and whose NVMe bytes are the engine's traffic during the run.
#include "common/trace.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "aio/aio.hpp"
#include "common/error.hpp"
#include "engine/train/trainer.hpp"
#include "tests/trainer/trainer_test_util.hpp"

namespace outcore::train {
namespace {

using nlohmann::json;
using testing::DemoData;
using testing::make_config;
using testing::quiet_options;
using testing::tiny_model;

struct Span {
  double ts = 0, end = 0;
  std::string name;
};

// Spans of one track, sorted by start (longer first on ties), must be disjoint or properly
// nested: a span that starts inside another ends inside it too. Returns the first violation.
std::string nesting_violation(std::vector<Span> spans) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.ts != b.ts ? a.ts < b.ts : a.end > b.end;
  });
  std::vector<Span> open;
  for (const Span& s : spans) {
    while (!open.empty() && open.back().end <= s.ts) open.pop_back();
    if (!open.empty() && s.end > open.back().end) {
      return "'" + s.name + "' [" + std::to_string(s.ts) + ", " + std::to_string(s.end) +
             ") overlaps '" + open.back().name + "' [" + std::to_string(open.back().ts) + ", " +
             std::to_string(open.back().end) + ")";
    }
    open.push_back(s);
  }
  return "";
}

struct Parsed {
  json doc;
  std::map<int64_t, std::string> track_names;
  std::map<int64_t, std::vector<Span>> tracks;
  uint64_t read_bytes = 0, write_bytes = 0;
  std::set<std::pair<std::string, int>> compute;  // (forward|backward, unit)
  std::set<std::string> names;
};

Parsed parse(const std::string& path) {
  std::ifstream in(path);
  Parsed p;
  p.doc = json::parse(in);  // throws on invalid JSON
  for (const json& e : p.doc.at("traceEvents")) {
    const std::string ph = e.at("ph");
    if (ph == "M") {
      if (e.at("name") == "thread_name") p.track_names[e.at("tid")] = e.at("args").at("name");
      continue;
    }
    EXPECT_EQ(ph, "X") << e.dump();  // only complete events: nothing is left open
    const double ts = e.at("ts"), dur = e.at("dur");
    EXPECT_GE(dur, 0) << e.dump();
    p.tracks[e.at("tid")].push_back({ts, ts + dur, e.at("name")});
    p.names.insert(e.at("name"));
    const json& args = e.at("args");
    if (e.at("cat") == "io" && args.contains("bytes")) {
      (e.at("name") == "read" ? p.read_bytes : p.write_bytes) += args.at("bytes").get<uint64_t>();
    }
    if (e.at("cat") == "compute") p.compute.insert({e.at("name"), args.at("unit").get<int>()});
  }
  return p;
}

TEST(TraceTest, Stage3NvmeRunWritesAConsistentTrace) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 3);
  o.eval_every = 2;
  o.eval_batches = 1;
  o.trace_file = data.file("trace.json");
  Trainer t(make_config(testing::nvme_patch(data.file("swap")), mc), mc, o);
  const zero::TrafficStats before = t.engine().traffic();
  const TrainResult r = t.run();
  EXPECT_FALSE(trace::enabled());  // run() stops tracing

  const Parsed p = parse(o.trace_file);
  ASSERT_TRUE(r.trace.has_value());
  EXPECT_EQ(r.trace->path, o.trace_file);
  size_t spans = 0;
  for (const auto& [tid, list] : p.tracks) {
    spans += list.size();
    EXPECT_TRUE(p.track_names.count(tid)) << "track " << tid << " has no name";
    EXPECT_EQ(nesting_violation(list), "") << "on track " << p.track_names.at(tid);
  }
  EXPECT_EQ(spans, r.trace->events);

  // Every NVMe byte the engine counted during run() is in the trace, and nothing else.
  EXPECT_GT(p.read_bytes, 0u);
  EXPECT_EQ(p.read_bytes, r.traffic.nvme_read_bytes - before.nvme_read_bytes);
  EXPECT_EQ(p.write_bytes, r.traffic.nvme_write_bytes - before.nvme_write_bytes);

  // Each unit's forward and backward, the copies, Adam and the tracks of the streams.
  const int units = t.model().num_units();
  for (int u = 0; u < units; ++u) {
    EXPECT_TRUE(p.compute.count({"backward", u})) << "unit " << u;
    if (u < units - 1) {  // the head's forward is fused into its backward
      EXPECT_TRUE(p.compute.count({"forward", u})) << "unit " << u;
    }
  }
  for (const char* n : {"step", "optimizer step", "validate", "copy_h2d", "grad d2h", "adam",
                        "param wait", "swap wait", "read", "write"}) {
    EXPECT_TRUE(p.names.count(n)) << n;
  }
  std::set<std::string> names;
  for (const auto& [tid, n] : p.track_names) names.insert(n);
  for (const char* n : {"trainer", "zero-fetch", "zero-fetch-wait", "zero-grad", "optimizer #0"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  // Every step's overlapped updates run on one worker: one track, whatever the step count.
  int step_tracks = 0;
  for (const auto& [tid, n] : p.track_names) step_tracks += n == "zero-step";
  EXPECT_EQ(step_tracks, 1);

  const json& other = p.doc.at("otherData");
  const double hidden = other.at("io_hidden_under_compute");
  EXPECT_GE(hidden, 0.0);
  EXPECT_LE(hidden, 1.0);
  EXPECT_NEAR(hidden, r.trace->under_compute.hidden_fraction, 1e-6);
  EXPECT_GT(r.trace->under_compute.io_busy_s, 0.0);
}

// A run that fails (a read error while training) writes its trace up to the failure, in place
// of the file an earlier run left at the path, which would pass for this run's.
TEST(TraceTest, AFailedRunWritesItsTraceUpToTheFailure) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  auto faults = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
  faults->add_fault({.kind = aio::Fault::Kind::kEio, .nth = 40, .direction = 0});
  TrainerOptions o = quiet_options(data, 20);
  o.engine.io_backend = faults;
  o.trace_file = data.file("trace.json");
  std::ofstream(o.trace_file) << R"({"traceEvents": [], "otherData": {"run": "an earlier one"}})";
  Trainer t(make_config(testing::nvme_patch(data.file("swap")), mc), mc, o);
  EXPECT_THROW(t.run(), IoError);
  ASSERT_EQ(faults->faults_fired(), 1u);
  const Parsed p = parse(o.trace_file);
  EXPECT_FALSE(p.doc.at("otherData").contains("run")) << "the earlier run's trace is still there";
  EXPECT_TRUE(p.names.contains("step")) << p.doc.dump().substr(0, 400);
  EXPECT_FALSE(p.compute.empty());
  EXPECT_GT(p.read_bytes, 0u);
  for (const auto& [tid, spans] : p.tracks)
    EXPECT_EQ(nesting_violation(spans), "") << p.track_names.at(tid);
  EXPECT_FALSE(trace::enabled());
}

TEST(TraceTest, WithoutATraceFileNothingIsRecorded) {
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  trace::start();  // leave something behind, then switch tracing off
  trace::complete("marker", "test", trace::now_ns());
  trace::stop();
  ASSERT_EQ(trace::event_count(), 1u);
  TrainerOptions o = quiet_options(data, 2);
  Trainer t(make_config(testing::nvme_patch(data.file("swap")), mc), mc, o);
  const TrainResult r = t.run();
  EXPECT_FALSE(r.trace.has_value());
  EXPECT_EQ(trace::event_count(), 1u);  // the engine, aio, device and trainer recorded nothing
}

}  // namespace
}  // namespace outcore::train
