// The configurations aio_bench tries, how the best one is chosen, and how results print.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "aio/aio.hpp"
#include "tools/aio_bench/measure.hpp"

namespace outcore::aio_bench {

struct Axes {
  std::vector<uint64_t> block_sizes;
  std::vector<unsigned> queue_depths;
  std::vector<unsigned> threads;
  std::vector<bool> single_submit;
  std::vector<bool> overlap_events;
};

// The default sweep's first stage (block size x queue depth, one thread, batched,
// overlapped) and --full's grid.
Axes default_axes();
Axes full_axes();
// Every combination of the axes.
std::vector<aio::Options> grid(const Axes& a);
// The default sweep's second stage around `best`: more threads, single submit, no overlap.
std::vector<aio::Options> refine(const aio::Options& best);

struct Row {
  aio::Options opt;
  std::optional<Result> read{}, write{};
  std::optional<Result> fio_read{}, fio_write{};
  double score() const;  // read GB/s + write GB/s (DeepSpeed's criterion)
};

// The row to recommend: among rows scoring within `tolerance` (fraction) of the best score,
// the one with the fewest bytes in flight (block x depth x threads), so the smallest setting
// that reaches the drive's plateau wins. nullptr if no row has results.
const Row* choose(const std::vector<Row>& rows, double tolerance);

std::string describe(const aio::Options& o);
// The results table (stdout), headed by the backend, and the "aio" section ready to paste.
void print_table(const std::vector<Row>& rows, const aio::BackendChoice& backend, bool with_fio);
std::string aio_section(const aio::Options& o, int indent);
// Everything as one JSON document; "backend" holds name, forced and fallback_reason (null
// unless io_uring was wanted and could not be used).
std::string to_json(const std::vector<Row>& rows, const Row* best,
                    const aio::BackendChoice& backend, const std::string& path, uint64_t file_size,
                    bool interrupted);

}  // namespace outcore::aio_bench
