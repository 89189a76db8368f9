// A SIMT emulation of CUDA thread blocks on the host, for kernel bodies written once for the GPU
// and the host (engine/device/flash_attention_tiles.hpp, block_kernels.hpp): each thread of a block
// runs as a fiber, switched at its barriers, so the kernel's own code (indices, masks, warp
// collectives, shared memory) runs here exactly as written. Blocks run one after another.
//
// The warp collectives follow PTX: shfl_xor (__shfl_xor_sync over all 32 lanes), shfl
// (__shfl_sync of a double from a lane of the caller's `width`-lane segment), ldmatrix
// (.m8n8.x4.b16, with and without .trans) and mma (.m16n8k16.row.col.f32.bf16.bf16.f32, the sum
// of the 16 products taken in double and added to the fp32 accumulator: the tensor cores' own
// order and precision are not emulated, so results agree with a GPU up to summation order).
// exp2 is the host's exp2f where the GPU's multi-function unit approximates (ex2.approx.ftz, a
// few units in the last place); pack_bf16x2 rounds as cvt.rn.bf16x2.f32 does.
//
// Faults the emulation turns into a std::runtime_error: threads of a block waiting at different
// barriers (a divergent __syncthreads or collective), a 16-byte load (load4) not on 16 bytes, a
// shfl width that is not a power of two up to 32, an ldmatrix row outside shared memory or not
// on 16 bytes, a cp.async not 16 bytes on 16 or not into shared memory, and a race: 16 bytes of
// shared memory that one thread writes (zero16, or issues a cp.async into) and another reads
// (ldmatrix) or writes between the same two barriers, in either order. An exception thrown by a
// body ends the launch and reaches the caller.
//
// cp.async (copy16_async, wait_all: cp.async.cg 16 bytes, cp.async.wait_all) is emulated at its
// latest: the destination turns to 0xff when the copy is issued and gets its bytes only at the
// first barrier all threads reach after the issuing thread waited for it. So a read of a tile
// before its wait and barrier, or a copy issued into a tile that other threads still read, shows
// as NaNs. Shared memory
// starts filled with 0xff (NaN as fp32 and bf16) so that a read before a write shows, and ends at
// an inaccessible page.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace outcore::test {

class SimtBlock;

// One emulated thread: the `X` of a kernel body.
class SimtThread {
 public:
  int thread() const { return tid_; }
  int threads() const;
  int block(int axis) const;
  int blocks() const;
  unsigned char* shared() const;
  void sync();
  float shfl_xor(float v, int mask);
  double shfl(double v, int lane, int width);
  void load4(const float* p, float (&v)[4]) const;
  void ldmatrix(uint32_t (&r)[4], const uint16_t* row) { load_matrices(r, row, false); }
  void ldmatrix_trans(uint32_t (&r)[4], const uint16_t* row) { load_matrices(r, row, true); }
  void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
  void copy16_async(void* dst, const void* src);
  void wait_all();
  void zero16(void* dst);
  float exp2(float v) const { return std::exp2(v); }
  uint32_t pack_bf16x2(float lo, float hi) const;

 private:
  friend class SimtBlock;
  struct Slot {
    uint64_t v[4];
  };
  // This lane's slot of the warp's next exchange, and (after the warp's barrier) every lane's.
  Slot& deposit();
  const Slot* exchange();
  void load_matrices(uint32_t (&r)[4], const uint16_t* row, bool trans);

  // cp.async: each copy's destination and the 16 bytes it brings; landed once waited for.
  struct Copy {
    unsigned char* dst;
    unsigned char bytes[16];
    bool landed;
  };
  void publish();  // writes the landed copies (at a barrier that all threads have reached)

  std::vector<Copy> copies_;
  SimtBlock* block_ = nullptr;
  int tid_ = 0;
  unsigned phase_ = 0;  // collectives done: which of the warp's two slot sets is next
};

struct SimtGrid {
  int x = 1, y = 1, z = 1;
};

// Runs body(thread) for every thread of every block of `grid`: `threads` per block (a multiple
// of 32, at most 1024), `shared_bytes` of shared memory per block.
void simt_launch(SimtGrid grid, int threads, size_t shared_bytes,
                 const std::function<void(SimtThread&)>& body);

}  // namespace outcore::test
