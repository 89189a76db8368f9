// How the CUDA backend's RMSNorm weight gradient, dw[i] += sum over rows r of dy[r, i] x[r, i]
// rstd[r], divides its work among thread blocks (engine/device/cuda/cuda_kernels.cu): a block
// sums one tile of kDwColumns columns over one range of rows. A hidden size has enough tiles to
// fill the GPU (128 at 4096); a head's q/k norm does not (4 tiles at head size 128, over
// tokens x heads rows), so its rows split into ranges: each block writes its range's sums to a
// partial-sum workspace, and a second kernel adds the ranges into dw in range order.
// Deterministic: the same bits run after run. The workspace has one size for every shape
// (kDwPartialBytes, charged to the device budget with the backend's other workspaces). Plain
// C++: the planner and the CPU tests read it too.
#pragma once

#include <cstdint>

#include "engine/device/kernel_math.hpp"  // OUTCORE_HD

namespace outcore::device::norm {

inline constexpr int64_t kDwColumns = 32;
// Blocks a launch aims at: two per SM of an H100 / H200 (132 SMs; a block of 1024 threads).
inline constexpr int64_t kDwTargetBlocks = 256;
// Rows a range holds at least: fewer would not pay for the second kernel's pass.
inline constexpr int64_t kDwMinRows = 256;
// The partial sums' floats: ranges x dim < 2 x kDwTargetBlocks x kDwColumns for any split.
inline constexpr int64_t kDwPartialFloats = 2 * kDwTargetBlocks * kDwColumns;
inline constexpr uint64_t kDwPartialBytes = kDwPartialFloats * sizeof(float);

struct DwSplit {
  int64_t tiles = 0;           // column tiles (blocks along x)
  int64_t ranges = 1;          // row ranges (blocks along y); 1: dw written directly
  int64_t rows_per_range = 0;  // the last range may hold fewer; none is empty
};

// The split of `rows` x `dim`: one range where the tiles alone reach kDwTargetBlocks or the
// rows are few, else as many ranges as bring the blocks to about kDwTargetBlocks, each of at
// least kDwMinRows rows.
constexpr DwSplit dw_split(int64_t rows, int64_t dim) {
  DwSplit s;
  s.tiles = (dim + kDwColumns - 1) / kDwColumns;
  s.rows_per_range = rows;
  if (s.tiles == 0 || s.tiles >= kDwTargetBlocks || rows < 2 * kDwMinRows) return s;
  int64_t ranges = (kDwTargetBlocks + s.tiles - 1) / s.tiles;
  if (ranges > rows / kDwMinRows) ranges = rows / kDwMinRows;
  s.rows_per_range = (rows + ranges - 1) / ranges;
  s.ranges = (rows + s.rows_per_range - 1) / s.rows_per_range;
  return s;
}

// The rows [first, end) of range `k` of a split with `rows_per_range` (block k along y).
struct RowRange {
  int64_t first = 0, end = 0;
};
OUTCORE_HD RowRange dw_rows(int64_t k, int64_t rows_per_range, int64_t rows) {
  const int64_t first = k * rows_per_range;
  return {first, first + rows_per_range < rows ? first + rows_per_range : rows};
}

}  // namespace outcore::device::norm
