// Recognising concepts in ONNX nodes. Exporters spell one concept many ways; each
// recogniser here turns one family of spellings into one Graph node:
//
//   Linear      Gemm | MatMul [+ Add bias] | either with a Transpose of the weight
//   GELU, SiLU  elementwise regions (Div/Erf/Add/Mul..., Mul/Tanh/..., x*Sigmoid(x))
//               found around their anchor op and verified numerically, so operand
//               order, x*x*x versus Pow(x,3) and constant placement do not matter
//   LayerNorm   ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div[/Mul/Add] | LayerNormalization
//   the rest    one ONNX op each
//
// Layers of other networks (convolutions, pooling, recurrent layers) are refused first, at
// the layer; then pass 1 runs the multi-node recognisers at their anchors, and pass 2 maps
// what is left one to one and refuses anything else, naming the node.
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>

#include "importer/import_context.h"
#include "importer/onnx_importer.h"

namespace pipeshard::detail {
namespace {

using onnx::NodeProto;

bool is_default_domain(const NodeProto& n) { return n.domain().empty() || n.domain() == "ai.onnx"; }

bool is_op(const ImportContext& ctx, int i, const char* op) {
  return i >= 0 && is_default_domain(ctx.node(i)) && ctx.node(i).op_type() == op;
}

const onnx::AttributeProto* find_attr(const NodeProto& n, const char* name) {
  for (const auto& a : n.attribute())
    if (a.name() == name) return &a;
  return nullptr;
}
int64_t attr_int(const NodeProto& n, const char* name, int64_t fallback) {
  const auto* a = find_attr(n, name);
  return a ? a->i() : fallback;
}
float attr_float(const NodeProto& n, const char* name, float fallback) {
  const auto* a = find_attr(n, name);
  return a ? a->f() : fallback;
}
// An axis attribute. The value is an int64 in the file; one beyond int's range is no axis
// of any tensor, and narrowing it could turn it into a valid one (2^32 - 1 into -1).
Result<int> attr_axis(const ImportContext& ctx, int i, int64_t fallback) {
  const int64_t axis = attr_int(ctx.node(i), "axis", fallback);
  if (axis < std::numeric_limits<int>::min() || axis > std::numeric_limits<int>::max()) {
    return ctx.node_error(i, "axis " + std::to_string(axis) + " is out of range");
  }
  return static_cast<int>(axis);
}
std::string attr_string(const NodeProto& n, const char* name, const std::string& fallback) {
  const auto* a = find_attr(n, name);
  return a ? a->s() : fallback;
}

// The one node consuming `name`, when it is not also a graph output; else -1.
int sole_consumer(const ImportContext& ctx, const std::string& name) {
  auto c = ctx.consumers_of(name);
  return (c.size() == 1 && !ctx.is_graph_output(name)) ? c[0] : -1;
}

int producer_of(const ImportContext& ctx, const std::string& name) {
  auto it = ctx.producer.find(ctx.resolve(name));
  return it == ctx.producer.end() ? -1 : it->second;
}

// ---------------------------------------------------------------------------------
// Elementwise regions.

bool is_elementwise_op(const ImportContext& ctx, int i) {
  static const std::set<std::string> kOps = {"Add", "Sub",  "Mul",     "Div",  "Pow",
                                             "Erf", "Tanh", "Sigmoid", "Sqrt", "Cast"};
  return i >= 0 && is_default_domain(ctx.node(i)) && kOps.count(ctx.node(i).op_type()) > 0;
}

struct Region {
  std::string x, y;     // the single activation input and the output
  std::set<int> nodes;  // ONNX nodes computing y from x and scalar constants
};

// Nodes between x and y, or nullopt when y depends on anything but x and scalars.
std::optional<std::set<int>> region_between(const ImportContext& ctx, const std::string& x, const std::string& y) {
  std::set<int> nodes;
  std::vector<std::string> stack = {y};
  std::set<std::string> seen;
  while (!stack.empty()) {
    std::string v = ctx.resolve(stack.back());
    stack.pop_back();
    if (v == x || !seen.insert(v).second) continue;
    if (ctx.scalar(v)) continue;
    int p = producer_of(ctx, v);
    if (!is_elementwise_op(ctx, p) || ctx.consumed[p]) return std::nullopt;
    nodes.insert(p);
    if (nodes.size() > 16) return std::nullopt;
    for (const auto& in : ctx.node(p).input()) stack.push_back(in);
  }
  // Closed: nothing computed inside is used outside, except y.
  for (int n : nodes) {
    for (const auto& out : ctx.node(n).output()) {
      if (ctx.resolve(out) == ctx.resolve(y)) continue;
      if (ctx.is_graph_output(out)) return std::nullopt;
      for (int c : ctx.consumers_of(out))
        if (!nodes.count(c)) return std::nullopt;
    }
  }
  return nodes;
}

// Evaluates the region at x = t in double precision.
std::optional<double> evaluate(const ImportContext& ctx, const std::string& x, const std::string& v_raw, double t) {
  const std::string v = ctx.resolve(v_raw);
  if (v == x) return t;
  if (auto s = ctx.scalar(v)) return *s;
  int p = producer_of(ctx, v);
  if (p < 0) return std::nullopt;
  const NodeProto& n = ctx.node(p);
  std::vector<double> a;
  for (const auto& in : n.input()) {
    auto r = evaluate(ctx, x, in, t);
    if (!r) return std::nullopt;
    a.push_back(*r);
  }
  const std::string& op = n.op_type();
  if (a.size() == 2) {
    if (op == "Add") return a[0] + a[1];
    if (op == "Sub") return a[0] - a[1];
    if (op == "Mul") return a[0] * a[1];
    if (op == "Div") return a[0] / a[1];
    if (op == "Pow") return std::pow(a[0], a[1]);
  } else if (a.size() == 1) {
    if (op == "Erf") return std::erf(a[0]);
    if (op == "Tanh") return std::tanh(a[0]);
    if (op == "Sigmoid") return 1.0 / (1.0 + std::exp(-a[0]));
    if (op == "Sqrt") return std::sqrt(a[0]);
    if (op == "Cast") return a[0];
  }
  return std::nullopt;
}

bool computes(const ImportContext& ctx, const Region& r, const std::function<double(double)>& f) {
  for (double t : {-4.0, -2.2, -1.0, -0.3, 0.0, 0.15, 0.8, 1.7, 3.5}) {
    auto got = evaluate(ctx, r.x, r.y, t);
    const double want = f(t);
    if (!got || !(std::fabs(*got - want) <= 1e-6 + 1e-5 * std::fabs(want))) return false;
  }
  return true;
}

// Values reachable from `start` by walking `depth` elementwise steps in one direction.
std::vector<std::string> nearby_values(const ImportContext& ctx, int anchor, bool forward, int depth) {
  std::vector<std::string> out;
  std::vector<int> frontier = {anchor};
  std::set<int> seen = {anchor};
  for (int d = 0; d < depth && !frontier.empty(); ++d) {
    std::vector<int> next;
    for (int n : frontier) {
      const auto& names = forward ? ctx.node(n).output() : ctx.node(n).input();
      for (const auto& v : names) {
        if (v.empty() || ctx.scalar(v)) continue;
        out.push_back(ctx.resolve(v));
        std::vector<int> steps = forward ? ctx.consumers_of(v) : std::vector<int>{producer_of(ctx, v)};
        for (int s : steps) {
          if (is_elementwise_op(ctx, s) && seen.insert(s).second) next.push_back(s);
        }
      }
    }
    frontier = next;
  }
  return out;
}

// The largest closed region around `anchor` computing f, if any.
std::optional<Region> match_function(const ImportContext& ctx, int anchor, const std::function<double(double)>& f) {
  std::optional<Region> best;
  for (const auto& x : nearby_values(ctx, anchor, false, 6)) {
    for (const auto& y : nearby_values(ctx, anchor, true, 6)) {
      auto nodes = region_between(ctx, x, y);
      if (!nodes || !nodes->count(anchor)) continue;
      Region r{x, y, *nodes};
      if ((!best || r.nodes.size() > best->nodes.size()) && computes(ctx, r, f)) best = r;
    }
  }
  return best;
}

double gelu_exact(double t) { return 0.5 * t * (1.0 + std::erf(t / std::sqrt(2.0))); }
double gelu_tanh(double t) { return 0.5 * t * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (t + 0.044715 * t * t * t))); }
double silu(double t) { return t / (1.0 + std::exp(-t)); }

void emit_activation(ImportContext& ctx, const Region& r, ActivationKind kind, int anchor) {
  Node node;
  node.name = ctx.node(anchor).name().empty() ? r.y : ctx.node(anchor).name();
  node.kind = OpKind::kActivation;
  node.activation = kind;
  node.inputs = {ctx.value_id(r.x)};
  node.outputs = {ctx.value_id(ctx.resolve(r.y))};
  node.onnx_nodes.assign(r.nodes.begin(), r.nodes.end());
  ctx.emit(std::move(node));
}

// ---------------------------------------------------------------------------------
// Linear.

// The initializer a weight input stands for, and whether a Transpose node sits between
// (which flips the layout). Fills `extra` with the Transpose node.
Result<std::pair<std::string, bool>> weight_source(const ImportContext& ctx, int at, const std::string& input,
                                                   std::vector<int>& extra) {
  if (ctx.is_float_initializer(input)) return std::make_pair(ctx.resolve(input), false);
  if (auto c = ctx.constants.find(ctx.resolve(input)); c != ctx.constants.end()) {
    return ctx.node_error(at, "weight '" + ctx.resolve(input) + "' is " + dtype_label(c->second.data_type) +
                                  "; pipeshard trains float32 models (call model.float() before exporting)");
  }
  int p = producer_of(ctx, input);
  if (is_op(ctx, p, "Transpose") && ctx.is_float_initializer(ctx.node(p).input(0))) {
    const auto* perm = find_attr(ctx.node(p), "perm");
    if (perm && !(perm->ints_size() == 2 && perm->ints(0) == 1 && perm->ints(1) == 0)) {
      return ctx.node_error(p, "only a 2-D transpose of a weight is supported");
    }
    extra.push_back(p);
    return std::make_pair(ctx.resolve(ctx.node(p).input(0)), true);
  }
  return ctx.node_error(at, "input '" + input +
                                "' is not a weight initializer; pipeshard supports "
                                "Linear layers (activation times a constant weight), not products of activations");
}

Status emit_linear(ImportContext& ctx, int at, const std::string& x, const std::string& w_input, bool transposed_in_op,
                   const std::string& bias, std::vector<int> onnx_nodes, float alpha, float beta,
                   const std::string& output) {
  auto src = weight_source(ctx, at, w_input, onnx_nodes);
  if (!src) return src.status();
  const auto& [w_name, flipped] = *src;
  const std::vector<int64_t> dims = ctx.float_dims.count(w_name) ? ctx.float_dims.at(w_name) : std::vector<int64_t>{};
  if (dims.size() != 2 || dims[0] == 0 || dims[1] == 0) {
    return ctx.node_error(at, "weight '" + w_name + "' must be a non-empty 2-D matrix");
  }
  Node node;
  node.name = ctx.node(at).name().empty() ? output : ctx.node(at).name();
  node.kind = OpKind::kLinear;
  node.layout = (transposed_in_op != flipped) ? WeightLayout::kOutIn : WeightLayout::kInOut;
  node.out_features = node.layout == WeightLayout::kOutIn ? dims[0] : dims[1];
  node.in_features = node.layout == WeightLayout::kOutIn ? dims[1] : dims[0];
  node.alpha = alpha;
  node.beta = beta;
  Result<int> w = ctx.param_id(w_name, true);
  if (!w) return w.status().with_context(ctx.describe(at));
  node.weight = *w;
  if (!bias.empty()) {
    Result<int> b = ctx.param_id(bias, true);
    if (!b) return b.status().with_context(ctx.describe(at));
    const auto& bdims = ctx.graph.params[*b].dims;
    const bool row = bdims.size() == 1 || (bdims.size() == 2 && bdims[0] == 1);
    if (ctx.graph.params[*b].elements() != node.out_features) {
      return ctx.node_error(at, "bias '" + bias + "' has " + std::to_string(ctx.graph.params[*b].elements()) +
                                    " elements, the layer has " + std::to_string(node.out_features) + " outputs");
    }
    if (!row) {
      return ctx.node_error(at, "bias '" + bias + "' must be a row [" + std::to_string(node.out_features) +
                                    "] or [1, " + std::to_string(node.out_features) + "], not a column");
    }
    node.bias = *b;
  }
  node.inputs = {ctx.value_id(ctx.resolve(x))};
  node.outputs = {ctx.value_id(ctx.resolve(output))};
  node.onnx_nodes = std::move(onnx_nodes);
  ctx.emit(std::move(node));
  return Status::ok();
}

Status recognise_gemm(ImportContext& ctx, int i) {
  const NodeProto& n = ctx.node(i);
  if (n.input_size() < 2) return ctx.node_error(i, "Gemm needs inputs A and B");
  if (attr_int(n, "transA", 0) != 0) return ctx.node_error(i, "transA=1 is not supported (the activation must be A)");
  if (ctx.is_constant(n.input(0))) return ctx.node_error(i, "input A must be an activation, not a constant");
  const std::string bias = n.input_size() > 2 ? n.input(2) : "";
  return emit_linear(ctx, i, n.input(0), n.input(1), attr_int(n, "transB", 0) == 1, bias, {i},
                     attr_float(n, "alpha", 1.0f), attr_float(n, "beta", 1.0f), n.output(0));
}

Status recognise_matmul(ImportContext& ctx, int i) {
  const NodeProto& n = ctx.node(i);
  if (n.input_size() != 2) return ctx.node_error(i, "MatMul needs two inputs");
  if (ctx.is_constant(n.input(0))) return ctx.node_error(i, "the first input must be an activation, not a constant");
  std::vector<int> nodes = {i};
  std::string bias, output = n.output(0);
  int add = sole_consumer(ctx, n.output(0));
  if (is_op(ctx, add, "Add") && ctx.node(add).input_size() == 2) {
    const NodeProto& a = ctx.node(add);
    const std::string other = ctx.resolve(a.input(0)) == ctx.resolve(n.output(0)) ? a.input(1) : a.input(0);
    auto dims = ctx.float_dims.find(ctx.resolve(other));
    if (ctx.is_float_initializer(other) && dims != ctx.float_dims.end() && dims->second.size() == 1) {
      bias = other;
      output = a.output(0);
      nodes.push_back(add);
    }
  }
  return emit_linear(ctx, i, n.input(0), n.input(1), false, bias, nodes, 1.0f, 1.0f, output);
}

// ---------------------------------------------------------------------------------
// LayerNorm, decomposed: mean = ReduceMean(x); d = x - mean; v = ReduceMean(d^2);
// y = d / Sqrt(v + eps) [* gamma + beta].

bool reduces_last_axis(const ImportContext& ctx, int i) {
  const NodeProto& n = ctx.node(i);
  if (attr_int(n, "keepdims", 1) != 1) return false;
  std::vector<double> axes;
  if (const auto* a = find_attr(n, "axes")) {
    for (int64_t v : a->ints()) axes.push_back(static_cast<double>(v));
  } else if (n.input_size() > 1 && ctx.constants.count(ctx.resolve(n.input(1)))) {
    axes = ctx.constants.at(ctx.resolve(n.input(1))).values;
  }
  return axes.size() == 1 && axes[0] == -1;  // last axis; a positive axis is checked against the rank later
}

std::optional<std::string> other_operand(const ImportContext& ctx, int i, const std::string& v) {
  const NodeProto& n = ctx.node(i);
  if (n.input_size() != 2) return std::nullopt;
  if (ctx.resolve(n.input(0)) == ctx.resolve(v)) return n.input(1);
  if (ctx.resolve(n.input(1)) == ctx.resolve(v)) return n.input(0);
  return std::nullopt;
}

bool recognise_layernorm_pattern(ImportContext& ctx, int r1) {
  const std::string x = ctx.resolve(ctx.node(r1).input(0));
  if (!reduces_last_axis(ctx, r1) || ctx.is_constant(x)) return false;
  std::vector<int> nodes = {r1};
  const std::string mean = ctx.node(r1).output(0);
  int sub = sole_consumer(ctx, mean);
  if (!is_op(ctx, sub, "Sub") || ctx.resolve(ctx.node(sub).input(0)) != x) return false;
  nodes.push_back(sub);
  const std::string d = ctx.node(sub).output(0);
  auto dc = ctx.consumers_of(d);
  if (dc.size() != 2 || ctx.is_graph_output(d)) return false;
  int pow = is_op(ctx, dc[0], "Pow") ? dc[0] : dc[1];
  int div = pow == dc[0] ? dc[1] : dc[0];
  // A Pow with one input (a corrupt file) has no exponent to read: it squares nothing.
  if (!is_op(ctx, pow, "Pow") || ctx.node(pow).input_size() != 2 || ctx.scalar(ctx.node(pow).input(1)) != 2.0 ||
      !is_op(ctx, div, "Div")) {
    return false;
  }
  int r2 = sole_consumer(ctx, ctx.node(pow).output(0));
  if (!is_op(ctx, r2, "ReduceMean") || !reduces_last_axis(ctx, r2)) return false;
  int add = sole_consumer(ctx, ctx.node(r2).output(0));
  if (!is_op(ctx, add, "Add")) return false;
  auto eps_name = other_operand(ctx, add, ctx.node(r2).output(0));
  auto eps = eps_name ? ctx.scalar(*eps_name) : std::nullopt;
  int sqrt = sole_consumer(ctx, ctx.node(add).output(0));
  if (!eps || !is_op(ctx, sqrt, "Sqrt") || sole_consumer(ctx, ctx.node(sqrt).output(0)) != div) return false;
  if (ctx.resolve(ctx.node(div).input(0)) != ctx.resolve(d)) return false;
  nodes.insert(nodes.end(), {pow, r2, add, sqrt, div});
  Node node;
  node.kind = OpKind::kLayerNorm;
  node.name = ctx.node(r1).name();
  node.epsilon = static_cast<float>(*eps);
  std::string out = ctx.node(div).output(0);
  // Optional affine part: Mul by a float initializer, then Add of one.
  int mul = sole_consumer(ctx, out);
  auto gamma = is_op(ctx, mul, "Mul") ? other_operand(ctx, mul, out) : std::nullopt;
  if (gamma && ctx.is_float_initializer(*gamma)) {
    node.weight = *ctx.param_id(*gamma, true);
    nodes.push_back(mul);
    out = ctx.node(mul).output(0);
    int badd = sole_consumer(ctx, out);
    auto beta = is_op(ctx, badd, "Add") ? other_operand(ctx, badd, out) : std::nullopt;
    if (beta && ctx.is_float_initializer(*beta)) {
      node.bias = *ctx.param_id(*beta, true);
      nodes.push_back(badd);
      out = ctx.node(badd).output(0);
    }
  }
  node.inputs = {ctx.value_id(x)};
  node.outputs = {ctx.value_id(ctx.resolve(out))};
  node.onnx_nodes = nodes;
  ctx.emit(std::move(node));
  return true;
}

// ---------------------------------------------------------------------------------
// One-to-one ops.

Result<int> optional_param(ImportContext& ctx, int i, int input, bool trainable) {
  const NodeProto& n = ctx.node(i);
  if (n.input_size() <= input || n.input(input).empty()) return -1;
  Result<int> p = ctx.param_id(n.input(input), trainable);
  if (!p) return p.status().with_context(ctx.describe(i));
  return p;
}

// ---- one ONNX node, one Graph node: a recogniser per op type ----

// Each fills in `node` (name, inputs and outputs are set) for ONNX node i, or says why not.
using Recogniser = Status (*)(ImportContext& ctx, int i, Node& node);

// AllReduce and AllGather of the pipeshard domain (sharded stage files). A row-parallel
// Linear adds its bias after the reduction: the Add that does is part of the node.
Status recognise_collective(ImportContext& ctx, int i, Node& node) {
  const NodeProto& n = ctx.node(i);
  node.kind = n.op_type() == "AllReduce" ? OpKind::kAllReduce : OpKind::kAllGather;
  node.shards = attr_int(n, "shards", 0);
  if (node.shards < 1) return ctx.node_error(i, "needs a positive 'shards' attribute");
  int add = node.kind == OpKind::kAllReduce ? sole_consumer(ctx, n.output(0)) : -1;
  auto bias = is_op(ctx, add, "Add") ? other_operand(ctx, add, n.output(0)) : std::nullopt;
  if (bias && ctx.is_float_initializer(*bias)) {
    Result<int> b = ctx.param_id(*bias, true);
    if (!b) return b.status().with_context(ctx.describe(add));
    node.bias = *b;
    node.outputs = {ctx.value_id(ctx.resolve(ctx.node(add).output(0)))};
    node.onnx_nodes.push_back(add);
  }
  return Status::ok();
}

Status recognise_activation(ImportContext& ctx, int i, Node& node) {
  static const std::map<std::string, ActivationKind> kActivations = {{"Relu", ActivationKind::kRelu},
                                                                     {"LeakyRelu", ActivationKind::kLeakyRelu},
                                                                     {"Sigmoid", ActivationKind::kSigmoid},
                                                                     {"Tanh", ActivationKind::kTanh}};
  const NodeProto& n = ctx.node(i);
  node.kind = OpKind::kActivation;
  node.activation = kActivations.at(n.op_type());
  if (n.op_type() == "LeakyRelu") node.alpha = attr_float(n, "alpha", 0.01f);
  return Status::ok();
}

Status recognise_gelu(ImportContext& ctx, int i, Node& node) {
  node.kind = OpKind::kActivation;
  const std::string approx = attr_string(ctx.node(i), "approximate", "none");
  if (approx != "none" && approx != "tanh") return ctx.node_error(i, "unknown approximate='" + approx + "'");
  node.activation = approx == "tanh" ? ActivationKind::kGeluTanh : ActivationKind::kGelu;
  return Status::ok();
}

Status recognise_softmax(ImportContext& ctx, int i, Node& node) {
  node.kind = ctx.node(i).op_type() == "Softmax" ? OpKind::kSoftmax : OpKind::kLogSoftmax;
  Result<int> axis = attr_axis(ctx, i, ctx.opset >= 13 ? -1 : 1);
  if (!axis) return axis.status();
  node.axis = *axis;
  return Status::ok();
}

Status recognise_layernorm(ImportContext& ctx, int i, Node& node) {
  node.kind = OpKind::kLayerNorm;
  Result<int> axis = attr_axis(ctx, i, -1);
  if (!axis) return axis.status();
  node.axis = *axis;
  node.epsilon = attr_float(ctx.node(i), "epsilon", 1e-5f);
  Result<int> w = optional_param(ctx, i, 1, true), b = optional_param(ctx, i, 2, true);
  if (!w) return w.status();
  if (!b) return b.status();
  node.weight = *w;
  node.bias = *b;
  return Status::ok();
}

Status recognise_batchnorm(ImportContext& ctx, int i, Node& node) {
  const NodeProto& n = ctx.node(i);
  if (n.input_size() != 5) return ctx.node_error(i, "needs 5 inputs (X, scale, B, mean, var)");
  node.kind = OpKind::kBatchNorm;
  node.epsilon = attr_float(n, "epsilon", 1e-5f);
  node.momentum = attr_float(n, "momentum", 0.9f);
  node.training = attr_int(n, "training_mode", 0) == 1;
  int* slots[] = {&node.weight, &node.bias, &node.running_mean, &node.running_var};
  for (int k = 0; k < 4; ++k) {
    Result<int> p = optional_param(ctx, i, k + 1, k < 2);
    if (!p) return p.status();
    *slots[k] = *p;
  }
  return Status::ok();
}

Status recognise_dropout(ImportContext& ctx, int i, Node& node) {
  const NodeProto& n = ctx.node(i);
  node.kind = OpKind::kDropout;
  node.ratio = attr_float(n, "ratio", 0.5f);
  if (n.input_size() > 1 && !n.input(1).empty()) {
    auto r = ctx.scalar(n.input(1));
    if (!r) return ctx.node_error(i, "the ratio must be a constant scalar");
    node.ratio = static_cast<float>(*r);
  }
  if (n.input_size() > 2 && !n.input(2).empty()) {
    auto t = ctx.scalar(n.input(2));
    if (!t) return ctx.node_error(i, "training_mode must be a constant");
    node.training = *t != 0.0;
  }
  if (!(node.ratio >= 0.0f && node.ratio < 1.0f)) return ctx.node_error(i, "ratio must be in [0, 1)");
  return Status::ok();
}

Status recognise_flatten(ImportContext& ctx, int i, Node& node) {
  node.kind = OpKind::kReshape;
  node.target = {0, -1};
  Result<int> axis = attr_axis(ctx, i, 1);  // checked against the rank in shape inference
  if (!axis) return axis.status();
  node.axis = *axis;
  return Status::ok();
}

Status recognise_reshape(ImportContext& ctx, int i, Node& node) {
  const NodeProto& n = ctx.node(i);
  if (n.input_size() != 2 || !ctx.constants.count(ctx.resolve(n.input(1)))) {
    return ctx.node_error(i, "the target shape must be a constant");
  }
  const ConstantTensor& target = ctx.constants.at(ctx.resolve(n.input(1)));
  if (target.data_type != onnx::TensorProto::INT64) {
    return ctx.node_error(i, "the target shape is " + dtype_label(target.data_type) + "; ONNX shapes are int64");
  }
  node.kind = OpKind::kReshape;
  node.axis = 1;
  for (double v : target.values) {
    // Constants are decoded to double; converting one beyond int64's range back is
    // undefined. Shape inference refuses any dimension beyond 2^32 anyway.
    if (std::fabs(v) > static_cast<double>(kMaxTensorElements)) {
      return ctx.node_error(i, "a target dimension is beyond 2^32 (corrupt shape constant?)");
    }
    node.target.push_back(static_cast<int64_t>(v));
  }
  if (attr_int(n, "allowzero", 0) == 1) {
    for (int64_t v : node.target)
      if (v == 0) return ctx.node_error(i, "allowzero=1 with a zero dimension is not supported");
  }
  return Status::ok();
}

Status recognise_add(ImportContext& ctx, int i, Node& node) {
  const NodeProto& n = ctx.node(i);
  if (n.input_size() != 2 || ctx.is_constant(n.input(1))) {
    return ctx.node_error(i, "Add of a constant is supported only as a Linear's bias");
  }
  node.kind = OpKind::kAdd;
  node.inputs.push_back(ctx.value_id(ctx.resolve(n.input(1))));
  return Status::ok();
}

// The ONNX ops of the default domain that map to one node each.
constexpr const char* kWhatImports =
    "pipeshard imports MLP layers (Gemm, MatMul, Relu, LeakyRelu, Sigmoid, Tanh, GELU, SiLU, Softmax, LogSoftmax, "
    "LayerNorm, BatchNormalization, Dropout, Flatten, Reshape, Add, Identity, Constant)";

// Layers of other kinds of network, by ONNX op: what each is. A model with one is refused
// at that layer, before any other node is looked at: the Unsqueeze that feeds a Conv1d its
// channel axis is not what its exporter needs to hear about.
const std::map<std::string, const char*>& layers_of_other_networks() {
  static const std::map<std::string, const char*> kLayers = {
      {"Conv", "a convolution"},
      {"ConvTranspose", "a transposed convolution"},
      {"ConvInteger", "a quantized convolution"},
      {"QLinearConv", "a quantized convolution"},
      {"DeformConv", "a deformable convolution"},
      {"MaxPool", "pooling"},
      {"AveragePool", "pooling"},
      {"LpPool", "pooling"},
      {"GlobalMaxPool", "pooling"},
      {"GlobalAveragePool", "pooling"},
      {"GlobalLpPool", "pooling"},
      {"MaxRoiPool", "pooling"},
      {"RoiAlign", "pooling"},
      {"RNN", "a recurrent layer"},
      {"GRU", "a recurrent layer"},
      {"LSTM", "a recurrent layer"},
      {"Attention", "attention"},
      {"InstanceNormalization", "instance normalisation (of convolution channels)"},
      {"GroupNormalization", "group normalisation (of convolution channels)"},
      {"LRN", "local response normalisation (of convolution channels)"}};
  return kLayers;
}

Status refuse_layers_of_other_networks(const ImportContext& ctx) {
  for (int i : ctx.topo_order) {
    const NodeProto& n = ctx.node(i);
    if (!is_default_domain(n)) continue;
    auto it = layers_of_other_networks().find(n.op_type());
    if (it != layers_of_other_networks().end()) {
      return ctx.node_error(i, std::string(it->second) + ", which pipeshard does not train; " + kWhatImports);
    }
  }
  return Status::ok();
}

const std::map<std::string, Recogniser>& single_node_ops() {
  static const std::map<std::string, Recogniser> kOps = {{"Relu", recognise_activation},
                                                         {"LeakyRelu", recognise_activation},
                                                         {"Sigmoid", recognise_activation},
                                                         {"Tanh", recognise_activation},
                                                         {"Gelu", recognise_gelu},
                                                         {"Softmax", recognise_softmax},
                                                         {"LogSoftmax", recognise_softmax},
                                                         {"LayerNormalization", recognise_layernorm},
                                                         {"BatchNormalization", recognise_batchnorm},
                                                         {"Dropout", recognise_dropout},
                                                         {"Flatten", recognise_flatten},
                                                         {"Reshape", recognise_reshape},
                                                         {"Add", recognise_add}};
  return kOps;
}

Status recognise_single(ImportContext& ctx, int i) {
  const NodeProto& n = ctx.node(i);
  const std::string& op = n.op_type();
  Node node;
  node.name = n.name().empty() ? n.output(0) : n.name();
  node.onnx_nodes = {i};
  if (n.input_size() == 0 || n.input(0).empty()) return ctx.node_error(i, "has no data input");
  if (ctx.is_constant(n.input(0))) {
    return ctx.node_error(i, "operates on a constant; pipeshard expects layers applied to activations");
  }
  node.inputs = {ctx.value_id(ctx.resolve(n.input(0)))};
  node.outputs = {ctx.value_id(ctx.resolve(n.output(0)))};
  Recogniser recognise = nullptr;
  if (n.domain() == "pipeshard" && (op == "AllReduce" || op == "AllGather")) {
    recognise = recognise_collective;
  } else if (!is_default_domain(n)) {
    return ctx.node_error(i, "operator domain '" + n.domain() + "' is not supported");
  } else if (auto it = single_node_ops().find(op); it != single_node_ops().end()) {
    recognise = it->second;
  } else {
    return ctx.node_error(i, std::string("unsupported operator; ") + kWhatImports);
  }
  PIPESHARD_RETURN_IF_ERROR(recognise(ctx, i, node));
  ctx.emit(std::move(node));
  return Status::ok();
}

// Identity renames a value; Constant, and Transpose of a weight, are folded into the
// layers that use them.
void mark_auxiliary(ImportContext& ctx) {
  for (int i : ctx.topo_order) {
    const NodeProto& n = ctx.node(i);
    if (!is_default_domain(n)) continue;
    if (n.op_type() == "Identity" && n.input_size() == 1 && n.output_size() == 1) {
      ctx.alias[n.output(0)] = n.input(0);
      ctx.consumed[i] = true;
    } else if (n.op_type() == "Constant") {
      ctx.consumed[i] = true;
    }
  }
  ctx.merge_alias_consumers();
}

}  // namespace

Status recognise_nodes(ImportContext& ctx) {
  PIPESHARD_RETURN_IF_ERROR(refuse_layers_of_other_networks(ctx));
  mark_auxiliary(ctx);
  // Pass 1: multi-node concepts at their anchors.
  for (int i : ctx.topo_order) {
    if (ctx.consumed[i]) continue;
    std::optional<Region> r;
    if (is_op(ctx, i, "Erf")) {
      if (!(r = match_function(ctx, i, gelu_exact)))
        return ctx.node_error(i, "Erf outside a GELU pattern is not supported");
      emit_activation(ctx, *r, ActivationKind::kGelu, i);
    } else if (is_op(ctx, i, "Tanh") && (r = match_function(ctx, i, gelu_tanh))) {
      emit_activation(ctx, *r, ActivationKind::kGeluTanh, i);
    } else if (is_op(ctx, i, "Sigmoid") && (r = match_function(ctx, i, silu))) {
      emit_activation(ctx, *r, ActivationKind::kSilu, i);
    } else if (is_op(ctx, i, "ReduceMean")) {
      if (!recognise_layernorm_pattern(ctx, i))
        return ctx.node_error(i, "ReduceMean outside a LayerNorm pattern is not supported");
    } else if (is_op(ctx, i, "Gemm")) {
      PIPESHARD_RETURN_IF_ERROR(recognise_gemm(ctx, i));
    } else if (is_op(ctx, i, "MatMul")) {
      PIPESHARD_RETURN_IF_ERROR(recognise_matmul(ctx, i));
    }
  }
  // Pass 2: everything else, one to one. A Transpose folded into a Linear is consumed.
  for (int i : ctx.topo_order) {
    if (!ctx.consumed[i]) PIPESHARD_RETURN_IF_ERROR(recognise_single(ctx, i));
  }
  ctx.finalize_nodes();
  for (const auto& out : ctx.graph_outputs) {
    auto it = ctx.value_ids.find(ctx.resolve(out));
    if (it == ctx.value_ids.end()) return Status::error("graph output '" + out + "' is not computed by any layer");
    ctx.graph.outputs.push_back(it->second);
  }
  return Status::ok();
}

}  // namespace pipeshard::detail
