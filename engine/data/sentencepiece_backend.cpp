// tokenizer.model (SentencePiece) -> a Backend, run by libsentencepiece.
#include <fmt/format.h>
#include <sentencepiece_processor.h>

#include "common/error.hpp"
#include "common/open_file.hpp"
#include "engine/data/backend.hpp"

namespace outcore::data::detail {
namespace {

// Far above any released model's tokenizer.model (Llama 2's is 0.5 MB, Gemma's 4 MB).
constexpr size_t kMaxModelBytes = size_t{256} << 20;

class SentencePieceBackend final : public Backend {
 public:
  explicit SentencePieceBackend(const std::string& path) {
    // Read here, not by the library: a FIFO, a device or a directory is refused by name, and a
    // file of any size is not read whole into memory.
    const std::string bytes = read_whole_file(path, "SentencePiece model", kMaxModelBytes);
    const auto status = processor_.LoadFromSerializedProto(bytes);
    if (!status.ok())
      throw ConfigError("",
                        fmt::format("{}: not a SentencePiece model: {}", path, status.ToString()));
  }

  void encode_text(std::string_view text, std::vector<uint32_t>& out) const override {
    std::vector<int> ids;
    const auto status = processor_.Encode(text, &ids);
    if (!status.ok())
      throw Error(fmt::format("SentencePiece encode failed: {}", status.ToString()));
    out.insert(out.end(), ids.begin(), ids.end());
  }

  uint64_t vocab_size() const override { return static_cast<uint64_t>(processor_.GetPieceSize()); }

  std::optional<uint32_t> token_id(std::string_view content) const override {
    const int id = processor_.PieceToId(content);
    if (id < 0 || (id == processor_.unk_id() && processor_.IdToPiece(id) != content))
      return std::nullopt;
    return static_cast<uint32_t>(id);
  }

  std::optional<uint32_t> bos() const { return id_or_none(processor_.bos_id()); }
  std::optional<uint32_t> eos() const { return id_or_none(processor_.eos_id()); }
  // The unk, bos and eos pieces (those the model has), as (text, id).
  std::vector<std::pair<std::string, uint32_t>> specials() const {
    std::vector<std::pair<std::string, uint32_t>> out;
    for (const int id : {processor_.unk_id(), processor_.bos_id(), processor_.eos_id()})
      if (id >= 0 && id < processor_.GetPieceSize())
        out.emplace_back(processor_.IdToPiece(id), static_cast<uint32_t>(id));
    return out;
  }

 private:
  static std::optional<uint32_t> id_or_none(int id) {
    if (id < 0) return std::nullopt;
    return static_cast<uint32_t>(id);
  }

  sentencepiece::SentencePieceProcessor processor_;
};

}  // namespace

LoadedBackend load_sentencepiece(const std::string& path) {
  auto backend = std::make_unique<SentencePieceBackend>(path);
  LoadedBackend loaded;
  loaded.bos = backend->bos();
  loaded.eos = backend->eos();
  loaded.own_specials = backend->specials();
  if (loaded.bos) loaded.prefix.push_back(*loaded.bos);
  loaded.description = fmt::format("{} (SentencePiece)", path);
  loaded.backend = std::move(backend);
  return loaded;
}

}  // namespace outcore::data::detail
