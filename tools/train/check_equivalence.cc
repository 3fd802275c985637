// train --check-equivalence (tools/train/check_equivalence.h).
#include "tools/train/check_equivalence.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "comm/watchdog.h"

namespace pipeshard::train_cli {

int check_equivalence(const Graph& graph, const Dataset& data, const TrainConfig& config, Trainer& distributed,
                      int64_t steps, Communicator& world,
                      const std::function<std::unique_ptr<Backend>()>& make_backend) {
  std::vector<double> losses;
  for (int64_t s = 0; s < steps; ++s) losses.push_back(distributed.step().loss);
  Graph ours = graph;
  distributed.download_parameters(ours);
  double loss_diff = 0, weight_diff = 0;
  const WatchdogSlowPhase solo("the one-process reference run on rank 0");
  if (world.rank() == 0) {
    std::unique_ptr<Backend> backend = make_backend();
    TrainConfig one = config;  // the whole batch at once, as one process would train it
    one.micro_batches = 1;
    one.pipeline_schedule = "1f1b";  // one stage: whatever the schedule, forward then backward
    one.virtual_stages = 0;
    one.sync_batchnorm = false;
    auto alone = Trainer::create(graph, data, *backend, one);
    PIPESHARD_CHECK(alone.is_ok(), alone.status().message());
    for (int64_t s = 0; s < steps; ++s) {
      const double want = (*alone)->step().loss;
      loss_diff = std::max(loss_diff, std::fabs(losses[s] - want) / std::max(std::fabs(want), 1e-12));
    }
    Graph reference = graph;
    (*alone)->download_parameters(reference);
    for (size_t p = 0; p < reference.params.size(); ++p) {
      const auto& want = reference.params[p].data;
      float scale = 1.0f;
      for (float v : want) scale = std::max(scale, std::fabs(v));
      for (size_t i = 0; i < want.size(); ++i) {
        weight_diff = std::max(weight_diff, static_cast<double>(std::fabs(ours.params[p].data[i] - want[i]) / scale));
      }
    }
    fmt::print(
        "check-equivalence: {} steps on {} process{} vs 1: largest loss difference {:.2e} (relative), "
        "largest weight difference {:.2e} (relative to each tensor's largest value)\n",
        steps, world.size(), world.size() == 1 ? "" : "es", loss_diff, weight_diff);
  }
  const bool same = world.all_reduce_sum(loss_diff <= 1e-5 && weight_diff <= 1e-5 ? 0.0 : 1.0) == 0.0;
  if (world.rank() == 0)
    fmt::print("{}\n", same ? "equivalent: the layout computes the one-process training"
                            : "NOT equivalent beyond float rounding (1e-5)");
  return same ? 0 : 1;
}

}  // namespace pipeshard::train_cli
