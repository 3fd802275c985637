// Stage files, end to end: for every model in models/, the files `partition` writes are
// valid ONNX, hold only their own initializers, and run one after another give the
// full model's outputs — checked with our reference evaluator and, independently, with
// onnxruntime. Tensor-parallel shard files are run together by a small simulator that
// performs their AllReduce/AllGather nodes, and must give the full model's outputs too.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include <gtest/gtest.h>
#include <onnx/checker.h>

#include "importer/onnx_importer.h"
#include "importer/onnx_writer.h"
#include "partitioner/plan.h"
#include "partitioner/stage_writer.h"
#include "testing/reference_forward.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

namespace fs = std::filesystem;
using testing::model_names;
using testing::quote;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

std::map<std::string, HostTensor> random_inputs(const Graph& g, int64_t batch, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::map<std::string, HostTensor> in;
  for (int v : g.inputs) {
    HostTensor t;
    t.dims = g.values[v].shape.dims;
    t.dims[0] = batch;
    int64_t n = 1;
    for (int64_t d : t.dims) n *= d;
    t.data.resize(static_cast<size_t>(n));
    for (float& x : t.data) x = normal(rng);
    in[g.values[v].name] = t;
  }
  return in;
}

// Largest |a-b| / (1 + |b|) over every model output.
double output_difference(const Graph& g, const std::map<std::string, HostTensor>& want,
                         const std::map<std::string, HostTensor>& got) {
  double worst = 0.0;
  for (int v : g.outputs) {
    const std::string& name = g.values[v].name;
    auto w = want.find(name), o = got.find(name);
    if (o == got.end()) return INFINITY;
    EXPECT_EQ(w->second.dims, o->second.dims) << name;
    for (size_t i = 0; i < w->second.data.size(); ++i) {
      worst = std::max(worst, std::fabs(static_cast<double>(w->second.data[i]) - o->second.data[i]) /
                                  (1.0 + std::fabs(w->second.data[i])));
    }
  }
  return worst;
}

ImportedModel import_or_die(const std::string& path) {
  Result<ImportedModel> m = import_onnx_file(path);
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  return std::move(m).value();
}

// Runs `stage` (one imported file per tensor-parallel rank) on the values in `env`,
// adding its outputs. Ranks run in lockstep node by node; AllReduce sums the ranks'
// partial results (then adds the bias), AllGather concatenates their last dimension.
void run_stage(const std::vector<ImportedModel>& shards, std::map<std::string, HostTensor>& env) {
  const size_t t_count = shards.size();
  std::vector<std::map<std::string, HostTensor>> local(t_count);
  for (size_t t = 0; t < t_count; ++t) {
    const Graph& g = shards[t].graph;
    for (int v : g.inputs) {
      ASSERT_TRUE(env.count(g.values[v].name)) << "stage input " << g.values[v].name << " was never produced";
      local[t][g.values[v].name] = env[g.values[v].name];
    }
    ASSERT_EQ(g.nodes.size(), shards[0].graph.nodes.size()) << "shard files differ in structure";
  }
  const Graph& g0 = shards[0].graph;
  for (size_t i = 0; i < g0.nodes.size(); ++i) {
    std::vector<HostTensor> results(t_count);
    for (size_t t = 0; t < t_count; ++t) {
      const Graph& g = shards[t].graph;
      const Node& n = g.nodes[i];
      std::vector<const HostTensor*> in;
      for (int v : n.inputs) in.push_back(&local[t].at(g.values[v].name));
      if (n.kind == OpKind::kAllReduce || n.kind == OpKind::kAllGather) {
        results[t] = *in[0];  // combined below
      } else {
        results[t] = forward_node(g, n, in);
      }
    }
    const Node& n0 = g0.nodes[i];
    if (n0.kind == OpKind::kAllReduce) {
      ASSERT_EQ(n0.shards, static_cast<int64_t>(t_count));
      HostTensor sum = results[0];
      for (size_t t = 1; t < t_count; ++t)
        for (size_t k = 0; k < sum.data.size(); ++k) sum.data[k] += results[t].data[k];
      if (n0.bias >= 0) {
        const auto& b = g0.params[n0.bias].data;
        for (size_t k = 0; k < sum.data.size(); ++k) sum.data[k] += b[k % b.size()];
      }
      std::fill(results.begin(), results.end(), sum);
    } else if (n0.kind == OpKind::kAllGather) {
      ASSERT_EQ(n0.shards, static_cast<int64_t>(t_count));
      const int64_t w = results[0].dims.back();
      const size_t rows = results[0].data.size() / static_cast<size_t>(w);
      HostTensor cat{results[0].dims, {}};
      cat.dims.back() = w * static_cast<int64_t>(t_count);
      for (size_t r = 0; r < rows; ++r)
        for (size_t t = 0; t < t_count; ++t)
          cat.data.insert(cat.data.end(), results[t].data.begin() + r * w, results[t].data.begin() + (r + 1) * w);
      std::fill(results.begin(), results.end(), cat);
    }
    for (size_t t = 0; t < t_count; ++t) local[t][shards[t].graph.values[n0.outputs[0]].name] = results[t];
  }
  for (const auto& o : shards[0].source->graph().output()) env[o.name()] = local[0].at(o.name());
}

// Partitions `model` with `o` into a scratch folder and checks that the stage files
// chained reproduce the full model. Returns the worst relative difference.
double chained_difference(const std::string& model, const PartitionOptions& o, int64_t inline_limit = kProtobufLimit) {
  ImportedModel full = import_or_die(source_path("models/" + model + ".onnx"));
  Result<Plan> plan = make_plan(full.graph, model, o);
  EXPECT_TRUE(plan.is_ok()) << plan.status().message();
  if (!plan) return INFINITY;
  ScratchDir dir("stages");
  Status written = write_partition(full, *plan, dir.path(), inline_limit);
  EXPECT_TRUE(written.is_ok()) << written.message();
  const auto inputs = random_inputs(full.graph, 5, 7);
  Result<std::map<std::string, HostTensor>> want = run_forward(full.graph, inputs);
  EXPECT_TRUE(want.is_ok()) << want.status().message();
  std::map<std::string, HostTensor> env = inputs;
  for (const StagePlan& s : plan->stages) {
    std::vector<ImportedModel> shards;
    for (const auto& f : s.files) shards.push_back(import_or_die(dir / f));
    run_stage(shards, env);
  }
  return output_difference(full.graph, *want, env);
}

int layer_count(const std::string& model) {
  ImportedModel m = import_or_die(source_path("models/" + model + ".onnx"));
  return layer_of_nodes(m.graph).back() + 1;
}

class EveryModel : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryModel, ChainedStagesEqualTheFullModel) {
  const int layers = layer_count(GetParam());
  for (int stages = 1; stages <= std::min(layers, 4); ++stages) {
    PartitionOptions o;
    o.stages = stages;
    // Same nodes, same order, same arithmetic: the chain is bit-identical.
    EXPECT_EQ(chained_difference(GetParam(), o), 0.0) << "stages=" << stages;
  }
}

TEST_P(EveryModel, StageFilesAreValidAndHoldOnlyTheirOwnInitializers) {
  ImportedModel full = import_or_die(source_path("models/" + GetParam() + ".onnx"));
  PartitionOptions o;
  o.stages = std::min(3, layer_of_nodes(full.graph).back() + 1);
  Result<Plan> plan = make_plan(full.graph, GetParam(), o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  ScratchDir dir("valid");
  ASSERT_TRUE(write_partition(full, *plan, dir.path()).is_ok());
  std::set<std::string> all_initializers;
  for (const auto& t : full.source->graph().initializer()) all_initializers.insert(t.name());
  std::set<std::string> seen;
  for (const StagePlan& s : plan->stages) {
    ImportedModel stage = import_or_die(dir / s.files[0]);
    const onnx::ModelProto& proto = *stage.source;
    // libonnx 1.12's checker knows IR versions up to 8 and opsets up to 17.
    if (full.graph.opset <= 17 && proto.ir_version() <= 8) {
      EXPECT_NO_THROW(onnx::checker::check_model(proto)) << s.files[0];
    }
    std::set<std::string> read;
    for (const auto& n : proto.graph().node())
      for (const auto& in : n.input()) read.insert(in);
    for (const auto& t : proto.graph().initializer()) {
      EXPECT_TRUE(read.count(t.name())) << s.files[0] << " carries unused initializer " << t.name();
      EXPECT_TRUE(all_initializers.count(t.name())) << t.name();
      seen.insert(t.name());
    }
    EXPECT_EQ(stage.graph.total_parameter_count(), s.parameters) << s.files[0];
  }
  EXPECT_EQ(seen, all_initializers) << "every initializer lands in some stage";
}

TEST_P(EveryModel, OnnxRuntimeRunsTheChainedStagesLikeTheFullModel) {
  // Training-mode Dropout draws a random mask in onnxruntime, so for that model the
  // outputs can't be compared: onnxruntime must still load every stage file.
  const bool random = GetParam() == "dropout_train";
  const int layers = layer_count(GetParam());
  for (int stages = 2; stages <= std::min(layers, 3); ++stages) {
    ScratchDir dir("ort");
    const std::string model = source_path("models/" + GetParam() + ".onnx");
    auto part = run_command(quote(tool_path("partition")) + " " + quote(model) + " --stages " + std::to_string(stages) +
                            " --out " + quote(dir.path()));
    ASSERT_EQ(part.exit_code, 0) << part.err;
    auto check = run_command("node " + quote(source_path("tests/ort/chain_check.mjs")) + " --model " + quote(model) +
                             " --plan " + quote(dir / "plan.json") + " --batch 4" + (random ? " --check-only" : ""));
    EXPECT_EQ(check.exit_code, 0) << check.out << check.err;
    EXPECT_NE(check.out.find("\"ok\":true"), std::string::npos) << check.out;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, EveryModel, ::testing::ValuesIn(model_names()),
                         [](const auto& info) { return info.param; });

struct ShardCase {
  std::string model;
  int stages;
  int tensor_parallel;
  int64_t min_shard_parameters;
};

class TensorParallelShards : public ::testing::TestWithParam<ShardCase> {};

TEST_P(TensorParallelShards, ShardsRunTogetherEqualTheFullModel) {
  const ShardCase& c = GetParam();
  PartitionOptions o;
  o.stages = c.stages;
  o.tensor_parallel = c.tensor_parallel;
  o.min_shard_parameters = c.min_shard_parameters;
  // Sums split across shards round differently: agree to float precision.
  EXPECT_LT(chained_difference(c.model, o), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Models, TensorParallelShards,
                         ::testing::Values(ShardCase{"simple", 1, 2, 65536}, ShardCase{"simple", 1, 2, 0},
                                           ShardCase{"simple", 2, 2, 0}, ShardCase{"pipeline_parallel", 1, 4, 65536},
                                           ShardCase{"pipeline_parallel", 2, 2, 0}, ShardCase{"residual", 1, 2, 0},
                                           ShardCase{"gelu_erf", 1, 2, 0}, ShardCase{"gelu_tanh", 1, 2, 0},
                                           ShardCase{"silu", 1, 2, 0}, ShardCase{"activations", 2, 2, 0},
                                           ShardCase{"layernorm_decomposed", 1, 2, 0},
                                           ShardCase{"linear_matmul_add", 1, 2, 0}, ShardCase{"linear_nobias", 1, 2, 0},
                                           ShardCase{"gemm_alpha_beta", 1, 2, 0}, ShardCase{"dropout_eval", 1, 2, 0},
                                           ShardCase{"batchnorm_eval", 1, 2, 0}),
                         [](const auto& info) {
                           return info.param.model + "_p" + std::to_string(info.param.stages) + "_t" +
                                  std::to_string(info.param.tensor_parallel) +
                                  (info.param.min_shard_parameters ? "" : "_all");
                         });

// A stage too large for one protobuf message (protobuf's limit is 2 GiB; here 2 KiB)
// keeps its weights in <stage file>.data beside it, where pipeshard and onnxruntime read
// them: the chained stages are still the full model, bit for bit.
TEST(StageFiles, LargeStagesKeepTheirWeightsInExternalData) {
  PartitionOptions o;
  o.stages = 2;
  EXPECT_EQ(chained_difference("simple", o, 2048), 0.0);
  const std::string model = source_path("models/simple.onnx");
  ImportedModel full = import_or_die(model);
  Result<Plan> plan = make_plan(full.graph, "simple", o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  ScratchDir dir("external");
  ASSERT_TRUE(write_partition(full, *plan, dir.path(), 2048).is_ok());
  for (const StagePlan& s : plan->stages) {
    const std::filesystem::path file = dir / s.files[0];
    EXPECT_LE(std::filesystem::file_size(file), 2048u) << file;
    ASSERT_TRUE(std::filesystem::exists(file.string() + ".data")) << file;
    ImportedModel stage = import_or_die(file);
    EXPECT_EQ(stage.graph.total_parameter_count(), s.parameters) << file;
  }
  auto check = run_command("node " + quote(source_path("tests/ort/chain_check.mjs")) + " --model " + quote(model) +
                           " --plan " + quote(dir / "plan.json") + " --batch 4");
  EXPECT_EQ(check.exit_code, 0) << check.out << check.err;
  EXPECT_NE(check.out.find("\"ok\":true"), std::string::npos) << check.out;
}

TEST(StageFiles, FailureWritesNothing) {
  ImportedModel full = import_or_die(source_path("models/gemm_alpha_beta.onnx"));
  PartitionOptions o;
  o.tensor_parallel = 2;
  o.min_shard_parameters = 0;
  // Make building a stage file fail: mark the Gemm with beta = 2 row-parallel, which
  // the stage writer refuses. Nothing may be written, not even the folder.
  Result<Plan> plan = make_plan(full.graph, "m", o);
  ASSERT_TRUE(plan.is_ok());
  Plan broken = *plan;
  for (auto& s : broken.stages)
    for (size_t i = 0; i < s.nodes.size(); ++i)
      if (full.graph.nodes[s.nodes[i]].kind == OpKind::kLinear && full.graph.nodes[s.nodes[i]].beta != 1.0f)
        s.roles[i] = ShardRole::kRow;
  ScratchDir dir("nothing");
  const std::string out = dir / "out";
  Status st = write_partition(full, broken, out);
  EXPECT_FALSE(st.is_ok());
  EXPECT_FALSE(fs::exists(out)) << "a failed partition must not leave files behind";
}

}  // namespace
}  // namespace pipeshard
