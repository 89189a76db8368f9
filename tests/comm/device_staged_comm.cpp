#include "tests/comm/device_staged_comm.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "common/error.hpp"

namespace outcore::comm::testing {
namespace {

void cuda(cudaError_t err, const char* stmt) {
  if (err != cudaSuccess)
    throw Error(fmt::format("DeviceStagedComm: `{}` failed: {}", stmt, cudaGetErrorString(err)));
}
#define STAGED_CUDA(stmt) cuda((stmt), #stmt)

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};

// Device copies of host ranges; ranges that overlap on the host share one device region, at
// the same offsets.
class Mirror {
 public:
  Mirror(const void* a, size_t a_bytes, const void* b = nullptr, size_t b_bytes = 0) {
    add(a, a_bytes);
    add(b, b_bytes);
    for (Region& r : regions_) {
      void* p = nullptr;
      STAGED_CUDA(cudaMalloc(&p, static_cast<size_t>(r.hi - r.lo)));
      r.dev.reset(p);
      STAGED_CUDA(cudaMemcpy(p, r.lo, static_cast<size_t>(r.hi - r.lo), cudaMemcpyHostToDevice));
    }
  }

  // The device address of a host pointer into one of the ranges (nullptr for an empty range).
  template <typename T>
  T* dev(const T* host) const {
    const auto* h = reinterpret_cast<const std::byte*>(host);
    for (const Region& r : regions_)
      if (h >= r.lo && h < r.hi)
        return reinterpret_cast<T*>(static_cast<std::byte*>(r.dev.get()) + (h - r.lo));
    return nullptr;
  }

  template <typename T>
  void download(std::span<T> host) const {
    if (host.empty()) return;
    STAGED_CUDA(
        cudaMemcpy(host.data(), dev(host.data()), host.size_bytes(), cudaMemcpyDeviceToHost));
  }

 private:
  struct Region {
    const std::byte* lo;
    const std::byte* hi;
    std::unique_ptr<void, DeviceFree> dev;
  };

  void add(const void* p, size_t bytes) {
    if (bytes == 0) return;
    const auto* lo = static_cast<const std::byte*>(p);
    for (Region& r : regions_) {
      if (detail::overlaps(lo, bytes, r.lo, static_cast<size_t>(r.hi - r.lo))) {
        r.lo = std::min(r.lo, lo);
        r.hi = std::max(r.hi, lo + bytes);
        return;
      }
    }
    regions_.push_back({lo, lo + bytes, nullptr});
  }

  std::vector<Region> regions_;
};

template <typename T>
std::span<T> on_device(const Mirror& m, std::span<T> host) {
  return {m.dev(host.data()), host.size()};
}

}  // namespace

void DeviceStagedComm::forward(Kind kind, const CommTraffic& before) {
  const CommTraffic after = d_.traffic();
  count(kind, after.total() - before.total());
}

void DeviceStagedComm::all_gather(std::span<const float> send, std::span<float> recv) {
  Mirror m(recv.data(), recv.size_bytes(), send.data(), send.size_bytes());
  const CommTraffic t = d_.traffic();
  d_.all_gather(on_device(m, send), on_device(m, recv));
  forward(Kind::kAllGather, t);
  m.download(recv);
}

void DeviceStagedComm::all_gather_bytes(std::span<const std::byte> send,
                                        std::span<std::byte> recv) {
  Mirror m(recv.data(), recv.size_bytes(), send.data(), send.size_bytes());
  const CommTraffic t = d_.traffic();
  d_.all_gather_bytes(on_device(m, send), on_device(m, recv));
  forward(Kind::kAllGather, t);
  m.download(recv);
}

void DeviceStagedComm::reduce_scatter(std::span<const float> send, std::span<float> recv,
                                      ReduceOp op) {
  Mirror m(send.data(), send.size_bytes(), recv.data(), recv.size_bytes());
  const CommTraffic t = d_.traffic();
  d_.reduce_scatter(on_device(m, send), on_device(m, recv), op);
  forward(Kind::kReduceScatter, t);
  m.download(recv);
}

void DeviceStagedComm::all_reduce(std::span<float> data, ReduceOp op) {
  Mirror m(data.data(), data.size_bytes());
  const CommTraffic t = d_.traffic();
  d_.all_reduce(on_device(m, data), op);
  forward(Kind::kAllReduce, t);
  m.download(data);
}

void DeviceStagedComm::all_reduce(std::span<double> data, ReduceOp op) {
  Mirror m(data.data(), data.size_bytes());
  const CommTraffic t = d_.traffic();
  d_.all_reduce(on_device(m, data), op);
  forward(Kind::kAllReduce, t);
  m.download(data);
}

void DeviceStagedComm::broadcast(std::span<float> data, int root) {
  Mirror m(data.data(), data.size_bytes());
  const CommTraffic t = d_.traffic();
  d_.broadcast(on_device(m, data), root);
  forward(Kind::kBroadcast, t);
  m.download(data);
}

void DeviceStagedComm::broadcast_bytes(std::span<std::byte> data, int root) {
  Mirror m(data.data(), data.size_bytes());
  const CommTraffic t = d_.traffic();
  d_.broadcast_bytes(on_device(m, data), root);
  forward(Kind::kBroadcast, t);
  m.download(data);
}

void DeviceStagedComm::all_to_all(std::span<float> data) {
  Mirror m(data.data(), data.size_bytes());
  const CommTraffic t = d_.traffic();
  d_.all_to_all(on_device(m, data));
  forward(Kind::kAllToAll, t);
  m.download(data);
}

void DeviceStagedComm::barrier() {
  d_.barrier();
  count(Kind::kBarrier, 0);
}

}  // namespace outcore::comm::testing
