#include "tools/train/training_board.h"

#include <string>
#include <utility>

namespace pipeshard {

Result<std::unique_ptr<TrainingBoard>> TrainingBoard::create(const std::string& dir, bool writes) {
  std::unique_ptr<TensorBoardWriter> writer;
  if (writes) {
    Result<std::unique_ptr<TensorBoardWriter>> w = TensorBoardWriter::create(dir);
    if (!w) return w.status();
    writer = std::move(*w);
  }
  return std::unique_ptr<TrainingBoard>(new TrainingBoard(std::move(writer)));
}

Status TrainingBoard::add_step(Trainer& trainer, const StepResult& r, double samples_per_s) {
  // The Tracer's sums run from start_trace(); this step's share is the difference.
  Trainer::StageTimes now = trainer.stage_times();
  const Trainer::StageTimes before = std::move(last_);
  last_ = now;
  if (!writer_) return Status::ok();
  const double wall_time = unix_seconds_now();
  writer_->add_scalar("train/loss", r.step, r.loss, wall_time);
  writer_->add_scalar("train/lr", r.step, r.lr, wall_time);
  writer_->add_scalar("train/samples_per_s", r.step, samples_per_s, wall_time);
  for (size_t p = 0; p < now.compute_us.size(); ++p) {
    const double compute = now.compute_us[p] - (before.compute_us.empty() ? 0.0 : before.compute_us[p]);
    const double schedule = now.schedule_us[p] - (before.schedule_us.empty() ? 0.0 : before.schedule_us[p]);
    const std::string stage = "time/stage" + std::to_string(p);
    writer_->add_scalar(stage + "_forward_backward_ms", r.step, compute / 1e3, wall_time);
    writer_->add_scalar(stage + "_idle_ms", r.step, (schedule - compute) / 1e3, wall_time);
  }
  return writer_->flush();
}

Status TrainingBoard::add_eval(int64_t step, const EvalResult& e) {
  if (!writer_) return Status::ok();
  const double wall_time = unix_seconds_now();
  writer_->add_scalar("eval/loss", step, e.loss, wall_time);
  if (e.accuracy >= 0) writer_->add_scalar("eval/accuracy", step, e.accuracy, wall_time);
  return writer_->flush();
}

Status TrainingBoard::add_bubble(int64_t step, const Trainer::Bubble& b) {
  if (!writer_) return Status::ok();
  const double wall_time = unix_seconds_now();
  writer_->add_scalar("pipeline/bubble_measured", step, b.measured, wall_time);
  writer_->add_scalar("pipeline/bubble_predicted", step, b.predicted, wall_time);
  writer_->add_scalar("pipeline/bubble_theoretical", step, b.theoretical, wall_time);
  return writer_->flush();
}

}  // namespace pipeshard
