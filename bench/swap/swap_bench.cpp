// swap_bench: an Adam step over optimizer state that lives on NVMe (OptimizerSwapper, CRC32C
// on), against the bound max(aio time to read + write the same bytes at the best settings,
// in-memory cpu_adam step time), all measured in this run. Also: the same step with checksums
// off (their cost), and a bit-identity check of the NVMe step against the in-memory one.
//
//   swap_bench --dir /nvme/scratch --params 500000000
//
// Progress goes to stderr; results to stdout. Exit 1 on any error (one line on stderr).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include "common/log.hpp"
#include "swap/swap.hpp"
#include "tools/env_settings.hpp"

namespace outcore::swap {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
double gb(double bytes) { return bytes / 1e9; }

struct Args {
  fs::path dir;
  uint64_t params = 500'000'000;
  uint64_t sub_group = 12'500'000;
  unsigned buffers = 4;
  unsigned threads = 0;  // cpu_adam/CRC threads; 0 = all cores
  int steps = 2;
  bool sweep = true;
};

// Fills with reproducible values in [-scale, scale), in parallel chunks.
void fill(std::vector<float>& v, uint64_t seed, float scale, const cpu_adam::Executor& ex) {
  ex.for_chunks(v.size(), 1 << 20, 1 << 20, [&](size_t, size_t b, size_t e) {
    std::mt19937 rng(static_cast<uint32_t>(seed * 7919 + b / (1 << 20)));
    std::uniform_real_distribution<float> d(-scale, scale);
    for (size_t i = b; i < e; ++i) v[i] = d(rng);
  });
}

cpu_adam::AdamParams hyper(uint64_t step) {
  cpu_adam::AdamParams hp;
  hp.lr = 1e-4;
  hp.weight_decay = 0.01;
  hp.step = step;
  hp.grad_scale = 1.0 / 1024;
  return hp;
}

// ---------------------------------------------------------------------------------------------
// Raw aio: the step's exact I/O (same file, offsets, lengths, buffers, engine) with no compute
// and no checksums.

struct RawIo {
  const aio::File& file;
  std::vector<std::pair<uint64_t, uint64_t>> chunks;  // (offset, bytes) per sub-group slot
  std::byte* ring;                                    // buffers * slot bytes
  uint64_t slot;
  unsigned buffers;

  std::byte* buf(size_t k) const { return ring + (k % buffers) * slot; }
  std::span<std::byte> span(size_t k) const { return {buf(k), chunks[k].second}; }

  // Read chunk k, then write it back from the same buffer (content unchanged), with the
  // read-ahead / write-behind schedule of the pipelined optimizer step and zero compute.
  double pipelined(aio::Engine& e, size_t n) const {
    auto t0 = Clock::now();
    std::vector<aio::Ticket> rt(n), wt(n);
    const size_t ahead = buffers >= 3 ? buffers - 2 : 1;
    size_t next = 0;
    for (size_t k = 0; k < n; ++k) {
      while (next < n && next <= k + ahead) {
        if (next >= buffers && wt[next - buffers].valid()) {
          e.wait(std::exchange(wt[next - buffers], {}));
        }
        rt[next] = e.submit_read(file, chunks[next].first, span(next));
        ++next;
      }
      e.wait(rt[k]);
      wt[k] = e.submit_write(file, chunks[k].first, span(k));
    }
    for (auto& t : wt) {
      if (t.valid()) e.wait(t);
    }
    return since(t0);
  }

  // Every chunk in one direction, `buffers` chunks in flight.
  double sequential(aio::Engine& e, bool write) const {
    auto t0 = Clock::now();
    const size_t n = chunks.size();
    std::vector<aio::Ticket> t(n);
    for (size_t k = 0; k < n; ++k) {
      if (k >= buffers) e.wait(t[k - buffers]);
      t[k] = write ? e.submit_write(file, chunks[k].first, span(k))
                   : e.submit_read(file, chunks[k].first, span(k));
    }
    for (size_t k = n > buffers ? n - buffers : 0; k < n; ++k) e.wait(t[k]);
    return since(t0);
  }
};

// Picks the aio settings under which the raw pipelined pattern runs fastest (on the first
// chunks). REQUIRES the file's extents written (not fallocated-unwritten, which reads free).
aio::Options sweep(const RawIo& raw) {
  aio::Options best{.block_size = 1 << 20, .queue_depth = 32, .thread_count = 1};
  const size_t n = std::min<size_t>(raw.chunks.size(), 6);
  double best_t = 1e30;
  for (size_t bs : {size_t(1) << 20, size_t(4) << 20}) {
    for (unsigned qd : {8u, 32u}) {
      for (unsigned th : {1u, 2u}) {
        aio::Options o{.block_size = bs, .queue_depth = qd, .thread_count = th};
        aio::Engine e(o);
        double t = raw.pipelined(e, n);
        double bytes = 0;
        for (size_t k = 0; k < n; ++k) bytes += 2.0 * raw.chunks[k].second;
        log::info("sweep: block {} KiB, queue_depth {}, threads {}: {:.2f} GB/s", bs >> 10, qd, th,
                  gb(bytes) / t);
        if (t < best_t) best_t = t, best = o;
      }
    }
  }
  return best;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// `reps` rounds of (raw pipelined I/O, NVMe step), interleaved so that drift in the disk's
// speed hits both alike. Returns per-round times.
struct Rounds {
  std::vector<double> io, step;
  OptimizerStepStats best_stats;
};

Rounds interleaved(RawIo raw, PinnedPool& pool, aio::Engine& e, OptimizerSwapper& opt,
                   const std::vector<float>& grads, std::vector<uint16_t>& out, int reps,
                   uint64_t first_step, const char* label) {
  Rounds r;
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    log::info("round {}/{} ({}): raw aio read+write-back, then the NVMe step", i + 1, reps, label);
    {
      PinnedBuffer ring = pool.acquire(raw.buffers * raw.slot);  // returned before the step
      raw.ring = ring.data();
      r.io.push_back(raw.pipelined(e, raw.chunks.size()));
    }
    auto t0 = Clock::now();
    opt.step(0, grads, hyper(first_step + i), {out.data(), DType::BF16});
    r.step.push_back(since(t0));
    if (r.step.back() < best) best = r.step.back(), r.best_stats = opt.last_step_stats();
  }
  return r;
}

// ---------------------------------------------------------------------------------------------

int run(const Args& a) {
  const cpu_adam::Executor ex(a.threads);
  const uint64_t N = a.params, sg = std::min(a.sub_group, a.params);
  const uint64_t slot = 3 * align_up(sg * 4, kIoAlignment);
  const size_t groups = (N + sg - 1) / sg;
  SwapFileSpec spec = optimizer_file_spec(0, N, sg);
  const uint64_t state_bytes = SwapSpace::bytes_needed(std::span(&spec, 1));
  const double io_bytes = 2.0 * double(state_bytes);

  fs::create_directories(a.dir);
  fmt::print(
      "swap_bench: {} params ({:.2f} GB of fp32 master + exp_avg + exp_avg_sq on disk), "
      "sub_group_size {} ({} sub-groups), buffer_count {}, {} cpu threads, dir {}\n",
      N, gb(double(state_bytes)), sg, groups, a.buffers, ex.threads(), a.dir.string());
  SwapSpace space({.nvme_path = a.dir}, std::span(&spec, 1));  // ENOSPC here if it won't fit
  PinnedPool pool({.budget_bytes = a.buffers * slot});
  fmt::print("pinned pool: {:.2f} GB, {}\n", gb(double(pool.budget_bytes())),
             pool.locked() ? "mlocked" : "NOT locked (mlock refused)");

  // 1. Raw aio on the swap file itself, before the state is written: fill it, sweep the
  //    settings, time plain read and write at the best ones.
  RawIo raw{space.file({0, SwapKind::kOptimizer, 0}), {}, nullptr, slot, a.buffers};
  for (size_t k = 0; k < groups; ++k) {
    const TensorInfo& t = space.info({0, SwapKind::kOptimizer, uint32_t(k)});
    raw.chunks.emplace_back(t.offset, t.slot_bytes());
  }
  aio::Options best{.block_size = 1 << 20, .queue_depth = 32, .thread_count = 1};
  double read_s, write_s;
  {
    PinnedBuffer ring = pool.acquire(a.buffers * slot);
    std::memset(ring.data(), 0x5a, ring.capacity());
    raw.ring = ring.data();
    {
      aio::Engine e(best);
      log::info("raw aio: writing {:.2f} GB (gives the file real extents)", gb(state_bytes));
      raw.sequential(e, /*write=*/true);
    }
    if (a.sweep) best = sweep(raw);
    aio::Engine e(best);
    read_s = raw.sequential(e, false);
    write_s = raw.sequential(e, true);
  }

  // 2. In-memory cpu_adam steps, the NVMe state initialised from the same values first.
  log::info("allocating {:.2f} GB of host memory", gb(N * 20.0));
  std::vector<float> grads(N), p(N), m(N, 0.0f), v(N, 0.0f);
  std::vector<uint16_t> out_mem(N), out_nvme(N);
  fill(grads, 1, 1000.0f, ex);
  fill(p, 2, 1.0f, ex);

  aio::Engine engine(best);
  Swapper swapper(space, engine, {.verify_checksums = true}, &ex);
  OptimizerSwapperOptions oo{.sub_group_size = sg,
                             .buffer_count = a.buffers,
                             .pipeline_read = true,
                             .pipeline_write = true};
  OptimizerSwapper opt(swapper, pool, oo, &ex);
  log::info("initialising the NVMe state");
  auto t0 = Clock::now();
  opt.init_state(0, p);
  const double init_s = since(t0);
  std::vector<double> mem;
  for (int s = 1; s <= a.steps; ++s) {
    t0 = Clock::now();
    cpu_adam::adam_step(hyper(s), N, p.data(), {grads.data(), DType::F32}, m.data(), v.data(),
                        {out_mem.data(), DType::BF16}, &ex);
    mem.push_back(since(t0));
  }
  std::vector<float>().swap(m);
  std::vector<float>().swap(v);

  // 3. Interleaved rounds: raw pipelined aio on the swap file, NVMe step (checksums on).
  Rounds on = interleaved(raw, pool, engine, opt, grads, out_nvme, a.steps, 1, "checksums on");
  std::vector<float> master(N);
  opt.read_master(0, master);
  const bool identical =
      out_mem == out_nvme && std::memcmp(master.data(), p.data(), N * sizeof(float)) == 0;
  const SwapperStats crc = swapper.stats();

  // 4. The same with checksums off: a second swapper over the same files.
  Swapper plain(space, engine, {.verify_checksums = false}, &ex);
  OptimizerSwapper opt_plain(plain, pool, oo, &ex);
  log::info("initialising the NVMe state again (checksums off)");
  opt_plain.init_state(0, master);
  Rounds off =
      interleaved(raw, pool, engine, opt_plain, grads, out_nvme, a.steps, 1, "checksums off");

  const double mem_best = *std::min_element(mem.begin(), mem.end());
  const double pipe_best = std::min(*std::min_element(on.io.begin(), on.io.end()),
                                    *std::min_element(off.io.begin(), off.io.end()));
  const double io_bound = std::min(read_s + write_s, pipe_best);
  const double bound = std::max(io_bound, mem_best);
  const double on_best = *std::min_element(on.step.begin(), on.step.end());
  const double off_best = *std::min_element(off.step.begin(), off.step.end());
  std::vector<double> paired;  // step / raw I/O of the same round
  for (size_t i = 0; i < on.step.size(); ++i) {
    paired.push_back(on.step[i] / std::max(on.io[i], mem_best));
  }

  fmt::print("\naio best settings: block_size {} KiB, queue_depth {}, thread_count {}\n",
             best.block_size >> 10, best.queue_depth, best.thread_count);
  fmt::print("aio read   {:5.2f} GB                              {:7.3f} s ({:.2f} GB/s)\n",
             gb(state_bytes), read_s, gb(state_bytes) / read_s);
  fmt::print("aio write  {:5.2f} GB                              {:7.3f} s ({:.2f} GB/s)\n",
             gb(state_bytes), write_s, gb(state_bytes) / write_s);
  fmt::print("aio pipelined read+write-back {:5.2f} GB (best of {}) {:7.3f} s ({:.2f} GB/s)\n",
             gb(io_bytes), 2 * a.steps, pipe_best, gb(io_bytes) / pipe_best);
  fmt::print("io bound = min(read + write, pipelined)            {:7.3f} s\n", io_bound);
  fmt::print("in-memory cpu_adam step (best of {})                 {:7.3f} s\n", a.steps, mem_best);
  fmt::print("bound = max(io bound, in-memory step)              {:7.3f} s\n", bound);
  fmt::print("NVMe state init (write {:.2f} GB, checksums on)     {:7.3f} s\n", gb(state_bytes),
             init_s);
  fmt::print("NVMe step, checksums on  (best of {})               {:7.3f} s  rounds:", a.steps,
             on_best);
  for (double t : on.step) fmt::print(" {:.3f}", t);
  fmt::print("\n  best step: compute {:.3f} s, blocked on reads {:.3f} s, on writes {:.3f} s\n",
             on.best_stats.compute_seconds, on.best_stats.read_wait_seconds,
             on.best_stats.write_wait_seconds);
  fmt::print("  CRC32C: {:.3f} s of thread time for {:.2f} GB swapped in this run\n",
             crc.checksum_seconds, gb(double(crc.bytes_in + crc.bytes_out)));
  fmt::print("NVMe step, checksums off (best of {})               {:7.3f} s  rounds:", a.steps,
             off_best);
  for (double t : off.step) fmt::print(" {:.3f}", t);
  fmt::print("\nchecksum cost: {:+.1f}% of the step (best on vs best off)\n",
             100.0 * (on_best - off_best) / off_best);
  fmt::print(
      "RATIO step / bound = {:.3f} (goal <= 1.15); median per-round step / raw I/O = {:.3f}\n",
      on_best / bound, median(paired));
  fmt::print("NVMe step output and master bit-identical to in-memory: {}\n",
             identical ? "yes" : "NO");
  return identical ? 0 : 1;
}

}  // namespace
}  // namespace outcore::swap

int main(int argc, char** argv) {
  outcore::log::init("info");
  outcore::tools::apply_environment_settings();
  outcore::swap::Args a;
  CLI::App app{"NVMe-streamed Adam step vs max(aio read+write, in-memory cpu_adam)"};
  app.add_option("--dir", a.dir, "directory on the disk to test (swap files go below it)")
      ->required();
  app.add_option("--params", a.params, "parameters (elements) in the unit")
      ->check(CLI::PositiveNumber);
  app.add_option("--sub-group", a.sub_group, "sub_group_size (elements)")
      ->check(CLI::PositiveNumber);
  app.add_option("--buffers", a.buffers, "buffer_count")->check(CLI::Range(1u, 64u));
  app.add_option("--threads", a.threads, "cpu_adam / CRC threads (0 = all cores)");
  app.add_option("--steps", a.steps, "timed steps per configuration")->check(CLI::Range(1, 100));
  app.add_flag("!--no-sweep", a.sweep, "skip the aio settings sweep (use 1 MiB, qd 32, 1 thread)");
  CLI11_PARSE(app, argc, argv);
  try {
    return outcore::swap::run(a);
  } catch (const std::exception& e) {
    fmt::print(stderr, "swap_bench: {}\n", e.what());
    return 1;
  }
}
