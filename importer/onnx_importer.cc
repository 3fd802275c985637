// The import driver: structural checks on the ONNX graph (opset, every value defined
// once, no cycles, inputs float32 with a batch dimension), then the recognisers
// (onnx_patterns.cc) and shape inference (shape_inference.cc).
#include "importer/onnx_importer.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <queue>
#include <unordered_set>

#include "importer/import_context.h"

namespace pipeshard {
namespace detail {

std::string ImportContext::resolve(const std::string& name) const {
  // Aliases come from Identity nodes, which check_structure has proven acyclic.
  std::string n = name;
  for (auto it = alias.find(n); it != alias.end(); it = alias.find(n)) n = it->second;
  return n;
}

std::optional<double> ImportContext::scalar(const std::string& name) const {
  auto it = constants.find(resolve(name));
  if (it == constants.end() || it->second.values.size() != 1) return std::nullopt;
  return it->second.values[0];
}

std::vector<int> ImportContext::consumers_of(const std::string& name) const {
  auto it = class_consumers.find(resolve(name));
  return it == class_consumers.end() ? std::vector<int>() : it->second;
}

void ImportContext::merge_alias_consumers() {
  class_consumers.clear();
  for (const auto& [name, readers] : consumers) {
    auto& merged = class_consumers[resolve(name)];
    for (int r : readers) {
      const auto& n = node(r);
      const bool folded_identity = n.op_type() == "Identity" && alias.count(n.output(0));
      if (!folded_identity) merged.push_back(r);
    }
  }
  for (auto& [name, readers] : class_consumers) {
    std::sort(readers.begin(), readers.end());
    readers.erase(std::unique(readers.begin(), readers.end()), readers.end());
  }
}

bool ImportContext::is_graph_output(const std::string& name) const {
  for (const auto& o : graph_outputs) {
    if (resolve(o) == name) return true;
  }
  return false;
}

std::string ImportContext::describe(int i) const {
  const auto& n = node(i);
  if (n.name().empty() && n.output_size() == 0) return "node #" + std::to_string(i) + " (" + n.op_type() + ")";
  const std::string& name = n.name().empty() ? n.output(0) : n.name();
  return "node '" + name + "' (" + n.op_type() + ")";
}

int ImportContext::value_id(const std::string& name) {
  auto [it, inserted] = value_ids.try_emplace(name, static_cast<int>(graph.values.size()));
  if (inserted) graph.values.push_back(Value{name, {}, -1, {}});
  return it->second;
}

Result<int> ImportContext::param_id(const std::string& raw_name, bool trainable) {
  std::string name = resolve(raw_name);
  auto it = param_ids.find(name);
  if (it != param_ids.end() && graph.params[it->second].trainable != trainable) {
    // One tensor in two roles: exporters fold equal initializers into one, so a fresh
    // BatchNorm's running variance may be an Identity of its scale. Statistics must
    // not update the weight: give the second role its own copy, named as the node
    // reads it (the Identity's output), which is where it is written back.
    if (raw_name != name) {
      name = raw_name;
    } else if (!trainable) {
      name.append(".running");
    }
    it = param_ids.find(name);
    if (it == param_ids.end()) {
      const int id = static_cast<int>(graph.params.size());
      Parameter copy = graph.params[param_ids.at(resolve(raw_name))];
      copy.name = name;
      copy.trainable = trainable;
      graph.params.push_back(std::move(copy));
      param_ids[name] = id;
      return id;
    }
  }
  if (it != param_ids.end()) return it->second;
  auto data = float_data.find(name);
  if (data == float_data.end()) {
    auto c = constants.find(name);
    if (c != constants.end() && c->second.data_type == onnx::TensorProto::DOUBLE) {
      return Status::error("initializer '" + name +
                           "' is float64; pipeshard trains float32 models (call model.float() before exporting)");
    }
    return Status::error("'" + name + "' is not a float32 initializer");
  }
  const int id = static_cast<int>(graph.params.size());
  graph.params.push_back(Parameter{name, float_dims[name], data->second, trainable});
  param_ids[name] = id;
  return id;
}

void ImportContext::emit(Node node) {
  for (int i : node.onnx_nodes) consumed[i] = true;
  emitted.push_back(std::move(node));
}

void ImportContext::finalize_nodes() {
  // Emission follows the anchors of the patterns, which is nearly but not always a
  // topological order of the results: order by value dependencies, earliest emitted
  // first among the ready ones (Kahn with a min-heap).
  std::vector<int> made_by(graph.values.size(), -1);
  for (size_t n = 0; n < emitted.size(); ++n) {
    for (int v : emitted[n].outputs) made_by[v] = static_cast<int>(n);
  }
  std::vector<int> pending(emitted.size(), 0);
  std::vector<std::vector<int>> readers(emitted.size());
  for (size_t n = 0; n < emitted.size(); ++n) {
    for (int v : emitted[n].inputs) {
      if (made_by[v] < 0) continue;
      ++pending[n];
      readers[made_by[v]].push_back(static_cast<int>(n));
    }
  }
  std::priority_queue<int, std::vector<int>, std::greater<int>> ready;
  for (size_t n = 0; n < emitted.size(); ++n)
    if (pending[n] == 0) ready.push(static_cast<int>(n));
  while (!ready.empty()) {
    const int n = ready.top();
    ready.pop();
    const int id = static_cast<int>(graph.nodes.size());
    for (int v : emitted[n].inputs) graph.values[v].consumers.push_back(id);
    for (int v : emitted[n].outputs) graph.values[v].producer = id;
    graph.nodes.push_back(std::move(emitted[n]));
    for (int r : readers[n])
      if (--pending[r] == 0) ready.push(r);
  }
  PIPESHARD_CHECK(graph.nodes.size() == emitted.size(), "recognised nodes form a cycle");
  emitted.clear();
}

}  // namespace detail

namespace {

using detail::ImportContext;

Result<int64_t> default_opset(const onnx::ModelProto& model) {
  int64_t opset = -1;
  for (const auto& imp : model.opset_import()) {
    if (imp.domain().empty() || imp.domain() == "ai.onnx") opset = imp.version();
  }
  if (opset < 0) return Status::error("the model imports no opset of the default ONNX domain");
  if (opset < kMinOpset || opset > kMaxOpset) {
    return Status::error("opset " + std::to_string(opset) + " is not supported (pipeshard knows opsets " +
                         std::to_string(kMinOpset) + " to " + std::to_string(kMaxOpset) + ")");
  }
  return opset;
}

// Producer/consumer tables; every value defined exactly once; no cycles (Kahn).
Status check_structure(ImportContext& ctx) {
  const auto& g = *ctx.onnx_graph;
  std::unordered_set<std::string> defined;
  for (const auto& t : g.initializer()) defined.insert(t.name());
  for (const auto& in : g.input()) defined.insert(in.name());
  for (int i = 0; i < g.node_size(); ++i) {
    // Recognisers read output(0), and input(0) of every op but Constant.
    if (g.node(i).output_size() == 0 || g.node(i).output(0).empty()) return ctx.node_error(i, "has no output");
    if (g.node(i).op_type() != "Constant" && (g.node(i).input_size() == 0 || g.node(i).input(0).empty())) {
      return ctx.node_error(i, "has no input");
    }
    for (const auto& out : g.node(i).output()) {
      if (out.empty()) continue;
      if (ctx.producer.count(out) || defined.count(out)) {
        return ctx.node_error(i, "value '" + out + "' is defined more than once");
      }
      ctx.producer[out] = i;
    }
  }
  for (int i = 0; i < g.node_size(); ++i) {
    for (const auto& in : g.node(i).input()) {
      if (in.empty()) continue;  // an omitted optional input
      if (!defined.count(in) && !ctx.producer.count(in)) {
        return ctx.node_error(
            i, "input '" + in + "' is not defined by any node, input or initializer (missing initializer?)");
      }
      ctx.consumers[in].push_back(i);
    }
  }
  // Kahn's algorithm over node dependencies.
  std::vector<int> pending(g.node_size(), 0);
  std::vector<std::vector<int>> dependents(g.node_size());
  for (int i = 0; i < g.node_size(); ++i) {
    for (const auto& in : g.node(i).input()) {
      auto p = ctx.producer.find(in);
      if (p != ctx.producer.end()) {
        ++pending[i];
        dependents[p->second].push_back(i);
      }
    }
  }
  // A min-heap keeps the file's order wherever the file is already sorted.
  std::priority_queue<int, std::vector<int>, std::greater<int>> ready;
  for (int i = 0; i < g.node_size(); ++i)
    if (pending[i] == 0) ready.push(i);
  while (!ready.empty()) {
    int i = ready.top();
    ready.pop();
    ctx.topo_order.push_back(i);
    for (int d : dependents[i])
      if (--pending[d] == 0) ready.push(d);
  }
  if (static_cast<int>(ctx.topo_order.size()) != g.node_size()) {
    for (int i = 0; i < g.node_size(); ++i) {
      if (pending[i] > 0) return ctx.node_error(i, "the graph has a cycle through this node");
    }
  }
  for (const auto& out : g.output()) {
    if (!ctx.producer.count(out.name()) && !defined.count(out.name())) {
      return Status::error("graph output '" + out.name() + "' is not produced by any node");
    }
    ctx.graph_outputs.push_back(out.name());
  }
  if (g.output_size() == 0) return Status::error("the graph has no outputs");
  return Status::ok();
}

// Graph inputs (those that are not initializers): float32, dim 0 the batch.
Status import_inputs(ImportContext& ctx) {
  for (const auto& in : ctx.onnx_graph->input()) {
    if (ctx.constants.count(in.name()) || ctx.float_data.count(in.name())) continue;  // old-style initializer inputs
    const std::string what = "input '" + in.name() + "'";
    if (!in.type().has_tensor_type()) return Status::error(what + " is not a tensor");
    const auto& tt = in.type().tensor_type();
    if (tt.elem_type() != onnx::TensorProto::FLOAT) {
      return Status::error(what + " has element type " + detail::dtype_label(tt.elem_type()) +
                           "; pipeshard needs float32 inputs (call model.float() before exporting)");
    }
    if (!tt.has_shape() || tt.shape().dim_size() < 2) {
      return Status::error(what + " needs a shape [batch, features...] of rank 2 or more");
    }
    Shape shape{{kBatch}};
    int64_t per_sample = 1;
    for (int d = 1; d < tt.shape().dim_size(); ++d) {
      const auto& dim = tt.shape().dim(d);
      if (!dim.has_dim_value() || dim.dim_value() <= 0) {
        return Status::error(what + " dimension " + std::to_string(d) +
                             " must be a fixed positive size (only the batch may be symbolic)");
      }
      if (per_sample > kMaxTensorElements / dim.dim_value()) {
        return Status::error(what + " has dims needing more than 2^32 elements per sample");
      }
      per_sample *= dim.dim_value();
      shape.dims.push_back(dim.dim_value());
    }
    const int id = ctx.value_id(in.name());
    ctx.graph.values[id].shape = shape;
    ctx.graph.inputs.push_back(id);
  }
  if (ctx.graph.inputs.empty()) return Status::error("the model has no non-initializer input");
  return Status::ok();
}

// A weight that is inf or NaN makes every loss and gradient through it one too: training
// or evaluating the model could only fail later, after writing metrics. Refused here, where
// every tool reads a model, naming the first such element.
Status check_finite_parameters(const Graph& g) {
  for (const Parameter& p : g.params) {
    const auto bad = std::find_if(p.data.begin(), p.data.end(), [](float v) { return !std::isfinite(v); });
    if (bad == p.data.end()) continue;
    std::string dims;
    for (int64_t d : p.dims) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    const char* what = std::isnan(*bad) ? "NaN" : *bad > 0 ? "inf" : "-inf";
    return Status::error("initializer '" + p.name + "' [" + dims + "] holds " + what + " at flat index " +
                         std::to_string(bad - p.data.begin()) + "; a model's weights must be finite numbers");
  }
  return Status::ok();
}

}  // namespace

Result<ImportedModel> import_onnx_model(std::shared_ptr<onnx::ModelProto> model, const std::string& base_dir,
                                        const std::string& label) {
  auto fail = [&](const Status& s) -> Result<ImportedModel> { return s.with_context(label); };
  if (!model->has_graph() || model->ir_version() <= 0) {
    return fail(Status::error("not an ONNX model (no graph or IR version)"));
  }
  if (model->graph().node_size() == 0) return fail(Status::error("the graph has no nodes"));
  Result<int64_t> opset = default_opset(*model);
  if (!opset) return fail(opset.status());

  ImportContext ctx;
  ctx.onnx_graph = &model->graph();
  ctx.label = label;
  ctx.opset = *opset;
  ctx.consumed.assign(model->graph().node_size(), false);
  ctx.graph.name = model->graph().name();
  ctx.graph.opset = *opset;
  if (Status s = detail::load_constants(*model, base_dir, ctx); !s) return fail(s);
  if (Status s = check_structure(ctx); !s) return fail(s);
  if (Status s = import_inputs(ctx); !s) return fail(s);
  if (Status s = detail::recognise_nodes(ctx); !s) return fail(s);
  if (Status s = check_finite_parameters(ctx.graph); !s) return fail(s);
  if (Status s = detail::infer_shapes(ctx); !s) return fail(s);

  ImportedModel out;
  out.graph = std::move(ctx.graph);
  out.source = std::move(model);
  out.path = label;
  return out;
}

}  // namespace pipeshard
