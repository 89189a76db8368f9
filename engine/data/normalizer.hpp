// Normalizer: the Unicode normalization forms a tokenizer.json may ask for (NFC, NFD, NFKC,
// NFKD, applied in sequence), computed by utf8proc.
//
// Threading: immutable; apply() may run on many threads at once.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace outcore::data {

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };

class Normalizer {
 public:
  Normalizer() = default;  // the identity
  explicit Normalizer(std::vector<NormalForm> forms) : forms_(std::move(forms)) {}

  bool is_identity() const { return forms_.empty(); }

  // `text` normalized: either `text` itself (nothing to change) or a view of `buffer`, which
  // it overwrites. REQUIRES: well-formed UTF-8. Throws InvalidArgument when utf8proc refuses
  // the text (it cannot, for well-formed input).
  std::string_view apply(std::string_view text, std::string& buffer) const;

 private:
  std::vector<NormalForm> forms_;
};

}  // namespace outcore::data
