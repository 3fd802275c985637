// Actions: the steps a pipeline schedule is made of (schedule/schedule.h), one per
// compute pass, transfer or gradient reduction of one model chunk and micro-batch.
//
// A model is cut into chunks, chunk c feeding chunk c + 1; each pipeline stage (a rank of
// the pipeline group) holds one chunk in GPipe and 1F1B, several in interleaved and V
// schedules. Compute kinds:
//   F  forward of the chunk for one micro-batch;
//   B  its whole backward: input gradients and weight gradients in one sweep;
//   I  the input-gradient half of B (dX = dY·W and everything upstream needs);
//   W  the weight-gradient half of B (dW += dYᵀ·X), deferred to fill the bubble.
// A micro-batch's backward is either one B or one I and a later W. Transfers (sA, rA, sG,
// rG) move a chunk's output activation forward and its input gradient back; R
// (REDUCE_GRAD) marks where every gradient of the chunk is final, so data-parallel
// replicas reduce what is left of them there.
#ifndef PIPESHARD_SCHEDULE_ACTION_H_
#define PIPESHARD_SCHEDULE_ACTION_H_

#include <cstdint>
#include <string>
#include <vector>

namespace pipeshard {

enum class ActionKind : uint8_t {
  kForward,          // F:  forward of the chunk for one micro-batch
  kBackward,         // B:  its backward, input and weight gradients together
  kSendActivation,   // sA: send the chunk's output to chunk + 1
  kRecvActivation,   // rA: receive the chunk's input from chunk − 1
  kSendGradient,     // sG: send the chunk's input gradient to chunk − 1
  kRecvGradient,     // rG: receive the chunk's output gradient from chunk + 1
  kBackwardInput,    // I:  the input-gradient half of B
  kBackwardWeight,   // W:  the weight-gradient half of B
  kReduceGradients,  // R:  REDUCE_GRAD, the chunk's gradients are final (no micro-batch)
};
inline constexpr int kActionKindCount = 9;

struct Action {
  ActionKind kind = ActionKind::kForward;
  int micro_batch = 0;  // 0 .. micro_batches − 1; -1 for R
  int chunk = 0;        // which of its stage's chunks: 0 .. chunks per stage − 1 (PipelineSchedule::stage_chunks)
  bool operator==(const Action&) const = default;
};

// What an action does, for the checker, the simulator, the runner and the trace.
enum class ActionRole : uint8_t { kCompute, kSend, kRecv, kReduce };

struct ActionKindInfo {
  ActionKind kind;
  const char* prefix;      // "F", "sA", ... as names and grids print it
  const char* trace_name;  // "forward", "send activation", ... as the trace shows it
  ActionRole role;
  bool input_gradient;   // computes the chunk's input gradient (B, I)
  bool weight_gradient;  // adds into parameter gradients (B, W)
};

// The row of `kind`; every kind has exactly one (a test checks the table).
const ActionKindInfo& action_kind_info(ActionKind kind);

// Whether a stage's `actions` run backwards as halves (I, then W): its program then keeps
// each Linear's output gradient per slot from I to W.
bool splits_backward(const std::vector<Action>& actions);

// "F3", "B3", "I3", "W3", "sA3", "rA3", "sG3", "rG3", "R"; with `with_chunk` the chunk
// goes first, as PyTorch's pipelining prints actions: "1F3", "1R" (action_label() in
// schedule.h prints the model chunk instead of the stage's index of it).
std::string action_name(const Action& action, bool with_chunk = false);

}  // namespace pipeshard

#endif  // PIPESHARD_SCHEDULE_ACTION_H_
