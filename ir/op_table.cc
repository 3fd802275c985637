#include "ir/op_table.h"

#include <algorithm>
#include <iterator>

namespace pipeshard {
namespace {

constexpr int64_t kFloatBytes = 4;

Result<Shape> fail(const Node& n, const std::string& message) { return Status::error(node_label(n) + ": " + message); }

int normalise_axis(int axis, int rank) { return axis < 0 ? axis + rank : axis; }

const Shape& input_shape(const Graph& g, const Node& n) { return g.values[n.inputs[0]].shape; }

// A parameter of `role_name` that must hold `size` elements (absent ones pass).
Status expect_vector(const Graph& g, int param, int64_t size, const Node& n, const char* role_name) {
  if (param < 0) return Status::ok();
  const Parameter& p = g.params[param];
  if (p.elements() != size) {
    return Status::error(node_label(n) + ": " + role_name + " '" + p.name + "' has " + std::to_string(p.elements()) +
                         " elements, the layer needs " + std::to_string(size));
  }
  return Status::ok();
}

// ---- shape rules ----

// Elementwise ops and AllReduce (the sum of same-shaped partial sums).
Result<Shape> same_shape(const Graph& g, Node& n) { return input_shape(g, n); }

// Linear acts on the last dim: [..., in_features] -> [..., out_features].
Result<Shape> linear_shape(const Graph& g, Node& n) {
  Shape out = input_shape(g, n);
  if (out.features() != n.in_features) {
    return fail(n, "shape mismatch: input " + out.to_string() + " has " + std::to_string(out.features()) +
                       " features, weight '" + g.params[n.weight].name + "' expects " + std::to_string(n.in_features));
  }
  out.dims.back() = n.out_features;
  return out;
}

// Softmax and LogSoftmax over the last axis only.
Result<Shape> softmax_shape(const Graph& g, Node& n) {
  const Shape& in = input_shape(g, n);
  n.axis = normalise_axis(n.axis, in.rank());
  if (n.axis != in.rank() - 1) return fail(n, "only the last axis is supported, got axis " + std::to_string(n.axis));
  return in;
}

// LayerNorm over the last axis only, scale and bias [features].
Result<Shape> layernorm_shape(const Graph& g, Node& n) {
  const Shape& in = input_shape(g, n);
  if (normalise_axis(n.axis, in.rank()) != in.rank() - 1)
    return fail(n, "only normalisation over the last axis is supported");
  n.axis = in.rank() - 1;
  PIPESHARD_RETURN_IF_ERROR(expect_vector(g, n.weight, in.features(), n, "scale"));
  PIPESHARD_RETURN_IF_ERROR(expect_vector(g, n.bias, in.features(), n, "bias"));
  return in;
}

// BatchNorm per channel (dim 1): every parameter [channels].
Result<Shape> batchnorm_shape(const Graph& g, Node& n) {
  const Shape& in = input_shape(g, n);
  const int64_t channels = in.dims[1];
  for (int p : {n.weight, n.bias, n.running_mean, n.running_var}) {
    PIPESHARD_RETURN_IF_ERROR(expect_vector(g, p, channels, n, "parameter"));
  }
  return in;
}

// Resolves a Reshape's target as written (0 = copy, -1 = infer) against `in`, with
// dim 0 standing for the batch.
Result<std::vector<int64_t>> reshape_target(const Node& n, const Shape& in) {
  const auto& spec = n.target;
  if (spec.size() < 2)
    return Status::error(node_label(n) + ": the target shape must keep the batch and at least one feature dimension");
  if (!(spec[0] == -1 || spec[0] == 0 || spec[0] > 0)) {
    return Status::error(node_label(n) + ": the first target dimension must keep the batch");
  }
  std::vector<int64_t> out;
  int infer_at = -1;
  int64_t known = 1;
  for (size_t k = 1; k < spec.size(); ++k) {
    int64_t d = spec[k];
    if (d == 0) {
      if (static_cast<int>(k) >= in.rank())
        return Status::error(node_label(n) + ": copies a dimension the input lacks");
      d = in.dims[k];
    }
    if (d == -1) {
      if (infer_at >= 0) return Status::error(node_label(n) + ": more than one -1 in the target shape");
      infer_at = static_cast<int>(out.size());
    } else if (d <= 0 || d > kMaxTensorElements) {
      return Status::error(node_label(n) + ": invalid target dimension " + std::to_string(d));
    } else {
      if (known > kMaxTensorElements / d)
        return Status::error(node_label(n) + ": target shape needs more than 2^32 elements per sample");
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

// Flatten (axis 1) or Reshape to `target`, the batch kept as dim 0; resolves the target.
Result<Shape> reshape_shape(const Graph& g, Node& n) {
  const Shape& in = input_shape(g, n);
  if (normalise_axis(n.axis, in.rank()) != 1) {
    return fail(n, "only Flatten with axis=1 (keep the batch) is supported, got axis " + std::to_string(n.axis) +
                       " of a rank-" + std::to_string(in.rank()) + " input");
  }
  Result<std::vector<int64_t>> t = reshape_target(n, in);
  if (!t) return t.status();
  n.target = *t;
  Shape out{{kBatch}};
  out.dims.insert(out.dims.end(), n.target.begin(), n.target.end());
  return out;
}

// Add: two activations of one shape.
Result<Shape> add_shape(const Graph& g, Node& n) {
  const Shape& in = input_shape(g, n);
  const Shape& other = g.values[n.inputs[1]].shape;
  if (!(other == in)) return fail(n, "shape mismatch: adds " + in.to_string() + " and " + other.to_string());
  return in;
}

// AllGather: the shards' features side by side.
Result<Shape> allgather_shape(const Graph& g, Node& n) {
  Shape out = input_shape(g, n);
  if (n.shards > kMaxTensorElements / std::max<int64_t>(out.dims.back(), 1)) {
    return fail(n, "shards=" + std::to_string(n.shards) + " would gather more than 2^32 features");
  }
  out.dims.back() *= n.shards;
  return out;
}

// ---- flops rules ----

// One per output element: what every op but Linear counts (Reshape too, though it aliases).
int64_t output_elements(const Graph& g, const Node& n) { return g.values[n.outputs[0]].shape.per_sample_elements(); }

// Rows per sample (everything between the batch and the feature dim) × in × out.
int64_t linear_flops(const Graph& g, const Node& n) {
  const Shape& out = g.values[n.outputs[0]].shape;
  const int64_t rows = out.per_sample_elements() / (out.features() ? out.features() : 1);
  return rows * n.in_features * n.out_features;
}

const char* activation_member_name(const Node& n) { return activation_name(n.activation); }

// ---- the table ----

constexpr RoleUse kNo = RoleUse::kNone, kOptional = RoleUse::kOptional, kRequired = RoleUse::kRequired;
constexpr std::array<RoleUse, kParamRoles> kNoParams = {kNo, kNo, kNo, kNo};
constexpr std::array<SavedBuffer, 2> kNothingSaved = {};

constexpr OpInfo kOpTable[] = {
    {.kind = OpKind::kLinear,
     .name = "Linear",
     .member_name = nullptr,
     .inputs = 1,
     .infer_shape = linear_shape,
     .flops_per_sample = linear_flops,
     .params = {kRequired, kOptional, kNo, kNo},
     .output = OutputBuffer::kOwn,
     .backward_reads = BackwardReads::kInput,
     .saved = kNothingSaved,
     .tensor_parallel = ShardUse::kSplitsWeight,
     .recompute = Recompute::kKept,
     .fusion = Fusion::kNone},
    {.kind = OpKind::kActivation,
     .name = "Activation",
     .member_name = activation_member_name,
     .inputs = 1,
     .infer_shape = same_shape,
     .flops_per_sample = output_elements,
     .params = kNoParams,
     .output = OutputBuffer::kOwn,
     .backward_reads = BackwardReads::kInputAndOutput,
     .saved = kNothingSaved,
     .tensor_parallel = ShardUse::kElementwise,
     .recompute = Recompute::kFromInput,
     .fusion = Fusion::kLinearEpilogue},
    {.kind = OpKind::kSoftmax,
     .name = "Softmax",
     .member_name = nullptr,
     .inputs = 1,
     .infer_shape = softmax_shape,
     .flops_per_sample = output_elements,
     .params = kNoParams,
     .output = OutputBuffer::kOwn,
     .backward_reads = BackwardReads::kOutput,
     .saved = kNothingSaved,
     .tensor_parallel = ShardUse::kReplicated,
     .recompute = Recompute::kKept,
     .fusion = Fusion::kNone},
    {.kind = OpKind::kLogSoftmax,
     .name = "LogSoftmax",
     .member_name = nullptr,
     .inputs = 1,
     .infer_shape = softmax_shape,
     .flops_per_sample = output_elements,
     .params = kNoParams,
     .output = OutputBuffer::kOwn,
     .backward_reads = BackwardReads::kOutput,
     .saved = kNothingSaved,
     .tensor_parallel = ShardUse::kReplicated,
     .recompute = Recompute::kKept,
     .fusion = Fusion::kNone},
    {.kind = OpKind::kLayerNorm,
     .name = "LayerNorm",
     .member_name = nullptr,
     .inputs = 1,
     .infer_shape = layernorm_shape,
     .flops_per_sample = output_elements,
     .params = {kOptional, kOptional, kNo, kNo},
     .output = OutputBuffer::kOwn,
     .backward_reads = BackwardReads::kInput,
     .saved = {{{SavedScale::kPerInputRow, "mean"}, {SavedScale::kPerInputRow, "rstd"}}},
     .tensor_parallel = ShardUse::kReplicated,
     .recompute = Recompute::kKept,
     .fusion = Fusion::kNone},
    {.kind = OpKind::kBatchNorm,
     .name = "BatchNorm",
     .member_name = nullptr,
     .inputs = 1,
     .infer_shape = batchnorm_shape,
     .flops_per_sample = output_elements,
     .params = {kRequired, kRequired, kRequired, kRequired},
     .output = OutputBuffer::kOwn,
     .backward_reads = BackwardReads::kInput,
     .saved = {{{SavedScale::kPerChannel, "mean"}, {SavedScale::kPerChannel, "rstd"}}},
     .tensor_parallel = ShardUse::kReplicated,
     .recompute = Recompute::kKept,
     .fusion = Fusion::kNone},
    {.kind = OpKind::kDropout,
     .name = "Dropout",
     .member_name = nullptr,
     .inputs = 1,
     .infer_shape = same_shape,
     .flops_per_sample = output_elements,
     .params = kNoParams,
     .output = OutputBuffer::kOwn,
     .backward_reads = BackwardReads::kNothing,
     .saved = {{{SavedScale::kPerInputElement, "mask"}, {}}},
     .tensor_parallel = ShardUse::kElementwise,
     .recompute = Recompute::kKept,
     .fusion = Fusion::kNone},
    {.kind = OpKind::kReshape,
     .name = "Reshape",
     .member_name = nullptr,
     .inputs = 1,
     .infer_shape = reshape_shape,
     .flops_per_sample = output_elements,
     .params = kNoParams,
     .output = OutputBuffer::kAliasesInput,
     .backward_reads = BackwardReads::kNothing,
     .saved = kNothingSaved,
     .tensor_parallel = ShardUse::kReplicated,
     .recompute = Recompute::kKept,
     .fusion = Fusion::kNone},
    {.kind = OpKind::kAdd,
     .name = "Add",
     .member_name = nullptr,
     .inputs = 2,
     .infer_shape = add_shape,
     .flops_per_sample = output_elements,
     .params = kNoParams,
     .output = OutputBuffer::kOwn,
     .backward_reads = BackwardReads::kNothing,
     .saved = kNothingSaved,
     .tensor_parallel = ShardUse::kReplicated,
     .recompute = Recompute::kKept,
     .fusion = Fusion::kNone},
    {.kind = OpKind::kAllReduce,
     .name = "AllReduce",
     .member_name = nullptr,
     .inputs = 1,
     .infer_shape = same_shape,
     .flops_per_sample = output_elements,
     .params = {kNo, kOptional, kNo, kNo},
     .output = OutputBuffer::kInPlace,
     .backward_reads = BackwardReads::kNothing,
     .saved = kNothingSaved,
     .tensor_parallel = ShardUse::kCombinesShards,
     .recompute = Recompute::kKept,
     .fusion = Fusion::kNone},
    {.kind = OpKind::kAllGather,
     .name = "AllGather",
     .member_name = nullptr,
     .inputs = 1,
     .infer_shape = allgather_shape,
     .flops_per_sample = output_elements,
     .params = kNoParams,
     .output = OutputBuffer::kOwn,
     .backward_reads = BackwardReads::kNothing,
     .saved = kNothingSaved,
     .tensor_parallel = ShardUse::kCombinesShards,
     .recompute = Recompute::kKept,
     .fusion = Fusion::kNone},
};

struct ActivationInfo {
  ActivationKind kind;
  const char* name;  // as op_kind_name() gives it for an activation node
};

constexpr ActivationInfo kActivationTable[] = {
    {ActivationKind::kRelu, "Relu"}, {ActivationKind::kLeakyRelu, "LeakyRelu"}, {ActivationKind::kSigmoid, "Sigmoid"},
    {ActivationKind::kTanh, "Tanh"}, {ActivationKind::kGelu, "Gelu"},           {ActivationKind::kGeluTanh, "GeluTanh"},
    {ActivationKind::kSilu, "Silu"},
};

// ---- every kind has exactly one row ----
//
// The switches name every kind with no default, and -Wswitch is an error here, so a kind
// added to an enum does not compile until it is named here; the static_asserts then hold
// until it has its row, at the index of its value.
#pragma GCC diagnostic push
#pragma GCC diagnostic error "-Wswitch"
constexpr bool is_op_kind(OpKind kind) {
  switch (kind) {
    case OpKind::kLinear:
    case OpKind::kActivation:
    case OpKind::kSoftmax:
    case OpKind::kLogSoftmax:
    case OpKind::kLayerNorm:
    case OpKind::kBatchNorm:
    case OpKind::kDropout:
    case OpKind::kReshape:
    case OpKind::kAdd:
    case OpKind::kAllReduce:
    case OpKind::kAllGather: return true;
  }
  return false;
}

constexpr bool is_activation_kind(ActivationKind kind) {
  switch (kind) {
    case ActivationKind::kRelu:
    case ActivationKind::kLeakyRelu:
    case ActivationKind::kSigmoid:
    case ActivationKind::kTanh:
    case ActivationKind::kGelu:
    case ActivationKind::kGeluTanh:
    case ActivationKind::kSilu: return true;
  }
  return false;
}
#pragma GCC diagnostic pop

template <typename Row, typename Kind, size_t N>
constexpr bool one_row_per_kind(const Row (&rows)[N], bool (*is_kind)(Kind)) {
  for (size_t k = 0; k < N; ++k) {
    if (rows[k].kind != static_cast<Kind>(k) || !is_kind(rows[k].kind)) return false;
  }
  return !is_kind(static_cast<Kind>(N));  // and none past the last row
}

static_assert(one_row_per_kind(kOpTable, is_op_kind), "kOpTable: row k must be OpKind k, one row for every kind");
static_assert(one_row_per_kind(kActivationTable, is_activation_kind),
              "kActivationTable: row k must be ActivationKind k, one row for every kind");
static_assert(std::size(kActivationTable) == std::size(kActivationKinds), "kActivationKinds lists every kind");

constexpr bool rows_are_whole() {
  for (const OpInfo& row : kOpTable) {
    if (row.name == nullptr || row.infer_shape == nullptr || row.flops_per_sample == nullptr) return false;
    if (row.inputs < 1 || row.inputs > 2) return false;
    // A saved buffer's slot 1 is used only after slot 0.
    if (row.saved[0].scale == SavedScale::kNone && row.saved[1].scale != SavedScale::kNone) return false;
  }
  return true;
}
static_assert(rows_are_whole(), "kOpTable: every row has a name, a shape rule, a flops rule and 1 or 2 inputs");

}  // namespace

const OpInfo& op_info(OpKind kind) {
  const auto k = static_cast<size_t>(kind);
  PIPESHARD_CHECK(k < std::size(kOpTable), "OpKind " + std::to_string(k) + " has no row in the op table");
  return kOpTable[k];
}

std::span<const OpInfo> op_table() { return kOpTable; }

const char* activation_name(ActivationKind kind) {
  const auto k = static_cast<size_t>(kind);
  PIPESHARD_CHECK(k < std::size(kActivationTable), "ActivationKind " + std::to_string(k) + " has no row");
  return kActivationTable[k].name;
}

const char* op_kind_name(const Node& node) {
  const OpInfo& info = op_info(node.kind);
  return info.member_name ? info.member_name(node) : info.name;
}

int node_param(const Node& node, ParamRole role) {
  switch (role) {
    case ParamRole::kWeight: return node.weight;
    case ParamRole::kBias: return node.bias;
    case ParamRole::kRunningMean: return node.running_mean;
    case ParamRole::kRunningVar: return node.running_var;
  }
  PIPESHARD_CHECK(false, "ParamRole " + std::to_string(static_cast<int>(role)));
  return -1;
}

std::string node_label(const Node& node) { return "node '" + node.name + "' (" + op_kind_name(node) + ")"; }

Result<Shape> infer_output_shape(const Graph& graph, Node& node) {
  Result<Shape> out = op_info(node.kind).infer_shape(graph, node);
  if (out && out->per_sample_elements() > kMaxTensorElements) {
    return Status::error(node_label(node) + ": output needs more than 2^32 elements per sample");
  }
  return out;
}

bool backward_reads_input(OpKind kind) {
  const BackwardReads r = op_info(kind).backward_reads;
  return r == BackwardReads::kInput || r == BackwardReads::kInputAndOutput;
}

bool backward_reads_output(OpKind kind) {
  const BackwardReads r = op_info(kind).backward_reads;
  return r == BackwardReads::kOutput || r == BackwardReads::kInputAndOutput;
}

bool output_aliases_input(OpKind kind) { return op_info(kind).output == OutputBuffer::kAliasesInput; }

bool runs_on_feature_shard(OpKind kind) { return op_info(kind).tensor_parallel == ShardUse::kElementwise; }

std::span<const SavedBuffer> saved_buffers(OpKind kind) {
  const auto& saved = op_info(kind).saved;
  const size_t used =
      std::count_if(saved.begin(), saved.end(), [](const SavedBuffer& b) { return b.scale != SavedScale::kNone; });
  return std::span<const SavedBuffer>(saved.data(), used);
}

int64_t saved_elements(const Graph& g, const Node& n, const SavedBuffer& buffer, int64_t batch) {
  const Shape& in = input_shape(g, n);
  switch (buffer.scale) {
    case SavedScale::kNone: return 0;
    case SavedScale::kPerInputRow: return batch * (in.per_sample_elements() / in.features());
    case SavedScale::kPerInputElement: return batch * in.per_sample_elements();
    case SavedScale::kPerChannel: return in.dims[1];
  }
  PIPESHARD_CHECK(false, "SavedScale " + std::to_string(static_cast<int>(buffer.scale)));
  return 0;
}

int64_t saved_bytes_per_sample(const Graph& g, const Node& n, int64_t feature_parts) {
  int64_t bytes = 0;
  for (const SavedBuffer& b : saved_buffers(n.kind)) {
    if (b.scale == SavedScale::kPerInputRow) bytes += kFloatBytes * saved_elements(g, n, b, 1);
    // Bytes first, then the part: as the partitioner has always divided a value's bytes.
    if (b.scale == SavedScale::kPerInputElement) bytes += kFloatBytes * saved_elements(g, n, b, 1) / feature_parts;
  }
  return bytes;
}

int64_t saved_bytes_per_batch(const Graph& g, const Node& n) {
  int64_t bytes = 0;
  for (const SavedBuffer& b : saved_buffers(n.kind)) {
    if (b.scale == SavedScale::kPerChannel) bytes += kFloatBytes * saved_elements(g, n, b, 1);
  }
  return bytes;
}

}  // namespace pipeshard
