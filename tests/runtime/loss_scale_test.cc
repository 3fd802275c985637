// Loss scaling (runtime/trainer.h, LossScaling), checked on the CPU, where fp32 shows
// exactly what it must do: a power-of-two scale changes no bit; a dynamic scale skips the
// steps whose gradients overflow under it, halving each time, doubles after its growth
// interval, and a run resumed from a checkpoint goes on with the scale it had; the flag
// is refused, with one line, when it is not a power of two.
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "importer/onnx_importer.h"
#include "runtime/trainer.h"
#include "tests/model_builder.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::quote;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

struct TrainedRun {
  std::vector<StepResult> steps;
  Graph trained;
};

TrainedRun train(const Graph& g, const Dataset& d, const TrainConfig& c, int64_t steps) {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  auto t = Trainer::create(g, d, *backend, c);
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  TrainedRun r;
  for (int64_t s = 0; s < steps; ++s) r.steps.push_back((*t)->step());
  r.trained = g;
  (*t)->download_parameters(r.trained);
  return r;
}

void expect_same_weights(const Graph& got, const Graph& want, const std::string& what) {
  for (size_t p = 0; p < want.params.size(); ++p) {
    ASSERT_EQ(got.params[p].data.size(), want.params[p].data.size());
    for (size_t i = 0; i < want.params[p].data.size(); ++i) {
      ASSERT_EQ(got.params[p].data[i], want.params[p].data[i])
          << what << ": " << want.params[p].name << "[" << i << "]";
    }
  }
}

ImportedModel digits_model() {
  Result<ImportedModel> m = import_onnx_file(source_path("models/simple_digits.onnx"));
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  return std::move(m).value();
}

Dataset digits(const Graph& g) {
  Result<Dataset> d = load_dataset(source_path("data/digits_features.npy"), source_path("data/digits_labels.npy"), g,
                                   Targets::kClassIndices);
  EXPECT_TRUE(d.is_ok()) << d.status().message();
  return std::move(d).value();
}

TrainConfig config(OptimizerKind kind, double clip) {
  TrainConfig c;
  c.optimizer.kind = kind;
  c.optimizer.lr = kind == OptimizerKind::kSgd ? 0.05f : 1e-3f;
  c.optimizer.momentum = kind == OptimizerKind::kSgd ? 0.9f : 0.0f;
  c.optimizer.weight_decay = kind == OptimizerKind::kAdamW ? 0.01f : 0.0f;
  c.clip_grad_norm = clip;
  c.batch_size = 32;
  c.grad_accum = 2;
  c.total_steps = 6;
  c.shuffle = false;
  return c;
}

// Powers of two scale and unscale exactly: the run is the unscaled run, bit for bit, for
// scales far above and below 1, with accumulation and clipping (whose norm must be the
// unscaled gradient's).
TEST(LossScale, PowersOfTwoChangeNoBit) {
  ImportedModel m = digits_model();
  const Dataset d = digits(m.graph);
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdamW}) {
    const TrainConfig plain = config(kind, 0.5);
    const TrainedRun want = train(m.graph, d, plain, 6);
    for (double scale : {0x1p10, 0x1p-10, 0x1p40}) {
      for (LossScaling::Mode mode : {LossScaling::Mode::kStatic, LossScaling::Mode::kDynamic}) {
        TrainConfig scaled = plain;
        scaled.loss_scaling.mode = mode;
        scaled.loss_scaling.initial = scale;
        scaled.loss_scaling.growth_interval = 4;  // the dynamic scale doubles once in the run
        const std::string what = std::string(kind == OptimizerKind::kSgd ? "sgd" : "adamw") + " scale " +
                                 std::to_string(scale) + (mode == LossScaling::Mode::kStatic ? " static" : " dynamic");
        const TrainedRun got = train(m.graph, d, scaled, 6);
        for (size_t s = 0; s < want.steps.size(); ++s) {
          EXPECT_EQ(got.steps[s].loss, want.steps[s].loss) << what << ", step " << s + 1;
          EXPECT_EQ(got.steps[s].grad_norm, want.steps[s].grad_norm) << what << ", step " << s + 1;
          EXPECT_FALSE(got.steps[s].scale_overflow) << what << ", step " << s + 1;
          const double expected_scale = mode == LossScaling::Mode::kDynamic && s >= 4 ? 2 * scale : scale;
          EXPECT_EQ(got.steps[s].loss_scale, expected_scale) << what << ", step " << s + 1;
        }
        expect_same_weights(got.trained, want.trained, what);
      }
    }
  }
}

// One Linear(4 → 2), weights 1, on 32 identical samples of 1e15 with targets 0 (MSE):
// every step sees the same batch, and the weight gradient is about 32 · 1.25e14 · 1e15 =
// 4e30, which overflows float (3.4e38) under scales from 2^27 (5.4e38) up and fits under
// 2^26 (2.7e38). A learning rate of 1e-36 keeps the weights, and so the gradient, nearly
// where they are.
class Overflow : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::ModelBuilder b(4);
    b.output(b.linear("input", 4, 2), 2);
    for (auto& t : *b.model().mutable_graph()->mutable_initializer()) {
      for (int i = 0; i < t.float_data_size(); ++i) t.set_float_data(i, t.name() == "fc0.weight" ? 1.0f : 0.0f);
    }
    b.save(dir_ / "linear.onnx");
    Result<ImportedModel> m = import_onnx_file(dir_ / "linear.onnx");
    ASSERT_TRUE(m.is_ok()) << m.status().message();
    model_ = std::move(*m);
    data_.samples = 32;
    data_.features_per_sample = 4;
    data_.targets_per_sample = 2;
    data_.features = Rows::of_floats(std::vector<float>(32 * 4, 1e15f), 4);
    data_.targets = Rows::of_floats(std::vector<float>(32 * 2, 0.0f), 2);
  }

  TrainConfig base(OptimizerKind kind) const {
    TrainConfig c;
    c.loss = LossKind::kMse;
    c.optimizer.kind = kind;
    c.optimizer.lr = 1e-36f;
    c.optimizer.momentum = kind == OptimizerKind::kSgd ? 0.9f : 0.0f;
    c.batch_size = 32;
    c.total_steps = 40;
    c.shuffle = false;
    return c;
  }

  ScratchDir dir_{"loss_scale"};
  ImportedModel model_;
  Dataset data_;
};

// From 2^30 the scale halves through four overflowing steps to 2^26, where steps update;
// after two updates it doubles to 2^27, overflows, halves: a saw-tooth. The updates are
// those of the unscaled run, bit for bit (SGD's first momentum step and Adam's bias
// correction count updates, not skipped steps), and a skipped step changes no weight.
TEST_F(Overflow, DynamicScaleSkipsOverflowsHalvesAndGrows) {
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdam}) {
    const char* name = kind == OptimizerKind::kSgd ? "sgd" : "adam";
    TrainConfig dynamic = base(kind);
    dynamic.loss_scaling.mode = LossScaling::Mode::kDynamic;
    dynamic.loss_scaling.initial = 0x1p30;
    dynamic.loss_scaling.growth_interval = 2;
    const TrainedRun got = train(model_.graph, data_, dynamic, 13);
    const std::vector<double> scales = {0x1p30, 0x1p29, 0x1p28, 0x1p27, 0x1p26, 0x1p26, 0x1p27,
                                        0x1p26, 0x1p26, 0x1p27, 0x1p26, 0x1p26, 0x1p27};
    int updates = 0;
    for (size_t s = 0; s < scales.size(); ++s) {
      EXPECT_EQ(got.steps[s].loss_scale, scales[s]) << name << ", step " << s + 1;
      const bool overflow = scales[s] >= 0x1p27;
      EXPECT_EQ(got.steps[s].scale_overflow, overflow) << name << ", step " << s + 1;
      EXPECT_FALSE(got.steps[s].non_finite) << name << ", step " << s + 1;
      if (!overflow) ++updates;
    }
    ASSERT_EQ(updates, 6);
    // The unscaled run, one step further: a step's loss is that of the weights the updates
    // before it left, so a step after u updates has loss want.steps[u].loss.
    const TrainedRun want = train(model_.graph, data_, base(kind), updates + 1);
    size_t u = 0;
    for (size_t s = 0; s < scales.size(); ++s) {
      EXPECT_EQ(got.steps[s].loss, want.steps[u].loss) << name << ", step " << s + 1;
      if (!got.steps[s].scale_overflow) ++u;
    }
    expect_same_weights(got.trained, train(model_.graph, data_, base(kind), updates).trained, name);
  }
}

// The scale and its count of good steps travel in the checkpoint: 7 steps, a checkpoint,
// 6 more in a new trainer, give the 13 steps of one run.
TEST_F(Overflow, ResumedRunGoesOnWithItsScale) {
  TrainConfig c = base(OptimizerKind::kAdam);
  c.loss_scaling.mode = LossScaling::Mode::kDynamic;
  c.loss_scaling.initial = 0x1p30;
  c.loss_scaling.growth_interval = 2;
  const TrainedRun whole = train(model_.graph, data_, c, 13);

  std::unique_ptr<Backend> backend = make_cpu_backend();
  auto first = Trainer::create(model_.graph, data_, *backend, c);
  ASSERT_TRUE(first.is_ok()) << first.status().message();
  for (int s = 0; s < 8; ++s) (*first)->step();  // ends after one good step at 2^26
  ASSERT_TRUE((*first)->save_checkpoint(dir_ / "ckpt").is_ok());
  auto second = Trainer::create(model_.graph, data_, *backend, c);
  ASSERT_TRUE(second.is_ok()) << second.status().message();
  const Status loaded = (*second)->load_checkpoint(dir_ / "ckpt");
  ASSERT_TRUE(loaded.is_ok()) << loaded.message();
  EXPECT_EQ((*second)->loss_scale(), 0x1p26);
  for (size_t s = 8; s < 13; ++s) {
    const StepResult r = (*second)->step();
    EXPECT_EQ(r.loss_scale, whole.steps[s].loss_scale) << "step " << s + 1;
    EXPECT_EQ(r.scale_overflow, whole.steps[s].scale_overflow) << "step " << s + 1;
    EXPECT_EQ(r.loss, whole.steps[s].loss) << "step " << s + 1;
  }
  Graph resumed = model_.graph;
  (*second)->download_parameters(resumed);
  expect_same_weights(resumed, whole.trained, "resumed");
}

TEST(LossScaleCli, ReportsOverflowsAndRefusesScalesThatAreNotPowersOfTwo) {
  const std::string train = quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) +
                            " --data " + quote(source_path("data/digits_features.npy")) + " --labels " +
                            quote(source_path("data/digits_labels.npy")) + " --steps 2 --loss-scale ";
  for (const char* bad : {"3", "0", "-2", "1e300", "dynamic2", "0x1p3"}) {
    const auto r = run_command(train + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.err;
    EXPECT_NE(r.err.find("train: error: --loss-scale must be dynamic, none or a power of two"), std::string::npos)
        << bad << ": " << r.err;
  }
  for (const char* good : {"1024", "0.25", "dynamic", "none"}) {
    const auto r = run_command(train + good);
    EXPECT_EQ(r.exit_code, 0) << good << ": " << r.err;
  }
  // --precision fp16 turns dynamic scaling on by itself; the CPU refuses the precision.
  const auto fp16 = run_command(train + "dynamic --precision fp16");
  EXPECT_EQ(fp16.exit_code, 2);
  EXPECT_NE(fp16.err.find("--precision fp16 needs --device cuda"), std::string::npos) << fp16.err;
}

}  // namespace
}  // namespace pipeshard
