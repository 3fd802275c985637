#include "tools/plot/pictures.h"

#include "schedule/registry.h"

namespace pipeshard {

nlohmann::json partition_chart_data(const Plan& plan) {
  const PartitionOptions& o = plan.options;
  nlohmann::json stages = nlohmann::json::array();
  for (const StagePlan& s : plan.stages) {
    stages.push_back({{"stage", s.stage},
                      {"first_layer", s.first_layer},
                      {"last_layer", s.end_layer - 1},
                      {"parameters", s.parameters},
                      {"memory_bytes", s.memory_bytes}});
  }
  return {{"kind", "partition"},
          {"model", plan.model},
          {"total_parameters", plan.total_parameters},
          {"tensor_parallel", o.tensor_parallel},
          {"balance_by", balance_name(o.balance)},
          {"balance", plan.balance},
          {"batch_size", o.batch_size},
          {"micro_batches", micro_batch_count(o)},
          {"schedule", find_schedule(o.schedule)->title},
          {"optimizer_slots", o.optimizer_slots},
          {"stages", stages}};
}

void TrainingCurves::add_step(int64_t step, double loss) {
  steps_.push_back(step);
  losses_.push_back(loss);
}

void TrainingCurves::add_eval(int64_t epoch, int64_t step, double loss, double accuracy) {
  evals_.push_back({{"epoch", epoch}, {"step", step}, {"loss", loss}, {"accuracy", accuracy}});
}

nlohmann::json TrainingCurves::data() const {
  return {{"kind", "train"},
          {"model", run_.model},
          {"optimizer", run_.optimizer},
          {"loss_name", run_.loss},
          {"batch_size", run_.batch_size},
          {"steps_per_epoch", run_.steps_per_epoch},
          {"layout",
           {{"replicas", run_.replicas},
            {"stages", run_.stages},
            {"shards", run_.shards},
            {"schedule", run_.schedule},
            {"micro_batches", run_.micro_batches}}},
          {"steps", steps_},
          {"loss", losses_},
          {"eval", evals_}};
}

}  // namespace pipeshard
