// Moving a ZeroEngine's training state to and from engine/ckpt checkpoints, and Hugging Face
// weights into an engine.
//
// save_engine_checkpoint streams each unit from whichever tier holds it (device, host, NVMe swap
// files) through the writer's bounded staging buffers: this rank's fp32 master weights and Adam
// moments to rank<r>/optimizer.bin, its low-precision parameters to rank<r>/model.bin. At any
// moment at most two units' state is staged, so host memory grows by a few units, never by the
// model. load_engine_checkpoint reads this rank's partition of every unit from whichever files of
// the checkpoint hold it (any saving world size: the slabs are re-sliced) and writes it into the
// engine; the low-precision parameters are recomputed from the master weights with the same
// rounding the optimizer uses, so a resumed run is bit-identical to an uninterrupted one.
//
// Errors: as ckpt::CheckpointWriter / ckpt::Checkpoint and zero::ZeroEngine. A checkpoint whose
// model does not match the engine's (units, sizes) is a ConfigError naming the difference.
#pragma once

#include <filesystem>
#include <functional>
#include <string>

#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/hf.hpp"
#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/zero.hpp"

namespace outcore::train {

// The files describing a run besides the engine's state; written as they are.
struct CheckpointTexts {
  std::string ds_config;      // resolved DeepSpeed config JSON
  std::string model_config;   // Hugging Face config.json
  std::string trainer_state;  // step, scheduler, loss scaler, data position, ...
};

ckpt::SaveResult save_engine_checkpoint(ckpt::SaveDir& dir, const std::string& tag, int64_t step,
                                        zero::ZeroEngine& engine, int rank, int world_size,
                                        int zero_stage, const CheckpointTexts& texts,
                                        const ckpt::WriterOptions& options);

// At most the bytes one checkpoint of `engine`'s run takes, every rank's: its data files as a
// save with pieces of `piece_elems` lays them out (headers, each segment aligned), the
// manifest's entries at kManifestBytesPerSegment each, `config_bytes` (the sizes of the
// checkpoint's ds_config.json and config.json) and kCheckpointTextBytes for the trainer state
// and the manifest's other fields, each text file block-aligned. A save checks its own figure
// again exactly.
inline constexpr uint64_t kCheckpointTextBytes = uint64_t{64} << 10;
inline constexpr uint64_t kManifestBytesPerSegment = 512;
uint64_t checkpoint_bytes(const zero::ZeroEngine& engine, int world_size, int zero_stage,
                          uint64_t piece_elems, uint64_t config_bytes);

// REQUIRES: ck.verify() passed (the caller decides when; loading never checks CRCs itself).
void load_engine_checkpoint(const ckpt::Checkpoint& ck, zero::ZeroEngine& engine);

// Checks that the checkpoint's units are this model's (names and numel), ConfigError otherwise.
void check_checkpoint_model(const ckpt::Manifest& m, const model::ModelLayout& layout,
                            const std::string& source);

// Fills the engine from Hugging Face weights (opened and checked against the engine's model by
// ckpt::HfWeights::open): master weights from the files (converted to fp32), moments zero,
// low-precision parameters rounded from the master weights. Streams range by range into the
// tier (one optimizer sub-group at a time on NVMe).
void import_hf_weights(const ckpt::HfWeights& weights, zero::ZeroEngine& engine);

}  // namespace outcore::train
