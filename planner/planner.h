// The layout planner: every layout `train` can run on N ranks (partitioner/layout_search.h),
// each priced on a machine profile (planner/cost_model.h), fastest first. `partition
// --plan` prints it and `train --layout auto` runs its first choice.
#ifndef PIPESHARD_PLANNER_PLANNER_H_
#define PIPESHARD_PLANNER_PLANNER_H_

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ir/graph.h"
#include "partitioner/layout_search.h"
#include "planner/cost_model.h"
#include "planner/profile.h"

namespace pipeshard {

struct PlannedLayout {
  LayoutFit fit;
  LayoutPrediction prediction;
};

struct LayoutPlan {
  LayoutSearchOptions options;
  MachineProfile profile;
  std::vector<PlannedLayout> ranked;     // every accepted layout, fastest predicted first (ties: enumeration order)
  std::vector<RejectedLayout> rejected;  // in enumeration order
  int rejected_for_memory = 0;
  // The reasons of the rejections not for memory, each once, with how many layouts it
  // refused, most first.
  std::vector<std::pair<std::string, int>> rejection_reasons() const;
};

LayoutPlan plan_layouts(const Graph& graph, const LayoutSearchOptions& options, const MachineProfile& profile);

// train's flags for `layout` (mpirun -np layout.ranks()): "--stages 2 --micro-batches 4
// --schedule zb-h1 --zero 1", the defaults left out.
std::string layout_train_flags(const Layout& layout);

// The best `top` layouts as a table, the rejections summarised under it.
std::string layout_plan_text(const LayoutPlan& plan, const std::string& model, size_t top);
// Every layout, accepted and rejected, with its prediction and memory (partition --plan --json).
nlohmann::json layout_plan_json(const LayoutPlan& plan, const std::string& model);

}  // namespace pipeshard

#endif  // PIPESHARD_PLANNER_PLANNER_H_
