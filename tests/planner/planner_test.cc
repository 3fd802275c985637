// The layout planner: profile.json read and refused, the cost model against sums worked
// out by hand, the ranking (every layout the search accepts, once, fastest first), and a
// profile measured in one process and in two in-process ranks. No timing is asserted:
// measured figures are only checked to be there and positive.
#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "common/host_memory.h"
#include "importer/onnx_importer.h"
#include "planner/cost_model.h"
#include "planner/measure.h"
#include "planner/planner.h"
#include "planner/profile.h"
#include "schedule/predict.h"
#include "schedule/schedule.h"
#include "testing/in_process_comm.h"
#include "tests/model_builder.h"

namespace pipeshard {
namespace {

using testing::ModelBuilder;

// Linear layers of the given widths (widths[0] in, widths.back() out), a ReLU between
// each two, or none with `relu` false.
ImportedModel mlp(const std::vector<int64_t>& widths, bool relu = true) {
  ModelBuilder b(widths[0]);
  std::string x = "input";
  for (size_t l = 1; l < widths.size(); ++l) {
    x = b.linear(x, widths[l - 1], widths[l]);
    if (relu && l + 1 < widths.size()) x = b.relu(x);
  }
  b.output(x, widths.back());
  auto proto = std::make_shared<onnx::ModelProto>(b.model());
  Result<ImportedModel> m = import_onnx_model(proto, ".", "built");
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  return std::move(m).value();
}

std::string profile_text(const std::string& fields) {
  return R"({"format": "pipeshard-profile", "version": 1)" + (fields.empty() ? "" : ", " + fields) + "}";
}

TEST(Profile, RoundTripsThroughItsJson) {
  MachineProfile p;
  p.machine = "test box";
  p.ranks = 4;
  p.linear = {{16, 512, 256, 10.5, 11.5, 12.5}, {8, 64, 64, 0.25, 0.5, 0.75}};
  p.gemm_flops_per_s = 3e11;
  p.elementwise_bytes_per_s = 7e9;
  p.optimizer_params_per_s = 5e8;
  p.op_overhead_us = 1.5;
  p.step_overhead_us = 40;
  p.compute_scale = 1.25;
  p.all_busy_slowdown = 1.5;
  p.slowdown_by_busy_ranks = {1, 1, 1.25, 1.5};
  p.compute_scale_by_rows = {{4, 0.75}, {64, 1.5}};
  p.p2p = {3, 2e9, {}};
  p.all_reduce = {9, 1.5e9, {{4096, 12}, {65536, 50.5}}};
  Result<MachineProfile> back = parse_profile_json(profile_json_text(p), "p.json");
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_EQ(profile_json_text(*back), profile_json_text(p));
  EXPECT_EQ(back->ranks, 4);
  ASSERT_EQ(back->linear.size(), 2u);
  EXPECT_EQ(back->linear[0].out, 256);
  EXPECT_EQ(back->linear[1].weight_grad_us, 0.75);
  EXPECT_EQ(back->compute_scale, 1.25);
  EXPECT_EQ(back->all_busy_slowdown, 1.5);
  EXPECT_EQ(back->slowdown_by_busy_ranks, (std::vector<double>{1, 1, 1.25, 1.5}));
  ASSERT_EQ(back->compute_scale_by_rows.size(), 2u);
  EXPECT_EQ(back->compute_scale_by_rows[1].rows, 64);
  EXPECT_EQ(back->compute_scale_by_rows[1].scale, 1.5);
  EXPECT_TRUE(back->p2p.points.empty());
  ASSERT_EQ(back->all_reduce.points.size(), 2u);
  EXPECT_EQ(back->all_reduce.points[1].us, 50.5);
}

TEST(Profile, ALinkWithMeasuredPointsIsReadBetweenThem) {
  LinkCost line{50, 1e9, {}};
  EXPECT_DOUBLE_EQ(line.time_us(1e6), 50 + 1000);  // no points: the line
  EXPECT_EQ(line.time_us(0), 0);
  // Two cores' 4-rank all-reduce (bus bytes): no line through these prices both ends.
  LinkCost measured = line;
  measured.points = {{3072, 50}, {49152, 108}, {786432, 380}, {6291456, 6223}};
  EXPECT_DOUBLE_EQ(measured.time_us(3072), 50);
  EXPECT_DOUBLE_EQ(measured.time_us(6291456), 6223);
  EXPECT_DOUBLE_EQ(measured.time_us((49152 + 786432) / 2.0), (108 + 380) / 2.0);
  const double last_slope = (6223.0 - 380) / (6291456 - 786432);
  EXPECT_DOUBLE_EQ(measured.time_us(2 * 6291456.0), 6223 + last_slope * 6291456);  // the last segment extended
  EXPECT_GT(measured.time_us(1024), 0);                                            // the first, never below 0
  EXPECT_LT(measured.time_us(1024), 50);
  EXPECT_EQ(measured.time_us(0), 0);
  // One point is no curve: the line.
  LinkCost one = line;
  one.points = {{4096, 7}};
  EXPECT_DOUBLE_EQ(one.time_us(1e6), 1050);
}

TEST(Profile, TheComputeScaleByRowsIsReadBetweenItsEntriesOnALogScale) {
  MachineProfile p;
  p.compute_scale = 1.25;
  EXPECT_EQ(p.compute_scale_at(16), 1.25);  // without the list: compute_scale at every size
  p.compute_scale_by_rows = {{4, 0.75}, {16, 1}, {64, 2}};
  EXPECT_DOUBLE_EQ(p.compute_scale_at(4), 0.75);
  EXPECT_DOUBLE_EQ(p.compute_scale_at(8), 0.875);  // halfway from 4 to 16 in log rows
  EXPECT_DOUBLE_EQ(p.compute_scale_at(16), 1);
  EXPECT_DOUBLE_EQ(p.compute_scale_at(32), 1.5);
  EXPECT_DOUBLE_EQ(p.compute_scale_at(1), 0.75);  // the end entries beyond them
  EXPECT_DOUBLE_EQ(p.compute_scale_at(1024), 2);
}

TEST(Profile, TheSlowdownByBusyRanksIsReadBetweenItsEntries) {
  MachineProfile p;
  p.ranks = 4;
  p.all_busy_slowdown = 2;
  // Without the list: the straight line from 1 (no other rank busy) to all_busy_slowdown.
  EXPECT_DOUBLE_EQ(p.busy_slowdown(0), 1);
  EXPECT_DOUBLE_EQ(p.busy_slowdown(0.25), 1.25);
  EXPECT_DOUBLE_EQ(p.busy_slowdown(1), 2);
  // Two cores under four ranks: no slowdown until a third rank computes.
  p.slowdown_by_busy_ranks = {1, 1, 1.5, 2};
  EXPECT_DOUBLE_EQ(p.busy_slowdown(0), 1);
  EXPECT_DOUBLE_EQ(p.busy_slowdown(1.0 / 3), 1);    // 2 ranks busy
  EXPECT_DOUBLE_EQ(p.busy_slowdown(0.5), 1.25);     // 2.5 ranks busy
  EXPECT_DOUBLE_EQ(p.busy_slowdown(2.0 / 3), 1.5);  // 3
  EXPECT_DOUBLE_EQ(p.busy_slowdown(1), 2);          // all 4
  EXPECT_DOUBLE_EQ(p.busy_slowdown(3), 2);          // clamped
  // Read from a file, the list may stand for all_busy_slowdown.
  Result<MachineProfile> back =
      parse_profile_json(profile_text(R"("ranks": 3, "slowdown_by_busy_ranks": [1, 1.5, 1.8])"), "p.json");
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_EQ(back->all_busy_slowdown, 1.8);
}

TEST(Profile, AHandWrittenOneNeedsOnlyWhatItChanges) {
  Result<MachineProfile> p = parse_profile_json(
      profile_text(
          R"("machine": "8 x H100", "gemm_flops_per_s": 4e14, "all_reduce": {"latency_us": 20, "bytes_per_s": 1.5e11})"),
      "hand.json");
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  EXPECT_EQ(p->machine, "8 x H100");
  EXPECT_EQ(p->gemm_flops_per_s, 4e14);
  EXPECT_EQ(p->all_reduce.bytes_per_s, 1.5e11);
  EXPECT_EQ(p->p2p.bytes_per_s, MachineProfile{}.p2p.bytes_per_s);  // the default
  EXPECT_EQ(p->compute_scale, 1);                                   // ops take what their figures say
  // No shape listed: 2·rows·in·out at the GEMM rate.
  EXPECT_DOUBLE_EQ(p->linear_forward_us(1000, 2000, 4000), 2.0 * 1000 * 2000 * 4000 / 4e14 * 1e6);
}

TEST(Profile, RefusalsNameTheFieldAtFault) {
  const std::pair<std::string, std::string> cases[] = {
      {"not json", "not a JSON object"},
      {R"({"format": "other", "version": 1})", "not a pipeshard profile"},
      {R"({"format": "pipeshard-profile", "version": 7})", "profile version 7"},
      {profile_text(R"("p2p": {"latency_us": 1, "bytes_per_s": 0})"), "'p2p.bytes_per_s' must be a positive number"},
      {profile_text(R"("p2p": 3)"), "'p2p' must be an object"},
      {profile_text(R"("gemm_flops_per_s": "fast")"), "'gemm_flops_per_s' must be a positive number"},
      {profile_text(R"("op_overhead_us": -1)"), "'op_overhead_us' must be a number, 0 or more"},
      {profile_text(R"("ranks": 1.5)"), "'ranks' must be a whole number"},
      {profile_text(R"("compute_scale": 0)"), "'compute_scale' must be a positive number"},
      {profile_text(R"("all_busy_slowdown": 0.5)"), "'all_busy_slowdown' must be 1 or more"},
      {profile_text(R"("ranks": 2, "slowdown_by_busy_ranks": [1, 2, 3])"),
       "'slowdown_by_busy_ranks' must be a list of 2 numbers (one per rank), each 1 or more"},
      {profile_text(R"("ranks": 2, "slowdown_by_busy_ranks": [1, 0.5])"),
       "'slowdown_by_busy_ranks' must be a list of 2 numbers"},
      {profile_text(R"("ranks": 2, "all_busy_slowdown": 2, "slowdown_by_busy_ranks": [1, 1.5])"),
       "'slowdown_by_busy_ranks' must be a list that ends at all_busy_slowdown"},
      {profile_text(R"("compute_scale_by_rows": [{"rows": 4, "scale": 1}, {"rows": 4, "scale": 2}])"),
       "'compute_scale_by_rows[1].rows' must be more than the entry before's (ascending)"},
      {profile_text(R"("compute_scale_by_rows": [{"rows": 4}])"), "'compute_scale_by_rows[0].scale' must be present"},
      {profile_text(R"("compute_scale_by_rows": [{"rows": 2.5, "scale": 1}])"),
       "'compute_scale_by_rows[0].rows' must be a whole number"},
      {profile_text(R"("compute_scale_by_rows": 2)"), "'compute_scale_by_rows' must be a list of"},
      {profile_text(R"("p2p": {"latency_us": 1, "bytes_per_s": 1e9, "measured": 4})"),
       "'p2p.measured' must be a list of"},
      {profile_text(R"("all_reduce": {"latency_us": 1, "bytes_per_s": 1e9, "measured": [{"bytes": 8, "us": 1},
         {"bytes": 8, "us": 2}]})"),
       "'all_reduce.measured[1].bytes' must be more than the point before's (ascending)"},
      {profile_text(R"("p2p": {"latency_us": 1, "bytes_per_s": 1e9, "measured": [{"bytes": 8}]})"),
       "'p2p.measured[0].us' must be present"},
      {profile_text(R"("linear": [{"rows": 4, "in": 8, "forward_us": 1, "input_grad_us": 1, "weight_grad_us": 1}])"),
       "'linear[0].out' must be present"},
      {profile_text(
           R"("linear": [{"rows": 4, "in": 8, "out": 2, "forward_us": 1, "input_grad_us": -2, "weight_grad_us": 1}])"),
       "'linear[0].input_grad_us' must be a number, 0 or more"},
  };
  for (const auto& [text, want] : cases) {
    Result<MachineProfile> p = parse_profile_json(text, "p.json");
    ASSERT_FALSE(p.is_ok()) << text;
    EXPECT_NE(p.status().message().find(want), std::string::npos) << p.status().message();
    EXPECT_EQ(p.status().message().rfind("p.json: ", 0), 0u) << p.status().message();
  }
}

TEST(Profile, LinearTimesComeFromTheNearestMeasuredShape) {
  MachineProfile p;
  p.gemm_flops_per_s = 1e9;
  p.linear = {{16, 64, 64, 10, 20, 30}, {64, 512, 512, 1000, 1100, 1200}};
  EXPECT_EQ(p.linear_forward_us(16, 64, 64), 10);  // measured
  EXPECT_EQ(p.linear_weight_grad_us(64, 512, 512), 1200);
  // Twice the flops of the small one: its rate, twice the time.
  EXPECT_DOUBLE_EQ(p.linear_input_grad_us(32, 64, 64), 40);
  // Nearer the large one in log flops.
  EXPECT_DOUBLE_EQ(p.linear_forward_us(32, 512, 512), 500);
}

TEST(Profile, CollectivesFollowTheBusBandwidth) {
  MachineProfile p;
  p.all_reduce = {10, 1e9, {}};
  EXPECT_EQ(p.all_reduce_us(1e6, 1), 0);
  EXPECT_DOUBLE_EQ(p.all_reduce_us(1e6, 2), 10 + 1e6 / 1e9 * 1e6);  // 2·(2−1)/2 = 1
  EXPECT_DOUBLE_EQ(p.all_reduce_us(1e6, 4), 10 + 1.5e6 / 1e9 * 1e6);
  EXPECT_DOUBLE_EQ(p.reduce_scatter_us(1e6, 4), 10 + 0.75e6 / 1e9 * 1e6);
}

TEST(Profile, TheScalesByRowsAreSmoothedOntoALineInLogRows) {
  // On a line already (0.5 per factor 4 of rows): unchanged.
  std::vector<MachineProfile::RowsScale> line = {{4, 0.5}, {16, 1.0}, {64, 1.5}};
  smooth_in_log_rows(line);
  EXPECT_NEAR(line[0].scale, 0.5, 1e-12);
  EXPECT_NEAR(line[1].scale, 1.0, 1e-12);
  EXPECT_NEAR(line[2].scale, 1.5, 1e-12);
  // A spike in the middle is spread over the three: the line through (0, 0.7), (1, 1.22), (2, 0.98).
  std::vector<MachineProfile::RowsScale> spike = {{4, 0.7}, {16, 1.22}, {64, 0.98}};
  smooth_in_log_rows(spike);
  const double mean = (0.7 + 1.22 + 0.98) / 3, slope = (0.98 - 0.7) / 2;
  EXPECT_NEAR(spike[0].scale, mean - slope, 1e-9);
  EXPECT_NEAR(spike[1].scale, mean, 1e-9);
  EXPECT_NEAR(spike[2].scale, mean + slope, 1e-9);
  EXPECT_EQ(spike[1].rows, 16);
}

TEST(Profile, EachFigureIsTheMedianOfItsTakesOverTheSweeps) {
  // Three sweeps of two figures; the second sweep is the slow moment (both figures 2x), the
  // third has one figure disturbed alone. The medians leave both out.
  const std::vector<std::vector<double>> takes = {{10, 100}, {20, 200}, {11, 90}};
  int taken = 0;
  const std::vector<double> got = median_of_sweeps(3, [&] { return takes[taken++]; });
  EXPECT_EQ(taken, 3);
  EXPECT_EQ(got, (std::vector<double>{11, 100}));
  // An even count averages the middle two; a count below 1 takes once.
  taken = 0;
  EXPECT_EQ(median_of_sweeps(2, [&] { return takes[taken++]; }), (std::vector<double>{15, 150}));
  taken = 0;
  EXPECT_EQ(median_of_sweeps(0, [&] { return takes[taken++]; }), (std::vector<double>{10, 100}));
  EXPECT_EQ(taken, 1);
}

TEST(Profile, FitLinkRecoversALine) {
  const LinkCost c = fit_link({{1e3, 5 + 1e3 / 2e9 * 1e6}, {1e6, 5 + 1e6 / 2e9 * 1e6}, {1e7, 5 + 1e7 / 2e9 * 1e6}});
  EXPECT_NEAR(c.latency_us, 5, 1e-6);
  EXPECT_NEAR(c.bytes_per_s / 2e9, 1, 1e-9);
  // A line through below the origin is taken through it: latency 0.
  const LinkCost d = fit_link({{1e6, 100}, {2e6, 300}});
  EXPECT_EQ(d.latency_us, 0);
  EXPECT_GT(d.bytes_per_s, 0);
  // All-reduces on 4 ranks sharing 2 cores: the fit follows the small messages' latency
  // (an unweighted fit puts it at 0 and predicts the 3 KiB message 50 times too fast).
  const LinkCost e = fit_link({{3072, 50}, {49152, 108}, {786432, 380}, {6291456, 6223}});
  EXPECT_GT(e.latency_us, 30);
  EXPECT_LT(e.latency_us, 60);
  for (auto [x, y] : std::vector<std::pair<double, double>>{{3072, 50}, {49152, 108}, {786432, 380}})
    EXPECT_NEAR(e.latency_us + x / e.bytes_per_s * 1e6, y, 0.5 * y) << x;
}

int64_t parse_or_0(const std::string& text) {
  int64_t b = 0;
  return parse_bytes(text, &b) ? b : 0;
}

TEST(ParseBytes, ReadsSizesAsUsersWriteThem) {
  int64_t b = 0;
  EXPECT_EQ(parse_or_0("1073741824"), int64_t{1} << 30);
  EXPECT_EQ(parse_or_0("1.5GiB"), int64_t{3} << 29);
  EXPECT_EQ(parse_or_0("512 MiB"), int64_t{512} << 20);
  EXPECT_EQ(parse_or_0("8G"), int64_t{8} << 30);
  EXPECT_EQ(parse_or_0("80GB"), int64_t{80'000'000'000});
  for (const char* bad : {"", "-1G", "0", "12 parsecs", "GiB", "1e30", " 5"}) EXPECT_FALSE(parse_bytes(bad, &b)) << bad;
}

// A profile whose every cost is simple to add up by hand.
MachineProfile round_profile() {
  MachineProfile p;
  p.gemm_flops_per_s = 2e9;         // 2·r·i·o flops: r·i·o / 1000 µs
  p.elementwise_bytes_per_s = 4e6;  // 4 bytes per µs: a float per µs
  p.optimizer_params_per_s = 1e6;   // a parameter per µs
  p.op_overhead_us = 0;
  p.step_overhead_us = 7;
  p.p2p = {1, 4e6, {}};
  p.all_reduce = {2, 4e6, {}};
  return p;
}

Layout layout_of(int d, int p, int t, int m, const std::string& schedule, int zero = 0) {
  Layout l;
  l.replicas = d, l.stages = p, l.shards = t, l.micro_batches = m, l.schedule = schedule, l.zero = zero;
  return l;
}

LayoutPrediction predict(const ImportedModel& m, const Layout& l, const MachineProfile& profile, int64_t batch,
                         int64_t bucket_bytes = 25 << 20) {
  LayoutSearchOptions o;
  o.batch_size = batch;
  o.bucket_bytes = bucket_bytes;
  o.ranks = l.ranks();
  Result<Plan> plan = make_plan(m.graph, "", layout_partition_options(l, o));
  EXPECT_TRUE(plan.is_ok()) << plan.status().message();
  return predict_layout(m.graph, *plan, l, profile);
}

TEST(CostModel, OneLinearInOneProcessAddsUpByHand) {
  const ImportedModel m = mlp({100, 10});
  const MachineProfile p = round_profile();
  const LayoutPrediction got = predict(m, layout_of(1, 1, 1, 1, "1f1b"), p, 20);
  // Forward 20·100·10/1000 = 20 µs; no input gradient (the model's input); weight 20 µs.
  // The loss: 6 passes over 20·10 floats = 1200 µs, half in forward, half in backward.
  EXPECT_DOUBLE_EQ(got.costs.forward[0], 20 + 600);
  EXPECT_DOUBLE_EQ(got.costs.backward_input[0], 600);
  EXPECT_DOUBLE_EQ(got.costs.backward_weight[0], 20);
  EXPECT_DOUBLE_EQ(got.optimizer_us, 1010);  // 1000 weights + 10 biases
  EXPECT_DOUBLE_EQ(got.step_us, 620 + 620 + 1010 + 7);
  EXPECT_DOUBLE_EQ(got.compute_us + got.bubble_us + got.tensor_parallel_us + got.data_parallel_us + got.optimizer_us +
                       got.overhead_us,
                   got.step_us);
  EXPECT_EQ(got.bottleneck(), "compute");
}

TEST(CostModel, ComputeScaleMultipliesTheOpsNotTheFixedCostsOrTheMessages) {
  const ImportedModel m = mlp({512, 512, 512, 10});
  MachineProfile p = round_profile();
  const LayoutPrediction one = predict(m, layout_of(1, 1, 1, 1, "1f1b"), p, 16);
  const LayoutPrediction sharded = predict(m, layout_of(2, 1, 2, 1, "1f1b"), p, 32);
  p.compute_scale = 2;
  const LayoutPrediction one2 = predict(m, layout_of(1, 1, 1, 1, "1f1b"), p, 16);
  const LayoutPrediction sharded2 = predict(m, layout_of(2, 1, 2, 1, "1f1b"), p, 32);
  EXPECT_DOUBLE_EQ(one2.compute_us, 2 * one.compute_us);
  EXPECT_DOUBLE_EQ(one2.optimizer_us, 2 * one.optimizer_us);
  EXPECT_DOUBLE_EQ(one2.overhead_us, one.overhead_us);
  EXPECT_DOUBLE_EQ(one2.step_us - one2.overhead_us, 2 * (one.step_us - one.overhead_us));
  EXPECT_DOUBLE_EQ(sharded2.compute_us, 2 * sharded.compute_us);
  EXPECT_DOUBLE_EQ(sharded2.tensor_parallel_us, sharded.tensor_parallel_us);
}

TEST(CostModel, TheComputeScaleByRowsIsTakenAtTheMicroBatchesRows) {
  const ImportedModel m = mlp({512, 512, 512, 10});
  MachineProfile p = round_profile();
  const LayoutPrediction whole = predict(m, layout_of(1, 1, 1, 1, "1f1b"), p, 16);     // 16 rows
  const LayoutPrediction quarters = predict(m, layout_of(1, 1, 1, 4, "1f1b"), p, 16);  // 4 rows each
  p.compute_scale_by_rows = {{4, 0.5}, {16, 2}};
  const LayoutPrediction whole2 = predict(m, layout_of(1, 1, 1, 1, "1f1b"), p, 16);
  const LayoutPrediction quarters2 = predict(m, layout_of(1, 1, 1, 4, "1f1b"), p, 16);
  EXPECT_DOUBLE_EQ(whole2.compute_us, 2 * whole.compute_us);
  EXPECT_DOUBLE_EQ(quarters2.compute_us, 0.5 * quarters.compute_us);
  // The optimizer steps the same parameters at any micro-batch size: compute_scale's.
  EXPECT_DOUBLE_EQ(whole2.optimizer_us, whole.optimizer_us);
  EXPECT_DOUBLE_EQ(quarters2.optimizer_us, quarters.optimizer_us);
}

TEST(CostModel, RanksThatShareCoresComputeFasterWhereOthersIdle) {
  const ImportedModel m = mlp({64, 64, 64, 64, 64});
  MachineProfile p = round_profile();
  const LayoutPrediction pipeline = predict(m, layout_of(1, 4, 1, 1, "gpipe"), p, 32);
  const LayoutPrediction replicas = predict(m, layout_of(4, 1, 1, 1, "1f1b"), p, 128);
  ASSERT_LT(pipeline.busy_share, 0.5);  // one micro-batch through four stages: each works a quarter
  EXPECT_DOUBLE_EQ(replicas.busy_share, 1);
  p.all_busy_slowdown = 2;  // the figures were taken with every rank computing
  const LayoutPrediction pipeline2 = predict(m, layout_of(1, 4, 1, 1, "gpipe"), p, 32);
  const LayoutPrediction replicas2 = predict(m, layout_of(4, 1, 1, 1, "1f1b"), p, 128);
  // Busy a share u of the time, the ops take (1 + u) / 2 of their figures.
  EXPECT_DOUBLE_EQ(pipeline2.compute_us, pipeline.compute_us * (1 + pipeline.busy_share) / 2);
  EXPECT_DOUBLE_EQ(replicas2.compute_us, replicas.compute_us);  // every rank computes all along
  // Measured by busy ranks (two cores under four ranks): while one rank of the pipeline
  // computes, 1 + 3u of the four do, and fewer than three leave each its core.
  p.ranks = 4;
  p.slowdown_by_busy_ranks = {1, 1, 1.5, 2};
  const LayoutPrediction pipeline3 = predict(m, layout_of(1, 4, 1, 1, "gpipe"), p, 32);
  ASSERT_LE(1 + 3 * pipeline.busy_share, 2);
  EXPECT_DOUBLE_EQ(pipeline3.compute_us, pipeline.compute_us / 2);
  EXPECT_DOUBLE_EQ(predict(m, layout_of(4, 1, 1, 1, "1f1b"), p, 128).compute_us, replicas.compute_us);
}

TEST(CostModel, ReplicasReduceWhatOutlastsTheLastBackward) {
  const ImportedModel m = mlp({100, 10});
  const MachineProfile p = round_profile();
  const LayoutPrediction one = predict(m, layout_of(1, 1, 1, 1, "1f1b"), p, 40);
  const LayoutPrediction two = predict(m, layout_of(2, 1, 1, 1, "1f1b"), p, 40);
  // Each replica computes half the batch: the same passes as one process on 20 samples.
  EXPECT_DOUBLE_EQ(two.costs.forward[0], predict(m, layout_of(1, 1, 1, 1, "1f1b"), p, 20).costs.forward[0]);
  EXPECT_LT(two.compute_us, one.compute_us);
  // 1010 gradients (4040 bytes): all-reduce 2 + 4040/4 = 1012 µs over 2 ranks. In one
  // bucket it starts when backward ends: all exposed.
  EXPECT_DOUBLE_EQ(two.data_parallel_us, 1012);
  // In buckets of 400 bytes (2 + 100 µs each) the backward (600 + 20 µs) hides 620 of it.
  EXPECT_DOUBLE_EQ(predict(m, layout_of(2, 1, 1, 1, "1f1b"), p, 40, 400).data_parallel_us, 1012 - 620);
  // ZeRO-1: reduce-scatter half the bytes (2 + 505 µs, hidden but for the bucket's own
  // 507, as the bucket is the whole buffer), then an all-gather of the same size exposed;
  // the optimizer over half the parameters.
  const LayoutPrediction zero1 = predict(m, layout_of(2, 1, 1, 1, "1f1b", 1), p, 40);
  EXPECT_DOUBLE_EQ(zero1.data_parallel_us, 507 + 507);
  EXPECT_DOUBLE_EQ(zero1.optimizer_us, 505);
}

TEST(CostModel, PipelineStagesRunTheScheduleOnTheirPassCosts) {
  const ImportedModel m = mlp({64, 64, 64, 64, 64});
  const MachineProfile p = round_profile();
  for (const std::string schedule : {"gpipe", "1f1b", "zb-h1"}) {
    const Layout l = layout_of(1, 2, 1, 4, schedule);
    const LayoutPrediction got = predict(m, l, p, 32);
    ASSERT_EQ(got.costs.forward.size(), 2u);
    // The schedule's own prediction on the same costs, plus optimizer and overhead.
    const SchedulePrediction sp = predict_schedule(make_pipeline_schedule(schedule, 2, 4), got.costs);
    EXPECT_DOUBLE_EQ(got.step_us - got.optimizer_us - got.overhead_us, sp.end[got.critical_stage]) << schedule;
    EXPECT_GT(got.bubble_us, 0) << schedule;
    // One message of the 64 floats per sample crossing the cut, 8 samples per micro-batch.
    EXPECT_DOUBLE_EQ(got.costs.transfer, 1 + 64 * 8 * 4 / 4.0) << schedule;
  }
}

TEST(CostModel, TensorParallelShardsTheGemmsAndPaysForItsCollectives) {
  const ImportedModel m = mlp({512, 512, 512, 10});
  MachineProfile p = round_profile();
  const LayoutPrediction one = predict(m, layout_of(1, 1, 1, 1, "1f1b"), p, 16);
  const LayoutPrediction two = predict(m, layout_of(1, 1, 2, 1, "1f1b"), p, 16);
  EXPECT_GT(two.tensor_parallel_us, 0);
  EXPECT_LT(two.compute_us, one.compute_us);
  // With free collectives, sharding only removes work.
  p.all_reduce = {0, 1e30, {}};
  const LayoutPrediction free = predict(m, layout_of(1, 1, 2, 1, "1f1b"), p, 16);
  EXPECT_NEAR(free.tensor_parallel_us, 0, 1e-9);
  EXPECT_LT(free.step_us, one.step_us);
}

TEST(Planner, RanksEveryAcceptedLayoutOnceFastestFirst) {
  const ImportedModel m = mlp({64, 128, 128, 128, 10});
  LayoutSearchOptions o;
  o.ranks = 4;
  o.batch_size = 16;
  const LayoutSearch search = search_layouts(m.graph, o);
  const LayoutPlan plan = plan_layouts(m.graph, o, round_profile());
  ASSERT_EQ(plan.ranked.size(), search.accepted.size());
  EXPECT_EQ(plan.rejected.size(), search.rejected.size());
  std::set<std::string> seen;
  for (const PlannedLayout& p : plan.ranked) {
    EXPECT_TRUE(seen.insert(p.fit.layout.text()).second) << p.fit.layout.text();
    EXPECT_GT(p.prediction.step_us, 0);
  }
  for (const LayoutFit& f : search.accepted) EXPECT_EQ(seen.count(f.layout.text()), 1u) << f.layout.text();
  EXPECT_TRUE(std::is_sorted(plan.ranked.begin(), plan.ranked.end(),
                             [](const auto& a, const auto& b) { return a.prediction.step_us < b.prediction.step_us; }));

  const nlohmann::json j = layout_plan_json(plan, "m.onnx");
  EXPECT_EQ(j["layouts"].size(), plan.ranked.size());
  EXPECT_EQ(j["rejected"].size(), plan.rejected.size());
  EXPECT_EQ(j["layouts"][0]["text"], plan.ranked[0].fit.layout.text());
  EXPECT_EQ(j["layouts"][0]["predicted"]["step_ms"], plan.ranked[0].prediction.step_us / 1e3);

  const std::string text = layout_plan_text(plan, "m.onnx", 3);
  EXPECT_NE(text.find(plan.ranked[0].fit.layout.text()), std::string::npos) << text;
  EXPECT_NE(text.find(std::to_string(search.size()) + " layouts considered"), std::string::npos) << text;
}

TEST(Planner, TrainFlagsSayTheLayoutAndLeaveOutDefaults) {
  EXPECT_EQ(layout_train_flags(layout_of(4, 1, 1, 1, "1f1b")), "(none)");
  Layout l = layout_of(1, 2, 2, 4, "zb-h1", 0);
  EXPECT_EQ(layout_train_flags(l), "--stages 2 --tensor-parallel 2 --micro-batches 4 --schedule zb-h1");
  l = layout_of(2, 2, 1, 2, "interleaved", 1);
  l.virtual_stages = 3, l.keep_activations = true;
  EXPECT_EQ(layout_train_flags(l),
            "--stages 2 --micro-batches 2 --schedule interleaved --virtual-stages 3 --keep-activations --zero 1");
}

TEST(Measure, ModelShapesCoverEveryRowCountAndShard) {
  const ImportedModel m = mlp({64, 32, 10});
  const std::vector<LinearSize> sizes = model_linear_sizes(m.graph, 2, 8, 16);
  const std::set<LinearSize> got(sizes.begin(), sizes.end());
  EXPECT_EQ(got.size(), sizes.size());
  // Rows 8/D/M: D ∈ {1, 2}, M | 8/D: 8, 4, 2, 1.
  for (int64_t r : {8, 4, 2, 1}) {
    EXPECT_EQ(got.count({r, 64, 32}), 1u) << r;
    EXPECT_EQ(got.count({r, 64, 16}), 1u) << r;  // out split in 2
    EXPECT_EQ(got.count({r, 32, 32}), 1u) << r;  // in split in 2
    EXPECT_EQ(got.count({r, 32, 10}), 1u) << r;
    EXPECT_EQ(got.count({r, 32, 5}), 1u) << r;
    EXPECT_EQ(got.count({r, 16, 10}), 1u) << r;
  }
  EXPECT_EQ(sizes.size(), 4u * 6);
}

TEST(Measure, EveryMessageALayoutPricesIsNearAMeasuredSize) {
  const ImportedModel m = mlp({64, 32, 10});
  const int ranks = 4;
  const int64_t bucket = 4000;  // bytes: less than the model's 2410 floats
  const std::vector<int64_t> sizes = model_message_bytes(m.graph, ranks, 8, 4, bucket);
  ASSERT_TRUE(std::is_sorted(sizes.begin(), sizes.end()));
  for (size_t i = 1; i < sizes.size(); ++i) EXPECT_GT(sizes[i], sizes[i - 1] * 1.1) << sizes[i];
  for (int64_t fixed : MeasureOptions{}.message_bytes) {  // the four sizes every profile has, or one near
    EXPECT_TRUE(std::any_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s <= fixed && fixed <= s * 1.1; }));
  }
  // Bus bytes (planner/profile.h) as a profile on 4 ranks records each size, and as a layout reads
  // them. Under 1 KiB a message costs its latency, which the smallest size measured gives.
  const auto measured_near = [&](double bus) {
    if (bus < 1024) return true;
    return std::any_of(sizes.begin(), sizes.end(), [&](int64_t s) {
      const double measured = 2.0 * (ranks - 1) / ranks * static_cast<double>(s);
      return measured <= bus * 1.001 && bus <= measured * 1.1;
    });
  };
  const auto sent_near = [&](double bytes) {
    if (bytes < 1024) return true;
    return std::any_of(sizes.begin(), sizes.end(), [&](int64_t s) { return s <= bytes && bytes <= s * 1.1; });
  };
  for (int64_t rows : {8, 4, 2, 1}) {  // 8/D/M
    for (int64_t width : {64, 32, 10}) {
      const double bytes = 4.0 * rows * width;
      EXPECT_TRUE(sent_near(bytes)) << rows << " x " << width;
      for (int t : {2, 4}) {
        EXPECT_TRUE(measured_near(2.0 * (t - 1) / t * bytes)) << "all-reduce over " << t << ": " << bytes;
        EXPECT_TRUE(measured_near(1.0 * (t - 1) / t * bytes)) << "reduce-scatter over " << t << ": " << bytes;
      }
    }
  }
  const double gradients = 4.0 * 2410;
  for (auto [d, split] : {std::pair{2, 1}, {2, 2}, {4, 1}}) {
    const double bytes = std::min(gradients / split, static_cast<double>(bucket));
    EXPECT_TRUE(measured_near(2.0 * (d - 1) / d * bytes)) << "D = " << d << ", P·T = " << split;
    EXPECT_TRUE(measured_near(1.0 * (d - 1) / d * bytes)) << "D = " << d << ", P·T = " << split << ", ZeRO";
  }
  EXPECT_EQ(model_message_bytes(m.graph, 1, 8, 4, bucket), MeasureOptions{}.message_bytes) << "one rank sends nothing";
}

TEST(Measure, AProfileOfThisMachineHasEveryFigure) {
  const ImportedModel m = mlp({64, 32, 10});
  MeasureOptions o = model_measure_options(m.graph, 2, 8, 4);
  o.seconds_per_figure = 0.001;
  o.elementwise_elements = 1 << 12;
  o.message_bytes = {1 << 10, 1 << 14};
  std::vector<MachineProfile> got(2);
  run_ranks(2, [&](Communicator& world) {
    std::unique_ptr<Backend> backend = make_cpu_backend();
    got[world.rank()] = measure_profile(*backend, world, o);
  });
  EXPECT_EQ(profile_json_text(got[0]), profile_json_text(got[1])) << "every rank returns the same profile";
  const MachineProfile& p = got[0];
  EXPECT_EQ(p.ranks, 2);
  EXPECT_EQ(p.backend, "cpu");
  ASSERT_EQ(p.linear.size(), o.linear.size());
  for (const LinearTiming& t : p.linear) EXPECT_GT(t.forward_us + t.input_grad_us + t.weight_grad_us, 0);
  for (double v : {p.gemm_flops_per_s, p.elementwise_bytes_per_s, p.optimizer_params_per_s, p.p2p.bytes_per_s,
                   p.all_reduce.bytes_per_s, p.compute_scale}) {
    EXPECT_GT(v, 0);
    EXPECT_TRUE(std::isfinite(v));
  }
  Result<MachineProfile> back = parse_profile_json(profile_json_text(p), "measured");
  EXPECT_TRUE(back.is_ok()) << back.status().message();
}

}  // namespace
}  // namespace pipeshard
