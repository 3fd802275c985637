// Pipeline schedules as data (schedule/schedule.h): GPipe and 1F1B for every small
// pipeline pass the structural and deadlock checks, keep their memory bounds, print as
// a step × stage grid; hand-broken schedules are rejected with messages that name the
// stage and action.
#include "schedule/schedule.h"
#include "schedule/registry.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "tests/schedule/stage_labels.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

constexpr const char* kKinds[] = {"gpipe", "1f1b", "zb-h1"};

std::string names(const std::vector<Action>& actions) {
  std::string out;
  for (const Action& a : actions) {
    if (!out.empty()) out += ' ';
    out += action_name(a);
  }
  return out;
}

std::vector<int> micro_batches_of(const std::vector<Action>& actions, ActionKind kind) {
  std::vector<int> out;
  for (const Action& a : actions) {
    if (a.kind == kind) out.push_back(a.micro_batch);
  }
  return out;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Index of `action` in stage s's list; fails the test when absent.
size_t find_action(const PipelineSchedule& sc, int s, Action action) {
  auto& list = sc.actions[s];
  auto it = std::find(list.begin(), list.end(), action);
  EXPECT_NE(it, list.end()) << action_name(action) << " not on stage " << s;
  return it - list.begin();
}

std::string check_message(const PipelineSchedule& sc, SendMode mode = SendMode::kBuffered) {
  Status st = check_pipeline_schedule(sc, mode);
  return st.is_ok() ? "OK" : st.message();
}

// ---- every small pipeline ----

TEST(Schedule, EverySmallPipelinePassesAndKeepsItsMemoryBound) {
  for (std::string kind : kKinds) {
    for (int p = 1; p <= 8; ++p) {
      for (int m = 1; m <= 16; ++m) {
        SCOPED_TRACE(kind + " P=" + std::to_string(p) + " M=" + std::to_string(m));
        PipelineSchedule sc = make_pipeline_schedule(kind, p, m);
        ASSERT_EQ(sc.name, kind);
        ASSERT_EQ(sc.stages, p);
        ASSERT_EQ(sc.micro_batches, m);
        ASSERT_EQ(static_cast<int>(sc.actions.size()), p);
        EXPECT_EQ(check_message(sc), "OK");
        std::vector<int> in_order(m);
        for (int k = 0; k < m; ++k) in_order[k] = k;
        for (int s = 0; s < p; ++s) {
          EXPECT_EQ(micro_batches_of(sc.actions[s], ActionKind::kForward), in_order) << "stage " << s;
          if (kind == "zb-h1") {  // split backwards, each half in micro-batch order
            EXPECT_EQ(micro_batches_of(sc.actions[s], ActionKind::kBackwardInput), in_order) << "stage " << s;
            EXPECT_EQ(micro_batches_of(sc.actions[s], ActionKind::kBackwardWeight), in_order) << "stage " << s;
            EXPECT_EQ(micro_batches_of(sc.actions[s], ActionKind::kBackward), std::vector<int>{}) << "stage " << s;
          } else {
            EXPECT_EQ(micro_batches_of(sc.actions[s], ActionKind::kBackward), in_order) << "stage " << s;
          }
          const int expected = kind == "gpipe" ? m : kind == "1f1b" ? std::min(p - s, m) : std::min(p, m);
          EXPECT_EQ(max_in_flight(sc, s), expected) << "stage " << s;
        }
        EXPECT_LE(max_in_flight(sc, 0), kind == "gpipe" ? m : p);
      }
    }
  }
}

// Transfers around each compute, as the conventions of schedule.h say.
TEST(Schedule, EveryComputeHasItsTransfersNextToIt) {
  for (std::string kind : kKinds) {
    PipelineSchedule sc = make_pipeline_schedule(kind, 4, 6);
    for (int s = 0; s < 4; ++s) {
      const auto& list = sc.actions[s];
      for (size_t i = 0; i < list.size(); ++i) {
        const int k = list[i].micro_batch;
        if (list[i].kind == ActionKind::kForward) {
          if (s > 0) {
            EXPECT_EQ(list[i - 1], (Action{ActionKind::kRecvActivation, k}));
          }
          if (s < 3) {
            EXPECT_EQ(list[i + 1], (Action{ActionKind::kSendActivation, k}));
          }
        }
        if (action_kind_info(list[i].kind).input_gradient) {  // B, or I
          if (s < 3) {
            EXPECT_EQ(list[i - 1], (Action{ActionKind::kRecvGradient, k})) << kind;
          }
          if (s > 0) {
            EXPECT_EQ(list[i + 1], (Action{ActionKind::kSendGradient, k})) << kind;
          }
        }
      }
    }
  }
}

// Under rendezvous sends GPipe still runs; 1F1B deadlocks as soon as two stages and
// two micro-batches make a stage send an activation while its successor sends a gradient.
TEST(Schedule, RendezvousSendsDeadlock1F1BButNotGPipe) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 16; ++m) {
      SCOPED_TRACE("P=" + std::to_string(p) + " M=" + std::to_string(m));
      EXPECT_EQ(check_message(make_pipeline_schedule("gpipe", p, m), SendMode::kRendezvous), "OK");
      std::string one_f_one_b = check_message(make_pipeline_schedule("1f1b", p, m), SendMode::kRendezvous);
      if (p == 1 || m == 1) {
        EXPECT_EQ(one_f_one_b, "OK");
      } else {
        EXPECT_EQ(one_f_one_b.rfind("deadlock (rendezvous sends) at step ", 0), 0u) << one_f_one_b;
      }
    }
  }
  EXPECT_EQ(check_message(make_pipeline_schedule("1f1b", 2, 2), SendMode::kRendezvous),
            "deadlock (rendezvous sends) at step 4: stage 0 waits at sA1 while stage 1 waits at sG0");
}

// ---- hand-checked cases ----

TEST(Schedule, OneFOneBTwoStagesFourMicroBatches) {
  PipelineSchedule sc = make_pipeline_schedule("1f1b", 2, 4);
  EXPECT_EQ(names(sc.actions[0]), "F0 sA0 F1 sA1 rG0 B0 F2 sA2 rG1 B1 F3 sA3 rG2 B2 rG3 B3");
  EXPECT_EQ(names(sc.actions[1]), "rA0 F0 B0 sG0 rA1 F1 B1 sG1 rA2 F2 B2 sG2 rA3 F3 B3 sG3");
}

// ZB-H1: stage 0 runs 1F1B with each B split in place; the last stage sends each input
// gradient before any weight half and owes one W (its s = 1) until the drain.
TEST(Schedule, ZeroBubbleH1TwoStagesFourMicroBatches) {
  PipelineSchedule sc = make_pipeline_schedule("zb-h1", 2, 4);
  EXPECT_EQ(names(sc.actions[0]), "F0 sA0 F1 sA1 rG0 I0 W0 F2 sA2 rG1 I1 W1 F3 sA3 rG2 I2 W2 rG3 I3 W3");
  EXPECT_EQ(names(sc.actions[1]), "rA0 F0 I0 sG0 rA1 F1 I1 sG1 W0 rA2 F2 I2 sG2 W1 rA3 F3 I3 sG3 W2 W3");
  EXPECT_EQ(names(make_pipeline_schedule("zb-h1", 1, 3).actions[0]), "F0 I0 W0 F1 I1 W1 F2 I2 W2");
}

TEST(Schedule, GPipeTwoStagesThreeMicroBatches) {
  PipelineSchedule sc = make_pipeline_schedule("gpipe", 2, 3);
  EXPECT_EQ(names(sc.actions[0]), "F0 sA0 F1 sA1 F2 sA2 rG0 B0 rG1 B1 rG2 B2");
  EXPECT_EQ(names(sc.actions[1]), "rA0 F0 rA1 F1 rA2 F2 B0 sG0 B1 sG1 B2 sG2");
}

TEST(Schedule, OneStageHasNoTransfers) {
  EXPECT_EQ(names(make_pipeline_schedule("1f1b", 1, 3).actions[0]), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(names(make_pipeline_schedule("gpipe", 1, 3).actions[0]), "F0 F1 F2 B0 B1 B2");
}

TEST(Schedule, GridOfOneFOneBFourStagesEightMicroBatches) {
  PipelineSchedule sc = make_pipeline_schedule("1f1b", 4, 8);
  std::string grid = format_pipeline_schedule(sc);
  std::vector<std::string> lines = lines_of(grid);
  ASSERT_EQ(lines.size(), 55u) << grid;  // header + 54 steps
  EXPECT_EQ(lines[0], "step  stage0  stage1  stage2  stage3");
  EXPECT_EQ(lines[1], "0     F0      .       .       .");
  EXPECT_EQ(lines[2], "1     sA0     rA0     .       .");
  EXPECT_EQ(lines[6], "5     sA2     F1      sA0     rA0");
  EXPECT_EQ(lines[8], "7     sA3     rA2     F1      B0");  // the last stage turns around at once
  EXPECT_EQ(lines[14], "13    rG0     sG0     F2      .");  // the first gradient reaches stage 0
  EXPECT_EQ(lines[54], "53    B7      .       .       .");
  // Every action appears exactly once in its stage's column.
  for (int s = 0; s < 4; ++s) {
    std::vector<std::string> column;
    for (size_t i = 1; i < lines.size(); ++i) {
      std::istringstream cells(lines[i]);
      std::string cell;
      for (int c = 0; c <= s + 1; ++c) cells >> cell;
      if (cell != ".") column.push_back(cell);
    }
    std::string joined;
    for (const std::string& c : column) {
      if (!joined.empty()) joined += ' ';
      joined += c;
    }
    EXPECT_EQ(joined, names(sc.actions[s])) << "stage " << s;
  }
  EXPECT_EQ(*pipeline_schedule_steps(sc), 54);
}

// With every transfer taking a step, 1F1B needs no more steps than GPipe.
TEST(Schedule, OneFOneBIsNoSlowerThanGPipe) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 16; ++m) {
      Result<int> gpipe = pipeline_schedule_steps(make_pipeline_schedule("gpipe", p, m));
      Result<int> one_f_one_b = pipeline_schedule_steps(make_pipeline_schedule("1f1b", p, m));
      ASSERT_TRUE(gpipe.is_ok() && one_f_one_b.is_ok());
      EXPECT_LE(*one_f_one_b, *gpipe) << "P=" << p << " M=" << m;
    }
  }
}

TEST(Schedule, GridEndsWithTheDeadlock) {
  std::string grid = format_pipeline_schedule(make_pipeline_schedule("1f1b", 2, 2), SendMode::kRendezvous);
  EXPECT_EQ(grid,
            "step  stage0  stage1\n"
            "0     F0      .\n"
            "1     sA0     rA0\n"
            "2     F1      F0\n"
            "3     .       B0\n"
            "deadlock (rendezvous sends) at step 4: stage 0 waits at sA1 while stage 1 waits at sG0\n");
}

// ---- broken schedules ----

// A receive hoisted ahead of the send it depends on: stage 0 waits for the gradient of
// micro-batch 0 before sending its activation, stage 1 waits for that activation.
TEST(ScheduleCheck, ReportsADeadlock) {
  PipelineSchedule sc = make_pipeline_schedule("gpipe", 2, 1);
  std::swap(sc.actions[0][1], sc.actions[0][2]);  // F0 sA0 rG0 B0 -> F0 rG0 sA0 B0
  EXPECT_EQ(names(sc.actions[0]), "F0 rG0 sA0 B0");
  EXPECT_EQ(check_message(sc), "deadlock (buffered sends) at step 1: stage 0 waits at rG0 while stage 1 waits at rA0");
}

// In a long pipeline: stage 2 asks for its first gradient before it has received any
// activation, and every stage ends up waiting.
TEST(ScheduleCheck, ReportsADeadlockAcrossALongPipeline) {
  PipelineSchedule sc = make_pipeline_schedule("1f1b", 4, 8);
  auto& stage2 = sc.actions[2];
  const size_t recv = find_action(sc, 2, {ActionKind::kRecvGradient, 0});
  Action moved = stage2[recv];
  stage2.erase(stage2.begin() + recv);
  stage2.insert(stage2.begin(), moved);
  EXPECT_EQ(check_message(sc),
            "deadlock (buffered sends) at step 10: stage 0 waits at rG0, stage 1 waits at rG0, "
            "stage 2 waits at rG0 while stage 3 waits at rA0");
}

// Swapping the receives (and so the forwards) of two micro-batches on one stage breaks
// the in-order matching of transfers on its incoming link.
TEST(ScheduleCheck, ReportsReceivesOutOfOrderOnALink) {
  PipelineSchedule sc = make_pipeline_schedule("gpipe", 3, 4);
  auto& stage1 = sc.actions[1];
  const size_t first = find_action(sc, 1, {ActionKind::kRecvActivation, 1});
  const size_t second = find_action(sc, 1, {ActionKind::kRecvActivation, 2});
  std::swap_ranges(stage1.begin() + first, stage1.begin() + first + 3, stage1.begin() + second);
  EXPECT_EQ(
      check_message(sc),
      "activations stage 0 -> stage 1: send #1 is sA1 but receive #1 is rA2 (transfers on a link match in order)");
}

TEST(ScheduleCheck, ReportsAMissingSend) {
  PipelineSchedule sc = make_pipeline_schedule("1f1b", 4, 8);
  sc.actions[1].erase(sc.actions[1].begin() + find_action(sc, 1, {ActionKind::kSendActivation, 3}));
  EXPECT_EQ(check_message(sc), "stage 1: no sA3 after F3");
  PipelineSchedule grad = make_pipeline_schedule("1f1b", 4, 8);
  grad.actions[3].erase(grad.actions[3].begin() + find_action(grad, 3, {ActionKind::kSendGradient, 7}));
  EXPECT_EQ(check_message(grad), "stage 3: no sG7 after B7");
}

TEST(ScheduleCheck, ReportsAMismatchedMicroBatch) {
  PipelineSchedule sc = make_pipeline_schedule("1f1b", 4, 8);
  sc.actions[2][find_action(sc, 2, {ActionKind::kRecvActivation, 3})].micro_batch = 4;
  EXPECT_EQ(check_message(sc), "stage 2: no rA3 before F3");
  PipelineSchedule sender = make_pipeline_schedule("1f1b", 4, 8);
  sender.actions[1][find_action(sender, 1, {ActionKind::kSendActivation, 3})].micro_batch = 2;
  EXPECT_EQ(check_message(sender), "stage 1: sA2 appears 2 times");
  PipelineSchedule out_of_range = make_pipeline_schedule("1f1b", 4, 8);
  const size_t i = find_action(out_of_range, 2, {ActionKind::kRecvActivation, 3});
  out_of_range.actions[2][i].micro_batch = 8;
  EXPECT_EQ(check_message(out_of_range),
            "stage 2: action " + std::to_string(i) + " (rA8) has a micro-batch outside 0..7");
}

TEST(ScheduleCheck, ReportsComputeOrderAndPlacementErrors) {
  PipelineSchedule backward_first = make_pipeline_schedule("1f1b", 1, 2);
  std::swap(backward_first.actions[0][0], backward_first.actions[0][1]);  // B0 F0 F1 B1
  EXPECT_EQ(check_message(backward_first), "stage 0: B0 comes before F0");

  PipelineSchedule late_receive = make_pipeline_schedule("gpipe", 2, 2);
  std::swap(late_receive.actions[1][0], late_receive.actions[1][1]);  // F0 rA0 ...
  EXPECT_EQ(check_message(late_receive), "stage 1: rA0 comes after F0");

  PipelineSchedule into_the_void = make_pipeline_schedule("gpipe", 2, 2);
  into_the_void.actions[1].push_back({ActionKind::kSendActivation, 0});
  EXPECT_EQ(check_message(into_the_void), "stage 1: sA0, but it is the last stage");

  PipelineSchedule missing_forward = make_pipeline_schedule("gpipe", 1, 2);
  missing_forward.actions[0].erase(missing_forward.actions[0].begin() + 1);
  EXPECT_EQ(check_message(missing_forward), "stage 0: no F1");

  PipelineSchedule short_list = make_pipeline_schedule("gpipe", 3, 2);
  short_list.actions.pop_back();
  EXPECT_EQ(check_message(short_list), "the schedule has action lists for 2 stages, not 3");
}

TEST(Schedule, Names) {
  EXPECT_EQ(action_name({ActionKind::kForward, 3}), "F3");
  EXPECT_EQ(action_name({ActionKind::kBackward, 3}), "B3");
  EXPECT_EQ(action_name({ActionKind::kSendActivation, 3}), "sA3");
  EXPECT_EQ(action_name({ActionKind::kRecvActivation, 3}), "rA3");
  EXPECT_EQ(action_name({ActionKind::kSendGradient, 3}), "sG3");
  EXPECT_EQ(action_name({ActionKind::kRecvGradient, 3}), "rG3");
  EXPECT_EQ(action_name({ActionKind::kBackwardInput, 3}), "I3");
  EXPECT_EQ(action_name({ActionKind::kBackwardWeight, 3}), "W3");
  EXPECT_EQ(action_name({ActionKind::kReduceGradients, -1}), "R");
  EXPECT_EQ(action_name({ActionKind::kForward, 3, 1}, true), "1F3");
  EXPECT_EQ(action_name({ActionKind::kReduceGradients, -1, 2}, true), "2R");
}

}  // namespace
}  // namespace pipeshard

namespace pipeshard {
namespace {

// partition --show-schedule prints the schedule train runs: the grid of this file's
// format_pipeline_schedule, and the micro-batches each stage keeps alive.
TEST(ScheduleCli, PartitionShowsTheScheduleGrid) {
  testing::ScratchDir dir("show-schedule");
  const testing::CommandResult r =
      testing::run_command(testing::quote(testing::tool_path("partition")) + " " +
                           testing::quote(testing::source_path("models/simple.onnx")) +
                           " --stages 2 --micro-batches 3 --show-schedule --out " + testing::quote(dir.path()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(format_pipeline_schedule(make_pipeline_schedule("1f1b", 2, 3))), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("stage 0: at most 2 micro-batches alive"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("stage 1: at most 1 micro-batch alive"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace pipeshard

namespace pipeshard {
namespace {

// ---- the registry ----

// Every row's in-flight formula is what its built schedule keeps alive, and the stage
// runner's slots are as many; the bubble formula is the fill and drain of the pipeline.
// (The rows of several chunks per stage have theirs checked in multi_chunk_schedule_test.cc.)
TEST(ScheduleRegistry, FormulasAgreeWithTheBuiltSchedules) {
  ASSERT_EQ(schedule_names(), (std::vector<std::string>{"gpipe", "1f1b", "zb-h1", "interleaved", "zb-v"}));
  for (const std::string& name : schedule_names()) {
    const ScheduleInfo& info = *find_schedule(name);
    if (info.chunks_per_stage != 1) continue;
    for (int p = 1; p <= 6; ++p) {
      for (int m = 1; m <= 9; ++m) {
        SCOPED_TRACE(name + " P=" + std::to_string(p) + " M=" + std::to_string(m));
        const PipelineSchedule sc = make_pipeline_schedule(name, p, m);
        for (int s = 0; s < p; ++s) {
          EXPECT_EQ(info.in_flight(p, m, s, 1), max_in_flight(sc, s)) << "stage " << s;
          EXPECT_EQ(max_in_flight_of_chunk(sc, s, 0), max_in_flight(sc, s)) << "stage " << s;
        }
        // (P − 1) passes of idle time beside M(F + I + W) of work, at F = I = W; fill and drain
        // cost F + B = 3 passes each with a whole backward, F + I − W = 1 with ZB-H1's.
        const double idle = name == "zb-h1" ? p - 1 : 3.0 * (p - 1);
        EXPECT_DOUBLE_EQ(info.bubble(p, m, 1), idle / (3.0 * m + idle));
      }
    }
  }
  EXPECT_EQ(find_schedule("zb-h2"), nullptr);
  EXPECT_EQ(check_schedule_name("zb-h2").message(),
            "no pipeline schedule 'zb-h2' (there are gpipe, 1f1b, zb-h1, interleaved, zb-v)");
}

// Every action kind has one row of facts, in enum order.
TEST(ScheduleRegistry, EveryActionKindHasItsRow) {
  for (int i = 0; i < kActionKindCount; ++i) {
    const ActionKindInfo& info = action_kind_info(static_cast<ActionKind>(i));
    EXPECT_EQ(static_cast<int>(info.kind), i);
    EXPECT_NE(std::string(info.prefix), "");
    EXPECT_NE(std::string(info.trace_name), "");
  }
  EXPECT_TRUE(action_kind_info(ActionKind::kBackward).input_gradient);
  EXPECT_TRUE(action_kind_info(ActionKind::kBackward).weight_gradient);
  EXPECT_FALSE(action_kind_info(ActionKind::kBackwardInput).weight_gradient);
  EXPECT_FALSE(action_kind_info(ActionKind::kBackwardWeight).input_gradient);
}

// A schedule registered for a scope is found, built, lowered and checked like the
// built-in ones, and gone afterwards.
TEST(ScheduleRegistry, ARegisteredScheduleIsFoundAndLeaves) {
  {
    ScheduleInfo info = *find_schedule("gpipe");
    info.name = "gpipe-copy";
    ScheduleRegistration registration(info);
    ASSERT_NE(find_schedule("gpipe-copy"), nullptr);
    EXPECT_EQ(check_pipeline_schedule(make_pipeline_schedule("gpipe-copy", 3, 4)).message(), "");
    EXPECT_EQ(schedule_names_text(), "gpipe, 1f1b, zb-h1, interleaved, zb-v, gpipe-copy");
  }
  EXPECT_EQ(find_schedule("gpipe-copy"), nullptr);
}

// ---- lowering ----

// R (REDUCE_GRAD) follows each stage's last gradient pass and the send after it.
TEST(ScheduleLowering, ReduceGradientsAfterTheLastBackward) {
  LowerOptions reduce;
  reduce.reduce_gradients = true;
  PipelineSchedule sc = make_pipeline_schedule("1f1b", 2, 2, reduce);
  EXPECT_EQ(names(sc.actions[0]), "F0 sA0 F1 sA1 rG0 B0 rG1 B1 R");
  EXPECT_EQ(names(sc.actions[1]), "rA0 F0 B0 sG0 rA1 F1 B1 sG1 R");
  EXPECT_EQ(check_message(sc), "OK");
  sc.actions[1].pop_back();
  EXPECT_EQ(check_message(sc), "stage 1: no R after the last gradient pass, which other stages have");
  PipelineSchedule early = make_pipeline_schedule("gpipe", 1, 2, reduce);
  std::swap(early.actions[0][2], early.actions[0][4]);  // F0 F1 R B1 B0
  EXPECT_EQ(check_message(early), "stage 0: R comes before B0");
}

// 1F1B on 2 stages and 2 micro-batches with its backwards as I then W: the lowering puts
// the gradient transfers around I, none around W, and R after the last W.
ComputeOrder one_f_one_b_split_2x2() {
  const auto F = [](int k) { return Action{ActionKind::kForward, k}; };
  const auto I = [](int k) { return Action{ActionKind::kBackwardInput, k}; };
  const auto W = [](int k) { return Action{ActionKind::kBackwardWeight, k}; };
  return {{F(0), F(1), I(0), W(0), I(1), W(1)}, {F(0), I(0), W(0), F(1), I(1), W(1)}};
}

TEST(ScheduleLowering, InputAndWeightHalves) {
  LowerOptions reduce;
  reduce.reduce_gradients = true;
  const PipelineSchedule sc = lower_schedule("1f1b-iw", 2, 2, {0, 1}, one_f_one_b_split_2x2(), reduce);
  EXPECT_EQ(names(sc.actions[0]), "F0 sA0 F1 sA1 rG0 I0 W0 rG1 I1 W1 R");
  EXPECT_EQ(names(sc.actions[1]), "rA0 F0 I0 sG0 W0 rA1 F1 I1 sG1 W1 R");
  EXPECT_EQ(check_message(sc), "OK");
  EXPECT_EQ(max_in_flight(sc, 0), 2);
  EXPECT_EQ(last_gradient_action(sc, 1, 0), 9);
}

TEST(ScheduleCheck, ReportsBrokenSplitBackwards) {
  const PipelineSchedule good = lower_schedule("1f1b-iw", 2, 2, {0, 1}, one_f_one_b_split_2x2());
  PipelineSchedule no_w = good;
  no_w.actions[1].erase(no_w.actions[1].begin() + 4);  // rA0 F0 I0 sG0 [W0] ...
  EXPECT_EQ(check_message(no_w), "stage 1: no W0 after I0");
  PipelineSchedule w_first = good;
  std::swap(w_first.actions[0][5], w_first.actions[0][6]);  // ... rG0 W0 I0 ...
  EXPECT_EQ(check_message(w_first), "stage 0: W0 comes before I0");
  PipelineSchedule both = good;
  both.actions[0].insert(both.actions[0].begin() + 7, Action{ActionKind::kBackward, 0});
  EXPECT_EQ(check_message(both), "stage 0: B0 and I0 both: a micro-batch's backward is one B, or one I and one W");
}

// ---- several chunks per stage ----

// Interleaved placement (chunk c on stage c mod P), one forward sweep then one backward
// sweep over the chunks: the lowering adds transfers only between chunks on different
// stages, names carry the model chunk, and every link matches in order.
ComputeOrder interleaved_gpipe(int stages, int micro_batches, int chunks_per_stage) {
  ComputeOrder order(stages);
  for (int s = 0; s < stages; ++s) {
    for (int j = 0; j < chunks_per_stage; ++j)
      for (int k = 0; k < micro_batches; ++k) order[s].push_back({ActionKind::kForward, k, j});
    for (int j = chunks_per_stage; j-- > 0;)
      for (int k = 0; k < micro_batches; ++k) order[s].push_back({ActionKind::kBackward, k, j});
  }
  return order;
}

TEST(ScheduleChunks, InterleavedPlacementLowersAndRuns) {
  const PipelineSchedule sc = lower_schedule("interleaved-gpipe", 2, 2, {0, 1, 0, 1}, interleaved_gpipe(2, 2, 2));
  EXPECT_EQ(sc.chunks(), 4);
  ASSERT_TRUE(sc.names_chunks());
  EXPECT_EQ(testing::stage_labels(sc, 0),
            "0F0 0sA0 0F1 0sA1 2rA0 2F0 2sA0 2rA1 2F1 2sA1 2rG0 2B0 2sG0 2rG1 2B1 2sG1 0rG0 0B0 0rG1 0B1");
  EXPECT_EQ(check_message(sc), "OK");
  EXPECT_EQ(max_in_flight(sc, 0), 4);
  EXPECT_EQ(max_in_flight_of_chunk(sc, 0, 1), 2);
  EXPECT_TRUE(pipeline_schedule_steps(sc).is_ok());
}

// A V: stage s holds chunks s and 2P − 1 − s, so the last stage holds two neighbours,
// which hand over in place (no transfer between them), in dependency order.
TEST(ScheduleChunks, VPlacementHandsOverInPlace) {
  const std::vector<int> v = {0, 1, 1, 0};  // chunks 0..3 on stages 0, 1, 1, 0
  const PipelineSchedule sc = lower_schedule("v-gpipe", 2, 1, v, interleaved_gpipe(2, 1, 2));
  EXPECT_EQ(testing::stage_labels(sc, 1), "1rA0 1F0 2F0 2sA0 2rG0 2B0 1B0 1sG0");
  EXPECT_EQ(check_message(sc), "OK");
  PipelineSchedule swapped = sc;
  std::swap(swapped.actions[1][1], swapped.actions[1][2]);  // 2F0 before 1F0
  EXPECT_EQ(check_message(swapped), "stage 1: 2F0 comes before 1F0");
}

// A row that lets the user choose its chunks per stage (chunks_per_stage 0) and refuses
// some counts: check_schedule_counts() says why, in one sentence that names the count at
// fault, and make_pipeline_schedule() builds what it accepts with the chosen count, or 2
// when none is chosen. Rows of one chunk per stage take 0 or 1 and nothing else.
TEST(ScheduleChunks, ChunkCountsAreCheckedBeforeBuilding) {
  ScheduleInfo info;
  info.name = "interleaved-gpipe";
  info.title = "test";
  info.summary = "one forward sweep, then one backward sweep, over the chunks";
  info.chunks_per_stage = 0;
  info.build = interleaved_gpipe;
  info.in_flight = [](int, int m, int, int v) { return v * m; };
  info.bubble = [](int, int, int) { return 0.0; };
  info.accepts = [](int p, int m, int) {
    return m % p == 0 ? Status::ok()
                      : Status::invalid("micro_batches", std::to_string(m) + " micro-batches are not a multiple of " +
                                                             std::to_string(p) + " stages");
  };
  ScheduleRegistration registration(info);
  const ScheduleInfo& one_f_one_b = *find_schedule("1f1b");
  EXPECT_EQ(chunks_per_stage_of(info, 0), 2);
  EXPECT_EQ(chunks_per_stage_of(info, 3), 3);
  EXPECT_EQ(chunks_per_stage_of(one_f_one_b, 0), 1);
  EXPECT_EQ(chunks_per_stage_of(one_f_one_b, 3), 1);

  EXPECT_TRUE(check_schedule_counts("interleaved-gpipe", 2, 4, 0).is_ok());
  EXPECT_TRUE(check_schedule_counts("interleaved-gpipe", 2, 4, 3).is_ok());
  EXPECT_TRUE(check_schedule_counts("1f1b", 2, 4, 1).is_ok());
  struct Refused {
    int stages, micro_batches, virtual_stages;
    const char* name;
    const char* setting;
    std::string message;
  };
  const Refused refused[] = {
      {2, 4, 1, "interleaved-gpipe", "virtual_stages",
       "schedule 'interleaved-gpipe' needs at least 2 chunks per stage, not 1"},
      {2, 4, 2, "1f1b", "virtual_stages", "schedule '1f1b' holds 1 chunk per stage; a chosen count (2) does not apply"},
      {2, 3, 0, "interleaved-gpipe", "micro_batches", "3 micro-batches are not a multiple of 2 stages"},
      {2, 4, -1, "1f1b", "virtual_stages", "a count of chunks per stage cannot be -1"},
      {0, 4, 0, "1f1b", "stages", "a pipeline needs at least one stage, not 0"},
      {2, 0, 0, "1f1b", "micro_batches", "there must be at least one micro-batch, not 0"},
      {2, 4, 0, "nope", "", "no pipeline schedule 'nope' (there are " + schedule_names_text() + ")"},
  };
  for (const Refused& r : refused) {
    const Status st = check_schedule_counts(r.name, r.stages, r.micro_batches, r.virtual_stages);
    EXPECT_EQ(st.message(), r.message);
    EXPECT_EQ(st.setting(), r.setting) << r.message;
  }

  const PipelineSchedule two = make_pipeline_schedule("interleaved-gpipe", 2, 4);
  EXPECT_EQ(two.stage_chunks, (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
  const PipelineSchedule three = make_pipeline_schedule("interleaved-gpipe", 2, 4, {}, 3);
  EXPECT_EQ(three.stage_chunks, (std::vector<std::vector<int>>{{0, 2, 4}, {1, 3, 5}}));
  EXPECT_EQ(check_message(three), "OK");
  for (int s = 0; s < 2; ++s) EXPECT_EQ(max_in_flight(three, s), info.in_flight(2, 4, s, 3));
}

TEST(ScheduleChunksDeathTest, BuildingRefusedCountsIsABug) {
  EXPECT_DEATH(make_pipeline_schedule("1f1b", 2, 4, {}, 2), "schedule '1f1b' holds 1 chunk per stage");
  EXPECT_DEATH(make_pipeline_schedule("1f1b", 2, 0), "at least one micro-batch");
}

TEST(ScheduleChunks, ReportsPlacementErrors) {
  PipelineSchedule sc = lower_schedule("interleaved-gpipe", 2, 1, {0, 1, 0, 1}, interleaved_gpipe(2, 1, 2));
  sc.stage_chunks[1] = {1, 1};
  EXPECT_EQ(check_message(sc), "stage 1 holds chunk 1: chunks 0..3 go on one stage each");
  PipelineSchedule bad_chunk = lower_schedule("interleaved-gpipe", 2, 1, {0, 1, 0, 1}, interleaved_gpipe(2, 1, 2));
  bad_chunk.actions[0][0].chunk = 5;
  EXPECT_EQ(check_message(bad_chunk), "stage 0: action 0 (F0) names its chunk 5, but the stage holds 2");
}

}  // namespace
}  // namespace pipeshard
