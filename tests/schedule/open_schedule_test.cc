// The schedule table is open: schedules that exist only in this file are registered
// (schedule/registry.h), built, checked and run by the stage runner on an in-process job
// (testing/in_process_comm.h: each rank a thread), with nothing outside this file told
// about them. Each trains what one process trains:
// - "1f1b-iw": 1F1B whose backwards run as an input half then a weight half (I, W),
//   bit for bit the layout's 1F1B;
// - "1f1b-late-w": 1F1B whose weight halves all wait until every input half has run
//   (the zero-bubble idea, without its memory bound), bit for bit 1F1B as well, since the
//   weight gradients still add up in micro-batch order;
// - "gpipe-reversed": GPipe with its backwards in reverse micro-batch order, which sums
//   the gradients in another order: equal to one process up to float rounding.

#include <gtest/gtest.h>

#include "schedule/registry.h"
#include "tests/layout_training.h"
#include "tests/model_util.h"
#include "tests/schedule/split_one_f_one_b.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::expect_bitwise;
using testing::load_model;
using testing::source_path;
using testing::train_alone;
using testing::train_layout;
using testing::Trained;

TrainConfig adamw(const std::string& schedule, int micro_batches, int64_t steps = 4) {
  return testing::adamw_config(schedule, micro_batches, 32, steps);
}

void expect_equivalent(const Trained& layout, const Trained& alone) {
  testing::expect_equivalent(layout, alone, load_model("simple_digits").graph);
}

// ---- the schedules, defined here and nowhere else ----

ComputeOrder one_f_one_b_input_then_weight(int stages, int micro_batches) {
  return testing::one_f_one_b_split(stages, micro_batches, false);
}

ComputeOrder one_f_one_b_late_weights(int stages, int micro_batches) {
  return testing::one_f_one_b_split(stages, micro_batches, true);
}

ComputeOrder gpipe_reversed(int stages, int micro_batches) {
  ComputeOrder order(stages);
  for (auto& stage : order) {
    for (int k = 0; k < micro_batches; ++k) stage.push_back({ActionKind::kForward, k});
    for (int k = micro_batches; k-- > 0;) stage.push_back({ActionKind::kBackward, k});
  }
  return order;
}

// A row of one chunk per stage: its functions ignore the chunks per stage, always 1.
ScheduleInfo row(std::string name, std::function<ComputeOrder(int, int)> build,
                 std::function<int(int, int, int, int)> in_flight) {
  const ScheduleInfo& like = *find_schedule("1f1b");
  ScheduleInfo info;
  info.name = std::move(name);
  info.title = "test";
  info.summary = "a schedule of open_schedule_test.cc";
  info.build = [build](int stages, int micro_batches, int) { return build(stages, micro_batches); };
  info.in_flight = std::move(in_flight);
  info.bubble = like.bubble;
  info.bubble_formula = like.bubble_formula;
  return info;
}

class OpenSchedules : public ::testing::Test {
 protected:
  ScheduleRegistration iw_{row("1f1b-iw", one_f_one_b_input_then_weight, find_schedule("1f1b")->in_flight)};
  ScheduleRegistration late_w_{row("1f1b-late-w", one_f_one_b_late_weights, [](int, int m, int, int) { return m; })};
  ScheduleRegistration reversed_{row("gpipe-reversed", gpipe_reversed, [](int, int m, int, int) { return m; })};
};

Dataset digits(const ImportedModel& model) {
  Result<Dataset> d = load_dataset(source_path("data/digits_features.npy"), source_path("data/digits_labels.npy"),
                                   model.graph, Targets::kClassIndices);
  EXPECT_TRUE(d.is_ok()) << d.status().message();
  return std::move(d).value();
}

TEST_F(OpenSchedules, RegisteredSchedulesPassTheChecker) {
  for (const char* name : {"1f1b-iw", "1f1b-late-w", "gpipe-reversed"}) {
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 8; ++m) {
        const PipelineSchedule sc = make_pipeline_schedule(name, p, m);
        EXPECT_TRUE(check_pipeline_schedule(sc).is_ok()) << name << " P=" << p << " M=" << m;
        for (int s = 0; s < p; ++s) {
          EXPECT_EQ(max_in_flight(sc, s), find_schedule(name)->in_flight(p, m, s, 1)) << name << " stage " << s;
        }
      }
    }
  }
}

// Two stages (and two stages × two replicas) on threads: the split backwards give the
// layout's own 1F1B bit for bit, and that is the one-process training.
TEST_F(OpenSchedules, SplitBackwardsAreOneFOneBBitForBit) {
  const ImportedModel model = load_model("simple_digits");
  const Dataset data = digits(model);
  const Trained alone = train_alone(model, data, adamw("1f1b", 1));
  for (int replicas : {1, 2}) {
    SCOPED_TRACE(std::to_string(replicas) + " replica(s) of 2 stages");
    const int ranks = 2 * replicas;
    const Trained one_f_one_b = train_layout(model, data, adamw("1f1b", 4), ranks, 2, 1);
    expect_equivalent(one_f_one_b, alone);
    for (const char* name : {"1f1b-iw", "1f1b-late-w"}) {
      SCOPED_TRACE(name);
      expect_bitwise(train_layout(model, data, adamw(name, 4), ranks, 2, 1), one_f_one_b);
    }
  }
}

// Backwards in reverse micro-batch order, on three stages: the gradients add up in
// another order, and the training is still the one-process training.
TEST_F(OpenSchedules, ReversedBackwardsTrainTheOneProcessModel) {
  const ImportedModel model = load_model("simple_digits");
  const Dataset data = digits(model);
  const Trained alone = train_alone(model, data, adamw("1f1b", 1));
  expect_equivalent(train_layout(model, data, adamw("gpipe-reversed", 4), 3, 3, 1), alone);
}

// With tensor parallelism too (2 stages × 2 shards): the column-parallel Linear's partial
// input gradient is summed in I, its weight gradient added in W.
TEST_F(OpenSchedules, SplitBackwardsWithTensorParallelShards) {
  const ImportedModel model = load_model("simple_digits");
  const Dataset data = digits(model);
  const Trained one_f_one_b = train_layout(model, data, adamw("1f1b", 2, 3), 4, 2, 2);
  expect_bitwise(train_layout(model, data, adamw("1f1b-late-w", 2, 3), 4, 2, 2), one_f_one_b);
  expect_equivalent(one_f_one_b, train_alone(model, data, adamw("1f1b", 1, 3)));
}

}  // namespace
}  // namespace pipeshard
