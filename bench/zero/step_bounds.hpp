// Lower bounds on one training step, measured on this machine in the benchmark's own run:
//
//   I/O bound      the time the drive takes to read and write the step's NVMe bytes, from its
//                  throughput through outcore's aio engine (the engine the swap tier uses)
//   compute bound  forward+backward of the step's micro-batches with every unit in memory,
//                  from the time of one embedding, one decoder layer and one head
//
// A step cannot be faster than the larger of the two; bench/zero/zero_large_bench reports its
// step time against them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <utility>

#include "aio/aio.hpp"
#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/placement.hpp"
#include "engine/zero/step_bounds.hpp"

namespace outcore::bench {

// Throughput of the drive under one directory, in 1e9 bytes per second.
struct DriveRates {
  double write_gbps = 0;  // a sequential write pass over the file
  double read_gbps = 0;   // a sequential read pass over the file
  // Reads and writes in flight together, in the proportion asked for: bytes both ways per
  // second.
  double mixed_gbps = 0;
  uint64_t file_bytes = 0;  // bytes of each pass (the file size, rounded down to whole spans)
  uint64_t span_bytes = 0;  // bytes per submitted span
};

// Creates a scratch file of about `file_bytes` in `dir` under a name of its own, unlinked once
// open (open_unlinked_scratch_file: nothing else in `dir` is touched, and nothing is left however
// the process ends), preallocated, O_DIRECT where the filesystem allows it, and moves it through an
// aio::Engine built from `options`, in spans of `span_bytes` with 4 spans in flight: one write
// pass, one read pass, then one mixed pass that reads the first `read_fraction` of the file while
// writing the rest, keeping the share of reads among the submitted spans at `read_fraction`.
// REQUIRES: span_bytes a non-zero multiple of 4096, file_bytes >= 2 spans, 0 <= read_fraction <= 1
// (InvalidArgument otherwise). Throws IoError naming the file when it cannot be created,
// preallocated (ENOSPC), read or written.
DriveRates measure_drive(const std::filesystem::path& dir, uint64_t file_bytes, uint64_t span_bytes,
                         double read_fraction, const aio::Options& options);

// The drive's time for a step that reads `read_bytes` and writes `write_bytes`.
struct IoBound {
  double serial_s = 0;      // read_bytes / read rate + write_bytes / write rate
  double overlapped_s = 0;  // max of the two terms: reads and writes fully overlapped
  double mixed_s = 0;       // all bytes at the measured mixed rate
};
IoBound io_bound(const DriveRates& rates, uint64_t read_bytes, uint64_t write_bytes);

// Median forward+backward time of each kind of unit of `model` with its parameters in host
// memory (its param dtype, activation checkpointing and micro-batch shape).
struct ComputeTimes {
  double embed_s = 0;    // embedding forward + backward
  double decoder_s = 0;  // one decoder layer forward + backward (its recompute included)
  double head_s = 0;     // head backward, which computes the loss forward fused in
  int64_t layers = 0;
  int64_t micro_batches = 1;
  // The step's forward+backward: every decoder layer costs the same.
  double step_s() const {
    return static_cast<double>(micro_batches) *
           (embed_s + static_cast<double>(layers) * decoder_s + head_s);
  }
};

// Times one warm-up and `reps` (>= 1; InvalidArgument otherwise) passes over the embedding,
// decoder layer 1 and the head of `model` on `micro_batches` micro-batches per step, with
// parameters from model::init_params and buffers allocated here on `dev` (the three units'
// parameters and fp32 gradients, the activations of one micro-batch; the model's backend must
// compute on `dev`'s memory); `cpu_checkpointing` as the training run's. Uses every BLAS
// thread (or the GPU), as training does: run it alone.
ComputeTimes measure_compute(const model::LlamaModel& model, device::Device& dev,
                             int64_t micro_batches, int reps, bool cpu_checkpointing);

// The (micro-batch, accumulation) that `outcore estimate` recommends on this machine
// (zero::choose_shape: the fewest tokens per step whose compute covers every transfer within
// `budget`, else the closest) for training `mc` on sequences of `seq` tokens, parameters in
// `param_dtype`, with `base`'s placement and compute dtype on `dev` and gradients as `grads` say;
// from rates measured here, left in `rates`: the drive's read and write rates under `nvme`
// through the aio engine of `base` (a scratch file of `ref_gib` GiB), pinned copies where the
// host cannot read `dev`, the GEMM and the model's attention on `compute_dev`. Prints the rates
// and the choice; nullopt when no micro-batch fits.
std::optional<std::pair<int64_t, int64_t>> recommend_shape(
    const model::LlamaConfig& mc, int64_t seq, DType param_dtype, device::Device& dev,
    device::Device& compute_dev, uint64_t budget, const std::filesystem::path& nvme, double ref_gib,
    zero::GradientPlacement grads, const config::Config& base, zero::LinkRates& rates);

// User + system CPU seconds of this process so far (every thread), from getrusage.
double cpu_seconds();

}  // namespace outcore::bench
