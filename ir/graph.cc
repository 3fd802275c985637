#include "ir/graph.h"

#include <algorithm>
#include <set>

namespace pipeshard {

int64_t Shape::per_sample_elements() const {
  int64_t n = 1;
  for (int64_t d : dims) {
    if (d != kBatch) n *= d;
  }
  return n;
}

std::string Shape::to_string() const {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += dims[i] == kBatch ? std::string("batch") : std::to_string(dims[i]);
  }
  return s + "]";
}

std::vector<int> Graph::node_params(const Node& node) const {
  std::vector<int> ids;
  for (int p : {node.weight, node.bias, node.running_mean, node.running_var}) {
    if (p >= 0) ids.push_back(p);
  }
  return ids;
}

int64_t Graph::node_parameter_count(const Node& node) const {
  int64_t n = 0;
  for (int p : node_params(node)) {
    if (params[p].trainable) n += params[p].elements();
  }
  return n;
}

int64_t Graph::total_parameter_count() const {
  std::set<int> seen;
  int64_t n = 0;
  for (const Node& node : nodes) {
    for (int p : node_params(node)) {
      if (params[p].trainable && seen.insert(p).second) n += params[p].elements();
    }
  }
  return n;
}

int64_t Graph::node_flops_per_sample(const Node& node) const {
  const Shape& out = values[node.outputs[0]].shape;
  if (node.kind == OpKind::kLinear) {
    // Rows per sample: everything between the batch and the feature dimension.
    int64_t rows = out.per_sample_elements() / (out.features() ? out.features() : 1);
    return rows * node.in_features * node.out_features;
  }
  return out.per_sample_elements();
}

const char* activation_name(ActivationKind kind) {
  switch (kind) {
    case ActivationKind::kRelu: return "Relu";
    case ActivationKind::kLeakyRelu: return "LeakyRelu";
    case ActivationKind::kSigmoid: return "Sigmoid";
    case ActivationKind::kTanh: return "Tanh";
    case ActivationKind::kGelu: return "Gelu";
    case ActivationKind::kGeluTanh: return "GeluTanh";
    case ActivationKind::kSilu: return "Silu";
  }
  return "Activation";
}

std::vector<bool> fused_activations(const Graph& g) {
  std::vector<bool> fused(g.nodes.size(), false);
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (n.kind != OpKind::kLinear) continue;
    const int y = n.outputs[0];
    const auto& readers = g.values[y].consumers;
    const bool output = std::find(g.outputs.begin(), g.outputs.end(), y) != g.outputs.end();
    if (readers.size() == 1 && g.nodes[readers[0]].kind == OpKind::kActivation && !output) fused[readers[0]] = true;
  }
  return fused;
}

std::vector<bool> recomputable_values(const Graph& g, const std::vector<ActivationKind>& kept_when_fused) {
  const std::vector<bool> fused = fused_activations(g);
  std::vector<bool> r(g.values.size(), false);
  for (size_t i = 0; i < g.nodes.size(); ++i) {  // topological: an input's verdict comes first
    const Node& n = g.nodes[i];
    if (n.kind != OpKind::kActivation || r[n.inputs[0]]) continue;
    if (fused[i] && std::find(kept_when_fused.begin(), kept_when_fused.end(), n.activation) != kept_when_fused.end()) {
      continue;
    }
    const int y = n.outputs[0];
    if (std::find(g.outputs.begin(), g.outputs.end(), y) != g.outputs.end()) continue;
    bool aliased = false;
    for (int c : g.values[y].consumers) aliased = aliased || g.nodes[c].kind == OpKind::kReshape;
    r[y] = !aliased;
  }
  return r;
}

const char* op_kind_name(const Node& node) {
  switch (node.kind) {
    case OpKind::kLinear: return "Linear";
    case OpKind::kActivation: return activation_name(node.activation);
    case OpKind::kSoftmax: return "Softmax";
    case OpKind::kLogSoftmax: return "LogSoftmax";
    case OpKind::kLayerNorm: return "LayerNorm";
    case OpKind::kBatchNorm: return "BatchNorm";
    case OpKind::kDropout: return "Dropout";
    case OpKind::kReshape: return "Reshape";
    case OpKind::kAdd: return "Add";
    case OpKind::kAllReduce: return "AllReduce";
    case OpKind::kAllGather: return "AllGather";
  }
  return "?";
}

}  // namespace pipeshard
