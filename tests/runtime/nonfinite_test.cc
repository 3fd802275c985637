// --on-nonfinite: a step whose loss or gradients are inf or NaN never touches the
// weights. `stop` (the default) ends the run with status 2, naming the step and the first
// parameter in backward order whose gradient went bad; `skip` goes on, counting the step
// as taken, and the rest of the run is the run without that step's update.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "dataset/npy.h"
#include "tests/model_builder.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::quote;
using testing::read_text;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

constexpr int64_t kSamples = 320, kFeatures = 64, kBatch = 32;
constexpr int64_t kPoisonedStep = 3;  // its batch holds the NaN sample (--no-shuffle)

class NonFinite : public ::testing::Test {
 protected:
  void SetUp() override {
    // The first kSamples digits, one sample of batch kPoisonedStep poisoned; and
    // the same samples without that batch.
    Result<NpyArray> x = read_npy(source_path("data/digits_features.npy"));
    Result<NpyArray> y = read_npy(source_path("data/digits_labels.npy"));
    ASSERT_TRUE(x && y);
    std::vector<float> features = x->as_float();
    std::vector<int64_t> labels = y->as_int64();
    features.resize(kSamples * kFeatures);
    labels.resize(kSamples);
    std::vector<float> removed = features;
    std::vector<int64_t> removed_labels = labels;
    const int64_t first = (kPoisonedStep - 1) * kBatch;
    removed.erase(removed.begin() + first * kFeatures, removed.begin() + (first + kBatch) * kFeatures);
    removed_labels.erase(removed_labels.begin() + first, removed_labels.begin() + first + kBatch);
    // Data holding NaN is refused at load; finite features this large make the first
    // layer overflow to inf of both signs, and the next one inf - inf: a NaN loss.
    std::fill_n(features.begin() + (first + 5) * kFeatures, kFeatures, std::numeric_limits<float>::max());
    ASSERT_TRUE(write_npy(dir_ / "x.npy", {kSamples, kFeatures}, features.data()));
    ASSERT_TRUE(write_npy(dir_ / "y.npy", {kSamples}, labels.data()));
    ASSERT_TRUE(write_npy(dir_ / "x_removed.npy", {kSamples - kBatch, kFeatures}, removed.data()));
    ASSERT_TRUE(write_npy(dir_ / "y_removed.npy", {kSamples - kBatch}, removed_labels.data()));
  }

  // train on `data` (x or x_removed, with the matching labels).
  std::string train(const std::string& launcher, const std::string& data, const std::string& flags) const {
    return launcher + quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) + " --data " +
           quote(dir_ / (data + ".npy")) + " --labels " + quote(dir_ / (data == "x" ? "y.npy" : "y_removed.npy")) +
           " --batch-size 32 --no-shuffle --optimizer adam " + flags;
  }

  static std::vector<nlohmann::json> metrics(const std::string& path) {
    std::vector<nlohmann::json> rows;
    std::string text = read_text(path);
    for (size_t at = 0, end; (end = text.find('\n', at)) != std::string::npos; at = end + 1) {
      rows.push_back(nlohmann::json::parse(text.substr(at, end - at)));
    }
    return rows;
  }

  // overflow.onnx, big_x.npy and zero_y.npy: a model and data whose gradients overflow
  // under a finite loss (StopNamesTheLayerWhoseGradientOverflowedUnderAFiniteLoss says how).
  void write_overflowing_run() const {
    testing::ModelBuilder b(4);
    b.output(b.linear(b.linear("input", 4, 4), 4, 2), 2);
    for (auto& t : *b.model().mutable_graph()->mutable_initializer()) {
      const float value = t.name() == "fc0.weight" ? 1e-19f : t.name() == "fc1.weight" ? 1e19f : 0.0f;
      for (int i = 0; i < t.float_data_size(); ++i) t.set_float_data(i, value);
    }
    b.save(dir_ / "overflow.onnx");
    const std::vector<float> x(32 * 4, 1e19f), y(32 * 2, 0.0f);
    ASSERT_TRUE(write_npy(dir_ / "big_x.npy", {32, 4}, x.data()));
    ASSERT_TRUE(write_npy(dir_ / "zero_y.npy", {32, 2}, y.data()));
  }
  // train on them, before the run's own flags.
  std::string overflowing_train() const {
    return quote(tool_path("train")) + " " + quote(dir_ / "overflow.onnx") + " --data " + quote(dir_ / "big_x.npy") +
           " --labels " + quote(dir_ / "zero_y.npy");
  }

  ScratchDir dir_{"nonfinite"};
};

TEST_F(NonFinite, StopNamesTheStepAndTheFirstGradientInBackwardOrder) {
  const auto r = run_command(train("", "x", "--steps 6 --save " + quote(dir_ / "never.onnx")));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  // The NaN reaches every gradient; backward meets the last Linear's first.
  EXPECT_NE(r.err.find("train: error: step 3: the loss became nan (first non-finite gradient in backward order: "
                       "'4.weight' (node '/4/Gemm'))"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("--on-nonfinite skip"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "never.onnx"));
}

// A finite loss over gradients that overflow, and not in the last layer: fc0's weights
// are 1e-19 and fc1's 1e19, so on inputs of 1e19 the prediction is about 1.6e20 (its square
// still fits the loss's double), the gradient reaching fc0's output is about 4e38 (past
// float's 3.4e38: inf) and fc1's own gradients stay finite. Backward meets fc0's first.
TEST_F(NonFinite, StopNamesTheLayerWhoseGradientOverflowedUnderAFiniteLoss) {
  ASSERT_NO_FATAL_FAILURE(write_overflowing_run());
  const auto r = run_command(overflowing_train() + " --loss mse --steps 3 --checkpoint " + quote(dir_ / "ckpt"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("train: error: step 1: the gradient of 'fc0.weight' (node 'fc0') became inf or NaN, the first "
                       "in backward order (loss "),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "ckpt/checkpoint.pipeshard")) << "a spoilt step was saved";
  std::printf("%s", r.err.c_str());
}

// A skipped step changes no weight and no optimizer state, and Adam counts only updates:
// so after it the run is, step for step, the run on the data without that batch.
TEST_F(NonFinite, SkipGoesOnExactlyAsIfTheBatchWereNotThere) {
  const auto r = run_command(train("", "x", "--steps 8 --on-nonfinite skip --metrics " + quote(dir_ / "skip.jsonl")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("step 3: the loss became nan"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("; step skipped"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("done: 8 steps (1 skipped: loss or gradients not finite)"), std::string::npos) << r.err;
  const auto without = run_command(train("", "x_removed", "--steps 7 --metrics " + quote(dir_ / "removed.jsonl")));
  ASSERT_EQ(without.exit_code, 0) << without.err;

  const auto skipping = metrics(dir_ / "skip.jsonl"), removed = metrics(dir_ / "removed.jsonl");
  ASSERT_EQ(skipping.size(), 8u);
  ASSERT_EQ(removed.size(), 7u);
  for (int64_t step = 1; step <= 8; ++step) {
    const nlohmann::json& row = skipping[step - 1];
    EXPECT_EQ(row.contains("skipped"), step == kPoisonedStep) << row.dump();
    if (step == kPoisonedStep) continue;
    const nlohmann::json& same = removed[step < kPoisonedStep ? step - 1 : step - 2];
    EXPECT_EQ(row["loss"].get<double>(), same["loss"].get<double>()) << "step " << step;
  }
}

// A skipped step logs the learning rate the schedule set for it, not 0: here every step
// overflows (as in the test above, the weights never change), under a warm-up of 4 steps.
TEST_F(NonFinite, SkippedStepsLogTheScheduledLearningRate) {
  ASSERT_NO_FATAL_FAILURE(write_overflowing_run());
  const auto r = run_command(overflowing_train() +
                             " --loss mse --steps 3 --lr 0.1 --lr-schedule warmup --warmup-steps 4 --on-nonfinite skip "
                             "--metrics " +
                             quote(dir_ / "m.jsonl"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto rows = metrics(dir_ / "m.jsonl");
  ASSERT_EQ(rows.size(), 3u);
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_TRUE(rows[i].value("skipped", false)) << rows[i].dump();
    EXPECT_NEAR(rows[i]["lr"].get<double>(), 0.1 * static_cast<double>(i + 1) / 4, 1e-7) << rows[i].dump();
  }
}

// Two pipeline stages: the stages agree to stop or skip together. The bad gradient named
// is stage 1's, which backward reaches first; skipping gives the one-process run exactly
// (one micro-batch: the same sums in the same order).
TEST_F(NonFinite, PipelineStagesStopAndSkipTogether) {
  const std::string mpi = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir_.path()) +
                          " " + quote(PIPESHARD_MPIEXEC) + " -n 2 --oversubscribe ";
  const auto stopped = run_command(train(mpi, "x", "--steps 6 --stages 2"));
  EXPECT_NE(stopped.exit_code, 0) << stopped.err;
  EXPECT_NE(stopped.err.find("train: error: step 3: the loss became nan (first non-finite gradient in backward order: "
                             "'4.weight' (node '/4/Gemm', stage 1))"),
            std::string::npos)
      << stopped.err;

  const auto skipped =
      run_command(train(mpi, "x", "--steps 6 --stages 2 --on-nonfinite skip --metrics " + quote(dir_ / "p2.jsonl")));
  ASSERT_EQ(skipped.exit_code, 0) << skipped.err;
  const auto alone = run_command(train("", "x", "--steps 6 --on-nonfinite skip --metrics " + quote(dir_ / "p1.jsonl")));
  ASSERT_EQ(alone.exit_code, 0) << alone.err;
  const auto p2 = metrics(dir_ / "p2.jsonl"), p1 = metrics(dir_ / "p1.jsonl");
  ASSERT_EQ(p2.size(), 6u);
  ASSERT_EQ(p1.size(), 6u);
  for (size_t i = 0; i < p1.size(); ++i) {
    EXPECT_EQ(p2[i].contains("skipped"), p1[i].contains("skipped")) << p2[i].dump();
    if (!p1[i].contains("skipped")) {
      EXPECT_EQ(p2[i]["loss"].get<double>(), p1[i]["loss"].get<double>()) << i;
    }
  }
}

}  // namespace
}  // namespace pipeshard
