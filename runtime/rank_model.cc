#include "runtime/rank_model.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <unordered_map>

#include "partitioner/stage_writer.h"

namespace pipeshard {
namespace {

constexpr int kGatherTag = 7;

int64_t product(const std::vector<int64_t>& dims, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= dims[i];
  return p;
}

template <typename T>
std::unordered_map<std::string, int> index_by_name(const std::vector<T>& items) {
  std::unordered_map<std::string, int> m;
  for (size_t i = 0; i < items.size(); ++i) m.emplace(items[i].name, static_cast<int>(i));
  return m;
}

std::string shape_list(const std::vector<TensorSpec>& specs) {
  std::string s;
  for (const TensorSpec& t : specs) s += (s.empty() ? "" : ", ") + t.name + " " + t.shape.to_string();
  return s.empty() ? "nothing" : s;
}

}  // namespace

RankModel RankModel::whole(const Graph& graph, const ProcessLayout& layout) {
  PIPESHARD_CHECK(layout.stages == 1 && layout.shards == 1);
  RankModel r;
  r.full_ = &graph;
  r.layout_ = layout;
  r.whole_ = true;
  r.input_needs_grad_.assign(graph.inputs.size(), false);
  for (size_t i = 0; i < graph.nodes.size(); ++i) r.model_node_ids_.push_back(i);
  r.stage_params_.resize(1);
  for (size_t p = 0; p < graph.params.size(); ++p) {
    r.full_param_.push_back(static_cast<int>(p));
    r.shard_axis_.push_back(-1);
    r.stage_params_[0].push_back(static_cast<int>(p));
  }
  return r;
}

// What RankModel::create works from: the whole model, its plan, and which piece of the
// plan (stage, or model chunk) each node is in.
struct RankModel::Cut {
  const Graph& g;
  const Plan& plan;
  std::vector<int> piece_of;     // [whole-model nodes]
  std::vector<bool> needs_grad;  // [whole-model values]: a trainable parameter is upstream
};

namespace {

// Appends `part` to `into`, every index moved past what `into` holds.
void append_graph(Graph& into, const Graph& part) {
  const int values = static_cast<int>(into.values.size()), nodes = static_cast<int>(into.nodes.size());
  const int params = static_cast<int>(into.params.size());
  if (into.values.empty()) {
    into.name = part.name;
    into.opset = part.opset;
  }
  for (Value v : part.values) {
    if (v.producer >= 0) v.producer += nodes;
    for (int& c : v.consumers) c += nodes;
    into.values.push_back(std::move(v));
  }
  for (Node n : part.nodes) {
    for (int& v : n.inputs) v += values;
    for (int& v : n.outputs) v += values;
    for (int* p : {&n.weight, &n.bias, &n.running_mean, &n.running_var}) {
      if (*p >= 0) *p += params;
    }
    into.nodes.push_back(std::move(n));
  }
  into.params.insert(into.params.end(), part.params.begin(), part.params.end());
  for (int v : part.inputs) into.inputs.push_back(v + values);
  for (int v : part.outputs) into.outputs.push_back(v + values);
}

}  // namespace

Result<RankModel> RankModel::create(const ImportedModel& model, const ProcessLayout& layout, PartitionOptions options) {
  const Graph& g = model.graph;
  options.stages = layout.stages;
  options.tensor_parallel = layout.shards;
  Result<Plan> plan = make_plan(g, model.path, options);
  if (!plan) return plan.status();
  if (layout.stages == 1 && layout.shards == 1 && plan->stages.size() == 1) return whole(g, layout);

  RankModel r;
  r.full_ = &g;
  r.whole_ = false;
  r.layout_ = layout;
  r.model_chunks_.clear();
  r.incoming_.clear();
  r.outgoing_.clear();
  Cut cut{g, *plan, std::vector<int>(g.nodes.size(), -1), {}};
  for (const StagePlan& s : plan->stages)
    for (int n : s.nodes) cut.piece_of[n] = s.stage;
  // Gradients flow back to a value when a trainable parameter is upstream of it.
  cut.needs_grad.assign(g.values.size(), false);
  for (const Node& n : g.nodes) {
    bool upstream = false;
    for (int p : g.node_params(n)) upstream = upstream || g.params[p].trainable;
    for (int in : n.inputs) upstream = upstream || cut.needs_grad[in];
    for (int out : n.outputs) cut.needs_grad[out] = upstream;
  }
  PIPESHARD_RETURN_IF_ERROR(r.place_parameters(cut));
  const bool chunked = plan->chunks_per_stage > 1;
  for (const StagePlan& piece : plan->stages) {
    if (piece.holder != layout.stage) continue;
    Result<std::shared_ptr<onnx::ModelProto>> proto = build_stage_model(model, *plan, piece.stage, layout.shard);
    if (!proto) return proto.status();
    const std::string label = model.path + " (" + (chunked ? "chunk " : "stage ") + std::to_string(piece.stage) +
                              ", shard " + std::to_string(layout.shard) + ")";
    Result<ImportedModel> part =
        import_onnx_model(*proto, std::filesystem::path(model.path).parent_path().string(), label);
    if (!part) return part.status().with_context("cutting the stage file");
    PIPESHARD_RETURN_IF_ERROR(r.add_chunk(cut, piece.stage, part->graph, label));
  }
  for (int p : r.stage_params_[layout.stage]) {
    if (std::find(r.full_param_.begin(), r.full_param_.end(), p) == r.full_param_.end()) {
      return Status::error(model.path + " (stage " + std::to_string(layout.stage) + ", shard " +
                           std::to_string(layout.shard) + "): parameter '" + g.params[p].name +
                           "' is missing from the stage");
    }
  }
  // The loss reads output 0 (program/loss.h): the last chunk's outputs go first.
  if (r.model_chunks_.back() == static_cast<int>(plan->stages.size()) - 1 && r.chunks() > 1) {
    std::stable_partition(r.local_.outputs.begin(), r.local_.outputs.end(), [&](int v) {
      const int producer = r.local_.values[v].producer;
      return producer >= 0 && r.node_chunk_[producer] == r.chunks() - 1;
    });
  }
  if (!chunked) r.node_chunk_.clear();
  return r;
}

// Parameters each stage holds (a parameter in two pieces cannot be trained there: its two
// halves of the gradient would never meet).
Status RankModel::place_parameters(const Cut& cut) {
  const Graph& g = cut.g;
  const bool chunked = cut.plan.chunks_per_stage > 1;
  stage_params_.assign(layout_.stages, {});
  std::vector<int> holder(g.params.size(), -1);
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    for (int p : g.node_params(g.nodes[n])) {
      const int s = cut.piece_of[n];
      if (holder[p] >= 0 && holder[p] != s) {
        return Status::invalid("stages", "parameter '" + g.params[p].name + "' is used by " +
                                             (chunked ? "chunks " : "stages ") + std::to_string(holder[p]) + " and " +
                                             std::to_string(s) +
                                             "; weights shared across pipeline stages cannot be trained: use fewer "
                                             "stages");
      }
      if (holder[p] < 0) stage_params_[cut.plan.stages[s].holder].push_back(p);
      holder[p] = s;
    }
  }
  for (auto& list : stage_params_) std::sort(list.begin(), list.end());
  return Status::ok();
}

Status RankModel::add_chunk(const Cut& cut, int c, const Graph& part, const std::string& label) {
  const int j = chunks(), last = static_cast<int>(cut.plan.stages.size()) - 1;
  const int values = static_cast<int>(local_.values.size());
  PIPESHARD_RETURN_IF_ERROR(map_parameters(cut, part, label));
  name_nodes_and_inputs(cut, part);
  std::vector<LinkValue> in, out;
  if (c > 0) {
    Result<std::vector<LinkValue>> links = link(cut, c - 1, part, label);
    if (!links) return links.status();
    in = std::move(*links);
  }
  if (c < last) {
    Result<std::vector<LinkValue>> links = link(cut, c, part, label);
    if (!links) return links.status();
    out = std::move(*links);
  }
  for (auto* side : {&in, &out}) {
    for (LinkValue& l : *side) {
      if (l.local >= 0) l.local += values;
    }
  }
  model_chunks_.push_back(c);
  incoming_.push_back(std::move(in));
  outgoing_.push_back(std::move(out));
  node_chunk_.insert(node_chunk_.end(), part.nodes.size(), j);
  append_graph(local_, part);
  return Status::ok();
}

// The chunk's parameters as (slices of) whole-model ones.
Status RankModel::map_parameters(const Cut& cut, const Graph& part, const std::string& label) {
  const Graph& g = cut.g;
  const auto full_params = index_by_name(g.params);
  for (const Parameter& q : part.params) {
    auto it = full_params.find(q.name);
    if (it == full_params.end()) return Status::error(label + ": parameter '" + q.name + "' is not in the model");
    const Parameter& whole = g.params[it->second];
    int axis = -1;
    if (q.dims != whole.dims) {
      for (size_t a = 0; a < q.dims.size() && q.dims.size() == whole.dims.size(); ++a) {
        if (q.dims[a] == whole.dims[a]) continue;
        if (axis >= 0 || q.dims[a] * layout_.shards != whole.dims[a]) axis = -2;
        if (axis == -1) axis = static_cast<int>(a);
      }
      if (axis < 0) return Status::error(label + ": parameter '" + q.name + "' is no even shard of the model's");
    }
    full_param_.push_back(it->second);
    shard_axis_.push_back(axis);
  }
  return Status::ok();
}

// A local node is the whole model's node that produces the same value: value names are
// unique in ONNX (node names need not be). Nodes the stage writer made (sharded Linears)
// produce values of their own and get ids past the model's. A stage input needs a
// gradient when the whole model's value does.
void RankModel::name_nodes_and_inputs(const Cut& cut, const Graph& part) {
  const Graph& g = cut.g;
  const auto full_values = index_by_name(g.values);
  for (size_t i = 0; i < part.nodes.size(); ++i) {
    auto it = full_values.find(part.values[part.nodes[i].outputs[0]].name);
    const int producer = it != full_values.end() ? g.values[it->second].producer : -1;
    model_node_ids_.push_back(producer >= 0 ? static_cast<uint64_t>(producer)
                                            : g.nodes.size() + model_node_ids_.size());
  }
  for (int v : part.inputs) {
    auto it = full_values.find(part.values[v].name);
    input_needs_grad_.push_back(it != full_values.end() && cut.needs_grad[it->second]);
  }
}

// The values crossing cut c (after piece c): made at or before piece c, read after it
// (the loss reads the model outputs in the last piece), checked against the Plan's; their
// local ids are `part`'s.
Result<std::vector<LinkValue>> RankModel::link(const Cut& cut, int c, const Graph& part,
                                               const std::string& label) const {
  const Graph& g = cut.g;
  std::vector<int> made(g.values.size(), -1), last(g.values.size(), -1);
  for (size_t v = 0; v < g.values.size(); ++v) {
    if (g.values[v].producer >= 0) made[v] = cut.piece_of[g.values[v].producer];
    for (int reader : g.values[v].consumers) last[v] = std::max(last[v], cut.piece_of[reader]);
  }
  for (int v : g.outputs) last[v] = static_cast<int>(cut.plan.stages.size()) - 1;
  const auto full_values = index_by_name(g.values), local_values = index_by_name(part.values);
  std::vector<LinkValue> out;
  std::set<std::string> names;
  for (size_t v = 0; v < g.values.size(); ++v) {
    if (made[v] > c || last[v] <= c) continue;
    LinkValue l{g.values[v].name, g.values[v].shape.per_sample_elements(), cut.needs_grad[v], -1};
    if (auto it = local_values.find(l.name); it != local_values.end()) {
      l.local = it->second;
      if (part.values[l.local].shape.per_sample_elements() != l.per_sample) {
        return Status::error(label + ": value '" + l.name + "' crosses a cut but is sharded in the stage");
      }
    }
    out.push_back(l);
    names.insert(l.name);
  }
  // The Plan says what crosses the cut too; the two must agree, shapes included.
  const StagePlan& s = cut.plan.stages[c];
  std::vector<TensorSpec> planned = s.outputs;
  planned.insert(planned.end(), s.carried.begin(), s.carried.end());
  bool same = planned.size() == out.size();
  for (const TensorSpec& t : planned) {
    auto it = full_values.find(t.name);
    same = same && names.count(t.name) && it != full_values.end() && g.values[it->second].shape == t.shape;
  }
  if (!same) {
    return Status::error(label + ": the values crossing cut " + std::to_string(c) + " do not match the plan (" +
                         shape_list(planned) + ")");
  }
  return out;
}

std::vector<float> RankModel::slice(int local, const std::vector<float>& whole) const {
  const int axis = shard_axis_[local];
  if (axis < 0) return whole;
  const std::vector<int64_t>& fd = full_->params[full_param_[local]].dims;
  const std::vector<int64_t>& ld = graph().params[local].dims;
  const int64_t outer = product(fd, 0, axis), inner = product(fd, axis + 1, fd.size());
  const int64_t width = ld[axis] * inner, full_width = fd[axis] * inner, start = layout_.shard * width;
  std::vector<float> out(static_cast<size_t>(outer * width));
  for (int64_t o = 0; o < outer; ++o) {
    std::copy_n(whole.begin() + o * full_width + start, width, out.begin() + o * width);
  }
  return out;
}

void RankModel::gather(const std::vector<std::vector<float>>& local, std::vector<std::vector<float>>& whole,
                       Communicator& world, Communicator* tensor, bool trainable_only) const {
  const Graph& g = *full_;
  const Graph& mine = graph();
  PIPESHARD_CHECK(local.size() == mine.params.size());
  // Join the shards (every shard of every replica takes part: the groups are collective).
  std::map<int, std::vector<float>> joined;  // whole-model parameter -> data
  for (size_t q = 0; q < local.size(); ++q) {
    const int p = full_param_[q], axis = shard_axis_[q];
    if (trainable_only && !g.params[p].trainable) continue;
    PIPESHARD_CHECK(static_cast<int64_t>(local[q].size()) == mine.params[q].elements(), mine.params[q].name);
    if (axis < 0) {
      joined[p] = local[q];
      continue;
    }
    PIPESHARD_CHECK(tensor != nullptr, "a sharded parameter without a tensor group");
    const int64_t n = static_cast<int64_t>(local[q].size()), shards = tensor->size();
    std::vector<float> all(static_cast<size_t>(n * shards));
    tensor->all_gather(local[q].data(), all.data(), n);
    const std::vector<int64_t>& fd = g.params[p].dims;
    const int64_t outer = product(fd, 0, axis), inner = product(fd, axis + 1, fd.size());
    const int64_t width = mine.params[q].dims[axis] * inner, full_width = width * shards;
    std::vector<float>& out = joined[p];
    out.assign(static_cast<size_t>(outer * full_width), 0.0f);
    for (int64_t s = 0; s < shards; ++s)
      for (int64_t o = 0; o < outer; ++o)
        std::copy_n(all.begin() + s * n + o * width, width, out.begin() + o * full_width + s * width);
  }
  auto travels = [&](int p) { return !trainable_only || g.params[p].trainable; };
  const int P = layout_.stages;
  if (world.rank() == 0) {
    whole.assign(g.params.size(), {});
    for (auto& [p, data] : joined) whole[p] = std::move(data);
    for (int s = 1; s < P; ++s) {
      const int source = layout_.rank_of(s, 0, 0);
      for (int p : stage_params_[s]) {
        if (!travels(p)) continue;
        whole[p].resize(static_cast<size_t>(g.params[p].elements()));
        world.recv(whole[p].data(), g.params[p].elements(), source, kGatherTag);
      }
    }
  } else if (layout_.replica == 0 && layout_.shard == 0) {
    for (int p : stage_params_[layout_.stage]) {
      if (!travels(p)) continue;
      world.send(joined.at(p).data(), g.params[p].elements(), 0, kGatherTag);
    }
  }
}

}  // namespace pipeshard
