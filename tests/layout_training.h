// Training a parallel layout inside one test process: every rank a thread on the
// in-process communicator (testing/in_process_comm.h), each with a CPU backend of its own,
// and comparing what it trained with another layout or with one process, bit for bit or
// by --check-equivalence's measure.
#ifndef PIPESHARD_TESTS_LAYOUT_TRAINING_H_
#define PIPESHARD_TESTS_LAYOUT_TRAINING_H_

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/trainer.h"
#include "testing/in_process_comm.h"
#include "tests/test_util.h"

namespace pipeshard::testing {

struct Trained {
  std::vector<double> losses;  // per step, as rank 0 reports them
  Graph weights;               // the whole trained model
  std::vector<int64_t> peaks;  // [world rank] the most bytes its backend held at once
  // [world rank] the bytes of its program's activations and their gradients (kept for
  // backward in every slot, saved tensors, shared working buffers): what a schedule's
  // micro-batches in flight cost, apart from weights and optimizer state.
  std::vector<int64_t> activations;
};

// AdamW with accumulation and clipping, as --check-equivalence runs it in the tests'
// matrix: `steps` steps of `batch_size` samples in `micro_batches` under `schedule`.
inline TrainConfig adamw_config(const std::string& schedule, int micro_batches, int64_t batch_size = 32,
                                int64_t steps = 4) {
  TrainConfig c;
  c.optimizer.kind = OptimizerKind::kAdamW;
  c.optimizer.lr = 0.001f;  // train's defaults for AdamW
  c.optimizer.weight_decay = 0.01f;
  c.batch_size = batch_size;
  c.grad_accum = 2;
  c.total_steps = steps;
  c.clip_grad_norm = 0.5;
  c.micro_batches = micro_batches;
  c.pipeline_schedule = schedule;
  return c;
}

// `samples` samples of `features` normal features (seeded by `seed`), each of the class (of
// ten) whose feature is largest among the first ten: something to learn.
inline Dataset random_classes(int64_t features, int64_t samples = 192, uint32_t seed = 7) {
  Dataset d;
  d.samples = samples;
  d.features_per_sample = features;
  d.targets_per_sample = 1;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x, y;
  for (int64_t i = 0; i < samples * features; ++i) x.push_back(normal(rng));
  for (int64_t i = 0; i < samples; ++i) {
    const float* row = x.data() + i * features;
    y.push_back(static_cast<float>(std::max_element(row, row + 10) - row));
  }
  d.features = Rows::of_floats(std::move(x), features);
  d.targets = Rows::of_floats(std::move(y), 1);
  return d;
}

// Optional checkpoints of train_layout(): resume from `resume_from` before the first step
// (training then runs from the checkpoint's step to config.total_steps), and save into
// `save_to` once `save_after` steps are done.
struct Checkpointing {
  std::string resume_from, save_to;
  int64_t save_after = 0;
};

// config.total_steps steps of `config` on `ranks` in-process ranks cut into `stages` ×
// `shards` (replicas: the rest); rank 0's losses and the whole trained model.
inline Trained train_layout(const ImportedModel& model, const Dataset& data, const TrainConfig& config, int ranks,
                            int stages, int shards, const Checkpointing& checkpoints = {}) {
  Trained result;
  result.peaks.assign(static_cast<size_t>(ranks), 0);
  result.activations.assign(static_cast<size_t>(ranks), 0);
  std::mutex mu;
  run_ranks(ranks, [&](Communicator& world) {
    ProcessGroups groups = make_layout_groups(world, stages, shards);
    std::unique_ptr<Backend> backend = make_cpu_backend();
    const Parallel parallel{&world, &groups, &model, nullptr};
    Result<std::unique_ptr<Trainer>> t = Trainer::create(model.graph, data, *backend, config, parallel);
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    ASSERT_TRUE((*t)->check_links().is_ok());
    if (!checkpoints.resume_from.empty()) {
      ASSERT_TRUE((*t)->load_checkpoint(checkpoints.resume_from).is_ok());
    }
    std::vector<double> losses;
    while ((*t)->steps_done() < config.total_steps) {
      losses.push_back((*t)->step().loss);
      if (!checkpoints.save_to.empty() && (*t)->steps_done() == checkpoints.save_after) {
        ASSERT_TRUE((*t)->save_checkpoint(checkpoints.save_to).is_ok());
      }
    }
    Graph weights = model.graph;
    (*t)->download_parameters(weights);
    std::lock_guard<std::mutex> lock(mu);
    result.peaks[static_cast<size_t>(world.rank())] = backend->memory_use().peak;
    const Program::Memory program = (*t)->memory().program;
    result.activations[static_cast<size_t>(world.rank())] = program.activations + program.activation_gradients;
    if (world.rank() != 0) return;
    result.losses = losses;
    result.weights = weights;
  });
  return result;
}

// The same training in one process, one micro-batch.
inline Trained train_alone(const ImportedModel& model, const Dataset& data, TrainConfig config) {
  config.micro_batches = 1;
  config.pipeline_schedule = "1f1b";
  return train_layout(model, data, config, 1, 1, 1);
}

inline void expect_bitwise(const Trained& a, const Trained& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t s = 0; s < a.losses.size(); ++s) EXPECT_EQ(a.losses[s], b.losses[s]) << "step " << s + 1;
  ASSERT_EQ(a.weights.params.size(), b.weights.params.size());
  for (size_t p = 0; p < a.weights.params.size(); ++p) {
    const auto& x = a.weights.params[p].data;
    const auto& y = b.weights.params[p].data;
    ASSERT_EQ(x.size(), y.size());
    EXPECT_EQ(std::memcmp(x.data(), y.data(), sizeof(float) * x.size()), 0) << a.weights.params[p].name;
  }
}

// --check-equivalence's measure: the largest loss difference relative to the loss, and
// the largest weight difference relative to its tensor's largest value (at least 1).
struct Difference {
  double loss = 0, weight = 0;
};

inline Difference difference(const Trained& layout, const Trained& alone) {
  Difference d;
  EXPECT_EQ(layout.losses.size(), alone.losses.size());
  for (size_t s = 0; s < std::min(layout.losses.size(), alone.losses.size()); ++s) {
    d.loss = std::max(d.loss, std::fabs(layout.losses[s] - alone.losses[s]) / std::fabs(alone.losses[s]));
  }
  EXPECT_EQ(layout.weights.params.size(), alone.weights.params.size());
  for (size_t p = 0; p < std::min(layout.weights.params.size(), alone.weights.params.size()); ++p) {
    const auto& want = alone.weights.params[p].data;
    const auto& got = layout.weights.params[p].data;
    EXPECT_EQ(got.size(), want.size()) << alone.weights.params[p].name;
    float scale = 1.0f;
    for (float v : want) scale = std::max(scale, std::fabs(v));
    for (size_t i = 0; i < std::min(want.size(), got.size()); ++i) {
      d.weight = std::max(d.weight, static_cast<double>(std::fabs(got[i] - want[i]) / scale));
    }
  }
  return d;
}

// Within --check-equivalence's 1e-5 of `alone`, which must have trained away from
// `initial` (the check compares trained weights, not the file's).
inline void expect_equivalent(const Trained& layout, const Trained& alone, const Graph& initial) {
  const Difference d = difference(layout, alone);
  EXPECT_LE(d.loss, 1e-5);
  EXPECT_LE(d.weight, 1e-5);
  bool moved = false;
  for (size_t p = 0; p < std::min(alone.weights.params.size(), initial.params.size()); ++p) {
    moved = moved || alone.weights.params[p].data != initial.params[p].data;
  }
  EXPECT_TRUE(moved);
}

}  // namespace pipeshard::testing

#endif  // PIPESHARD_TESTS_LAYOUT_TRAINING_H_
