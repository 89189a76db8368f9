// Internal: CRC32C (ISA-L crc32_iscsi) of consecutive fixed-size blocks, optionally spread over
// a cpu_adam::Executor's threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "cpu_adam/cpu_adam.hpp"

namespace outcore::swap::internal {

// CRC32C of data[i*block, min((i+1)*block, size)) into out[i], for every block. REQUIRES
// out.size() == ceil(data.size() / block), block > 0. ex: null = calling thread.
void block_crcs(std::span<const std::byte> data, size_t block, std::span<uint32_t> out,
                const cpu_adam::Executor* ex);

constexpr size_t block_count(uint64_t bytes, size_t block) { return (bytes + block - 1) / block; }

}  // namespace outcore::swap::internal
