// The op table: one row per OpKind with everything the rest of pipeshard needs to know
// about that op, as data or small functions: its name, its shape rule, its parameter
// roles, what its backward reads and what forward saves for it, whether its output is a
// buffer of its own, how it runs under tensor parallelism, its cost.
//
// The importer infers shapes from the rows (importer/shape_inference.cc), ir/graph.cc
// names ops, counts flops and finds fused and recomputable activations from them, and
// the partitioner prices memory (partitioner/plan.cc) and chooses what runs on a feature
// shard (partitioner/tensor_parallel.cc) from them. What computes an op (the backends,
// program/program.cc's forward_node and backward_node, testing/reference_forward.cc)
// still dispatches on the kind itself.
//
// Every OpKind has exactly one row: op_table.cc checks at compile time that row k is
// the row of OpKind k and that no kind is left without one.
//
// Adding an op: its OpKind (ir/graph.h) and its row (op_table.cc); its recognition in
// importer/onnx_patterns.cc; its forward and backward in backend/backend.h, the CPU and
// CUDA backends and testing/recording_backend.h; its cases in program/program.cc's
// forward_node and backward_node (and, until it reads these rows, in program_plan.cc's
// saved buffers, backward_reads_input() and ops on a feature shard); and its reference
// in testing/reference_forward.cc.
// A new activation is a new ActivationKind instead: a row of op_table.cc's activation
// table and its value and derivative in the backends and the reference.
#ifndef PIPESHARD_IR_OP_TABLE_H_
#define PIPESHARD_IR_OP_TABLE_H_

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "common/status.h"
#include "ir/graph.h"

namespace pipeshard {

// A Node's parameter slots (Node::weight, bias, running_mean, running_var), in the order
// Graph::node_params() lists them. Weight and bias are trainable; running statistics
// are not (Parameter::trainable).
enum class ParamRole { kWeight, kBias, kRunningMean, kRunningVar };
inline constexpr int kParamRoles = 4;

// Whether an op has a parameter in a role.
enum class RoleUse {
  kNone,      // never: the slot stays -1
  kOptional,  // when the file has one (a Linear without bias, a LayerNorm without affine part)
  kRequired,  // always
};

// Where an op's output lives.
enum class OutputBuffer {
  kOwn,           // a buffer of its own, which training keeps for backward unless it is recomputed
  kAliasesInput,  // the input's buffer under another shape (Reshape): nothing to compute or keep
  kInPlace,       // may be computed in its input's buffer when nothing else reads the input
                  // (AllReduce sums a row-parallel Linear's partial sums where they lie)
};

// What an op's backward reads of the forward pass, besides dy, its parameters and the
// buffers it saved (OpInfo::saved).
enum class BackwardReads {
  kNothing,         // Dropout (its mask), Reshape, Add, the collectives
  kInput,           // x: Linear (for dW), LayerNorm, BatchNorm
  kOutput,          // y: Softmax, LogSoftmax
  kInputAndOutput,  // x and y: an activation, whose derivative reads one of them by its kind
                    // (Sigmoid, Tanh: y); given no y (recomputed for a later node only,
                    // program/program.h), it remakes y from x
};

// How a buffer that forward saves for backward is sized.
enum class SavedScale {
  kNone,             // no buffer
  kPerInputRow,      // one float per row of the input (all dims but the last): per sample
  kPerInputElement,  // one float per input element: per sample
  kPerChannel,       // one float per channel (the input's dim 1), whatever the batch: per
                     // micro-batch, not per sample
};

struct SavedBuffer {
  SavedScale scale = SavedScale::kNone;
  const char* name = "";  // "mean", "rstd", "mask"
};

// How an op runs under Megatron-style tensor parallelism (partitioner/tensor_parallel.h).
enum class ShardUse {
  kReplicated,      // runs whole on every rank, ending a chain: it needs every feature of a row
                    // (a norm over features, softmax, a reshape), or is not split yet (BatchNorm's
                    // per-channel parameters, Add's second input)
  kElementwise,     // acts on each element alone: may run on a feature shard between a column-
                    // and a row-parallel Linear
  kSplitsWeight,    // Linear: split by output features (column) or input features (row)
  kCombinesShards,  // a collective joining the shards (only in sharded stage files)
};

// Whether backward can have the op's output without keeping it from forward.
enum class Recompute {
  kKept,       // it is kept (or aliased, or not needed)
  kFromInput,  // one elementwise pass over the kept input remakes it bit for bit
               // (recomputable_values()); program/program.cc remakes it with
               // Backend::activation_forward, so only kActivation can say so today
};

// Whether the op can run inside the GEMM of the Linear before it.
enum class Fusion {
  kNone,
  kLinearEpilogue,  // as the epilogue of a Linear whose only reader it is (one GEMM + bias + op
                    // pass, fused_activations()); the backends' epilogue is an Activation, so
                    // only kActivation can say so today
};

// Output shape of `node` from its inputs' shapes in `graph` (already inferred), checking
// its widths against its parameters and attributes. May normalise the node's attributes
// (a negative axis, a Reshape target's 0 and -1). Errors name the node.
using ShapeRule = Result<Shape> (*)(const Graph& graph, Node& node);
// Multiply-accumulates of one forward pass of `node` per sample.
using FlopsRule = int64_t (*)(const Graph& graph, const Node& node);
// The name of one member of an op family (kActivation: "Relu", "Gelu", ...).
using MemberName = const char* (*)(const Node& node);

struct OpInfo {
  OpKind kind;
  const char* name;        // in messages, plan.json and tests: "Linear", "LayerNorm", ...
  MemberName member_name;  // null, or: a family names each member (op_kind_name())
  int inputs;              // activation inputs (Node::inputs): 2 for Add, 1 for the rest
  ShapeRule infer_shape;
  FlopsRule flops_per_sample;
  std::array<RoleUse, kParamRoles> params;  // [ParamRole]
  OutputBuffer output;
  BackwardReads backward_reads;
  std::array<SavedBuffer, 2> saved;  // what forward saves for backward beyond its output;
                                     // unused entries have SavedScale::kNone
  ShardUse tensor_parallel;
  Recompute recompute;
  Fusion fusion;
};

// The row of `kind`. An OpKind value outside the enum is a bug (fatal).
const OpInfo& op_info(OpKind kind);
// Every row, in OpKind order (row k is OpKind k).
std::span<const OpInfo> op_table();

// ---- questions answered from the rows ----

// The parameter slot of `node` in `role` (-1 when absent).
int node_param(const Node& node, ParamRole role);
// "node 'fc1' (Linear)": how messages name a node.
std::string node_label(const Node& node);

// The output shape of `node` by its row's shape rule, refusing one of more than
// kMaxTensorElements per sample. Errors name the node.
Result<Shape> infer_output_shape(const Graph& graph, Node& node);

bool backward_reads_input(OpKind kind);
bool backward_reads_output(OpKind kind);
bool output_aliases_input(OpKind kind);
// Whether the op may run on one shard of the features (ShardUse::kElementwise).
bool runs_on_feature_shard(OpKind kind);

// The buffers forward saves for `kind`'s backward (0, 1 or 2 of OpInfo::saved).
std::span<const SavedBuffer> saved_buffers(OpKind kind);
// Floats in `buffer` of `node` for a micro-batch of `batch` samples (kPerChannel: the
// channel count whatever the batch).
int64_t saved_elements(const Graph& graph, const Node& node, const SavedBuffer& buffer, int64_t batch);
// Bytes per sample of the buffers `node` saves that grow with the batch (kPerInputRow,
// kPerInputElement): LayerNorm's mean and rstd per row, Dropout's mask. On one of
// `feature_parts` feature shards a per-element buffer holds that part of the input.
int64_t saved_bytes_per_sample(const Graph& graph, const Node& node, int64_t feature_parts = 1);
// Bytes per micro-batch of the buffers `node` saves whatever the batch (kPerChannel):
// BatchNorm's mean and rstd per channel.
int64_t saved_bytes_per_batch(const Graph& graph, const Node& node);

}  // namespace pipeshard

#endif  // PIPESHARD_IR_OP_TABLE_H_
