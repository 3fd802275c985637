// The timed prediction of a pipeline schedule: given what each pass of each model chunk
// costs and what a transfer takes, when every action of every stage starts and finishes,
// and the figures train measures on a real run — each stage's compute and schedule time,
// the step time and the pipeline bubble (Trainer::pipeline_bubble()). It works on any
// schedule check_pipeline_schedule() accepts: several chunks per stage, split backwards
// (I, W), R.
//
// The model is the stage runner's (runtime/stage_runner.cc): every stage starts at 0 and
// runs its list in order; a compute action takes its cost (B costs I + W); a send is
// posted without blocking and takes nothing on the sender, its message is there for the
// receiver `transfer` after it was posted; a receive waits until its message is there
// (sends and receives pair as schedule.h's conventions say); R takes nothing, since the
// data-parallel reduction is not the schedule's time (the runner leaves it out of the
// measured schedule time too). Neighbouring chunks on one stage hand over in place.
//
// Not modelled: the runner's waits for its own sends to complete, at the end of its list
// and before it reuses a micro-batch slot whose sends are in flight (so with transfer > 0
// a stage whose list ends with a send may measure more than its predicted end);
// contention between transfers; the host's overheads between actions.
#ifndef PIPESHARD_SCHEDULE_PREDICT_H_
#define PIPESHARD_SCHEDULE_PREDICT_H_

#include <vector>

#include "schedule/schedule.h"

namespace pipeshard {

// What one micro-batch's passes cost, per model chunk, in any unit of time (µs when
// measured). All non-negative.
struct PassCosts {
  std::vector<double> forward;          // [chunks] F
  std::vector<double> backward_input;   // [chunks] I; a whole B costs I + W
  std::vector<double> backward_weight;  // [chunks] W
  // From a send being posted to its receive completing when the receiver is already waiting.
  double transfer = 0;
};

// The same costs for every one of `chunks` chunks: F = f, I = i, W = w.
PassCosts uniform_pass_costs(int chunks, double f, double i, double w, double transfer = 0);

struct SchedulePrediction {
  struct Interval {
    double start = 0, finish = 0;
  };
  // [stages][actions]: when each action of the stage's list starts and finishes. A
  // receive starts when the stage reaches it and finishes when its message is there: its
  // length is the stage's wait.
  std::vector<std::vector<Interval>> timeline;
  std::vector<double> busy;         // [stages] compute time: the costs of its F, B, I, W
  std::vector<double> end;          // [stages] when its last action finishes: its schedule time
  double step = 0;                  // the largest end: the schedule's time
  double bubble = 0;                // mean over stages of 1 − busy/end (0 where end is 0), as train measures it
  std::vector<int> peak_in_flight;  // [stages] max_in_flight(): micro-batches whose activations it keeps at once
};

// Runs `schedule`, which must pass check_pipeline_schedule(), with `costs` ([chunks]
// vectors, schedule.chunks() long). Aborts on costs of another length or below 0, and on a
// schedule that deadlocks.
SchedulePrediction predict_schedule(const PipelineSchedule& schedule, const PassCosts& costs);

}  // namespace pipeshard

#endif  // PIPESHARD_SCHEDULE_PREDICT_H_
