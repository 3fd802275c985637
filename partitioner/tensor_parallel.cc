#include "partitioner/tensor_parallel.h"

#include <algorithm>
#include <map>
#include <set>

#include "ir/op_table.h"

namespace pipeshard {
namespace {

Status check_divides(const Node& n, int64_t width, const char* what, int t) {
  if (width % t == 0) return Status::ok();
  return Status::error(node_label(n) + ": " + std::to_string(width) + " " + what + " do not divide into " +
                       std::to_string(t) + " tensor-parallel shards");
}

}  // namespace

Status assign_shard_roles(const Graph& g, const PartitionOptions& o, StagePlan& s) {
  const int t = o.tensor_parallel;
  std::map<int, size_t> position;  // node id -> index in s.nodes
  for (size_t i = 0; i < s.nodes.size(); ++i) position[s.nodes[i]] = i;
  std::vector<bool> assigned(s.nodes.size(), false);
  // A weight that two nodes use (tied weights) stays whole: its users would need the same
  // slice, and a pair's halves different ones.
  std::vector<int> users(g.params.size(), 0);
  for (const Node& n : g.nodes)
    for (int p : g.node_params(n)) ++users[p];
  auto splittable = [&](const Node& n) { return users[n.weight] == 1 && (n.bias < 0 || users[n.bias] == 1); };
  // The only consumer of `v` inside this stage, or -1 when v has other readers
  // (later stages, the loss, a second node).
  auto sole_local_consumer = [&](int v) {
    const Value& val = g.values[v];
    bool model_output = std::find(g.outputs.begin(), g.outputs.end(), v) != g.outputs.end();
    if (val.consumers.size() != 1 || model_output || !position.count(val.consumers[0])) return -1;
    return val.consumers[0];
  };
  for (size_t i = 0; i < s.nodes.size(); ++i) {
    const Node& first = g.nodes[s.nodes[i]];
    if (assigned[i] || first.kind != OpKind::kLinear) continue;
    if (!splittable(first)) {
      assigned[i] = true;  // replicated
      continue;
    }
    // Walk elementwise nodes to a partner Linear.
    std::vector<size_t> chain;
    int partner = -1;
    for (int v = first.outputs[0];;) {
      int c = sole_local_consumer(v);
      if (c < 0) break;
      if (g.nodes[c].kind == OpKind::kLinear) {
        partner = c;
        break;
      }
      if (!runs_on_feature_shard(g.nodes[c].kind)) break;
      chain.push_back(position[c]);
      v = g.nodes[c].outputs[0];
    }
    assigned[i] = true;
    if (partner >= 0 && !assigned[position[partner]] && splittable(g.nodes[partner])) {
      PIPESHARD_RETURN_IF_ERROR(check_divides(first, first.out_features, "output features", t));
      s.roles[i] = ShardRole::kColumn;
      for (size_t c : chain) {
        s.roles[c] = ShardRole::kShardLocal;
        assigned[c] = true;
      }
      const size_t p = position[partner];
      s.roles[p] = ShardRole::kRow;
      assigned[p] = true;
    } else if (g.node_parameter_count(first) >= o.min_shard_parameters) {
      PIPESHARD_RETURN_IF_ERROR(check_divides(first, first.out_features, "output features", t));
      s.roles[i] = ShardRole::kColumnGather;
    }
  }
  return Status::ok();
}

int64_t sharded_parameter_elements(const Graph& g, int t, const StagePlan& s) {
  int64_t total = 0;
  std::set<int> seen;  // a tensor two nodes share, once
  for (size_t i = 0; i < s.nodes.size(); ++i) {
    const Node& n = g.nodes[s.nodes[i]];
    for (int p : g.node_params(n)) {
      if (!seen.insert(p).second) continue;
      const int64_t e = g.params[p].elements();
      const bool split_weight = p == n.weight && s.roles[i] != ShardRole::kReplicated;
      const bool split_bias =
          p == n.bias && (s.roles[i] == ShardRole::kColumn || s.roles[i] == ShardRole::kColumnGather);
      total += (split_weight || split_bias) ? e / t : e;
    }
  }
  return total;
}

}  // namespace pipeshard
