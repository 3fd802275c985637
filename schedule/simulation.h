// The lock-step run of a schedule that check_pipeline_schedule(), the grid and the step
// count share (schedule.h says how a step goes), and the rule that pairs a receive with
// its send, which the timed prediction (schedule/predict.h) shares too. Internal to
// schedule/.
#ifndef PIPESHARD_SCHEDULE_SIMULATION_H_
#define PIPESHARD_SCHEDULE_SIMULATION_H_

#include <compare>
#include <optional>
#include <vector>

#include "common/status.h"
#include "schedule/schedule.h"

namespace pipeshard {

// What a transfer carries, named alike by its send and its receive: the kind of the send
// (sA or sG), the model chunks it goes from and to, and the micro-batch. A send and a
// receive pair when their messages are equal. A well-formed schedule sends and receives
// each message once, and check.cc proves that then the k-th send of a kind between two
// stages carries what the k-th receive expects, so pairing by message is pairing in issue
// order, as NCCL does.
struct Message {
  ActionKind send = ActionKind::kSendActivation;
  int from = -1, to = -1;  // model chunks
  int micro_batch = -1;
  auto operator<=>(const Message&) const = default;
};

// The message stage `stage`'s action `a` sends or receives; none for compute and R. An
// action naming a chunk the stage does not hold is taken for model chunk -1 (the grid
// prints schedules the structural check refuses, as far as they run).
std::optional<Message> message_of(const PipelineSchedule& schedule, int stage, const Action& a);

// grid[step][stage] is the index of the action that stage ran in that step, or -1.
// `status` says whether every stage finished, or where the run got stuck.
struct Simulation {
  std::vector<std::vector<int>> grid;
  Status status;
};

// `schedule` must pass the structural checks (its chunks, peers and micro-batches in range).
Simulation simulate(const PipelineSchedule& schedule, SendMode mode);

}  // namespace pipeshard

#endif  // PIPESHARD_SCHEDULE_SIMULATION_H_
