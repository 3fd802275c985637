#include "partitioner/pipeline_split.h"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <string>
#include <utility>

namespace pipeshard {
namespace {

__extension__ typedef __int128 Int128;  // wide enough for factor * activation sums

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// ---- Validation ----------------------------------------------------------------------------

Status check_sizes(const PipelineSplitProblem& problem) {
  const size_t n = problem.unit_cost.size();
  const std::string layers = std::to_string(n) + " layers";
  if (n == 0) return Status::error("cannot split a model with 0 layers into pipeline stages");
  if (n > static_cast<size_t>(std::numeric_limits<int>::max() - 1)) {
    return Status::error("too many layers to split: " + std::to_string(n));
  }
  if (problem.stages < 1) {
    return Status::error("the number of pipeline stages must be at least 1, got " + std::to_string(problem.stages));
  }
  if (static_cast<size_t>(problem.stages) > n) {
    return Status::error("cannot make " + std::to_string(problem.stages) + " non-empty stages from " + layers);
  }
  if (!problem.unit_activation.empty() && problem.unit_activation.size() != n) {
    return Status::error("unit_activation has " + std::to_string(problem.unit_activation.size()) +
                         " entries; expected 0 or one per layer (" + layers + ")");
  }
  const size_t p = static_cast<size_t>(problem.stages);
  if (!problem.stage_activation_factor.empty() && problem.stage_activation_factor.size() != p) {
    return Status::error("stage_activation_factor has " + std::to_string(problem.stage_activation_factor.size()) +
                         " entries; expected 0 or one per stage (" + std::to_string(p) + " stages)");
  }
  if (problem.cut_bytes.size() != n + 1) {
    return Status::error("cut_bytes has " + std::to_string(problem.cut_bytes.size()) +
                         " entries; expected one per cut position 0.." + std::to_string(n) + " (" +
                         std::to_string(n + 1) + " for " + layers + ")");
  }
  return Status::ok();
}

Status check_non_negative(const char* name, const std::vector<int64_t>& values) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (values[i] < 0) {
      return Status::error(std::string(name) + "[" + std::to_string(i) + "] is " + std::to_string(values[i]) +
                           "; costs and sizes must be non-negative");
    }
  }
  return Status::ok();
}

Int128 wide_sum(const std::vector<int64_t>& values) {
  Int128 total = 0;
  for (int64_t v : values) total += v;
  return total;
}

// The largest cost any stage can have is the cost of all units under the largest factor; when
// that and the total cut bytes fit in int64, every sum formed later fits too.
Status check_fits_int64(const PipelineSplitProblem& problem) {
  const Int128 total_cost = wide_sum(problem.unit_cost);
  const Int128 total_activation = wide_sum(problem.unit_activation);
  const Int128 total_cut_bytes = wide_sum(problem.cut_bytes);
  int64_t max_factor = 0;
  for (int64_t f : problem.stage_activation_factor) max_factor = std::max(max_factor, f);
  const bool fits = total_cost <= kInt64Max && total_activation <= kInt64Max && total_cut_bytes <= kInt64Max &&
                    (max_factor == 0 || total_activation <= (kInt64Max - total_cost) / max_factor);
  if (!fits) {
    return Status::error(
        "layer costs are too large: the cost of a stage or the total cut bytes would overflow a "
        "64-bit integer");
  }
  return Status::ok();
}

// ---- Stage costs in O(1) -------------------------------------------------------------------

// Prefix sums of a validated problem, so that any stage's cost is two subtractions.
class StageCosts {
 public:
  explicit StageCosts(const PipelineSplitProblem& problem)
      : factor_(problem.stage_activation_factor), stages_(problem.stages) {
    const size_t n = problem.unit_cost.size();
    cost_prefix_.assign(n + 1, 0);
    activation_prefix_.assign(n + 1, 0);
    for (size_t i = 0; i < n; ++i) {
      cost_prefix_[i + 1] = cost_prefix_[i] + problem.unit_cost[i];
      const int64_t activation = problem.unit_activation.empty() ? 0 : problem.unit_activation[i];
      activation_prefix_[i + 1] = activation_prefix_[i] + activation;
    }
    if (factor_.empty()) factor_.assign(static_cast<size_t>(stages_), 0);
  }

  int units() const { return static_cast<int>(cost_prefix_.size()) - 1; }
  int stages() const { return stages_; }
  int64_t smallest_factor() const { return *std::min_element(factor_.begin(), factor_.end()); }
  int64_t largest_factor() const { return *std::max_element(factor_.begin(), factor_.end()); }

  // Cost of units [begin, end) as stage `stage`; validation guarantees no overflow.
  int64_t cost(int stage, int begin, int end) const { return cost_with_factor(factor_[stage], begin, end); }
  // The same with an explicit activation factor in [smallest_factor(), largest_factor()].
  int64_t cost_with_factor(int64_t factor, int begin, int end) const {
    return cost_prefix_[end] - cost_prefix_[begin] + factor * (activation_prefix_[end] - activation_prefix_[begin]);
  }

 private:
  std::vector<int64_t> cost_prefix_;        // [n + 1]; entry i = sum(unit_cost[0..i))
  std::vector<int64_t> activation_prefix_;  // [n + 1]; entry i = sum(unit_activation[0..i))
  std::vector<int64_t> factor_;             // [stages]
  int stages_;
};

// ---- Step 1: the smallest bottleneck -------------------------------------------------------

// Whether units [0, n) can be covered by exactly P non-empty stages, each costing <= budget.
//
// Stage by stage, the search marks every end e such that [0, e) is exactly covered by stages
// 0..k-1. Stage k may then run [s, e) for any marked s in [first, e-1], where `first` is the
// smallest start with cost(k, first, e) <= budget: costs only grow as a range grows, so the
// valid starts are an interval and `first` never moves left as e grows (two pointers). A prefix
// count of the marks answers "is any start in the interval marked" in O(1).
bool fits_in_budget(const StageCosts& costs, int64_t budget) {
  const int n = costs.units();
  const int stages = costs.stages();
  // [n + 2]; entry i = number of ends < i that stages 0..k-1 cover exactly. Initially k = 0,
  // which covers only the end 0.
  std::vector<int> covered_before(n + 2, 1);
  covered_before[0] = 0;
  std::vector<int> next_covered_before(n + 2);
  for (int stage = 0; stage < stages; ++stage) {
    // Stage k ends somewhere in [k + 1, n - (P - 1 - k)]: every stage holds at least one unit.
    const int lowest_end = stage + 1;
    const int highest_end = n - (stages - 1 - stage);
    std::fill(next_covered_before.begin(), next_covered_before.begin() + lowest_end + 1, 0);
    int first = 0;
    for (int end = lowest_end; end <= highest_end; ++end) {
      while (first < end && costs.cost(stage, first, end) > budget) ++first;
      const bool covered = first < end && covered_before[end] > covered_before[first];
      next_covered_before[end + 1] = next_covered_before[end] + covered;
    }
    if (next_covered_before[highest_end + 1] == 0) return false;
    std::fill(next_covered_before.begin() + highest_end + 2, next_covered_before.end(),
              next_covered_before[highest_end + 1]);
    std::swap(covered_before, next_covered_before);
  }
  return covered_before[n + 1] > covered_before[n];
}

// An interval [low, high] that contains the smallest bottleneck; it saves binary-search probes.
struct BottleneckBounds {
  int64_t low;
  int64_t high;
};

// low: every unit lies in some stage, which costs at least the unit under the cheapest factor;
// and the P stage costs add up to at least the total under the cheapest factor.
// high: price every stage with the dearest factor f, making costs additive per unit
// (c_i = unit_cost[i] + f * unit_activation[i], total T). Cutting where the prefix sum first
// reaches T/P, 2T/P, ... gives stages of at most ceil(T/P) + max c_i; stages left empty by a
// large unit can be refilled by splitting others (P <= n), which raises no stage's cost, and
// the real price of a stage never exceeds its price at f.
BottleneckBounds bottleneck_bounds(const StageCosts& costs) {
  const int n = costs.units();
  const int64_t stages = costs.stages();
  const int64_t cheap = costs.smallest_factor();
  const int64_t dear = costs.largest_factor();
  int64_t largest_unit_cheap = 0;
  int64_t largest_unit_dear = 0;
  for (int i = 0; i < n; ++i) {
    largest_unit_cheap = std::max(largest_unit_cheap, costs.cost_with_factor(cheap, i, i + 1));
    largest_unit_dear = std::max(largest_unit_dear, costs.cost_with_factor(dear, i, i + 1));
  }
  const int64_t total_cheap = costs.cost_with_factor(cheap, 0, n);
  const int64_t total_dear = costs.cost_with_factor(dear, 0, n);
  const int64_t average_cheap = total_cheap / stages + (total_cheap % stages != 0);
  const int64_t average_dear = total_dear / stages + (total_dear % stages != 0);
  // average_dear + largest_unit_dear may exceed int64; total_dear is a bound on its own.
  const int64_t high = largest_unit_dear > total_dear - average_dear ? total_dear : average_dear + largest_unit_dear;
  return {std::max(largest_unit_cheap, average_cheap), high};
}

// Binary search over integers: fits_in_budget is monotone in the budget.
int64_t smallest_bottleneck(const StageCosts& costs) {
  auto [low, high] = bottleneck_bounds(costs);
  PIPESHARD_CHECK(low <= high);
  while (low < high) {
    const int64_t middle = low + (high - low) / 2;
    if (fits_in_budget(costs, middle)) {
      high = middle;
    } else {
      low = middle + 1;
    }
  }
  return low;
}

// ---- Step 2: the cheapest cuts under that bottleneck ---------------------------------------

// What the cut DP minimises, lexicographically: bytes crossing the cuts, then how far the
// cuts sit from their even shares (see balance_deviation).
struct CutScore {
  int64_t bytes = 0;
  Int128 deviation = 0;
  bool operator<(const CutScore& o) const { return bytes != o.bytes ? bytes < o.bytes : deviation < o.deviation; }
};

// Sliding-window minimum over candidate indices that enter in decreasing order and leave from
// the largest index down. Among equal values the smallest index wins (our tie-break rule).
class MinWindow {
 public:
  explicit MinWindow(size_t capacity) { indices_.reserve(capacity); }

  void push(int index, CutScore value) {
    // A newer (smaller) index with a value no larger stays in the window longer, so it
    // makes older entries with larger or equal values useless.
    while (size() > 0 && !(values_.back() < value)) pop_back();
    indices_.push_back(index);
    values_.push_back(value);
  }
  // Drops entries whose index is above `last_index`.
  void drop_above(int last_index) {
    while (size() > 0 && indices_[head_] > last_index) ++head_;
  }
  size_t size() const { return indices_.size() - head_; }
  int best_index() const { return indices_[head_]; }
  CutScore best_value() const { return values_[head_]; }

 private:
  void pop_back() {
    indices_.pop_back();
    values_.pop_back();
  }
  std::vector<int> indices_;      // increasing values from head_ to back, decreasing indices
  std::vector<CutScore> values_;  // parallel to indices_
  size_t head_ = 0;
};

// |P * W(before unit j) - k * W(all)|: how far a cut before unit j, opening stage k, is from
// the k-th even share of the weight W = unit_cost + unit_activation (units when all are 0).
class BalanceDeviation {
 public:
  explicit BalanceDeviation(const PipelineSplitProblem& p) : stages_(p.stages), prefix_(p.unit_cost.size() + 1, 0) {
    for (size_t i = 0; i < p.unit_cost.size(); ++i) {
      prefix_[i + 1] = prefix_[i] + p.unit_cost[i] + (p.unit_activation.empty() ? 0 : p.unit_activation[i]);
    }
    if (prefix_.back() == 0) {
      for (size_t i = 0; i < prefix_.size(); ++i) prefix_[i] = static_cast<Int128>(i);
    }
  }
  Int128 operator()(int stage, int unit) const {
    const Int128 d = Int128(stages_) * prefix_[unit] - Int128(stage) * prefix_.back();
    return d < 0 ? -d : d;
  }

 private:
  int stages_;
  std::vector<Int128> prefix_;  // [n + 1]
};

constexpr int64_t kUnreachable = kInt64Max;

// Returns stage_begin of the split with every stage costing <= budget that minimises total cut
// bytes, then the summed BalanceDeviation of its cuts, ties broken towards the
// lexicographically smallest stage_begin. Requires fits_in_budget(costs, budget).
//
// Dynamic program from the last stage backwards: for stage k, next_tail[s] = best score to
// cover [s, n) with stages k..P-1 (not counting the cut at s itself). Stage k starting at s
// may end at any e in [s+1, last], where `last` is the largest end with cost(k, s, e) <= budget;
// as s moves left `last` never moves right, so a sliding-window minimum over e of the cut at e
// plus tail[e] (stages k+1..P-1 from e) gives each entry in amortised O(1). Both parts of a
// cut's score depend on the cut alone, which is what keeps the window valid.
std::vector<int> cheapest_cuts_within_budget(const StageCosts& costs, const PipelineSplitProblem& problem,
                                             int64_t budget) {
  const int n = costs.units();
  const int stages = costs.stages();
  const BalanceDeviation deviation(problem);
  // [stages, n]; chosen_end[k][s] = where stage k ends when it starts at unit s.
  std::vector<std::vector<int>> chosen_end(stages, std::vector<int>(n, -1));
  const CutScore unreachable{kUnreachable, 0};
  std::vector<CutScore> tail(n + 1, unreachable);  // [n + 1]; for stages k+1..P-1
  std::vector<CutScore> next_tail(n + 1);          // [n + 1]; for stages k..P-1
  for (int stage = stages - 1; stage >= 0; --stage) {
    std::fill(next_tail.begin(), next_tail.end(), unreachable);
    const bool is_last_stage = stage == stages - 1;
    MinWindow window(static_cast<size_t>(n));
    int last = n;
    for (int start = n - 1; start >= 0; --start) {
      while (last > start && costs.cost(stage, start, last) > budget) --last;
      if (is_last_stage) {
        if (last == n) {
          next_tail[start] = CutScore{0, 0};
          chosen_end[stage][start] = n;
        }
        continue;
      }
      const int candidate = start + 1;
      if (tail[candidate].bytes != kUnreachable) {
        window.push(candidate, CutScore{problem.cut_bytes[candidate] + tail[candidate].bytes,
                                        deviation(stage + 1, candidate) + tail[candidate].deviation});
      }
      window.drop_above(last);
      if (window.size() > 0) {
        next_tail[start] = window.best_value();
        chosen_end[stage][start] = window.best_index();
      }
    }
    std::swap(tail, next_tail);
  }
  PIPESHARD_CHECK(tail[0].bytes != kUnreachable, "budget " + std::to_string(budget));

  std::vector<int> stage_begin(stages + 1);  // [stages + 1]
  stage_begin[0] = 0;
  for (int stage = 0; stage < stages; ++stage) {
    stage_begin[stage + 1] = chosen_end[stage][stage_begin[stage]];
    PIPESHARD_CHECK(stage_begin[stage + 1] > stage_begin[stage]);
  }
  PIPESHARD_CHECK(stage_begin[stages] == n);
  return stage_begin;
}

PipelineSplit describe_split(const StageCosts& costs, const std::vector<int64_t>& cut_bytes,
                             std::vector<int> stage_begin) {
  PipelineSplit split;
  for (int stage = 0; stage < costs.stages(); ++stage) {
    const int64_t cost = costs.cost(stage, stage_begin[stage], stage_begin[stage + 1]);
    split.stage_cost.push_back(cost);
    split.max_stage_cost = std::max(split.max_stage_cost, cost);
    if (stage > 0) split.crossing_bytes += cut_bytes[stage_begin[stage]];
  }
  split.stage_begin = std::move(stage_begin);
  return split;
}

}  // namespace

Status validate_pipeline_split_problem(const PipelineSplitProblem& problem) {
  PIPESHARD_RETURN_IF_ERROR(check_sizes(problem));
  PIPESHARD_RETURN_IF_ERROR(check_non_negative("unit_cost", problem.unit_cost));
  PIPESHARD_RETURN_IF_ERROR(check_non_negative("unit_activation", problem.unit_activation));
  PIPESHARD_RETURN_IF_ERROR(check_non_negative("stage_activation_factor", problem.stage_activation_factor));
  PIPESHARD_RETURN_IF_ERROR(check_non_negative("cut_bytes", problem.cut_bytes));
  return check_fits_int64(problem);
}

Result<PipelineSplit> split_pipeline(const PipelineSplitProblem& problem) {
  PIPESHARD_RETURN_IF_ERROR(validate_pipeline_split_problem(problem));
  const StageCosts costs(problem);
  const int64_t bottleneck = smallest_bottleneck(costs);
  PipelineSplit split =
      describe_split(costs, problem.cut_bytes, cheapest_cuts_within_budget(costs, problem, bottleneck));
  PIPESHARD_CHECK(split.max_stage_cost == bottleneck);
  return split;
}

int64_t stage_cost(const PipelineSplitProblem& problem, int stage, int begin, int end) {
  const int n = static_cast<int>(problem.unit_cost.size());
  PIPESHARD_CHECK(0 <= begin && begin <= end && end <= n,
                  "units [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " + std::to_string(n));
  PIPESHARD_CHECK(0 <= stage && stage < problem.stages, "stage " + std::to_string(stage));
  PIPESHARD_CHECK(problem.unit_activation.empty() || problem.unit_activation.size() == static_cast<size_t>(n));
  PIPESHARD_CHECK(problem.stage_activation_factor.empty() ||
                  problem.stage_activation_factor.size() == static_cast<size_t>(problem.stages));
  Int128 cost = 0;
  Int128 activation = 0;
  for (int i = begin; i < end; ++i) {
    cost += problem.unit_cost[i];
    if (!problem.unit_activation.empty()) activation += problem.unit_activation[i];
  }
  if (!problem.stage_activation_factor.empty() && activation != 0) {
    const Int128 factor = problem.stage_activation_factor[stage];
    // factor * activation may overflow even Int128 on absurd input; saturate before multiplying.
    if (factor != 0 && activation > (Int128(kInt64Max) - cost) / factor) return kInt64Max;
    cost += factor * activation;
  }
  return cost > kInt64Max ? kInt64Max : static_cast<int64_t>(cost);
}

}  // namespace pipeshard
