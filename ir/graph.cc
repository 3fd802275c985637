#include "ir/graph.h"

#include <algorithm>
#include <set>

#include "ir/op_table.h"

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
  return op_info(node.kind).flops_per_sample(*this, node);
}

std::vector<bool> fused_activations(const Graph& g) {
  std::vector<bool> fused(g.nodes.size(), false);
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (n.kind != OpKind::kLinear) continue;
    const int y = n.outputs[0];
    const auto& readers = g.values[y].consumers;
    const bool output = std::find(g.outputs.begin(), g.outputs.end(), y) != g.outputs.end();
    if (readers.size() == 1 && op_info(g.nodes[readers[0]].kind).fusion == Fusion::kLinearEpilogue && !output) {
      fused[readers[0]] = true;
    }
  }
  return fused;
}

std::vector<bool> recomputable_values(const Graph& g, const std::vector<ActivationKind>& kept_when_fused) {
  const std::vector<bool> fused = fused_activations(g);
  std::vector<bool> r(g.values.size(), false);
  for (size_t i = 0; i < g.nodes.size(); ++i) {  // topological: an input's verdict comes first
    const Node& n = g.nodes[i];
    if (op_info(n.kind).recompute != Recompute::kFromInput || r[n.inputs[0]]) continue;
    if (fused[i] && std::find(kept_when_fused.begin(), kept_when_fused.end(), n.activation) != kept_when_fused.end()) {
      continue;
    }
    const int y = n.outputs[0];
    if (std::find(g.outputs.begin(), g.outputs.end(), y) != g.outputs.end()) continue;
    bool aliased = false;
    for (int c : g.values[y].consumers) aliased = aliased || output_aliases_input(g.nodes[c].kind);
    r[y] = !aliased;
  }
  return r;
}

}  // namespace pipeshard
