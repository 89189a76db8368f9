#include "tools/aio_bench/sweep.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "tools/aio_bench/scratch.hpp"
#include "tools/aio_bench/sizes.hpp"

namespace outcore::aio_bench {

Axes default_axes() {
  return {
      {128 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20}, {1, 4, 8, 32, 128}, {1}, {false}, {true}};
}

Axes full_axes() {
  return {{128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20},
          {1, 2, 4, 8, 16, 32, 64, 128},
          {1, 2, 4, 8},
          {false, true},
          {true, false}};
}

std::vector<aio::Options> grid(const Axes& a) {
  std::vector<aio::Options> out;
  for (uint64_t bs : a.block_sizes)
    for (unsigned qd : a.queue_depths)
      for (unsigned t : a.threads)
        for (bool single : a.single_submit)
          for (bool overlap : a.overlap_events)
            out.push_back({.block_size = bs,
                           .queue_depth = qd,
                           .thread_count = t,
                           .single_submit = single,
                           .overlap_events = overlap});
  return out;
}

std::vector<aio::Options> refine(const aio::Options& best) {
  std::vector<aio::Options> out;
  for (unsigned t : {2u, 4u}) {
    aio::Options o = best;
    o.thread_count = t;
    out.push_back(o);
  }
  aio::Options single = best;
  single.single_submit = !best.single_submit;
  out.push_back(single);
  aio::Options batches = best;
  batches.overlap_events = !best.overlap_events;
  out.push_back(batches);
  return out;
}

double Row::score() const { return (read ? read->gbps : 0.0) + (write ? write->gbps : 0.0); }

const Row* choose(const std::vector<Row>& rows, double tolerance) {
  double best = 0;
  for (const Row& r : rows) best = std::max(best, r.score());
  if (best <= 0) return nullptr;
  const Row* pick = nullptr;
  auto inflight = [](const aio::Options& o) {
    return o.block_size * o.queue_depth * o.thread_count;
  };
  for (const Row& r : rows) {
    if (r.score() < (1.0 - tolerance) * best) continue;
    if (pick == nullptr || inflight(r.opt) < inflight(pick->opt) ||
        (inflight(r.opt) == inflight(pick->opt) && r.score() > pick->score())) {
      pick = &r;
    }
  }
  return pick;
}

std::string describe(const aio::Options& o) {
  return fmt::format("bs={} qd={} threads={} {} {}", format_size(o.block_size), o.queue_depth,
                     o.thread_count, o.single_submit ? "single" : "batch",
                     o.overlap_events ? "overlap" : "no-overlap");
}

namespace {

std::string cell(const std::optional<Result>& r) {
  if (!r) return fmt::format("{:>7} {:>8} {:>8}", "-", "-", "-");
  return fmt::format("{:>7.3f} {:>8} {:>8}", r->gbps, r->p50_us, r->p99_us);
}

std::string ratio(const std::optional<Result>& ours, const std::optional<Result>& fio) {
  if (!ours || !fio || fio->gbps <= 0) return fmt::format("{:>7} {:>6}", "-", "-");
  return fmt::format("{:>7.3f} {:>6.2f}", fio->gbps, ours->gbps / fio->gbps);
}

}  // namespace

void print_table(const std::vector<Row>& rows, const aio::BackendChoice& backend, bool with_fio) {
  std::string head = fmt::format(
      "{:>6} {:>4} {:>4} {:>6} {:>7} | {:>7} {:>8} {:>8} | {:>7} {:>8} {:>8}", "block", "qd", "thr",
      "submit", "overlap", "read", "p50us", "p99us", "write", "p50us", "p99us");
  if (with_fio)
    head += fmt::format(" | {:>7} {:>6} {:>7} {:>6}", "fio_rd", "ratio", "fio_wr", "ratio");
  std::printf(
      "aio backend: %s\nGB/s = 1e9 bytes/s; latency per request, submission to completion\n%s\n",
      describe_backend(backend).c_str(), head.c_str());
  for (const Row& r : rows) {
    std::string line =
        fmt::format("{:>6} {:>4} {:>4} {:>6} {:>7} | {} | {}", format_size(r.opt.block_size),
                    r.opt.queue_depth, r.opt.thread_count, r.opt.single_submit ? "single" : "batch",
                    r.opt.overlap_events ? "yes" : "no", cell(r.read), cell(r.write));
    if (with_fio) line += " | " + ratio(r.read, r.fio_read) + " " + ratio(r.write, r.fio_write);
    std::printf("%s\n", line.c_str());
  }
}

std::string aio_section(const aio::Options& o, int indent) {
  std::string pad(indent, ' ');
  return fmt::format(
      "{0}\"aio\": {{\n"
      "{0}  \"block_size\": {1},\n"
      "{0}  \"queue_depth\": {2},\n"
      "{0}  \"intra_op_parallelism\": {3},\n"
      "{0}  \"single_submit\": {4},\n"
      "{0}  \"overlap_events\": {5}\n"
      "{0}}}",
      pad, o.block_size, o.queue_depth, o.thread_count, o.single_submit, o.overlap_events);
}

namespace {

nlohmann::json result_json(const std::optional<Result>& r) {
  if (!r) return nullptr;
  return {{"gbps", r->gbps},     {"bytes", r->bytes},   {"seconds", r->seconds},
          {"p50_us", r->p50_us}, {"p99_us", r->p99_us}, {"stopped", r->stopped}};
}

nlohmann::json options_json(const aio::Options& o) {
  return {{"block_size", o.block_size},
          {"queue_depth", o.queue_depth},
          {"intra_op_parallelism", o.thread_count},
          {"single_submit", o.single_submit},
          {"overlap_events", o.overlap_events}};
}

}  // namespace

std::string to_json(const std::vector<Row>& rows, const Row* best,
                    const aio::BackendChoice& backend, const std::string& path, uint64_t file_size,
                    bool interrupted) {
  nlohmann::json doc;
  doc["backend"] = {
      {"name", backend.name()}, {"forced", backend.forced}, {"fallback_reason", nullptr}};
  if (!backend.fallback_reason.empty()) doc["backend"]["fallback_reason"] = backend.fallback_reason;
  doc["path"] = path;
  doc["file_size"] = file_size;
  doc["interrupted"] = interrupted;
  doc["results"] = nlohmann::json::array();
  for (const Row& r : rows) {
    nlohmann::json j = options_json(r.opt);
    j["read"] = result_json(r.read);
    j["write"] = result_json(r.write);
    if (r.fio_read || r.fio_write) {
      j["fio_read"] = result_json(r.fio_read);
      j["fio_write"] = result_json(r.fio_write);
    }
    doc["results"].push_back(j);
  }
  if (best != nullptr) {
    doc["best"] = {{"aio", options_json(best->opt)},
                   {"read_gbps", best->read ? best->read->gbps : 0.0},
                   {"write_gbps", best->write ? best->write->gbps : 0.0}};
  } else {
    doc["best"] = nullptr;
  }
  return doc.dump(2);
}

}  // namespace outcore::aio_bench
