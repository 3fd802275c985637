// The registry's rows of several chunks per stage (schedule/builders.h): interleaved 1F1B
// and ZB-V. For every small pipeline each passes the checker, keeps alive what its row
// says, runs each chunk's weight gradients in micro-batch order (so every gradient adds up
// its micro-batches in one process's order, as the other rows do), and takes the bubble its
// row states under the timed prediction at unit costs, less than its one-chunk peer's
// (1F1B, ZB-H1); a golden grid for P = 2, M = 4 shows each order.
//
// Unit costs: F = I = W = 1 per chunk (so B = 2), transfers free.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "schedule/predict.h"
#include "schedule/registry.h"
#include "schedule/schedule.h"
#include "tests/schedule/stage_labels.h"

namespace pipeshard {
namespace {

std::string counts(int p, int m, int v) {
  return "P=" + std::to_string(p) + " M=" + std::to_string(m) + " v=" + std::to_string(v);
}

// The micro-batches of stage s's chunk j's actions of `kind`, in list order.
std::vector<int> micro_batches_of(const PipelineSchedule& sc, int s, int j, ActionKind kind) {
  std::vector<int> out;
  for (const Action& a : sc.actions[s]) {
    if (a.kind == kind && a.chunk == j) out.push_back(a.micro_batch);
  }
  return out;
}

std::vector<int> zero_to(int m) {
  std::vector<int> out;
  for (int k = 0; k < m; ++k) out.push_back(k);
  return out;
}

SchedulePrediction predict_at_unit_costs(const PipelineSchedule& sc) {
  return predict_schedule(sc, uniform_pass_costs(sc.chunks(), 1, 1, 1));
}

// The step's idle share when every stage computes `busy`: the registry's bubble.
double idle_share(const SchedulePrediction& p, double busy) {
  for (double b : p.busy) EXPECT_EQ(b, busy);
  return (p.step - busy) / p.step;
}

// ---- interleaved 1F1B ----

// Chunk c on stage c mod P; whole backwards, each chunk's forwards and backwards in
// micro-batch order; as many alive as the row says; checked, with and without R.
TEST(Interleaved, EverySmallPipelinePassesInMicroBatchOrder) {
  const ScheduleInfo& info = *find_schedule("interleaved");
  EXPECT_EQ(info.chunks_per_stage, 0);  // the user chooses v
  LowerOptions reduce;
  reduce.reduce_gradients = true;
  for (int v = 2; v <= 4; ++v) {
    for (int p = 1; p <= 6; ++p) {
      for (int m = 1; m <= 3 * p; ++m) {
        SCOPED_TRACE(counts(p, m, v));
        ASSERT_TRUE(check_schedule_counts("interleaved", p, m, v).is_ok());
        const PipelineSchedule sc = make_pipeline_schedule("interleaved", p, m, {}, v);
        ASSERT_EQ(sc.chunks(), p * v);
        EXPECT_EQ(check_pipeline_schedule(sc).message(), "");
        EXPECT_EQ(check_pipeline_schedule(make_pipeline_schedule("interleaved", p, m, reduce, v)).message(), "");
        for (int s = 0; s < p; ++s) {
          EXPECT_EQ(info.in_flight(p, m, s, v), max_in_flight(sc, s)) << "stage " << s;
          for (int j = 0; j < v; ++j) {
            EXPECT_EQ(sc.chunk_of(s, j), j * p + s);
            EXPECT_EQ(micro_batches_of(sc, s, j, ActionKind::kForward), zero_to(m)) << "stage " << s << " chunk " << j;
            EXPECT_EQ(micro_batches_of(sc, s, j, ActionKind::kBackward), zero_to(m)) << "stage " << s << " chunk " << j;
          }
        }
      }
    }
  }
  // v = 2 when none is chosen.
  EXPECT_EQ(make_pipeline_schedule("interleaved", 3, 6).chunks(), 6);
}

// At unit costs every stage computes 3vM and the step is 3(vM + P − 1) for M ≥ P, where
// the row's figure is the textbook (P − 1)/(vM + P − 1); for M < P it is 3(vP + M − 1),
// and the row's figure is that one.
TEST(Interleaved, BubbleIsWhatThePredictorGives) {
  const ScheduleInfo& info = *find_schedule("interleaved");
  for (int v = 2; v <= 4; ++v) {
    for (int p = 1; p <= 6; ++p) {
      for (int m = 1; m <= 3 * p; ++m) {
        SCOPED_TRACE(counts(p, m, v));
        const SchedulePrediction pred = predict_at_unit_costs(make_pipeline_schedule("interleaved", p, m, {}, v));
        EXPECT_EQ(pred.step, m >= p ? 3.0 * (v * m + p - 1) : 3.0 * (v * p + m - 1));
        EXPECT_DOUBLE_EQ(info.bubble(p, m, v), idle_share(pred, 3.0 * v * m));
        if (m >= p) {
          EXPECT_DOUBLE_EQ(info.bubble(p, m, v), (p - 1.0) / (v * m + p - 1));
        }
      }
    }
  }
}

// The predictor's bubble (the stages' mean idle share) at v = 2 is below 1F1B's once there
// are as many micro-batches as stages. (At M = 1 there is nothing to interleave, and
// interleaving's longer trip round the stages costs more than it saves.)
TEST(Interleaved, LessBubbleThanOneFOneB) {
  for (int p = 2; p <= 6; ++p) {
    for (int m = p; m <= 3 * p; ++m) {
      SCOPED_TRACE(counts(p, m, 2));
      const double interleaved = predict_at_unit_costs(make_pipeline_schedule("interleaved", p, m, {}, 2)).bubble;
      const double one_f_one_b = predict_at_unit_costs(make_pipeline_schedule("1f1b", p, m)).bubble;
      EXPECT_LT(interleaved, one_f_one_b);
    }
  }
}

// Two stages, chunks 0 and 2 on stage 0, 1 and 3 on stage 1, four micro-batches in two
// groups of two: stage 0 forwards the first group through chunk 0, then chunk 2, and
// 2(P − 1) + (v − 1)·2 = 4 forwards in takes its first backward, of chunk 2; stage 1's
// first backward comes after (v − 1)·2 = 2 forwards, when micro-batch 0 has left chunk 3.
TEST(Interleaved, TwoStagesFourMicroBatches) {
  const PipelineSchedule sc = make_pipeline_schedule("interleaved", 2, 4);
  EXPECT_EQ(testing::stage_labels(sc, 0),
            "0F0 0sA0 0F1 0sA1 2rA0 2F0 2sA0 2rA1 2F1 2sA1 0F2 0sA2 2rG0 2B0 2sG0 0F3 0sA3 2rG1 2B1 2sG1 2rA2 2F2 "
            "2sA2 0rG0 0B0 2rA3 2F3 2sA3 0rG1 0B1 2rG2 2B2 2sG2 2rG3 2B3 2sG3 0rG2 0B2 0rG3 0B3");
  EXPECT_EQ(format_pipeline_schedule(sc),
            "step  stage0  stage1\n"
            "0     0F0     .\n"
            "1     0sA0    1rA0\n"
            "2     0F1     1F0\n"
            "3     0sA1    1sA0\n"
            "4     2rA0    1rA1\n"
            "5     2F0     1F1\n"
            "6     2sA0    1sA1\n"
            "7     2rA1    3rA0\n"
            "8     2F1     3F0\n"
            "9     2sA1    3B0\n"
            "10    0F2     3sG0\n"
            "11    0sA2    3rA1\n"
            "12    2rG0    3F1\n"
            "13    2B0     3B1\n"
            "14    2sG0    3sG1\n"
            "15    0F3     1rA2\n"
            "16    0sA3    1F2\n"
            "17    2rG1    1sA2\n"
            "18    2B1     1rG0\n"
            "19    2sG1    1B0\n"
            "20    2rA2    1sG0\n"
            "21    2F2     1rA3\n"
            "22    2sA2    1F3\n"
            "23    0rG0    1sA3\n"
            "24    0B0     1rG1\n"
            "25    2rA3    1B1\n"
            "26    2F3     1sG1\n"
            "27    2sA3    3rA2\n"
            "28    0rG1    3F2\n"
            "29    0B1     3B2\n"
            "30    2rG2    3sG2\n"
            "31    2B2     3rA3\n"
            "32    2sG2    3F3\n"
            "33    .       3B3\n"
            "34    2rG3    3sG3\n"
            "35    2B3     1rG2\n"
            "36    2sG3    1B2\n"
            "37    0rG2    1sG2\n"
            "38    0B2     1rG3\n"
            "39    .       1B3\n"
            "40    0rG3    1sG3\n"
            "41    0B3     .\n");
}

// ---- ZB-V ----

// The V: stage s holds chunks s and 2P − 1 − s; backwards split, each chunk's F, I and W in
// micro-batch order; 2P chunk-micro-batches alive on every stage (P whole micro-batches'
// activations, 1F1B's stage 0), as the row says; checked, with and without R.
TEST(ZeroBubbleV, EverySmallPipelinePassesInMicroBatchOrder) {
  const ScheduleInfo& info = *find_schedule("zb-v");
  EXPECT_EQ(info.chunks_per_stage, 2);
  LowerOptions reduce;
  reduce.reduce_gradients = true;
  for (int p = 1; p <= 6; ++p) {
    for (int m = p; m <= 3 * p; ++m) {
      SCOPED_TRACE(counts(p, m, 2));
      const PipelineSchedule sc = make_pipeline_schedule("zb-v", p, m);
      EXPECT_EQ(check_pipeline_schedule(sc).message(), "");
      EXPECT_EQ(check_pipeline_schedule(make_pipeline_schedule("zb-v", p, m, reduce)).message(), "");
      for (int s = 0; s < p; ++s) {
        EXPECT_EQ(sc.stage_chunks[s], (std::vector<int>{s, 2 * p - 1 - s}));
        EXPECT_EQ(info.in_flight(p, m, s, 2), max_in_flight(sc, s)) << "stage " << s;
        EXPECT_EQ(max_in_flight(sc, s), 2 * p) << "stage " << s;
        for (int j = 0; j < 2; ++j) {
          for (ActionKind kind : {ActionKind::kForward, ActionKind::kBackwardInput, ActionKind::kBackwardWeight}) {
            EXPECT_EQ(micro_batches_of(sc, s, j, kind), zero_to(m))
                << "stage " << s << " chunk " << j << " " << action_kind_info(kind).prefix;
          }
          EXPECT_EQ(micro_batches_of(sc, s, j, ActionKind::kBackward), std::vector<int>{});
        }
      }
    }
  }
}

// Fewer micro-batches than stages never fill the V's rounds: the row refuses them, saying
// so, and a chosen count of chunks per stage other than its 2. Its builder's order is
// correct for them all the same.
TEST(ZeroBubbleV, RefusesFewerMicroBatchesThanStages) {
  const ScheduleInfo& info = *find_schedule("zb-v");
  for (int p = 2; p <= 6; ++p) {
    for (int m = 1; m < p; ++m) {
      SCOPED_TRACE(counts(p, m, 2));
      const PipelineSchedule sc = lower_schedule("zb-v", p, m, info.placement(p, 2), info.build(p, m, 2));
      EXPECT_EQ(check_pipeline_schedule(sc).message(), "");
      for (int s = 0; s < p; ++s) EXPECT_EQ(max_in_flight(sc, s), info.in_flight(p, m, s, 2));
    }
  }
  const Status few = check_schedule_counts("zb-v", 4, 3, 0);
  EXPECT_EQ(few.message(), "zb-v needs at least as many micro-batches (3) as stages (4)");
  EXPECT_EQ(few.setting(), "micro_batches");
  EXPECT_TRUE(check_schedule_counts("zb-v", 4, 4, 2).is_ok());
  EXPECT_EQ(check_schedule_counts("zb-v", 4, 4, 3).message(),
            "schedule 'zb-v' holds 2 chunks per stage; a chosen count (3) does not apply");
}

// At unit costs every stage computes 6M (F, I and W of two chunks) and the step is
// 6M + P − 1, the least any order can take: stage P − 1 cannot start before P − 1.
TEST(ZeroBubbleV, BubbleIsWhatThePredictorGives) {
  const ScheduleInfo& info = *find_schedule("zb-v");
  for (int p = 1; p <= 6; ++p) {
    for (int m = p; m <= 3 * p; ++m) {
      SCOPED_TRACE(counts(p, m, 2));
      const SchedulePrediction pred = predict_at_unit_costs(make_pipeline_schedule("zb-v", p, m));
      EXPECT_EQ(pred.step, 6.0 * m + p - 1);
      EXPECT_DOUBLE_EQ(info.bubble(p, m, 2), idle_share(pred, 6.0 * m));
      EXPECT_DOUBLE_EQ(info.bubble(p, m, 2), (p - 1.0) / (6 * m + p - 1));
    }
  }
}

// The predictor's bubble (the stages' mean idle share) is below ZB-H1's.
TEST(ZeroBubbleV, LessBubbleThanZeroBubbleH1) {
  for (int p = 2; p <= 6; ++p) {
    for (int m = p; m <= 3 * p; ++m) {
      SCOPED_TRACE(counts(p, m, 2));
      const double v = predict_at_unit_costs(make_pipeline_schedule("zb-v", p, m)).bubble;
      const double h1 = predict_at_unit_costs(make_pipeline_schedule("zb-h1", p, m)).bubble;
      EXPECT_LT(v, h1);
    }
  }
}

// Two stages: stage 0 holds chunks 0 and 3 (the loss), stage 1 chunks 1 and 2, which hand
// over in place. Round n of stage 0 runs 0F(n), 3F(n − 1), 3I(n − 1), 0I(n − 2); of stage 1,
// 1F(n), 2F(n), 2I(n − 1), 1I(n − 1); the W's fill in where a stage would wait, or where a
// forward would pass 2P = 4 alive.
TEST(ZeroBubbleV, TwoStagesFourMicroBatches) {
  const PipelineSchedule sc = make_pipeline_schedule("zb-v", 2, 4);
  EXPECT_EQ(testing::stage_labels(sc, 0),
            "0F0 0sA0 0F1 0sA1 3rA0 3F0 3I0 3sG0 0F2 0sA2 3W0 3rA1 3F1 3I1 3sG1 0rG0 0I0 3W1 0F3 0sA3 0W0 3rA2 3F2 3I2 "
            "3sG2 0rG1 0I1 3W2 3rA3 3F3 3I3 3sG3 0rG2 0I2 0W1 0rG3 0I3 3W3 0W2 0W3");
  EXPECT_EQ(testing::stage_labels(sc, 1),
            "1rA0 1F0 2F0 2sA0 1rA1 1F1 2F1 2sA1 2rG0 2I0 1I0 1sG0 2W0 1rA2 1F2 1W0 2F2 2sA2 2rG1 2I1 1I1 1sG1 2W1 "
            "1rA3 1F3 1W1 2F3 2sA3 2rG2 2I2 1I2 1sG2 2rG3 2I3 1I3 1sG3 2W2 1W2 2W3 1W3");
  EXPECT_EQ(format_pipeline_schedule(sc),
            "step  stage0  stage1\n"
            "0     0F0     .\n"
            "1     0sA0    1rA0\n"
            "2     0F1     1F0\n"
            "3     0sA1    2F0\n"
            "4     3rA0    2sA0\n"
            "5     3F0     1rA1\n"
            "6     3I0     1F1\n"
            "7     3sG0    2F1\n"
            "8     0F2     2sA1\n"
            "9     0sA2    2rG0\n"
            "10    3W0     2I0\n"
            "11    3rA1    1I0\n"
            "12    3F1     1sG0\n"
            "13    3I1     2W0\n"
            "14    3sG1    1rA2\n"
            "15    0rG0    1F2\n"
            "16    0I0     1W0\n"
            "17    3W1     2F2\n"
            "18    0F3     2sA2\n"
            "19    0sA3    2rG1\n"
            "20    0W0     2I1\n"
            "21    3rA2    1I1\n"
            "22    3F2     1sG1\n"
            "23    3I2     2W1\n"
            "24    3sG2    1rA3\n"
            "25    0rG1    1F3\n"
            "26    0I1     1W1\n"
            "27    3W2     2F3\n"
            "28    3rA3    2sA3\n"
            "29    3F3     2rG2\n"
            "30    3I3     2I2\n"
            "31    3sG3    1I2\n"
            "32    0rG2    1sG2\n"
            "33    0I2     2rG3\n"
            "34    0W1     2I3\n"
            "35    .       1I3\n"
            "36    0rG3    1sG3\n"
            "37    0I3     2W2\n"
            "38    3W3     1W2\n"
            "39    0W2     2W3\n"
            "40    0W3     1W3\n");
}

}  // namespace
}  // namespace pipeshard
