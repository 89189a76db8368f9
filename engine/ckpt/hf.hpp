// engine/ckpt: Hugging Face Llama weights in and out (a directory of config.json and
// safetensors), in terms of the model's unit slabs (engine/model make_layout).
//
// Import: HfWeights::open checks a directory against the model config, then any rank reads
// any range of any unit's slab, converted to fp32:
//
//   model::LlamaConfig cfg = model::LlamaConfig::load(dir / "config.json");
//   ckpt::HfWeights w = ckpt::HfWeights::open(dir, cfg);
//   w.read_unit_range(layout.units[u], rank * P, P, master);   // this rank's partition
//
// Export: write_hf_model streams the fp32 master weights of every tensor, piece by piece,
// from a callback into config.json and safetensors files (sharded with an index when larger
// than ExportOptions::max_shard_bytes), built in a temporary directory moved into place at the
// end, so a failed export leaves nothing under the final name.
//
// Errors: bad input (no weights in the directory, a missing, misnamed, mis-shaped or unexpected
// tensor, a malformed index or safetensors header, a tensor name twice in a header or in the
// index's weight_map, a NaN or Inf weight, a non-empty export directory) throws CorruptData or
// InvalidArgument naming the tensor and the file. An export refuses master weights that are NaN
// or Inf, or that would round to Inf in the export dtype (|x| >= 65520 for fp16), with
// InvalidArgument naming the tensor, the first such value and their count. I/O failures throw
// IoError naming the file. Memory: reads and writes go through bounded pieces (a few MiB for
// import, ExportOptions::piece_elems for export), never a whole tensor or file.
//
// Threading: HfWeights is immutable after open(); read_unit_range may run on several threads
// at once. write_hf_model calls read_master from the calling thread only, in tensor order.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.hpp"
#include "engine/ckpt/safetensors.hpp"
#include "engine/model/model.hpp"

namespace outcore::ckpt {

// File names Hugging Face uses.
inline constexpr const char* kHfWeightsFile = "model.safetensors";
inline constexpr const char* kHfIndexFile = "model.safetensors.index.json";
inline constexpr const char* kHfConfigFile = "config.json";
// The marker an export's temporary directory (`<out>.tmp-<pid>`) holds while it is written,
// removed just before the rename: a directory of that name without it is not an export's.
inline constexpr const char* kExportScratchMarker = ".outcore-export";

// Whether `dir` is an export's temporary directory: it holds kExportScratchMarker and nothing
// but what an export writes (regular files named config.json, model.safetensors.index.json or
// *.safetensors, or one of those with the ".tmp" suffix of a file still being written).
bool is_export_scratch(const std::filesystem::path& dir);

// The weights of a Hugging Face Llama directory, validated against a model config.
class HfWeights {
 public:
  // Opens `dir`/model.safetensors, or else `dir`/model.safetensors.index.json and the shards its
  // weight_map names. Checks that every tensor of make_layout(expected) is present exactly once
  // with its HF shape and a dtype of F32, BF16 or F16, and that no other tensor is there, except
  // "*.rotary_emb.inv_freq" and, with tie_word_embeddings, "lm_head.weight" (both ignored, as
  // Hugging Face does). Throws InvalidArgument when the directory holds neither file, CorruptData
  // for a malformed index, a shard named in it but absent, a tensor missing from the file the
  // index names, a missing / unexpected / mis-shaped tensor (each naming tensor and file), a
  // tensor named twice in the index's weight_map (naming it and the index), and whatever
  // SafetensorsFile::open throws (for instance for a tensor listed twice in a header). Values
  // are not read here: read_unit_range checks them. ConfigError when `expected` is invalid.
  // `param_dtype` is the dtype the parameters will be stored in: values beyond its range are
  // refused on reading.
  static HfWeights open(const std::filesystem::path& dir, const model::LlamaConfig& expected,
                        DType param_dtype = DType::F32);

  // The model's layout at world size 1 (tensor offsets are the same at every world size).
  const model::ModelLayout& layout() const { return layout_; }
  // The safetensors files opened: the single file, or the shards in name order.
  const std::vector<SafetensorsFile>& files() const { return files_; }
  // The file entry holding model tensor `name`, or nullptr when it is not a model tensor.
  const SafetensorsEntry* entry(std::string_view name) const;
  // The file holding model tensor `name`, or nullptr when it is not a model tensor.
  const SafetensorsFile* file(std::string_view name) const;

  // Writes fp32 values of slab elements [begin, begin + count) of unit `unit` to out[0..count):
  // each tensor at its TensorSpec offset, converted exactly from BF16/F16; alignment gaps and
  // padding are 0. `unit` may come from a layout of any world size of the same model (only the
  // padding differs). CorruptData naming the file, the tensor and the element index (in the
  // tensor) of the first NaN or Inf in the range, or of the first value that rounds to Inf in
  // open()'s param_dtype (out[] then holds partial data); InvalidArgument
  // when the range leaves unit.padded_numel or the unit holds a tensor this model does not have;
  // IoError when a read fails. Peak memory: a 4 MiB buffer.
  void read_unit_range(const model::UnitLayout& unit, uint64_t begin, uint64_t count,
                       float* out) const;

 private:
  HfWeights() = default;

  model::ModelLayout layout_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t, std::less<>> file_of_;  // model tensor -> index in files_
  DType param_dtype_ = DType::F32;
};

struct ExportOptions {
  // Storage dtype of every tensor written (values rounded to nearest even from fp32).
  DType dtype = DType::F32;
  // Tensor bytes per safetensors file. A model larger than this is split into
  // model-0000i-of-0000N.safetensors shards filled greedily in tensor order (a tensor larger
  // than the limit alone in its shard) plus model.safetensors.index.json. Default: HF's 5 GB.
  uint64_t max_shard_bytes = 5'000'000'000;
  // Elements asked of read_master per call: the memory bound of the export (fp32 values plus
  // their converted copy). Must be positive.
  uint64_t piece_elems = uint64_t{1} << 24;
};

// Fills out[0..count) with fp32 master values of elements [begin, begin + count) of unit
// `unit`'s slab (make_layout(cfg) offsets). Errors it throws propagate out of write_hf_model.
using ReadMasterFn = std::function<void(int unit, uint64_t begin, uint64_t count, float* out)>;

// Writes `cfg` and its weights as a Hugging Face Llama directory `out_dir`: config.json
// (cfg.to_hf_json() with "torch_dtype" for options.dtype) and the tensors in HF order (embedding,
// each layer's tensors, final norm, lm_head unless tied) read through `read_master` in pieces
// of at most options.piece_elems elements. Everything is built in a sibling temporary
// directory `<out_dir>.tmp-<pid>` (made by this call, holding kExportScratchMarker until the
// end; one already there is refused unless is_export_scratch), fsynced and renamed to
// `out_dir` at the end; on failure it is removed.
// InvalidArgument when `out_dir` exists and is not an empty directory, or piece_elems is 0, and
// when a tensor's master values hold NaN or Inf (any dtype) or values that round to Inf in
// options.dtype (|x| >= 65520 for F16, past bf16's largest value for BF16): the message names
// the tensor, their count and the first one with its element index, and for overflow the dtypes
// that can hold them (--dtype bf16 or fp32). ConfigError for an invalid cfg; IoError when writing
// fails (ENOSPC...).
void write_hf_model(const model::LlamaConfig& cfg, const ReadMasterFn& read_master,
                    const std::filesystem::path& out_dir, const ExportOptions& options = {});

}  // namespace outcore::ckpt
