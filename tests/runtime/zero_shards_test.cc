// ZeRO's bookkeeping (runtime/zero_shards.h): the replicas' slices and tails cover every
// bucket exactly once between them (tails: by every replica), the spans point where the
// reduced gradients lie, and optimizer state goes to whole buffers and back unchanged.
#include "runtime/zero_shards.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace pipeshard {
namespace {

// Buckets as GradientSync makes them: from the end of the buffer towards its start, with
// sizes that do and do not divide by the replicas, and one smaller than them.
const std::vector<std::pair<int64_t, int64_t>> kBuckets = {{70, 103}, {10, 70}, {7, 10}, {0, 7}};
constexpr int64_t kElements = 103;

TEST(ZeroShards, SlicesAndTailsCoverEveryElement) {
  for (int replicas : {1, 2, 3, 4, 5}) {
    std::vector<int> owners(kElements, 0), everyone(kElements, 0);
    int64_t slices = 0;
    for (int r = 0; r < replicas; ++r) {
      const ZeroShards z(kBuckets, r, replicas);
      int64_t owned = 0;
      const std::vector<ZeroShards::Range> ranges = z.ranges();
      for (size_t i = 0; i < ranges.size(); ++i) {
        for (int64_t e = ranges[i].at; e < ranges[i].at + ranges[i].n; ++e) {
          ++(i < kBuckets.size() ? owners : everyone)[e];
        }
        owned += ranges[i].n;
      }
      EXPECT_EQ(owned, z.owned_elements());
      for (size_t i = 0; i < kBuckets.size(); ++i) slices += ranges[i].n;
    }
    for (int64_t e = 0; e < kElements; ++e) {
      // Each element is in exactly one replica's slice, or in a tail that every replica holds.
      EXPECT_TRUE((owners[e] == 1 && everyone[e] == 0) || (owners[e] == 0 && everyone[e] == replicas))
          << "element " << e << " of " << replicas << " replicas";
    }
    int64_t in_tails = 0;
    for (int64_t e = 0; e < kElements; ++e) in_tails += everyone[e] > 0;
    EXPECT_EQ(slices + in_tails, kElements);
    EXPECT_LT(in_tails, replicas * static_cast<int64_t>(kBuckets.size()));  // each tail is under D elements
  }
}

TEST(ZeroShards, SpansPointAtTheReducedGradients) {
  const ZeroShards z(kBuckets, 1, 4);
  std::vector<float> params(kElements), grads(kElements), packed(static_cast<size_t>(z.owned_elements()));
  const std::vector<ZeroShards::Range>& ranges = z.ranges();
  // Stage 1: in place, where the reduce-scatter leaves this replica's block of each bucket.
  const std::vector<Optimizer::Span> in_place = z.spans(params.data(), grads.data());
  // Stage 2: one after another in the packed buffer, slices then tails, as the pieces say.
  const std::vector<Optimizer::Span> spans = z.spans(params.data(), grads.data(), packed.data());
  ASSERT_EQ(in_place.size(), ranges.size());
  ASSERT_EQ(spans.size(), ranges.size());
  int64_t at = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    EXPECT_EQ(in_place[i].params, params.data() + ranges[i].at);
    EXPECT_EQ(in_place[i].grads, grads.data() + ranges[i].at);
    EXPECT_EQ(spans[i].params, params.data() + ranges[i].at);
    EXPECT_EQ(spans[i].grads, packed.data() + at);
    EXPECT_EQ(spans[i].n, ranges[i].n);
    const ZeroShards::Piece& p = z.pieces()[i % kBuckets.size()];
    EXPECT_EQ(at, i < kBuckets.size() ? p.slice_at : p.tail_at);
    at += spans[i].n;
  }
  EXPECT_EQ(at, z.owned_elements());
  // Bucket {10, 70}: 60 elements, 15 each; replica 1's slice starts 15 in.
  EXPECT_EQ(ranges[1].at, 25);
  EXPECT_EQ(ranges[1].n, 15);
}

TEST(ZeroShards, StateGoesToTheWholeBufferAndBack) {
  const ZeroShards z(kBuckets, 2, 3);
  std::vector<float> owned(static_cast<size_t>(z.owned_elements()));
  std::iota(owned.begin(), owned.end(), 1.0f);
  const std::vector<float> whole = z.to_whole(owned, kElements);
  ASSERT_EQ(static_cast<int64_t>(whole.size()), kElements);
  EXPECT_EQ(z.to_owned(whole), owned);
  int64_t filled = 0;
  for (float v : whole) filled += v != 0.0f;
  EXPECT_EQ(filled, z.owned_elements());
}

}  // namespace
}  // namespace pipeshard
