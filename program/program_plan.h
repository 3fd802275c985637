// The plan of a Program (program/program.h): where every parameter, activation, gradient
// and saved tensor lives, which buffers values share, what backward recomputes and what it
// zeroes — computed from the Graph and the options alone, as plain data. No backend memory
// is touched: Program::create allocates exactly the buffers the plan lists and then only
// runs it, so what a program will hold (ProgramPlan::memory()) is known before it exists.
//
// The rules (each planning step's comment in program_plan.cc says why):
// - Parameters: trainable ones in one buffer, running statistics in a second, each in the
//   order the forward pass first uses them, so backward finishes the gradient buffer from
//   its end towards its start (gradient buckets reduce while backward continues).
// - Activations: a buffer per value with a slot per micro-batch in flight, except that a
//   Reshape's output and a row-parallel Linear's all-reduced sums alias their input, and an
//   activation's output that backward can recompute exactly from the activation's input
//   lives only while forward needs it and again from where backward recomputes it, in
//   one-slot buffers such values share.
// - Gradients of values: model inputs' and outputs' (and, when backward is split, those of
//   the outputs whose weight gradient W computes later) have their own per slot; every other
//   value's lives only inside one backward, so values whose lives do not overlap share
//   buffers (an MLP of any depth needs two; a residual branch one more).
// - Gradients that one Linear writes alone are overwritten by its first backward of a step
//   instead of zeroed and added to.
#ifndef PIPESHARD_PROGRAM_PROGRAM_PLAN_H_
#define PIPESHARD_PROGRAM_PROGRAM_PLAN_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "common/status.h"
#include "ir/graph.h"

namespace pipeshard {

class Communicator;

struct ProgramOptions {
  // Micro-batches whose activations live at once, each in its own slot of max_batch rows.
  int slots = 1;
  // [graph inputs] inputs whose gradient backward must produce (a pipeline stage's
  // inputs computed by an earlier stage); empty: none.
  std::vector<bool> input_needs_grad;
  // The tensor-parallel group that AllReduce/AllGather nodes reduce over; required when
  // the graph has them, and then its size must be their `shards`.
  Communicator* tensor = nullptr;
  // [graph nodes] the index of each node in the whole model, which keys its dropout
  // masks; empty: the node's own index (the Graph is the whole model).
  std::vector<uint64_t> model_node_ids;
  // Training BatchNorm statistics over several processes (--sync-batchnorm): sums the
  // per-channel partial statistics over the data-parallel replicas. Null: this batch's.
  ChannelReducer batchnorm_reducer;
  // false: every value gets a gradient buffer of its own in every slot, as if all were
  // model inputs or outputs (the tests' reference for sharing; it changes no result).
  bool share_gradient_buffers = true;
  // true: values that recomputable_values() names, and whose recomputation the backend
  // says is exact, are recomputed in backward instead of kept from forward. false: every
  // value keeps its own buffer in every slot (the tests' reference; it changes no result).
  bool recompute_activations = true;
  // Only kEval forwards (evaluation): no gradient buffers at all, and backward() is a bug.
  bool forward_only = false;
  // Backward may run as backward_input() then, later, backward_weight() (schedules with I
  // and W actions): the output gradient of every node whose weight gradient W computes is
  // kept per slot from one to the other. false: backward() only.
  bool split_backward = false;
  // [graph nodes] the model chunk each node belongs to, for a pipeline rank that holds
  // several (interleaved and V schedules, runtime/stage_runner.h): the graph is their
  // union, each chunk's nodes contiguous and in chunk order, no value passing from one
  // chunk to another inside it. Program::select_chunk() then runs one chunk's forward and
  // backward at a time. Empty: one chunk.
  std::vector<int> node_chunk;
  // [chunks] the slots of each chunk's values and saved tensors (a chunk's values: its
  // nodes' outputs, and the model inputs its nodes read); `slots` must be the largest.
  // Empty: `slots` for every chunk.
  std::vector<int> chunk_slots;
  // true: the program allocates no parameter-gradient buffer; Program::place_gradients()
  // says where each parameter's gradient lives for the next backward pass, and every pass
  // writes afresh (ZeRO stage 2's windows, runtime/gradient_sync.h). Whole backwards only.
  bool gradients_elsewhere = false;
};

struct ProgramPlan {
  int64_t max_batch = 0;
  int slots = 1;                 // the most any chunk has
  std::vector<int> value_chunk;  // [values]: the chunk of the producer, or of a model input's first reader
  bool forward_only = false;

  // ---- parameters ----
  int64_t trainable_elements = 0;     // the parameter and gradient buffers
  int64_t buffer_elements = 0;        // running statistics
  std::vector<int64_t> param_offset;  // [params]: into the trainable buffer or the statistics one

  // ---- activations ----
  std::vector<int> owner;                  // [values]: the value whose buffers v aliases, or v; -1: made by no node
  std::vector<int64_t> value_slot_stride;  // [values]: elements per slot; 0 for a recomputed value
  std::vector<int> value_buffer;           // [values]: index into value_buffer_sizes (own buffers), or -1
  std::vector<int64_t> value_buffer_sizes;
  std::vector<bool> recomputed;       // [values]: recomputed in backward, not kept from forward
  std::vector<int> transient_buffer;  // [values]: a recomputed value's shared one-slot buffer, or -1
  std::vector<int64_t> transient_sizes;
  std::vector<std::vector<int>> recompute_before;  // [nodes]: values that node's backward recomputes first
  std::vector<bool> back_for_producer;             // [values]: recomputed again by its producer's backward
  std::vector<int> fused_activation;               // [nodes]: Linear -> its activation node, or -1
  std::vector<bool> skip_forward;                  // [nodes]: an activation fused into its Linear
  std::vector<bool> needs_grad;  // [values]: some trainable parameter or input needing one is upstream
  std::vector<int64_t> saved_a_size, saved_b_size;  // [nodes]: mean/rstd, mask (elements, all slots)

  // ---- tensor parallelism ----
  std::vector<bool> sharded;             // [values]: holds this shard's slice of the features
  std::vector<bool> partial_input_grad;  // [nodes]: a column-parallel Linear, whose dx is a partial sum
  std::vector<int64_t> scratch_size;     // [nodes]: AllGather's and partial dx's staging (elements)

  // ---- gradients of values ----
  std::vector<int> grad_buffer;  // [values]: index into grad_buffer_sizes, or -1 (aliases: their owner's)
  std::vector<int64_t> grad_buffer_sizes;
  std::vector<int64_t> grad_slot_stride;      // [values]: elements per slot; 0 when shared
  std::vector<bool> shared_grad;              // [values]: lives in a shared buffer, only inside one backward
  std::vector<int> first_writer;              // [values]: the node whose backward writes v's gradient first
  std::vector<std::vector<int>> zero_before;  // [nodes]: shared gradients zeroed before that node's backward
  std::vector<int> cleared_values;            // own value gradients zeroed after each kTrain forward
  std::vector<bool> overwritten;              // [values]: read only by one Linear, which writes dx

  // ---- parameter gradients ----
  std::vector<bool> owns_param_grads;                      // [nodes]: a Linear that alone uses its weight and bias
  std::vector<std::pair<int64_t, int64_t>> zeroed_ranges;  // [offset, end) of the other parameter gradients
  std::vector<bool> deferred_weight_grad;  // [nodes]: W computes its parameter gradients (split backward)

  // Bytes of the buffers a program of this plan holds (before the backend's rounding):
  // parameters and running statistics; their gradients; activations (kept and recomputed)
  // with what backward saves of them (masks, statistics) and collective staging; the
  // activations' gradients.
  struct Memory {
    int64_t weights = 0, gradients = 0, activations = 0, activation_gradients = 0;
    int64_t total() const { return weights + gradients + activations + activation_gradients; }
  };
  Memory memory() const;
};

// The plan for all of `graph` with room for batches of up to `max_batch` samples.
// `tensor_shards`: the size of the tensor-parallel group (1: none); `kept_when_fused`: the
// fused activations the backend cannot recompute exactly (kept_when_fused() in
// program/program.h). Errors: a graph the options do not fit (a collective's group size,
// a value nobody makes, an op that cannot run on a feature shard).
Result<ProgramPlan> plan_program(const Graph& graph, int64_t max_batch, const ProgramOptions& options,
                                 int tensor_shards, const std::vector<ActivationKind>& kept_when_fused);

}  // namespace pipeshard

#endif  // PIPESHARD_PROGRAM_PROGRAM_PLAN_H_
