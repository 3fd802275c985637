// train's data from the command line: shards (a folder, a glob) train bit for bit as the
// whole file, under mpirun; NaN and inf are refused at load naming the file, row and column,
// with nothing written; and data too big to check at load (kCheckAtLoadBytes) stops at
// the step that first reads a bad row, whichever rank reads it, before anything of that
// step is kept.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "dataset/dataset.h"
#include "dataset/npy.h"
#include "importer/onnx_importer.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::quote;
using testing::read_text;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// Open MPI refuses root without these; its session folder goes under the test's own TMPDIR
// (concurrent mpiexec runs can collide in a shared one).
std::string mpiexec(const ScratchDir& dir, int np) {
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir.path()) + " " +
         quote(PIPESHARD_MPIEXEC) + " -n " + std::to_string(np) + " --oversubscribe ";
}

std::string train(const std::string& data, const std::string& labels, const std::string& extra) {
  return quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) + " --data " + quote(data) +
         " --labels " + quote(labels) + " " + extra;
}

std::vector<std::vector<float>> weights(const std::string& onnx) {
  Result<ImportedModel> m = import_onnx_file(onnx);
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  std::vector<std::vector<float>> w;
  if (m.is_ok())
    for (const auto& p : m->graph.params) w.push_back(p.data);
  return w;
}

TEST(TrainData, ShardsTrainAsTheWholeFileUnderMpirun) {
  ScratchDir dir("train-shards");
  Result<NpyArray> x = read_npy(source_path("data/digits_features.npy"));
  Result<NpyArray> y = read_npy(source_path("data/digits_labels.npy"));
  ASSERT_TRUE(x.is_ok() && y.is_ok());
  const std::vector<float> features = x->as_float();
  const std::vector<int64_t> labels = y->as_int64();
  const int64_t n = x->shape[0], width = x->shape[1];
  std::filesystem::create_directories(dir / "x");
  std::filesystem::create_directories(dir / "y");
  // Names sort as the rows go; the cuts fall inside batches.
  const std::vector<int64_t> cuts = {0, 500, 1001, n};
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    const std::string name = "shard-" + std::to_string(i) + ".npy";
    const int64_t rows = cuts[i + 1] - cuts[i];
    ASSERT_TRUE(write_npy(dir / ("x/" + name), {rows, width}, features.data() + cuts[i] * width).is_ok());
    ASSERT_TRUE(write_npy(dir / ("y/" + name), {rows}, labels.data() + cuts[i]).is_ok());
  }
  const std::string flags = "--steps 20 --batch-size 64 --lr 0.05 --optimizer adamw --save ";
  auto whole =
      run_command(mpiexec(dir, 2) + train(source_path("data/digits_features.npy"),
                                          source_path("data/digits_labels.npy"), flags + quote(dir / "whole.onnx")));
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  auto sharded = run_command(mpiexec(dir, 2) + train(dir / "x", dir / "y/shard-*.npy", flags + quote(dir / "d2.onnx")));
  ASSERT_EQ(sharded.exit_code, 0) << sharded.err;
  EXPECT_NE(sharded.err.find("2 data-parallel replicas"), std::string::npos) << sharded.err;
  EXPECT_EQ(weights(dir / "whole.onnx"), weights(dir / "d2.onnx"));
}

TEST(TrainData, NonFiniteFeaturesAndEvalDataAreRefusedAtLoad) {
  ScratchDir dir("train-nan");
  Result<NpyArray> x = read_npy(source_path("data/digits_features.npy"));
  ASSERT_TRUE(x.is_ok());
  std::vector<float> features = x->as_float();
  features[17 * x->shape[1] + 3] = kNan;
  ASSERT_TRUE(write_npy(dir / "x.npy", x->shape, features.data()).is_ok());
  const std::string outputs = " --metrics " + quote(dir / "m.jsonl") + " --save " + quote(dir / "t.onnx");
  auto r = run_command(train(dir / "x.npy", source_path("data/digits_labels.npy"), "--steps 5" + outputs));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err, "train: error: " + (dir / "x.npy") +
                       ": row 17, column 3 holds nan; features must be finite numbers (the data is bad, not the "
                       "training: fix or drop that row)\n");
  auto e = run_command(train(source_path("data/digits_features.npy"), source_path("data/digits_labels.npy"),
                             "--steps 5 --eval-data " + quote(dir / "x.npy") + " --eval-labels " +
                                 quote(source_path("data/digits_labels.npy")) + outputs));
  EXPECT_EQ(e.exit_code, 2) << e.err;
  EXPECT_NE(e.err.find("x.npy: row 17, column 3 holds nan"), std::string::npos) << e.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "m.jsonl"));
  EXPECT_FALSE(std::filesystem::exists(dir / "t.onnx"));
}

// Features just over kCheckAtLoadBytes, with a NaN in the fourth batch (in file order),
// in the half of it that the second replica reads.
TEST(TrainData, BadRowOfBigDataStopsTheStepThatReadsIt) {
  ScratchDir dir("train-big");
  const int64_t width = 64, rows = kCheckAtLoadBytes / (4 * width) + 1000;
  std::vector<float> features(static_cast<size_t>(rows * width), 0.25f);
  features[(3 * 64 + 40) * width + 7] = kNan;
  ASSERT_TRUE(write_npy(dir / "x.npy", {rows, width}, features.data()).is_ok());
  std::vector<int64_t> labels(static_cast<size_t>(rows), 1);
  ASSERT_TRUE(write_npy(dir / "y.npy", {rows}, labels.data()).is_ok());
  features = {};
  auto r = run_command(mpiexec(dir, 2) + train(dir / "x.npy", dir / "y.npy",
                                               "--steps 10 --batch-size 64 --no-shuffle --metrics " +
                                                   quote(dir / "m.jsonl") + " --save " + quote(dir / "t.onnx")));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  const std::string said = "train: error: step 4: " + (dir / "x.npy") + ": row 232, column 7 holds nan";
  EXPECT_NE(r.err.find(said), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(said), r.err.rfind(said)) << "said once\n" << r.err;
  EXPECT_NE(r.err.find("stopped before saving anything of this step"), std::string::npos) << r.err;
  const std::string metrics = read_text(dir / "m.jsonl");
  EXPECT_EQ(std::count(metrics.begin(), metrics.end(), '\n'), 3) << "steps 1-3 only\n" << metrics;
  EXPECT_FALSE(std::filesystem::exists(dir / "t.onnx"));
}

}  // namespace
}  // namespace pipeshard
