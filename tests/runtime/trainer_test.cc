// The training loop's promises that need no PyTorch to check: gradient accumulation is
// a larger batch, a resumed run is the uninterrupted run, shuffling is seeded, and
// bad data files are refused with a message naming the file and the problem.
#include <cmath>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "dataset/npy.h"
#include "importer/onnx_importer.h"
#include "program/program.h"
#include "runtime/trainer.h"
#include "testing/recording_backend.h"
#include "tests/model_util.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::load_model;
using testing::ScratchDir;
using testing::source_path;

struct RunResult {
  std::vector<double> losses;
  Graph trained;
};

Dataset digits() {
  ImportedModel m = load_model("simple_digits");
  Result<Dataset> d = load_dataset(source_path("data/digits_features.npy"), source_path("data/digits_labels.npy"),
                                   m.graph, Targets::kClassIndices);
  EXPECT_TRUE(d.is_ok()) << d.status().message();
  return std::move(d).value();
}

TrainConfig sgd(int64_t batch, int64_t accum, int64_t steps) {
  TrainConfig c;
  c.optimizer.kind = OptimizerKind::kSgd;
  c.optimizer.lr = 0.05f;
  c.optimizer.momentum = 0.9f;
  c.batch_size = batch;
  c.grad_accum = accum;
  c.total_steps = steps;
  c.shuffle = false;
  return c;
}

RunResult train(const Graph& g, const Dataset& d, const TrainConfig& c, int64_t steps) {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  auto t = Trainer::create(g, d, *backend, c);
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  RunResult r;
  for (int64_t s = 0; s < steps; ++s) r.losses.push_back((*t)->step().loss);
  r.trained = g;
  (*t)->download_parameters(r.trained);
  return r;
}

double max_weight_difference(const Graph& a, const Graph& b) {
  double worst = 0;
  for (size_t p = 0; p < a.params.size(); ++p)
    for (size_t i = 0; i < a.params[p].data.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::fabs(a.params[p].data[i] - b.params[p].data[i])));
  return worst;
}

TEST(Trainer, GradientAccumulationIsALargerBatch) {
  ImportedModel m = load_model("simple_digits");
  const Dataset d = digits();
  RunResult big = train(m.graph, d, sgd(64, 1, 10), 10);
  RunResult accumulated = train(m.graph, d, sgd(32, 2, 10), 10);
  for (size_t s = 0; s < big.losses.size(); ++s) {
    EXPECT_NEAR(accumulated.losses[s], big.losses[s], 1e-5 * std::fabs(big.losses[s])) << "step " << s + 1;
  }
  // Two half-batch GEMMs sum in a different order than one: float rounding only.
  EXPECT_LT(max_weight_difference(accumulated.trained, big.trained), 1e-5);
}

TEST(Trainer, ResumedRunEqualsTheUninterruptedRun) {
  ImportedModel m = load_model("simple_digits");
  const Dataset d = digits();
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdamW}) {
    TrainConfig c = sgd(64, 1, 12);
    c.optimizer.kind = kind;
    c.shuffle = true;
    c.seed = 5;
    if (kind != OptimizerKind::kSgd) c.optimizer.momentum = 0;
    RunResult straight = train(m.graph, d, c, 12);

    ScratchDir dir("ckpt");
    std::unique_ptr<Backend> backend = make_cpu_backend();
    {
      auto first = Trainer::create(m.graph, d, *backend, c);
      ASSERT_TRUE(first.is_ok());
      for (int s = 0; s < 5; ++s) (*first)->step();
      ASSERT_TRUE((*first)->save_checkpoint(dir.path()).is_ok());
    }
    auto second = Trainer::create(m.graph, d, *backend, c);
    ASSERT_TRUE(second.is_ok());
    Graph resumed = m.graph;
    Status loaded = (*second)->load_checkpoint(dir.path());
    ASSERT_TRUE(loaded.is_ok()) << loaded.message();
    EXPECT_EQ((*second)->steps_done(), 5);
    for (int s = 5; s < 12; ++s) {
      StepResult r = (*second)->step();
      EXPECT_EQ(r.step, s + 1);
      EXPECT_EQ(r.loss, straight.losses[s]) << "step " << s + 1 << " must be bit-identical";
    }
    (*second)->download_parameters(resumed);
    EXPECT_EQ(max_weight_difference(resumed, straight.trained), 0.0);
  }
}

// BatchNorm's running statistics are parameters without gradients or optimizer state:
// they are checkpointed by value, and the resumed run is still bit-identical, with and
// without clipping.
TEST(Trainer, ResumesABatchNormModelBitIdentically) {
  ImportedModel m = load_model("batchnorm_train");
  Result<Dataset> loaded =
      load_dataset(source_path("tests/golden/gelu_layernorm/x.npy"), source_path("tests/golden/gelu_layernorm/y.npy"),
                   m.graph, Targets::kClassIndices);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().message();
  const Dataset& d = *loaded;
  for (double clip : {0.0, 0.5}) {
    SCOPED_TRACE("clip " + std::to_string(clip));
    TrainConfig c = sgd(32, 1, 8);
    c.clip_grad_norm = clip;
    RunResult straight = train(m.graph, d, c, 8);
    ScratchDir dir("bn-ckpt");
    std::unique_ptr<Backend> backend = make_cpu_backend();
    {
      auto first = Trainer::create(m.graph, d, *backend, c);
      ASSERT_TRUE(first.is_ok());
      for (int s = 0; s < 3; ++s) (*first)->step();
      ASSERT_TRUE((*first)->save_checkpoint(dir.path()).is_ok());
    }
    auto second = Trainer::create(m.graph, d, *backend, c);
    ASSERT_TRUE(second.is_ok());
    Status resumed_ok = (*second)->load_checkpoint(dir.path());
    ASSERT_TRUE(resumed_ok.is_ok()) << resumed_ok.message();
    for (int s = 3; s < 8; ++s) EXPECT_EQ((*second)->step().loss, straight.losses[s]) << "step " << s + 1;
    Graph resumed = m.graph;
    (*second)->download_parameters(resumed);
    EXPECT_EQ(max_weight_difference(resumed, straight.trained), 0.0);
  }
}

TEST(Trainer, CheckpointOfAnotherModelIsRefused) {
  const Dataset d = digits();
  ImportedModel digits_model = load_model("simple_digits");
  ScratchDir dir("other");
  std::unique_ptr<Backend> backend = make_cpu_backend();
  {
    auto t = Trainer::create(digits_model.graph, d, *backend, sgd(64, 1, 2));
    ASSERT_TRUE(t.is_ok());
    (*t)->step();
    ASSERT_TRUE((*t)->save_checkpoint(dir.path()).is_ok());
  }
  // Same tensors but one renamed: the checkpoint lacks a parameter of this model.
  Graph renamed = digits_model.graph;
  renamed.params[0].name = "not_in_the_checkpoint";
  auto t = Trainer::create(renamed, d, *backend, sgd(64, 1, 2));
  ASSERT_TRUE(t.is_ok());
  Status s = (*t)->load_checkpoint(dir.path());
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("is not in this model"), std::string::npos) << s.message();
}

TEST(Trainer, ShuffleIsSeeded) {
  BatchOrder a(100, 10, true, 1), b(100, 10, true, 1), c(100, 10, true, 2), plain(100, 10, false, 1);
  EXPECT_EQ(a.indices(3), b.indices(3));
  EXPECT_NE(a.indices(3), c.indices(3));
  EXPECT_EQ(plain.indices(12), (std::vector<int64_t>{20, 21, 22, 23, 24, 25, 26, 27, 28, 29}));  // epoch 2 restarts
  // Each epoch is a permutation of all samples.
  std::vector<int64_t> seen;
  for (int64_t bi = 10; bi < 20; ++bi) {
    auto idx = a.indices(bi);
    seen.insert(seen.end(), idx.begin(), idx.end());
  }
  std::sort(seen.begin(), seen.end());
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(seen[i], i);
}

// Above kHeldPermutationSamples the order is computed per index (nothing held): still a
// permutation of every sample each epoch, seeded, different from epoch to epoch.
TEST(Trainer, ShuffleOfBigDataIsAPermutationHoldingNothing) {
  const int64_t n = kHeldPermutationSamples + 32768, batch = 1024;  // n / batch batches exactly
  BatchOrder a(n, batch, true, 5), b(n, batch, true, 5), c(n, batch, true, 6);
  ASSERT_EQ(a.batches_per_epoch() * batch, n);
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    std::vector<bool> seen(static_cast<size_t>(n), false);
    double sum = 0;
    for (int64_t bi = epoch * a.batches_per_epoch(); bi < (epoch + 1) * a.batches_per_epoch(); ++bi) {
      for (int64_t i : a.indices(bi)) {
        ASSERT_TRUE(i >= 0 && i < n && !seen[static_cast<size_t>(i)]) << i;
        seen[static_cast<size_t>(i)] = true;
        if (bi == epoch * a.batches_per_epoch()) sum += static_cast<double>(i);
      }
    }
    EXPECT_NEAR(sum / batch, n / 2.0, n * 0.05) << "the first batch is spread over the data";
  }
  EXPECT_EQ(a.indices(7), b.indices(7));
  EXPECT_NE(a.indices(7), c.indices(7));
  EXPECT_NE(a.indices(7), a.indices(7 + a.batches_per_epoch()));
}

TEST(Trainer, IncompleteLastBatchIsDropped) {
  BatchOrder o(1797, 64, false, 0);
  EXPECT_EQ(o.batches_per_epoch(), 28);
  EXPECT_EQ(o.indices(28).front(), 0);  // batch 29 is epoch 2's first
  EXPECT_EQ(o.epoch_of(28), 2);
}

TEST(Trainer, EvaluationReportsLossAndAccuracy) {
  ImportedModel m = load_model("simple_digits");
  const Dataset d = digits();
  std::unique_ptr<Backend> backend = make_cpu_backend();
  auto t = Trainer::create(m.graph, d, *backend, sgd(64, 1, 60));
  ASSERT_TRUE(t.is_ok());
  const EvalResult before = (*t)->evaluate(d);
  for (int s = 0; s < 60; ++s) (*t)->step();
  const EvalResult after = (*t)->evaluate(d);
  EXPECT_EQ(after.samples, 1797);
  EXPECT_LT(after.loss, before.loss);
  EXPECT_GT(after.accuracy, 0.8) << "the course model learns digits in 60 steps";
}

// Micro-batches are what a rank holds at once: a whole model trained in four keeps a
// quarter of the batch's activations (it used to keep the whole batch, for evaluation).
// Evaluation still goes in chunks of the whole batch, through a forward-only program with
// the trained weights copied in: the same figures, bit for bit, as a trainer without
// micro-batches gives for those weights.
TEST(Trainer, MicroBatchesHoldOneMicroBatchAndEvaluateAlike) {
  ImportedModel m = load_model("simple_digits");
  const Dataset d = digits();
  std::vector<int64_t> held;
  std::vector<EvalResult> before;
  Graph trained = m.graph;
  EvalResult after;
  for (int micro_batches : {1, 4}) {
    std::unique_ptr<Backend> backend = make_cpu_backend();
    TrainConfig c = sgd(64, 1, 3);
    c.micro_batches = micro_batches;
    auto t = Trainer::create(m.graph, d, *backend, c);
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    held.push_back(backend->memory_use().in_use);
    before.push_back((*t)->evaluate(d));
    if (micro_batches == 4) {
      for (int s = 0; s < 3; ++s) (*t)->step();
      after = (*t)->evaluate(d);
      (*t)->download_parameters(trained);
    }
  }
  std::unique_ptr<Backend> backend = make_cpu_backend();
  int64_t programs[2];
  for (int i = 0; i < 2; ++i) {
    auto p = Program::create(m.graph, *backend, i == 0 ? 64 : 16);
    ASSERT_TRUE(p.is_ok());
    programs[i] = (*p)->memory().total();
  }
  EXPECT_EQ(held[0] - held[1], programs[0] - programs[1]) << "the training program holds one micro-batch of 16";
  EXPECT_EQ(before[1].loss, before[0].loss);
  EXPECT_EQ(before[1].accuracy, before[0].accuracy);
  auto reference = Trainer::create(trained, d, *backend, sgd(64, 1, 3));
  ASSERT_TRUE(reference.is_ok());
  const EvalResult expected = (*reference)->evaluate(d);
  EXPECT_EQ(after.loss, expected.loss) << "the trained weights, not the first ones";
  EXPECT_EQ(after.accuracy, expected.accuracy);
  EXPECT_NE(after.loss, before[1].loss);
}

// The trace times forward and backward on the host clock, so on a backend that queues its
// work each of them waits for it then, and only then: otherwise the GPU keeps running ahead.
TEST(Trainer, ATraceWaitsForTheBackendAfterEachForwardAndBackward) {
  ImportedModel m = load_model("simple_digits");
  const Dataset d = digits();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  for (bool trace : {false, true}) {
    testing::RecordingBackend backend(*cpu);
    TrainConfig c = sgd(64, 1, 2);
    c.micro_batches = 2;
    auto t = Trainer::create(m.graph, d, backend, c);
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    (*t)->start_trace(trace);
    (*t)->step();
    EXPECT_EQ(backend.synchronizations, trace ? 4 : 0) << "two micro-batches, each a forward and a backward";
  }
}

// A data set split into shards of uneven sizes (a batch straddles two), mapped from files,
// trains bit for bit as the same arrays read whole into memory, shuffled, across epochs.
TEST(Trainer, ShardedMappedDataTrainsAsArraysInMemory) {
  ImportedModel m = load_model("simple_digits");
  Result<NpyArray> x = read_npy(source_path("data/digits_features.npy"));
  Result<NpyArray> y = read_npy(source_path("data/digits_labels.npy"));
  ASSERT_TRUE(x.is_ok() && y.is_ok());
  Result<Dataset> memory = make_dataset(*x, *y, m.graph, Targets::kClassIndices);
  ASSERT_TRUE(memory.is_ok()) << memory.status().message();
  ScratchDir dir("shards");
  std::filesystem::create_directories(dir / "x");
  std::filesystem::create_directories(dir / "y");
  const int64_t n = x->shape[0], width = x->shape[1];
  const std::vector<float> features = x->as_float();
  const std::vector<int64_t> labels = y->as_int64();
  const std::vector<int64_t> cuts = {0, 100, 101, 1000, n};
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    const int64_t rows = cuts[i + 1] - cuts[i];
    const std::string name = "part-" + std::to_string(i) + ".npy";
    ASSERT_TRUE(write_npy(dir / ("x/" + name), {rows, width}, features.data() + cuts[i] * width).is_ok());
  }
  ASSERT_TRUE(write_npy(dir / "y/all.npy", {n}, labels.data()).is_ok());
  Result<Dataset> sharded = load_dataset(dir / "x", dir / "y", m.graph, Targets::kClassIndices);
  ASSERT_TRUE(sharded.is_ok()) << sharded.status().message();
  ASSERT_EQ(sharded->features.parts().size(), 4u);
  TrainConfig c = sgd(64, 1, 0);
  c.shuffle = true;
  c.seed = 3;
  const int64_t steps = n / 64 + 3;  // into the second epoch
  c.total_steps = steps;
  const RunResult a = train(m.graph, *memory, c, steps), b = train(m.graph, *sharded, c, steps);
  EXPECT_EQ(a.losses, b.losses);
  EXPECT_EQ(max_weight_difference(a.trained, b.trained), 0.0);
  c.shuffle = false;  // in order: batches read in place where they lie in one shard
  const RunResult c1 = train(m.graph, *memory, c, steps), c2 = train(m.graph, *sharded, c, steps);
  EXPECT_EQ(c1.losses, c2.losses);
  EXPECT_EQ(max_weight_difference(c1.trained, c2.trained), 0.0);
}

class BadData : public ::testing::Test {
 protected:
  ImportedModel model_ = load_model("simple_digits");
  ScratchDir dir_{"data"};
  std::string message(const std::string& x, const std::string& y, LossKind loss = LossKind::kCrossEntropy) {
    Result<Dataset> d = load_dataset(x, y, model_.graph, targets_of(loss));
    EXPECT_FALSE(d.is_ok());
    return d.is_ok() ? "" : d.status().message();
  }
  std::string write_floats(const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::vector<float> v(static_cast<size_t>(n), 0.5f);
    EXPECT_TRUE(write_npy(dir_ / name, shape, v.data()).is_ok());
    return dir_ / name;
  }
  std::string write_labels(const std::string& name, std::vector<int64_t> labels) {
    EXPECT_TRUE(write_npy(dir_ / name, {static_cast<int64_t>(labels.size())}, labels.data()).is_ok());
    return dir_ / name;
  }
};

TEST_F(BadData, WidthThatDoesNotMatchTheModel) {
  std::string msg = message(write_floats("x.npy", {4, 100}), write_labels("y.npy", {0, 1, 2, 3}));
  EXPECT_NE(msg.find("features have shape [4, 100], the model's input 'input' takes [N, 64]"), std::string::npos)
      << msg;
}

TEST_F(BadData, LabelsOutOfRange) {
  std::string msg = message(write_floats("x.npy", {4, 64}), write_labels("y.npy", {0, 1, 10, 3}));
  EXPECT_NE(msg.find("label 10 at row 2 is outside the model's 10 classes [0, 9]"), std::string::npos) << msg;
}

TEST_F(BadData, FloatLabelsForCrossEntropy) {
  std::string msg = message(write_floats("x.npy", {4, 64}), write_floats("y.npy", {4}));
  EXPECT_NE(msg.find("needs integer class labels"), std::string::npos) << msg;
}

TEST_F(BadData, RowCountsDiffer) {
  std::string msg = message(write_floats("x.npy", {4, 64}), write_labels("y.npy", {0, 1, 2}));
  EXPECT_NE(msg.find("has 3 rows but the features have 4"), std::string::npos) << msg;
}

TEST_F(BadData, WrongFeatureDtype) {
  std::vector<int64_t> ints(4 * 64, 1);
  ASSERT_TRUE(write_npy(dir_ / "x.npy", {4, 64}, ints.data()).is_ok());
  std::string msg = message(dir_ / "x.npy", write_labels("y.npy", {0, 1, 2, 3}));
  EXPECT_NE(msg.find("int64"), std::string::npos) << msg;
}

TEST_F(BadData, MseTargetsMustMatchTheOutput) {
  std::string msg = message(write_floats("x.npy", {4, 64}), write_floats("y.npy", {4, 3}), LossKind::kMse);
  EXPECT_NE(msg.find("targets have shape [4, 3], the model's output is [N, 10]"), std::string::npos) << msg;
}

TEST_F(BadData, FewerSamplesThanOneBatch) {
  Result<Dataset> d = load_dataset(write_floats("x.npy", {4, 64}), write_labels("y.npy", {0, 1, 2, 3}), model_.graph,
                                   Targets::kClassIndices);
  ASSERT_TRUE(d.is_ok());
  std::unique_ptr<Backend> backend = make_cpu_backend();
  auto t = Trainer::create(model_.graph, *d, *backend, sgd(8, 1, 1));
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("fewer than one batch of 8"), std::string::npos);
}

}  // namespace
}  // namespace pipeshard
