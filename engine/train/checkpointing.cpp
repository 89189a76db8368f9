#include "engine/train/checkpointing.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "engine/ckpt/hf.hpp"

namespace outcore::train {
namespace {

std::span<float> as_floats(std::span<std::byte> b) {
  return {reinterpret_cast<float*>(b.data()), b.size() / sizeof(float)};
}

size_t max_partition(const zero::ZeroEngine& engine) {
  size_t n = 0;
  for (int u = 0; u < engine.model().num_units(); ++u) n = std::max(n, engine.partition_numel(u));
  return n;
}

}  // namespace

ckpt::SaveResult save_engine_checkpoint(ckpt::SaveDir& dir, const std::string& tag, int64_t step,
                                        zero::ZeroEngine& engine, int rank, int world_size,
                                        int zero_stage, const CheckpointTexts& texts,
                                        const ckpt::WriterOptions& options) {
  if (world_size != 1)
    throw InvalidArgument("checkpoints of more than one rank are not supported yet");
  const model::ModelLayout& layout = engine.model().layout();
  const int units = engine.model().num_units();
  ckpt::CheckpointWriter w(dir, tag, options);
  w.add_text_file("ds_config.json", texts.ds_config);
  w.add_text_file("config.json", texts.model_config);
  w.add_text_file("trainer_state.json", texts.trainer_state);

  std::vector<ckpt::Segment> opt, par;
  for (int u = 0; u < units; ++u) {
    const uint64_t off = engine.partition_offset(u), n = engine.partition_numel(u);
    for (ckpt::ArrayKind a :
         {ckpt::ArrayKind::kMaster, ckpt::ArrayKind::kExpAvg, ckpt::ArrayKind::kExpAvgSq})
      opt.push_back({u, a, DType::F32, off, n, 0});
    par.push_back({u, ckpt::ArrayKind::kParams, engine.param_dtype(), off, n, 0});
  }
  const int fo = w.add_data_file(fmt::format("rank{}/optimizer.bin", rank), rank, "optimizer", opt);
  const int fp = w.add_data_file(fmt::format("rank{}/model.bin", rank), rank, "model", par);
  w.prepare();
  for (int u = 0; u < units; ++u) {
    std::span<std::byte> m = w.stage(fo, 3 * u), a = w.stage(fo, 3 * u + 1),
                         v = w.stage(fo, 3 * u + 2);
    engine.read_unit_state(u, as_floats(m), as_floats(a), as_floats(v));
    for (int k = 0; k < 3; ++k) w.submit(fo, 3 * u + k);
    engine.read_param_partition(u, w.stage(fp, u));
    w.submit(fp, u);
  }
  ckpt::Manifest man;
  man.step = step;
  man.world_size = world_size;
  man.zero_stage = zero_stage;
  man.param_dtype = engine.param_dtype();
  for (const model::UnitLayout& ul : layout.units)
    man.units.push_back({ul.name, ul.numel, ul.padded_numel});
  return w.commit(std::move(man));
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
  const size_t cap = max_partition(engine);
  AlignedBuffer buf[3] = {AlignedBuffer(cap * 4), AlignedBuffer(cap * 4), AlignedBuffer(cap * 4)};
  const ckpt::ArrayKind kinds[3] = {ckpt::ArrayKind::kMaster, ckpt::ArrayKind::kExpAvg,
                                    ckpt::ArrayKind::kExpAvgSq};
  for (int u = 0; u < engine.model().num_units(); ++u) {
    const uint64_t off = engine.partition_offset(u), n = engine.partition_numel(u);
    std::span<float> s[3];
    for (int k = 0; k < 3; ++k) {
      s[k] = buf[k].as<float>().first(n);
      ck.read_slab(u, kinds[k], off, n, std::as_writable_bytes(s[k]));
    }
    engine.write_unit_state(u, s[0], s[1], s[2]);
  }
}

void import_hf_weights(const std::filesystem::path& hf_dir, zero::ZeroEngine& engine) {
  const ckpt::HfWeights w = ckpt::HfWeights::open(hf_dir, engine.model().config());
  const model::ModelLayout& layout = engine.model().layout();
  const size_t cap = max_partition(engine);
  AlignedBuffer master(cap * 4), zeros(cap * 4);
  for (int u = 0; u < engine.model().num_units(); ++u) {
    const uint64_t off = engine.partition_offset(u), n = engine.partition_numel(u);
    std::span<float> m = master.as<float>().first(n);
    w.read_unit_range(layout.units[u], off, n, m.data());
    std::span<const float> z = zeros.as<float>().first(n);
    engine.write_unit_state(u, m, z, z);
  }
}

}  // namespace outcore::train
