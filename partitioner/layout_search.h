// Every way to train a Graph on N ranks, and which of them fit in memory.
//
// search_layouts() enumerates the layouts `train` can run on N ranks: D data-parallel
// replicas × P pipeline stages × T tensor-parallel shards == N, the micro-batches M, every
// registered pipeline schedule (schedule/registry.h) with its chunks per stage, activations
// recomputed or kept (train --keep-activations) and the ZeRO stage (train --zero). Each is
// cut by make_plan() with the PartitionOptions train uses (layout_partition_options(),
// which runtime/trainer.cc calls too), so its memory estimate is the one train checks
// before it starts.
// A layout is accepted when the plan is made and its largest stage fits the memory per
// rank; otherwise it is rejected with the reason. Nothing here predicts time: ranking the
// accepted layouts is the planner's (planner/planner.h).
#ifndef PIPESHARD_PARTITIONER_LAYOUT_SEARCH_H_
#define PIPESHARD_PARTITIONER_LAYOUT_SEARCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "partitioner/plan.h"

namespace pipeshard {

// One way to train: what train's flags would say.
struct Layout {
  int replicas = 1;               // D (data-parallel replicas)
  int stages = 1;                 // P (pipeline stages, --stages)
  int shards = 1;                 // T (tensor-parallel shards, --tensor-parallel)
  int micro_batches = 1;          // M per replica batch (--micro-batches); 0 in a rejection for every M
  std::string schedule;           // a registered schedule (--schedule); empty in a rejection for every schedule
  int virtual_stages = 0;         // chunks per stage where the schedule lets it be chosen, else 0
  bool keep_activations = false;  // --keep-activations: nothing recomputed in backward
  int zero = 0;                   // ZeRO stage (--zero): 0, 1 or 2; 0 when D == 1

  int ranks() const { return replicas * stages * shards; }
  // "D=2 P=2 T=1 M=4 1f1b zero 1", with " v=3" after a schedule whose chunks per stage
  // were chosen and " keep-activations" before the ZeRO stage when set; "D=3 P=2 T=1" alone
  // for a rejection of every M and schedule.
  std::string text() const;
};

bool operator==(const Layout& a, const Layout& b);
bool operator<(const Layout& a, const Layout& b);  // in the order search_layouts() lists them

struct LayoutSearchOptions {
  int ranks = 1;                           // N
  int64_t batch_size = 32;                 // B, the global batch per step (train --batch-size), split over D
  int optimizer_slots = 2;                 // float32 state per parameter (Adam: 2, SGD+momentum: 1, SGD: 0)
  int64_t memory_per_rank = 0;             // bytes; 0: unlimited
  int64_t bucket_bytes = 25 << 20;         // gradient bucket size (train --bucket-mb)
  BalanceBy balance = BalanceBy::kParams;  // how stages are cut (train --balance)
  // Fused activations the backend keeps anyway (PartitionOptions::kept_when_fused).
  std::vector<ActivationKind> kept_when_fused;
  // Micro-batch counts to try; empty: every divisor of the replica's batch B/D up to
  // max_micro_batches. A count that does not divide B/D is rejected (train refuses it).
  std::vector<int> micro_batches;
  int max_micro_batches = 16;
  // Chunks per stage to try for a schedule that lets the user choose them (interleaved).
  std::vector<int> virtual_stages = {2, 3, 4};
};

// An accepted layout and its memory estimate per rank.
struct LayoutFit {
  Layout layout;
  Plan plan;                             // the cut it trains with
  std::vector<int64_t> bytes_per_stage;  // [P] memory_per_stage() of its plan: bytes on each rank of stage p
  int64_t peak_bytes = 0;                // the largest of them
};

struct RejectedLayout {
  Layout layout;
  std::string reason;                    // one sentence: make_plan()'s error, or train's, or the memory over budget
  bool for_memory = false;               // the plan is made but its peak exceeds memory_per_rank
  std::vector<int64_t> bytes_per_stage;  // [P] when for_memory, else empty
  int64_t peak_bytes = 0;                // when for_memory
};

struct LayoutSearch {
  std::vector<LayoutFit> accepted;       // in enumeration order (operator< on Layout)
  std::vector<RejectedLayout> rejected;  // in enumeration order
  int rejected_for_memory = 0;           // how many of `rejected` have for_memory
  size_t size() const { return accepted.size() + rejected.size(); }
};

// The space, in this order (nested loops, outermost first):
// - D ascending over the divisors of N, then P ascending over those of N/D; T = N/D/P.
//   Where B % D != 0, one rejection for the whole (D, P, T), with micro_batches 0 and no
//   schedule.
// - Schedules in schedule_names() order; with P == 1 only PartitionOptions' default
//   ("1f1b"): train refuses --schedule with one stage, so it is the only one train runs.
//   For a schedule whose chunks per stage the user chooses, each of options.virtual_stages;
//   otherwise virtual_stages 0 (the schedule's own).
// - M: options.micro_batches, or the divisors of B/D up to max_micro_batches.
// - keep_activations false, then true (false alone when the model recomputes nothing, so
//   the flag changes nothing); ZeRO 0, 1, 2 (only 0 when D == 1, and not 2 where train
//   runs it as stage 1: a schedule with I and W passes or several chunks per stage, or
//   buckets so few and large that its memory estimate is ZeRO-1's on every stage).
// Every layout of it is accepted or rejected once: its size is accepted + rejected.
LayoutSearch search_layouts(const Graph& graph, const LayoutSearchOptions& options);

// The divisors of n from 1 up to cap, ascending: the counts the search walks (D, P, M).
std::vector<int> divisors(int64_t n, int64_t cap);

// The PartitionOptions `layout` is cut with, by train (runtime/trainer.cc) as by the
// search, under `options`' batch, optimizer slots, buckets, balance and fused activations.
PartitionOptions layout_partition_options(const Layout& layout, const LayoutSearchOptions& options);

}  // namespace pipeshard

#endif  // PIPESHARD_PARTITIONER_LAYOUT_SEARCH_H_
