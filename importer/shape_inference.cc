// Shape inference on the Graph: every value gets a shape with a symbolic batch, each
// layer's widths are checked against its parameters, and shapes the file declares
// (graph outputs, value_info) are checked against what the layers produce.
#include <algorithm>
#include <unordered_map>

#include "importer/import_context.h"
#include "importer/onnx_importer.h"

namespace pipeshard::detail {
namespace {

std::string node_label(const Node& n) { return "node '" + n.name + "' (" + op_kind_name(n) + ")"; }

Status expect_vector(const Graph& g, int param, int64_t size, const Node& n, const char* role) {
  if (param < 0) return Status::ok();
  const Parameter& p = g.params[param];
  if (p.elements() != size) {
    return Status::error(node_label(n) + ": " + role + " '" + p.name + "' has " + std::to_string(p.elements()) +
                         " elements, the layer needs " + std::to_string(size));
  }
  return Status::ok();
}

// Resolves a Reshape's target as written (0 = copy, -1 = infer) against `in`, with
// dim 0 standing for the batch.
Result<std::vector<int64_t>> reshape_target(const Node& n, const Shape& in) {
  const auto& spec = n.target;
  if (spec.size() < 2) return Status::error(node_label(n) + ": the target shape must keep the batch and at least one feature dimension");
  if (!(spec[0] == -1 || spec[0] == 0 || spec[0] > 0)) {
    return Status::error(node_label(n) + ": the first target dimension must keep the batch");
  }
  std::vector<int64_t> out;
  int infer_at = -1;
  int64_t known = 1;
  for (size_t k = 1; k < spec.size(); ++k) {
    int64_t d = spec[k];
    if (d == 0) {
      if (static_cast<int>(k) >= in.rank()) return Status::error(node_label(n) + ": copies a dimension the input lacks");
      d = in.dims[k];
    }
    if (d == -1) {
      if (infer_at >= 0) return Status::error(node_label(n) + ": more than one -1 in the target shape");
      infer_at = static_cast<int>(out.size());
    } else if (d <= 0 || d > kMaxTensorElements) {
      return Status::error(node_label(n) + ": invalid target dimension " + std::to_string(d));
    } else {
      if (known > kMaxTensorElements / d) return Status::error(node_label(n) + ": target shape needs more than 2^32 elements per sample");
      known *= d;
    }
    out.push_back(d);
  }
  const int64_t per_sample = in.per_sample_elements();
  if (infer_at >= 0) {
    if (known == 0 || per_sample % known) {
      return Status::error(node_label(n) + ": cannot reshape " + in.to_string() + " keeping the batch");
    }
    out[infer_at] = per_sample / known;
  } else if (known != per_sample) {
    // A batch written as -1 or fixed by the exporter: the rest must hold one sample.
    return Status::error(node_label(n) + ": shape mismatch: reshape of " + in.to_string() + " to " +
                         std::to_string(known) + " elements per sample");
  }
  return out;
}

int normalise_axis(int axis, int rank) { return axis < 0 ? axis + rank : axis; }

Result<Shape> infer_node(Graph& g, Node& n) {
  const Shape in = g.values[n.inputs[0]].shape;
  auto fail = [&](const std::string& m) { return Status::error(node_label(n) + ": " + m); };
  switch (n.kind) {
    case OpKind::kLinear: {
      if (in.features() != n.in_features) {
        return fail("shape mismatch: input " + in.to_string() + " has " + std::to_string(in.features()) +
                    " features, weight '" + g.params[n.weight].name + "' expects " + std::to_string(n.in_features));
      }
      Shape out = in;
      out.dims.back() = n.out_features;
      return out;
    }
    case OpKind::kSoftmax:
    case OpKind::kLogSoftmax:
      n.axis = normalise_axis(n.axis, in.rank());
      if (n.axis != in.rank() - 1) return fail("only the last axis is supported, got axis " + std::to_string(n.axis));
      return in;
    case OpKind::kLayerNorm:
      if (normalise_axis(n.axis, in.rank()) != in.rank() - 1) return fail("only normalisation over the last axis is supported");
      n.axis = in.rank() - 1;
      PIPESHARD_RETURN_IF_ERROR(expect_vector(g, n.weight, in.features(), n, "scale"));
      PIPESHARD_RETURN_IF_ERROR(expect_vector(g, n.bias, in.features(), n, "bias"));
      return in;
    case OpKind::kBatchNorm: {
      const int64_t channels = in.dims[1];
      for (int p : {n.weight, n.bias, n.running_mean, n.running_var}) {
        PIPESHARD_RETURN_IF_ERROR(expect_vector(g, p, channels, n, "parameter"));
      }
      return in;
    }
    case OpKind::kReshape: {
      if (normalise_axis(n.axis, in.rank()) != 1) {
        return fail("only Flatten with axis=1 (keep the batch) is supported, got axis " + std::to_string(n.axis) +
                    " of a rank-" + std::to_string(in.rank()) + " input");
      }
      Result<std::vector<int64_t>> t = reshape_target(n, in);
      if (!t) return t.status();
      n.target = *t;
      Shape out{{kBatch}};
      out.dims.insert(out.dims.end(), n.target.begin(), n.target.end());
      return out;
    }
    case OpKind::kAdd: {
      const Shape& other = g.values[n.inputs[1]].shape;
      if (!(other == in)) return fail("shape mismatch: adds " + in.to_string() + " and " + other.to_string());
      return in;
    }
    case OpKind::kAllGather: {
      Shape out = in;
      if (n.shards > kMaxTensorElements / std::max<int64_t>(out.dims.back(), 1)) return fail("shards=" + std::to_string(n.shards) + " would gather more than 2^32 features");
      out.dims.back() *= n.shards;
      return out;
    }
    case OpKind::kActivation:
    case OpKind::kDropout:
    case OpKind::kAllReduce:
      return in;
  }
  return in;
}

// Shapes the file declares for a value: non-batch dims with a fixed size.
std::optional<std::vector<int64_t>> declared_dims(const onnx::ValueInfoProto& vi) {
  if (!vi.type().has_tensor_type() || !vi.type().tensor_type().has_shape()) return std::nullopt;
  std::vector<int64_t> dims;
  for (const auto& d : vi.type().tensor_type().shape().dim()) dims.push_back(d.has_dim_value() ? d.dim_value() : -1);
  return dims;
}

Status check_declared(const ImportContext& ctx, const onnx::ValueInfoProto& vi) {
  auto it = ctx.value_ids.find(ctx.resolve(vi.name()));
  auto dims = declared_dims(vi);
  if (it == ctx.value_ids.end() || !dims) return Status::ok();
  const Shape& s = ctx.graph.values[it->second].shape;
  if (dims->empty()) {
    return Status::error("shape mismatch: '" + vi.name() + "' is declared as a scalar but the layers produce " + s.to_string());
  }
  bool same = static_cast<int>(dims->size()) == s.rank();
  for (int k = 1; same && k < s.rank(); ++k) same = (*dims)[k] < 0 || (*dims)[k] == s.dims[k];
  if (!same) {
    Shape declared{*dims};
    declared.dims[0] = kBatch;
    return Status::error("shape mismatch: '" + vi.name() + "' is declared " + declared.to_string() +
                         " but the layers produce " + s.to_string());
  }
  return Status::ok();
}

}  // namespace

Status infer_shapes(ImportContext& ctx) {
  Graph& g = ctx.graph;
  for (Node& n : g.nodes) {
    Result<Shape> out = infer_node(g, n);
    if (!out) return out.status();
    if (out->per_sample_elements() > kMaxTensorElements) {
      return Status::error(node_label(n) + ": output needs more than 2^32 elements per sample");
    }
    g.values[n.outputs[0]].shape = *out;
  }
  for (const auto& vi : ctx.onnx_graph->output()) PIPESHARD_RETURN_IF_ERROR(check_declared(ctx, vi));
  for (const auto& vi : ctx.onnx_graph->value_info()) PIPESHARD_RETURN_IF_ERROR(check_declared(ctx, vi));
  return Status::ok();
}

}  // namespace pipeshard::detail
