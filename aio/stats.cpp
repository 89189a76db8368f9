// aio::LatencyHistogram: log2 buckets with kSub linear sub-buckets each.
#include <algorithm>
#include <bit>
#include <cmath>

#include "aio/aio.hpp"

namespace outcore::aio {

int LatencyHistogram::bucket_of(uint64_t micros) {
  if (micros < kSub) return static_cast<int>(micros);
  int e = std::bit_width(micros) - 1;  // floor(log2), >= 2
  int sub = static_cast<int>((micros >> (e - 2)) & (kSub - 1));
  return std::min((e - 1) * kSub + sub, kBuckets - 1);
}

uint64_t LatencyHistogram::bucket_upper_us(int bucket) {
  if (bucket < kSub) return static_cast<uint64_t>(bucket) + 1;
  int e = bucket / kSub + 1;
  int sub = bucket % kSub;
  return static_cast<uint64_t>(kSub + 1 + sub) << (e - 2);
}

void LatencyHistogram::record(uint64_t micros) {
  ++buckets_[bucket_of(micros)];
  ++count_;
  sum_us_ += micros;
  max_us_ = std::max(max_us_, micros);
}

void LatencyHistogram::merge(const LatencyHistogram& other) {
  for (int i = 0; i < kBuckets; ++i) buckets_[i] += other.buckets_[i];
  count_ += other.count_;
  sum_us_ += other.sum_us_;
  max_us_ = std::max(max_us_, other.max_us_);
}

uint64_t LatencyHistogram::percentile_us(double p) const {
  if (count_ == 0) return 0;
  p = std::clamp(p, 0.0, 1.0);
  uint64_t rank = std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(p * double(count_))));
  uint64_t seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    seen += buckets_[i];
    if (seen >= rank) return std::min(bucket_upper_us(i), max_us_);
  }
  return max_us_;
}

}  // namespace outcore::aio
