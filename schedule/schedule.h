// Pipeline schedules as data: per pipeline stage, the ordered list of actions
// (schedule/action.h) that the stage runner (runtime/stage_runner.h) will run, built
// before training, checked for matching transfers and deadlocks, and printable as a
// step × stage grid. PyTorch's torch.distributed.pipelining works the same way
// (_Action lists, _format_pipeline_order).
//
// A schedule is made in two passes:
//   1. its builder (one row of the registry, schedule/registry.h) lists each stage's
//      compute actions only: F, B, or I and W, each with its chunk and micro-batch;
//   2. lower_schedule() adds what every schedule needs alike: the transfers around each
//      compute and, when data-parallel replicas reduce gradients, R after each chunk's
//      last gradient pass. So a new schedule is a builder and nothing else.
//
// Conventions of the lowered lists (P stages, M micro-batches, C chunks):
//   - Activations flow from chunk c to c + 1, gradients from c + 1 to c; an Action names
//     no peer because the chunks' placement fixes it. Neighbouring chunks on the same
//     stage hand over in place, without transfers.
//   - F(c, k) is preceded by rA(c, k) when chunk c − 1 is on another stage, and followed by
//     sA(c, k) when chunk c + 1 is. B(c, k) or I(c, k) is preceded by rG(c, k) when chunk
//     c + 1 is on another stage, and followed by sG(c, k) when chunk c − 1 is. The last
//     chunk computes the loss inside F, so its backward needs no receive. W(c, k) needs no
//     transfer: it reads what I(c, k) left.
//   - Transfers of one kind between two stages match in issue order, as NCCL
//     point-to-point does: the k-th send of activations from stage s to stage t pairs with
//     the k-th receive of activations on t from s; likewise for gradients.
//
// Communication semantics (SendMode): the stage runner posts sends without blocking and
// blocks on receives until the matching send has been posted (kBuffered); every
// schedule made here is deadlock-free under it. Under rendezvous semantics
// (kRendezvous: a send completes only when the peer is at the matching receive in the
// same step, as a blocking MPI_Ssend or a single-stream NCCL send/recv behaves), GPipe
// is deadlock-free but 1F1B deadlocks for P ≥ 2 and M ≥ 2 (stage s sends an
// activation while stage s + 1 sends a gradient): a runner must not run 1F1B with
// blocking sends.
#ifndef PIPESHARD_SCHEDULE_SCHEDULE_H_
#define PIPESHARD_SCHEDULE_SCHEDULE_H_

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "schedule/action.h"

namespace pipeshard {

// What a builder makes: the compute actions (F, B, I, W) of every stage, in order.
using ComputeOrder = std::vector<std::vector<Action>>;  // [stages][...]

struct PipelineSchedule {
  std::string name = "1f1b";  // the registry row it was made from
  int stages = 1;             // P
  int micro_batches = 1;      // M
  // [stages][j]: the model chunk that is stage s's j-th, which its actions call chunk j
  // (Action::chunk); chunk c feeds chunk c + 1. With one chunk per stage, stage s holds
  // chunk s.
  std::vector<std::vector<int>> stage_chunks = {{0}};
  std::vector<std::vector<Action>> actions;  // [stages][...], in execution order on that stage

  int chunks() const;  // C, the model chunks of all stages
  int chunk_of(int stage, int j) const { return stage_chunks[stage][j]; }
  // Where model chunk c is: its stage, and its index j there.
  struct Place {
    int stage = -1, j = -1;
  };
  Place place_of(int chunk) const;
  // Whether names need the chunk: some stage holds more than one.
  bool names_chunks() const { return chunks() != stages; }
  // Whether every stage holds one chunk and runs each micro-batch's backward as one pass
  // (B, not I and W): what ZeRO stage 2's gradient windows need (runtime/gradient_sync.h).
  // Under any other schedule train runs --zero 2 as stage 1.
  bool backward_whole_in_one_chunk() const;
};

// "F3" for one chunk per stage; "5F3" (model chunk 5) when stages hold several.
std::string action_label(const PipelineSchedule& schedule, int stage, const Action& action);

// How the deadlock check (and the grid's timing) treats point-to-point transfers.
enum class SendMode {
  kBuffered,    // sends never block; a receive blocks until its send has been issued
  kRendezvous,  // a send and its receive complete together, in the same step
};

struct LowerOptions {
  // Append R (REDUCE_GRAD) after each chunk's last gradient pass: for data-parallel
  // replicas, which reduce the gradients there.
  bool reduce_gradients = false;
};

// Adds the transfers (and R) to `compute` as the conventions above say. `chunk_stage`
// [chunks] places the model chunks on stages (stage s's chunks, in ascending order, are
// its chunks 0, 1, ...); every stage must hold at least one.
PipelineSchedule lower_schedule(std::string name, int stages, int micro_batches, const std::vector<int>& chunk_stage,
                                const ComputeOrder& compute, const LowerOptions& options = {});

// The registered schedule `name` (schedule/registry.h) for `stages` ≥ 1 and
// `micro_batches` ≥ 1 with `virtual_stages` chunks per stage (0: the row's default,
// chunks_per_stage_of()), lowered. Aborts on counts check_schedule_counts() refuses:
// callers validate flags with it first. It passes check_pipeline_schedule().
PipelineSchedule make_pipeline_schedule(std::string_view name, int stages, int micro_batches,
                                        const LowerOptions& options = {}, int virtual_stages = 0);

// OK when `schedule` is well formed and runs to the end under `mode`. Well formed:
// actions.size() == stages; every model chunk on exactly one stage; chunk and
// micro-batch indices in range; per chunk and micro-batch exactly one F, and either one B or one I
// and one W, the backward after the forward and W after I; exactly the transfers listed
// in the conventions above, each receive before the compute that uses it and each send
// after the compute that produces it, none towards a missing neighbour; neighbouring
// chunks on one stage in dependency order; at most one R per chunk, after all of its
// gradient passes, and on every chunk or none; and between any two stages the k-th send
// and the k-th receive of a kind carry the same chunk and micro-batch. Runs to the end:
// the step simulation of format_pipeline_schedule() finishes every stage. Errors name the
// stage and action, e.g. "stage 2: no sA3 after F3" or
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
std::string format_pipeline_schedule(const PipelineSchedule& schedule, SendMode mode = SendMode::kBuffered);

// Steps the simulation under `mode` takes to finish every stage, or the deadlock.
Result<int> pipeline_schedule_steps(const PipelineSchedule& schedule, SendMode mode = SendMode::kBuffered);

// Most micro-batches on `stage` whose forward has run and whose backward (B, or W after
// I) has not, at any point of its action list, summed over its chunks: the activations it
// must keep alive at once.
int max_in_flight(const PipelineSchedule& schedule, int stage);
// The same for stage `stage`'s chunk j: the micro-batch slots its program needs.
int max_in_flight_of_chunk(const PipelineSchedule& schedule, int stage, int j);

// Index of the action in stage `stage`'s list after which every parameter gradient of
// its chunk j is final for the step: its last B or W. -1 when the chunk has none.
int last_gradient_action(const PipelineSchedule& schedule, int stage, int j);

const char* send_mode_name(SendMode mode);  // "buffered sends" or "rendezvous sends"

}  // namespace pipeshard

#endif  // PIPESHARD_SCHEDULE_SCHEDULE_H_
