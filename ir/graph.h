// The Graph: pipeshard's intermediate representation of an imported MLP.
//
// The importer (importer/onnx_importer.h) turns the many forms exporters emit into one
// node per concept (a Gemm, a MatMul+Add or a Transpose+MatMul all become one Linear;
// the Erf pattern, the tanh pattern and the Gelu op all become one GELU activation),
// so that the partitioner and the runtime handle each concept once.
//
// Everything here is plain data with no ONNX dependency. Values are activations whose
// first dimension is the symbolic batch (kBatch); Parameters are the model's
// initializers under their original ONNX names and layouts, so trained weights can be
// written back into the same file.
#ifndef PIPESHARD_IR_GRAPH_H_
#define PIPESHARD_IR_GRAPH_H_

#include <cstdint>
#include <string>
#include <vector>

namespace pipeshard {

// The symbolic batch dimension inside a Shape.
inline constexpr int64_t kBatch = -1;
// Refuse models whose tensors would need more than this many elements in one tensor
// or one sample's activation: such dims are corrupt, not real MLPs.
inline constexpr int64_t kMaxTensorElements = int64_t{1} << 32;

// An activation's shape: dims[0] is kBatch, the rest are concrete, e.g. [batch, 100].
struct Shape {
  std::vector<int64_t> dims;

  int rank() const { return static_cast<int>(dims.size()); }
  // Elements per sample: the product of all dims except the batch dimension.
  int64_t per_sample_elements() const;
  // The last dimension (the feature width that Linear and LayerNorm act on).
  int64_t features() const { return dims.empty() ? 0 : dims.back(); }
  // "[batch, 100]".
  std::string to_string() const;
  bool operator==(const Shape& other) const { return dims == other.dims; }
};

// What a Node computes. Everything else pipeshard knows about a kind (its name, shape
// rule, parameters, what backward keeps, how it shards) is its row in ir/op_table.h.
enum class OpKind {
  kLinear,      // y = alpha * x·W(ᵀ) + beta * b over the last dim
  kActivation,  // elementwise, see ActivationKind
  kSoftmax,     // over `axis`
  kLogSoftmax,  // over `axis`
  kLayerNorm,   // over the last dim, scale and bias [features]
  kBatchNorm,   // per feature (dim 1), scale/bias/running stats [channels]
  kDropout,     // `ratio`; active only when `training`
  kReshape,     // Flatten or Reshape to `target` (batch kept as dim 0)
  kAdd,         // elementwise sum of two activations of one shape (residual)
  kAllReduce,   // tensor-parallel sum over the shard group, then + bias if present
                //   (only in sharded stage files)
  kAllGather,   // tensor-parallel concatenation over the last dim (only in sharded files)
};

enum class ActivationKind { kRelu, kLeakyRelu, kSigmoid, kTanh, kGelu, kGeluTanh, kSilu };
inline constexpr ActivationKind kActivationKinds[] = {
    ActivationKind::kRelu, ActivationKind::kLeakyRelu, ActivationKind::kSigmoid, ActivationKind::kTanh,
    ActivationKind::kGelu, ActivationKind::kGeluTanh,  ActivationKind::kSilu};

// How a Linear's weight is stored in the file.
enum class WeightLayout {
  kOutIn,  // [out_features, in_features]: PyTorch's layout, Gemm with transB=1
  kInOut,  // [in_features, out_features]: MatMul's layout, Gemm with transB=0
};

// A named tensor from the model file (an ONNX initializer).
struct Parameter {
  std::string name;           // the ONNX initializer name, kept for write-back
  std::vector<int64_t> dims;  // as stored in the file
  std::vector<float> data;    // [product(dims)], row-major
  bool trainable = true;      // false for BatchNorm running statistics

  int64_t elements() const { return static_cast<int64_t>(data.size()); }
};

struct Value {
  std::string name;  // the ONNX value name
  Shape shape;
  int producer = -1;           // index into Graph::nodes; -1 for a graph input
  std::vector<int> consumers;  // indices into Graph::nodes, ascending
};

struct Node {
  std::string name;  // the ONNX node at which the concept was recognised
  OpKind kind = OpKind::kLinear;
  std::vector<int> inputs;      // value ids; kAdd has two, every other kind one
  std::vector<int> outputs;     // value ids; exactly one
  std::vector<int> onnx_nodes;  // indices of the source ONNX nodes this node came from

  // Parameters by role, indices into Graph::params (-1 when absent).
  int weight = -1;        // Linear [out,in] or [in,out]; LayerNorm/BatchNorm scale [features]
  int bias = -1;          // Linear [out]; LayerNorm/BatchNorm [features]
  int running_mean = -1;  // BatchNorm [channels]
  int running_var = -1;   // BatchNorm [channels]

  // Linear.
  WeightLayout layout = WeightLayout::kOutIn;
  int64_t in_features = 0;
  int64_t out_features = 0;
  float alpha = 1.0f;  // Linear: scale of x·W; LeakyRelu: negative slope
  float beta = 1.0f;   // Linear: scale of the bias

  ActivationKind activation = ActivationKind::kRelu;  // kActivation
  int axis = -1;                                      // Softmax/LogSoftmax/LayerNorm, normalised to be non-negative;
      // Reshape: the Flatten axis, which must resolve to 1 (1 for Reshape)
  float epsilon = 1e-5f;        // LayerNorm, BatchNorm
  float momentum = 0.9f;        // BatchNorm, ONNX convention: running = running*m + batch*(1-m)
  bool training = false;        // BatchNorm (batch statistics), Dropout (active)
  float ratio = 0.0f;           // Dropout drop probability
  std::vector<int64_t> target;  // Reshape: output dims after the batch dim
  int64_t shards = 1;           // AllReduce, AllGather: size of the tensor-parallel group
};

// An imported model. Nodes are stored in a topological order.
struct Graph {
  std::string name;   // the ONNX graph name
  int64_t opset = 0;  // default-domain opset the file was exported with
  std::vector<Value> values;
  std::vector<Node> nodes;
  std::vector<Parameter> params;
  std::vector<int> inputs;   // value ids of the model inputs
  std::vector<int> outputs;  // value ids of the model outputs

  // Parameters a node owns (weight, bias, running stats), in that order, skipping -1.
  std::vector<int> node_params(const Node& node) const;
  // Trainable parameter elements held by `node` (what PyTorch counts as parameters).
  int64_t node_parameter_count(const Node& node) const;
  // Trainable parameter elements in the whole model, shared parameters counted once.
  int64_t total_parameter_count() const;
  // Multiply-accumulates per sample for `node` (Linear: in*out*rows; others: elements),
  // by its row in the op table.
  int64_t node_flops_per_sample(const Node& node) const;
};

// [nodes] Activation nodes (ops whose row says Fusion::kLinearEpilogue) that training
// runs inside the Linear before them, as one GEMM + bias + activation pass: the Linear's
// output is read by nothing else and is no model output.
std::vector<bool> fused_activations(const Graph& g);

// [values] Activations that training need not keep from forward to backward: the output
// of an activation node (Recompute::kFromInput) whose input is kept, which backward can
// recompute from that input in one elementwise pass. Not model outputs (the loss and the
// next pipeline stage read them), nor values a Reshape aliases (OutputBuffer::kAliasesInput),
// nor an activation of an activation that is itself recomputed, nor a fused activation
// (fused_activations()) of a kind in `kept_when_fused`: those whose fused pass the backend
// cannot repeat bit for bit (Backend::epilogue_recomputes_exactly).
std::vector<bool> recomputable_values(const Graph& g, const std::vector<ActivationKind>& kept_when_fused = {});

// "Linear", "Relu", "Gelu", ... : the names used in messages, plan.json and tests (the op
// table's, an activation named by its ActivationKind).
const char* op_kind_name(const Node& node);
// "Relu", "LeakyRelu", "Gelu", "GeluTanh", ...
const char* activation_name(ActivationKind kind);

}  // namespace pipeshard

#endif  // PIPESHARD_IR_GRAPH_H_
