// Reading ONNX's backend node tests (Debian's libonnx-testdata) and reshaping them into
// the MLP form pipeshard imports.
//
// A node test is a folder holding model.onnx, one graph with a single node, and
// test_data_set_*/ with input_k.pb and output_k.pb, serialised onnx::TensorProto, one
// per graph input and output in order. Node tests feed weights as graph inputs;
// pipeshard wants one activation input and weights as initializers, so
// prepare_node_model() moves the trailing inputs into initializers.
#ifndef PIPESHARD_TESTS_IMPORTER_ONNX_NODE_UTIL_H_
#define PIPESHARD_TESTS_IMPORTER_ONNX_NODE_UTIL_H_

#include <onnx/onnx_pb.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/status.h"

namespace pipeshard::testing {

// Where Debian's libonnx-testdata puts the node tests.
inline constexpr const char* kOnnxNodeTestDir = "/usr/share/libonnx-testdata/data/node";

// One test_data_set_*: the tensors of input_k.pb and output_k.pb, k = 0, 1, ...
struct NodeDataSet {
  std::string name;                        // "test_data_set_0"
  std::vector<onnx::TensorProto> inputs;   // [graph inputs]
  std::vector<onnx::TensorProto> outputs;  // [graph outputs]; empty under ReadTensors::kWeightsOnly
};

inline Result<onnx::TensorProto> read_tensor_proto(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error("cannot open " + path.string());
  std::stringstream bytes;
  bytes << in.rdbuf();
  onnx::TensorProto t;
  if (!t.ParseFromString(bytes.str())) return Status::error(path.string() + " is not a serialised TensorProto");
  return t;
}

inline Result<std::shared_ptr<onnx::ModelProto>> read_model_proto(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error("cannot open " + path.string());
  auto model = std::make_shared<onnx::ModelProto>();
  if (!model->ParseFromIstream(&in)) return Status::error(path.string() + " is not an ONNX model");
  return model;
}

// Which tensors read_node_data_sets() parses.
enum class ReadTensors {
  kAll,          // every input and output
  kWeightsOnly,  // inputs from `activation_inputs` on; the rest stay empty placeholders
                 // (a refused test's activations may be sequences or optionals, which
                 // are not TensorProtos)
};

// Reads the data sets of a node test folder, sorted by name.
inline Result<std::vector<NodeDataSet>> read_node_data_sets(const std::filesystem::path& dir, ReadTensors what,
                                                            int activation_inputs) {
  std::vector<NodeDataSet> sets;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_directory() || entry.path().filename().string().rfind("test_data_set_", 0) != 0) continue;
    NodeDataSet set;
    set.name = entry.path().filename().string();
    for (int k = 0;; ++k) {
      const auto in = entry.path() / ("input_" + std::to_string(k) + ".pb");
      if (!std::filesystem::exists(in)) break;
      if (what == ReadTensors::kWeightsOnly && k < activation_inputs) {
        set.inputs.emplace_back();
        continue;
      }
      Result<onnx::TensorProto> t = read_tensor_proto(in);
      if (!t) return t.status();
      set.inputs.push_back(std::move(*t));
    }
    for (int k = 0; what == ReadTensors::kAll; ++k) {
      const auto out = entry.path() / ("output_" + std::to_string(k) + ".pb");
      if (!std::filesystem::exists(out)) break;
      Result<onnx::TensorProto> t = read_tensor_proto(out);
      if (!t) return t.status();
      set.outputs.push_back(std::move(*t));
    }
    sets.push_back(std::move(set));
  }
  if (sets.empty()) return Status::error(dir.string() + " has no test_data_set_*");
  std::sort(sets.begin(), sets.end(), [](const NodeDataSet& a, const NodeDataSet& b) { return a.name < b.name; });
  return sets;
}

// A float32 tensor's elements, row-major, from raw_data or float_data.
inline Result<std::vector<float>> tensor_floats(const onnx::TensorProto& t) {
  if (t.data_type() != onnx::TensorProto::FLOAT) {
    return Status::error("tensor '" + t.name() + "' has data type " + std::to_string(t.data_type()) + ", not float32");
  }
  int64_t n = 1;
  for (int64_t d : t.dims()) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  if (t.has_raw_data()) {
    if (t.raw_data().size() != v.size() * sizeof(float)) {
      return Status::error("tensor '" + t.name() + "': raw_data size does not match its dims");
    }
    std::memcpy(v.data(), t.raw_data().data(), t.raw_data().size());
  } else {
    if (t.float_data_size() != n) {
      return Status::error("tensor '" + t.name() + "': float_data size does not match its dims");
    }
    std::copy(t.float_data().begin(), t.float_data().end(), v.begin());
  }
  return v;
}

inline std::vector<int64_t> tensor_dims(const onnx::TensorProto& t) { return {t.dims().begin(), t.dims().end()}; }

enum class Rank1 {
  kAsIs,
  kAsColumn,  // declare rank-1 inputs and outputs [n] as [n, 1]: same data, and the
              // numbers of an elementwise op do not change
};

// How prepare_node_model() turns a node test's model into an MLP-shaped one.
struct NodeModelEdits {
  int activation_inputs = 1;  // leading graph inputs kept as activations; later ones become initializers
  int kept_outputs = -1;      // leading graph outputs kept, later ones dropped from graph.output; -1: all
  Rank1 rank1 = Rank1::kAsIs;
};

// A copy of `model` with graph inputs from `activation_inputs` on turned into
// initializers holding `set`'s tensors, outputs past `kept_outputs` dropped, and, when
// asked, rank-1 inputs and outputs declared as columns.
inline Result<std::shared_ptr<onnx::ModelProto>> prepare_node_model(const onnx::ModelProto& model,
                                                                    const NodeDataSet& set,
                                                                    const NodeModelEdits& edits) {
  auto out = std::make_shared<onnx::ModelProto>(model);
  onnx::GraphProto& g = *out->mutable_graph();
  const int kept_outputs = edits.kept_outputs < 0 ? g.output_size() : edits.kept_outputs;
  if (g.input_size() < edits.activation_inputs || g.output_size() < kept_outputs) {
    return Status::error("the model has fewer inputs or outputs than the edits keep");
  }
  for (int k = edits.activation_inputs; k < g.input_size(); ++k) {
    if (k >= static_cast<int>(set.inputs.size())) {
      return Status::error(set.name + " lacks input_" + std::to_string(k) + ".pb");
    }
    onnx::TensorProto* init = g.add_initializer();
    *init = set.inputs[k];
    init->set_name(g.input(k).name());
  }
  while (g.input_size() > edits.activation_inputs) g.mutable_input()->RemoveLast();
  while (g.output_size() > kept_outputs) g.mutable_output()->RemoveLast();
  if (edits.rank1 == Rank1::kAsColumn) {
    auto as_column = [](onnx::ValueInfoProto& vi) {
      auto* shape = vi.mutable_type()->mutable_tensor_type()->mutable_shape();
      if (shape->dim_size() == 1) shape->add_dim()->set_dim_value(1);
    };
    for (auto& vi : *g.mutable_input()) as_column(vi);
    for (auto& vi : *g.mutable_output()) as_column(vi);
  }
  return out;
}

}  // namespace pipeshard::testing

#endif  // PIPESHARD_TESTS_IMPORTER_ONNX_NODE_UTIL_H_
