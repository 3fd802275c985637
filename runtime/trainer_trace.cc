// The Trainer's timeline (runtime/trainer.h: start_trace, write_trace) and the figures
// read off it: the pipeline bubble and each stage's compute and schedule time.
#include "common/atomic_file.h"
#include "runtime/trainer.h"
#include "schedule/predict.h"
#include "schedule/registry.h"

namespace pipeshard {

void Trainer::start_trace(bool record) {
  if (world_) world_->barrier();
  tracer_.start(record);
  runner_->reset_pass_times();
  // The trace and the pipeline bubble time forward and backward on the host clock; on a
  // backend that queues work (a GPU) that is when the work was queued, unless the action
  // waits for it. Waiting costs the host's run-ahead, so only where the figures are shown.
  runner_->set_time_device_work(record || rank_.layout().stages > 1);
}

Status Trainer::write_trace(const std::string& path) {
  const ProcessLayout& l = rank_.layout();
  const int rank = world_ ? world_->rank() : 0;
  const std::string label = "rank " + std::to_string(rank) + ": stage " + std::to_string(l.stage) + ", replica " +
                            std::to_string(l.replica) + ", shard " + std::to_string(l.shard);
  // Rank 0 gathers every rank's text in one buffer: keep the whole under 1 GiB.
  const size_t budget = (size_t{1} << 30) / static_cast<size_t>(world_ ? world_->size() : 1);
  const std::string mine = tracer_.events_json(rank, label, budget);
  const std::vector<std::string> all = world_ ? world_->gather_text(mine, 0) : std::vector<std::string>{mine};
  if (rank != 0) return Status::ok();
  return write_file_atomically(path, chrome_trace_json(all));
}

// What each model chunk's passes took on average (µs per micro-batch), from its stage's
// StageRunner::pass_times() averaged over the stage's ranks, and the quickest receive of
// any stage as the transfer time. A whole backward counts as an input half with a free
// weight half. Collective: one all-reduce of 4·C + P doubles.
PassCosts Trainer::measured_pass_costs() {
  const ProcessLayout& l = rank_.layout();
  enum { kF, kI, kW, kB, kFields };
  const int chunks = schedule_.chunks();
  std::vector<double> sums(kFields * chunks + l.stages, 0.0);  // [chunk][field], then [stage] receives
  const StageRunner::PassTimes& t = runner_->pass_times();
  for (int j = 0; j < rank_.chunks(); ++j) {
    double* mine = sums.data() + kFields * rank_.model_chunk(j);
    mine[kF] = t.mean_us(j, ActionKind::kForward);
    mine[kI] = t.mean_us(j, ActionKind::kBackwardInput);
    mine[kW] = t.mean_us(j, ActionKind::kBackwardWeight);
    mine[kB] = t.mean_us(j, ActionKind::kBackward);
  }
  sums[kFields * chunks + l.stage] = t.fastest_receive_us;
  if (world_) world_->all_reduce_sum(sums.data(), static_cast<int64_t>(sums.size()));
  const double ranks_per_stage = static_cast<double>(l.replicas) * l.shards;
  PassCosts costs;
  for (int c = 0; c < chunks; ++c) {
    const double* chunk = sums.data() + kFields * c;
    costs.forward.push_back(chunk[kF] / ranks_per_stage);
    costs.backward_input.push_back((chunk[kI] + chunk[kB]) / ranks_per_stage);
    costs.backward_weight.push_back(chunk[kW] / ranks_per_stage);
  }
  for (int p = 0; p < l.stages; ++p) {
    const double fastest = sums[kFields * chunks + p] / ranks_per_stage;
    if (fastest > 0 && (costs.transfer == 0 || fastest < costs.transfer)) costs.transfer = fastest;
  }
  return costs;
}

Trainer::Bubble Trainer::pipeline_bubble() {
  Bubble b;
  const double idle = tracer_.schedule_us() > 0 ? 1.0 - tracer_.busy_us() / tracer_.schedule_us() : 0.0;
  b.measured = world_ ? world_->all_reduce_sum(idle) / world_->size() : idle;
  b.costs = measured_pass_costs();
  b.predicted = predict_schedule(schedule_, b.costs).bubble;
  const ScheduleInfo& info = *find_schedule(schedule_.name);
  b.theoretical = info.bubble(schedule_.stages, schedule_.micro_batches, schedule_.chunks() / schedule_.stages);
  b.formula = info.bubble_formula;
  return b;
}

Trainer::StageTimes Trainer::stage_times() {
  const ProcessLayout& l = rank_.layout();
  std::vector<double> sums(2 * l.stages, 0.0);  // [compute of each stage, then schedule of each stage]
  sums[l.stage] = tracer_.busy_us();
  sums[l.stages + l.stage] = tracer_.schedule_us();
  if (world_) world_->all_reduce_sum(sums.data(), static_cast<int64_t>(sums.size()));
  const double ranks_per_stage = static_cast<double>(l.replicas) * l.shards;
  StageTimes t;
  for (int p = 0; p < l.stages; ++p) {
    t.compute_us.push_back(sums[p] / ranks_per_stage);
    t.schedule_us.push_back(sums[l.stages + p] / ranks_per_stage);
  }
  return t;
}

}  // namespace pipeshard
