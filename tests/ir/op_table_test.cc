// The op table (ir/op_table.h) against what the importer, the partitioner and the runtime
// do with each op: every row's facts checked on every model in models/ and on its
// tensor-parallel stage files, the bytes kept for backward against what a Program
// allocates, and what each op's backward reads against what changes its gradients.
#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "comm/comm.h"
#include "importer/onnx_importer.h"
#include "ir/op_table.h"
#include "partitioner/plan.h"
#include "partitioner/stage_writer.h"
#include "program/program.h"
#include "tests/model_util.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::load_model;
using testing::model_names;

constexpr ParamRole kRoles[] = {ParamRole::kWeight, ParamRole::kBias, ParamRole::kRunningMean, ParamRole::kRunningVar};

int64_t value_bytes(const Graph& g, int v) { return 4 * g.values[v].shape.per_sample_elements(); }

bool is_model_output(const Graph& g, int v) {
  return std::find(g.outputs.begin(), g.outputs.end(), v) != g.outputs.end();
}

TEST(OpTable, EveryKindHasOneRowInOrder) {
  std::set<std::string> names;
  for (size_t k = 0; k < op_table().size(); ++k) {
    const OpInfo& row = op_table()[k];
    EXPECT_EQ(static_cast<size_t>(row.kind), k);
    EXPECT_EQ(&op_info(row.kind), &row);
    EXPECT_TRUE(names.insert(row.name).second) << "two rows named " << row.name;
    for (const SavedBuffer& b : saved_buffers(row.kind)) EXPECT_STRNE(b.name, "") << row.name;
  }
  std::set<std::string> activations;
  for (ActivationKind a : kActivationKinds) EXPECT_TRUE(activations.insert(activation_name(a)).second);
}

// The checks every node of an imported graph must pass against its row.
void expect_node_matches_row(const Graph& g, const Node& n, const std::string& where) {
  const OpInfo& row = op_info(n.kind);
  const std::string what = where + ": " + node_label(n);
  EXPECT_EQ(static_cast<int>(n.inputs.size()), row.inputs) << what;
  EXPECT_EQ(n.outputs.size(), 1u) << what;
  EXPECT_STREQ(op_kind_name(n), row.member_name ? row.member_name(n) : row.name) << what;
  for (ParamRole role : kRoles) {
    const int p = node_param(n, role);
    const RoleUse use = row.params[static_cast<int>(role)];
    const std::string r = what + ", role " + std::to_string(static_cast<int>(role));
    if (use == RoleUse::kNone) {
      EXPECT_LT(p, 0) << r;
    }
    if (use == RoleUse::kRequired) {
      EXPECT_GE(p, 0) << r;
    }
    if (p >= 0) {
      const bool statistic = role == ParamRole::kRunningMean || role == ParamRole::kRunningVar;
      EXPECT_EQ(g.params[p].trainable, !statistic) << r;
    }
  }
  // The importer's shapes are the rule's: running it again gives the same. (A resolved
  // Reshape target holds the dims after the batch; as written it starts with the batch.)
  Node copy = n;
  if (n.kind == OpKind::kReshape) copy.target.insert(copy.target.begin(), 0);
  Result<Shape> shape = infer_output_shape(g, copy);
  ASSERT_TRUE(shape.is_ok()) << what << ": " << shape.status().message();
  EXPECT_EQ(shape->dims, g.values[n.outputs[0]].shape.dims) << what;
  EXPECT_EQ(copy.axis, n.axis) << what;
  EXPECT_EQ(copy.target, n.target) << what;
}

// The stage files of `model` for `tensor_parallel` shards in one stage, imported; empty
// when the model does not split that way. `min_shard_parameters` 0 splits every Linear
// without a partner and gathers its output (AllGather).
std::vector<ImportedModel> shard_files(const ImportedModel& model, int tensor_parallel, int64_t min_shard_parameters,
                                       Plan* plan_out = nullptr) {
  PartitionOptions o;
  o.tensor_parallel = tensor_parallel;
  o.min_shard_parameters = min_shard_parameters;
  Result<Plan> plan = make_plan(model.graph, model.path, o);
  if (!plan) return {};
  std::vector<ImportedModel> shards;
  for (int t = 0; t < tensor_parallel; ++t) {
    auto proto = build_stage_model(model, *plan, 0, t);
    EXPECT_TRUE(proto.is_ok()) << proto.status().message();
    if (!proto) return {};
    Result<ImportedModel> m = import_onnx_model(*proto, "", model.path + " shard " + std::to_string(t));
    EXPECT_TRUE(m.is_ok()) << m.status().message();
    if (!m) return {};
    shards.push_back(std::move(*m));
  }
  if (plan_out) *plan_out = std::move(*plan);
  return shards;
}

TEST(OpTable, RowsDescribeEveryNodeOfEveryModelAndShard) {
  std::set<OpKind> seen;
  for (const std::string& name : model_names()) {
    const ImportedModel m = load_model(name);
    for (const Node& n : m.graph.nodes) {
      expect_node_matches_row(m.graph, n, name);
      seen.insert(n.kind);
    }
    for (int64_t min_shard_parameters : {PartitionOptions{}.min_shard_parameters, int64_t{0}}) {
      const std::vector<ImportedModel> shards = shard_files(m, 2, min_shard_parameters);
      for (size_t t = 0; t < shards.size(); ++t) {
        for (const Node& n : shards[t].graph.nodes) {
          expect_node_matches_row(shards[t].graph, n, name + " shard " + std::to_string(t));
          seen.insert(n.kind);
        }
      }
    }
  }
  for (const OpInfo& row : op_table()) EXPECT_TRUE(seen.count(row.kind)) << row.name << " occurs in no model";
}

// What a one-slot Program allocates for activations grows by exactly the bytes per sample
// that the partitioner counts (the inputs, then node_kept_bytes() of every node with
// nothing recomputed) for each sample of max_batch, on top of what the rows save per
// micro-batch (saved_bytes_per_batch(): BatchNorm's statistics).
TEST(OpTable, KeptBytesAreWhatAProgramAllocates) {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  for (const std::string& name : model_names()) {
    const ImportedModel m = load_model(name);
    const Graph& g = m.graph;
    const std::vector<bool> none(g.values.size(), false);
    int64_t per_sample = 0, per_batch = 0;
    for (int v : g.inputs) per_sample += value_bytes(g, v);
    for (const Node& n : g.nodes) {
      per_sample += node_kept_bytes(g, n, none, ShardRole::kReplicated, 1);
      per_batch += saved_bytes_per_batch(g, n);
    }
    for (int64_t batch : {1, 2, 5}) {
      ProgramOptions options;
      options.recompute_activations = false;
      Result<std::unique_ptr<Program>> p = Program::create(g, *backend, batch, options);
      ASSERT_TRUE(p.is_ok()) << name << ": " << p.status().message();
      EXPECT_EQ((*p)->memory().activations, batch * per_sample + per_batch) << name << ", batch " << batch;
    }
  }
}

// Where each node's output lives in a Program: the input's buffer exactly when the row
// says so (kInPlace: when the input, a row-parallel Linear's partial sums, has no other
// reader), on every model and every tensor-parallel shard, which the Program accepts
// (every node it runs on a feature shard is one the row lets run there).
TEST(OpTable, OutputBuffersAndShardsAreWhatAProgramMakes) {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  auto check = [&](const Graph& g, Communicator* tensor, const std::string& where) {
    ProgramOptions options;
    options.recompute_activations = false;
    options.tensor = tensor;
    Result<std::unique_ptr<Program>> p = Program::create(g, *backend, 2, options);
    ASSERT_TRUE(p.is_ok()) << where << ": " << p.status().message();
    for (const Node& n : g.nodes) {
      const int x = n.inputs[0], y = n.outputs[0];
      bool shares = false;
      switch (op_info(n.kind).output) {
        case OutputBuffer::kOwn: shares = false; break;
        case OutputBuffer::kAliasesInput: shares = true; break;
        case OutputBuffer::kInPlace: shares = g.values[x].consumers.size() == 1 && !is_model_output(g, x); break;
      }
      EXPECT_EQ((*p)->value(y) == (*p)->value(x), shares) << where << ": " << node_label(n);
    }
  };
  int sharded_files = 0;
  for (const std::string& name : model_names()) {
    const ImportedModel m = load_model(name);
    check(m.graph, nullptr, name);
    for (int64_t min_shard_parameters : {PartitionOptions{}.min_shard_parameters, int64_t{0}}) {
      Plan plan;
      const std::vector<ImportedModel> shards = shard_files(m, 2, min_shard_parameters, &plan);
      for (size_t t = 0; t < shards.size(); ++t) {
        auto group = make_placeholder_communicator(static_cast<int>(t), 2, "op_table_test");
        check(shards[t].graph, group.get(), name + " shard " + std::to_string(t));
        ++sharded_files;
      }
      // The partitioner puts on a feature shard only what the rows allow there.
      for (const StagePlan& s : plan.stages) {
        for (size_t i = 0; i < s.nodes.size(); ++i) {
          const Node& n = m.graph.nodes[s.nodes[i]];
          if (s.roles[i] == ShardRole::kShardLocal) {
            EXPECT_TRUE(runs_on_feature_shard(n.kind)) << name << ": " << node_label(n);
          }
          if (s.roles[i] != ShardRole::kReplicated && s.roles[i] != ShardRole::kShardLocal) {
            EXPECT_EQ(op_info(n.kind).tensor_parallel, ShardUse::kSplitsWeight) << name << ": " << node_label(n);
          }
        }
      }
    }
  }
  EXPECT_GT(sharded_files, 0);
}

// ---- graphs made by hand, one per row ----

// Builds a Graph node by node, each output's shape by its row's rule.
struct GraphBuilder {
  Graph g;
  int param(std::vector<int64_t> dims, bool trainable) {
    int64_t count = 1;
    for (int64_t d : dims) count *= d;
    std::vector<float> data(static_cast<size_t>(count));
    for (size_t i = 0; i < data.size(); ++i) data[i] = 0.5f + 0.25f * static_cast<float>((i * 7) % 5);
    g.params.push_back(Parameter{std::to_string(g.params.size()), dims, data, trainable});
    return static_cast<int>(g.params.size()) - 1;
  }
  int input(const Shape& shape) {
    g.inputs.push_back(value(shape, -1));
    return g.inputs.back();
  }
  // Appends `n` reading `inputs`; returns its output.
  int node(Node n, const std::vector<int>& inputs) {
    const int id = static_cast<int>(g.nodes.size());
    n.inputs = inputs;
    for (int v : inputs) g.values[v].consumers.push_back(id);
    n.outputs = {value(Shape{}, id)};
    n.name = op_kind_name(n);
    n.name += std::to_string(id);
    Result<Shape> shape = infer_output_shape(g, n);
    EXPECT_TRUE(shape.is_ok()) << shape.status().message();
    if (shape) g.values[n.outputs[0]].shape = *shape;
    g.nodes.push_back(std::move(n));
    return g.nodes.back().outputs[0];
  }
  int value(const Shape& shape, int producer) {
    g.values.push_back(Value{std::to_string(g.values.size()), shape, producer, {}});  // (GCC 12 bug 105329: no "v" + …)
    return static_cast<int>(g.values.size()) - 1;
  }
};

// A node of `kind` for inputs of `width` features, its parameters added to `b`: a Linear
// to 3 features, Dropout and BatchNorm in training, collectives over one rank.
Node example_node(GraphBuilder& b, OpKind kind, int64_t width, ActivationKind activation = ActivationKind::kRelu) {
  Node n;
  n.kind = kind;
  switch (kind) {
    case OpKind::kLinear:
      n.in_features = width;
      n.out_features = 3;
      n.weight = b.param({3, width}, true);
      n.bias = b.param({3}, true);
      break;
    case OpKind::kActivation:
      n.activation = activation;
      n.alpha = 0.1f;
      break;
    case OpKind::kLayerNorm:
      n.weight = b.param({width}, true);
      n.bias = b.param({width}, true);
      break;
    case OpKind::kBatchNorm:
      n.weight = b.param({width}, true);
      n.bias = b.param({width}, true);
      n.running_mean = b.param({width}, false);
      n.running_var = b.param({width}, false);
      n.training = true;
      break;
    case OpKind::kDropout:
      n.ratio = 0.5f;
      n.training = true;
      break;
    case OpKind::kReshape:
      n.axis = 1;
      n.target = {0, -1};
      break;
    case OpKind::kAllReduce: n.bias = b.param({width}, true); break;
    case OpKind::kSoftmax:
    case OpKind::kLogSoftmax:
    case OpKind::kAdd:
    case OpKind::kAllGather: break;
  }
  return n;
}

// A graph of one node per row (and per ActivationKind) reading model inputs of 4 features
// ([batch, 2, 2] for Reshape), its output the model output.
std::vector<Graph> one_node_graphs() {
  std::vector<Graph> graphs;
  for (const OpInfo& row : op_table()) {
    for (ActivationKind a : kActivationKinds) {
      GraphBuilder b;
      const Shape in = row.kind == OpKind::kReshape ? Shape{{kBatch, 2, 2}} : Shape{{kBatch, 4}};
      std::vector<int> inputs;
      for (int k = 0; k < row.inputs; ++k) inputs.push_back(b.input(in));
      b.g.outputs = {b.node(example_node(b, row.kind, 4, a), inputs)};
      graphs.push_back(std::move(b.g));
      if (row.kind != OpKind::kActivation) break;
    }
  }
  return graphs;
}

enum class Change { kNone, kInput, kOutput };

// Every gradient backward makes (inputs', parameters') after a kTrain forward, with x or y
// changed in between.
std::vector<float> gradients_after(const Graph& g, Change change) {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::unique_ptr<Communicator> group = make_single_process_communicator();
  const int64_t batch = 3;
  ProgramOptions options;
  options.input_needs_grad.assign(g.inputs.size(), true);
  options.tensor = group.get();
  Result<std::unique_ptr<Program>> made = Program::create(g, *backend, batch, options);
  EXPECT_TRUE(made.is_ok()) << made.status().message();
  Program& p = **made;
  std::vector<std::vector<float>> inputs;
  std::vector<const float*> host;
  for (size_t k = 0; k < g.inputs.size(); ++k) {
    const int64_t count = batch * g.values[g.inputs[k]].shape.per_sample_elements();
    inputs.emplace_back(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) inputs[k][i] = 0.37f * static_cast<float>((i * 5 + 3 * k) % 11) - 1.7f;
    host.push_back(inputs[k].data());
  }
  p.zero_gradients();
  p.forward(host, batch, Mode::kTrain, 42);
  const Node& n = g.nodes[0];
  if (change != Change::kNone) {
    const int v = change == Change::kInput ? n.inputs[0] : n.outputs[0];
    std::vector<float> values(static_cast<size_t>(batch * g.values[v].shape.per_sample_elements()));
    backend->download(values.data(), p.value(v), static_cast<int64_t>(values.size()));
    for (float& x : values) x = 0.75f - 1.5f * x;
    backend->upload(p.value(v), values.data(), static_cast<int64_t>(values.size()));
  }
  const int64_t out_count = batch * g.values[g.outputs[0]].shape.per_sample_elements();
  std::vector<float> dy(static_cast<size_t>(out_count));
  for (int64_t i = 0; i < out_count; ++i) dy[i] = 0.1f * static_cast<float>(i % 7) - 0.3f;
  backend->upload(p.output_gradient(0), dy.data(), out_count);
  p.backward(batch);
  std::vector<float> grads(static_cast<size_t>(p.trainable_elements()));
  backend->download(grads.data(), p.gradients(), p.trainable_elements());
  for (size_t k = 0; k < g.inputs.size(); ++k) {
    std::vector<float> dx(inputs[k].size());
    backend->download(dx.data(), p.input_gradient(static_cast<int>(k)), static_cast<int64_t>(dx.size()));
    grads.insert(grads.end(), dx.begin(), dx.end());
  }
  return grads;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(OpTable, BackwardReadsWhatTheRowSays) {
  bool some_activation_reads_input = false, some_activation_reads_output = false;
  for (const Graph& g : one_node_graphs()) {
    const Node& n = g.nodes[0];
    const std::vector<float> plain = gradients_after(g, Change::kNone);
    ASSERT_TRUE(same_bits(plain, gradients_after(g, Change::kNone))) << node_label(n) << " is not repeatable";
    const bool input_moves = !same_bits(plain, gradients_after(g, Change::kInput));
    const bool output_moves = !same_bits(plain, gradients_after(g, Change::kOutput));
    if (output_aliases_input(n.kind)) {  // one buffer: changing it must change nothing
      EXPECT_FALSE(input_moves || output_moves) << node_label(n);
      continue;
    }
    if (op_info(n.kind).backward_reads == BackwardReads::kInputAndOutput) {
      // An activation reads x or y, as its kind's derivative needs (Sigmoid and Tanh: y).
      EXPECT_TRUE(input_moves || output_moves) << node_label(n);
      some_activation_reads_input |= input_moves;
      some_activation_reads_output |= output_moves;
      continue;
    }
    EXPECT_EQ(input_moves, backward_reads_input(n.kind)) << node_label(n);
    EXPECT_EQ(output_moves, backward_reads_output(n.kind)) << node_label(n);
  }
  EXPECT_TRUE(some_activation_reads_input);
  EXPECT_TRUE(some_activation_reads_output);
}

// The one-node graphs' saved buffers, as a Program sizes them.
TEST(OpTable, SavedBuffersAreWhatAProgramAllocates) {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::unique_ptr<Communicator> group = make_single_process_communicator();
  for (const Graph& g : one_node_graphs()) {
    const Node& n = g.nodes[0];
    int64_t values = 0;
    for (const Value& v : g.values) values += 4 * v.shape.per_sample_elements();
    if (output_aliases_input(n.kind)) values -= 4 * g.values[n.outputs[0]].shape.per_sample_elements();
    ProgramOptions options;
    options.recompute_activations = false;
    options.tensor = group.get();
    for (int64_t batch : {1, 4}) {
      Result<std::unique_ptr<Program>> p = Program::create(g, *backend, batch, options);
      ASSERT_TRUE(p.is_ok()) << p.status().message();
      int64_t saved = 0;
      for (const SavedBuffer& b : saved_buffers(n.kind)) saved += 4 * saved_elements(g, n, b, batch);
      int64_t scratch = 0;  // AllGather's staging: the group's blocks of its input
      if (n.kind == OpKind::kAllGather) scratch = 4 * batch * g.values[n.inputs[0]].shape.per_sample_elements();
      EXPECT_EQ((*p)->memory().activations, batch * values + saved + scratch) << node_label(n) << ", batch " << batch;
      EXPECT_EQ(saved, batch * saved_bytes_per_sample(g, n) + saved_bytes_per_batch(g, n)) << node_label(n);
    }
  }
}

// Between a column- and a row-parallel Linear (x → Linear → op → Linear → AllReduce, one
// rank's shard of a pair), a Program runs exactly the ops whose row lets them run on a
// feature shard, and refuses the rest.
TEST(OpTable, WhatRunsOnAFeatureShardIsWhatAProgramRunsThere) {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::unique_ptr<Communicator> group = make_placeholder_communicator(0, 2, "op_table_test");
  for (const OpInfo& row : op_table()) {
    if (row.tensor_parallel == ShardUse::kSplitsWeight || row.tensor_parallel == ShardUse::kCombinesShards) continue;
    GraphBuilder b;
    const int x = b.input(Shape{{kBatch, 4}});
    const int column = b.node(example_node(b, OpKind::kLinear, 4), {x});  // 3 of the pair's 6 features
    const int op = b.node(example_node(b, row.kind, 3), std::vector<int>(row.inputs, column));
    Node row_linear = example_node(b, OpKind::kLinear, 3);
    const int partial = b.node(row_linear, {op});
    Node reduce = example_node(b, OpKind::kAllReduce, 3);
    reduce.shards = 2;
    b.g.outputs = {b.node(reduce, {partial})};
    ProgramOptions options;
    options.tensor = group.get();
    Result<std::unique_ptr<Program>> p = Program::create(b.g, *backend, 2, options);
    EXPECT_EQ(p.is_ok(), runs_on_feature_shard(row.kind)) << row.name << ": " << p.status().message();
  }
}

}  // namespace
}  // namespace pipeshard
