// aio::LatencyHistogram: buckets, percentiles, merge.
#include <gtest/gtest.h>

#include "aio/aio.hpp"

namespace outcore::aio {
namespace {

TEST(AioLatencyHistogram, BucketsAreMonotonicAndContainTheirValues) {
  int last = -1;
  for (uint64_t us = 0; us < 1000000; us = us < 64 ? us + 1 : us * 5 / 4) {
    int b = LatencyHistogram::bucket_of(us);
    EXPECT_GE(b, last) << us;
    EXPECT_LT(us, LatencyHistogram::bucket_upper_us(b)) << us;
    if (b > 0) {
      EXPECT_GE(us, LatencyHistogram::bucket_upper_us(b - 1)) << us;
    }
    last = b;
  }
  EXPECT_EQ(LatencyHistogram::bucket_of(~uint64_t{0}), LatencyHistogram::kBuckets - 1);
}

TEST(AioLatencyHistogram, PercentilesAreWithinBucketResolution) {
  LatencyHistogram h;
  EXPECT_EQ(h.percentile_us(0.5), 0u);
  for (uint64_t us = 1; us <= 1000; ++us) h.record(us);
  EXPECT_EQ(h.count(), 1000u);
  EXPECT_EQ(h.max_us(), 1000u);
  EXPECT_NEAR(h.mean_us(), 500.5, 1e-9);
  uint64_t p50 = h.percentile_us(0.5);
  EXPECT_GE(p50, 500u);
  EXPECT_LE(p50, 500u * 5 / 4);
  uint64_t p99 = h.percentile_us(0.99);
  EXPECT_GE(p99, 990u);
  EXPECT_LE(p99, 1000u);
  EXPECT_EQ(h.percentile_us(1.0), 1000u);
}

TEST(AioLatencyHistogram, MergeAddsCounts) {
  LatencyHistogram a, b;
  a.record(10);
  b.record(10000);
  b.record(20000);
  a.merge(b);
  EXPECT_EQ(a.count(), 3u);
  EXPECT_EQ(a.max_us(), 20000u);
  EXPECT_GE(a.percentile_us(0.6), 10000u);
  EXPECT_LE(a.percentile_us(0.3), 12u);
}

}  // namespace
}  // namespace outcore::aio
