// The builders of the registry's rows that hold several chunks per stage, with the facts
// their rows state (schedule/registry.h: in flight, bubble, what counts they run), each in
// its own file: interleaved.cc. Internal to schedule/: the rest of pipeshard reaches them
// through the registry.
#ifndef PIPESHARD_SCHEDULE_BUILDERS_H_
#define PIPESHARD_SCHEDULE_BUILDERS_H_

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

}  // namespace pipeshard

#endif  // PIPESHARD_SCHEDULE_BUILDERS_H_
