// Pipeline schedules as data: per stage, the ordered list of actions (forward and
// backward of micro-batch k, send and receive of its activation or gradient) that the
// executor will run, built before training and checked for matching transfers and
// deadlocks, and printable as a step × stage grid.
//
// Conventions shared by every schedule made here (P stages, M micro-batches):
//   - Activations flow from stage s to s + 1, gradients from s + 1 to s; an Action
//     names no peer because the direction fixes it.
//   - On stage s > 0, F(k) is preceded by rA(k); on s < P − 1 it is followed by sA(k).
//     On s < P − 1, B(k) is preceded by rG(k); on s > 0 it is followed by sG(k). The
//     last stage computes the loss inside F(k), so its B(k) needs no receive.
//   - Forwards run in micro-batch order 0 .. M−1 and so do backwards, in both
//     schedules (as PyTorch's ScheduleGPipe and Schedule1F1B do). Gradients therefore
//     accumulate in the same order under GPipe and 1F1B, which keeps the two
//     bitwise-comparable.
//   - Transfers on one link (stage pair and direction) match in issue order, as NCCL
//     point-to-point does: the k-th send on a link pairs with the k-th receive.
//
// The schedules:
//   kGPipe  all M forwards, then all M backwards; M micro-batches in flight per stage.
//   k1F1B   PipeDream-flush: stage s runs min(P − 1 − s, M) warm-up forwards, then
//           alternates one forward and one backward, then drains the remaining
//           backwards; at most min(P − s, M) micro-batches in flight on stage s.
//
// Communication semantics (SendMode): the executor posts sends without blocking and
// blocks on receives until the matching send has been posted (kBuffered); every
// schedule made here is deadlock-free under it. Under rendezvous semantics
// (kRendezvous: a send completes only when the peer is at the matching receive in the
// same step, as a blocking MPI_Ssend or a single-stream NCCL send/recv behaves), GPipe
// is deadlock-free but 1F1B deadlocks for P ≥ 2 and M ≥ 2 (stage s sends an
// activation while stage s + 1 sends a gradient): an executor must not run 1F1B with
// blocking sends.
#ifndef PIPESHARD_SCHEDULE_SCHEDULE_H_
#define PIPESHARD_SCHEDULE_SCHEDULE_H_

#include <string>
#include <vector>

#include "common/status.h"
#include "partitioner/plan.h"  // ScheduleKind

namespace pipeshard {

enum class ActionKind {
  kForward,         // F:  forward of the stage's slice for one micro-batch
  kBackward,        // B:  backward of it (gradients accumulate into the parameters)
  kSendActivation,  // sA: send the forward output to stage + 1
  kRecvActivation,  // rA: receive the forward input from stage − 1
  kSendGradient,    // sG: send the input gradient to stage − 1
  kRecvGradient,    // rG: receive the output gradient from stage + 1
};

struct Action {
  ActionKind kind = ActionKind::kForward;
  int micro_batch = 0;  // 0 .. micro_batches − 1
  bool operator==(const Action&) const = default;
};

struct PipelineSchedule {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int stages = 1;         // P
  int micro_batches = 1;  // M
  std::vector<std::vector<Action>> actions;  // [stages][...], in execution order on that stage
};

// How the deadlock check (and the grid's timing) treats point-to-point transfers.
enum class SendMode {
  kBuffered,    // sends never block; a receive blocks until its send has been issued
  kRendezvous,  // a send and its receive complete together, in the same step
};

// The schedule of `kind` for `stages` ≥ 1 and `micro_batches` ≥ 1 (aborts otherwise:
// callers validate flags first). It passes check_pipeline_schedule(kBuffered).
PipelineSchedule make_pipeline_schedule(ScheduleKind kind, int stages, int micro_batches);

// OK when `schedule` is well formed and runs to the end under `mode`. Well formed:
// actions.size() == stages; micro-batch indices in range; on every stage exactly one
// F(k) and one B(k) per micro-batch, B(k) after F(k); exactly the transfers listed in
// the conventions above, each receive before the compute that uses it and each send
// after the compute that produces it, none towards a missing neighbour; and on every
// link the k-th send and the k-th receive carry the same micro-batch. Runs to the
// end: the step simulation of format_pipeline_schedule() finishes every stage. Errors
// name the stage and action, e.g. "stage 2: no sA3 after F3" or
// "deadlock (buffered sends) at step 5: stage 1 waits at rG3 while stage 2 waits at rA4".
Status check_pipeline_schedule(const PipelineSchedule& schedule, SendMode mode = SendMode::kBuffered);

// The schedule as a step × stage grid, one row per step of the simulation under
// `mode`: in each step every stage runs its next action if it can (compute always
// can; transfers as SendMode says; a buffered receive may complete in the step of its
// send), "." marks a stage that waits or has finished. A schedule that deadlocks
// prints up to the stuck step and then the deadlock message. Example (1F1B, P=2, M=2):
//   step  stage0  stage1
//   0     F0      .
//   1     sA0     rA0
//   ...
std::string format_pipeline_schedule(const PipelineSchedule& schedule,
                                     SendMode mode = SendMode::kBuffered);

// Steps the simulation under `mode` takes to finish every stage, or the deadlock.
Result<int> pipeline_schedule_steps(const PipelineSchedule& schedule,
                                    SendMode mode = SendMode::kBuffered);

// Most micro-batches on `stage` whose forward has run and whose backward has not, at
// any point of its action list: the activations it must keep alive at once.
int max_in_flight(const PipelineSchedule& schedule, int stage);

// "F3", "B3", "sA3", "rA3", "sG3", "rG3".
std::string action_name(const Action& action);
// "gpipe" or "1f1b", as the --schedule flag spells them.
const char* schedule_kind_name(ScheduleKind kind);
const char* send_mode_name(SendMode mode);  // "buffered sends" or "rendezvous sends"

}  // namespace pipeshard

#endif  // PIPESHARD_SCHEDULE_SCHEDULE_H_
