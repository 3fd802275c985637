// Stages that hold several model chunks (interleaved and V schedules) train what one
// process trains. Two schedules registered here for the purpose, whose orders are simple
// enough to check by eye, exercise what such schedules need of the runtime, apart from
// any particular order:
// - "looped": v chunks per stage placed round robin (chunk c on stage c mod P), every
//   forward of each chunk in turn, then every backward, the last chunk's first: transfers
//   between the same two stages for several chunks;
// - "v-split": two chunks per stage in a V (stage r holds chunks r and 2P − 1 − r), the
//   backward split into I and W with all W's last: the turn of the V inside one stage,
//   the loss computed on stage 0, deferred weight gradients of two chunks at once.
// On a model of eight Linear layers with a residual connection over two of them, each is
// checked for P = 2, 3, 4 (up to eight chunks), with two replicas and with two tensor-
// parallel shards: bit for bit the 1F1B run of P·v stages (the same cuts, each chunk a
// stage of its own) without clipping, and within --check-equivalence's 1e-5 of one
// process with it. The built-in rows (interleaved, zb-v) resume checkpoints across
// layouts, and their stages hold the memory the estimate says.
#include <algorithm>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <utility>

#include <gtest/gtest.h>

#include "importer/onnx_importer.h"
#include "schedule/registry.h"
#include "tests/layout_training.h"
#include "tests/model_builder.h"

namespace pipeshard {
namespace {

constexpr int64_t kFeatures = 16, kClasses = 10, kBatch = 48;

ImportedModel eight_layers() {
  testing::ModelBuilder b(kFeatures);
  std::string x = b.relu(b.linear("input", kFeatures, 32));
  for (int layer = 1; layer < 7; ++layer) {
    const std::string in = x;
    x = b.relu(b.linear(x, 32, 32));
    if (layer == 3) x = b.add(b.linear(b.relu(b.linear(x, 32, 32)), 32, 32), in);  // a residual over two
  }
  b.output(b.linear(x, 32, kClasses), kClasses);
  auto proto = std::make_shared<onnx::ModelProto>(b.model());
  Result<ImportedModel> m = import_onnx_model(proto, ".", "eight_layers");
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  return std::move(m).value();
}

Action act(ActionKind kind, int k, int j) { return {kind, k, j}; }

// Every forward of chunk 0, then of chunk 1, ...; then every backward of the last chunk,
// ..., of chunk 0; `split`: I's first, then the W's in the same order.
ComputeOrder chunk_by_chunk(int stages, int micro_batches, int chunks, bool split) {
  ComputeOrder order(stages);
  for (auto& list : order) {
    for (int j = 0; j < chunks; ++j)
      for (int k = 0; k < micro_batches; ++k) list.push_back(act(ActionKind::kForward, k, j));
    for (int j = chunks; j-- > 0;) {
      for (int k = 0; k < micro_batches; ++k)
        list.push_back(act(split ? ActionKind::kBackwardInput : ActionKind::kBackward, k, j));
    }
    for (int j = chunks; split && j-- > 0;)
      for (int k = 0; k < micro_batches; ++k) list.push_back(act(ActionKind::kBackwardWeight, k, j));
  }
  return order;
}

ScheduleInfo looped_row() {
  ScheduleInfo row;
  row.name = "looped";
  row.title = "Looped";
  row.summary = "test: two chunks per stage, round robin, chunk by chunk";
  row.chunks_per_stage = 2;
  row.build = [](int p, int m, int v) { return chunk_by_chunk(p, m, v, false); };
  row.in_flight = [](int, int m, int, int v) { return v * m; };
  row.bubble = [](int, int, int) { return 0.0; };
  return row;
}

ScheduleInfo v_split_row() {
  ScheduleInfo row = looped_row();
  row.name = "v-split";
  row.title = "V split";
  row.summary = "test: two chunks per stage in a V, backward split, W's last";
  row.placement = [](int p, int) {
    std::vector<int> stage_of;
    for (int c = 0; c < 2 * p; ++c) stage_of.push_back(c < p ? c : 2 * p - 1 - c);
    return stage_of;
  };
  row.build = [](int p, int m, int v) { return chunk_by_chunk(p, m, v, true); };
  return row;
}

class ChunkedStages : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    looped_ = new ScheduleRegistration(looped_row());
    v_split_ = new ScheduleRegistration(v_split_row());
  }
  static void TearDownTestSuite() {
    delete looped_;
    delete v_split_;
  }

  void SetUp() override {
    model_ = eight_layers();
    data_ = testing::random_classes(kFeatures, 192, 11);
  }

  static TrainConfig config(const std::string& schedule, int micro_batches, bool clip) {
    TrainConfig c = testing::adamw_config(schedule, micro_batches, kBatch);
    if (!clip) c.clip_grad_norm = 0;
    return c;
  }

  // `schedule` on P stages × `replicas` × `shards` at M micro-batches: bitwise 1F1B on 2P
  // stages without clipping, within 1e-5 of one process with it.
  void check(const std::string& schedule, int stages, int replicas, int shards, int micro_batches) {
    SCOPED_TRACE(schedule + " P" + std::to_string(stages) + " D" + std::to_string(replicas) + " T" +
                 std::to_string(shards) + " M" + std::to_string(micro_batches));
    const int ranks = stages * replicas * shards;
    const testing::Trained flat =
        testing::train_layout(model_, data_, config("1f1b", micro_batches, false), 2 * ranks, 2 * stages, shards);
    const testing::Trained chunked =
        testing::train_layout(model_, data_, config(schedule, micro_batches, false), ranks, stages, shards);
    testing::expect_bitwise(chunked, flat);
    const testing::Trained alone = testing::train_alone(model_, data_, config("1f1b", 1, true));
    const testing::Trained clipped =
        testing::train_layout(model_, data_, config(schedule, micro_batches, true), ranks, stages, shards);
    testing::expect_equivalent(clipped, alone, model_.graph);
  }

  static ScheduleRegistration* looped_;
  static ScheduleRegistration* v_split_;
  ImportedModel model_;
  Dataset data_;
};

ScheduleRegistration* ChunkedStages::looped_ = nullptr;
ScheduleRegistration* ChunkedStages::v_split_ = nullptr;

TEST_F(ChunkedStages, RoundRobinChunksTrainTheOneProcessModel) {
  for (int stages = 2; stages <= 4; ++stages) check("looped", stages, 1, 1, stages);
  check("looped", 2, 1, 1, 4);
}

TEST_F(ChunkedStages, AVTrainsTheOneProcessModel) {
  for (int stages = 2; stages <= 4; ++stages) check("v-split", stages, 1, 1, stages);
  check("v-split", 2, 1, 1, 4);
}

// A checkpoint stores whole tensors by name, whatever the chunks: one taken after 2 steps
// of interleaved on two stages resumes in one process, and one taken in one process
// resumes under zb-v on two stages, each onto the one-process trajectory.
TEST_F(ChunkedStages, CheckpointsResumeAcrossChunkedLayouts) {
  const testing::Trained alone = testing::train_alone(model_, data_, config("1f1b", 1, true));
  for (const auto& [first, second] : {std::pair{"interleaved", "1f1b"}, std::pair{"1f1b", "zb-v"}}) {
    SCOPED_TRACE(std::string(first) + " then " + second);
    testing::ScratchDir dir("chunked-resume");
    const int first_stages = std::string(first) == "1f1b" ? 1 : 2, second_stages = 3 - first_stages;
    TrainConfig before = config(first, first_stages == 1 ? 1 : 4, true);
    before.total_steps = 2;
    testing::train_layout(model_, data_, before, first_stages, first_stages, 1,
                          testing::Checkpointing{"", dir.path(), 2});
    const TrainConfig after = config(second, second_stages == 1 ? 1 : 4, true);
    const testing::Trained resumed = testing::train_layout(model_, data_, after, second_stages, second_stages, 1,
                                                           testing::Checkpointing{dir.path(), "", 0});
    ASSERT_EQ(resumed.losses.size(), 2u);
    testing::Trained tail = alone;
    tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 2);
    const testing::Difference d = testing::difference(resumed, tail);
    EXPECT_LE(d.loss, 1e-5);
    EXPECT_LE(d.weight, 1e-5);
  }
}

// What each stage's program and optimizer hold under interleaved (v = 2, 3) and zb-v, as
// the memory estimate (the schedule's in-flight counts per chunk, summed over the stage's
// chunks) says: never under, at most 10% over (shared buffers counted per chunk).
TEST_F(ChunkedStages, StagesHoldWhatTheEstimateSays) {
  struct Case {
    const char* schedule;
    int stages, virtual_stages, micro_batches;
  };
  for (const Case& c : {Case{"interleaved", 2, 2, 4}, Case{"interleaved", 2, 3, 4}, Case{"interleaved", 3, 2, 6},
                        Case{"zb-v", 2, 0, 4}, Case{"zb-v", 3, 0, 6}}) {
    SCOPED_TRACE(std::string(c.schedule) + " P" + std::to_string(c.stages) + " v" + std::to_string(c.virtual_stages) +
                 " M" + std::to_string(c.micro_batches));
    TrainConfig cfg = config(c.schedule, c.micro_batches, true);
    cfg.virtual_stages = c.virtual_stages;
    std::mutex mu;
    run_ranks(c.stages, [&](Communicator& world) {
      ProcessGroups groups = make_layout_groups(world, c.stages, 1);
      std::unique_ptr<Backend> backend = make_cpu_backend();
      const Parallel parallel{&world, &groups, &model_, nullptr};
      Result<std::unique_ptr<Trainer>> t = Trainer::create(model_.graph, data_, *backend, cfg, parallel);
      ASSERT_TRUE(t.is_ok()) << t.status().message();
      const Trainer::Memory m = (*t)->memory();
      const int64_t held = m.program.total() + m.optimizer;
      const int stage = groups.layout.stage;
      const int64_t estimate = Trainer::memory_per_stage(model_.graph, cfg, groups.layout, *backend)[stage];
      std::lock_guard<std::mutex> lock(mu);
      std::printf("%s P%d v%d M%d stage %d: holds %lld bytes, estimate %lld\n", c.schedule, c.stages, c.virtual_stages,
                  c.micro_batches, stage, static_cast<long long>(held), static_cast<long long>(estimate));
      EXPECT_GE(estimate, held - 8) << "stage " << stage;
      EXPECT_LE(estimate, held + held / 10) << "stage " << stage;
    });
  }
}

TEST_F(ChunkedStages, WithReplicasAndWithShards) {
  for (const char* schedule : {"looped", "v-split"}) {
    check(schedule, 2, 2, 1, 2);
    check(schedule, 2, 1, 2, 2);
  }
}

}  // namespace
}  // namespace pipeshard
