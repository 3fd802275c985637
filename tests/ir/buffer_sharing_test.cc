// The interval colouring of gradient spans (ir/buffer_sharing.h) on chains and residual
// blocks, whose buffer counts the Program's plan and the memory estimate both rely on.
#include "ir/buffer_sharing.h"

#include <gtest/gtest.h>

namespace pipeshard {
namespace {

int64_t total(const SharedBuffers& b) {
  int64_t n = 0;
  for (int64_t s : b.sizes) n += s;
  return n;
}

// Spans that share a buffer never overlap: a buffer's spans, in backward order, each
// end (first writer) before the one before it started (producer).
void expect_no_overlap(const std::vector<GradientSpan>& spans, const SharedBuffers& b) {
  ASSERT_EQ(b.buffer.size(), spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    EXPECT_GE(b.sizes.at(b.buffer[i]), spans[i].size);
    for (size_t j = i + 1; j < spans.size(); ++j) {
      if (b.buffer[i] != b.buffer[j]) continue;
      const bool apart = spans[i].first_writer < spans[j].producer || spans[j].first_writer < spans[i].producer;
      EXPECT_TRUE(apart) << "spans " << i << " and " << j << " share buffer " << b.buffer[i];
    }
  }
}

TEST(ShareGradientBuffers, AChainNeedsTwoWhateverItsLength) {
  std::vector<GradientSpan> spans;  // node i makes value i, node i + 1 reads it
  for (int i = 0; i < 12; ++i) spans.push_back({i, i + 1, 64 + i % 2});
  const SharedBuffers b = share_gradient_buffers(spans);
  expect_no_overlap(spans, b);
  EXPECT_EQ(b.sizes, (std::vector<int64_t>{65, 64})) << "the odd values in one, the even ones in the other";
}

// h = x + f(g(x)): x's gradient waits from the Add's backward to its producer's while the
// branch's two values take two more buffers.
TEST(ShareGradientBuffers, AResidualHoldsOneMoreForTheSkippedValue) {
  const std::vector<GradientSpan> spans = {
      {0, 3, 32},  // x, made by node 0, read by g (1) and the Add (3)
      {1, 2, 32},  // g(x), read by f (2)
      {2, 3, 32},  // f(g(x)), read by the Add (3)
      {3, 4, 32},  // the sum, read by node 4
  };
  const SharedBuffers b = share_gradient_buffers(spans);
  expect_no_overlap(spans, b);
  EXPECT_EQ(b.sizes.size(), 3u);
  EXPECT_EQ(total(b), 3 * 32);
}

TEST(ShareGradientBuffers, ReusesTheBestFittingFreeBuffer) {
  const std::vector<GradientSpan> spans = {
      {4, 5, 100},  // backward order: these two first, alive together
      {4, 5, 10},
      {2, 3, 10},  // then both are free: the 10 fits best
      {2, 3, 50},  // and the 100 is the one still free
  };
  const SharedBuffers b = share_gradient_buffers(spans);
  expect_no_overlap(spans, b);
  EXPECT_EQ(b.buffer, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(b.sizes, (std::vector<int64_t>{100, 10}));
}

TEST(ShareGradientBuffers, GrowsTheLargestFreeBufferWhenNoneFits) {
  const std::vector<GradientSpan> spans = {{4, 5, 10}, {4, 5, 20}, {2, 3, 30}};
  const SharedBuffers b = share_gradient_buffers(spans);
  expect_no_overlap(spans, b);
  EXPECT_EQ(b.buffer, (std::vector<int>{0, 1, 1}));
  EXPECT_EQ(b.sizes, (std::vector<int64_t>{10, 30}));
}

// A recomputed activation needs its buffer in forward and again in backward: a value
// living in between may take the same buffer, one overlapping either span may not.
TEST(ShareBuffers, ValuesWithSeveralSpansShareBetweenThem) {
  const std::vector<BufferLife> lives = {
      {{{0, 2}, {10, 12}}, 8},  // forward, then backward
      {{{3, 5}}, 8},            // in between
      {{{1, 4}}, 8},            // overlapping both
  };
  const SharedBuffers b = share_buffers(lives);
  EXPECT_EQ(b.buffer, (std::vector<int>{0, 0, 1}));
  EXPECT_EQ(b.sizes, (std::vector<int64_t>{8, 8}));
}

TEST(ShareGradientBuffers, NoSpansNoBuffers) { EXPECT_TRUE(share_gradient_buffers({}).sizes.empty()); }

}  // namespace
}  // namespace pipeshard
