// ONNX's own backend node tests (Debian's libonnx-testdata 1.12) for the operators
// pipeshard imports, run through the importer and a CPU Program.
//
// Each case is one folder of data/node/ with what pipeshard must do with it: run and
// match output_k.pb elementwise within |got - want| <= 1e-5 + 1e-4 * |want|, or refuse
// at import with a message containing a given fragment (never compute something else).
// Node tests feed weights as graph inputs; prepare_node_model() moves every input but
// the activation(s) into initializers, which is how an exported MLP holds them.
//
// Not considered (they exist in data/node/ but are not in kCases):
// - every folder of an operator outside the families below (Conv, RNNs, reductions,
//   Mul, Exp, ...): pipeshard does not import them. The summary prints their count.
// - GELU: opset-20 Gelu's node tests (test_gelu_*) first ship with ONNX 1.15; 1.12 has
//   none. If a newer package brings them, EveryFolderOfTheseOpsIsClassified fails until
//   they are added here.
// - data/pytorch-operator, data/pytorch-converted, data/simple, data/real: not node tests.
//
// Adaptations, each stated where the case is listed:
// - outputs pipeshard does not compute are dropped from graph.output before import:
//   LayerNormalization's Mean and InvStdDev, Dropout's mask. BatchNormalization's
//   training-mode running_mean/var outputs are compared with the statistics the
//   Program holds after the step (download_parameters) instead.
// - rank-1 examples of elementwise ops ([3]) are declared [3, 1] (the importer needs a
//   batch and a feature dim); each such case first checks that the file as it is gets
//   a clear refusal.
// - random Dropout in training mode: the reference mask comes from numpy's RNG, which
//   no other implementation reproduces; the case checks each element is 0 or
//   x / (1 - ratio) and that about `ratio` of them are dropped.
#include <gtest/gtest.h>
#include <onnx/onnx_pb.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "importer/onnx_importer.h"
#include "program/program.h"
#include "tests/importer/onnx_node_util.h"

namespace pipeshard {
namespace {

namespace fs = std::filesystem;
using testing::NodeDataSet;
using testing::NodeModelEdits;
using testing::Rank1;

enum class Expect {
  kMatches,                 // every kept output matches output_k.pb
  kMatchesAndRunningStats,  // output 0 matches; outputs 1 and 2 (BatchNorm's updated running mean
                            // and variance) match the Program's statistics after the forward
  kDropoutPattern,          // random mask: each y is 0 or x / (1 - ratio), about `ratio` dropped
  kRefused,                 // import fails with a message containing `refusal`
};

struct NodeCase {
  std::string folder;  // "test_gemm_alpha", under kOnnxNodeTestDir
  Expect expect = Expect::kMatches;
  std::string refusal;  // kRefused: a fragment of the import error
  Mode mode = Mode::kEval;
  NodeModelEdits edits;
};

void PrintTo(const NodeCase& c, std::ostream* os) { *os << c.folder; }

NodeCase runs(std::string folder, NodeModelEdits edits = {}, Mode mode = Mode::kEval) {
  return {std::move(folder), Expect::kMatches, "", mode, edits};
}
NodeCase refused(std::string folder, std::string fragment, NodeModelEdits edits = {}) {
  return {std::move(folder), Expect::kRefused, std::move(fragment), Mode::kEval, edits};
}

constexpr NodeModelEdits kFirstOutputOnly{.kept_outputs = 1};
constexpr NodeModelEdits kColumn{.rank1 = Rank1::kAsColumn};

std::vector<NodeCase> gemm_and_matmul_cases() {
  return {
      runs("test_gemm_alpha"),
      runs("test_gemm_beta"),
      runs("test_gemm_default_no_bias"),
      runs("test_gemm_default_vector_bias"),  // C [1, 4]: the same numbers as a bias [4]
      runs("test_gemm_default_zero_bias"),
      runs("test_gemm_transposeB"),
      // Linear's bias is [out]; a bias broadcast any other way is refused, not reinterpreted.
      refused("test_gemm_default_matrix_bias", "bias 'c' has 12 elements, the layer has 4 outputs"),
      refused("test_gemm_default_scalar_bias", "bias 'c' has 1 elements, the layer has 4 outputs"),
      refused("test_gemm_default_single_elem_vector_bias", "bias 'c' has 1 elements, the layer has 3 outputs"),
      refused("test_gemm_transposeA", "transA=1 is not supported"),
      refused("test_gemm_all_attributes", "transA=1 is not supported"),
      runs("test_matmul_2d"),
      refused("test_matmul_3d", "weight 'b' must be a non-empty 2-D matrix"),
      refused("test_matmul_4d", "weight 'b' must be a non-empty 2-D matrix"),
      refused("test_matmulinteger", "input 'A' has element type uint8"),
  };
}

std::vector<NodeCase> activation_cases() {
  return {
      runs("test_relu"),
      runs("test_leakyrelu"),
      runs("test_leakyrelu_default"),
      runs("test_leakyrelu_example", kColumn),
      runs("test_sigmoid"),
      runs("test_sigmoid_example", kColumn),
      runs("test_tanh"),
      runs("test_tanh_example", kColumn),
      refused("test_erf", "Erf outside a GELU pattern is not supported"),
  };
}

// Softmax and LogSoftmax over the last axis run; other axes are refused. The
// *_expanded twins spell the op as its ONNX function body (ReduceMax, Exp, ReduceSum).
std::vector<NodeCase> softmax_cases() {
  std::vector<NodeCase> cases;
  for (const std::string op : {"softmax", "logsoftmax"}) {
    const std::string example = op == "softmax" ? "example" : "example_1";
    const std::vector<std::string> last_axis = {"axis_2", "default_axis", "negative_axis", example, "large_number"};
    for (const auto& v : last_axis) cases.push_back(runs("test_" + op + "_" + v));
    cases.push_back(refused("test_" + op + "_axis_0", "only the last axis is supported, got axis 0"));
    cases.push_back(refused("test_" + op + "_axis_1", "only the last axis is supported, got axis 1"));
    std::vector<std::string> every_axis = last_axis;
    every_axis.insert(every_axis.end(), {"axis_0", "axis_1"});
    for (const auto& v : every_axis) {
      cases.push_back(refused("test_" + op + "_" + v + "_expanded", "unsupported operator"));
    }
  }
  return cases;
}

// LayerNormalization over the last axis runs (its Mean and InvStdDev outputs dropped);
// other axes are refused. *_expanded: the function body (Shape, Flatten, ReduceMean, ...).
std::vector<NodeCase> layernorm_cases() {
  const std::vector<std::string> last_axis = {
      "2d_axis1", "2d_axis_negative_1", "3d_axis2_epsilon", "3d_axis_negative_1_epsilon",
      "4d_axis3", "4d_axis_negative_1", "default_axis"};
  const std::vector<std::string> other_axis = {"2d_axis0",
                                               "2d_axis_negative_2",
                                               "3d_axis0_epsilon",
                                               "3d_axis1_epsilon",
                                               "3d_axis_negative_2_epsilon",
                                               "3d_axis_negative_3_epsilon",
                                               "4d_axis0",
                                               "4d_axis1",
                                               "4d_axis2",
                                               "4d_axis_negative_2",
                                               "4d_axis_negative_3",
                                               "4d_axis_negative_4"};
  std::vector<NodeCase> cases;
  for (const auto& v : last_axis) cases.push_back(runs("test_layer_normalization_" + v, kFirstOutputOnly));
  for (const auto& v : other_axis) {
    cases.push_back(refused("test_layer_normalization_" + v, "only normalisation over the last axis is supported",
                            kFirstOutputOnly));
  }
  for (const auto* list : {&last_axis, &other_axis}) {
    for (const auto& v : *list) {
      cases.push_back(refused("test_layer_normalization_" + v + "_expanded", "ReduceMean outside a LayerNorm pattern"));
    }
  }
  return cases;
}

std::vector<NodeCase> batchnorm_and_dropout_cases() {
  auto batchnorm_training = [](std::string folder) {
    return NodeCase{std::move(folder), Expect::kMatchesAndRunningStats, "", Mode::kTrain, kFirstOutputOnly};
  };
  auto dropout_training = [](std::string folder, Expect expect) {
    return NodeCase{std::move(folder), expect, "", Mode::kTrain, kFirstOutputOnly};
  };
  return {
      runs("test_batchnorm_example"),
      runs("test_batchnorm_epsilon"),
      batchnorm_training("test_batchnorm_example_training_mode"),
      batchnorm_training("test_batchnorm_epsilon_training_mode"),
      // Inference: identity. The *_mask cases' second output, the mask, is dropped.
      runs("test_dropout_default"),
      runs("test_dropout_default_ratio"),
      runs("test_dropout_default_mask", kFirstOutputOnly),
      runs("test_dropout_default_mask_ratio", kFirstOutputOnly),
      runs("test_dropout_default_old", kColumn),
      runs("test_dropout_random_old"),
      // training_mode=true: identity at ratio 0, a random mask otherwise.
      dropout_training("test_training_dropout_zero_ratio", Expect::kMatches),
      dropout_training("test_training_dropout_zero_ratio_mask", Expect::kMatches),
      dropout_training("test_training_dropout", Expect::kDropoutPattern),
      dropout_training("test_training_dropout_default", Expect::kDropoutPattern),
      dropout_training("test_training_dropout_mask", Expect::kDropoutPattern),
      dropout_training("test_training_dropout_default_mask", Expect::kDropoutPattern),
  };
}

std::vector<NodeCase> shape_and_add_cases() {
  const char* kFlattenAxis = "only Flatten with axis=1 (keep the batch) is supported";
  return {
      // Flatten and Reshape run where they keep dim 0, the batch.
      runs("test_flatten_axis1"),
      runs("test_flatten_default_axis"),
      runs("test_flatten_negative_axis3"),  // axis -3 of a rank-4 input is axis 1
      refused("test_flatten_axis0", kFlattenAxis),
      refused("test_flatten_axis2", kFlattenAxis),
      refused("test_flatten_axis3", kFlattenAxis),
      refused("test_flatten_negative_axis1", kFlattenAxis),
      refused("test_flatten_negative_axis2", kFlattenAxis),
      refused("test_flatten_negative_axis4", kFlattenAxis),
      runs("test_reshape_extended_dims"),
      runs("test_reshape_negative_dim"),
      runs("test_reshape_reduced_dims"),
      runs("test_reshape_reordered_last_dims"),
      runs("test_reshape_zero_and_negative_dim"),
      runs("test_reshape_zero_dim"),
      refused("test_reshape_allowzero_reordered", "allowzero=1 with a zero dimension is not supported"),
      refused("test_reshape_negative_extended_dims", "shape mismatch: reshape of [batch, 3, 4] to 24 elements"),
      refused("test_reshape_one_dim", "the target shape must keep the batch"),
      refused("test_reshape_reordered_all_dims", "shape mismatch: reshape of [batch, 3, 4] to 6 elements"),
      // Add of two activations (a residual): both inputs stay model inputs.
      runs("test_add", {.activation_inputs = 2}),
      refused("test_add_bcast", "Add of a constant is supported only as a Linear's bias"),
      refused("test_add_uint8", "has element type uint8", {.activation_inputs = 2}),
      runs("test_identity"),
      refused("test_identity_opt", "input 'opt_in' is not a tensor"),
      refused("test_identity_sequence", "input 'x' is not a tensor"),
  };
}

std::vector<NodeCase> all_cases() {
  std::vector<NodeCase> all;
  for (auto part : {gemm_and_matmul_cases(), activation_cases(), softmax_cases(), layernorm_cases(),
                    batchnorm_and_dropout_cases(), shape_and_add_cases()}) {
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

const std::vector<NodeCase>& cases() {
  static const std::vector<NodeCase> kCases = all_cases();
  return kCases;
}

// Folder-name prefixes of the operator families above.
const std::vector<std::string> kFamilies = {"test_gemm_",
                                            "test_matmul",
                                            "test_relu",
                                            "test_leakyrelu",
                                            "test_sigmoid",
                                            "test_tanh",
                                            "test_gelu",
                                            "test_erf",
                                            "test_softmax_",
                                            "test_logsoftmax_",
                                            "test_layer_normalization_",
                                            "test_batchnorm_",
                                            "test_dropout_",
                                            "test_training_dropout",
                                            "test_flatten_",
                                            "test_reshape_",
                                            "test_add",
                                            "test_identity"};

bool in_families(const std::string& folder) {
  for (const auto& f : kFamilies) {
    if (folder.rfind(f, 0) == 0) return true;
  }
  return false;
}

std::string missing_data_message() {
  return std::string(testing::kOnnxNodeTestDir) +
         " is missing: install Debian's libonnx-testdata (scripts/install-deps.sh does)";
}

// ---------------------------------------------------------------------------------
// Checks.

constexpr double kAbsTolerance = 1e-5, kRelTolerance = 1e-4;

bool close(float got, float want) {
  return std::fabs(static_cast<double>(got) - want) <= kAbsTolerance + kRelTolerance * std::fabs(want);
}

// `got` [product(got_dims)] against the reference tensor, with the worst element named.
::testing::AssertionResult matches(const std::string& what, const std::vector<float>& got,
                                   const std::vector<int64_t>& got_dims, const onnx::TensorProto& want_proto,
                                   Rank1 rank1) {
  std::vector<int64_t> want_dims = testing::tensor_dims(want_proto);
  if (rank1 == Rank1::kAsColumn && want_dims.size() == 1) want_dims.push_back(1);
  if (got_dims != want_dims) {
    return ::testing::AssertionFailure() << what << ": shape " << ::testing::PrintToString(got_dims) << ", reference "
                                         << ::testing::PrintToString(want_dims);
  }
  Result<std::vector<float>> want = testing::tensor_floats(want_proto);
  if (!want) return ::testing::AssertionFailure() << what << ": " << want.status().message();
  size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (close(got[i], (*want)[i])) continue;
    ++bad;
    const double allowed = kAbsTolerance + kRelTolerance * std::fabs((*want)[i]);
    const double excess = std::fabs(static_cast<double>(got[i]) - (*want)[i]) / allowed;
    if (!(excess <= worst_excess)) worst_excess = excess, worst = i;  // NaN counts as worst
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size()
                                       << " elements outside 1e-5 + 1e-4*|want|; worst at flat index " << worst
                                       << ": got " << got[worst] << ", want " << (*want)[worst];
}

// Dropout in training mode: y[i] is 0 or x[i] / (1 - ratio), and about ratio·n are 0.
::testing::AssertionResult is_dropout_of(const std::vector<float>& y, const std::vector<float>& x, float ratio) {
  size_t dropped = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    if (y[i] == 0.0f && x[i] != 0.0f) {
      ++dropped;
    } else if (!close(y[i], x[i] / (1.0f - ratio))) {
      return ::testing::AssertionFailure()
             << "element " << i << " is " << y[i] << ", neither 0 nor x/(1-ratio) = " << x[i] / (1.0f - ratio);
    }
  }
  // 60 elements: a binomial's standard deviation is at most 0.065 of n; 0.25 is ~4 of them.
  const double fraction = static_cast<double>(dropped) / y.size();
  if (std::fabs(fraction - ratio) > 0.25) {
    return ::testing::AssertionFailure() << "dropped " << dropped << " of " << y.size() << " at ratio " << ratio;
  }
  return ::testing::AssertionSuccess();
}

struct Tally {
  int matched = 0, refused = 0, failed = 0;
};

class OnnxNodeTest : public ::testing::TestWithParam<NodeCase> {
 protected:
  static void TearDownTestSuite() {
    std::cout << "ONNX node tests (" << testing::kOnnxNodeTestDir << "): " << tally_.matched << " ran and matched, "
              << tally_.refused << " refused as expected, " << tally_.failed << " failed\n";
  }
  void TearDown() override {
    if (HasFailure()) {
      ++tally_.failed;
    } else {
      ++(GetParam().expect == Expect::kRefused ? tally_.refused : tally_.matched);
    }
  }

  void check_refused(const NodeCase& c, const fs::path& dir, const onnx::ModelProto& model, const NodeDataSet& set);
  void check_runs(const NodeCase& c, const fs::path& dir, const onnx::ModelProto& model, const NodeDataSet& set);

  static Tally tally_;
};

Tally OnnxNodeTest::tally_;

void OnnxNodeTest::check_refused(const NodeCase& c, const fs::path& dir, const onnx::ModelProto& model,
                                 const NodeDataSet& set) {
  Result<std::shared_ptr<onnx::ModelProto>> prepared = testing::prepare_node_model(model, set, c.edits);
  ASSERT_TRUE(prepared) << prepared.status().message();
  Result<ImportedModel> imported = import_onnx_model(*prepared, dir.string(), c.folder);
  ASSERT_FALSE(imported) << "imported; expected a refusal containing \"" << c.refusal << "\"";
  EXPECT_NE(imported.status().message().find(c.refusal), std::string::npos)
      << "refusal \"" << imported.status().message() << "\" lacks \"" << c.refusal << "\"";
  std::cout << "  refused " << c.folder << ": " << imported.status().message() << "\n";
}

void OnnxNodeTest::check_runs(const NodeCase& c, const fs::path& dir, const onnx::ModelProto& model,
                              const NodeDataSet& set) {
  if (c.edits.rank1 == Rank1::kAsColumn) {  // the file as it is: refused, clearly
    NodeModelEdits as_is = c.edits;
    as_is.rank1 = Rank1::kAsIs;
    Result<std::shared_ptr<onnx::ModelProto>> unlifted = testing::prepare_node_model(model, set, as_is);
    ASSERT_TRUE(unlifted) << unlifted.status().message();
    Result<ImportedModel> refusal = import_onnx_model(*unlifted, dir.string(), c.folder);
    ASSERT_FALSE(refusal) << "a rank-1 input was imported";
    EXPECT_NE(refusal.status().message().find("rank 2 or more"), std::string::npos) << refusal.status().message();
  }
  Result<std::shared_ptr<onnx::ModelProto>> prepared = testing::prepare_node_model(model, set, c.edits);
  ASSERT_TRUE(prepared) << prepared.status().message();
  Result<ImportedModel> imported = import_onnx_model(*prepared, dir.string(), c.folder);
  ASSERT_TRUE(imported) << imported.status().message();
  const Graph& graph = imported->graph;

  std::vector<std::vector<float>> inputs;  // [activation inputs][batch, ...]
  std::vector<const float*> input_ptrs;
  for (int k = 0; k < c.edits.activation_inputs; ++k) {
    Result<std::vector<float>> x = testing::tensor_floats(set.inputs[k]);
    ASSERT_TRUE(x) << x.status().message();
    inputs.push_back(std::move(*x));
  }
  for (const auto& x : inputs) input_ptrs.push_back(x.data());
  ASSERT_GE(set.inputs[0].dims_size(), 1);
  const int64_t batch = set.inputs[0].dims(0);
  ASSERT_GE(batch, 1);

  std::unique_ptr<Backend> backend = make_cpu_backend();
  Result<std::unique_ptr<Program>> program = Program::create(graph, *backend, batch);
  ASSERT_TRUE(program) << program.status().message();
  Program& p = **program;
  p.forward(input_ptrs, batch, c.mode, /*seed=*/1);

  const int compared = static_cast<int>(graph.outputs.size());
  ASSERT_LE(compared, static_cast<int>(set.outputs.size()));
  for (int k = 0; k < compared; ++k) {
    std::vector<int64_t> dims = p.output_shape(k).dims;  // [kBatch, ...]
    dims[0] = batch;
    std::vector<float> got(static_cast<size_t>(batch * p.output_shape(k).per_sample_elements()));
    backend->download(got.data(), p.output(k), static_cast<int64_t>(got.size()));
    const std::string what = "output " + std::to_string(k) + " '" + set.outputs[k].name() + "'";
    if (c.expect == Expect::kDropoutPattern) {
      Result<std::vector<float>> ratio = testing::tensor_floats(set.inputs[1]);
      ASSERT_TRUE(ratio && ratio->size() == 1) << "input 1 must be the ratio";
      EXPECT_TRUE(is_dropout_of(got, inputs[0], (*ratio)[0])) << what;
    } else {
      EXPECT_TRUE(matches(what, got, dims, set.outputs[k], c.edits.rank1));
    }
  }

  if (c.expect == Expect::kMatchesAndRunningStats) {
    ASSERT_EQ(set.outputs.size(), 3u);
    Graph after = graph;
    p.download_parameters(after);
    const onnx::NodeProto& bn = model.graph().node(0);  // X, scale, B, input_mean, input_var
    for (int k : {1, 2}) {
      const std::string& stat = bn.input(k + 2);
      onnx::TensorProto expected = set.outputs[k];
      if (k == 2) {
        // A documented deviation (docs/design.md, "Training semantics"): pipeshard updates the
        // running variance with the UNBIASED batch variance, as PyTorch does, where the
        // ONNX spec uses the population variance. Convert ONNX's expected value:
        //   onnx  = m·old + (1 − m)·var_pop;   torch = m·old + (1 − m)·var_pop·N/(N − 1)
        // so torch = m·old + (onnx − m·old)·N/(N − 1), N = values per channel.
        float momentum = 0.9f;
        for (const auto& a : bn.attribute())
          if (a.name() == "momentum") momentum = a.f();
        const auto& x = set.inputs[0];
        int64_t n = 1;
        for (int d = 0; d < x.dims_size(); ++d) n *= d == 1 ? 1 : x.dims(d);
        Result<std::vector<float>> old = testing::tensor_floats(set.inputs[4]);
        Result<std::vector<float>> onnx_rule = testing::tensor_floats(set.outputs[2]);
        ASSERT_TRUE(old && onnx_rule);
        expected.clear_raw_data();
        expected.clear_float_data();
        for (size_t i = 0; i < old->size(); ++i) {
          const double m_old = static_cast<double>(momentum) * (*old)[i];
          expected.add_float_data(static_cast<float>(m_old + ((*onnx_rule)[i] - m_old) * n / (n - 1.0)));
        }
      }
      bool found = false;
      for (const Parameter& param : after.params) {
        if (param.name != stat) continue;
        found = true;
        EXPECT_TRUE(matches("running statistic '" + stat + "' (output " + std::to_string(k) + ")", param.data,
                            param.dims, expected, Rank1::kAsIs));
      }
      EXPECT_TRUE(found) << "no parameter '" << stat << "'";
    }
  }
}

TEST_P(OnnxNodeTest, MatchesReferenceOrRefuses) {
  const NodeCase& c = GetParam();
  ASSERT_TRUE(fs::is_directory(testing::kOnnxNodeTestDir)) << missing_data_message();
  const fs::path dir = fs::path(testing::kOnnxNodeTestDir) / c.folder;
  ASSERT_TRUE(fs::is_directory(dir)) << dir << " is missing from this libonnx-testdata";
  Result<std::shared_ptr<onnx::ModelProto>> model = testing::read_model_proto(dir / "model.onnx");
  ASSERT_TRUE(model) << model.status().message();
  const auto read = c.expect == Expect::kRefused ? testing::ReadTensors::kWeightsOnly : testing::ReadTensors::kAll;
  Result<std::vector<NodeDataSet>> sets = testing::read_node_data_sets(dir, read, c.edits.activation_inputs);
  ASSERT_TRUE(sets) << sets.status().message();
  for (const NodeDataSet& set : *sets) {
    SCOPED_TRACE(set.name);
    if (c.expect == Expect::kRefused) {
      check_refused(c, dir, **model, set);
    } else {
      check_runs(c, dir, **model, set);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(LibOnnxTestdata, OnnxNodeTest, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<NodeCase>& info) { return info.param.folder; });

// Every folder of the families above is in kCases, so a newer libonnx-testdata's new
// cases (e.g. test_gelu_*) cannot go unnoticed; the summary counts the rest.
TEST(OnnxNodeTestTable, EveryFolderOfTheseOpsIsClassified) {
  ASSERT_TRUE(fs::is_directory(testing::kOnnxNodeTestDir)) << missing_data_message();
  std::set<std::string> listed;
  for (const auto& c : cases()) EXPECT_TRUE(listed.insert(c.folder).second) << c.folder << " is listed twice";
  int other = 0;
  for (const auto& entry : fs::directory_iterator(testing::kOnnxNodeTestDir)) {
    const std::string folder = entry.path().filename().string();
    if (!in_families(folder)) {
      ++other;
    } else {
      EXPECT_TRUE(listed.count(folder)) << folder << " tests an operator pipeshard imports but is not in kCases";
    }
  }
  std::cout << "ONNX node tests: " << listed.size() << " classified here, " << other
            << " other folders test operators pipeshard does not import (not considered)\n";
}

}  // namespace
}  // namespace pipeshard
