// The timed prediction (schedule/predict.h) against timelines derived by hand: GPipe and
// 1F1B with and without transfer time, an uneven stage, split backwards with W right
// after I or all at the end, two chunks per stage; the bubble as train measures it; the
// activations in flight as max_in_flight() counts them; and partition --show-schedule's
// predictions for a real plan.
//
// Unless a test says otherwise the costs are F = 1, I = W = 1 (so B = 2) on every chunk,
// and times are exact in binary, so they are compared exactly.
#include "schedule/predict.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/host_memory.h"
#include "schedule/registry.h"
#include "tests/schedule/split_one_f_one_b.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

PassCosts unit_costs(int chunks, double transfer = 0) { return uniform_pass_costs(chunks, 1, 1, 1, transfer); }

// One chunk per stage: chunk s on stage s.
std::vector<int> one_chunk_each(int stages) {
  std::vector<int> place;
  for (int s = 0; s < stages; ++s) place.push_back(s);
  return place;
}

// 1F1B with each B split into I and W (tests/schedule/split_one_f_one_b.h), lowered.
PipelineSchedule one_f_one_b_split(int stages, int micro_batches, bool weights_last) {
  const ComputeOrder order = testing::one_f_one_b_split(stages, micro_batches, weights_last);
  PipelineSchedule sc =
      lower_schedule(weights_last ? "1f1b-late-w" : "1f1b-iw", stages, micro_batches, one_chunk_each(stages), order);
  EXPECT_TRUE(check_pipeline_schedule(sc).is_ok()) << check_pipeline_schedule(sc).message();
  return sc;
}

// Two stages, four chunks, chunk c on stage c mod 2: each stage runs the forwards of its
// first chunk, then of its second, for every micro-batch, then the backwards the other way.
PipelineSchedule two_chunks_per_stage(int micro_batches) {
  ComputeOrder order(2);
  for (auto& stage : order) {
    for (int j : {0, 1}) {
      for (int k = 0; k < micro_batches; ++k) stage.push_back({ActionKind::kForward, k, j});
    }
    for (int j : {1, 0}) {
      for (int k = 0; k < micro_batches; ++k) stage.push_back({ActionKind::kBackward, k, j});
    }
  }
  PipelineSchedule sc = lower_schedule("two-chunks", 2, micro_batches, {0, 1, 0, 1}, order);
  EXPECT_TRUE(check_pipeline_schedule(sc).is_ok()) << check_pipeline_schedule(sc).message();
  return sc;
}

// When stage s's action `action` starts and finishes.
SchedulePrediction::Interval when(const PipelineSchedule& sc, const SchedulePrediction& p, int s, Action action) {
  const auto& list = sc.actions[s];
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i] == action) return p.timeline[s][i];
  }
  ADD_FAILURE() << action_label(sc, s, action) << " not on stage " << s;
  return {};
}

double mean_idle_share(const SchedulePrediction& p) {
  double idle = 0;
  for (size_t s = 0; s < p.end.size(); ++s) idle += 1 - p.busy[s] / p.end[s];
  return idle / p.end.size();
}

// ---- GPipe and 1F1B ----

// Without transfer time both take (M + P − 1)(F + B) = 3(M + P − 1). The last stage, once
// its first activation is there at P − 1, never waits: it runs 3M and ends at 3M + P − 1.
// Its last gradient then walks back one B = 2 per stage, each stage having finished
// everything else by the time it arrives: stage s ends at 3(M + P − 1) − 2s.
TEST(SchedulePredict, GPipeAndOneFOneBWithoutTransfers) {
  for (const char* name : {"gpipe", "1f1b"}) {
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 6; ++m) {
        SCOPED_TRACE(std::string(name) + " P=" + std::to_string(p) + " M=" + std::to_string(m));
        const PipelineSchedule sc = make_pipeline_schedule(name, p, m);
        const SchedulePrediction pred = predict_schedule(sc, unit_costs(p));
        EXPECT_EQ(pred.step, 3.0 * (m + p - 1));
        ASSERT_EQ(pred.end.size(), static_cast<size_t>(p));
        for (int s = 0; s < p; ++s) {
          EXPECT_EQ(pred.end[s], 3.0 * (m + p - 1) - 2 * s) << "stage " << s;
          EXPECT_EQ(pred.busy[s], 3.0 * m) << "stage " << s;
          EXPECT_EQ(pred.timeline[s].size(), sc.actions[s].size());
          EXPECT_EQ(pred.timeline[s].back().finish, pred.end[s]);
        }
        EXPECT_DOUBLE_EQ(pred.bubble, mean_idle_share(pred));
      }
    }
  }
}

// The bubble by hand for 1F1B, P = 2, M = 2. Stage 0: F0 [0,1], F1 [1,2], waits for rG0
// until stage 1 has run F0 [1,2] and B0 [2,4]; B0 [4,6]; rG1 comes when stage 1's F1
// [4,5] and B1 [5,7] are done; B1 [7,9]. Busy 6 of 9 and 6 of 7: bubble (3/9 + 1/7)/2.
TEST(SchedulePredict, BubbleIsTheMeanIdleShareOfTheStages) {
  const PipelineSchedule sc = make_pipeline_schedule("1f1b", 2, 2);
  const SchedulePrediction p = predict_schedule(sc, unit_costs(2));
  EXPECT_EQ(when(sc, p, 0, {ActionKind::kRecvGradient, 0}).start, 2);
  EXPECT_EQ(when(sc, p, 0, {ActionKind::kRecvGradient, 0}).finish, 4);
  EXPECT_EQ(when(sc, p, 0, {ActionKind::kBackward, 1}).start, 7);
  EXPECT_EQ(when(sc, p, 1, {ActionKind::kForward, 1}).start, 4);
  EXPECT_EQ(p.end, (std::vector<double>{9, 7}));
  EXPECT_EQ(p.busy, (std::vector<double>{6, 6}));
  EXPECT_DOUBLE_EQ(p.bubble, (3.0 / 9 + 1.0 / 7) / 2);
  // Not the registry's (P−1)/(M+P−1) = 1/3, which is stage 0's share alone: the last
  // stage finishes earlier and idles less of its own time, as train measures it. For any
  // M on two stages (ends 3(M + 1) and 3M + 1, busy 3M): ½[1/(M + 1) + 1/(3M + 1)].
  EXPECT_LT(p.bubble, find_schedule("1f1b")->bubble(2, 2, 1));
  for (int m = 1; m <= 6; ++m) {
    for (const char* name : {"gpipe", "1f1b"}) {
      const SchedulePrediction pm = predict_schedule(make_pipeline_schedule(name, 2, m), unit_costs(2));
      EXPECT_DOUBLE_EQ(pm.bubble, (1.0 / (m + 1) + 1.0 / (3 * m + 1)) / 2) << name << " M=" << m;
    }
  }
}

// GPipe with transfer time t: the forwards flow without waits, each stage's activation
// arriving just as it finishes the previous micro-batch, so the last stage ends its
// forwards at M + P − 1 + (P − 1)t; its backwards flow back the same way, t per stage.
// Stage s ends at 3(M + P − 1) − 2s + (2(P − 1) − s)t: the step grows by 2(P − 1)t.
TEST(SchedulePredict, GPipeStepGrowsByOneTransferPerLinkEachWay) {
  const double t = 0.25;
  for (int p = 1; p <= 4; ++p) {
    for (int m = 1; m <= 6; ++m) {
      SCOPED_TRACE("P=" + std::to_string(p) + " M=" + std::to_string(m));
      const SchedulePrediction pred = predict_schedule(make_pipeline_schedule("gpipe", p, m), unit_costs(p, t));
      EXPECT_EQ(pred.step, 3.0 * (m + p - 1) + 2 * (p - 1) * t);
      for (int s = 0; s < p; ++s) EXPECT_EQ(pred.end[s], 3.0 * (m + p - 1) - 2 * s + (2 * (p - 1) - s) * t);
    }
  }
}

// 1F1B with transfer time t. For M ≤ 2 it runs as GPipe does (every stage but the last
// has the same order, and the last stage's earlier B0 changes no later time): + 2(P − 1)t.
// Beyond, its steady state leaves no slack for a round trip: stage 0 runs F(k + P − 1)
// between F(k) and B(k), exactly the compute of micro-batch k's trip down and back, so
// every trip's 2(P − 1)t transfers show. For P = 2, on stage 0 (F0 F1 B0 F2 B1 F3 …), with
// a_k the end of F(k) and e_k the end of stage 1's B(k):
//   e_k = max(a_k + t, e_{k−1}) + 3,  B(k) starts at max(e_k + t, a_{k+1}),  a_{k+2} = its end + 1,
// which gives a_0 = 1, a_1 = 2, e_0 = 4 + t, B0 [4 + 2t, 6 + 2t], a_2 = 7 + 2t, e_1 = 7 + t,
// B1 [7 + 2t, 9 + 2t], a_3 = 10 + 2t, e_2 = 10 + 3t, B2 [10 + 4t, 12 + 4t]: each pair of
// micro-batches adds one round trip, 2t, and the step is 3(M + 1) + 2⌈M/2⌉t.
TEST(SchedulePredict, OneFOneBStepGrowsByEveryRoundTripItCannotHide) {
  const double t = 0.25;
  for (int p = 1; p <= 4; ++p) {
    for (int m = 1; m <= 2; ++m) {
      SCOPED_TRACE("P=" + std::to_string(p) + " M=" + std::to_string(m));
      const SchedulePrediction pred = predict_schedule(make_pipeline_schedule("1f1b", p, m), unit_costs(p, t));
      EXPECT_EQ(pred.step, 3.0 * (m + p - 1) + 2 * (p - 1) * t);
    }
  }
  for (int m = 1; m <= 8; ++m) {
    SCOPED_TRACE("P=2 M=" + std::to_string(m));
    const PipelineSchedule sc = make_pipeline_schedule("1f1b", 2, m);
    const SchedulePrediction pred = predict_schedule(sc, unit_costs(2, t));
    EXPECT_EQ(pred.step, 3.0 * (m + 1) + 2 * ((m + 1) / 2) * t);
    if (m >= 3) {
      EXPECT_EQ(when(sc, pred, 0, {ActionKind::kBackward, 2}).start, 10 + 4 * t);
    }
  }
  // So 1F1B is slower than GPipe once transfers cost and M > 2.
  const SchedulePrediction gpipe = predict_schedule(make_pipeline_schedule("gpipe", 3, 4), unit_costs(3, t));
  const SchedulePrediction one_f_one_b = predict_schedule(make_pipeline_schedule("1f1b", 3, 4), unit_costs(3, t));
  EXPECT_GT(one_f_one_b.step, gpipe.step);
}

// ---- uneven stages ----

// Three stages, the middle one twice as slow (F = 2, B = 4; the others F = 1, B = 2). It
// must run M·6, so no schedule beats that. GPipe: stage 1 runs its forwards from 1 to
// 1 + 2M, then waits 3 while stage 2 runs its last F and first B, then runs its M
// backwards back to back (gradients come every 2, it takes 4), ending at 6M + 4; stage 0's
// last B makes 6M + 6. 1F1B (M ≥ 2): stage 1 waits 1 at the start and once more, 1, for
// its first gradient (F0 [1,3], F1 [3,5], stage 2's B0 ends at 6), then never again: it
// ends at 6M + 2 and stage 0 at 6M + 4.
TEST(SchedulePredict, TheSlowestStageSetsThePace) {
  PassCosts costs;
  costs.forward = {1, 2, 1};
  costs.backward_input = costs.forward;
  costs.backward_weight = costs.forward;
  for (int m = 1; m <= 6; ++m) {
    SCOPED_TRACE("M=" + std::to_string(m));
    const SchedulePrediction gpipe = predict_schedule(make_pipeline_schedule("gpipe", 3, m), costs);
    const SchedulePrediction one_f_one_b = predict_schedule(make_pipeline_schedule("1f1b", 3, m), costs);
    EXPECT_GE(gpipe.step, 6.0 * m);
    EXPECT_GE(one_f_one_b.step, 6.0 * m);
    EXPECT_EQ(gpipe.busy, (std::vector<double>{3.0 * m, 6.0 * m, 3.0 * m}));
    EXPECT_EQ(gpipe.end[1], 6.0 * m + 4);
    EXPECT_EQ(gpipe.step, 6.0 * m + 6);
    if (m >= 2) {
      EXPECT_EQ(one_f_one_b.end[1], 6.0 * m + 2);
      EXPECT_EQ(one_f_one_b.step, 6.0 * m + 4);
    }
  }
}

// ---- split backwards ----

// W right after I: the gradient leaves after I, so the last one walks back I = 1 per stage
// instead of B = 2 (stage P − 1 sends it at 3M + P − 2, stage 0 receives it P − 2 later,
// runs I and W): 3(M + P − 1) − (P − 1), one W per link less than 1F1B. Every W moved to
// the end of its stage's list takes the same time without transfers. By hand for P = 2,
// M = 2: stage 1 runs F0 [1,2], I0 [2,3] (sG0 at 3), F1 [3,4], I1 [4,5] (sG1 at 5), W0 W1
// [5,7]; stage 0 runs F0 F1 [0,2], I0 [3,4], waits for rG1 until 5, I1 [5,6], W0 W1 [6,8].
TEST(SchedulePredict, SplitBackwardsSendTheGradientBeforeW) {
  for (int p = 1; p <= 4; ++p) {
    for (int m = 1; m <= 6; ++m) {
      SCOPED_TRACE("P=" + std::to_string(p) + " M=" + std::to_string(m));
      const SchedulePrediction whole = predict_schedule(make_pipeline_schedule("1f1b", p, m), unit_costs(p));
      const SchedulePrediction iw = predict_schedule(one_f_one_b_split(p, m, false), unit_costs(p));
      const SchedulePrediction late = predict_schedule(one_f_one_b_split(p, m, true), unit_costs(p));
      EXPECT_EQ(iw.step, 3.0 * (m + p - 1) - (p - 1));
      EXPECT_EQ(iw.step, whole.step - (p - 1));
      EXPECT_EQ(late.step, iw.step);
      EXPECT_EQ(late.busy, whole.busy);
    }
  }
  const PipelineSchedule sc = one_f_one_b_split(2, 2, true);
  const SchedulePrediction p = predict_schedule(sc, unit_costs(2));
  EXPECT_EQ(when(sc, p, 1, {ActionKind::kSendGradient, 1}).start, 5);
  EXPECT_EQ(when(sc, p, 1, {ActionKind::kBackwardWeight, 0}).start, 5);
  EXPECT_EQ(when(sc, p, 0, {ActionKind::kRecvGradient, 1}).start, 4);
  EXPECT_EQ(when(sc, p, 0, {ActionKind::kRecvGradient, 1}).finish, 5);
  EXPECT_EQ(when(sc, p, 0, {ActionKind::kBackwardWeight, 0}).start, 6);
  EXPECT_EQ(p.end, (std::vector<double>{8, 7}));
  EXPECT_EQ(p.step, 8);
  // Late weights keep every micro-batch alive until the end: M in flight, not 1F1B's P − s.
  EXPECT_EQ(p.peak_in_flight, (std::vector<int>{2, 2}));
}

// ---- several chunks per stage ----

// Chunks 0..3 on stages 0, 1, 0, 1; M = 2. Forwards: chunk c's F(k) runs [c + k, c + k + 1]
// (each waits only for the chunk before), so chunk 3's are [3,4] and [4,5]; its backwards
// run [5,7] and [7,9]. Chunk 2 (stage 0, idle since 4) runs B0 [7,9] and B1 [9,11], chunk 1
// (stage 1) [9,11] and [11,13], chunk 0 (stage 0) [11,13] and [13,15]. Each stage is busy
// 2 chunks × 2 micro-batches × 3 = 12.
// ZB-H1 at F = I = W = 1 without transfers: the bubble the paper promises, (P − 1)(F + I −
// W) = P − 1 beside the 3M of work, against 1F1B's 3(P − 1), once there are enough
// micro-batches to fill it (M ≥ P); the step is 1F1B's less 2(P − 1).
TEST(SchedulePredict, ZeroBubbleH1TakesAThirdOfOneFOneBsBubble) {
  for (int p = 2; p <= 6; ++p) {
    for (int m = p; m <= 3 * p; ++m) {
      SCOPED_TRACE("P=" + std::to_string(p) + " M=" + std::to_string(m));
      const SchedulePrediction zb = predict_schedule(make_pipeline_schedule("zb-h1", p, m), unit_costs(p));
      const SchedulePrediction one = predict_schedule(make_pipeline_schedule("1f1b", p, m), unit_costs(p));
      EXPECT_EQ(zb.step, 3 * m + (p - 1));
      EXPECT_EQ(one.step, 3 * m + 3 * (p - 1));
      EXPECT_EQ(zb.peak_in_flight[0], one.peak_in_flight[0]);  // 1F1B's peak, on stage 0
    }
  }
}

TEST(SchedulePredict, TwoChunksPerStage) {
  const PipelineSchedule sc = two_chunks_per_stage(2);
  const SchedulePrediction p = predict_schedule(sc, unit_costs(4));
  EXPECT_EQ(when(sc, p, 1, {ActionKind::kForward, 1, 1}).start, 4);  // chunk 3, micro-batch 1
  EXPECT_EQ(when(sc, p, 0, {ActionKind::kRecvGradient, 0, 1}).start, 4);
  EXPECT_EQ(when(sc, p, 0, {ActionKind::kRecvGradient, 0, 1}).finish, 7);
  EXPECT_EQ(when(sc, p, 1, {ActionKind::kBackward, 1, 0}).start, 11);  // chunk 1, micro-batch 1
  EXPECT_EQ(p.end, (std::vector<double>{15, 13}));
  EXPECT_EQ(p.busy, (std::vector<double>{12, 12}));
  EXPECT_EQ(p.step, 15);
  EXPECT_DOUBLE_EQ(p.bubble, (3.0 / 15 + 1.0 / 13) / 2);
  EXPECT_EQ(p.peak_in_flight, (std::vector<int>{4, 4}));
}

// Costs are per model chunk, not per a stage's index of it: with F = c + 1 on chunk c (B
// twice that) and one micro-batch, the run is one chain, F 1 + 2 + 3 + 4 = 10, then B 8 +
// 6 + 4 + 2: stage 1 ends with chunk 1's B at 28, stage 0 with chunk 0's at 30.
TEST(SchedulePredict, CostsArePerModelChunk) {
  const PipelineSchedule sc = two_chunks_per_stage(1);
  PassCosts costs;
  costs.forward = {1, 2, 3, 4};
  costs.backward_input = costs.forward;
  costs.backward_weight = costs.forward;
  const SchedulePrediction p = predict_schedule(sc, costs);
  EXPECT_EQ(p.end, (std::vector<double>{30, 28}));
  EXPECT_EQ(p.busy, (std::vector<double>{3 * (1 + 3), 3 * (2 + 4)}));
}

// ---- in flight, R, bad input ----

TEST(SchedulePredict, PeakInFlightIsMaxInFlight) {
  for (const std::string& name : schedule_names()) {
    for (int p = 1; p <= 4; ++p) {
      for (int m = 1; m <= 5; ++m) {
        if (!check_schedule_counts(name, p, m, 0).is_ok()) continue;  // zb-v needs M >= P
        const PipelineSchedule sc = make_pipeline_schedule(name, p, m);
        const SchedulePrediction pred = predict_schedule(sc, unit_costs(sc.chunks()));
        ASSERT_EQ(pred.peak_in_flight.size(), static_cast<size_t>(p));
        for (int s = 0; s < p; ++s) EXPECT_EQ(pred.peak_in_flight[s], max_in_flight(sc, s)) << name << " " << s;
      }
    }
  }
  const PipelineSchedule sc = one_f_one_b_split(3, 4, true);
  const SchedulePrediction pred = predict_schedule(sc, unit_costs(3));
  for (int s = 0; s < 3; ++s) EXPECT_EQ(pred.peak_in_flight[s], max_in_flight(sc, s));
}

// R is the data-parallel reduction, not the schedule's time: it changes nothing.
TEST(SchedulePredict, ReductionsTakeNoTime) {
  LowerOptions reduce;
  reduce.reduce_gradients = true;
  const PipelineSchedule plain = make_pipeline_schedule("1f1b", 3, 4);
  const PipelineSchedule with_r = make_pipeline_schedule("1f1b", 3, 4, reduce);
  ASSERT_TRUE(check_pipeline_schedule(with_r).is_ok());
  const SchedulePrediction a = predict_schedule(plain, unit_costs(3, 0.5));
  const SchedulePrediction b = predict_schedule(with_r, unit_costs(3, 0.5));
  EXPECT_EQ(a.end, b.end);
  EXPECT_EQ(a.busy, b.busy);
  EXPECT_EQ(b.timeline[0].back().start, b.timeline[0].back().finish);  // R itself
}

TEST(SchedulePredictDeathTest, RefusesWrongCostsAndDeadlocks) {
  const PipelineSchedule sc = make_pipeline_schedule("1f1b", 2, 2);
  EXPECT_DEATH(predict_schedule(sc, unit_costs(3)), "forward costs for 3 chunks, not 2");
  EXPECT_DEATH(predict_schedule(sc, unit_costs(2, -1)), "transfer time -1.* below 0");
  // Stage 0 waits for the gradient of micro-batch 0 while stage 1 waits for the activation
  // of micro-batch 1, which stage 0 sends after that gradient.
  const ComputeOrder crossed = {
      {{ActionKind::kForward, 0}, {ActionKind::kBackward, 0}, {ActionKind::kForward, 1}, {ActionKind::kBackward, 1}},
      {{ActionKind::kForward, 1}, {ActionKind::kBackward, 1}, {ActionKind::kForward, 0}, {ActionKind::kBackward, 0}}};
  const PipelineSchedule stuck = lower_schedule("crossed", 2, 2, {0, 1}, crossed);
  EXPECT_DEATH(predict_schedule(stuck, unit_costs(2)),
               "schedule 'crossed' deadlocks: stage 0 waits at rG0, stage 1 waits at rA1");
}

// ---- partition --show-schedule ----

// The numbers of the line partition prints for schedule `name`: "  NAME  bubble B  step S (...)".
struct PrintedPrediction {
  double bubble = -1, step = -1;
};
PrintedPrediction printed_prediction(const std::string& out, const std::string& name) {
  const size_t at = out.find("\n  " + name + " ");
  if (at == std::string::npos) return {};
  const std::string line = out.substr(at + 1, out.find('\n', at + 1) - at - 1);
  PrintedPrediction p;
  char step[64] = {};
  if (std::sscanf(line.c_str(), " %*s bubble %lf step %63s", &p.bubble, step) != 2) return {};
  std::string digits;
  for (const char* c = step; *c; ++c) {
    if (*c != ',') digits += *c;
  }
  p.step = std::stod(digits);
  return p;
}

// partition --show-schedule predicts every registered schedule on its plan, with F from the
// flops estimate for a micro-batch (batch 32 in 4: 8 samples) and I = W = F. simple.onnx cut
// in two by parameters puts more multiply-adds on stage 1: F = a on stage 0, b ≥ a on stage
// 1, B = 2F. Under GPipe and 1F1B alike stage 1 then never waits once its first activation
// is there at a (each later one arrives before it wants it, since a ≤ b), ends at a + 3bM,
// and stage 0 ends 2a later with its last B: step 3a + 3bM, bubble
// ½[(3a + 3bM − 3aM)/(3a + 3bM) + a/(a + 3bM)]. With a = b that is ½[1/(M + 1) + 1/(3M + 1)]:
// stage 0's share is the registry's (P−1)/(M+P−1), the last stage's is smaller. Under
// ZB-H1 stage 1 still never waits after a and ends at a + 3bM, but its last input gradient
// leaves 2b before its end (its two W's owed come after it), so stage 0 ends with that I and
// its W at a + 3bM − 2b + 2a: step a + 3bM, bubble
// ½[1 − 3aM/(3a + 3bM − 2b) + a/(a + 3bM)].
TEST(SchedulePredictCli, PartitionPredictsEveryRegisteredSchedule) {
  testing::ScratchDir dir("show-schedule-predict");
  const int m = 4;
  const testing::CommandResult r = testing::run_command(
      testing::quote(testing::tool_path("partition")) + " " +
      testing::quote(testing::source_path("models/simple.onnx")) +
      " --stages 2 --batch-size 32 --micro-batches 4 --show-schedule --out " + testing::quote(dir.path()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json plan = nlohmann::json::parse(testing::read_text(dir / "plan.json"));
  const double a = plan["stages"][0]["flops_per_sample"].get<double>() * 8;
  const double b = plan["stages"][1]["flops_per_sample"].get<double>() * 8;
  ASSERT_GT(a, 0);
  ASSERT_GE(b, a);
  struct Expected {
    double step, bubble;
  };
  const std::map<std::string, Expected> expected = {
      {"gpipe", {3 * a + 3 * b * m, ((3 * a + 3 * b * m - 3 * a * m) / (3 * a + 3 * b * m) + a / (a + 3 * b * m)) / 2}},
      {"1f1b", {3 * a + 3 * b * m, ((3 * a + 3 * b * m - 3 * a * m) / (3 * a + 3 * b * m) + a / (a + 3 * b * m)) / 2}},
      {"zb-h1", {a + 3 * b * m, (1 - 3 * a * m / (3 * a + 3 * b * m - 2 * b) + a / (a + 3 * b * m)) / 2}},
  };
  EXPECT_NE(r.out.find("predicted for 2 stages and 4 micro-batches"), std::string::npos) << r.out;
  for (const std::string& name : schedule_names()) {
    SCOPED_TRACE(name);
    if (find_schedule(name)->chunks_per_stage != 1) {  // 2 × 2 chunks of a model of three layers
      EXPECT_NE(r.out.find(" not predicted: cannot cut 4 chunks (2 stages of 2 for the " + name +
                           " schedule) from 3 "
                           "layers"),
                std::string::npos)
          << r.out;
      continue;
    }
    ASSERT_TRUE(expected.count(name)) << "a new schedule: derive its figures here";
    // The memory each would need: the estimate of a plan made for it.
    const testing::CommandResult own =
        testing::run_command(testing::quote(testing::tool_path("partition")) + " " +
                             testing::quote(testing::source_path("models/simple.onnx")) +
                             " --stages 2 --batch-size 32 --micro-batches 4 --json --schedule " + name + " --out " +
                             testing::quote(dir / name));
    ASSERT_EQ(own.exit_code, 0) << own.err;
    const nlohmann::json own_plan = nlohmann::json::parse(own.out);
    const std::string memory = bytes_text(own_plan["stages"][0]["memory_bytes"].get<int64_t>()) + ", " +
                               bytes_text(own_plan["stages"][1]["memory_bytes"].get<int64_t>());
    EXPECT_NE(r.out.find("  " + name + " "), std::string::npos);
    EXPECT_NE(r.out.find("memory per rank " + memory + "\n"), std::string::npos) << memory << "\n" << r.out;
    const PrintedPrediction p = printed_prediction(r.out, name);
    EXPECT_EQ(p.step, expected.at(name).step) << r.out;
    EXPECT_NEAR(p.bubble, expected.at(name).bubble, 0.00005) << r.out;  // printed to 4 decimals
  }
  EXPECT_NE(r.out.find("costs assumed: F per stage from the flops estimate ("), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("multiply-adds for a micro-batch of 8 samples; times are in multiply-adds), I = W = F, "
                       "transfers free\n"),
            std::string::npos)
      << r.out;
  // The grid of the chosen schedule is still there.
  EXPECT_NE(r.out.find(format_pipeline_schedule(make_pipeline_schedule("1f1b", 2, 4))), std::string::npos) << r.out;
}

}  // namespace
}  // namespace pipeshard
