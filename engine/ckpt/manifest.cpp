// The checkpoint manifest: JSON form, self-checksum, coverage check; CRC32C.
#include <fmt/format.h>
#include <isa-l/crc.h>

#include <algorithm>
#include <map>

#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "engine/ckpt/ckpt.hpp"

namespace outcore::ckpt {
namespace {

constexpr std::string_view kFormatName = "outcore-checkpoint";
constexpr std::string_view kCrcKey = "\"manifest_crc32c\": \"";

std::string hex32(uint32_t v) { return fmt::format("{:08x}", v); }

DType parse_dtype(const std::string& s, const std::string& source) {
  if (s == "fp32") return DType::F32;
  if (s == "bf16") return DType::BF16;
  if (s == "fp16") return DType::F16;
  throw CorruptData(fmt::format("{}: unknown dtype \"{}\"", source, s));
}

ArrayKind parse_array(const std::string& s, const std::string& source) {
  for (ArrayKind a :
       {ArrayKind::kMaster, ArrayKind::kExpAvg, ArrayKind::kExpAvgSq, ArrayKind::kParams}) {
    if (array_name(a) == s) return a;
  }
  throw CorruptData(fmt::format("{}: unknown array \"{}\"", source, s));
}

uint32_t parse_hex32(const std::string& s, const std::string& source, const std::string& key) {
  if (s.size() != 8 || s.find_first_not_of("0123456789abcdef") != std::string::npos)
    throw CorruptData(fmt::format("{}: {}: \"{}\" is not 8 hex digits", source, key, s));
  return static_cast<uint32_t>(std::stoul(s, nullptr, 16));
}

// Reads a key with a clear error for a missing key or a wrong type.
template <typename T>
T get(const nlohmann::json& j, const char* key, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end()) throw CorruptData(fmt::format("{}: missing key \"{}\"", source, key));
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception&) {
    throw CorruptData(
        fmt::format("{}: key \"{}\" has the wrong type ({})", source, key, json_brief(*it)));
  }
}

}  // namespace

uint32_t crc32c(std::span<const std::byte> data, uint32_t crc) {
  // ISA-L's crc32_iscsi neither inverts on entry nor on exit; the standard CRC32C does both.
  uint32_t state = ~crc;
  size_t off = 0;
  while (off < data.size()) {
    const size_t n = std::min<size_t>(data.size() - off, size_t{1} << 30);
    state = crc32_iscsi(reinterpret_cast<unsigned char*>(const_cast<std::byte*>(data.data() + off)),
                        static_cast<int>(n), state);
    off += n;
  }
  return ~state;
}

std::string_view array_name(ArrayKind a) {
  switch (a) {
    case ArrayKind::kMaster:
      return "master";
    case ArrayKind::kExpAvg:
      return "exp_avg";
    case ArrayKind::kExpAvgSq:
      return "exp_avg_sq";
    case ArrayKind::kParams:
      return "params";
  }
  return "?";
}

std::string tag_for_step(int64_t step) { return fmt::format("global_step{}", step); }

const FileInfo* Manifest::find(std::string_view path) const {
  for (const FileInfo& f : files)
    if (f.path == path) return &f;
  return nullptr;
}

nlohmann::ordered_json Manifest::to_json() const {
  nlohmann::ordered_json j;
  j["format"] = kFormatName;
  j["version"] = version;
  j["tag"] = tag;
  j["step"] = step;
  j["world_size"] = world_size;
  j["zero_stage"] = zero_stage;
  j["param_dtype"] = dtype_name(param_dtype);
  auto& units_j = j["units"] = nlohmann::ordered_json::array();
  for (const UnitInfo& u : units)
    units_j.push_back({{"name", u.name}, {"numel", u.numel}, {"padded_numel", u.padded_numel}});
  auto& files_j = j["files"] = nlohmann::ordered_json::array();
  for (const FileInfo& f : files) {
    nlohmann::ordered_json fj{{"path", f.path}, {"bytes", f.bytes}, {"crc32c", hex32(f.crc32c)}};
    if (f.rank >= 0) fj["rank"] = f.rank;
    if (!f.segments.empty()) {
      auto& segs = fj["segments"] = nlohmann::ordered_json::array();
      for (const Segment& s : f.segments)
        segs.push_back({{"unit", s.unit},
                        {"array", array_name(s.array)},
                        {"dtype", dtype_name(s.dtype)},
                        {"slab_begin", s.slab_begin},
                        {"count", s.count},
                        {"offset", s.offset}});
    }
    files_j.push_back(std::move(fj));
  }
  if (!replaces.empty()) j["replaces"] = replaces;
  return j;
}

Manifest Manifest::from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) throw CorruptData(fmt::format("{}: not a JSON object", source));
  if (get<std::string>(j, "format", source) != kFormatName)
    throw CorruptData(fmt::format("{}: not an outcore checkpoint manifest", source));
  Manifest m;
  m.version = get<int>(j, "version", source);
  if (m.version != kFormatVersion)
    throw CorruptData(fmt::format("{}: format version {} (this build reads version {})", source,
                                  m.version, kFormatVersion));
  m.tag = get<std::string>(j, "tag", source);
  m.step = get<int64_t>(j, "step", source);
  m.world_size = get<int>(j, "world_size", source);
  m.zero_stage = get<int>(j, "zero_stage", source);
  m.param_dtype = parse_dtype(get<std::string>(j, "param_dtype", source), source);
  if (m.world_size < 1 || m.step < 0 || m.zero_stage < 0 || m.zero_stage > 3)
    throw CorruptData(fmt::format("{}: world_size {}, step {}, zero_stage {} out of range", source,
                                  m.world_size, m.step, m.zero_stage));
  for (const auto& u : get<nlohmann::json>(j, "units", source)) {
    UnitInfo ui{get<std::string>(u, "name", source), get<uint64_t>(u, "numel", source),
                get<uint64_t>(u, "padded_numel", source)};
    if (ui.padded_numel < ui.numel)
      throw CorruptData(fmt::format("{}: unit {} is padded to {} < numel {}", source, ui.name,
                                    ui.padded_numel, ui.numel));
    m.units.push_back(std::move(ui));
  }
  if (j.contains("replaces")) {
    for (const auto& r : get<nlohmann::json>(j, "replaces", source)) {
      if (!r.is_string() || step_of_tag(r.get<std::string>()) < 0)
        throw CorruptData(fmt::format("{}: replaces: {} is not a checkpoint's name", source,
                                      r.dump(-1, ' ', true)));
      m.replaces.push_back(r.get<std::string>());
    }
  }
  for (const auto& f : get<nlohmann::json>(j, "files", source)) {
    FileInfo fi;
    fi.path = get<std::string>(f, "path", source);
    if (fi.path.empty() || fi.path.front() == '/' || fi.path.find("..") != std::string::npos)
      throw CorruptData(fmt::format("{}: file path \"{}\" leaves the checkpoint", source, fi.path));
    fi.bytes = get<uint64_t>(f, "bytes", source);
    fi.crc32c = parse_hex32(get<std::string>(f, "crc32c", source), source, fi.path);
    fi.rank = f.contains("rank") ? get<int>(f, "rank", source) : -1;
    if (f.contains("segments")) {
      for (const auto& s : get<nlohmann::json>(f, "segments", source)) {
        Segment seg;
        seg.unit = get<int>(s, "unit", source);
        seg.array = parse_array(get<std::string>(s, "array", source), source);
        seg.dtype = parse_dtype(get<std::string>(s, "dtype", source), source);
        seg.slab_begin = get<uint64_t>(s, "slab_begin", source);
        seg.count = get<uint64_t>(s, "count", source);
        seg.offset = get<uint64_t>(s, "offset", source);
        fi.segments.push_back(seg);
      }
    }
    m.files.push_back(std::move(fi));
  }
  return m;
}

void Manifest::check_coverage(const std::string& source) const {
  // (unit, array) -> sorted [begin, end) ranges
  std::map<std::pair<int, int>, std::vector<std::pair<uint64_t, uint64_t>>> ranges;
  for (const FileInfo& f : files) {
    for (const Segment& s : f.segments) {
      if (s.unit < 0 || static_cast<size_t>(s.unit) >= units.size())
        throw CorruptData(
            fmt::format("{}: {} names unit {} of {}", source, f.path, s.unit, units.size()));
      const uint64_t padded = units[s.unit].padded_numel;
      if (s.count > padded || s.slab_begin > padded - s.count)
        throw CorruptData(
            fmt::format("{}: {}: segment [{}, +{}) of unit {} is outside its {} "
                        "elements",
                        source, f.path, s.slab_begin, s.count, s.unit, padded));
      const uint64_t nbytes = s.bytes();
      if (s.offset % 4096 != 0 || s.offset < 4096)
        throw CorruptData(fmt::format(
            "{}: {}: segment at offset {} is {}", source, f.path, s.offset,
            s.offset % 4096 != 0 ? "not 4096-aligned" : "inside the file's 4096-byte header"));
      if (s.offset > f.bytes || nbytes > f.bytes - s.offset)
        throw CorruptData(
            fmt::format("{}: {}: segment at offset {} ({} bytes) is outside the "
                        "file's {} bytes",
                        source, f.path, s.offset, nbytes, f.bytes));
      ranges[{s.unit, static_cast<int>(s.array)}].push_back({s.slab_begin, s.slab_begin + s.count});
    }
    // Two segments sharing bytes of the file would load one array's values as another's.
    std::vector<std::pair<uint64_t, uint64_t>> bytes;
    for (const Segment& s : f.segments) bytes.push_back({s.offset, s.offset + s.bytes()});
    std::sort(bytes.begin(), bytes.end());
    for (size_t i = 1; i < bytes.size(); ++i)
      if (bytes[i].first < bytes[i - 1].second)
        throw CorruptData(fmt::format("{}: {}: segments overlap at byte offset {}", source, f.path,
                                      bytes[i].first));
  }
  for (size_t u = 0; u < units.size(); ++u) {
    for (ArrayKind a :
         {ArrayKind::kMaster, ArrayKind::kExpAvg, ArrayKind::kExpAvgSq, ArrayKind::kParams}) {
      auto& r = ranges[{static_cast<int>(u), static_cast<int>(a)}];
      std::sort(r.begin(), r.end());
      uint64_t covered = 0;
      for (const auto& [b, e] : r) {
        if (b > covered && covered < units[u].numel) break;
        if (b < covered)
          throw CorruptData(fmt::format("{}: unit {} {}: segments overlap at element {}", source,
                                        units[u].name, array_name(a), b));
        covered = e;
      }
      if (covered < units[u].numel)
        throw CorruptData(fmt::format("{}: unit {} {}: elements from {} of {} are in no file",
                                      source, units[u].name, array_name(a), covered,
                                      units[u].numel));
    }
  }
}

std::string manifest_text(const Manifest& m) {
  nlohmann::ordered_json j = m.to_json();
  j["manifest_crc32c"] = "00000000";
  std::string text = j.dump(1) + "\n";
  const size_t pos = text.rfind(kCrcKey);
  const uint32_t crc = crc32c(std::as_bytes(std::span(text.data(), text.size())));
  text.replace(pos + kCrcKey.size(), 8, hex32(crc));
  return text;
}

Manifest parse_manifest(std::string_view text, const std::string& source) {
  const size_t pos = text.rfind(kCrcKey);
  if (pos == std::string_view::npos || pos + kCrcKey.size() + 8 > text.size())
    throw CorruptData(fmt::format("{}: no manifest_crc32c (truncated or not a manifest)", source));
  std::string zeroed(text);
  const std::string stored = zeroed.substr(pos + kCrcKey.size(), 8);
  zeroed.replace(pos + kCrcKey.size(), 8, "00000000");
  const uint32_t actual = crc32c(std::as_bytes(std::span(zeroed.data(), zeroed.size())));
  if (stored != hex32(actual))
    throw CorruptData(
        fmt::format("{}: CRC32C mismatch: expected {}, actual {}", source, stored, hex32(actual)));
  const nlohmann::json j =
      parse_json_file(text, source, {.max_depth = kMaxJsonFileDepth, .on_repeated_key = {}},
                      [](const std::string& why) { throw CorruptData(why); });
  Manifest m = Manifest::from_json(j, source);
  m.check_coverage(source);
  return m;
}

}  // namespace outcore::ckpt
