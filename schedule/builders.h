// The builders of the registry's rows that hold several chunks per stage, with the facts
// their rows state (schedule/registry.h: in flight, bubble, what counts they run), each in
// its own file: interleaved.cc, zero_bubble_v.cc. Internal to schedule/: the rest of
// pipeshard reaches them through the registry.
#ifndef PIPESHARD_SCHEDULE_BUILDERS_H_
#define PIPESHARD_SCHEDULE_BUILDERS_H_

#include <vector>

#include "common/status.h"
#include "schedule/schedule.h"

namespace pipeshard {

// Interleaved 1F1B (Megatron-LM, Narayanan et al., SC 2021; PyTorch's
// ScheduleInterleaved1F1B) on P stages of v ≥ 2 chunks each, chunk c on stage c mod P, for
// any M ≥ 1: whole backwards (B), each chunk's forwards and backwards in micro-batch order.
ComputeOrder interleaved_one_f_one_b(int stages, int micro_batches, int chunks_per_stage);
// What max_in_flight() counts on stage s of that schedule.
int interleaved_in_flight(int stages, int micro_batches, int stage, int chunks_per_stage);
// Its exact bubble at F = 1, B = 2 per chunk, transfers free.
double interleaved_bubble(int stages, int micro_batches, int chunks_per_stage);

// ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, and "Pipeline Parallelism
// with Controllable Memory", 2024) on P stages of 2 chunks each in a V: stage s holds chunks
// s and 2P − 1 − s. Backwards split into I and W; each chunk's F, I and W in micro-batch
// order. Correct for any M ≥ 1; the row runs M ≥ P (zero_bubble_v_accepts()).
ComputeOrder zero_bubble_v(int stages, int micro_batches);
// [2P] the stage of each chunk: the V.
std::vector<int> zero_bubble_v_placement(int stages);
// What max_in_flight() counts on every stage: 2·min(P, M).
int zero_bubble_v_in_flight(int stages, int micro_batches);
// Its bubble at F = I = W = 1 per chunk, transfers free, for M ≥ P: (P − 1)/(6M + P − 1).
double zero_bubble_v_bubble(int stages, int micro_batches);
// OK for M ≥ P; otherwise "zb-v needs at least as many micro-batches (2) as stages (4)".
Status zero_bubble_v_accepts(int stages, int micro_batches);

}  // namespace pipeshard

#endif  // PIPESHARD_SCHEDULE_BUILDERS_H_
