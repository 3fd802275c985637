// 1F1B with each whole backward B split into its input half I and its weight half W, for
// the schedule tests: W right after its I, or every W of a stage after all of its I's
// (the zero-bubble idea without its memory bound). Lowering puts sG right after I either
// way, so the gradient leaves before W runs. No production file knows these orders.
#ifndef PIPESHARD_TESTS_SCHEDULE_SPLIT_ONE_F_ONE_B_H_
#define PIPESHARD_TESTS_SCHEDULE_SPLIT_ONE_F_ONE_B_H_

#include <vector>

#include "schedule/registry.h"

namespace pipeshard::testing {

inline ComputeOrder one_f_one_b_split(int stages, int micro_batches, bool weights_last) {
  ComputeOrder order = find_schedule("1f1b")->build(stages, micro_batches, 1);
  for (auto& stage : order) {
    std::vector<Action> split, weights;
    for (const Action& a : stage) {
      if (a.kind != ActionKind::kBackward) {
        split.push_back(a);
        continue;
      }
      split.push_back({ActionKind::kBackwardInput, a.micro_batch, a.chunk});
      (weights_last ? weights : split).push_back({ActionKind::kBackwardWeight, a.micro_batch, a.chunk});
    }
    split.insert(split.end(), weights.begin(), weights.end());
    stage = split;
  }
  return order;
}

}  // namespace pipeshard::testing

#endif  // PIPESHARD_TESTS_SCHEDULE_SPLIT_ONE_F_ONE_B_H_
