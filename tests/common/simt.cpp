// Fibers on ucontext: a scheduler resumes, round robin, each thread whose barrier has opened; a
// round that resumes none while some wait is a divergent barrier.
#include "tests/common/simt.hpp"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/device/kernel_math.hpp"

namespace outcore::test {

class SimtBlock {
 public:
  SimtBlock(int threads, size_t shared_bytes, const std::function<void(SimtThread&)>& body)
      : body_(body), fibers_(static_cast<size_t>(threads)), warps_(threads / 32) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t rounded = (shared_bytes + page - 1) / page * page;
    map_bytes_ = rounded + page;
    void* map =
        mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) throw std::runtime_error("simt: cannot map shared memory");
    map_ = static_cast<unsigned char*>(map);
    mprotect(map_ + rounded, page, PROT_NONE);
    // Ends at the guard page, starts on 16 bytes.
    shared_ = map_ + ((rounded - shared_bytes) & ~size_t{15});
    shared_end_ = shared_ + shared_bytes;
    chunks_.resize((shared_bytes + 15) / 16);
    for (size_t i = 0; i < fibers_.size(); ++i) {
      fibers_[i].stack.reset(new char[kStack]);
      fibers_[i].thread.block_ = this;
      fibers_[i].thread.tid_ = static_cast<int>(i);
    }
  }
  ~SimtBlock() { munmap(map_, map_bytes_); }
  SimtBlock(const SimtBlock&) = delete;
  SimtBlock& operator=(const SimtBlock&) = delete;

  void run(int bx, int by, int bz, size_t shared_bytes) {
    idx_[0] = bx, idx_[1] = by, idx_[2] = bz;
    std::memset(shared_, 0xff, shared_bytes);
    for (Chunk& c : chunks_) c = Chunk{};
    block_arrived_ = 0;
    for (Warp& w : warps_) w.arrived = 0;
    for (Fiber& f : fibers_) {
      f.state = State::kRunnable;
      f.thread.phase_ = 0;
      f.thread.copies_.clear();
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.get();
      f.ctx.uc_stack.ss_size = kStack;
      f.ctx.uc_link = &scheduler_;
      makecontext(&f.ctx, &SimtBlock::trampoline, 0);
    }
    for (;;) {
      bool waiting = false, resumed = false;
      for (Fiber& f : fibers_) {
        if (f.state == State::kDone) continue;
        if (f.state == State::kWarp && warps_[f.thread.tid_ / 32].gen == f.gen) {
          waiting = true;
          continue;
        }
        if (f.state == State::kBlock && block_gen_ == f.gen) {
          waiting = true;
          continue;
        }
        f.state = State::kRunnable;
        current_ = &f;
        running_ = this;
        swapcontext(&scheduler_, &f.ctx);
        resumed = true;
        if (error_) std::rethrow_exception(error_);
      }
      if (!resumed && !waiting) return;
      if (!resumed)
        throw std::runtime_error("simt: block (" + std::to_string(bx) + ", " + std::to_string(by) +
                                 ", " + std::to_string(bz) +
                                 "): threads wait at different barriers");
    }
  }

  int index(int axis) const { return idx_[axis]; }
  int threads() const { return static_cast<int>(fibers_.size()); }
  int grid_x() const { return grid_x_; }
  void set_grid_x(int x) { grid_x_ = x; }
  unsigned char* shared() const { return shared_; }
  bool in_shared(const void* p, size_t bytes) const {
    const auto* c = static_cast<const unsigned char*>(p);
    return c >= shared_ && c + bytes <= shared_end_;
  }

  // Accesses of the 16 bytes at p (16 on 16, in shared memory) by thread tid: a race when
  // another thread wrote them since the last barrier, or (for a write) read them.
  void note(const void* p, int tid, bool write) {
    Chunk& c = chunks_[static_cast<size_t>(static_cast<const unsigned char*>(p) - shared_) / 16];
    const bool other_wrote = c.write_gen == block_gen_ && c.writer != tid;
    const bool other_read = c.read_gen == block_gen_ && c.reader != tid;
    if (other_wrote || (write && other_read)) {
      const std::string other = other_wrote     ? "thread " + std::to_string(c.writer) + " wrote"
                                : c.reader >= 0 ? "thread " + std::to_string(c.reader) + " read"
                                                : std::string("other threads read");
      throw std::runtime_error("simt: thread " + std::to_string(tid) +
                               (write ? " writes" : " reads") + " shared bytes at " +
                               std::to_string(static_cast<const unsigned char*>(p) - shared_) +
                               " that " + other + " with no barrier between");
    }
    if (write) {
      c.write_gen = block_gen_;
      c.writer = tid;
    } else {
      c.reader = c.read_gen == block_gen_ && c.reader != tid ? kSeveral : tid;
      c.read_gen = block_gen_;
    }
  }

  void block_barrier() {
    Fiber& f = *current_;
    if (++block_arrived_ == static_cast<int>(fibers_.size())) {
      block_arrived_ = 0;
      ++block_gen_;
      for (Fiber& each : fibers_) each.thread.publish();
      return;
    }
    f.state = State::kBlock;
    f.gen = block_gen_;
    swapcontext(&f.ctx, &scheduler_);
  }

  void warp_barrier() {
    Fiber& f = *current_;
    Warp& w = warps_[f.thread.tid_ / 32];
    if (++w.arrived == 32) {
      w.arrived = 0;
      ++w.gen;
      return;
    }
    f.state = State::kWarp;
    f.gen = w.gen;
    swapcontext(&f.ctx, &scheduler_);
  }

  SimtThread::Slot* slots(int tid, unsigned phase) { return warps_[tid / 32].slots[phase & 1]; }

 private:
  static constexpr size_t kStack = 256 * 1024;
  static constexpr int kSeveral = -1;  // a chunk read by more than one thread
  struct Chunk {                       // the last barrier interval that wrote and read 16 bytes
    uint64_t write_gen = UINT64_MAX, read_gen = UINT64_MAX;
    int writer = 0, reader = 0;
  };
  enum class State { kRunnable, kWarp, kBlock, kDone };
  struct Fiber {
    ucontext_t ctx;
    std::unique_ptr<char[]> stack;
    SimtThread thread;
    State state = State::kRunnable;
    uint64_t gen = 0;
  };
  struct Warp {
    int arrived = 0;
    uint64_t gen = 0;
    SimtThread::Slot slots[2][32];
  };

  static thread_local SimtBlock* running_;

  static void trampoline() {
    SimtBlock* self = running_;
    Fiber* f = self->current_;
    try {
      self->body_(f->thread);
    } catch (...) {
      self->error_ = std::current_exception();
    }
    f->state = State::kDone;  // uc_link returns to the scheduler
  }

  const std::function<void(SimtThread&)>& body_;
  std::vector<Fiber> fibers_;
  std::vector<Warp> warps_;
  ucontext_t scheduler_{};
  Fiber* current_ = nullptr;
  int idx_[3] = {0, 0, 0};
  int grid_x_ = 1;
  int block_arrived_ = 0;
  uint64_t block_gen_ = 0;
  std::exception_ptr error_;
  unsigned char* map_ = nullptr;
  size_t map_bytes_ = 0;
  unsigned char* shared_ = nullptr;
  unsigned char* shared_end_ = nullptr;
  std::vector<Chunk> chunks_;
};

thread_local SimtBlock* SimtBlock::running_ = nullptr;

int SimtThread::threads() const { return block_->threads(); }
int SimtThread::block(int axis) const { return block_->index(axis); }
int SimtThread::blocks() const { return block_->grid_x(); }
unsigned char* SimtThread::shared() const { return block_->shared(); }
void SimtThread::sync() { block_->block_barrier(); }

SimtThread::Slot& SimtThread::deposit() { return block_->slots(tid_, phase_)[tid_ % 32]; }

const SimtThread::Slot* SimtThread::exchange() {
  block_->warp_barrier();
  return block_->slots(tid_, phase_++);
}

float SimtThread::shfl_xor(float v, int mask) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  deposit().v[0] = bits;
  const Slot* all = exchange();
  const auto got = static_cast<uint32_t>(all[(tid_ % 32) ^ (mask & 31)].v[0]);
  float out;
  std::memcpy(&out, &got, sizeof out);
  return out;
}

double SimtThread::shfl(double v, int lane, int width) {
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    throw std::runtime_error("simt: shfl width " + std::to_string(width) +
                             " is not a power of two up to 32");
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  deposit().v[0] = bits;
  const Slot* all = exchange();
  const int me = tid_ % 32;
  const uint64_t got = all[me - me % width + lane % width].v[0];
  double out;
  std::memcpy(&out, &got, sizeof out);
  return out;
}

void SimtThread::load4(const float* p, float (&v)[4]) const {
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0)
    throw std::runtime_error("simt: 16-byte load of thread " + std::to_string(tid_) +
                             " is not on 16 bytes");
  std::memcpy(v, p, sizeof v);
}

void SimtThread::load_matrices(uint32_t (&r)[4], const uint16_t* row, bool trans) {
  if (!block_->in_shared(row, 16) || reinterpret_cast<uintptr_t>(row) % 16 != 0)
    throw std::runtime_error("simt: ldmatrix row of thread " + std::to_string(tid_) +
                             " is not 16 bytes on 16 in shared memory");
  block_->note(row, tid_, false);
  deposit().v[0] = reinterpret_cast<uintptr_t>(row);
  const Slot* all = exchange();
  const int lane = tid_ % 32, g = lane / 4, t = lane % 4;
  auto at = [&](int matrix, int row_in, int col) {
    return reinterpret_cast<const uint16_t*>(all[8 * matrix + row_in].v[0])[col];
  };
  for (int i = 0; i < 4; ++i) {
    const uint16_t lo = trans ? at(i, 2 * t, g) : at(i, g, 2 * t);
    const uint16_t hi = trans ? at(i, 2 * t + 1, g) : at(i, g, 2 * t + 1);
    r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
}

void SimtThread::copy16_async(void* dst, const void* src) {
  if (!block_->in_shared(dst, 16) || reinterpret_cast<uintptr_t>(dst) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(src) % 16 != 0)
    throw std::runtime_error("simt: cp.async of thread " + std::to_string(tid_) +
                             " is not 16 bytes on 16 into shared memory");
  block_->note(dst, tid_, true);
  Copy& c = copies_.emplace_back();
  c.dst = static_cast<unsigned char*>(dst);
  std::memcpy(c.bytes, src, 16);
  c.landed = false;
  std::memset(dst, 0xff, 16);
}

void SimtThread::zero16(void* dst) {
  if (!block_->in_shared(dst, 16) || reinterpret_cast<uintptr_t>(dst) % 16 != 0)
    throw std::runtime_error("simt: zero16 of thread " + std::to_string(tid_) +
                             " is not 16 bytes on 16 in shared memory");
  block_->note(dst, tid_, true);
  std::memset(dst, 0, 16);
}

uint32_t SimtThread::pack_bf16x2(float lo, float hi) const {
  return uint32_t(kmath::fp32_to_bf16(lo)) | (uint32_t(kmath::fp32_to_bf16(hi)) << 16);
}

void SimtThread::wait_all() {
  for (Copy& c : copies_) c.landed = true;
}

void SimtThread::publish() {
  size_t kept = 0;
  for (const Copy& c : copies_) {
    if (c.landed)
      std::memcpy(c.dst, c.bytes, 16);
    else
      copies_[kept++] = c;
  }
  copies_.resize(kept);
}

void SimtThread::mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Slot& s = deposit();
  s.v[0] = a[0] | (uint64_t(a[1]) << 32);
  s.v[1] = a[2] | (uint64_t(a[3]) << 32);
  s.v[2] = b0 | (uint64_t(b1) << 32);
  const Slot* all = exchange();
  auto half = [](uint64_t word, int which) {  // which: 0..3, 16-bit pieces of a 64-bit word
    const auto bits = static_cast<uint32_t>((word >> (16 * which)) & 0xffffu) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  };
  // A register j of lane L: word j / 2, pieces 2 (j % 2) and + 1; B register j: word 2.
  auto A = [&](int r, int k) {
    const int lane = (r % 8) * 4 + (k % 8) / 2, reg = r / 8 + 2 * (k / 8);
    return half(all[lane].v[reg / 2], 2 * (reg % 2) + k % 2);
  };
  auto B = [&](int k, int c) {
    const int lane = c * 4 + (k % 8) / 2, reg = k / 8;
    return half(all[lane].v[2], 2 * reg + k % 2);
  };
  const int lane = tid_ % 32, g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i / 2), c = 2 * t + i % 2;
    double sum = 0;
    for (int k = 0; k < 16; ++k) sum += double(A(r, k)) * double(B(k, c));
    d[i] = static_cast<float>(double(d[i]) + sum);
  }
}

void simt_launch(SimtGrid grid, int threads, size_t shared_bytes,
                 const std::function<void(SimtThread&)>& body) {
  if (threads <= 0 || threads % 32 != 0 || threads > 1024)
    throw std::invalid_argument("simt: threads per block must be a multiple of 32 up to 1024");
  SimtBlock block(threads, shared_bytes, body);
  block.set_grid_x(grid.x);
  for (int z = 0; z < grid.z; ++z)
    for (int y = 0; y < grid.y; ++y)
      for (int x = 0; x < grid.x; ++x) block.run(x, y, z, shared_bytes);
}

}  // namespace outcore::test
