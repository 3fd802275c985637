// TrainingBoard: what `train --tensorboard DIR` shows in TensorBoard, written as
// TensorBoard event files (observe/tensorboard.h) by world rank 0.
//
// Tags (the x axis is the optimizer step, from 1):
//   train/loss, train/lr, train/samples_per_s    every step; the same numbers as --metrics
//   time/stage<p>_forward_backward_ms             every step: forward plus backward time of
//   time/stage<p>_idle_ms                         stage p in that step, and the rest of its
//                                                 schedule (waiting: bubble and transfers),
//                                                 each the mean over the stage's ranks
//   eval/loss, eval/accuracy                      after each epoch with --eval-data
//                                                 (accuracy as a fraction, cross-entropy only)
//   pipeline/bubble_measured,                     once, at the last step of a pipelined run
//   pipeline/bubble_predicted,                    (fractions; Trainer::pipeline_bubble)
//   pipeline/bubble_theoretical
// Every call's events are flushed before it returns, so a crash loses at most the step
// in progress.
#ifndef PIPESHARD_OBSERVE_TRAINING_BOARD_H_
#define PIPESHARD_OBSERVE_TRAINING_BOARD_H_

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "observe/tensorboard.h"
#include "runtime/trainer.h"

namespace pipeshard {

class TrainingBoard {
 public:
  // With `writes` (world rank 0): creates `dir` if needed and a new event file in it.
  // Elsewhere it writes nothing and only takes part in add_step()'s collective.
  static Result<std::unique_ptr<TrainingBoard>> create(const std::string& dir, bool writes);

  // The scalars of step `r` (train/* and time/*). Collective: every rank calls it after
  // every step, in step order (Trainer::stage_times).
  Status add_step(Trainer& trainer, const StepResult& r, double samples_per_s);
  // eval/loss and eval/accuracy at `step`, from rank 0's EvalResult (Trainer::evaluate).
  Status add_eval(int64_t step, const EvalResult& e);
  // pipeline/bubble_measured, _predicted and _theoretical at `step`.
  Status add_bubble(int64_t step, const Trainer::Bubble& b);

  // The event file; empty on ranks that do not write.
  std::string path() const { return writer_ ? writer_->path() : std::string(); }

 private:
  explicit TrainingBoard(std::unique_ptr<TensorBoardWriter> writer) : writer_(std::move(writer)) {}

  std::unique_ptr<TensorBoardWriter> writer_;  // null on ranks that do not write
  Trainer::StageTimes last_;                   // stage times up to the previous step (µs)
};

}  // namespace pipeshard

#endif  // PIPESHARD_OBSERVE_TRAINING_BOARD_H_
