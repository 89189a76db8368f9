#include "tests/comm/collective_checks.hpp"

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>

#include "common/error.hpp"

namespace outcore::comm::testing {
namespace {

class Checker {
 public:
  explicit Checker(Comm& comm) : c_(comm), r_(comm.rank()), w_(comm.world_size()) {}

  void expect_eq(double got, double want, std::string_view what, size_t i) {
    if (got != want)
      failures_.push_back(fmt::format("rank {}: {}[{}] = {}, want {}", r_, what, i, got, want));
  }

  void all_gather(size_t shard) {
    std::vector<float> send(shard), recv(shard * w_, -1.f);
    for (size_t i = 0; i < shard; ++i) send[i] = static_cast<float>(r_ * 100 + i);
    c_.all_gather(send, recv);
    for (int q = 0; q < w_; ++q)
      for (size_t i = 0; i < shard; ++i)
        expect_eq(recv[q * shard + i], q * 100 + i, "all_gather", q * shard + i);
    // In place: this rank's shard already sits in the full buffer.
    std::vector<float> full(shard * w_, -1.f);
    for (size_t i = 0; i < shard; ++i) full[r_ * shard + i] = static_cast<float>(r_ * 7 + i);
    c_.all_gather(std::span<const float>(full.data() + r_ * shard, shard), full);
    for (int q = 0; q < w_; ++q)
      for (size_t i = 0; i < shard; ++i)
        expect_eq(full[q * shard + i], q * 7 + i, "all_gather in place", q * shard + i);
  }

  void all_gather_bytes(size_t shard) {
    std::vector<std::byte> send(shard), recv(shard * w_, std::byte{0xff});
    for (size_t i = 0; i < shard; ++i) send[i] = static_cast<std::byte>((r_ * 31 + i) & 0xff);
    c_.all_gather_bytes(send, recv);
    for (int q = 0; q < w_; ++q)
      for (size_t i = 0; i < shard; ++i)
        expect_eq(static_cast<int>(recv[q * shard + i]), (q * 31 + i) & 0xff, "all_gather_bytes",
                  q * shard + i);
  }

  // send[j] on rank q is (q+1)*(j+1): the sum over ranks of element j is (j+1)*w(w+1)/2 and
  // the max is (j+1)*w.
  void reduce_scatter(size_t shard) {
    std::vector<float> send(shard * w_), recv(shard, -1.f);
    for (size_t j = 0; j < send.size(); ++j) send[j] = static_cast<float>((r_ + 1) * (j + 1));
    c_.reduce_scatter(send, recv, ReduceOp::kSum);
    for (size_t i = 0; i < shard; ++i) {
      size_t j = r_ * shard + i;
      expect_eq(recv[i], double(j + 1) * w_ * (w_ + 1) / 2, "reduce_scatter sum", i);
    }
    c_.reduce_scatter(send, recv, ReduceOp::kMax);
    for (size_t i = 0; i < shard; ++i)
      expect_eq(recv[i], double(r_ * shard + i + 1) * w_, "reduce_scatter max", i);
    // In place: the result replaces this rank's shard of the send buffer.
    std::span<float> own(send.data() + r_ * shard, shard);
    c_.reduce_scatter(send, own, ReduceOp::kSum);
    for (size_t i = 0; i < shard; ++i) {
      size_t j = r_ * shard + i;
      expect_eq(own[i], double(j + 1) * w_ * (w_ + 1) / 2, "reduce_scatter in place", i);
    }
  }

  void all_reduce(size_t n) {
    std::vector<float> f(n);
    std::vector<double> d(n);
    for (size_t i = 0; i < n; ++i) {
      f[i] = static_cast<float>((r_ + 1) * (i + 1));
      d[i] = 0.5 * (r_ + 1) * (i + 1);
    }
    c_.all_reduce(std::span<float>(f), ReduceOp::kSum);
    c_.all_reduce(std::span<double>(d), ReduceOp::kMax);
    for (size_t i = 0; i < n; ++i) {
      expect_eq(f[i], double(i + 1) * w_ * (w_ + 1) / 2, "all_reduce sum", i);
      expect_eq(d[i], 0.5 * w_ * (i + 1), "all_reduce max", i);
    }
  }

  void broadcast(size_t n) {
    int root = w_ - 1;
    std::vector<float> f(n);
    std::vector<std::byte> b(n);
    for (size_t i = 0; i < n; ++i) {
      f[i] = static_cast<float>(r_ * 1000 + i);
      b[i] = static_cast<std::byte>((r_ * 13 + i) & 0xff);
    }
    c_.broadcast(f, root);
    c_.broadcast_bytes(b, root);
    for (size_t i = 0; i < n; ++i) {
      expect_eq(f[i], root * 1000 + i, "broadcast", i);
      expect_eq(static_cast<int>(b[i]), (root * 13 + i) & 0xff, "broadcast_bytes", i);
    }
  }

  // Block q of rank p's buffer holds p*10000 + q*100 + i; afterwards block q of rank p holds
  // what rank q sent to p: q*10000 + p*100 + i.
  void all_to_all(size_t block) {
    std::vector<float> data(block * w_);
    for (int q = 0; q < w_; ++q)
      for (size_t i = 0; i < block; ++i)
        data[q * block + i] = static_cast<float>(r_ * 10000 + q * 100 + i);
    c_.all_to_all(data);
    for (int q = 0; q < w_; ++q)
      for (size_t i = 0; i < block; ++i)
        expect_eq(data[q * block + i], q * 10000 + r_ * 100 + i, "all_to_all", q * block + i);
  }

  // The traffic counters grow by exactly the documented volumes.
  void traffic(size_t n) {
    const uint64_t others = static_cast<uint64_t>(w_ - 1);
    const CommTraffic t0 = c_.traffic();
    std::vector<float> shard(n), full(n * w_);
    c_.all_gather(shard, full);
    c_.reduce_scatter(full, shard, ReduceOp::kSum);
    c_.all_to_all(full);
    std::vector<float> ar(n * w_);
    c_.all_reduce(std::span<float>(ar), ReduceOp::kSum);
    const CommTraffic t1 = c_.traffic();
    const uint64_t bytes = n * sizeof(float);
    expect_eq(static_cast<double>(t1.all_gather - t0.all_gather), double(others * bytes),
              "traffic all_gather", n);
    expect_eq(static_cast<double>(t1.reduce_scatter - t0.reduce_scatter), double(others * bytes),
              "traffic reduce_scatter", n);
    expect_eq(static_cast<double>(t1.all_to_all - t0.all_to_all), double(others * bytes),
              "traffic all_to_all", n);
    expect_eq(static_cast<double>(t1.all_reduce - t0.all_reduce), double(2 * others * bytes),
              "traffic all_reduce", n);
  }

  template <typename F>
  void expect_invalid(std::string_view what, F&& f) {
    try {
      f();
      failures_.push_back(fmt::format("rank {}: {} did not throw InvalidArgument", r_, what));
    } catch (const InvalidArgument&) {
    }
  }

  void argument_errors() {
    std::vector<float> a(4 * w_ + 1), b(4);
    expect_invalid("all_gather with a wrong receive size",
                   [&] { c_.all_gather(std::span<const float>(b), std::span<float>(a)); });
    expect_invalid("reduce_scatter with a wrong send size",
                   [&] { c_.reduce_scatter(a, b, ReduceOp::kSum); });
    // The send shard overlaps the receive buffer at the wrong place (one element off).
    std::vector<float> full(4 * w_ + 1);
    size_t off = r_ * 4 + 1;
    expect_invalid("all_gather with a misplaced in-place shard", [&] {
      c_.all_gather(std::span<const float>(full.data() + off, 4),
                    std::span<float>(full.data(), 4 * w_));
    });
    expect_invalid("broadcast from a rank outside the world", [&] { c_.broadcast(b, w_); });
    expect_invalid("broadcast from a negative rank", [&] { c_.broadcast_bytes({}, -1); });
    if (w_ > 1) {
      std::vector<float> odd(static_cast<size_t>(w_) + 1);
      expect_invalid("all_to_all of a buffer not divisible by the world size",
                     [&] { c_.all_to_all(odd); });
    }
  }

  std::vector<std::string> run() {
    for (size_t n : {size_t{1}, size_t{5}, size_t{1031}}) {
      all_gather(n);
      all_gather_bytes(n);
      reduce_scatter(n);
      all_reduce(n);
      broadcast(n);
      all_to_all(n);
      traffic(n);
    }
    all_gather(0);
    all_reduce(0);
    argument_errors();
    c_.barrier();
    return failures_;
  }

 private:
  Comm& c_;
  int r_, w_;
  std::vector<std::string> failures_;
};

}  // namespace

std::vector<std::string> check_all_collectives(Comm& comm) { return Checker(comm).run(); }

}  // namespace outcore::comm::testing
