// Choosing where to cut a model into pipeline stages.
//
// The model's topological order has been grouped into n units (layers), numbered 0..n-1.
// A split into P stages is a list of P-1 cut positions: stage k holds the contiguous units
// [stage_begin[k], stage_begin[k+1]) and every stage holds at least one unit.
//
// Cost model. Costs are abstract non-negative integers (the importer uses bytes or parameter
// counts; the partitioner only compares and adds them). The cost of units [a, b) placed as
// stage k is
//
//     sum(unit_cost[a..b)) + stage_activation_factor[k] * sum(unit_activation[a..b))
//
// where the second term models memory that depends on the stage's position (under 1F1B, stage k
// keeps P-k micro-batches of activations in flight). Cutting just before unit j sends
// cut_bytes[j] bytes between neighbouring stages.
//
// Objective, lexicographic: (1) minimise the largest stage cost (the bottleneck); (2) among those
// splits, minimise the total cut_bytes over the P-1 cuts; (3) among those, put the cuts nearest
// their even shares: minimise the sum over cuts k = 1..P-1 of |P * W(stage_begin[k]) - k * W(n)|,
// where W(j) sums unit_cost + unit_activation over units [0, j) (unit counts when every weight is
// 0) — without it, the many splits that tie on a bottleneck set by one stage would put tiny stages
// first; (4) among those, return the split whose stage_begin is lexicographically smallest.
// The result is therefore a deterministic function of the problem.
#ifndef PIPESHARD_PARTITIONER_PIPELINE_SPLIT_H_
#define PIPESHARD_PARTITIONER_PIPELINE_SPLIT_H_

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace pipeshard {

// The input to split_pipeline; n = unit_cost.size(). All entries must be >= 0.
struct PipelineSplitProblem {
  std::vector<int64_t> unit_cost;                // [n]; position-independent cost of each unit
  std::vector<int64_t> unit_activation;          // [n] or empty (= all zero)
  std::vector<int64_t> stage_activation_factor;  // [stages] or empty (= all zero)
  std::vector<int64_t> cut_bytes;                // [n + 1]; entry j = bytes crossing a cut before
                                                 // unit j (only 1..n-1 can be cut; 0 and n unused)
  int stages = 1;                                // P, in [1, n]
};

// An optimal split (see the objective above).
struct PipelineSplit {
  std::vector<int> stage_begin;     // [stages + 1]; stage k holds units [stage_begin[k],
                                    // stage_begin[k+1]); stage_begin[0] = 0, back() = n,
                                    // strictly increasing (no empty stage)
  int64_t max_stage_cost = 0;       // the bottleneck: max over k of stage_cost[k]
  int64_t crossing_bytes = 0;       // sum of cut_bytes[stage_begin[k]] for k in 1..stages-1
  std::vector<int64_t> stage_cost;  // [stages]; stage_cost(problem, k, begin_k, end_k)
};

// Returns OK when `problem` is a well-formed instance: n >= 1, 1 <= stages <= n, vector sizes as
// documented on PipelineSplitProblem, no negative entry, and every possible stage cost and the
// total of cut_bytes fit in int64 (so that no sum the algorithm forms can overflow).
Status validate_pipeline_split_problem(const PipelineSplitProblem& problem);

// Finds the optimal split of `problem` (see the objective above), or returns the validation
// error ("cannot make 5 non-empty stages from 3 layers", ...).
//
// Algorithm: binary search over integers for the smallest bottleneck B, between a lower bound
// (largest single unit, average stage) and an upper bound (average stage + largest unit, priced
// at the dearest factor), each probe an O(P·n) feasibility check; then, with B fixed, an O(P·n)
// dynamic program over (stage, first unit) that minimises (cut bytes, deviation) using a
// sliding-window minimum. Time O(P·n·log(max cost)) (about 25 ms for n = 2000, P = 64 at -O2); memory O(P·n)
// ints for the chosen cuts.
Result<PipelineSplit> split_pipeline(const PipelineSplitProblem& problem);

// Cost of units [begin, end) placed as stage `stage` (formula above); 0 for an empty range.
// Requires 0 <= begin <= end <= n, 0 <= stage < problem.stages, and the vector sizes that
// validate_pipeline_split_problem demands (aborts otherwise). Saturates at INT64_MAX instead
// of overflowing; a validated problem never reaches it. O(end - begin).
int64_t stage_cost(const PipelineSplitProblem& problem, int stage, int begin, int end);

}  // namespace pipeshard

#endif  // PIPESHARD_PARTITIONER_PIPELINE_SPLIT_H_
