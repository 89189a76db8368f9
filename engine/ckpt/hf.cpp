// Hugging Face Llama directories: import checks and ranged slab reads, streaming export.
#include "engine/ckpt/hf.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/cleanup.hpp"
#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "common/open_file.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/file_util.hpp"

namespace outcore::ckpt {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Elements read, converted and checked per chunk on import (4 MiB of BF16/F16 source bytes).
constexpr uint64_t kImportChunkElems = uint64_t{1} << 21;

// Bit patterns of |x| (the sign bit cleared) of fp32 values: from kInfBits up they are Inf or
// NaN; from kF16OverflowBits (65520) or kBf16OverflowBits (the halfway point past bf16's largest
// value) up, rounding to nearest even gives Inf in that dtype.
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kF16OverflowBits = 0x477ff000u;
constexpr uint32_t kBf16OverflowBits = 0x7f7f8000u;

// Index of the first of v[0..n) whose magnitude bits are at least `limit_bits`, or n. One
// branch-free, vectorizable max over the values; the search runs only when one is found.
uint64_t first_at_or_above(const float* v, uint64_t n, uint32_t limit_bits) {
  uint32_t largest = 0;
  for (uint64_t i = 0; i < n; ++i)
    largest = std::max(largest, std::bit_cast<uint32_t>(v[i]) & 0x7fffffffu);
  if (largest < limit_bits) return n;
  uint64_t i = 0;
  while ((std::bit_cast<uint32_t>(v[i]) & 0x7fffffffu) < limit_bits) ++i;
  return i;
}

// Tensors Hugging Face itself skips when loading a Llama checkpoint.
bool ignored_tensor(std::string_view name, bool tied) {
  return name.ends_with(".rotary_emb.inv_freq") || (tied && name == "lm_head.weight");
}

// Whether `p` exists; an error while looking (EACCES...) counts as absent, and the open that
// follows reports it.
bool present(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

// Creates `dir` and its parents. InvalidArgument when a part of the path is a file (or a link
// to nowhere), IoError naming it on other failures.
void make_directories(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec == std::errc::not_a_directory || ec == std::errc::file_exists)
    throw InvalidArgument(
        fmt::format("{}: cannot be created: {} (a part of its path is a file "
                    "or a link to nowhere)",
                    dir.string(), ec.message()));
  if (ec) throw IoError(dir.string(), ec.value(), "mkdir");
}

std::string read_text(const fs::path& path) {
  return read_whole_file(path.string(), "safetensors index", size_t{256} << 20);
}

// The index's weight_map: tensor name -> shard file name (a plain name inside the directory).
std::map<std::string, std::string> parse_index(const fs::path& index) {
  const std::string p = index.string();
  const json j = parse_json_unique_keys(read_text(index), p);
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw CorruptData(p + ": no \"weight_map\" object");
  std::map<std::string, std::string> map;
  for (const auto& [name, file] : j["weight_map"].items()) {
    const bool plain = file.is_string() && !file.get_ref<const std::string&>().empty() &&
                       fs::path(file.get<std::string>()).filename() == file.get<std::string>() &&
                       file != "." && file != ".." &&
                       file.get_ref<const std::string&>().find('\0') == std::string::npos;
    if (!plain)
      throw CorruptData(
          fmt::format("{}: tensor \"{}\" maps to {}, not a file name in the directory", p, name,
                      json_brief(file)));
    map[name] = file.get<std::string>();
  }
  return map;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Import

namespace {

// Every tensor found in a directory: name -> index of its file, and the file to name when a
// model tensor is missing (the single file or the index).
struct Located {
  std::map<std::string, size_t> file_of{};
  std::string listing;
};

Located locate_single(const fs::path& file, std::vector<SafetensorsFile>& files) {
  files.push_back(SafetensorsFile::open(file));
  Located l{.listing = files.back().path()};
  for (const SafetensorsEntry& e : files.back().tensors()) l.file_of[e.name] = 0;
  return l;
}

// Opens every shard the index names and checks the index against their contents.
Located locate_sharded(const fs::path& dir, std::vector<SafetensorsFile>& files, bool tied) {
  const fs::path index = dir / kHfIndexFile;
  const std::map<std::string, std::string> map = parse_index(index);
  std::map<std::string, size_t> shard_index;  // file name -> position in files
  for (const auto& [name, file] : map) {
    if (shard_index.contains(file)) continue;
    std::error_code ec;  // a link to nowhere (or a loop) is there: its open names the error
    if (!present(dir / file) && !fs::is_symlink(dir / file, ec))
      throw CorruptData(fmt::format("{}: tensor \"{}\" is in shard {}, which is missing",
                                    index.string(), name, (dir / file).string()));
    shard_index[file] = 0;
  }
  for (auto& [file, i] : shard_index) {
    i = files.size();
    files.push_back(SafetensorsFile::open(dir / file));
  }
  Located l{.listing = index.string()};
  for (const auto& [name, file] : map) {
    const size_t i = shard_index.at(file);
    if (files[i].find(name) == nullptr)
      throw CorruptData(fmt::format("{}: tensor \"{}\" is mapped to {}, which does not hold it",
                                    index.string(), name, files[i].path()));
    l.file_of[name] = i;
  }
  for (const auto& [file, i] : shard_index) {
    for (const SafetensorsEntry& e : files[i].tensors()) {
      const auto it = map.find(e.name);
      if (it == map.end() && ignored_tensor(e.name, tied)) continue;
      if (it == map.end() || it->second != file)
        throw CorruptData(fmt::format("{}: holds tensor \"{}\", which {} maps to {}",
                                      files[i].path(), e.name, index.string(),
                                      it == map.end() ? "no shard" : it->second));
    }
  }
  return l;
}

}  // namespace

HfWeights HfWeights::open(const fs::path& dir, const model::LlamaConfig& expected,
                          DType param_dtype) {
  HfWeights w;
  w.param_dtype_ = param_dtype;
  w.layout_ = model::make_layout(expected, 1);
  Located found;
  // A link to nowhere (or a loop) at either name is taken as there: its open names the error.
  const auto named = [](const fs::path& p) {
    std::error_code ec;
    return fs::exists(fs::symlink_status(p, ec));
  };
  if (named(dir / kHfWeightsFile)) {
    found = locate_single(dir / kHfWeightsFile, w.files_);
  } else if (named(dir / kHfIndexFile)) {
    found = locate_sharded(dir, w.files_, w.layout_.tied);
  } else {
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
      throw InvalidArgument(fmt::format(
          "{}: {}", dir.string(), fs::exists(dir, ec) ? "not a directory" : "no such directory"));
    // An outcore checkpoint, or a save directory, is continued with --resume (or exported).
    // A save directory whose first save was not yet named `latest` holds only checkpoints.
    const bool ours = checkpoint_holding(dir) || present(dir / std::string(kLatestName)) ||
                      !checkpoints_in(dir).empty();
    throw InvalidArgument(fmt::format(
        "{}: holds neither {} nor {} (weights must be safetensors){}", dir.string(), kHfWeightsFile,
        kHfIndexFile,
        ours ? "; it is an outcore checkpoint: continue its run with --resume, or start a new one "
               "from `outcore export` of it"
             : ""));
  }
  for (const model::UnitLayout& u : w.layout_.units) {
    for (const model::TensorSpec& t : u.tensors) {
      const auto it = found.file_of.find(t.name);
      if (it == found.file_of.end())
        throw CorruptData(fmt::format("{}: tensor \"{}\" (shape {}) is missing", found.listing,
                                      t.name, format_shape(t.shape)));
      const SafetensorsFile& f = w.files_[it->second];
      const SafetensorsEntry& e = *f.find(t.name);
      if (e.shape != t.shape)
        throw CorruptData(fmt::format("{}: tensor \"{}\" has shape {}; the model config needs {}",
                                      f.path(), t.name, format_shape(e.shape),
                                      format_shape(t.shape)));
      w.file_of_.emplace(t.name, it->second);
      found.file_of.erase(it);
    }
  }
  for (const auto& [name, i] : found.file_of) {
    if (ignored_tensor(name, w.layout_.tied)) continue;
    throw CorruptData(fmt::format("{}: unexpected tensor \"{}\" (not part of this Llama config)",
                                  w.files_[i].path(), name));
  }
  return w;
}

const SafetensorsFile* HfWeights::file(std::string_view name) const {
  const auto it = file_of_.find(name);
  return it == file_of_.end() ? nullptr : &files_[it->second];
}

const SafetensorsEntry* HfWeights::entry(std::string_view name) const {
  const SafetensorsFile* f = file(name);
  return f == nullptr ? nullptr : f->find(name);
}

namespace {

// Magnitude bits from which an fp32 value cannot be stored as `dtype` (it is NaN or Inf, or
// rounds to Inf).
uint32_t limit_bits(DType dtype) {
  return dtype == DType::F16    ? kF16OverflowBits
         : dtype == DType::BF16 ? kBf16OverflowBits
                                : kInfBits;
}

// Refuses a NaN or Inf among v[0..n), elements [first, first + n) of tensor `e` of `f`, or a
// value that rounds to Inf in `dtype`, the parameters' dtype.
void check_finite(const SafetensorsFile& f, const SafetensorsEntry& e, uint64_t first,
                  const float* v, uint64_t n, DType dtype) {
  const uint64_t i = first_at_or_above(v, n, limit_bits(dtype));
  if (i == n) return;
  if (!std::isfinite(v[i]))
    throw CorruptData(
        fmt::format("{}: tensor \"{}\" holds {} at element {} (flat index); weights must be finite",
                    f.path(), e.name, v[i], first + i));
  throw CorruptData(fmt::format(
      "{}: tensor \"{}\" holds {} at element {} (flat index), beyond the range of {}, the "
      "dtype the parameters are stored in (fp32 keeps it)",
      f.path(), e.name, v[i], first + i, dtype_name(dtype)));
}

// Elements [first, first + n) of tensor `e` as fp32 into out, each chunk checked for NaN, Inf
// and values beyond `dtype` while it is still in cache.
void read_elements(const SafetensorsFile& f, const SafetensorsEntry& e, uint64_t first, uint64_t n,
                   float* out, std::vector<uint16_t>& buf, DType dtype) {
  if (e.dtype != DType::F32) buf.resize(std::min(n, kImportChunkElems));
  const SafetensorsFile::Reader reader(f);  // one open for the range's chunks
  for (uint64_t done = 0; done < n;) {
    const uint64_t k = std::min(n - done, kImportChunkElems);
    if (e.dtype == DType::F32) {
      reader.read(e, (first + done) * 4, k * 4, out + done);
    } else {
      reader.read(e, (first + done) * 2, k * 2, buf.data());
      model::convert_to_fp32(buf.data(), e.dtype, out + done, k);
    }
    check_finite(f, e, first + done, out + done, k, dtype);
    done += k;
  }
}

}  // namespace

void HfWeights::read_unit_range(const model::UnitLayout& unit, uint64_t begin, uint64_t count,
                                float* out) const {
  if (begin > unit.padded_numel || count > unit.padded_numel - begin)
    throw InvalidArgument(fmt::format("read of elements [{}, +{}) outside unit {} of {}", begin,
                                      count, unit.name, unit.padded_numel));
  std::fill(out, out + count, 0.0f);
  std::vector<uint16_t> buf;
  const uint64_t end = begin + count;
  for (const model::TensorSpec& t : unit.tensors) {
    const uint64_t lo = std::max<uint64_t>(begin, t.offset);
    const uint64_t hi = std::min<uint64_t>(end, t.offset + t.numel);
    if (lo >= hi) continue;
    const SafetensorsEntry* e = entry(t.name);
    if (e == nullptr || e->numel() != t.numel)
      throw InvalidArgument(fmt::format("unit {}: tensor \"{}\" {} is not a tensor of this model",
                                        unit.name, t.name, format_shape(t.shape)));
    read_elements(*file(t.name), *e, lo - t.offset, hi - lo, out + (lo - begin), buf, param_dtype_);
  }
}

// ---------------------------------------------------------------------------------------------
// Export

namespace {

struct ExportTensor {
  int unit = 0;
  const model::TensorSpec* spec = nullptr;
};

// Position of a decoder tensor in Hugging Face's state_dict (module registration order:
// self_attn q k v o, mlp gate up down, then the two norms).
int hf_rank(const std::string& name) {
  static const char* const kOrder[] = {
      "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
      "self_attn.o_proj.weight", "mlp.gate_proj.weight",    "mlp.up_proj.weight",
      "mlp.down_proj.weight",    "input_layernorm.weight",  "post_attention_layernorm.weight"};
  for (int i = 0; i < 9; ++i)
    if (name.ends_with(kOrder[i])) return i;
  return 9;
}

std::vector<ExportTensor> hf_order(const model::ModelLayout& layout) {
  std::vector<ExportTensor> order;
  for (const model::UnitLayout& u : layout.units) {
    const size_t first = order.size();
    for (const model::TensorSpec& t : u.tensors) order.push_back({u.index, &t});
    if (u.kind != model::UnitKind::Decoder) continue;
    std::stable_sort(order.begin() + first, order.end(), [](const auto& a, const auto& b) {
      return hf_rank(a.spec->name) < hf_rank(b.spec->name);
    });
  }
  return order;
}

// Shards as [first, last) ranges of `order`: greedy, a new shard when the next tensor would
// pass the limit (a tensor larger than the limit ends up alone).
std::vector<std::pair<size_t, size_t>> plan_shards(const std::vector<ExportTensor>& order,
                                                   DType dtype, uint64_t max_bytes) {
  std::vector<std::pair<size_t, size_t>> shards;
  uint64_t bytes = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const uint64_t b = order[i].spec->numel * dtype_size(dtype);
    if (shards.empty() || (bytes > 0 && bytes + b > max_bytes)) {
      shards.push_back({i, i});
      bytes = 0;
    }
    shards.back().second = i + 1;
    bytes += b;
  }
  return shards;
}

std::string shard_name(size_t i, size_t n) {
  return n == 1 ? std::string(kHfWeightsFile)
                : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
}

const char* torch_dtype(DType t) {
  return t == DType::F32 ? "float32" : t == DType::BF16 ? "bfloat16" : "float16";
}

std::string config_json(const model::LlamaConfig& cfg, DType dtype) {
  json j = json::parse(cfg.to_hf_json());
  j["torch_dtype"] = torch_dtype(dtype);
  if (!j.contains("architectures")) j["architectures"] = {"LlamaForCausalLM"};
  if (!j.contains("model_type")) j["model_type"] = "llama";
  return j.dump(2) + "\n";
}

// Elements of a piece checked and converted together, so each block is converted while the
// check has it in cache.
constexpr uint64_t kExportBlockElems = uint64_t{1} << 14;

// The values of one tensor an export refuses: NaN or Inf, or finite values that round to Inf in
// the export dtype; how many, and the first of each kind (element index in the tensor).
struct BadValues {
  uint64_t nonfinite = 0, overflow = 0;
  uint64_t first_nonfinite = 0, first_overflow = 0;
  float nonfinite_value = 0, overflow_value = 0;

  bool empty() const { return nonfinite == 0 && overflow == 0; }
  // Counts those of v[0..n), elements [first, first + n) of the tensor.
  void add(const float* v, uint64_t n, uint64_t first, uint32_t limit_bits) {
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t bits = std::bit_cast<uint32_t>(v[i]) & 0x7fffffffu;
      if (bits >= kInfBits) {
        if (nonfinite++ == 0) first_nonfinite = first + i, nonfinite_value = v[i];
      } else if (bits >= limit_bits) {
        if (overflow++ == 0) first_overflow = first + i, overflow_value = v[i];
      }
    }
  }
};

// The error for tensor `name` holding `bad` (not empty) when exported as `dtype`.
InvalidArgument bad_values_error(const std::string& name, const BadValues& bad, DType dtype) {
  if (bad.nonfinite > 0)
    return InvalidArgument(fmt::format(
        "export: tensor \"{}\" holds {} NaN or Inf value(s) in the master weights (the first, {}, "
        "at element {}); they cannot be exported in any dtype: export an earlier checkpoint",
        name, bad.nonfinite, bad.nonfinite_value, bad.first_nonfinite));
  const bool f16 = dtype == DType::F16;
  return InvalidArgument(fmt::format(
      "export: tensor \"{}\" holds {} value(s) beyond the range of {} (the first, {}, at element "
      "{}; {} holds magnitudes up to {}), which would become Inf; export as {} instead "
      "(--dtype {})",
      name, bad.overflow, dtype_name(dtype), bad.overflow_value, bad.first_overflow,
      dtype_name(dtype), f16 ? fp16_to_fp32(0x7bff) : bf16_to_fp32(0x7f7f),
      f16 ? "bf16 or fp32" : "fp32", f16 ? "bf16 or --dtype fp32" : "fp32"));
}

// Streams one tensor from read_master into `w`, piece by piece, each block of a piece checked
// (limit_bits) then converted. Values that cannot be exported throw InvalidArgument after
// the rest of the tensor has been read to count them; nothing of the tensor is written after the
// first.
void write_tensor(const ReadMasterFn& read_master, const ExportTensor& t, const ExportOptions& o,
                  std::vector<float>& vals, std::vector<uint16_t>& low, SafetensorsWriter& w) {
  const uint64_t n = t.spec->numel;
  const uint32_t limit = limit_bits(o.dtype);
  BadValues bad;
  for (uint64_t done = 0; done < n;) {
    const uint64_t k = std::min(n - done, o.piece_elems);
    read_master(t.unit, t.spec->offset + done, k, vals.data());
    for (uint64_t b = 0; b < k; b += kExportBlockElems) {
      const uint64_t m = std::min(k - b, kExportBlockElems);
      if (first_at_or_above(vals.data() + b, m, limit) < m)
        bad.add(vals.data() + b, m, done + b, limit);
      if (bad.empty() && o.dtype != DType::F32)
        model::convert_from_fp32(vals.data() + b, low.data() + b, o.dtype, m);
    }
    if (bad.empty())
      w.append(o.dtype == DType::F32 ? std::as_bytes(std::span(vals.data(), k))
                                     : std::as_bytes(std::span(low.data(), k)));
    done += k;
  }
  if (!bad.empty()) throw bad_values_error(t.spec->name, bad, o.dtype);
}

// Writes shards, index and config.json into `dir`.
void write_model_files(const model::LlamaConfig& cfg, const model::ModelLayout& layout,
                       const ReadMasterFn& read_master, const fs::path& dir,
                       const ExportOptions& o) {
  const std::vector<ExportTensor> order = hf_order(layout);
  const auto shards = plan_shards(order, o.dtype, o.max_shard_bytes);
  uint64_t largest = 0, total = 0;
  for (const ExportTensor& t : order) {
    largest = std::max<uint64_t>(largest, t.spec->numel);
    total += t.spec->numel * dtype_size(o.dtype);
  }
  std::vector<float> vals(std::min(largest, o.piece_elems));
  std::vector<uint16_t> low(o.dtype == DType::F32 ? 0 : vals.size());
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name = shard_name(s, shards.size());
    std::vector<SafetensorsTensor> decls;
    for (size_t i = shards[s].first; i < shards[s].second; ++i) {
      decls.push_back({order[i].spec->name, o.dtype, order[i].spec->shape});
      weight_map[order[i].spec->name] = name;
    }
    SafetensorsWriter w(dir / name, std::move(decls), {{"format", "pt"}});
    for (size_t i = shards[s].first; i < shards[s].second; ++i)
      write_tensor(read_master, order[i], o, vals, low, w);
    w.close();
  }
  if (shards.size() > 1) {
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_durably(dir / kHfIndexFile, index.dump(2) + "\n");
  }
  write_file_durably(dir / kHfConfigFile, config_json(cfg, o.dtype));
}

// Refuses an existing `out` unless it is an empty directory.
void check_export_target(const fs::path& out) {
  std::error_code ec;
  // The export is renamed onto `out` at the end: a link there would fail that rename (or be
  // replaced), after all the writing.
  if (fs::is_symlink(fs::symlink_status(out, ec)))
    throw InvalidArgument(
        fmt::format("{}: is a symbolic link; export to the directory it names, or to a new path",
                    out.string()));
  const fs::file_status st = fs::status(out, ec);
  if (!fs::exists(st)) return;
  if (!fs::is_directory(st))
    throw InvalidArgument(fmt::format("{}: exists and is not a directory", out.string()));
  const bool empty = fs::is_empty(out, ec);
  if (ec) throw IoError(out.string(), ec.value(), "list directory");
  if (!empty)
    throw InvalidArgument(fmt::format(
        "{}: directory is not empty; export into a new or empty directory", out.string()));
  // The finished export is renamed onto `out`, which a mount point refuses (EBUSY): said now,
  // not after the whole model is written.
  struct statx sx {};
  bool mount_root = false;
  if (::statx(AT_FDCWD, out.c_str(), 0, STATX_BASIC_STATS, &sx) == 0 &&
      (sx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) != 0)
    mount_root = (sx.stx_attributes & STATX_ATTR_MOUNT_ROOT) != 0;
  struct stat self {
  }, parent{};
  if (::stat(out.c_str(), &self) == 0 && ::stat(out.parent_path().c_str(), &parent) == 0 &&
      self.st_dev != parent.st_dev)
    mount_root = true;
  if (mount_root)
    throw InvalidArgument(fmt::format(
        "{}: is a mount point, which the finished export cannot be renamed onto; export into a "
        "new directory inside it (such as {})",
        out.string(), (out / "model").string()));
}

// An export's temporary directory: made by this process (one left at its name by a killed
// export of the same pid, is_export_scratch, is removed first; anything else there is
// refused), holding the marker, and removed with its contents on destruction unless release()
// was called.
class ScratchDir {
 public:
  explicit ScratchDir(fs::path p) : path_(std::move(p)) {
    std::error_code ec;
    const fs::file_type type = fs::symlink_status(path_, ec).type();
    if (ec && ec != std::errc::no_such_file_or_directory)  // a name too long, a parent unreadable
      throw IoError(path_.string(), ec.value(), "stat export directory");
    if (type != fs::file_type::not_found) {
      if (!fs::is_directory(fs::symlink_status(path_, ec)) || !is_export_scratch(path_))
        throw InvalidArgument(fmt::format(
            "{}: exists and is not an export's temporary directory (an export writes there): "
            "move it away",
            path_.string()));
      fs::remove_all(path_, ec);
    }
    if (!fs::create_directory(path_, ec) || ec) {
      if (ec == std::errc::not_a_directory || ec == std::errc::no_such_file_or_directory)
        throw InvalidArgument(fmt::format("{}: cannot be created: {} is not a directory",
                                          path_.string(), path_.parent_path().string()));
      throw IoError(path_.string(), ec ? ec.value() : EEXIST, "create export directory");
    }
    // A process ended at once (a second Ctrl-C) takes it too, not only the next export.
    cleanup::register_tree(path_.string());
    try {
      write_file_durably(path_ / kExportScratchMarker, "outcore export in progress\n");
    } catch (...) {  // a full disk: the directory just made goes too
      cleanup::unregister_path(path_.string());
      fs::remove(path_, ec);
      throw;
    }
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!released_) {
      fs::remove_all(path_, ec);
      cleanup::unregister_path(path_.string());
    }
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const fs::path& path() const { return path_; }
  // Before its rename into place: from then on its name is no longer the export's. False when
  // a removal of the registered files (the process ending at once) has taken it.
  bool release() {
    released_ = true;
    return cleanup::unregister_path(path_.string());
  }

 private:
  fs::path path_;
  bool released_ = false;
};

}  // namespace

bool is_export_scratch(const fs::path& dir) {
  std::error_code ec;
  if (fs::symlink_status(dir / kExportScratchMarker, ec).type() != fs::file_type::regular)
    return false;
  for (fs::directory_iterator it(dir, ec), end; it != end; it.increment(ec)) {
    if (ec) return false;
    std::string name = it->path().filename().string();
    if (name == kExportScratchMarker) continue;
    if (name.ends_with(".tmp")) name.resize(name.size() - 4);
    const bool known = name == kHfConfigFile || name == kHfIndexFile ||
                       (name.ends_with(".safetensors") && name != ".safetensors");
    if (!known || !it->is_regular_file(ec) || it->is_symlink(ec)) return false;
  }
  return !ec;
}

void write_hf_model(const model::LlamaConfig& cfg, const ReadMasterFn& read_master,
                    const fs::path& out_dir, const ExportOptions& options) {
  if (options.piece_elems == 0) throw InvalidArgument("export: piece_elems must be positive");
  const model::ModelLayout layout = model::make_layout(cfg, 1);
  fs::path out = fs::absolute(out_dir).lexically_normal();
  if (!out.has_filename()) out = out.parent_path();
  check_export_target(out);
  make_directories(out.parent_path());
  ScratchDir tmp(out.parent_path() / fmt::format("{}.tmp-{}", out.filename().string(), ::getpid()));
  write_model_files(cfg, layout, read_master, tmp.path(), options);
  // An empty directory it replaces keeps its mode, and its owner where this process may give
  // it (root); not its ACLs or other extended attributes.
  if (struct stat was{}; ::stat(out.c_str(), &was) == 0) {
    if (::chmod(tmp.path().c_str(), was.st_mode & 07777) != 0)
      throw IoError(tmp.path().string(), errno, "chmod to the mode of " + out.string());
    struct stat made {};
    if (::geteuid() == 0 && ::stat(tmp.path().c_str(), &made) == 0 &&
        (made.st_uid != was.st_uid || made.st_gid != was.st_gid) &&
        ::chown(tmp.path().c_str(), was.st_uid, was.st_gid) != 0)
      throw IoError(tmp.path().string(), errno, "chown to the owner of " + out.string());
  }
  fsync_directory(tmp.path());
  // The marker goes right before the rename (adjacent system calls): only a kill between the
  // two leaves a whole export without it under the temporary name. Its removal is made durable
  // with the directory's new name.
  std::error_code marker_ec;
  fs::remove(tmp.path() / kExportScratchMarker, marker_ec);
  if (marker_ec) throw IoError(tmp.path().string(), marker_ec.value(), "remove export marker");
  const fs::path scratch = tmp.path();
  if (!tmp.release()) throw Interrupted("export: not put in place, the process is ending");
  std::error_code ec;
  fs::rename(scratch, out, ec);  // replaces an empty directory
  if (ec) {
    std::error_code ignored;
    fs::remove_all(scratch, ignored);
    throw IoError(out.string(), ec.value(), "rename from " + scratch.string());
  }
  fsync_directory(out);
  fsync_directory(out.parent_path());
}

}  // namespace outcore::ckpt
