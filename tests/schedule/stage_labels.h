// A stage's action list as the schedule grid labels it, for the schedule tests' golden
// orders: "F0 F1 sA1 …", or "0F0 2F0 …" (model chunk first) when stages hold several chunks.
#ifndef PIPESHARD_TESTS_SCHEDULE_STAGE_LABELS_H_
#define PIPESHARD_TESTS_SCHEDULE_STAGE_LABELS_H_

#include <string>

#include "schedule/schedule.h"

namespace pipeshard::testing {

inline std::string stage_labels(const PipelineSchedule& sc, int stage) {
  std::string out;
  for (const Action& a : sc.actions[stage]) {
    if (!out.empty()) out += ' ';
    out += action_label(sc, stage, a);
  }
  return out;
}

}  // namespace pipeshard::testing

#endif  // PIPESHARD_TESTS_SCHEDULE_STAGE_LABELS_H_
