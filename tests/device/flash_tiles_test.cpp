// The register-resident fused attention (engine/device/flash_attention_tiles.hpp) run on the
// host under the SIMT emulation of a thread block (tests/common/simt.hpp): the very bodies the
// CUDA kernels run, against the host's default attention in bf16 compute, at the CUDA kernels'
// tolerance (host_attention.hpp, expect_bf16_attention).
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/device/compute_backend.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "engine/device/flash_attention_tiles.hpp"
#include "tests/common/numeric.hpp"
#include "tests/common/simt.hpp"
#include "tests/device/host_attention.hpp"

namespace outcore::test {
namespace {

// The kernels of one forward and backward; backward reads D of the host's bf16 output (the same
// bits as the host's D: ComputeBackend::attention_delta is the one function on every backend).
template <int HD>
HostAttention emulate(const AttentionCase& c) {
  const AttentionShape s{c.a.B, c.a.T, c.a.nh, c.a.nkv, c.a.hd};
  const float scale = c.a.scale;
  const std::vector<std::vector<uint16_t>>& bits = c.in.bits;
  const flash::Geometry g{static_cast<int>(s.T), static_cast<int>(s.nh), static_cast<int>(s.nkv),
                          static_cast<int>(s.nh / s.nkv), scale};
  const int64_t tokens = s.B * s.T;
  HostAttention o{std::vector<float>(tokens * s.nh * HD),  std::vector<float>(s.B * s.nh * s.T),
                  std::vector<float>(tokens * s.nh * HD),  std::vector<float>(tokens * s.nkv * HD),
                  std::vector<float>(tokens * s.nkv * HD), {}};
  std::vector<float> delta(s.B * s.nh * s.T);
  device::cpu_backend()->attention_delta(c.a, c.want.attn_bf16.data(), bits[3].data(),
                                         delta.data());
  const uint16_t *q = bits[0].data(), *k = bits[1].data(), *v = bits[2].data();
  const uint16_t* dattn = bits[3].data();
  const int B = static_cast<int>(s.B);
  const auto grid = [](flash::Grid g) { return SimtGrid{g.x, g.y, g.z}; };
  using L = flash::Tiles<HD>;
  simt_launch(grid(flash::forward_grid(g, B)), flash::kThreads, L::kForward, [&](SimtThread& x) {
    flash::forward_block<HD>(x, q, k, v, o.lse.data(), o.attn.data(), nullptr, g);
  });
  // The output in bf16 instead: the fp32 one, rounded.
  std::vector<uint16_t> attn16(o.attn.size(), 0x7fc1), want16(o.attn.size());
  std::vector<float> unused(s.B * s.nh * s.T);
  simt_launch(grid(flash::forward_grid(g, B)), flash::kThreads, L::kForward, [&](SimtThread& x) {
    flash::forward_block<HD>(x, q, k, v, unused.data(), nullptr, attn16.data(), g);
  });
  device::cpu::from_fp32(o.attn.data(), want16.data(), DType::BF16,
                         static_cast<int64_t>(o.attn.size()));
  EXPECT_EQ(attn16, want16) << "attn in bf16";
  simt_launch(grid(flash::dq_grid(g, B)), flash::kThreads, L::kDq, [&](SimtThread& x) {
    flash::backward_dq_block<HD>(x, q, k, v, o.lse.data(), dattn, delta.data(), o.dq.data(), g);
  });
  simt_launch(grid(flash::dkv_grid(g, B)), flash::kThreads, L::kDkv, [&](SimtThread& x) {
    flash::backward_dkv_block<HD>(x, q, k, v, o.lse.data(), dattn, delta.data(), o.dk.data(),
                                  o.dv.data(), g);
  });
  return o;
}

// Shapes: partial tiles (T not a multiple of 64, so rows and keys beyond T in the last tile),
// several tiles (the causal diagonal inside and across tiles), grouped kv heads, batches, and
// every head size the kernels take.
// The shared memory a block takes, against the opt-in limits of the devices the build runs on:
// head size 128 needs more than the 99 KiB of sm_86 / sm_89 / sm_120 (those run the default
// attention), every head size fits sm_80's 163 KiB and sm_90's 227 KiB.
TEST(FlashTiles, SharedMemoryFitsTheDevicesThatRunTheKernels) {
  EXPECT_EQ(flash::shared_bytes(128), 104448u);
  EXPECT_EQ(flash::shared_bytes(64), 55296u);
  EXPECT_EQ(flash::shared_bytes(96), 0u);
  for (const int hd : {16, 32, 64, 128}) {
    SCOPED_TRACE(hd);
    EXPECT_TRUE(flash::fits_shared(hd, 163 * 1024));
    EXPECT_TRUE(flash::fits_shared(hd, 227 * 1024));
    EXPECT_EQ(flash::fits_shared(hd, 99 * 1024), hd != 128);
  }
  EXPECT_FALSE(flash::fits_shared(96, size_t{1} << 30));
}

TEST(FlashTiles, EmulatedKernelsMatchTheHostInBf16) {
  for (const AttentionShape& s :
       {AttentionShape{2, 150, 4, 2, 64}, AttentionShape{1, 70, 2, 1, 128},
        AttentionShape{1, 100, 3, 3, 32}, AttentionShape{2, 65, 2, 1, 16}}) {
    const AttentionCase c = attention_case(s);
    SCOPED_TRACE(c.name);
    HostAttention got;
    switch (s.hd) {
      case 16:
        got = emulate<16>(c);
        break;
      case 32:
        got = emulate<32>(c);
        break;
      case 64:
        got = emulate<64>(c);
        break;
      default:
        got = emulate<128>(c);
    }
    expect_bf16_attention(got, c.want, c.fp32);
  }
}

// The emulation itself: an mma of known fragments gives the matrix product, ldmatrix hands out
// PTX's layout, and a barrier some threads skip is reported, not hung on.
TEST(FlashTiles, EmulatedWarpCollectivesFollowPtx) {
  // A[16 x 16] = r + 16 c (small integers, exact in bf16), B[16 x 8] = k - n.
  auto a_val = [](int r, int c) { return float(r + 16 * c) / 64.0f; };
  auto b_val = [](int k, int n) { return float(k - n); };
  auto bf = [](float f) { return uint32_t(kmath::fp32_to_bf16(f)); };
  std::vector<float> d(32 * 4);
  std::vector<uint32_t> lm(32 * 4), lmt(32 * 4);
  simt_launch({1, 1, 1}, 32, 16 * 16 * sizeof(uint16_t), [&](SimtThread& x) {
    const int lane = x.thread(), g = lane / 4, t = lane % 4;
    uint32_t a[4];
    for (int i = 0; i < 4; ++i) {
      const int r = g + 8 * (i % 2), c = 2 * t + 8 * (i / 2);
      a[i] = bf(a_val(r, c)) | (bf(a_val(r, c + 1)) << 16);
    }
    const uint32_t b0 = bf(b_val(2 * t, g)) | (bf(b_val(2 * t + 1, g)) << 16);
    const uint32_t b1 = bf(b_val(2 * t + 8, g)) | (bf(b_val(2 * t + 9, g)) << 16);
    float acc[4] = {1, 1, 1, 1};
    x.mma(acc, a, b0, b1);
    for (int i = 0; i < 4; ++i) d[lane * 4 + i] = acc[i];
    // A 16 x 16 tile of element values r * 16 + c in shared memory; lane l names row l % 8 of
    // matrix l / 8, matrices at (rows, cols) +0/+0, +8/+0, +0/+8, +8/+8.
    auto* tile = reinterpret_cast<uint16_t*>(x.shared());
    for (int i = 0; i < 8; ++i) tile[lane * 8 + i] = static_cast<uint16_t>(lane * 8 + i);
    x.sync();
    const uint16_t* row = tile + (lane % 8 + 8 * ((lane / 8) % 2)) * 16 + 8 * (lane / 16);
    uint32_t r[4], rt[4];
    x.ldmatrix(r, row);
    x.ldmatrix_trans(rt, row);
    for (int i = 0; i < 4; ++i) lm[lane * 4 + i] = r[i], lmt[lane * 4 + i] = rt[i];
  });
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int r = g + 8 * (i / 2), c = 2 * t + i % 2;
      double want = 1;
      for (int k = 0; k < 16; ++k) want += double(a_val(r, k)) * b_val(k, c);
      EXPECT_EQ(d[lane * 4 + i], float(want)) << "lane " << lane << " element " << i;
      // Matrix i at rows 8 (i % 2), columns 8 (i / 2) of the tile.
      const int r0 = 8 * (i % 2), c0 = 8 * (i / 2);
      auto at = [&](int rr, int cc) { return uint32_t((r0 + rr) * 16 + c0 + cc); };
      EXPECT_EQ(lm[lane * 4 + i], at(g, 2 * t) | (at(g, 2 * t + 1) << 16)) << "lane " << lane;
      EXPECT_EQ(lmt[lane * 4 + i], at(2 * t, g) | (at(2 * t + 1, g) << 16)) << "lane " << lane;
    }
  }
  EXPECT_THROW(simt_launch({1, 1, 1}, 64, 16,
                           [](SimtThread& x) {
                             if (x.thread() != 5) x.sync();
                           }),
               std::runtime_error);
  EXPECT_THROW(simt_launch({1, 1, 1}, 32, 64,
                           [](SimtThread& x) {
                             uint32_t r[4];
                             x.ldmatrix(r, reinterpret_cast<const uint16_t*>(x.shared()) + 1);
                           }),
               std::runtime_error);
}

// cp.async as emulated: the bytes arrive at the first barrier after the issuing thread's
// wait_all, not before; shared memory written by one thread and read or written by another
// between the same two barriers is reported.
TEST(FlashTiles, EmulatedCopiesLandAtTheBarrierAfterTheirWait) {
  std::vector<uint16_t> global(32 * 8);
  for (size_t i = 0; i < global.size(); ++i) global[i] = static_cast<uint16_t>(i);
  // Lane l copies row l (8 bf16) and reads its matrix back with ldmatrix x4, each lane naming its
  // own row: after a barrier but before the wait, after the wait, then after the next barrier.
  std::vector<uint32_t> early(32), waited(32), landed(32);
  simt_launch({1, 1, 1}, 32, global.size() * sizeof(uint16_t), [&](SimtThread& x) {
    auto* tile = reinterpret_cast<uint16_t*>(x.shared());
    const int lane = x.thread();
    x.copy16_async(tile + 8 * lane, global.data() + 8 * lane);
    x.sync();
    uint32_t r[4];
    x.ldmatrix(r, tile + 8 * lane);
    early[lane] = r[0];
    x.wait_all();
    x.ldmatrix(r, tile + 8 * lane);
    waited[lane] = r[0];
    x.sync();
    x.ldmatrix(r, tile + 8 * lane);
    landed[lane] = r[0];
  });
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;  // matrix 0: row g, columns 2t and 2t + 1
    EXPECT_EQ(early[lane], 0xffffffffu) << "lane " << lane;
    EXPECT_EQ(waited[lane], 0xffffffffu) << "lane " << lane;
    EXPECT_EQ(landed[lane], uint32_t(8 * g + 2 * t) | (uint32_t(8 * g + 2 * t + 1) << 16))
        << "lane " << lane;
  }
  // A read of bytes another thread wrote, and a write of bytes another thread read, with no
  // barrier between; the same with the barrier is fine.
  const auto race = [](bool barrier, bool write_first) {
    simt_launch({1, 1, 1}, 64, 64 * 16, [&](SimtThread& x) {
      auto* tile = reinterpret_cast<uint16_t*>(x.shared());
      const bool writer = x.thread() == 32;  // lane 0 of warp 1
      if (write_first && writer) x.zero16(tile);
      if (write_first && barrier) x.sync();
      uint32_t r[4];
      if (x.thread() < 32) x.ldmatrix(r, tile + 8 * (x.thread() % 8));
      if (!write_first && barrier) x.sync();
      if (!write_first && writer) x.zero16(tile);
    });
  };
  EXPECT_NO_THROW(race(true, true));
  EXPECT_NO_THROW(race(true, false));
  EXPECT_THROW(race(false, true), std::runtime_error);
  EXPECT_THROW(race(false, false), std::runtime_error);
}

}  // namespace
}  // namespace outcore::test
