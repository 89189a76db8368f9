#include "engine/train/checkpointing.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "engine/ckpt/hf.hpp"

namespace outcore::train {
namespace {

std::span<std::byte> as_bytes(float* p, size_t n) {
  return {reinterpret_cast<std::byte*>(p), n * sizeof(float)};
}

ckpt::Manifest checkpoint_manifest(const zero::ZeroEngine& engine, int64_t step, int world_size,
                                   int zero_stage) {
  ckpt::Manifest man;
  man.step = step;
  man.world_size = world_size;
  man.zero_stage = zero_stage;
  man.param_dtype = engine.param_dtype();
  for (const model::UnitLayout& ul : engine.model().layout().units)
    man.units.push_back({ul.name, ul.numel, ul.padded_numel});
  return man;
}

}  // namespace

uint64_t checkpoint_bytes(const zero::ZeroEngine& engine, int world_size, int zero_stage,
                          uint64_t piece_elems, uint64_t config_bytes) {
  if (piece_elems == 0) throw InvalidArgument("checkpoint: piece_elems must be > 0");
  // Per piece of this rank's partitions (save_engine_checkpoint's segments): fp32 master weights
  // and two moments in optimizer.bin, the parameters in model.bin, each segment aligned.
  const size_t psz = dtype_size(engine.param_dtype());
  uint64_t bytes = 2 * kIoAlignment, segments = 0;  // the two files' headers
  for (int u = 0; u < engine.model().num_units(); ++u) {
    const uint64_t n = engine.partition_numel(u);
    for (uint64_t b = 0; b < n; b += piece_elems) {
      const uint64_t c = std::min(piece_elems, n - b);
      bytes += 3 * align_up(c * sizeof(float), kIoAlignment) + align_up(c * psz, kIoAlignment);
      segments += 4;
    }
  }
  // Every rank saves its partitions (of equal size); at stage 0 rank 0 alone saves the state.
  const uint64_t savers = static_cast<uint64_t>(zero_stage == 0 ? 1 : world_size);
  return savers * (bytes + segments * kManifestBytesPerSegment) + config_bytes +
         kCheckpointTextBytes + 4 * kIoAlignment;  // four text files, each rounded up
}

ckpt::SaveResult save_engine_checkpoint(ckpt::SaveDir& dir, const std::string& tag, int64_t step,
                                        zero::ZeroEngine& engine, int rank, int world_size,
                                        int zero_stage, const CheckpointTexts& texts,
                                        const ckpt::WriterOptions& options) {
  if (world_size != 1 && (options.group == nullptr || options.group->world != world_size ||
                          options.group->rank != rank))
    throw InvalidArgument(
        fmt::format("checkpoint of rank {} of {}: the ranks save together (WriterOptions::group)",
                    rank, world_size));
  const int units = engine.model().num_units();
  const DType pdt = engine.param_dtype();
  const size_t psz = dtype_size(pdt);
  const uint64_t piece_elems = options.piece_elems;
  if (piece_elems == 0) throw InvalidArgument("checkpoint: piece_elems must be > 0");
  ckpt::CheckpointWriter w(dir, tag, options, ckpt::kSaveStagingSlots);
  if (rank == 0) {  // the files every rank shares
    w.add_text_file("ds_config.json", texts.ds_config);
    w.add_text_file("config.json", texts.model_config);
    w.add_text_file("trainer_state.json", texts.trainer_state);
  }

  // Stage 0 keeps the whole state on every rank: rank 0 writes it, the others write nothing (a
  // slab element stored twice is a checkpoint that does not load).
  if (zero_stage == 0 && rank != 0) {
    w.prepare();
    return w.commit(checkpoint_manifest(engine, step, world_size, zero_stage));
  }
  // Each unit's partition in pieces of piece_elems: optimizer.bin holds, per piece, its master
  // weights, exp_avg and exp_avg_sq; model.bin the piece's parameters.
  std::vector<ckpt::Segment> opt, par;
  std::vector<int> first_piece(units + 1, 0);
  for (int u = 0; u < units; ++u) {
    const uint64_t off = engine.partition_offset(u), n = engine.partition_numel(u);
    for (uint64_t b = 0; b < n; b += piece_elems) {
      const uint64_t c = std::min(piece_elems, n - b);
      for (ckpt::ArrayKind a :
           {ckpt::ArrayKind::kMaster, ckpt::ArrayKind::kExpAvg, ckpt::ArrayKind::kExpAvgSq})
        opt.push_back({u, a, DType::F32, off + b, c, 0});
      par.push_back({u, ckpt::ArrayKind::kParams, pdt, off + b, c, 0});
    }
    first_piece[u + 1] = static_cast<int>(par.size());
  }
  const int fo = w.add_data_file(fmt::format("rank{}/optimizer.bin", rank), rank, "optimizer", opt);
  const int fp = w.add_data_file(fmt::format("rank{}/model.bin", rank), rank, "model", par);
  w.prepare();
  for (int u = 0; u < units; ++u) {
    const uint64_t n = engine.partition_numel(u);
    // The tier hands out consecutive ranges; copy each into the open piece's three buffers
    // and submit the piece when it is complete.
    std::span<std::byte> open[3];
    bool is_open = false;
    engine.visit_unit_state(u, [&](size_t first, size_t count, const float* m, const float* a,
                                   const float* v) {
      const float* src[3] = {m, a, v};
      for (size_t done = 0; done < count;) {
        const uint64_t e = first + done, piece = e / piece_elems;
        const uint64_t p_begin = piece * piece_elems, p_end = std::min(n, p_begin + piece_elems);
        const int seg = 3 * (first_piece[u] + static_cast<int>(piece));
        if (!is_open) {
          for (int k = 0; k < 3; ++k) open[k] = w.stage(fo, seg + k);
          is_open = true;
        }
        const uint64_t take = std::min<uint64_t>(count - done, p_end - e);
        for (int k = 0; k < 3; ++k)
          std::memcpy(open[k].data() + (e - p_begin) * sizeof(float), src[k] + done,
                      take * sizeof(float));
        done += take;
        if (e + take == p_end) {
          for (int k = 0; k < 3; ++k) w.submit(fo, seg + k);
          is_open = false;
        }
      }
    });
    engine.visit_param_partition(u, [&](std::span<const std::byte> p) {
      for (uint64_t b = 0, k = 0; b < n; b += piece_elems, ++k) {
        const int seg = first_piece[u] + static_cast<int>(k);
        std::span<std::byte> buf = w.stage(fp, seg);
        std::memcpy(buf.data(), p.data() + b * psz, buf.size());
        w.submit(fp, seg);
      }
    });
  }
  return w.commit(checkpoint_manifest(engine, step, world_size, zero_stage));
}

void check_checkpoint_model(const ckpt::Manifest& m, const model::ModelLayout& layout,
                            const std::string& source) {
  if (m.units.size() != layout.units.size())
    throw ConfigError("", fmt::format("{}: the checkpoint has {} units, this model {} (a "
                                      "different number of layers)",
                                      source, m.units.size(), layout.units.size()));
  for (size_t u = 0; u < m.units.size(); ++u) {
    const model::UnitLayout& ul = layout.units[u];
    if (m.units[u].name != ul.name || m.units[u].numel != ul.numel)
      throw ConfigError(
          "", fmt::format("{}: unit {} is {} with {} elements in the checkpoint, "
                          "{} with {} in this model (a different model config)",
                          source, u, m.units[u].name, m.units[u].numel, ul.name, ul.numel));
  }
}

void load_engine_checkpoint(const ckpt::Checkpoint& ck, zero::ZeroEngine& engine) {
  check_checkpoint_model(ck.manifest(), engine.model().layout(), ck.dir().string());
  for (int u = 0; u < engine.model().num_units(); ++u) {
    const uint64_t off = engine.partition_offset(u);
    // Read straight into the tier's arrays (or its ring buffer, one sub-group at a time).
    engine.fill_unit_state(u, [&](size_t first, size_t n, float* m, float* a, float* v) {
      ck.read_slab(u, ckpt::ArrayKind::kMaster, off + first, n, as_bytes(m, n));
      ck.read_slab(u, ckpt::ArrayKind::kExpAvg, off + first, n, as_bytes(a, n));
      ck.read_slab(u, ckpt::ArrayKind::kExpAvgSq, off + first, n, as_bytes(v, n));
    });
  }
}

void import_hf_weights(const ckpt::HfWeights& w, zero::ZeroEngine& engine) {
  const model::ModelLayout& layout = engine.model().layout();
  for (int u = 0; u < engine.model().num_units(); ++u) {
    const uint64_t off = engine.partition_offset(u);
    engine.fill_unit_state(u, [&](size_t first, size_t n, float* m, float*, float*) {
      w.read_unit_range(layout.units[u], off + first, n, m);  // moments stay zero
    });
  }
}

}  // namespace outcore::train
