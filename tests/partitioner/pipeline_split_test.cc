// Tests for split_pipeline: brute force on small random instances, hand-computed cases from the
// course models, edge cases, a counterexample to greedy filling, and a size/speed sanity case.
#include "partitioner/pipeline_split.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace pipeshard {
namespace {

// ---- Independent reference helpers (no prefix sums, no windows) ----------------------------

int64_t reference_stage_cost(const PipelineSplitProblem& problem, int stage, int begin, int end) {
  int64_t cost = 0;
  int64_t activation = 0;
  for (int i = begin; i < end; ++i) {
    cost += problem.unit_cost[i];
    if (!problem.unit_activation.empty()) activation += problem.unit_activation[i];
  }
  const int64_t factor = problem.stage_activation_factor.empty() ? 0 : problem.stage_activation_factor[stage];
  return cost + factor * activation;
}

struct Score {
  int64_t max_stage_cost;
  int64_t crossing_bytes;
  bool operator==(const Score&) const = default;
};

Score score_of(const PipelineSplitProblem& problem, const std::vector<int>& stage_begin) {
  Score score{0, 0};
  for (int k = 0; k < problem.stages; ++k) {
    score.max_stage_cost =
        std::max(score.max_stage_cost, reference_stage_cost(problem, k, stage_begin[k], stage_begin[k + 1]));
    if (k > 0) score.crossing_bytes += problem.cut_bytes[stage_begin[k]];
  }
  return score;
}

// The documented third criterion, computed directly: the sum over cuts k of
// |P * W(stage_begin[k]) - k * W(n)|, W summing unit_cost + unit_activation (unit counts when
// all of it is zero).
__extension__ typedef __int128 Int128;
Int128 balance_deviation(const PipelineSplitProblem& problem, const std::vector<int>& stage_begin) {
  const int n = static_cast<int>(problem.unit_cost.size());
  auto weight = [&](int end) {
    Int128 w = 0;
    for (int i = 0; i < end; ++i) {
      w += problem.unit_cost[i] + (problem.unit_activation.empty() ? 0 : problem.unit_activation[i]);
    }
    return w;
  };
  const bool all_zero = weight(n) == 0;
  auto prefix = [&](int end) { return all_zero ? Int128(end) : weight(end); };
  Int128 total = 0;
  for (int k = 1; k < problem.stages; ++k) {
    Int128 d = Int128(problem.stages) * prefix(stage_begin[k]) - Int128(k) * prefix(n);
    total += d < 0 ? -d : d;
  }
  return total;
}

// Enumerates every composition of n into `stages` positive parts and returns the best
// stage_begin under the documented order: (max cost, crossing bytes, balance deviation,
// stage_begin lexicographic).
std::vector<int> brute_force_best(const PipelineSplitProblem& problem) {
  const int n = static_cast<int>(problem.unit_cost.size());
  std::vector<int> current = {0};
  std::vector<int> best;
  std::tuple<int64_t, int64_t, Int128, std::vector<int>> best_key;
  auto visit = [&](auto&& self) -> void {
    const int placed = static_cast<int>(current.size()) - 1;  // stages already closed
    if (placed == problem.stages - 1) {
      current.push_back(n);
      const Score score = score_of(problem, current);
      auto key =
          std::make_tuple(score.max_stage_cost, score.crossing_bytes, balance_deviation(problem, current), current);
      if (best.empty() || key < best_key) {
        best_key = key;
        best = current;
      }
      current.pop_back();
      return;
    }
    const int remaining_stages = problem.stages - placed;  // including the open one
    for (int next = current.back() + 1; next <= n - (remaining_stages - 1); ++next) {
      current.push_back(next);
      self(self);
      current.pop_back();
    }
  };
  visit(visit);
  return best;
}

// Asserts the invariants every returned split must satisfy.
void expect_consistent(const PipelineSplitProblem& problem, const PipelineSplit& split) {
  const int n = static_cast<int>(problem.unit_cost.size());
  ASSERT_EQ(split.stage_begin.size(), static_cast<size_t>(problem.stages) + 1);
  ASSERT_EQ(split.stage_cost.size(), static_cast<size_t>(problem.stages));
  EXPECT_EQ(split.stage_begin.front(), 0);
  EXPECT_EQ(split.stage_begin.back(), n);
  int64_t max_cost = 0;
  int64_t crossing = 0;
  for (int k = 0; k < problem.stages; ++k) {
    const int begin = split.stage_begin[k];
    const int end = split.stage_begin[k + 1];
    EXPECT_LT(begin, end) << "stage " << k << " is empty";
    const int64_t expected = reference_stage_cost(problem, k, begin, end);
    EXPECT_EQ(split.stage_cost[k], expected) << "stage " << k;
    EXPECT_EQ(stage_cost(problem, k, begin, end), expected) << "stage " << k;
    max_cost = std::max(max_cost, expected);
    if (k > 0) crossing += problem.cut_bytes[begin];
  }
  EXPECT_EQ(split.max_stage_cost, max_cost);
  EXPECT_EQ(split.crossing_bytes, crossing);
}

PipelineSplit split_or_die(const PipelineSplitProblem& problem) {
  Result<PipelineSplit> result = split_pipeline(problem);
  EXPECT_TRUE(result.is_ok()) << result.status().message();
  if (!result.is_ok()) return PipelineSplit{};
  return std::move(result).value();
}

PipelineSplitProblem units_only(std::vector<int64_t> unit_cost, int stages) {
  PipelineSplitProblem problem;
  problem.cut_bytes.assign(unit_cost.size() + 1, 0);
  problem.unit_cost = std::move(unit_cost);
  problem.stages = stages;
  return problem;
}

// ---- Brute force ----------------------------------------------------------------------------

PipelineSplitProblem random_small_problem(std::mt19937_64& rng) {
  auto uniform = [&rng](int64_t low, int64_t high) { return std::uniform_int_distribution<int64_t>(low, high)(rng); };
  PipelineSplitProblem problem;
  const int n = static_cast<int>(uniform(1, 10));
  problem.stages = static_cast<int>(uniform(1, n));
  // Small ranges make zeros and ties common; an occasional wide range exercises big numbers.
  const int64_t cost_max = uniform(0, 3) == 0 ? 1'000'000'000'000 : uniform(0, 6);
  for (int i = 0; i < n; ++i) problem.unit_cost.push_back(uniform(0, cost_max));
  for (int j = 0; j <= n; ++j) problem.cut_bytes.push_back(uniform(0, uniform(0, 1) ? 3 : 1000));
  if (uniform(0, 1) == 1) {
    for (int i = 0; i < n; ++i) problem.unit_activation.push_back(uniform(0, 5));
    for (int k = 0; k < problem.stages; ++k) {
      // Half the time the 1F1B shape (P - k in flight), otherwise arbitrary factors.
      problem.stage_activation_factor.push_back(uniform(0, 1) ? problem.stages - k : uniform(0, 4));
    }
  }
  return problem;
}

TEST(PipelineSplitBruteForce, MatchesExhaustiveSearchOnRandomSmallInstances) {
  std::mt19937_64 rng(20240531);
  constexpr int kInstances = 3000;
  for (int instance = 0; instance < kInstances; ++instance) {
    const PipelineSplitProblem problem = random_small_problem(rng);
    SCOPED_TRACE("instance " + std::to_string(instance) + ", n = " + std::to_string(problem.unit_cost.size()) +
                 ", stages = " + std::to_string(problem.stages));
    const PipelineSplit split = split_or_die(problem);
    expect_consistent(problem, split);
    const std::vector<int> best = brute_force_best(problem);
    const Score best_score = score_of(problem, best);
    EXPECT_EQ(split.max_stage_cost, best_score.max_stage_cost);
    EXPECT_EQ(split.crossing_bytes, best_score.crossing_bytes);
    // The documented tie-break (lexicographically smallest stage_begin) picks exactly this one.
    EXPECT_EQ(split.stage_begin, best);
    if (testing::Test::HasFailure()) return;
  }
}

// ---- Hand cases from the course models ------------------------------------------------------

// SimpleModel: Linear(100,256) ReLU Linear(256,128) ReLU Linear(128,10); cost = parameters,
// cut bytes = one float32 sample of the activation crossing the cut.
PipelineSplitProblem simple_model(int stages) {
  PipelineSplitProblem problem = units_only({25856, 32896, 1290}, stages);
  problem.cut_bytes = {0, 256 * 4, 128 * 4, 0};
  return problem;
}

TEST(PipelineSplitHandCases, SimpleModelTwoStagesSplitsAfterFirstLayer) {
  // {25856 | 34186} -> 34186 beats {58752 | 1290} -> 58752.
  const PipelineSplitProblem problem = simple_model(2);
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(split.max_stage_cost, 34186);
  EXPECT_EQ(split.stage_cost, (std::vector<int64_t>{25856, 34186}));
  EXPECT_EQ(split.crossing_bytes, 1024);
}

TEST(PipelineSplitHandCases, SimpleModelThreeStagesIsOneLayerEach) {
  const PipelineSplitProblem problem = simple_model(3);
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(split.max_stage_cost, 32896);
  EXPECT_EQ(split.crossing_bytes, 1024 + 512);
}

TEST(PipelineSplitHandCases, SimpleModelFourStagesIsAnError) {
  const Result<PipelineSplit> result = split_pipeline(simple_model(4));
  ASSERT_FALSE(result.is_ok());
  EXPECT_EQ(result.status().message(), "cannot make 4 non-empty stages from 3 layers");
}

TEST(PipelineSplitHandCases, PipelineParallelModelBeatsTheCourseHandSplit) {
  // Linear(100,512) Linear(512,256) Linear(256,128) Linear(128,10).
  PipelineSplitProblem problem = units_only({51712, 131328, 32896, 1290}, 2);
  problem.cut_bytes = {0, 512 * 4, 256 * 4, 128 * 4, 0};
  // The course splits after the second layer: 183040 + 34186.
  EXPECT_EQ(stage_cost(problem, 0, 0, 2), 183040);
  EXPECT_EQ(stage_cost(problem, 1, 2, 4), 34186);
  // Splitting after the first layer has the smaller bottleneck: 51712 | 165514.
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 1, 4}));
  EXPECT_EQ(split.max_stage_cost, 165514);
  EXPECT_EQ(split.stage_cost, (std::vector<int64_t>{51712, 165514}));
  EXPECT_EQ(split.crossing_bytes, 2048);
}

TEST(PipelineSplitHandCases, ActivationFactorShiftsLayersToLaterStages) {
  // Equal parameters; 1F1B factors {2, 1} make activations twice as costly on stage 0.
  PipelineSplitProblem problem = units_only({10, 10, 10, 10}, 2);
  problem.unit_activation = {5, 5, 5, 5};
  problem.stage_activation_factor = {2, 1};
  // {0..1 | 1..4}: 10+2*5 = 20 vs 30+15 = 45; {0..2 | 2..4}: 40 vs 30; {0..3 | 3..4}: 60 vs 15.
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(split.max_stage_cost, 40);
}

// ---- Edge cases -----------------------------------------------------------------------------

TEST(PipelineSplitEdgeCases, AllZeroCostsChooseTheCheapestCuts) {
  PipelineSplitProblem problem = units_only({0, 0, 0, 0, 0, 0}, 3);
  problem.cut_bytes = {0, 5, 1, 7, 2, 9, 0};
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.max_stage_cost, 0);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(split.crossing_bytes, 3);
}

TEST(PipelineSplitEdgeCases, TiesGoToTheCutsNearestTheirEvenShares) {
  // All weights zero: shares count units. 5 units in 3 stages: ideal cuts at 5/3 and 10/3;
  // {0,2,3,5} and {0,2,4,5} both deviate by |3*2-5| + |3*3-10| = 2 resp. |6-5| + |12-10| = 3,
  // so {0,2,3,5} wins; earliest-cuts alone would have given the lopsided {0,1,2,5}.
  const PipelineSplitProblem problem = units_only({0, 0, 0, 0, 0}, 3);
  EXPECT_EQ(split_or_die(problem).stage_begin, (std::vector<int>{0, 2, 3, 5}));
}

TEST(PipelineSplitEdgeCases, FullTiesTakeTheLexicographicallySmallestStageBegin) {
  // 3 units in 2 stages: cuts at 1 and 2 both deviate by |2*j - 3| = 1; the earlier wins.
  const PipelineSplitProblem problem = units_only({0, 0, 0}, 2);
  EXPECT_EQ(split_or_die(problem).stage_begin, (std::vector<int>{0, 1, 3}));
}

TEST(PipelineSplitEdgeCases, EqualLayersSpreadEvenlyWhenOneStageSetsTheBottleneck) {
  // 2000 equal layers into 64 stages: the bottleneck is 32 layers, and many splits reach
  // it; the balance criterion keeps every stage at 31 or 32 layers.
  const PipelineSplitProblem problem = units_only(std::vector<int64_t>(2000, 272), 64);
  const PipelineSplit split = split_or_die(problem);
  for (int k = 0; k < 64; ++k) {
    const int layers = split.stage_begin[k + 1] - split.stage_begin[k];
    EXPECT_TRUE(layers == 31 || layers == 32) << "stage " << k << " has " << layers << " layers";
  }
}

TEST(PipelineSplitEdgeCases, OneHugeUnitGetsAStageOfItsOwn) {
  constexpr int64_t kHuge = 1'000'000'000'000;
  PipelineSplitProblem problem = units_only({1, 1, kHuge, 1, 1}, 3);
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 2, 3, 5}));
  EXPECT_EQ(split.max_stage_cost, kHuge);
}

TEST(PipelineSplitEdgeCases, OneHugeUnitWithTwoStagesLetsCutBytesDecide) {
  constexpr int64_t kHuge = 1'000'000'000'000;
  PipelineSplitProblem problem = units_only({1, 1, kHuge, 1, 1}, 2);
  problem.cut_bytes = {0, 9, 9, 4, 9, 0};
  // The bottleneck kHuge + 2 is met by cutting at 2 or at 3; cut 3 crosses fewer bytes.
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.max_stage_cost, kHuge + 2);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 3, 5}));
  EXPECT_EQ(split.crossing_bytes, 4);
}

TEST(PipelineSplitEdgeCases, AsManyStagesAsLayersPutsOneLayerInEach) {
  PipelineSplitProblem problem = units_only({3, 0, 7, 7, 1, 2}, 6);
  problem.cut_bytes = {0, 1, 2, 3, 4, 5, 0};
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(split.max_stage_cost, 7);
  EXPECT_EQ(split.crossing_bytes, 15);
}

TEST(PipelineSplitEdgeCases, OneStageHoldsEverything) {
  PipelineSplitProblem problem = units_only({3, 0, 7, 7, 1, 2}, 1);
  problem.unit_activation = {1, 1, 1, 1, 1, 1};
  problem.stage_activation_factor = {2};
  problem.cut_bytes = {0, 1, 2, 3, 4, 5, 0};
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 6}));
  EXPECT_EQ(split.max_stage_cost, 20 + 2 * 6);
  EXPECT_EQ(split.crossing_bytes, 0);
}

TEST(PipelineSplitEdgeCases, LargeCostsNearInt64LimitDoNotOverflow) {
  constexpr int64_t kBig = std::numeric_limits<int64_t>::max() / 8;
  PipelineSplitProblem problem = units_only({kBig, kBig, kBig, kBig}, 2);
  problem.unit_activation = {1, 1, 1, 1};
  problem.stage_activation_factor = {kBig, 0};
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 1, 4}));
  EXPECT_EQ(split.max_stage_cost, 3 * kBig);
}

// ---- Errors ---------------------------------------------------------------------------------

std::string error_of(const PipelineSplitProblem& problem) {
  const Result<PipelineSplit> result = split_pipeline(problem);
  EXPECT_FALSE(result.is_ok());
  return result.status().message();
}

TEST(PipelineSplitErrors, RejectsBadInputWithAClearMessage) {
  EXPECT_EQ(error_of(units_only({1, 2, 3}, 5)), "cannot make 5 non-empty stages from 3 layers");
  EXPECT_EQ(error_of(units_only({1, 2, 3}, 0)), "the number of pipeline stages must be at least 1, got 0");
  EXPECT_EQ(error_of(units_only({}, 1)), "cannot split a model with 0 layers into pipeline stages");
  EXPECT_EQ(error_of(units_only({1, -2, 3}, 2)), "unit_cost[1] is -2; costs and sizes must be non-negative");

  PipelineSplitProblem negative_cut = units_only({1, 2, 3}, 2);
  negative_cut.cut_bytes[2] = -1;
  EXPECT_EQ(error_of(negative_cut), "cut_bytes[2] is -1; costs and sizes must be non-negative");

  PipelineSplitProblem negative_factor = units_only({1, 2, 3}, 2);
  negative_factor.unit_activation = {1, 1, 1};
  negative_factor.stage_activation_factor = {1, -1};
  EXPECT_EQ(error_of(negative_factor), "stage_activation_factor[1] is -1; costs and sizes must be non-negative");

  PipelineSplitProblem short_cuts = units_only({1, 2, 3}, 2);
  short_cuts.cut_bytes.pop_back();
  EXPECT_EQ(error_of(short_cuts), "cut_bytes has 3 entries; expected one per cut position 0..3 (4 for 3 layers)");

  PipelineSplitProblem short_activation = units_only({1, 2, 3}, 2);
  short_activation.unit_activation = {1, 2};
  EXPECT_EQ(error_of(short_activation), "unit_activation has 2 entries; expected 0 or one per layer (3 layers)");

  PipelineSplitProblem wrong_factors = units_only({1, 2, 3}, 2);
  wrong_factors.stage_activation_factor = {1, 2, 3};
  EXPECT_EQ(error_of(wrong_factors), "stage_activation_factor has 3 entries; expected 0 or one per stage (2 stages)");

  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_NE(error_of(units_only({kMax, 1}, 2)).find("overflow"), std::string::npos);
  PipelineSplitProblem huge_factor = units_only({1, 1}, 2);
  huge_factor.unit_activation = {kMax / 2, kMax / 2};
  huge_factor.stage_activation_factor = {3, 0};
  EXPECT_NE(error_of(huge_factor).find("overflow"), std::string::npos);
}

// ---- Not greedy -----------------------------------------------------------------------------

// The greedy the optimum is compared with: walking left to right, each stage takes units while
// its cost stays <= budget (at least one unit if any is left); the last stage takes the rest.
// Returns stage_begin, which may end in empty stages.
std::vector<int> greedy_fill(const PipelineSplitProblem& problem, int64_t budget) {
  const int n = static_cast<int>(problem.unit_cost.size());
  std::vector<int> stage_begin = {0};
  for (int k = 0; k + 1 < problem.stages; ++k) {
    int end = stage_begin.back();
    if (end < n) ++end;
    while (end < n && reference_stage_cost(problem, k, stage_begin.back(), end + 1) <= budget) {
      ++end;
    }
    stage_begin.push_back(end);
  }
  stage_begin.push_back(n);
  return stage_begin;
}

TEST(PipelineSplitNotGreedy, GreedyFillToTheBottleneckWouldLeaveAStageEmpty) {
  // The best bottleneck is 2, but filling each stage up to 2 from the left uses only two
  // stages ({1,1}, {1,1}) and leaves the third empty.
  PipelineSplitProblem problem = units_only({1, 1, 1, 1}, 3);
  problem.cut_bytes = {0, 6, 5, 4, 0};
  EXPECT_EQ(greedy_fill(problem, 2), (std::vector<int>{0, 2, 4, 4}));
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.max_stage_cost, 2);
  // Options with bottleneck 2: cuts {1,2} = 11 bytes, {1,3} = 10, {2,3} = 9.
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 2, 3, 4}));
  EXPECT_EQ(split.crossing_bytes, 9);
}

TEST(PipelineSplitNotGreedy, GreedyFillCrossesMoreBytesThanNeeded) {
  // Bottleneck 3: greedy packs three units into stage 0 and cuts before unit 3 (100 bytes);
  // cutting before unit 2 meets the same bottleneck with 1 byte.
  PipelineSplitProblem problem = units_only({1, 1, 1, 1, 1}, 2);
  problem.cut_bytes = {0, 50, 1, 100, 50, 0};
  EXPECT_EQ(greedy_fill(problem, 3), (std::vector<int>{0, 3, 5}));
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.max_stage_cost, 3);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 2, 5}));
  EXPECT_EQ(split.crossing_bytes, 1);
}

TEST(PipelineSplitNotGreedy, GreedyFillToTheAverageHasAWorseBottleneck) {
  // total = 15, P = 3: filling to the average 5 closes {4} and {2} early and leaves {4, 2, 3}
  // = 9 for the last stage; the optimum has bottleneck 6 ({4 | 2, 4 | 2, 3} is the
  // lexicographically first of the splits that reach it).
  const PipelineSplitProblem problem = units_only({4, 2, 4, 2, 3}, 3);
  const std::vector<int> greedy = greedy_fill(problem, 5);
  EXPECT_EQ(greedy, (std::vector<int>{0, 1, 2, 5}));
  EXPECT_EQ(score_of(problem, greedy).max_stage_cost, 9);
  const PipelineSplit split = split_or_die(problem);
  expect_consistent(problem, split);
  EXPECT_EQ(split.stage_begin, (std::vector<int>{0, 1, 3, 5}));  // 4 | 6 | 5
  EXPECT_EQ(split.max_stage_cost, 6);
}

// ---- Size and speed -------------------------------------------------------------------------

// Independent O(P·n·w) check (w = units per stage at the bottleneck): the smallest cut bytes of
// any split whose stages all cost <= budget, or -1 if none. Scans starts leftwards from each end
// and stops once the range is too expensive, instead of using windows.
int64_t reference_cheapest_cuts(const PipelineSplitProblem& problem, int64_t budget) {
  const int n = static_cast<int>(problem.unit_cost.size());
  constexpr int64_t kNone = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> best(n + 1, kNone);  // [n + 1]; with k stages covering [0, e)
  best[0] = 0;
  for (int k = 0; k < problem.stages; ++k) {
    std::vector<int64_t> next(n + 1, kNone);
    for (int end = 1; end <= n; ++end) {
      int64_t cost = 0;
      int64_t activation = 0;
      const int64_t factor = problem.stage_activation_factor.empty() ? 0 : problem.stage_activation_factor[k];
      for (int start = end - 1; start >= 0; --start) {
        cost += problem.unit_cost[start];
        if (!problem.unit_activation.empty()) activation += problem.unit_activation[start];
        if (cost + factor * activation > budget) break;
        if (best[start] == kNone) continue;
        const int64_t bytes = best[start] + (k > 0 ? problem.cut_bytes[start] : 0);
        next[end] = std::min(next[end], bytes);
      }
    }
    best = std::move(next);
  }
  return best[n] == kNone ? -1 : best[n];
}

TEST(PipelineSplitSpeed, TwoThousandLayersIntoSixtyFourStages) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int64_t> parameters(0, 50'000'000);
  std::uniform_int_distribution<int64_t> activations(0, 2'000'000);
  std::uniform_int_distribution<int64_t> bytes(0, 1 << 24);
  PipelineSplitProblem problem;
  constexpr int kUnits = 2000;
  problem.stages = 64;
  for (int i = 0; i < kUnits; ++i) {
    problem.unit_cost.push_back(parameters(rng));
    problem.unit_activation.push_back(activations(rng));
  }
  for (int j = 0; j <= kUnits; ++j) problem.cut_bytes.push_back(bytes(rng));
  for (int k = 0; k < problem.stages; ++k) problem.stage_activation_factor.push_back(64 - k);

  const auto start = std::chrono::steady_clock::now();
  const PipelineSplit split = split_or_die(problem);
  const double elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("split_pipeline(n = %d, P = %d): %.2f ms\n", kUnits, problem.stages, elapsed_ms);

  expect_consistent(problem, split);
  // Optimal: one less than the bottleneck is infeasible, and no split within the bottleneck
  // crosses fewer bytes.
  EXPECT_EQ(reference_cheapest_cuts(problem, split.max_stage_cost - 1), -1);
  EXPECT_EQ(reference_cheapest_cuts(problem, split.max_stage_cost), split.crossing_bytes);
}

}  // namespace
}  // namespace pipeshard
