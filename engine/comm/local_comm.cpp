#include "engine/comm/local_comm.hpp"

#include <cstring>

namespace outcore::comm {
namespace {

// Copies n bytes unless source and destination are the same place (the in-place case).
void copy_bytes(void* dst, const void* src, size_t n) {
  if (dst != src && n != 0) std::memcpy(dst, src, n);
}

}  // namespace

void LocalComm::all_gather(std::span<const float> send, std::span<float> recv) {
  detail::check_gather("all_gather", send.data(), send.size_bytes(), recv.data(), recv.size_bytes(),
                       0, 1);
  copy_bytes(recv.data(), send.data(), send.size_bytes());
}

void LocalComm::all_gather_bytes(std::span<const std::byte> send, std::span<std::byte> recv) {
  detail::check_gather("all_gather_bytes", send.data(), send.size_bytes(), recv.data(),
                       recv.size_bytes(), 0, 1);
  copy_bytes(recv.data(), send.data(), send.size_bytes());
}

void LocalComm::reduce_scatter(std::span<const float> send, std::span<float> recv, ReduceOp) {
  detail::check_scatter("reduce_scatter", send.data(), send.size_bytes(), recv.data(),
                        recv.size_bytes(), 0, 1);
  copy_bytes(recv.data(), send.data(), recv.size_bytes());
}

void LocalComm::all_reduce(std::span<float>, ReduceOp) {}
void LocalComm::all_reduce(std::span<double>, ReduceOp) {}

void LocalComm::all_to_all(std::span<float> data) {
  detail::check_blocks("all_to_all", data.size(), 1);
}

void LocalComm::broadcast(std::span<float>, int root) { detail::check_root("broadcast", root, 1); }

void LocalComm::broadcast_bytes(std::span<std::byte>, int root) {
  detail::check_root("broadcast_bytes", root, 1);
}

}  // namespace outcore::comm
