// Interleaved 1F1B (schedule/builders.h).
//
// Every stage runs its forwards in one order, Megatron's "virtual micro-batches": the
// micro-batches are cut into groups, and each group runs through the stage's chunk 0,
// then through its chunk 1, ..., before the next group starts. Megatron's groups hold P
// micro-batches (it refuses M that are not a multiple of P, or fewer than P); here there
// are ⌊M/P⌋ groups (one when M < P), as even as possible and larger first, so any M runs:
// each group holds at least P micro-batches when M ≥ P, and no later group is larger than
// the first (both matter, below). Backwards run in the same order with the chunks
// reversed (chunk v − 1 − j where the forwards have chunk j).
//
// Stage s forwards 2(P − 1 − s) + (v − 1)·G₀ virtual micro-batches before its first
// backward, G₀ the first group's size (capped at all M·v of them), then alternates one
// forward and one backward, then drains the backwards. The last stage must have forwarded
// its first micro-batch through its last chunk, (v − 1)·G₀ + 1 forwards in, before it can
// start the backward sweep; each stage above it needs two more, one for the activation
// still to travel down and one for the gradient to come back, as in 1F1B.
//
// Why it never deadlocks: the backward of virtual micro-batch b needs the forward of the
// same micro-batch through the stage's last chunk, which lies (v − 1)·G forwards after b's
// position in the forward order (G its group's size); with the warm-up's lead of
// (v − 1)·G₀ that forward has run as long as G ≤ G₀ (a later, larger group deadlocks: the
// checker shows it). And a micro-batch comes back to stage 0 for its next chunk P forward
// passes after it left, so a group of at least P never makes stage 0 wait for it: with
// M ≥ P the schedule has the textbook bubble. Each chunk's backwards run in micro-batch
// order, so every weight gradient adds its micro-batches in one process's order.
#include <algorithm>
#include <vector>

#include "schedule/builders.h"

namespace pipeshard {
namespace {

// The sizes of the groups each chunk runs in turn: ⌊M/P⌋ of them (one when M < P), as
// even as possible, larger first.
std::vector<int> micro_batch_groups(int stages, int micro_batches) {
  const int groups = std::max(1, micro_batches / stages);
  std::vector<int> sizes;
  for (int g = 0; g < groups; ++g) sizes.push_back(micro_batches / groups + (g < micro_batches % groups ? 1 : 0));
  return sizes;
}

// The forwards of every stage, in the order each runs them: per group, every chunk in turn
// over the group's micro-batches.
std::vector<Action> forward_order(int stages, int micro_batches, int chunks_per_stage) {
  std::vector<Action> order;
  int first = 0;
  for (int size : micro_batch_groups(stages, micro_batches)) {
    for (int j = 0; j < chunks_per_stage; ++j) {
      for (int k = first; k < first + size; ++k) order.push_back({ActionKind::kForward, k, j});
    }
    first += size;
  }
  return order;
}

int warmup_forwards(int stages, int micro_batches, int stage, int chunks_per_stage) {
  const int first_group = micro_batch_groups(stages, micro_batches)[0];
  return std::min(micro_batches * chunks_per_stage, 2 * (stages - 1 - stage) + (chunks_per_stage - 1) * first_group);
}

}  // namespace

ComputeOrder interleaved_one_f_one_b(int stages, int micro_batches, int chunks_per_stage) {
  PIPESHARD_CHECK(stages >= 1 && micro_batches >= 1 && chunks_per_stage >= 1,
                  "interleaved 1F1B of " + std::to_string(stages) + " stages, " + std::to_string(micro_batches) +
                      " micro-batches, " + std::to_string(chunks_per_stage) + " chunks per stage");
  const std::vector<Action> forwards = forward_order(stages, micro_batches, chunks_per_stage);
  const int total = static_cast<int>(forwards.size());
  ComputeOrder order(stages);
  for (int s = 0; s < stages; ++s) {
    const int warmup = warmup_forwards(stages, micro_batches, s, chunks_per_stage);
    int f = 0, b = 0;
    auto backward = [&] {
      const Action& like = forwards[b++];
      order[s].push_back({ActionKind::kBackward, like.micro_batch, chunks_per_stage - 1 - like.chunk});
    };
    while (f < warmup) order[s].push_back(forwards[f++]);
    while (f < total) {
      order[s].push_back(forwards[f++]);
      backward();
    }
    while (b < total) backward();
  }
  return order;
}

// The warm-up's forwards, and one more in the steady state before its backward frees one.
int interleaved_in_flight(int stages, int micro_batches, int stage, int chunks_per_stage) {
  return std::min(micro_batches * chunks_per_stage,
                  warmup_forwards(stages, micro_batches, stage, chunks_per_stage) + 1);
}

// With M ≥ P the textbook figure (Narayanan et al.): P − 1 chunk passes of F + B fill and
// drain the pipeline beside the v·M of each stage's work, (P − 1)/(vM + P − 1). With M < P
// every micro-batch waits for its own trip round the P stages before its next chunk, and
// the schedule runs as 1F1B on vP stages: a step of (vP + M − 1)(F + B) beside v·M(F + B)
// of work, (v(P − M) + M − 1)/(vP + M − 1). Both are what predict_schedule() gives at unit
// costs (tests/schedule/multi_chunk_schedule_test.cc), which is why the row states the
// exact figure and not the textbook one alone.
double interleaved_bubble(int stages, int micro_batches, int chunks_per_stage) {
  const int p = stages, m = micro_batches, v = chunks_per_stage;
  if (m >= p) return static_cast<double>(p - 1) / (v * m + p - 1);
  return static_cast<double>(v * (p - m) + m - 1) / (v * p + m - 1);
}

}  // namespace pipeshard
