// Internal to importer/: the tables the import steps share while turning ONNX nodes
// into Graph nodes. Not a public header.
#ifndef PIPESHARD_IMPORTER_IMPORT_CONTEXT_H_
#define PIPESHARD_IMPORTER_IMPORT_CONTEXT_H_

#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <onnx/onnx_pb.h>

#include "common/status.h"
#include "ir/graph.h"

namespace pipeshard::detail {

// A constant tensor: an initializer or the value of a Constant node, decoded.
struct ConstantTensor {
  std::vector<int64_t> dims;
  std::vector<double> values;   // every dtype decoded to double (small tensors only)
  int32_t data_type = 0;        // onnx::TensorProto::DataType
  bool is_initializer = false;  // false for Constant-node outputs
};

struct ImportContext {
  const onnx::GraphProto* onnx_graph = nullptr;
  std::string label;  // the model path, for messages
  int64_t opset = 0;

  // Float32 initializers, decoded, by name. They become Graph parameters when a layer
  // uses them as a weight, bias or statistic.
  std::unordered_map<std::string, std::vector<float>> float_data;
  std::unordered_map<std::string, std::vector<int64_t>> float_dims;
  // Every constant (initializer or Constant node output) that is small enough to decode
  // as a scalar or shape: up to kMaxDecodedConstant elements.
  std::unordered_map<std::string, ConstantTensor> constants;
  // name -> the name it is an Identity of (followed to the end by resolve()).
  std::unordered_map<std::string, std::string> alias;
  // value name -> index of the ONNX node producing it.
  std::unordered_map<std::string, int> producer;
  // value name -> indices of ONNX nodes consuming it.
  std::unordered_map<std::string, std::vector<int>> consumers;
  std::vector<int> topo_order;  // ONNX node indices in a topological order
  std::vector<bool> consumed;   // [onnx nodes]: already part of a Graph node
  std::vector<std::string> graph_outputs;

  // The Graph under construction.
  Graph graph;
  std::unordered_map<std::string, int> value_ids;  // value name -> Graph value id
  std::unordered_map<std::string, int> param_ids;  // initializer name -> Graph param id

  const onnx::NodeProto& node(int i) const { return onnx_graph->node(i); }
  // The name `name` stands for after following Identity aliases.
  std::string resolve(const std::string& name) const;
  bool is_constant(const std::string& name) const { return constants.count(resolve(name)) > 0; }
  bool is_float_initializer(const std::string& name) const { return float_data.count(resolve(name)) > 0; }
  // A one-element constant's value.
  std::optional<double> scalar(const std::string& name) const;
  // Nodes consuming `name` or any name aliased to the same value (Identity), sorted.
  // Valid once merge_alias_consumers() has run.
  std::vector<int> consumers_of(const std::string& name) const;
  void merge_alias_consumers();
  std::unordered_map<std::string, std::vector<int>> class_consumers;  // resolved name -> readers
  bool is_graph_output(const std::string& name) const;
  // "node 'fc1' (Gemm)" for messages.
  std::string describe(int onnx_node) const;
  Status node_error(int onnx_node, const std::string& message) const {
    return Status::error(describe(onnx_node) + ": " + message);
  }

  // Graph building.
  int value_id(const std::string& name);  // creates the value on first use
  // The Graph parameter for float initializer `name`, created on first use.
  Result<int> param_id(const std::string& name, bool trainable);
  // Records a recognised node and marks its ONNX nodes consumed.
  void emit(Node node);
  // Moves the emitted nodes into the graph in topological order, wiring producers
  // and consumers of their values.
  void finalize_nodes();
  std::vector<Node> emitted;
};

// "float64", "int64", "float16", ...: an ONNX data type as PyTorch users know it.
std::string dtype_label(int32_t data_type);

// Elements up to which constants are decoded into ConstantTensor::values.
inline constexpr int64_t kMaxDecodedConstant = 4096;

// Steps of import_onnx_model, in the order they run (each in its own .cc file).
// onnx_file.cc: decodes initializers and Constant nodes into the context.
Status load_constants(const onnx::ModelProto& model, const std::string& base_dir, ImportContext& ctx);
// onnx_patterns.cc: turns ONNX nodes into Graph nodes.
Status recognise_nodes(ImportContext& ctx);
// shape_inference.cc: gives every value its shape and checks widths along the way.
Status infer_shapes(ImportContext& ctx);

}  // namespace pipeshard::detail

#endif  // PIPESHARD_IMPORTER_IMPORT_CONTEXT_H_
