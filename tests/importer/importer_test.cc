// Tests for the ONNX importer against what PyTorch recorded when it exported each model
// (models/metadata.json): node kinds, output shapes and parameter counts for every model
// (one test case per model), then the specific forms each model exists to exercise.
#include "importer/onnx_importer.h"

#include <gtest/gtest.h>
#include <onnx/onnx_pb.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::source_path;

struct ModelCase {
  std::string file;     // "simple.onnx", relative to models/
  nlohmann::json meta;  // its models/metadata.json entry
};

// gtest prints the parameter in failure messages: the file name is enough.
void PrintTo(const ModelCase& c, std::ostream* os) { *os << c.file; }

nlohmann::json load_metadata() {
  std::ifstream in(source_path("models/metadata.json"));
  if (!in) return nlohmann::json::object();
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

std::vector<ModelCase> model_cases() {
  std::vector<ModelCase> cases;
  const nlohmann::json meta = load_metadata();
  if (!meta.is_object()) return cases;
  for (auto it = meta.begin(); it != meta.end(); ++it) cases.push_back({it.key(), it.value()});
  return cases;
}

Graph import_model(const std::string& file) {
  Result<ImportedModel> m = import_onnx_file(source_path("models/" + file));
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  return m.is_ok() ? std::move(m->graph) : Graph{};
}

// The metadata's shape ["batch", 10] as a Graph Shape [kBatch, 10].
std::vector<int64_t> metadata_dims(const nlohmann::json& shape) {
  std::vector<int64_t> dims;
  for (const auto& d : shape) dims.push_back(d.is_string() ? kBatch : d.get<int64_t>());
  return dims;
}

bool owns_parameters(const Node& n) {
  return n.kind == OpKind::kLinear || n.kind == OpKind::kLayerNorm || n.kind == OpKind::kBatchNorm;
}

// PyTorch's module type for a parameter-owning node kind, as metadata "layers" names it.
std::string torch_module_type(const Node& n) {
  switch (n.kind) {
    case OpKind::kLinear: return "Linear";
    case OpKind::kLayerNorm: return "LayerNorm";
    case OpKind::kBatchNorm: return "BatchNorm1d";
    default: return op_kind_name(n);
  }
}

// The k-th node (0-based) of `kind`, or nullptr.
const Node* nth_node(const Graph& g, OpKind kind, int k) {
  for (const Node& n : g.nodes) {
    if (n.kind == kind && k-- == 0) return &n;
  }
  return nullptr;
}

int count_nodes(const Graph& g, OpKind kind) {
  int c = 0;
  for (const Node& n : g.nodes) c += n.kind == kind;
  return c;
}

// ---- Every model against its metadata ----------------------------------------------------

class ImporterModelTest : public ::testing::TestWithParam<ModelCase> {};

TEST_P(ImporterModelTest, MatchesTorchMetadata) {
  const ModelCase& c = GetParam();
  Result<ImportedModel> imported = import_onnx_file(source_path("models/" + c.file));
  ASSERT_TRUE(imported.is_ok()) << imported.status().message();
  const Graph& g = imported->graph;
  EXPECT_EQ(g.opset, c.meta["opset"].get<int64_t>());

  // (a) node kinds in order.
  std::vector<std::string> kinds;
  for (const Node& n : g.nodes) kinds.push_back(op_kind_name(n));
  EXPECT_EQ(kinds, c.meta["ir_kinds"].get<std::vector<std::string>>());

  // (b) model inputs and outputs: names and shapes, the batch symbolic.
  ASSERT_EQ(g.inputs.size(), c.meta["inputs"].size());
  for (size_t k = 0; k < g.inputs.size(); ++k) {
    EXPECT_EQ(g.values[g.inputs[k]].name, c.meta["inputs"][k]["name"].get<std::string>());
    EXPECT_EQ(g.values[g.inputs[k]].shape.dims, metadata_dims(c.meta["inputs"][k]["shape"]));
  }
  ASSERT_EQ(g.outputs.size(), c.meta["outputs"].size());
  for (size_t k = 0; k < g.outputs.size(); ++k) {
    const Value& out = g.values[g.outputs[k]];
    EXPECT_EQ(out.name, c.meta["outputs"][k]["name"].get<std::string>());
    EXPECT_EQ(out.shape.dims, metadata_dims(c.meta["outputs"][k]["shape"])) << out.shape.to_string();
  }

  // (c) parameters per layer. Metadata counts a shared tensor once, at the first module
  // that uses it; count a Graph param id only the first time it is seen, the same way.
  const nlohmann::json& layers = c.meta["layers"];
  std::set<int> seen;
  size_t k = 0;
  for (const Node& n : g.nodes) {
    if (!owns_parameters(n)) continue;
    int64_t first_use = 0;
    for (int p : g.node_params(n)) {
      if (g.params[p].trainable && seen.insert(p).second) first_use += g.params[p].elements();
    }
    ASSERT_LT(k, layers.size()) << "more parameter-owning nodes than torch layers; extra: " << n.name;
    EXPECT_EQ(torch_module_type(n), layers[k]["type"].get<std::string>()) << "layer " << k << " (" << n.name << ")";
    EXPECT_EQ(first_use, layers[k]["parameters"].get<int64_t>())
        << "layer " << k << " (" << n.name << ", torch module '" << layers[k]["module"].get<std::string>() << "')";
    if (!layers[k].contains("shared")) {
      EXPECT_EQ(g.node_parameter_count(n), first_use) << "layer " << k << " shares nothing";
    }
    ++k;
  }
  EXPECT_EQ(k, layers.size()) << "fewer parameter-owning nodes than torch layers";

  // (d) the total, shared parameters once.
  EXPECT_EQ(g.total_parameter_count(), c.meta["total_parameters"].get<int64_t>());

  // Every Graph parameter is an initializer of the file, under its name and dims, except
  // the copy a BatchNorm statistic gets when the exporter made it an Identity of a
  // trainable initializer: that copy is named after the Identity's output.
  std::set<std::string> identity_outputs;
  for (const auto& node : imported->source->graph().node()) {
    if (node.op_type() == "Identity") identity_outputs.insert(node.output(0));
  }
  for (const Parameter& p : g.params) {
    bool found = false;
    for (const auto& init : c.meta["initializers"]) {
      if (init["name"].get<std::string>() != p.name) continue;
      found = true;
      EXPECT_EQ(p.dims, init["shape"].get<std::vector<int64_t>>()) << p.name;
    }
    if (!found) {
      EXPECT_FALSE(p.trainable) << "parameter '" << p.name << "' is not an initializer of the file";
      EXPECT_TRUE(identity_outputs.count(p.name)) << "parameter '" << p.name << "' is neither an initializer "
                                                  << "nor an Identity output of the file";
    }
    int64_t product = 1;
    for (int64_t d : p.dims) product *= d;
    EXPECT_EQ(p.elements(), product) << p.name;
  }

  // Structure: nodes in topological order, each value produced once, the output last.
  std::vector<bool> ready(g.values.size(), false);
  for (int v : g.inputs) ready[v] = true;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    ASSERT_EQ(n.inputs.size(), n.kind == OpKind::kAdd ? 2u : 1u) << n.name;
    ASSERT_EQ(n.outputs.size(), 1u) << n.name;
    for (int v : n.inputs) EXPECT_TRUE(ready[v]) << n.name << " reads '" << g.values[v].name << "' before it exists";
    EXPECT_FALSE(ready[n.outputs[0]]) << n.name << " redefines '" << g.values[n.outputs[0]].name << "'";
    ready[n.outputs[0]] = true;
    EXPECT_EQ(g.values[n.outputs[0]].producer, static_cast<int>(i)) << n.name;
  }
  ASSERT_FALSE(g.nodes.empty());
  EXPECT_EQ(g.outputs[0], g.nodes.back().outputs[0]);
}

INSTANTIATE_TEST_SUITE_P(AllModels, ImporterModelTest, ::testing::ValuesIn(model_cases()),
                         [](const ::testing::TestParamInfo<ModelCase>& info) {
                           return std::filesystem::path(info.param.file).stem().string();
                         });

TEST(ImporterTest, MetadataCoversEveryModelFile) {
  const nlohmann::json meta = load_metadata();
  ASSERT_TRUE(meta.is_object() && !meta.empty()) << "cannot read models/metadata.json";
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(source_path("models"))) {
    if (entry.path().extension() != ".onnx") continue;
    ++files;
    EXPECT_TRUE(meta.contains(entry.path().filename().string())) << entry.path() << " has no metadata entry";
  }
  EXPECT_EQ(static_cast<size_t>(files), meta.size());
}

// ---- Specific forms -----------------------------------------------------------------------

TEST(ImporterTest, SimpleLayers) {
  const Graph g = import_model("simple.onnx");
  ASSERT_EQ(count_nodes(g, OpKind::kLinear), 3);
  const int64_t expected[] = {25856, 32896, 1290};
  const int64_t widths[][2] = {{100, 256}, {256, 128}, {128, 10}};
  for (int k = 0; k < 3; ++k) {
    const Node& n = *nth_node(g, OpKind::kLinear, k);
    EXPECT_EQ(g.node_parameter_count(n), expected[k]) << n.name;
    EXPECT_EQ(n.in_features, widths[k][0]) << n.name;
    EXPECT_EQ(n.out_features, widths[k][1]) << n.name;
    EXPECT_EQ(n.layout, WeightLayout::kOutIn) << n.name << ": torch's Gemm has transB=1";
    EXPECT_GE(n.bias, 0) << n.name;
  }
  EXPECT_EQ(g.total_parameter_count(), 25856 + 32896 + 1290);
}

TEST(ImporterTest, LinearWithoutBiasIsInOutWithNoBias) {
  const Graph g = import_model("linear_nobias.onnx");
  ASSERT_EQ(count_nodes(g, OpKind::kLinear), 2);
  const int64_t widths[][2] = {{32, 64}, {64, 10}};
  for (int k = 0; k < 2; ++k) {
    const Node& n = *nth_node(g, OpKind::kLinear, k);
    EXPECT_EQ(n.layout, WeightLayout::kInOut) << n.name << ": MatMul's weight is [in, out]";
    EXPECT_EQ(n.bias, -1) << n.name;
    EXPECT_EQ(n.in_features, widths[k][0]);
    EXPECT_EQ(n.out_features, widths[k][1]);
    EXPECT_EQ(g.params[n.weight].dims, (std::vector<int64_t>{widths[k][0], widths[k][1]}));
  }
}

TEST(ImporterTest, MatMulAddBecomesOneLinearOnRank3) {
  const Graph g = import_model("linear_matmul_add.onnx");
  const Node& first = *nth_node(g, OpKind::kLinear, 0);
  EXPECT_EQ(first.layout, WeightLayout::kInOut);
  ASSERT_GE(first.bias, 0);
  EXPECT_EQ(g.params[first.bias].name, "0.bias");
  EXPECT_EQ(first.onnx_nodes.size(), 2u) << "MatMul and Add";
  EXPECT_EQ(g.values[first.outputs[0]].shape.dims, (std::vector<int64_t>{kBatch, 4, 32}));
  const Node& reshape = *nth_node(g, OpKind::kReshape, 0);
  EXPECT_EQ(reshape.target, (std::vector<int64_t>{128}));
}

TEST(ImporterTest, GemmAlphaBetaAndTransB0) {
  const Graph g = import_model("gemm_alpha_beta.onnx");
  const Node& l1 = *nth_node(g, OpKind::kLinear, 0);
  const Node& l2 = *nth_node(g, OpKind::kLinear, 1);
  EXPECT_FLOAT_EQ(l1.alpha, 0.5f);
  EXPECT_FLOAT_EQ(l1.beta, 2.0f);
  EXPECT_EQ(l1.layout, WeightLayout::kOutIn);
  EXPECT_FLOAT_EQ(l2.alpha, 1.0f);
  EXPECT_FLOAT_EQ(l2.beta, 1.0f);
  EXPECT_EQ(l2.layout, WeightLayout::kInOut) << "transB=0";
  EXPECT_EQ(g.params[l2.weight].name, "l2.weight_t");
  EXPECT_EQ(g.params[l2.weight].dims, (std::vector<int64_t>{32, 10}));
  EXPECT_EQ(l2.in_features, 32);
  EXPECT_EQ(l2.out_features, 10);
}

TEST(ImporterTest, SharedWeightIsOneParameter) {
  const Graph g = import_model("shared_weight.onnx");
  ASSERT_EQ(count_nodes(g, OpKind::kLinear), 3);
  const Node& fc1 = *nth_node(g, OpKind::kLinear, 0);
  const Node& fc2 = *nth_node(g, OpKind::kLinear, 1);
  EXPECT_EQ(fc1.weight, fc2.weight) << "fc2 reuses fc1's weight";
  EXPECT_EQ(g.params[fc1.weight].name, "fc1.weight");
  EXPECT_NE(fc1.bias, fc2.bias);
  EXPECT_EQ(g.params[fc2.bias].name, "fc2.bias");
  EXPECT_EQ(g.params.size(), 5u);
  // Per node the shared weight counts for both; in the total once.
  EXPECT_EQ(g.node_parameter_count(fc2), 32 * 32 + 32);
  EXPECT_EQ(g.total_parameter_count(), 1418);
}

TEST(ImporterTest, IdentityInitializerUsesTheSourceTensor) {
  Result<ImportedModel> m = import_onnx_file(source_path("models/identity_initializer.onnx"));
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  const Graph& g = m->graph;
  const Node& second = *nth_node(g, OpKind::kLinear, 1);
  const Parameter& w = g.params[second.weight];
  EXPECT_EQ(w.name, "onnx::Identity_src") << "the initializer behind the Identity, not its output '2.weight'";
  EXPECT_EQ(w.dims, (std::vector<int64_t>{10, 32}));
  EXPECT_EQ(second.layout, WeightLayout::kOutIn);
  EXPECT_EQ(g.params.size(), 4u);
  // Same numbers as the file's initializer.
  const onnx::TensorProto* init = nullptr;
  for (const auto& t : m->source->graph().initializer()) {
    if (t.name() == "onnx::Identity_src") init = &t;
  }
  ASSERT_NE(init, nullptr);
  std::vector<float> file_data(init->float_data().begin(), init->float_data().end());
  if (init->has_raw_data()) {
    file_data.resize(init->raw_data().size() / 4);
    std::memcpy(file_data.data(), init->raw_data().data(), init->raw_data().size());
  }
  EXPECT_EQ(w.data, file_data);
}

TEST(ImporterTest, BatchNormTrainingAndRunningStats) {
  for (const char* file : {"batchnorm_train.onnx", "batchnorm_eval.onnx"}) {
    SCOPED_TRACE(file);
    const Graph g = import_model(file);
    const Node* bn = nth_node(g, OpKind::kBatchNorm, 0);
    ASSERT_NE(bn, nullptr);
    EXPECT_EQ(bn->training, std::string(file) == "batchnorm_train.onnx");
    ASSERT_GE(bn->weight, 0);
    ASSERT_GE(bn->bias, 0);
    ASSERT_GE(bn->running_mean, 0);
    ASSERT_GE(bn->running_var, 0);
    EXPECT_EQ(g.params[bn->weight].name, "1.weight");
    EXPECT_EQ(g.params[bn->running_mean].name, "1.running_mean");
    EXPECT_EQ(g.params[bn->running_var].name, "1.running_var");
    EXPECT_TRUE(g.params[bn->weight].trainable);
    EXPECT_TRUE(g.params[bn->bias].trainable);
    EXPECT_FALSE(g.params[bn->running_mean].trainable);
    EXPECT_FALSE(g.params[bn->running_var].trainable);
    EXPECT_EQ(g.node_parameter_count(*bn), 64) << "running statistics are not parameters";
    EXPECT_FLOAT_EQ(bn->epsilon, 1e-5f);
    EXPECT_NEAR(bn->momentum, 0.9f, 1e-6f) << "torch momentum 0.1 is ONNX momentum 0.9";
  }
}

TEST(ImporterTest, FoldedBatchNormStatisticsGetTheirOwnParameters) {
  // torch folded the fresh running_mean (zeros) and running_var (ones) into Identities of
  // the equal bias and scale; the statistics must not alias the trainable tensors.
  const Graph g = import_model("batchnorm_default_stats.onnx");
  const Node* bn = nth_node(g, OpKind::kBatchNorm, 0);
  ASSERT_NE(bn, nullptr);
  EXPECT_FALSE(bn->training);
  const std::set<int> ids = {bn->weight, bn->bias, bn->running_mean, bn->running_var};
  EXPECT_EQ(ids.size(), 4u) << "four distinct parameters";
  ASSERT_GE(bn->running_mean, 0);
  ASSERT_GE(bn->running_var, 0);
  EXPECT_FALSE(g.params[bn->running_mean].trainable);
  EXPECT_FALSE(g.params[bn->running_var].trainable);
  EXPECT_TRUE(g.params[bn->weight].trainable);
  EXPECT_TRUE(g.params[bn->bias].trainable);
  EXPECT_EQ(g.params[bn->running_mean].data, std::vector<float>(32, 0.0f));
  EXPECT_EQ(g.params[bn->running_var].data, std::vector<float>(32, 1.0f));
  EXPECT_EQ(g.node_parameter_count(*bn), 64);
  EXPECT_EQ(g.total_parameter_count(), 938);
}

TEST(ImporterTest, DropoutTrainingAndRatio) {
  const Graph train = import_model("dropout_train.onnx");
  const Node* d = nth_node(train, OpKind::kDropout, 0);
  ASSERT_NE(d, nullptr);
  EXPECT_TRUE(d->training);
  EXPECT_NEAR(d->ratio, 0.1f, 1e-6f);

  const Graph eval = import_model("dropout_eval.onnx");
  ASSERT_EQ(count_nodes(eval, OpKind::kDropout), 2);
  EXPECT_FALSE(nth_node(eval, OpKind::kDropout, 0)->training);
  EXPECT_FALSE(nth_node(eval, OpKind::kDropout, 1)->training);
  EXPECT_NEAR(nth_node(eval, OpKind::kDropout, 1)->ratio, 0.1f, 1e-6f) << "ratio from a Constant input";
}

TEST(ImporterTest, ExternalDataLoadsTheSameWeightsAsSimple) {
  const Graph simple = import_model("simple.onnx");
  const Graph external = import_model("external_data.onnx");
  ASSERT_EQ(external.params.size(), simple.params.size());
  ASSERT_EQ(external.params.size(), 6u);
  for (size_t p = 0; p < simple.params.size(); ++p) {
    EXPECT_EQ(external.params[p].name, simple.params[p].name);
    EXPECT_EQ(external.params[p].dims, simple.params[p].dims) << simple.params[p].name;
    EXPECT_TRUE(external.params[p].data == simple.params[p].data) << simple.params[p].name << ": data differs";
  }
}

TEST(ImporterTest, ResidualAddReadsInputAndSecondLinear) {
  const Graph g = import_model("residual.onnx");
  const Node* add = nth_node(g, OpKind::kAdd, 0);
  ASSERT_NE(add, nullptr);
  const Node& fc2 = *nth_node(g, OpKind::kLinear, 1);
  ASSERT_EQ(add->inputs.size(), 2u);
  ASSERT_EQ(g.inputs.size(), 1u);
  const std::multiset<int> read(add->inputs.begin(), add->inputs.end());
  EXPECT_EQ(read, (std::multiset<int>{g.inputs[0], fc2.outputs[0]}));
  const Node& head = *nth_node(g, OpKind::kLinear, 2);
  EXPECT_EQ(head.inputs[0], add->outputs[0]);
  // The model input feeds both fc1 and the Add.
  EXPECT_EQ(g.values[g.inputs[0]].consumers.size(), 2u);
}

TEST(ImporterTest, LayerNormFormsAgree) {
  for (const char* file : {"layernorm_decomposed.onnx", "layernorm_op17.onnx", "layernorm_opset18.onnx"}) {
    SCOPED_TRACE(file);
    const Graph g = import_model(file);
    ASSERT_EQ(count_nodes(g, OpKind::kLayerNorm), 1);
    const Node& ln = *nth_node(g, OpKind::kLayerNorm, 0);
    EXPECT_NEAR(ln.epsilon, 1e-5f, 1e-12f);
    ASSERT_GE(ln.weight, 0);
    ASSERT_GE(ln.bias, 0);
    EXPECT_EQ(g.params[ln.weight].name, "1.weight");
    EXPECT_EQ(g.params[ln.bias].name, "1.bias");
    EXPECT_EQ(g.params[ln.weight].dims, (std::vector<int64_t>{32}));
    EXPECT_EQ(g.params[ln.bias].dims, (std::vector<int64_t>{32}));
    EXPECT_TRUE(g.params[ln.weight].trainable);
    EXPECT_EQ(ln.axis, 1) << "normalised to the last axis of [batch, 32]";
    EXPECT_EQ(g.values[ln.inputs[0]].shape.dims, (std::vector<int64_t>{kBatch, 32}));
  }
}

TEST(ImporterTest, ActivationAttributes) {
  const Graph g = import_model("activations.onnx");
  const Node* leaky = nth_node(g, OpKind::kActivation, 0);
  ASSERT_NE(leaky, nullptr);
  EXPECT_EQ(leaky->activation, ActivationKind::kLeakyRelu);
  EXPECT_NEAR(leaky->alpha, 0.2f, 1e-6f);

  const Graph sm = import_model("softmax.onnx");
  EXPECT_EQ(nth_node(sm, OpKind::kSoftmax, 0)->axis, 1);
  const Graph lsm = import_model("logsoftmax.onnx");
  EXPECT_EQ(nth_node(lsm, OpKind::kLogSoftmax, 0)->axis, 1);
}

TEST(ImporterTest, FlattenAndReshapeKeepTheBatch) {
  for (const char* file : {"flatten.onnx", "reshape.onnx"}) {
    SCOPED_TRACE(file);
    const Graph g = import_model(file);
    const Node& r = *nth_node(g, OpKind::kReshape, 0);
    EXPECT_EQ(r.target, (std::vector<int64_t>{64}));
    EXPECT_EQ(g.values[r.outputs[0]].shape.dims, (std::vector<int64_t>{kBatch, 64}));
  }
}

}  // namespace
}  // namespace pipeshard
