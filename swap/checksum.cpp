#include "swap/checksum.hpp"

#include <isa-l/crc.h>

#include <algorithm>

namespace outcore::swap::internal {
namespace {

// A non-zero seed, so that an all-zero block (preallocated, never written) has a non-zero CRC.
constexpr uint32_t kSeed = 0xffffffffu;

void crc_range(std::span<const std::byte> data, size_t block, uint32_t* out, size_t first,
               size_t last) {
  for (size_t i = first; i < last; ++i) {
    size_t begin = i * block;
    size_t len = std::min(block, data.size() - begin);
    // ISA-L takes a non-const pointer but only reads; block sizes fit in int (checked by the
    // Swapper's options).
    out[i] =
        crc32_iscsi(reinterpret_cast<unsigned char*>(const_cast<std::byte*>(data.data() + begin)),
                    static_cast<int>(len), kSeed);
  }
}

}  // namespace

void block_crcs(std::span<const std::byte> data, size_t block, std::span<uint32_t> out,
                const cpu_adam::Executor* ex) {
  const size_t n = out.size();
  if (ex == nullptr || ex->threads() <= 1 || n < 2) {
    crc_range(data, block, out.data(), 0, n);
    return;
  }
  ex->for_chunks(n, 1, 2,
                 [&](size_t, size_t b, size_t e) { crc_range(data, block, out.data(), b, e); });
}

}  // namespace outcore::swap::internal
