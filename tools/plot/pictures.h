// What the pictures show, as the JSON data tools/plot/pipeshard_plot.py draws (plot.h):
// partition's chart of a Plan (--chart) and train's curves of a run (--plot).
#ifndef PIPESHARD_TOOLS_PLOT_PICTURES_H_
#define PIPESHARD_TOOLS_PLOT_PICTURES_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "partitioner/plan.h"

namespace pipeshard {

// One bar pair per stage: its trainable parameters and its per-rank memory estimate
// (bytes), with the balance and the assumptions of the estimate.
nlohmann::json partition_chart_data(const Plan& plan);

// What the title of a training picture says about the run.
struct TrainingRun {
  std::string model;       // path as given
  std::string optimizer;   // sgd, adam or adamw
  std::string loss;        // cross-entropy or mse
  int64_t batch_size = 0;  // samples per optimizer step (accumulation included)
  int64_t steps_per_epoch = 0;
  int replicas = 1, stages = 1, shards = 1;  // D, P, T
  std::string schedule;                      // pipeline schedule, when stages > 1
  int micro_batches = 1;
};

// train's curves, collected as it runs: the loss of every step, and the evaluation after
// each epoch when there is evaluation data.
class TrainingCurves {
 public:
  explicit TrainingCurves(TrainingRun run) : run_(std::move(run)) {}

  void add_step(int64_t step, double loss);
  // accuracy: fraction correct in [0, 1], or negative when there is none (mse).
  void add_eval(int64_t epoch, int64_t step, double loss, double accuracy);

  nlohmann::json data() const;

 private:
  TrainingRun run_;
  std::vector<int64_t> steps_;
  std::vector<double> losses_;  // [steps_]
  nlohmann::json evals_ = nlohmann::json::array();
};

}  // namespace pipeshard

#endif  // PIPESHARD_TOOLS_PLOT_PICTURES_H_
