#include "partitioner/stage_writer.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <queue>
#include <set>
#include <unordered_map>

#include <onnx/onnx_pb.h>

namespace pipeshard {
namespace fs = std::filesystem;
namespace {

// Which Graph node (if any) each source ONNX node belongs to.
std::vector<int> onnx_owner(const Graph& g, int onnx_nodes) {
  std::vector<int> owner(onnx_nodes, -1);
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    for (int o : g.nodes[i].onnx_nodes) owner[o] = static_cast<int>(i);
  }
  return owner;
}

void set_value_info(onnx::ValueInfoProto* vi, const TensorSpec& s) {
  vi->set_name(s.name);
  auto* tt = vi->mutable_type()->mutable_tensor_type();
  tt->set_elem_type(onnx::TensorProto::FLOAT);
  for (int64_t d : s.shape.dims) {
    auto* dim = tt->mutable_shape()->add_dim();
    if (d == kBatch)
      dim->set_dim_param("batch");
    else
      dim->set_dim_value(d);
  }
}

onnx::TensorProto float_tensor(const std::string& name, std::vector<int64_t> dims, const std::vector<float>& data) {
  onnx::TensorProto t;
  t.set_name(name);
  t.set_data_type(onnx::TensorProto::FLOAT);
  for (int64_t d : dims) t.add_dims(d);
  t.set_raw_data(std::string(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float)));
  return t;
}

// Rows [r0, r1) and columns [c0, c1) of a row-major [rows, cols] matrix.
std::vector<float> slice(const std::vector<float>& m, int64_t cols, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  std::vector<float> out;
  out.reserve(static_cast<size_t>((r1 - r0) * (c1 - c0)));
  for (int64_t r = r0; r < r1; ++r) {
    out.insert(out.end(), m.begin() + r * cols + c0, m.begin() + r * cols + c1);
  }
  return out;
}

// Topological order of `nodes` by the names they produce and read; among ready nodes
// the earliest in `nodes` goes first, so an already sorted list is kept as it is.
std::vector<onnx::NodeProto> sort_nodes(std::vector<onnx::NodeProto> nodes) {
  std::unordered_map<std::string, size_t> made_by;
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (const auto& o : nodes[i].output()) made_by[o] = i;
  }
  std::vector<int> pending(nodes.size(), 0);
  std::vector<std::vector<size_t>> readers(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (const auto& in : nodes[i].input()) {
      auto it = made_by.find(in);
      if (in.empty() || it == made_by.end()) continue;
      ++pending[i];
      readers[it->second].push_back(i);
    }
  }
  std::priority_queue<size_t, std::vector<size_t>, std::greater<size_t>> ready;
  for (size_t i = 0; i < nodes.size(); ++i)
    if (pending[i] == 0) ready.push(i);
  std::vector<onnx::NodeProto> out;
  while (!ready.empty()) {
    size_t i = ready.top();
    ready.pop();
    out.push_back(std::move(nodes[i]));
    for (size_t r : readers[i])
      if (--pending[r] == 0) ready.push(r);
  }
  PIPESHARD_CHECK(out.size() == nodes.size(), "stage nodes form a cycle");
  return out;
}

// Collects a stage's ONNX nodes and initializers.
class StageBuilder {
 public:
  explicit StageBuilder(const ImportedModel& m)
      : g_(m.graph), src_(m.source->graph()), owner_(onnx_owner(m.graph, src_.node_size())) {
    for (int i = 0; i < src_.node_size(); ++i) {
      for (const auto& o : src_.node(i).output()) producer_[o] = i;
    }
    for (int i = 0; i < src_.initializer_size(); ++i) initializer_[src_.initializer(i).name()] = i;
  }

  // Copies a Graph node's source ONNX nodes as written.
  void copy_node(int node) {
    for (int o : g_.nodes[node].onnx_nodes) add_source(o);
  }

  // Adds a generated node; `reads` names initializers it uses (added separately).
  void add_generated(onnx::NodeProto n) { nodes_.push_back(std::move(n)); }
  void add_initializer(onnx::TensorProto t) {
    if (added_inits_.insert(t.name()).second) inits_.push_back(std::move(t));
  }

  void finish(onnx::GraphProto* out) {
    // Inputs that are initializers or come from nodes outside any layer (Constant,
    // Identity) are brought along; the rest are stage inputs.
    for (size_t i = 0; i < nodes_.size(); ++i) {
      const auto inputs = nodes_[i].input();  // a copy: bring() may grow nodes_
      for (const auto& in : inputs) bring(in);
    }
    for (auto& n : sort_nodes(std::move(nodes_))) *out->add_node() = std::move(n);
    for (auto& t : inits_) *out->add_initializer() = std::move(t);
  }

 private:
  void add_source(int o) {
    if (copied_.insert(o).second) nodes_.push_back(src_.node(o));
  }
  void bring(const std::string& name) {
    if (name.empty() || added_inits_.count(name)) return;
    if (auto it = initializer_.find(name); it != initializer_.end()) {
      add_initializer(src_.initializer(it->second));
      return;
    }
    auto p = producer_.find(name);
    if (p != producer_.end() && owner_[p->second] < 0 && !copied_.count(p->second)) {
      add_source(p->second);
      const auto inputs = src_.node(p->second).input();
      for (const auto& in : inputs) bring(in);
    }
  }

  const Graph& g_;
  const onnx::GraphProto& src_;
  std::vector<int> owner_;
  std::unordered_map<std::string, int> producer_, initializer_;
  std::set<int> copied_;
  std::set<std::string> added_inits_;
  std::vector<onnx::NodeProto> nodes_;
  std::vector<onnx::TensorProto> inits_;
};

onnx::NodeProto make_node(const std::string& op, const std::string& name, std::vector<std::string> in,
                          std::vector<std::string> out, const std::string& domain = "") {
  onnx::NodeProto n;
  n.set_op_type(op);
  n.set_name(name);
  if (!domain.empty()) n.set_domain(domain);
  for (auto& s : in) n.add_input(s);
  for (auto& s : out) n.add_output(s);
  return n;
}

void add_int_attr(onnx::NodeProto& n, const char* name, int64_t v) {
  auto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INT);
  a->set_i(v);
}

void add_float_attr(onnx::NodeProto& n, const char* name, float v) {
  auto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::FLOAT);
  a->set_f(v);
}

// Emits rank `t`'s slice of a split Linear.
Status emit_sharded_linear(const Graph& g, const Node& n, ShardRole role, int t, int shards, StageBuilder& b) {
  const Parameter& w = g.params[n.weight];
  const bool out_in = n.layout == WeightLayout::kOutIn;
  const int64_t rows = w.dims[0], cols = w.dims[1];
  const bool by_output = role != ShardRole::kRow;
  const int64_t width = by_output ? n.out_features : n.in_features;
  const int64_t lo = width / shards * t, hi = width / shards * (t + 1);
  // Output features are rows of [out,in] and columns of [in,out]; input features the reverse.
  const bool slice_rows = by_output == out_in;
  std::vector<float> wdata = slice_rows ? slice(w.data, cols, lo, hi, 0, cols) : slice(w.data, cols, 0, rows, lo, hi);
  std::vector<int64_t> wdims = slice_rows ? std::vector<int64_t>{hi - lo, cols} : std::vector<int64_t>{rows, hi - lo};
  b.add_initializer(float_tensor(w.name, wdims, wdata));

  const std::string x = g.values[n.inputs[0]].name, y = g.values[n.outputs[0]].name;
  const std::string tag = n.name + "/tp" + std::to_string(t);
  std::string bias;
  if (n.bias >= 0 && by_output) {
    const Parameter& bp = g.params[n.bias];
    b.add_initializer(float_tensor(bp.name, {hi - lo}, std::vector<float>(bp.data.begin() + lo, bp.data.begin() + hi)));
    bias = bp.name;
  }
  const std::string local = role == ShardRole::kColumn ? y : y + "/shard";
  if (g.values[n.inputs[0]].shape.rank() != 2 && (n.alpha != 1.0f || n.beta != 1.0f)) {
    return Status::error("node '" + n.name + "' (Linear): alpha/beta on inputs of rank > 2 cannot be sharded");
  }
  if (g.values[n.inputs[0]].shape.rank() == 2) {
    std::vector<std::string> in = {x, w.name};
    if (!bias.empty()) in.push_back(bias);
    auto gemm = make_node("Gemm", tag + "/Gemm", in, {local});
    add_int_attr(gemm, "transB", out_in ? 1 : 0);
    add_float_attr(gemm, "alpha", n.alpha);
    add_float_attr(gemm, "beta", n.beta);
    b.add_generated(gemm);
  } else {
    std::string weight = w.name;
    if (out_in) {
      weight = w.name + "/T";
      b.add_generated(make_node("Transpose", tag + "/Transpose", {w.name}, {weight}));
    }
    const std::string mm = bias.empty() ? local : tag + "/MatMul_output";
    b.add_generated(make_node("MatMul", tag + "/MatMul", {x, weight}, {mm}));
    if (!bias.empty()) b.add_generated(make_node("Add", tag + "/Add", {mm, bias}, {local}));
  }
  if (role == ShardRole::kColumnGather) {
    auto gather = make_node("AllGather", tag + "/AllGather", {local}, {y}, "pipeshard");
    add_int_attr(gather, "shards", shards);
    add_int_attr(gather, "axis", -1);
    b.add_generated(gather);
  } else if (role == ShardRole::kRow) {
    if (n.bias >= 0 && n.beta != 1.0f) {
      return Status::error("node '" + n.name + "' (Linear): a row-parallel layer with beta != 1 is not supported");
    }
    const std::string reduced = n.bias >= 0 ? y + "/reduced" : y;
    auto reduce = make_node("AllReduce", tag + "/AllReduce", {local}, {reduced}, "pipeshard");
    add_int_attr(reduce, "shards", shards);
    b.add_generated(reduce);
    if (n.bias >= 0) {
      const Parameter& bp = g.params[n.bias];
      b.add_initializer(float_tensor(bp.name, bp.dims, bp.data));
      b.add_generated(make_node("Add", tag + "/AddBias", {reduced, bp.name}, {y}));
    }
  }
  return Status::ok();
}

}  // namespace

Result<std::shared_ptr<onnx::ModelProto>> build_stage_model(const ImportedModel& model, const Plan& plan, int stage,
                                                            int tp_rank) {
  const StagePlan& s = plan.stages.at(stage);
  const Graph& g = model.graph;
  const int shards = plan.options.tensor_parallel;
  StageBuilder b(model);
  for (size_t i = 0; i < s.nodes.size(); ++i) {
    const ShardRole role = s.roles[i];
    if (role == ShardRole::kColumn || role == ShardRole::kRow || role == ShardRole::kColumnGather) {
      PIPESHARD_RETURN_IF_ERROR(emit_sharded_linear(g, g.nodes[s.nodes[i]], role, tp_rank, shards, b));
    } else {
      b.copy_node(s.nodes[i]);
    }
  }
  auto out = std::make_shared<onnx::ModelProto>();
  const onnx::ModelProto& src = *model.source;
  out->set_ir_version(src.ir_version());
  *out->mutable_opset_import() = src.opset_import();
  if (shards > 1) {
    auto* imp = out->add_opset_import();
    imp->set_domain("pipeshard");
    imp->set_version(1);
  }
  out->set_producer_name("pipeshard");
  out->set_doc_string(
      "stage " + std::to_string(stage) + " of " + std::to_string(plan.stages.size()) + " cut from " + plan.model +
      (shards > 1 ? ", tensor-parallel rank " + std::to_string(tp_rank) + " of " + std::to_string(shards)
                  : std::string()));
  auto* graph = out->mutable_graph();
  graph->set_name(src.graph().name() + "_stage" + std::to_string(stage) +
                  (shards > 1 ? "_tp" + std::to_string(tp_rank) : std::string()));
  for (const auto& in : s.inputs) set_value_info(graph->add_input(), in);
  for (const auto& o : s.outputs) set_value_info(graph->add_output(), o);
  b.finish(graph);
  return out;
}

Status write_partition(const ImportedModel& model, const Plan& plan, const std::string& dir, int64_t inline_limit) {
  std::vector<std::pair<std::string, std::vector<std::string>>> files;  // path, its bytes in pieces
  std::vector<std::pair<std::string, ModelFiles>> models;               // for their stale data
  for (const StagePlan& s : plan.stages) {
    for (size_t t = 0; t < s.files.size(); ++t) {
      auto m = build_stage_model(model, plan, s.stage, static_cast<int>(t));
      if (!m) return m.status();
      const std::string path = (fs::path(dir) / s.files[t]).string();
      Result<ModelFiles> bytes = serialize_model(**m, path, inline_limit);
      if (!bytes) return bytes.status().with_context(s.files[t]);
      m->reset();  // its weights now live in bytes->data
      if (!bytes->data_name.empty())
        files.emplace_back((fs::path(dir) / bytes->data_name).string(), std::move(bytes->data));
      files.emplace_back(path, std::vector<std::string>{std::move(bytes->model)});
      models.emplace_back(path, std::move(*bytes));
    }
  }
  files.emplace_back((fs::path(dir) / "plan.json").string(),
                     std::vector<std::string>{plan_json_text(plan, model.graph)});
  // Nothing may be left half-written: first every file goes to a temporary beside its
  // target, then every target is checked, and only then is anything renamed.
  std::error_code ec;
  const bool created = !fs::exists(dir, ec);
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) return Status::error("cannot create output folder '" + dir + "'");
  std::vector<std::string> temporaries;
  auto abandon = [&](const Status& why) {
    for (const auto& t : temporaries) fs::remove(t, ec);
    if (created) fs::remove_all(dir, ec);
    return why;
  };
  for (const auto& [path, bytes] : files) {
    const std::string tmp = path + ".partial";
    temporaries.push_back(tmp);
    if (Status s = write_file_synced(tmp, bytes); !s) return abandon(s);
    if (fs::exists(path, ec) && !fs::is_regular_file(path, ec)) {
      return abandon(Status::error("cannot write '" + path + "': something other than a file is in the way"));
    }
  }
  for (size_t i = 0; i < files.size(); ++i) {
    if (std::rename(temporaries[i].c_str(), files[i].first.c_str()) != 0) {
      return abandon(Status::error("cannot write '" + files[i].first + "'"));
    }
  }
  for (const auto& [path, written] : models) remove_stale_data(path, written);
  return Status::ok();
}

}  // namespace pipeshard
