// train --trace: one Chrome trace with every rank's timeline, and the pipeline bubble
// printed at the end of a pipelined run. The runs here launch mpiexec themselves.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::quote;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

// `train` on the course model (or `model`) under `mpiexec -n np`, 6 steps, writing DIR/trace.json.
testing::CommandResult run_traced(const ScratchDir& dir, int np, const std::string& flags,
                                  const std::string& model = "simple_digits") {
  // Open MPI refuses root without these; its session folder goes under this test's own
  // TMPDIR (concurrent mpiexec runs can collide in a shared one).
  const std::string env = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir.path()) + " ";
  return run_command(env + quote(PIPESHARD_MPIEXEC) + " -n " + std::to_string(np) + " --oversubscribe " +
                     quote(tool_path("train")) + " " + quote(source_path("models/" + model + ".onnx")) + " --data " +
                     quote(source_path("data/digits_features.npy")) + " --labels " +
                     quote(source_path("data/digits_labels.npy")) + " --batch-size 32 --steps 6 --trace " +
                     quote(dir / "trace.json") + " " + flags);
}

TEST(Trace, EveryRankOfAPipelineIsOnOneTimeline) {
  ScratchDir dir("trace");
  const testing::CommandResult r = run_traced(dir, 4, "--stages 2 --tensor-parallel 2 --micro-batches 4");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json trace = nlohmann::json::parse(testing::read_text(dir / "trace.json"), nullptr, false);
  ASSERT_FALSE(trace.is_discarded()) << "trace.json is not JSON";
  ASSERT_TRUE(trace.contains("traceEvents"));
  std::map<int, std::map<std::string, int>> count;  // pid -> event name -> events
  std::map<int, std::string> names;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") names[e["pid"].get<int>()] = e["args"]["name"];
    if (e["ph"] != "X") continue;
    EXPECT_GE(e["dur"].get<double>(), 0.0);
    EXPECT_GE(e["ts"].get<double>(), 0.0);
    ++count[e["pid"].get<int>()][e["name"].get<std::string>()];
  }
  ASSERT_EQ(count.size(), 4u) << "one timeline per rank";
  EXPECT_EQ(names[3], "rank 3: stage 1, replica 0, shard 1");
  for (int rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const int stage = rank / 2;
    // 6 steps x 4 micro-batches.
    EXPECT_EQ(count[rank]["forward"], 24);
    EXPECT_EQ(count[rank]["backward"], 24);
    EXPECT_EQ(count[rank]["optimizer step"], 6);
    EXPECT_EQ(count[rank][stage == 0 ? "send activation" : "recv activation"], 24);
    EXPECT_EQ(count[rank][stage == 0 ? "recv gradient" : "send gradient"], 24);
  }
  EXPECT_NE(r.err.find("pipeline bubble: stages idle"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("theory (P-1)/(M+P-1) = 20.0% for P=2, M=4"), std::string::npos) << r.err;
}

// ZB-H1's input and weight halves are events of their own, so the W's that fill the
// bubble show in Perfetto; the W's run in micro-batch order on every stage.
TEST(Trace, ZeroBubbleShowsInputAndWeightHalves) {
  ScratchDir dir("trace-zb");
  const testing::CommandResult r = run_traced(dir, 2, "--stages 2 --micro-batches 4 --schedule zb-h1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json trace = nlohmann::json::parse(testing::read_text(dir / "trace.json"), nullptr, false);
  ASSERT_FALSE(trace.is_discarded());
  std::map<int, std::map<std::string, int>> count;  // pid -> event name -> events
  std::map<int, std::vector<int>> weights;          // pid -> micro-batches of its W's, in order
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const int pid = e["pid"].get<int>();
    ++count[pid][e["name"].get<std::string>()];
    if (e["name"] == "backward weight") weights[pid].push_back(e["args"]["micro_batch"].get<int>());
  }
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_EQ(count[rank]["backward input"], 24);
    EXPECT_EQ(count[rank]["backward weight"], 24);
    EXPECT_EQ(count[rank]["backward"], 0);
    ASSERT_EQ(weights[rank].size(), 24u);
    for (size_t i = 0; i < 24; ++i) EXPECT_EQ(weights[rank][i], static_cast<int>(i % 4)) << "W number " << i;
  }
  EXPECT_NE(r.err.find("theory (P-1)/(3M+P-1) = 7.7% for P=2, M=4"), std::string::npos) << r.err;
}

// Under ZB-V each stage holds two chunks (stage 0 the first and the last, stage 1 the two
// in the middle): every pass names its model chunk, and each chunk's W's run in
// micro-batch order.
TEST(Trace, AVNamesTheChunkOfEveryPass) {
  ScratchDir dir("trace-zbv");
  const testing::CommandResult r = run_traced(dir, 2, "--stages 2 --micro-batches 4 --schedule zb-v", "deep_residual");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json trace = nlohmann::json::parse(testing::read_text(dir / "trace.json"), nullptr, false);
  ASSERT_FALSE(trace.is_discarded());
  std::map<int, std::map<int, std::map<std::string, int>>> count;  // pid -> chunk -> event name -> events
  std::map<int, std::map<int, std::vector<int>>> weights;          // pid -> chunk -> micro-batches of its W's
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] != "X" || e["cat"] != "compute") continue;
    const int pid = e["pid"].get<int>();
    ASSERT_TRUE(e["args"].contains("chunk")) << e.dump();
    const int chunk = e["args"]["chunk"].get<int>();
    ++count[pid][chunk][e["name"].get<std::string>()];
    if (e["name"] == "backward weight") weights[pid][chunk].push_back(e["args"]["micro_batch"].get<int>());
  }
  const std::map<int, std::vector<int>> chunks_of = {{0, {0, 3}}, {1, {1, 2}}};
  for (const auto& [rank, chunks] : chunks_of) {
    ASSERT_EQ(count[rank].size(), 2u) << "rank " << rank;
    for (int chunk : chunks) {
      SCOPED_TRACE("rank " + std::to_string(rank) + ", chunk " + std::to_string(chunk));
      EXPECT_EQ(count[rank][chunk]["forward"], 24);  // 6 steps x 4 micro-batches
      EXPECT_EQ(count[rank][chunk]["backward input"], 24);
      EXPECT_EQ(count[rank][chunk]["backward weight"], 24);
      ASSERT_EQ(weights[rank][chunk].size(), 24u);
      for (size_t i = 0; i < 24; ++i) EXPECT_EQ(weights[rank][chunk][i], static_cast<int>(i % 4)) << "W " << i;
    }
  }
  EXPECT_NE(r.err.find("pipeline passes (mean per micro-batch): chunk 0: F "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("; chunk 3: F "), std::string::npos) << r.err;
}

TEST(Trace, DataParallelRunsTraceTheirAllReduce) {
  ScratchDir dir("trace-dp");
  const testing::CommandResult r = run_traced(dir, 2, "");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json trace = nlohmann::json::parse(testing::read_text(dir / "trace.json"), nullptr, false);
  ASSERT_FALSE(trace.is_discarded());
  int all_reduce = 0;
  for (const auto& e : trace["traceEvents"]) all_reduce += e["ph"] == "X" && e["cat"] == "all-reduce";
  EXPECT_EQ(all_reduce, 2 * 6);
  EXPECT_EQ(r.err.find("pipeline bubble"), std::string::npos) << "no bubble without a pipeline";
}

}  // namespace
}  // namespace pipeshard
