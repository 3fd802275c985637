// The Plan: how a Graph is cut into pipeline stages and tensor-parallel shards.
//
// make_plan() groups the Graph's nodes into layers (a node with parameters starts a
// layer; parameter-free nodes such as activations join the layer before them), prices
// each layer (parameters, flops or memory), and lets split_pipeline() choose the
// optimal cuts. Values that cross a cut, residual connections included, become stage
// inputs and outputs. With tensor_parallel > 1, each stage's Linear layers are then
// paired Megatron-style (tensor_parallel.h).
//
// A Plan is plain data: plan_to_json() gives plan.json (docs/design.md, "File formats",
// lists its fields), and the stage files are written from it (stage_writer.h).
#ifndef PIPESHARD_PARTITIONER_PLAN_H_
#define PIPESHARD_PARTITIONER_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "ir/graph.h"

namespace pipeshard {

enum class BalanceBy { kParams, kFlops, kMemory };

// How a node runs under tensor parallelism.
enum class ShardRole {
  kReplicated,    // every tensor-parallel rank runs the whole node
  kColumn,        // Linear split by output features; output stays sharded
  kShardLocal,    // elementwise node between a column and a row Linear, on shards
  kRow,           // Linear split by input features; all-reduce after it, then bias
  kColumnGather,  // unpaired Linear split by output features, then all-gather
};

struct PartitionOptions {
  int stages = 1;
  int tensor_parallel = 1;
  BalanceBy balance = BalanceBy::kParams;
  // Assumptions of the memory estimate (and of --balance memory):
  int64_t batch_size = 32;        // samples per step on one data-parallel replica
  int micro_batches = 0;          // 0: as many as stages
  std::string schedule = "1f1b";  // a registered pipeline schedule (schedule/registry.h)
  // Chunks per stage for a schedule whose count the user chooses (interleaved's
  // --virtual-stages); 0: the schedule's own (chunks_per_stage_of() in schedule/registry.h).
  int virtual_stages = 0;
  int optimizer_slots = 2;  // float32 state per parameter (Adam: 2, SGD+momentum: 1)
  // ZeRO (train --zero) over this many data-parallel replicas: each holds the optimizer
  // state of 1/D of the parameters (stage 1), and with stage 2 of the gradients too, beside
  // two windows of the gradient buckets, of `bucket_bytes` (train --bucket-mb).
  int zero_replicas = 1;
  int zero_stage = 1;
  int64_t bucket_bytes = 25 << 20;
  bool recompute_activations = true;  // training recomputes recomputable_values() (train --keep-activations: false)
  // Fused activations the backend keeps anyway (program/program.h's kept_when_fused():
  // GeluTanh on a GPU below fp32); none on the CPU.
  std::vector<ActivationKind> kept_when_fused;
  // An unpaired Linear with fewer parameters than this stays replicated.
  int64_t min_shard_parameters = 65536;
};

struct TensorSpec {
  std::string name;
  Shape shape;
};

// One piece the model is cut into: a pipeline stage, or where the schedule places several
// model chunks on each stage (interleaved, V), one chunk. Pieces are numbered in model
// order; `holder` is the pipeline stage that runs it.
struct StagePlan {
  int stage = 0;                       // the piece: stage, or model chunk
  int holder = 0;                      // the pipeline stage holding it (== stage with one chunk per stage)
  std::vector<int> nodes;              // Graph node ids, in topological order
  int first_layer = 0, end_layer = 0;  // layers [first_layer, end_layer)
  int64_t parameters = 0;              // trainable elements (a shared tensor once)
  int64_t cost = 0;                    // what the balance minimised
  int64_t flops_per_sample = 0;        // multiply-accumulates, forward
  int64_t activation_bytes_out = 0;    // per sample, crossing the cut after this stage
  int64_t memory_bytes = 0;            // estimate per rank (of this piece): see PartitionOptions
  std::vector<TensorSpec> inputs;      // values this stage's nodes read from earlier stages
  std::vector<TensorSpec> outputs;     // values it produces that later stages or the loss need
  std::vector<TensorSpec> carried;     // values passing through it to a later stage
  std::vector<ShardRole> roles;        // [nodes]; all kReplicated when tensor_parallel == 1
  std::vector<std::string> files;      // stage files, relative to the output folder
};

struct Plan {
  std::string model;  // the model path as given
  PartitionOptions options;
  int64_t total_parameters = 0;
  int layers = 0;
  int chunks_per_stage = 1;       // v: stages.size() is stages × v
  std::vector<StagePlan> stages;  // the pieces, in model order
  double balance = 1.0;           // largest stage cost / mean stage cost
  int64_t crossing_bytes = 0;     // per sample, summed over the cuts
};

// Layer index of every node ([nodes]); the number of layers is back() + 1.
std::vector<int> layer_of_nodes(const Graph& graph);

// Bytes per sample a Program (program/program.h) keeps in every micro-batch slot for node
// `n` running as `role` on one of `shards` tensor-parallel ranks: its output unless it
// aliases its input (a Reshape) or is recomputed in backward (`recomputed`, [values], see
// recomputable_values()), and what forward saves for its backward per sample
// (saved_bytes_per_sample(): Dropout's mask, LayerNorm's mean and rstd per row; BatchNorm's
// per-channel statistics are per micro-batch and not counted). Column-parallel and
// shard-local nodes make one shard of their output, and a column-gather Linear keeps the
// whole output it gathers beside its shard; a row-parallel Linear's partial sums are
// all-reduced in place (stage_writer.cc writes them as values of their own;
// program/program_plan.cc's reduces_in_place(), OutputBuffer::kInPlace in the op table).
int64_t node_kept_bytes(const Graph& graph, const Node& n, const std::vector<bool>& recomputed, ShardRole role,
                        int shards);

// Cuts `graph` as `options` asks. Errors: more stages than layers, a width that does
// not divide by tensor_parallel (naming the layer), invalid options.
Result<Plan> make_plan(const Graph& graph, const std::string& model_path, const PartitionOptions& options);

nlohmann::json plan_to_json(const Plan& plan, const Graph& graph);
// plan.json's text. Names that are not valid UTF-8 (corrupt files) get U+FFFD in place
// of the bad bytes instead of failing.
std::string plan_json_text(const Plan& plan, const Graph& graph);

// The memory estimate per rank of each pipeline stage: its pieces' memory_bytes summed.
// (A stage holding several chunks runs one program over them all; its shared buffers are
// counted per chunk here, an estimate above the program's by at most their size.)
std::vector<int64_t> memory_per_stage(const Plan& plan);

// Micro-batches per step as the memory estimate assumes them: `micro_batches`, or as many
// as stages when that is 0.
int micro_batch_count(const PartitionOptions& options);
// Samples in one micro-batch: batch_size over micro_batch_count(), rounded up.
int64_t micro_batch_size(const PartitionOptions& options);

// Largest --batch-size the memory estimate accepts.
inline constexpr int64_t kMaxBatchSize = int64_t{1} << 24;

const char* balance_name(BalanceBy b);
const char* shard_role_name(ShardRole r);

}  // namespace pipeshard

#endif  // PIPESHARD_PARTITIONER_PLAN_H_
