// The Plan on real models: the course's splits, residuals crossing cuts, tensor-parallel
// pairing and its divisibility errors, the memory balance, and the 2000-layer case.
#include <chrono>
#include <cstdio>

#include <gtest/gtest.h>

#include "importer/onnx_importer.h"
#include "partitioner/plan.h"
#include "tests/model_builder.h"
#include "tests/model_util.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::load_model;
using testing::ModelBuilder;
using testing::source_path;

Plan plan_or_die(const Graph& g, PartitionOptions o) {
  Result<Plan> p = make_plan(g, "model", o);
  EXPECT_TRUE(p.is_ok()) << p.status().message();
  return std::move(p).value();
}

std::vector<int64_t> stage_parameters(const Plan& p) {
  std::vector<int64_t> out;
  for (const auto& s : p.stages) out.push_back(s.parameters);
  return out;
}

ImportedModel import_built(ModelBuilder& b) {
  auto proto = std::make_shared<onnx::ModelProto>(b.model());
  Result<ImportedModel> m = import_onnx_model(proto, ".", "built");
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  return std::move(m).value();
}

TEST(Plan, CourseSimpleModel) {
  ImportedModel m = load_model("simple");
  EXPECT_EQ(m.graph.total_parameter_count(), 60042);
  PartitionOptions o;
  o.stages = 2;
  Plan two = plan_or_die(m.graph, o);
  // {25,856 | 32,896 + 1,290}: the bottleneck 34,186 beats {58,752 | 1,290}.
  EXPECT_EQ(stage_parameters(two), (std::vector<int64_t>{25856, 34186}));
  EXPECT_EQ(two.stages[0].outputs.size(), 1u);
  EXPECT_EQ(two.stages[0].activation_bytes_out, 256 * 4);
  o.stages = 3;
  EXPECT_EQ(stage_parameters(plan_or_die(m.graph, o)), (std::vector<int64_t>{25856, 32896, 1290}));
  o.stages = 4;
  Result<Plan> four = make_plan(m.graph, "model", o);
  ASSERT_FALSE(four.is_ok());
  EXPECT_EQ(four.status().message(), "cannot make 4 non-empty stages from 3 layers");
}

TEST(Plan, CoursePipelineParallelModelBeatsTheHandSplit) {
  ImportedModel m = load_model("pipeline_parallel");
  PartitionOptions o;
  o.stages = 2;
  Plan p = plan_or_die(m.graph, o);
  // The course cuts by hand into 183,040 + 34,186; the optimal bottleneck is lower.
  EXPECT_EQ(stage_parameters(p), (std::vector<int64_t>{51712, 165514}));
  EXPECT_LT(std::max(p.stages[0].parameters, p.stages[1].parameters), 183040);
}

TEST(Plan, NoStageIsEverEmpty) {
  for (const char* name : {"simple", "pipeline_parallel", "residual", "flatten", "layernorm_decomposed"}) {
    ImportedModel m = load_model(name);
    const int layers = layer_of_nodes(m.graph).back() + 1;
    for (int p = 1; p <= layers; ++p) {
      PartitionOptions o;
      o.stages = p;
      Plan plan = plan_or_die(m.graph, o);
      for (const auto& s : plan.stages) {
        EXPECT_FALSE(s.nodes.empty()) << name << " stages=" << p;
        EXPECT_LT(s.first_layer, s.end_layer);
      }
    }
  }
}

TEST(Plan, ResidualCrossingSeveralCutsIsCarried) {
  // input -> fc0 -> relu -> fc1 -> relu -> fc2 -> (+ fc0's output) -> fc3
  ModelBuilder b(16);
  std::string h0 = b.linear("input", 16, 16);
  std::string h = b.relu(b.linear(b.relu(h0), 16, 16));
  std::string y = b.linear(b.add(b.linear(h, 16, 16), h0), 16, 4);
  b.output(y, 4);
  ImportedModel m = import_built(b);
  PartitionOptions o;
  o.stages = 4;
  Plan p = plan_or_die(m.graph, o);
  // fc0's output is made in stage 0, read in stage 2: it crosses two cuts and
  // passes through stage 1.
  ASSERT_EQ(p.stages.size(), 4u);
  auto has = [](const std::vector<TensorSpec>& v, const std::string& n) {
    return std::any_of(v.begin(), v.end(), [&](const TensorSpec& s) { return s.name == n; });
  };
  EXPECT_TRUE(has(p.stages[0].outputs, h0));
  EXPECT_TRUE(has(p.stages[1].carried, h0));
  EXPECT_FALSE(has(p.stages[1].inputs, h0));
  EXPECT_TRUE(has(p.stages[2].inputs, h0));
  EXPECT_EQ(p.stages[1].activation_bytes_out, 2 * 16 * 4);  // its own output and the carried one
}

TEST(Plan, TensorParallelPairsLinearsMegatronStyle) {
  ImportedModel m = load_model("simple");
  PartitionOptions o;
  o.tensor_parallel = 2;
  Plan p = plan_or_die(m.graph, o);
  ASSERT_EQ(p.stages.size(), 1u);
  // Linear(100,256) column, ReLU on shards, Linear(256,128) row; ReLU and the small
  // unpaired Linear(128,10) replicated.
  std::vector<ShardRole> want = {ShardRole::kColumn, ShardRole::kShardLocal, ShardRole::kRow, ShardRole::kReplicated,
                                 ShardRole::kReplicated};
  EXPECT_EQ(p.stages[0].roles, want);
  EXPECT_EQ(p.stages[0].files, (std::vector<std::string>{"stage_0_tp0.onnx", "stage_0_tp1.onnx"}));
  // A big enough unpaired Linear is column-split and gathered.
  o.min_shard_parameters = 1000;
  EXPECT_EQ(plan_or_die(m.graph, o).stages[0].roles.back(), ShardRole::kColumnGather);
}

// Tied weights stay whole: the two Linears sharing one weight would need the same slice
// of it, while a pair's halves take different ones (review: they made stage files that
// did not import).
TEST(Plan, TensorParallelNeverSplitsASharedWeight) {
  ImportedModel m = load_model("shared_weight");
  PartitionOptions o;
  o.tensor_parallel = 2;
  o.min_shard_parameters = 0;
  const Plan p = plan_or_die(m.graph, o);
  int tied = 0;
  for (size_t i = 0; i < p.stages[0].nodes.size(); ++i) {
    const Node& n = m.graph.nodes[p.stages[0].nodes[i]];
    if (n.kind != OpKind::kLinear) continue;
    int users = 0;
    for (const Node& other : m.graph.nodes) users += other.weight == n.weight;
    if (users < 2) continue;
    ++tied;
    EXPECT_EQ(p.stages[0].roles[i], ShardRole::kReplicated) << n.name;
  }
  EXPECT_EQ(tied, 2);
}

TEST(Plan, TensorParallelWidthMustDivide) {
  ImportedModel m = load_model("simple");
  PartitionOptions o;
  o.tensor_parallel = 3;
  Result<Plan> p = make_plan(m.graph, "model", o);
  ASSERT_FALSE(p.is_ok());
  EXPECT_NE(p.status().message().find("node '/0/Gemm' (Linear): 256 output features do not divide into 3"),
            std::string::npos)
      << p.status().message();
}

TEST(Plan, StagesAndTensorParallelCombine) {
  ImportedModel m = load_model("pipeline_parallel");
  PartitionOptions o;
  o.stages = 2;
  o.tensor_parallel = 2;
  Plan p = plan_or_die(m.graph, o);
  ASSERT_EQ(p.stages.size(), 2u);
  // Stage 1 holds Linear(512,256) ReLU Linear(256,128) ReLU Linear(128,10): one pair.
  EXPECT_EQ(p.stages[1].roles[0], ShardRole::kColumn);
  EXPECT_EQ(p.stages[1].roles[2], ShardRole::kRow);
  EXPECT_EQ(p.stages[1].files.size(), 2u);
}

TEST(Plan, MemoryBalanceMinimisesTheLargestMemoryEstimate) {
  for (const char* name : {"simple", "pipeline_parallel", "residual", "batchnorm_eval"}) {
    ImportedModel m = load_model(name);
    for (int stages = 2; stages <= 3; ++stages) {
      for (const char* schedule : {"1f1b", "gpipe"}) {
        PartitionOptions o;
        o.stages = stages;
        o.schedule = schedule;
        o.batch_size = 512;
        if (stages > layer_of_nodes(m.graph).back() + 1) continue;
        auto largest = [](const Plan& p) {
          int64_t v = 0;
          for (const auto& s : p.stages) v = std::max(v, s.memory_bytes);
          return v;
        };
        const int64_t by_params = largest(plan_or_die(m.graph, o));
        o.balance = BalanceBy::kMemory;
        const Plan by_memory = plan_or_die(m.graph, o);
        EXPECT_LE(largest(by_memory), by_params) << name;
        // The balance is over the per-layer part; the estimate adds each stage's working set.
        for (const auto& s : by_memory.stages) EXPECT_GT(s.memory_bytes, s.cost) << name;
      }
    }
  }
}

// 8 x (Linear(64, 64) + ReLU), the last ReLU's output the model's.
ImportedModel relu_chain() {
  ModelBuilder b(64);
  std::string h = "input";
  for (int i = 0; i < 8; ++i) h = b.relu(b.linear(h, 64, 64));
  b.output(h, 64);
  return import_built(b);
}

TEST(Plan, FirstStageKeepsMoreActivationsUnder1F1B) {
  // Equal layers: under 1F1B stage 0 holds P micro-batches in flight, the last one 1.
  ImportedModel m = relu_chain();
  PartitionOptions o;
  o.stages = 4;
  o.batch_size = 4096;
  Plan p = plan_or_die(m.graph, o);
  EXPECT_GT(p.stages[0].memory_bytes, p.stages[3].memory_bytes);
  o.balance = BalanceBy::kMemory;
  Plan mem = plan_or_die(m.graph, o);
  // Balancing memory gives the first stage fewer layers than the last.
  EXPECT_LT(mem.stages[0].end_layer - mem.stages[0].first_layer, mem.stages[3].end_layer - mem.stages[3].first_layer);
}

// The estimate leaves out what training recomputes in backward, here every ReLU's output
// but the last (the model's output), counting instead the two buffers of one micro-batch
// that hold them in turn.
TEST(Plan, MemoryEstimateLeavesOutRecomputedActivations) {
  ImportedModel m = relu_chain();
  PartitionOptions o;
  o.batch_size = 4096;
  const int64_t recomputed = plan_or_die(m.graph, o).stages[0].memory_bytes;
  o.recompute_activations = false;
  const int64_t kept = plan_or_die(m.graph, o).stages[0].memory_bytes;
  EXPECT_EQ(kept - recomputed, (7 - 2) * 4096 * 64 * 4);
}

// Eight equal layers of 64 x 64 + 64 (4,160 parameters), a bucket each: under ZeRO over D
// replicas the estimate holds 1/D of the optimizer state (stage 1), and of the gradients
// beside two windows of a layer (stage 2); each bucket's tail of under D elements counts on
// every replica. Stage 2 under a split backward (zb-h1) counts the whole gradients, as
// training then runs stage 1; so does a plan whose windows would hold the whole buffer.
TEST(Plan, MemoryEstimateKnowsTheZeroStage) {
  ImportedModel m = relu_chain();
  const int64_t layer = 64 * 64 + 64, params = 8 * layer;
  PartitionOptions o;
  o.bucket_bytes = layer * 4;
  const int64_t plain = plan_or_die(m.graph, o).stages[0].memory_bytes;
  for (int64_t d : {2, 4}) {
    o.zero_replicas = static_cast<int>(d);
    o.zero_stage = 1;
    const int64_t owned = params / d + 8 * (d - 1);  // a tail of 4,160 mod D = 0 still counts D - 1
    EXPECT_EQ(plain - plan_or_die(m.graph, o).stages[0].memory_bytes, 4 * 2 * (params - owned)) << d;
    o.zero_stage = 2;
    EXPECT_EQ(plain - plan_or_die(m.graph, o).stages[0].memory_bytes,
              4 * 2 * (params - owned) + 4 * (params - owned - 2 * layer))
        << d;
    o.schedule = "zb-h1";
    o.stages = 2;
    PartitionOptions one = o;
    one.zero_stage = 1;
    EXPECT_EQ(plan_or_die(m.graph, o).stages[0].memory_bytes, plan_or_die(m.graph, one).stages[0].memory_bytes) << d;
    o.schedule = "1f1b";
    o.stages = 1;
  }
  o.zero_replicas = 2;
  o.bucket_bytes = 4 * layer * 4;  // two buckets of four layers: windows as big as the buffer
  PartitionOptions one = o;
  one.zero_stage = 1;
  EXPECT_EQ(plan_or_die(m.graph, o).stages[0].memory_bytes, plan_or_die(m.graph, one).stages[0].memory_bytes);
}

TEST(Plan, JsonHasTheDocumentedFields) {
  ImportedModel m = load_model("residual");
  PartitionOptions o;
  o.stages = 2;
  nlohmann::json j = plan_to_json(plan_or_die(m.graph, o), m.graph);
  for (const char* key : {"model", "total_parameters", "stages", "tensor_parallel"})
    EXPECT_TRUE(j.contains(key)) << key;
  for (const auto& s : j["stages"]) {
    for (const char* key : {"stage", "parameters", "nodes", "inputs", "outputs", "files"})
      EXPECT_TRUE(s.contains(key)) << key;
    EXPECT_EQ(s["inputs"][0]["shape"][0], "batch");
  }
}

TEST(Plan, TwoThousandLayersIntoSixtyFourStages) {
  ModelBuilder b(16);
  std::string h = "input";
  for (int i = 0; i < 2000; ++i) h = b.relu(b.linear(h, 16, 16));
  b.output(h, 16);
  const auto t0 = std::chrono::steady_clock::now();
  ImportedModel m = import_built(b);
  const auto t1 = std::chrono::steady_clock::now();
  PartitionOptions o;
  o.stages = 64;
  Plan p = plan_or_die(m.graph, o);
  const auto t2 = std::chrono::steady_clock::now();
  ASSERT_EQ(p.stages.size(), 64u);
  // 2000 equal layers: 16 stages of 32 layers and 48 of 31 is optimal.
  int64_t largest = 0;
  for (const auto& s : p.stages) largest = std::max<int64_t>(largest, s.end_layer - s.first_layer);
  EXPECT_EQ(largest, 32);
  std::printf("2000 layers: import %.1f ms, plan into 64 stages %.1f ms\n",
              std::chrono::duration<double, std::milli>(t1 - t0).count(),
              std::chrono::duration<double, std::milli>(t2 - t1).count());
}

}  // namespace
}  // namespace pipeshard
