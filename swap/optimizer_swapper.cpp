// OptimizerSwapper: Adam over NVMe-resident optimizer state, one sub-group at a time through a
// ring of buffer_count pool buffers. Sub-group k lives in buffer k % B; a read into a buffer
// first waits for the write of the sub-group that used it before (k - B).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include "common/log.hpp"
#include "common/trace.hpp"
#include "swap/swap.hpp"

namespace outcore::swap {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// [fp32 master | exp_avg | exp_avg_sq] with moments of `mbytes` bytes each (4: fp32, 2: bf16),
// each part 4096-aligned; the last part is exact.
uint64_t part_bytes(uint64_t n, size_t elem_bytes) {
  return align_up(n * elem_bytes, kIoAlignment);
}
uint64_t sub_group_bytes(uint64_t n, size_t mbytes) {
  return part_bytes(n, sizeof(float)) + part_bytes(n, mbytes) + n * mbytes;
}

// Moments between the caller's fp32 arrays and the sub-group buffer: copied (fp32), or
// narrowed to nearest even / widened exactly (bf16).
void store_moments(std::byte* dst, const float* src, uint64_t n, DType t) {
  if (t == DType::F32) return void(std::memcpy(dst, src, n * sizeof(float)));
  auto* h = reinterpret_cast<uint16_t*>(dst);
  for (uint64_t i = 0; i < n; ++i) h[i] = fp32_to_bf16(src[i]);
}

void load_moments(float* dst, const std::byte* src, uint64_t n, DType t) {
  if (t == DType::F32) return void(std::memcpy(dst, src, n * sizeof(float)));
  const auto* h = reinterpret_cast<const uint16_t*>(src);
  for (uint64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(h[i]);
}
std::string sub_group_name(size_t k) { return fmt::format("sg{}", k); }

struct SubGroup {
  uint64_t first = 0;  // element offset in the unit's partition
  uint64_t n = 0;
  TensorId id;     // copy 0
  TensorId spare;  // copy 1 (spare_copy)
  TensorId at(int copy) const { return copy == 0 ? id : spare; }
  uint64_t part = 0;    // bytes of the master part: part_bytes(n, 4)
  uint64_t part_m = 0;  // bytes of the exp_avg part: part_bytes(n, moment size)
  uint64_t bytes = 0;   // sub_group_bytes(n, moment size)
  uint64_t span() const { return part + 2 * part_m; }  // all three parts, rounded up
  std::byte* exp_avg(std::byte* b) const { return b + part; }
  std::byte* exp_avg_sq(std::byte* b) const { return b + part + part_m; }
};

struct UnitLayout {
  uint64_t numel = 0;
  std::vector<SubGroup> groups;
  uint64_t slot = 0;  // bytes of one ring buffer: the three parts of the largest sub-group
};

struct UnitState {
  std::shared_ptr<const UnitLayout> layout;  // set once initialised
  bool initialised = false;
  bool poisoned = false;
  bool busy = false;
  uint64_t steps = 0;
  int current = 0;       // the copy holding the state (0 without spare_copy)
  bool pending = false;  // a tentative step's result is in the other copy
};

// The per-sub-group work of one pass; `buf` holds the sub-group's [master | m | v].
using Work = std::function<void(const SubGroup& g, std::byte* buf)>;

}  // namespace

uint64_t optimizer_swap_io_bytes(uint64_t numel, uint64_t sub_group_size, DType moments) {
  if (numel == 0 || sub_group_size == 0) return 0;
  const size_t m = dtype_size(moments);
  const uint64_t whole = numel / sub_group_size, rest = numel % sub_group_size;
  return whole * align_up(sub_group_bytes(sub_group_size, m), kIoAlignment) +
         (rest > 0 ? align_up(sub_group_bytes(rest, m), kIoAlignment) : 0);
}

SwapFileSpec optimizer_file_spec(uint32_t unit, uint64_t numel, uint64_t sub_group_size,
                                 DType moments, unsigned copies) {
  if (numel == 0 || sub_group_size == 0) {
    throw InvalidArgument(
        fmt::format("optimizer swap: unit {}: numel {} and sub_group_size {} must both be > 0",
                    unit, numel, sub_group_size));
  }
  if (moments != DType::F32 && moments != DType::BF16) {
    throw InvalidArgument("optimizer swap: the Adam moments must be fp32 or bf16");
  }
  if (copies != 1 && copies != 2) {
    throw InvalidArgument(
        fmt::format("optimizer swap: unit {}: {} copies of the state (1 or 2)", unit, copies));
  }
  SwapFileSpec spec{.unit = unit, .kind = SwapKind::kOptimizer, .tensors = {}};
  for (unsigned c = 0; c < copies; ++c) {
    for (uint64_t first = 0, k = 0; first < numel; first += sub_group_size, ++k) {
      uint64_t n = std::min(sub_group_size, numel - first);
      spec.tensors.push_back(
          {sub_group_name(k) + (c == 0 ? "" : ".spare"), sub_group_bytes(n, dtype_size(moments))});
    }
  }
  return spec;
}

struct OptimizerSwapper::Impl {
  Swapper& swapper;
  PinnedPool& pool;
  OptimizerSwapperOptions options;
  const cpu_adam::Executor* executor;

  // Unit states: created on first use; a Busy guard's holder is their only writer and writes
  // under mu, so readers (steps_done, poisoned) lock mu.
  mutable std::mutex mu;
  std::map<uint32_t, UnitState> units;  // GUARDED_BY(mu); nodes are stable
  OptimizerStepStats last;              // GUARDED_BY(mu)

  // The writes a pass left in flight (run's `leave`): its ring and their tickets.
  struct InFlight {
    PinnedBuffer lease;
    std::vector<SwapTicket> tickets;
  };
  // An init_state_async whose last writes are still in flight: the unit is initialised (with
  // `layout`) once they have finished. Finished by the next pass of any unit (Busy), flush()
  // and the destructor.
  struct Tail {
    uint32_t unit = 0;
    InFlight writes;
    std::shared_ptr<const UnitLayout> layout;
  };
  std::mutex tail_mu;        // taken before mu, never after
  std::optional<Tail> tail;  // GUARDED_BY(tail_mu)

  Impl(Swapper& s, PinnedPool& p, const OptimizerSwapperOptions& o, const cpu_adam::Executor* ex)
      : swapper(s), pool(p), options(o), executor(ex) {}
  ~Impl() {
    try {
      finish_tail();
    } catch (const std::exception& e) {
      log::warn("optimizer swap: the last initialisation's writes failed: {}", e.what());
    }
  }

  // Waits for the tail's writes; the unit is then initialised, or, when one failed, stays
  // uninitialised and the first error is rethrown.
  void finish_tail() {
    std::lock_guard tl(tail_mu);
    if (!tail) return;
    Tail t = std::move(*tail);
    tail.reset();
    std::exception_ptr err;
    for (SwapTicket& ticket : t.writes.tickets) {
      if (!ticket.valid()) continue;
      try {
        swapper.wait(std::exchange(ticket, SwapTicket{}));
      } catch (...) {
        if (!err) err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
    std::lock_guard lock(mu);
    UnitState& st = units[t.unit];
    st.layout = std::move(t.layout);
    st.steps = 0;
    st.poisoned = false;
    st.initialised = true;
  }

  // Marks the unit busy for the lifetime of the guard, once an initialisation still writing
  // (of any unit) has finished.
  class Busy {
   public:
    Busy(Impl& m, uint32_t unit) : m_(m) {
      m.finish_tail();
      std::lock_guard lock(m.mu);
      st_ = &m.units[unit];
      if (st_->busy) {
        throw InvalidArgument(
            fmt::format("optimizer swap: unit {} is already being used by another call", unit));
      }
      st_->busy = true;
    }
    ~Busy() {
      std::lock_guard lock(m_.mu);
      st_->busy = false;
    }
    UnitState& state() { return *st_; }  // fields other than busy: only its holder writes them

   private:
    Impl& m_;
    UnitState* st_;
  };

  std::shared_ptr<const UnitLayout> layout_for(uint32_t unit, uint64_t numel) const {
    const SwapSpace& space = swapper.space();
    const unsigned copies = options.spare_copy ? 2 : 1;
    SwapFileSpec want =
        optimizer_file_spec(unit, numel, options.sub_group_size, options.moments, copies);
    size_t have = space.tensor_count(unit, SwapKind::kOptimizer);
    auto mismatch = [&](const std::string& what) {
      return InvalidArgument(fmt::format(
          "optimizer swap: the swap space's optimizer file of unit {} is not laid out for {} "
          "elements in sub-groups of {} with {} moments, {} cop{} (use optimizer_file_spec): {}",
          unit, numel, options.sub_group_size, dtype_name(options.moments), copies,
          copies == 1 ? "y" : "ies", what));
    };
    if (have != want.tensors.size()) {
      throw mismatch(fmt::format("it has {} tensors, {} expected", have, want.tensors.size()));
    }
    auto layout = std::make_shared<UnitLayout>();
    layout->numel = numel;
    const size_t K = want.tensors.size() / copies;
    for (size_t k = 0; k < want.tensors.size(); ++k) {
      TensorId id{unit, SwapKind::kOptimizer, static_cast<uint32_t>(k)};
      const TensorInfo& info = space.info(id);
      if (info.name != want.tensors[k].name || info.bytes != want.tensors[k].bytes) {
        throw mismatch(fmt::format("tensor {} is '{}' of {} bytes, '{}' of {} expected", k,
                                   info.name, info.bytes, want.tensors[k].name,
                                   want.tensors[k].bytes));
      }
      if (k >= K) {  // the spare copy of sub-group k - K
        layout->groups[k - K].spare = id;
        continue;
      }
      SubGroup g;
      g.first = k * options.sub_group_size;
      g.n = std::min(options.sub_group_size, numel - g.first);
      g.id = id;
      g.part = part_bytes(g.n, sizeof(float));
      g.part_m = part_bytes(g.n, dtype_size(options.moments));
      g.bytes = info.bytes;
      layout->slot = std::max(layout->slot, g.span());
      layout->groups.push_back(g);
    }
    return layout;
  }

  // Runs `work` over every sub-group: read it from copy `from` (if `read`), work, write it to
  // copy `to` (if `write`), pipelined per the options. On any failure drains all I/O, sets
  // *wrote_any if a write was submitted, and rethrows.
  // `leave` (write-only passes): the last writes are left in flight there, with the ring.
  void run(const UnitLayout& L, bool read, bool write, const Work& work, OptimizerStepStats& s,
           bool* wrote_any, int from = 0, int to = 0, InFlight* leave = nullptr) {
    const size_t K = L.groups.size();
    const size_t B = std::min<size_t>(options.buffer_count, K);
    PinnedBuffer lease = pool.acquire(B * L.slot, options.buffer_timeout);
    auto buf = [&](size_t k) { return lease.data() + (k % B) * L.slot; };
    size_t ahead = 0;
    if (read && options.pipeline_read && B >= 2) {
      ahead = std::max<size_t>(1, B - 1 - (write && options.pipeline_write ? 1 : 0));
    }
    std::vector<SwapTicket> rt(K), wt(K);
    auto wait_write = [&](size_t j) {
      if (!wt[j].valid()) return;
      const SubGroup& g = L.groups[j];
      OUTCORE_TRACE_SPAN("write wait", "wait",
                         {.unit = int(g.id.unit), .index = int(g.id.index), .lanes = "optimizer"});
      auto t0 = Clock::now();
      swapper.wait(std::exchange(wt[j], SwapTicket{}));
      s.write_wait_seconds += seconds_since(t0);
    };
    auto issue_read = [&](size_t j) {
      if (j >= B) wait_write(j - B);  // the buffer's previous sub-group must be on disk
      const SubGroup& g = L.groups[j];
      rt[j] = swapper.swap_in(g.at(from), {buf(j), g.bytes});
    };
    size_t next_read = 0;
    try {
      for (size_t k = 0; k < K; ++k) {
        const SubGroup& g = L.groups[k];
        if (read) {
          while (next_read < K && next_read <= k + ahead) issue_read(next_read++);
          OUTCORE_TRACE_SPAN(
              "read wait", "wait",
              {.unit = int(g.id.unit), .index = int(g.id.index), .lanes = "optimizer"});
          auto t0 = Clock::now();
          swapper.wait(std::exchange(rt[k], SwapTicket{}));
          s.read_wait_seconds += seconds_since(t0);
          s.bytes_read += g.bytes;
        } else if (k >= B) {
          wait_write(k - B);
        }
        auto t0 = Clock::now();
        work(g, buf(k));
        s.compute_seconds += seconds_since(t0);
        if (write) {
          t0 = Clock::now();
          wt[k] = swapper.swap_out(g.at(to), {buf(k), g.bytes});
          *wrote_any = true;
          s.write_wait_seconds += seconds_since(t0);
          s.bytes_written += g.bytes;
          if (!options.pipeline_write) wait_write(k);
        }
        ++s.sub_groups;
      }
      if (leave != nullptr) {
        leave->tickets = std::move(wt);
        leave->lease = std::move(lease);
        return;
      }
      for (size_t k = 0; k < K; ++k) wait_write(k);
    } catch (...) {
      drain(rt);
      drain(wt);
      throw;
    }
  }

  void drain(std::vector<SwapTicket>& tickets) {
    for (SwapTicket& t : tickets) {
      if (!t.valid()) continue;
      try {
        swapper.wait(std::exchange(t, SwapTicket{}));
      } catch (const std::exception& e) {
        log::debug("optimizer swap: while draining a failed pass: {}", e.what());
      }
    }
  }

  // init_state / load_state.
  void write_state(uint32_t unit, std::span<const float> master, std::span<const float> m,
                   std::span<const float> v, uint64_t steps, bool leave_in_flight = false) {
    Work fill = [&](const SubGroup& g, std::byte* b) {
      std::memset(b, 0, g.span());
      std::memcpy(b, master.data() + g.first, g.n * sizeof(float));
      if (!m.empty()) store_moments(g.exp_avg(b), m.data() + g.first, g.n, options.moments);
      if (!v.empty()) store_moments(g.exp_avg_sq(b), v.data() + g.first, g.n, options.moments);
    };
    write_pass(unit, master.size(), fill, steps, leave_in_flight);
  }

  // A write-only pass producing every sub-group with `fill`; the unit is initialised (with
  // `steps`) only when all of them are written. `leave_in_flight`: returns once every
  // sub-group is filled and its write submitted, the last writes becoming the Tail (steps 0).
  void write_pass(uint32_t unit, uint64_t numel, const Work& fill, uint64_t steps,
                  bool leave_in_flight = false) {
    Busy busy(*this, unit);
    UnitState& st = busy.state();
    auto layout = layout_for(unit, numel);
    {
      std::lock_guard lock(mu);
      st.initialised = false;  // until every sub-group is written
      st.current = 0;          // written to copy 0
      st.pending = false;
    }
    OptimizerStepStats s;
    bool wrote = false;
    if (leave_in_flight) {
      InFlight writes;
      run(*layout, /*read=*/false, /*write=*/true, fill, s, &wrote, 0, 0, &writes);
      for (;;) {  // one tail at a time: another thread's, left since this pass began, first
        try {
          finish_tail();
        } catch (...) {
          drain(writes.tickets);  // this pass's own writes, before their ring goes back
          throw;
        }
        std::lock_guard tl(tail_mu);
        if (tail) continue;
        tail = Tail{.unit = unit, .writes = std::move(writes), .layout = std::move(layout)};
        return;
      }
    }
    run(*layout, /*read=*/false, /*write=*/true, fill, s, &wrote);
    std::lock_guard lock(mu);
    st.current = 0;
    st.pending = false;
    st.layout = std::move(layout);
    st.steps = steps;
    st.poisoned = false;
    st.initialised = true;
  }

  // step (in place) and step_tentative (to the spare copy).
  void step(uint32_t unit, std::span<const float> grads, const cpu_adam::AdamParams& hp,
            ParamsOut out, bool tentative);

  // Throws unless the unit is initialised, not poisoned, has no tentative step pending and
  // is of `numel` elements.
  std::shared_ptr<const UnitLayout> ready_layout(uint32_t unit, const UnitState& st, uint64_t numel,
                                                 const char* what) const {
    if (!st.initialised) {
      throw InvalidArgument(
          fmt::format("optimizer swap: {} of unit {}, whose state was never "
                      "initialised (init_state) or whose initialisation failed",
                      what, unit));
    }
    if (st.poisoned) {
      throw InvalidArgument(fmt::format(
          "optimizer swap: {} of unit {}, whose state on disk is a mix of two steps after a "
          "failed step; reinitialise it (init_state/load_state, e.g. from a checkpoint)",
          what, unit));
    }
    if (st.pending) {
      throw InvalidArgument(
          fmt::format("optimizer swap: {} of unit {}, which has a tentative step neither "
                      "committed nor discarded",
                      what, unit));
    }
    if (numel != st.layout->numel) {
      throw InvalidArgument(
          fmt::format("optimizer swap: {} of unit {} with {} elements; the "
                      "unit has {}",
                      what, unit, numel, st.layout->numel));
    }
    return st.layout;
  }
};

OptimizerSwapper::OptimizerSwapper(Swapper& swapper, PinnedPool& pool,
                                   const OptimizerSwapperOptions& options,
                                   const cpu_adam::Executor* executor) {
  if (options.sub_group_size == 0) {
    throw InvalidArgument("optimizer swap: sub_group_size must be > 0");
  }
  if (options.buffer_count == 0) throw InvalidArgument("optimizer swap: buffer_count must be >= 1");
  if (options.moments != DType::F32 && options.moments != DType::BF16) {
    throw InvalidArgument("optimizer swap: the Adam moments must be fp32 or bf16");
  }
  impl_ = std::make_unique<Impl>(swapper, pool, options, executor);
}

OptimizerSwapper::~OptimizerSwapper() = default;

void OptimizerSwapper::init_state(uint32_t unit, std::span<const float> master) {
  impl_->write_state(unit, master, {}, {}, 0);
}

void OptimizerSwapper::init_state_async(uint32_t unit, std::span<const float> master) {
  impl_->write_state(unit, master, {}, {}, 0, /*leave_in_flight=*/true);
}

void OptimizerSwapper::flush() { impl_->finish_tail(); }

void OptimizerSwapper::load_state(uint32_t unit, std::span<const float> master,
                                  std::span<const float> exp_avg, std::span<const float> exp_avg_sq,
                                  uint64_t steps_done) {
  if (exp_avg.size() != master.size() || exp_avg_sq.size() != master.size()) {
    throw InvalidArgument(fmt::format(
        "optimizer swap: load_state of unit {}: master, exp_avg, exp_avg_sq have {}, {}, {} "
        "elements; they must be equal",
        unit, master.size(), exp_avg.size(), exp_avg_sq.size()));
  }
  impl_->write_state(unit, master, exp_avg, exp_avg_sq, steps_done);
}

void OptimizerSwapper::step(uint32_t unit, std::span<const float> grads,
                            const cpu_adam::AdamParams& hp, ParamsOut out) {
  impl_->step(unit, grads, hp, out, /*tentative=*/false);
}

void OptimizerSwapper::step_tentative(uint32_t unit, std::span<const float> grads,
                                      const cpu_adam::AdamParams& hp, ParamsOut out) {
  if (!impl_->options.spare_copy) {
    throw InvalidArgument(fmt::format(
        "optimizer swap: tentative step of unit {} without a spare copy (spare_copy)", unit));
  }
  impl_->step(unit, grads, hp, out, /*tentative=*/true);
}

void OptimizerSwapper::commit(uint32_t unit) {
  std::lock_guard lock(impl_->mu);
  UnitState& st = impl_->units[unit];
  if (!st.pending || st.busy) {
    throw InvalidArgument(fmt::format(
        "optimizer swap: commit of unit {}, which has no finished tentative step", unit));
  }
  st.current = 1 - st.current;
  st.pending = false;
  ++st.steps;
}

void OptimizerSwapper::discard(uint32_t unit) {
  std::lock_guard lock(impl_->mu);
  UnitState& st = impl_->units[unit];
  if (st.busy) {
    throw InvalidArgument(
        fmt::format("optimizer swap: discard of unit {} while it is being used", unit));
  }
  st.pending = false;
}

bool OptimizerSwapper::tentative_pending(uint32_t unit) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->units.find(unit);
  return it != impl_->units.end() && it->second.pending;
}

void OptimizerSwapper::Impl::step(uint32_t unit, std::span<const float> grads,
                                  const cpu_adam::AdamParams& hp, ParamsOut out, bool tentative) {
  Impl& m = *this;
  cpu_adam::validate(hp);
  if (out.dtype != DType::F32 && out.dtype != DType::BF16 && out.dtype != DType::F16) {
    throw InvalidArgument("optimizer swap: unknown output dtype");
  }
  Impl::Busy busy(m, unit);
  UnitState& st = busy.state();
  auto layout = m.ready_layout(unit, st, grads.size(), "step");
  const size_t out_elem = dtype_size(out.dtype);
  Work adam = [&](const SubGroup& g, std::byte* b) {
    OUTCORE_TRACE_SPAN("adam", "optimizer",
                       {.unit = int(unit), .index = int(g.id.index), .lanes = "optimizer"});
    auto* master = reinterpret_cast<float*>(b);
    const cpu_adam::Moments moments{g.exp_avg(b), g.exp_avg_sq(b), m.options.moments};
    cpu_adam::ParamsOut lowp;
    if (out.data != nullptr && out.dtype != DType::F32) {
      lowp = {static_cast<std::byte*>(out.data) + g.first * out_elem, out.dtype};
    }
    cpu_adam::adam_step(hp, g.n, master, {grads.data() + g.first, DType::F32}, moments, lowp,
                        m.executor);
    if (out.data != nullptr && out.dtype == DType::F32) {
      std::memcpy(static_cast<float*>(out.data) + g.first, master, g.n * sizeof(float));
    }
  };
  OptimizerStepStats s;
  bool wrote = false;
  auto t0 = Clock::now();
  const int from = st.current;
  const int to = tentative ? 1 - from : from;
  try {
    m.run(*layout, /*read=*/true, /*write=*/true, adam, s, &wrote, from, to);
  } catch (...) {
    if (wrote && !tentative) {
      std::lock_guard lock(m.mu);
      st.poisoned = true;
    }
    throw;
  }
  s.total_seconds = seconds_since(t0);
  std::lock_guard lock(m.mu);
  if (tentative)
    st.pending = true;
  else
    ++st.steps;
  m.last = s;
}

void OptimizerSwapper::read_master(uint32_t unit, std::span<float> master) {
  read_state(unit, master, {}, {});
}

void OptimizerSwapper::read_state(uint32_t unit, std::span<float> master, std::span<float> exp_avg,
                                  std::span<float> exp_avg_sq) {
  Impl& m = *impl_;
  Impl::Busy busy(m, unit);
  auto layout = m.ready_layout(unit, busy.state(), master.size(), "read_state");
  if ((!exp_avg.empty() && exp_avg.size() != master.size()) ||
      (!exp_avg_sq.empty() && exp_avg_sq.size() != master.size())) {
    throw InvalidArgument(fmt::format(
        "optimizer swap: read_state of unit {}: exp_avg and exp_avg_sq must have {} elements", unit,
        master.size()));
  }
  const DType mt = m.options.moments;
  Work copy = [&](const SubGroup& g, std::byte* b) {
    std::memcpy(master.data() + g.first, b, g.n * sizeof(float));
    if (!exp_avg.empty()) load_moments(exp_avg.data() + g.first, g.exp_avg(b), g.n, mt);
    if (!exp_avg_sq.empty()) load_moments(exp_avg_sq.data() + g.first, g.exp_avg_sq(b), g.n, mt);
  };
  OptimizerStepStats s;
  bool wrote = false;
  m.run(*layout, /*read=*/true, /*write=*/false, copy, s, &wrote, busy.state().current);
}

void OptimizerSwapper::visit_state(uint32_t unit, uint64_t numel, const StateVisitor& fn) {
  Impl& m = *impl_;
  Impl::Busy busy(m, unit);
  auto layout = m.ready_layout(unit, busy.state(), numel, "visit_state");
  const DType mt = m.options.moments;
  // bf16 moments are widened into fp32 scratch of one sub-group (checkpoints only).
  std::vector<float> wide_m, wide_v;
  if (mt != DType::F32) {
    wide_m.resize(std::min(numel, m.options.sub_group_size));
    wide_v.resize(wide_m.size());
  }
  Work visit = [&](const SubGroup& g, std::byte* b) {
    const float* em = reinterpret_cast<const float*>(g.exp_avg(b));
    const float* ev = reinterpret_cast<const float*>(g.exp_avg_sq(b));
    if (mt != DType::F32) {
      load_moments(wide_m.data(), g.exp_avg(b), g.n, mt);
      load_moments(wide_v.data(), g.exp_avg_sq(b), g.n, mt);
      em = wide_m.data();
      ev = wide_v.data();
    }
    fn(g.first, g.n, reinterpret_cast<const float*>(b), em, ev);
  };
  OptimizerStepStats s;
  bool wrote = false;
  m.run(*layout, /*read=*/true, /*write=*/false, visit, s, &wrote, busy.state().current);
}

void OptimizerSwapper::fill_state(uint32_t unit, uint64_t numel, const StateFiller& fn,
                                  uint64_t steps_done) {
  const DType mt = impl_->options.moments;
  std::vector<float> wide_m, wide_v;  // bf16 moments: filled in fp32, then narrowed
  if (mt != DType::F32) {
    wide_m.resize(std::min(numel, impl_->options.sub_group_size));
    wide_v.resize(wide_m.size());
  }
  Work fill = [&](const SubGroup& g, std::byte* b) {
    std::memset(b, 0, g.span());
    auto* master = reinterpret_cast<float*>(b);
    if (mt == DType::F32) {
      return fn(g.first, g.n, master, reinterpret_cast<float*>(g.exp_avg(b)),
                reinterpret_cast<float*>(g.exp_avg_sq(b)));
    }
    std::fill_n(wide_m.data(), g.n, 0.0f);
    std::fill_n(wide_v.data(), g.n, 0.0f);
    fn(g.first, g.n, master, wide_m.data(), wide_v.data());
    store_moments(g.exp_avg(b), wide_m.data(), g.n, mt);
    store_moments(g.exp_avg_sq(b), wide_v.data(), g.n, mt);
  };
  impl_->write_pass(unit, numel, fill, steps_done);
}

uint64_t OptimizerSwapper::steps_done(uint32_t unit) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->units.find(unit);
  return it == impl_->units.end() ? 0 : it->second.steps;
}

bool OptimizerSwapper::poisoned(uint32_t unit) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->units.find(unit);
  return it != impl_->units.end() && it->second.poisoned;
}

OptimizerStepStats OptimizerSwapper::last_step_stats() const {
  std::lock_guard lock(impl_->mu);
  return impl_->last;
}

const OptimizerSwapperOptions& OptimizerSwapper::options() const { return impl_->options; }

}  // namespace outcore::swap
