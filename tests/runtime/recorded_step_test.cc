// train --cuda-graph (TrainConfig::cuda_graph) checked on the CPU: the trainer runs over a
// RecordingBackend (testing/recording_backend.h), which records as a CUDA graph does —
// arguments frozen at recording, no host values, allocation or host copies inside — so a
// trainer that recorded anything that changes from step to step, or something a graph
// cannot hold, gives different numbers or stops here. What must hold: the recorded run is
// the eager run, loss for loss and weight for weight, bit for bit.
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "importer/onnx_importer.h"
#include "runtime/trainer.h"
#include "testing/recording_backend.h"
#include "tests/backend/backend_check.h"
#include "tests/model_util.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::backend_under_test;
using testing::load_model;
using testing::quote;
using testing::RecordingBackend;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

Dataset data_for(const ImportedModel& m, const std::string& x, const std::string& y, LossKind loss) {
  Result<Dataset> d = load_dataset(source_path(x), source_path(y), m.graph, targets_of(loss));
  EXPECT_TRUE(d.is_ok()) << d.status().message();
  return std::move(d).value();
}

// The two trainers' parameters are the same, bit for bit.
void expect_same_parameters(Trainer& want_trainer, Trainer& got_trainer, const Graph& graph) {
  Graph want = graph, got = graph;
  want_trainer.download_parameters(want);
  got_trainer.download_parameters(got);
  for (size_t p = 0; p < want.params.size(); ++p) {
    for (size_t i = 0; i < want.params[p].data.size(); ++i) {
      ASSERT_EQ(got.params[p].data[i], want.params[p].data[i]) << want.params[p].name << "[" << i << "]";
    }
  }
}

struct Case {
  std::string name, model, x, y;
  TrainConfig config;
  int passes = 2;  // recorded per micro-batch: F and B, or F, I and W
};

std::vector<Case> cases() {
  const std::string digits_x = "data/digits_features.npy", digits_y = "data/digits_labels.npy";
  const std::string small_x = "tests/golden/gelu_layernorm/x.npy", small_y = "tests/golden/gelu_layernorm/y.npy";
  std::vector<Case> all;
  {
    TrainConfig c;  // SGD with momentum, accumulation, a changing learning rate
    c.optimizer.kind = OptimizerKind::kSgd;
    c.optimizer.lr = 0.05f;
    c.optimizer.momentum = 0.9f;
    c.schedule = LrSchedule::kCosine;
    c.warmup_steps = 2;
    c.batch_size = 32;
    c.grad_accum = 2;
    all.push_back({"sgd_accumulation_cosine", "simple_digits", digits_x, digits_y, c});
  }
  {
    TrainConfig c;  // Adam's step count, clipping, dynamic loss scaling: all outside the recordings
    c.optimizer.kind = OptimizerKind::kAdam;
    c.optimizer.lr = 1e-3f;
    c.clip_grad_norm = 0.5;
    c.loss_scaling.mode = LossScaling::Mode::kDynamic;
    c.loss_scaling.growth_interval = 3;
    c.batch_size = 64;
    all.push_back({"adam_clip_loss_scale", "residual", digits_x, digits_y, c});
  }
  {
    TrainConfig c;  // running statistics updated inside the recording
    c.optimizer.kind = OptimizerKind::kSgd;
    c.optimizer.lr = 0.01f;
    c.optimizer.momentum = 0.9f;
    c.batch_size = 32;
    all.push_back({"batchnorm", "batchnorm_train", small_x, small_y, c});
  }
  {
    TrainConfig c;  // micro-batches in one process: one recording per micro-batch, each its slice
    c.optimizer.kind = OptimizerKind::kSgd;
    c.optimizer.lr = 0.05f;
    c.batch_size = 64;
    c.micro_batches = 4;
    c.pipeline_schedule = "gpipe";
    all.push_back({"micro_batches", "simple_digits", digits_x, digits_y, c});
  }
  {
    TrainConfig c;
    c.optimizer.kind = OptimizerKind::kAdamW;
    c.optimizer.lr = 1e-3f;
    c.optimizer.weight_decay = 0.01f;
    c.batch_size = 16;
    c.grad_accum = 3;
    all.push_back({"layernorm_gelu_adamw", "layernorm_opset18", small_x, small_y, c});
  }
  {
    TrainConfig c;  // a split backward: I and W recorded apart, W's owed across other I's
    c.optimizer.kind = OptimizerKind::kAdamW;
    c.optimizer.lr = 1e-3f;
    c.batch_size = 32;
    c.grad_accum = 2;
    c.micro_batches = 4;
    c.pipeline_schedule = "zb-h1";
    all.push_back({"zb_h1_layernorm", "layernorm_opset18", small_x, small_y, c, 3});
  }
  for (Case& c : all) {
    c.config.total_steps = 7;
    c.config.shuffle = true;
    c.config.seed = 11;
  }
  return all;
}

void PrintTo(const Case& c, std::ostream* out) { *out << c.name; }

class RecordedStep : public ::testing::TestWithParam<Case> {};

TEST_P(RecordedStep, IsTheEagerStepBitForBit) {
  const Case& c = GetParam();
  const ImportedModel m = load_model(c.model);
  const Dataset d = data_for(m, c.x, c.y, c.config.loss);
  const int64_t steps = c.config.total_steps;

  std::unique_ptr<Backend> cpu = make_cpu_backend();
  auto eager = Trainer::create(m.graph, d, *cpu, c.config);
  ASSERT_TRUE(eager.is_ok()) << eager.status().message();
  std::unique_ptr<Backend> cpu2 = make_cpu_backend();
  RecordingBackend recorder(*cpu2);
  TrainConfig graphed = c.config;
  graphed.cuda_graph = true;
  auto recorded = Trainer::create(m.graph, d, recorder, graphed);
  ASSERT_TRUE(recorded.is_ok()) << recorded.status().message();

  for (int64_t s = 0; s < steps; ++s) {
    const StepResult want = (*eager)->step(), got = (*recorded)->step();
    EXPECT_EQ(got.loss, want.loss) << "step " << s + 1;
    EXPECT_EQ(got.grad_norm, want.grad_norm) << "step " << s + 1;
    EXPECT_EQ(got.lr, want.lr) << "step " << s + 1;
  }
  // One forward and one backward recording (or one of each half) per micro-step of the
  // accumulation and micro-batch, made at the second step and replayed from then on.
  const int per_step = c.passes * static_cast<int>(c.config.grad_accum) * c.config.micro_batches;
  EXPECT_EQ(recorder.recordings, per_step);
  EXPECT_EQ(recorder.replays, per_step * (steps - 1));
  EXPECT_GT(recorder.recorded_calls, 2 * per_step) << "the recordings hold the layers' calls";
  EXPECT_EQ((*recorded)->recordings(), per_step);

  expect_same_parameters(**eager, **recorded, m.graph);
}

// Evaluation between steps runs more rows through the same program, which on a GPU may
// move scratch buffers the recordings point into: the trainer records afresh after it.
TEST(RecordedStepEvaluation, RecordsAfreshAndStaysBitForBit) {
  const ImportedModel m = load_model("simple_digits");
  const Dataset d = data_for(m, "data/digits_features.npy", "data/digits_labels.npy", LossKind::kCrossEntropy);
  TrainConfig c;
  c.optimizer.kind = OptimizerKind::kSgd;
  c.optimizer.momentum = 0.9f;
  c.batch_size = 32;
  c.micro_batches = 2;
  c.pipeline_schedule = "gpipe";
  c.total_steps = 6;
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  auto eager = Trainer::create(m.graph, d, *cpu, c);
  ASSERT_TRUE(eager.is_ok());
  std::unique_ptr<Backend> cpu2 = make_cpu_backend();
  RecordingBackend recorder(*cpu2);
  c.cuda_graph = true;
  auto recorded = Trainer::create(m.graph, d, recorder, c);
  ASSERT_TRUE(recorded.is_ok());
  for (int s = 0; s < 6; ++s) {
    EXPECT_EQ((*recorded)->step().loss, (*eager)->step().loss) << "step " << s + 1;
    if (s == 2) {
      const EvalResult want = (*eager)->evaluate(d), got = (*recorded)->evaluate(d);
      EXPECT_EQ(got.loss, want.loss);
      EXPECT_EQ((*recorded)->recordings(), 0) << "evaluation drops the recordings";
    }
  }
  EXPECT_EQ(recorder.recordings, 2 * 2 * 2) << "two micro-batches, forward and backward, recorded twice";
}

INSTANTIATE_TEST_SUITE_P(Models, RecordedStep, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// The double itself: a replay runs the calls with the arguments they had when recorded,
// whatever the caller's variables hold now, and reads the buffers as they are now.
TEST(RecordingBackendItself, FreezesArgumentsNotBuffers) {
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  RecordingBackend recorder(*cpu);
  DeviceBuffer x(recorder, 4), y(recorder, 4);
  float a = 2.0f;
  std::unique_ptr<RecordedWork> work = recorder.record([&] { recorder.axpy(y.data(), a, x.data(), 4); });
  ASSERT_TRUE(work);
  std::vector<float> host(4, 0.0f);
  recorder.download(host.data(), y.data(), 4);
  EXPECT_EQ(host, std::vector<float>(4, 0.0f)) << "recording runs nothing";
  const std::vector<float> ones(4, 1.0f);
  recorder.upload(x.data(), ones.data(), 4);
  a = 100.0f;  // too late: the recording holds 2
  work->replay();
  work->replay();
  recorder.download(host.data(), y.data(), 4);
  EXPECT_EQ(host, std::vector<float>(4, 4.0f));
}

TEST(RecordedStepRefusals, DropoutAndTheCpu) {
  const ImportedModel m = load_model("dropout_train");
  const Dataset d =
      data_for(m, "tests/golden/gelu_layernorm/x.npy", "tests/golden/gelu_layernorm/y.npy", LossKind::kCrossEntropy);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  TrainConfig c;
  c.cuda_graph = true;
  c.batch_size = 16;
  auto t = Trainer::create(m.graph, d, *cpu, c);
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("(Dropout) draws new masks every step"), std::string::npos)
      << t.status().message();

  const auto r = run_command(quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) +
                             " --data " + quote(source_path("data/digits_features.npy")) + " --labels " +
                             quote(source_path("data/digits_labels.npy")) + " --steps 2 --cuda-graph");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("train: error: --cuda-graph needs --device cuda"), std::string::npos) << r.err;
}

// On the backend under test (tests/backend/backend_check.h: the CPU one, or the CUDA one in the
// "gpu" copy of this suite): the same run with and without --cuda-graph, bit for bit. On the
// GPU this runs real CUDA graphs (recordings() > 0) against the eager kernels; the CPU
// backend cannot record, so there both runs are eager.
TEST(RecordedStepOnBackend, IsTheEagerStepBitForBit) {
  std::string why;
  std::unique_ptr<Backend> eager_backend = backend_under_test(&why);
  if (!eager_backend) GTEST_SKIP() << why;
  std::unique_ptr<Backend> graph_backend = backend_under_test(&why);
  ASSERT_TRUE(graph_backend) << why;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const ImportedModel m = load_model(c.model);
    const Dataset d = data_for(m, c.x, c.y, c.config.loss);
    auto eager = Trainer::create(m.graph, d, *eager_backend, c.config);
    ASSERT_TRUE(eager.is_ok()) << eager.status().message();
    TrainConfig graphed = c.config;
    graphed.cuda_graph = true;
    auto recorded = Trainer::create(m.graph, d, *graph_backend, graphed);
    ASSERT_TRUE(recorded.is_ok()) << recorded.status().message();
    for (int64_t s = 0; s < c.config.total_steps; ++s) {
      const StepResult want = (*eager)->step(), got = (*recorded)->step();
      EXPECT_EQ(got.loss, want.loss) << "step " << s + 1;
    }
    const bool records = std::string(graph_backend->name()) == "cuda";
    EXPECT_EQ((*recorded)->recordings() > 0, records) << graph_backend->name();
    expect_same_parameters(**eager, **recorded, m.graph);
  }
}

// A resumed run warms up eagerly again before it records (a checkpoint does not carry the
// backend's plans and scratch), and still gives the uninterrupted run's numbers.
TEST(RecordedStepResume, GoesOnBitForBit) {
  const ImportedModel m = load_model("simple_digits");
  const Dataset d = data_for(m, "data/digits_features.npy", "data/digits_labels.npy", LossKind::kCrossEntropy);
  TrainConfig c;
  c.optimizer.kind = OptimizerKind::kAdam;
  c.optimizer.lr = 1e-3f;
  c.batch_size = 32;
  c.total_steps = 8;
  c.cuda_graph = true;
  ScratchDir dir("recorded_resume");

  std::unique_ptr<Backend> cpu = make_cpu_backend();
  RecordingBackend whole_backend(*cpu);
  auto whole = Trainer::create(m.graph, d, whole_backend, c);
  ASSERT_TRUE(whole.is_ok());
  std::vector<double> want;
  for (int s = 0; s < 8; ++s) want.push_back((*whole)->step().loss);

  std::unique_ptr<Backend> cpu2 = make_cpu_backend();
  RecordingBackend first_backend(*cpu2);
  auto first = Trainer::create(m.graph, d, first_backend, c);
  ASSERT_TRUE(first.is_ok());
  for (int s = 0; s < 4; ++s) EXPECT_EQ((*first)->step().loss, want[s]) << "step " << s + 1;
  ASSERT_TRUE((*first)->save_checkpoint(dir.path()).is_ok());

  std::unique_ptr<Backend> cpu3 = make_cpu_backend();
  RecordingBackend second_backend(*cpu3);
  auto second = Trainer::create(m.graph, d, second_backend, c);
  ASSERT_TRUE(second.is_ok());
  ASSERT_TRUE((*second)->load_checkpoint(dir.path()).is_ok());
  for (int s = 4; s < 8; ++s) EXPECT_EQ((*second)->step().loss, want[s]) << "step " << s + 1;
  EXPECT_EQ(second_backend.recordings, 2);
  EXPECT_EQ(second_backend.replays, 2 * 3) << "step 5 ran eagerly, steps 6 to 8 replayed";
}

}  // namespace
}  // namespace pipeshard
