// Shape inference on the Graph: every value gets a shape with a symbolic batch by its
// node's shape rule in the op table (ir/op_table.h), which checks each layer's widths
// against its parameters, and shapes the file declares (graph outputs, value_info) are
// checked against what the layers produce.
#include <optional>

#include "importer/import_context.h"
#include "importer/onnx_importer.h"
#include "ir/op_table.h"

namespace pipeshard::detail {
namespace {

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
    return Status::error("shape mismatch: '" + vi.name() + "' is declared as a scalar but the layers produce " +
                         s.to_string());
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
    Result<Shape> out = infer_output_shape(g, n);
    if (!out) return out.status();
    g.values[n.outputs[0]].shape = *out;
  }
  for (const auto& vi : ctx.onnx_graph->output()) PIPESHARD_RETURN_IF_ERROR(check_declared(ctx, vi));
  for (const auto& vi : ctx.onnx_graph->value_info()) PIPESHARD_RETURN_IF_ERROR(check_declared(ctx, vi));
  return Status::ok();
}

}  // namespace pipeshard::detail
