// Golden tests of the reference forward pass: every model with a PyTorch reference
// (models/reference/<name>.input.npy -> <name>.output.npy, batch 3) is imported, run on the
// reference input, and compared with PyTorch's output element by element.
//
// Tolerance, per element: |ours - torch| <= 1e-5 + 1e-4 * |torch|. The reference pass
// accumulates in double while PyTorch accumulates in float32, so the two differ by float32
// rounding of sums of up to 512 products (~1e-6 relative on these models); the bound leaves
// an order of magnitude of room, yet catches any wrong layout, scale, epsilon or formula.
// Each test prints the worst difference it saw.
#include "testing/reference_forward.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dataset/npy.h"
#include "importer/onnx_importer.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::source_path;

constexpr double kAbsTolerance = 1e-5;
constexpr double kRelTolerance = 1e-4;

struct ReferenceCase {
  std::string name;  // "simple" for models/simple.onnx
  std::string mode;  // "eval" or "train", as the reference was recorded
};

void PrintTo(const ReferenceCase& c, std::ostream* os) { *os << c.name; }

std::vector<ReferenceCase> reference_cases() {
  std::vector<ReferenceCase> cases;
  std::ifstream in(source_path("models/metadata.json"));
  const nlohmann::json meta = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object()) return cases;
  for (auto it = meta.begin(); it != meta.end(); ++it) {
    const nlohmann::json& ref = it.value()["reference"];
    if (!ref.is_object()) continue;  // e.g. dropout_train: a random mask has no reference
    cases.push_back({std::filesystem::path(it.key()).stem().string(), ref["mode"].get<std::string>()});
  }
  return cases;
}

Result<HostTensor> read_tensor(const std::string& path) {
  Result<NpyArray> a = read_npy(path);
  if (!a) return a.status();
  PIPESHARD_RETURN_IF_ERROR(a->expect_type(NpyType::kFloat32));
  return HostTensor{a->shape, a->as_float()};
}

struct Comparison {
  double worst_abs = 0.0;    // max |ours - torch|
  double worst_ratio = 0.0;  // max |ours - torch| / (abs + rel * |torch|); <= 1 passes
  int64_t worst_at = -1;     // flat index of worst_ratio
  int64_t failures = 0;      // elements outside the tolerance (NaN included)
};

Comparison compare(const std::vector<float>& ours, const std::vector<float>& torch) {
  Comparison c;
  for (size_t i = 0; i < ours.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(ours[i]) - torch[i]);
    const double ratio = diff / (kAbsTolerance + kRelTolerance * std::fabs(torch[i]));
    if (!(ratio <= 1.0)) ++c.failures;  // also counts NaN
    if (!(diff <= c.worst_abs)) c.worst_abs = diff;
    if (!(ratio <= c.worst_ratio)) {
      c.worst_ratio = ratio;
      c.worst_at = static_cast<int64_t>(i);
    }
  }
  return c;
}

// Imports models/<name>.onnx and runs it on models/reference/<name>.input.npy.
struct ReferenceRun {
  Graph graph;
  HostTensor input, expected, output;
};

void run_reference(const std::string& name, ReferenceRun& run) {
  Result<ImportedModel> m = import_onnx_file(source_path("models/" + name + ".onnx"));
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  run.graph = std::move(m->graph);
  Result<HostTensor> x = read_tensor(source_path("models/reference/" + name + ".input.npy"));
  Result<HostTensor> y = read_tensor(source_path("models/reference/" + name + ".output.npy"));
  ASSERT_TRUE(x.is_ok()) << x.status().message();
  ASSERT_TRUE(y.is_ok()) << y.status().message();
  run.input = *x;
  run.expected = *y;
  ASSERT_EQ(run.graph.inputs.size(), 1u);
  ASSERT_EQ(run.graph.outputs.size(), 1u);
  Result<std::map<std::string, HostTensor>> values =
      run_forward(run.graph, {{run.graph.values[run.graph.inputs[0]].name, run.input}});
  ASSERT_TRUE(values.is_ok()) << values.status().message();
  const std::string& out_name = run.graph.values[run.graph.outputs[0]].name;
  ASSERT_TRUE(values->count(out_name)) << "no value '" << out_name << "' computed";
  run.output = values->at(out_name);
}

class ReferenceForwardTest : public ::testing::TestWithParam<ReferenceCase> {};

TEST_P(ReferenceForwardTest, MatchesPyTorch) {
  const ReferenceCase& c = GetParam();
  ReferenceRun run;
  ASSERT_NO_FATAL_FAILURE(run_reference(c.name, run));
  ASSERT_EQ(run.output.dims, run.expected.dims);
  ASSERT_EQ(run.output.data.size(), run.expected.data.size());
  const Comparison cmp = compare(run.output.data, run.expected.data);
  std::printf("[ worst    ] %-24s max |diff| %.3g, %.3f of the tolerance (%s reference)\n", c.name.c_str(),
              cmp.worst_abs, cmp.worst_ratio, c.mode.c_str());
  RecordProperty("worst_abs_diff", std::to_string(cmp.worst_abs));
  RecordProperty("worst_tolerance_ratio", std::to_string(cmp.worst_ratio));
  EXPECT_EQ(cmp.failures, 0) << cmp.failures << " of " << run.output.data.size()
                             << " elements differ by more than 1e-5 + 1e-4*|torch|; worst at " << cmp.worst_at
                             << ": ours " << run.output.data[cmp.worst_at] << ", torch "
                             << run.expected.data[cmp.worst_at];
}

INSTANTIATE_TEST_SUITE_P(AllReferences, ReferenceForwardTest, ::testing::ValuesIn(reference_cases()),
                         [](const ::testing::TestParamInfo<ReferenceCase>& info) { return info.param.name; });

TEST(ReferenceForwardTest, EveryReferenceIsCovered) {
  // All but dropout_train (a random mask) carry a reference.
  EXPECT_GE(reference_cases().size(), 25u);
}

// batchnorm_train's reference was recorded in train mode: the forward pass must normalise
// with the batch's statistics, not the (non-trivial) running ones.
TEST(ReferenceForwardTest, BatchNormTrainUsesBatchStatistics) {
  ReferenceRun run;
  ASSERT_NO_FATAL_FAILURE(run_reference("batchnorm_train", run));
  for (float v : run.output.data) ASSERT_TRUE(std::isfinite(v));

  // The BatchNorm node's own output: per channel, (y - beta) / gamma over the batch has
  // mean 0 and population variance var/(var+eps), which only batch statistics give.
  const Graph& g = run.graph;
  int bn_index = -1;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    if (g.nodes[i].kind == OpKind::kBatchNorm) bn_index = static_cast<int>(i);
  }
  ASSERT_GE(bn_index, 0);
  const Node& bn = g.nodes[bn_index];
  ASSERT_TRUE(bn.training);
  Result<std::map<std::string, HostTensor>> values = run_forward(g, {{g.values[g.inputs[0]].name, run.input}});
  ASSERT_TRUE(values.is_ok()) << values.status().message();
  const HostTensor& x = values->at(g.values[bn.inputs[0]].name);
  const HostTensor& y = values->at(g.values[bn.outputs[0]].name);
  ASSERT_EQ(y.dims, (std::vector<int64_t>{3, 32}));
  const int64_t batch = y.dims[0], channels = y.dims[1];
  for (int64_t ch = 0; ch < channels; ++ch) {
    double xm = 0, xv = 0, zm = 0, zv = 0;
    for (int64_t b = 0; b < batch; ++b) xm += x.data[b * channels + ch] / static_cast<double>(batch);
    for (int64_t b = 0; b < batch; ++b) {
      const double dx = x.data[b * channels + ch] - xm;
      xv += dx * dx / batch;
    }
    const double gamma = g.params[bn.weight].data[ch], beta = g.params[bn.bias].data[ch];
    std::vector<double> z(batch);
    for (int64_t b = 0; b < batch; ++b) z[b] = (y.data[b * channels + ch] - beta) / gamma;
    for (double v : z) zm += v / batch;
    for (double v : z) zv += (v - zm) * (v - zm) / batch;
    EXPECT_NEAR(zm, 0.0, 1e-5) << "channel " << ch;
    EXPECT_NEAR(zv, xv / (xv + bn.epsilon), 1e-4) << "channel " << ch;
  }

  // With the running statistics instead, the output is far from the train-mode reference.
  Graph eval_graph = g;
  eval_graph.nodes[bn_index].training = false;
  Result<std::map<std::string, HostTensor>> eval_values =
      run_forward(eval_graph, {{g.values[g.inputs[0]].name, run.input}});
  ASSERT_TRUE(eval_values.is_ok()) << eval_values.status().message();
  const Comparison cmp = compare(eval_values->at(g.values[g.outputs[0]].name).data, run.expected.data);
  EXPECT_GT(cmp.worst_abs, 1e-2) << "running statistics reproduce the train-mode reference: the test proves nothing";
}

// dropout_train has no reference (a random mask); the reference pass treats Dropout as the
// identity, so the model must equal the same graph with its Dropout node bypassed.
TEST(ReferenceForwardTest, DropoutIsIdentityInTheReferencePass) {
  Result<ImportedModel> m = import_onnx_file(source_path("models/dropout_train.onnx"));
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  const Graph& g = m->graph;
  Result<HostTensor> x = read_tensor(source_path("models/reference/batchnorm_eval.input.npy"));  // [3, 16]
  ASSERT_TRUE(x.is_ok()) << x.status().message();
  Result<std::map<std::string, HostTensor>> values = run_forward(g, {{g.values[g.inputs[0]].name, *x}});
  ASSERT_TRUE(values.is_ok()) << values.status().message();
  for (const Node& n : g.nodes) {
    if (n.kind != OpKind::kDropout) continue;
    EXPECT_EQ(values->at(g.values[n.inputs[0]].name).data, values->at(g.values[n.outputs[0]].name).data);
  }
  for (float v : values->at(g.values[g.outputs[0]].name).data) EXPECT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace pipeshard
