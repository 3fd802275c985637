// The lock-step run of a schedule that check_pipeline_schedule(), the grid and the step
// count share (schedule.h says how a step goes). Internal to schedule/.
#ifndef PIPESHARD_SCHEDULE_SIMULATION_H_
#define PIPESHARD_SCHEDULE_SIMULATION_H_

#include <vector>

#include "common/status.h"
#include "schedule/schedule.h"

namespace pipeshard {

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
