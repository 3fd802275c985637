// A Program runs a Graph on a Backend: forward in topological order, backward in
// reverse. Trainable parameters and their gradients each live in one contiguous buffer
// (one memset, one optimizer loop, one all-reduce later); BatchNorm running statistics
// live in a second one. Every value has an activation buffer sized for the largest
// batch, except an activation's output that backward can recompute from the activation's
// input: it lives only while forward needs it and again from where backward recomputes it
// (one elementwise pass) to the activation's backward, in buffers such values share; an
// MLP of Linear + activation layers keeps half the activations it would. Gradients are summed where a value fans out (residual connections, tied
// weights) because every backward adds (+=). A value's gradient lives only inside one
// backward(), from its last reader's node down to its producer, so values whose lives
// do not overlap share gradient buffers (an MLP of any depth needs two); the model's
// inputs and outputs keep their own, which outlive backward().
//
// A Linear whose only reader is an activation runs as one fused GEMM + bias +
// activation pass; Reshape aliases its input's buffers and costs nothing, and so does a
// row-parallel Linear's AllReduce, which sums the partial sums in place.
//
// The same Program runs one pipeline stage or one tensor-parallel shard of a model
// (the Graph imported from a stage file, see partitioner/stage_writer.h):
// - Activation buffers have `slots` micro-batch slots, so a schedule can keep several
//   micro-batches in flight; select_slot() picks the one forward and backward work on.
// - Stage inputs that come from an earlier stage can ask for their gradient.
// - AllReduce and AllGather nodes run on a tensor-parallel communicator, and so does
//   Megatron's backward all-reduce: the input gradient of a column-parallel Linear (one
//   whose output is sharded) is a partial sum over the shards, summed before use.
// - Dropout draws the mask element (sample, feature) of the WHOLE model would draw, so a
//   micro-batch, a data-parallel slice or a feature shard sees the one-process mask.
#ifndef PIPESHARD_RUNTIME_PROGRAM_H_
#define PIPESHARD_RUNTIME_PROGRAM_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/status.h"
#include "backend/backend.h"
#include "ir/graph.h"

namespace pipeshard {

class Communicator;

enum class Mode { kTrain, kEval };

// The activation kinds whose output a Program keeps where they are fused into the Linear
// before them, because `backend` cannot repeat its fused pass bit for bit
// (Backend::epilogue_recomputes_exactly); what the memory estimate must be told
// (PartitionOptions::kept_when_fused).
std::vector<ActivationKind> kept_when_fused(const Backend& backend);

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
};

class Program {
 public:
  // Builds the program for all of `graph` with room for batches of up to `max_batch`
  // samples, and uploads the graph's parameters. `graph` must outlive the Program.
  static Result<std::unique_ptr<Program>> create(const Graph& graph, Backend& backend, int64_t max_batch,
                                                 const ProgramOptions& options = {});
  ~Program();

  // Trainable parameter elements: the size of parameters() and gradients().
  int64_t trainable_elements() const { return trainable_elements_; }
  float* parameters() { return params_.data(); }  // [trainable_elements]
  float* gradients() { return grads_.data(); }    // [trainable_elements]; null when forward_only
  // Where Graph parameter `p` lives in parameters() (-1 when it is not trainable).
  int64_t parameter_offset(int p) const { return graph_.params[p].trainable ? param_offset_[p] : -1; }

  // Copies parameters and running statistics from the backend into graph.params, or
  // back. `graph` must be the Graph the Program was built from (or a copy of it).
  void download_parameters(Graph& graph) const;
  void upload_parameters(const Graph& graph);
  // This program's parameters and running statistics := `from`'s, on the backend (no host
  // round trip). `from` must be built from the same Graph.
  void copy_parameters_from(const Program& from);

  // Selects the micro-batch slot (0 .. slots − 1) that the calls below work on.
  void select_slot(int slot);
  int slots() const { return slots_; }
  int slot() const { return slot_; }

  // Runs forward for `batch` samples. host_inputs[k] points at the k-th model input,
  // [batch, ...] float32 in host memory. In kTrain mode every BatchNorm uses batch
  // statistics and updates its running statistics (PyTorch's model.train(), whatever
  // mode the file was exported in), and Dropout draws masks from `seed`; in kEval mode
  // both use inference semantics. `first_sample`: where this batch starts in the
  // batch whose masks `seed` draws (micro-batches and data-parallel slices).
  void forward(const std::vector<const float*>& host_inputs, int64_t batch, Mode mode, uint64_t seed,
               int64_t first_sample = 0);
  // The first half of forward(): copies the host inputs into input(k).
  void upload_inputs(const std::vector<const float*>& host_inputs, int64_t batch);
  // The same with inputs already in input(k) (received from an earlier stage).
  void forward_resident(int64_t batch, Mode mode, uint64_t seed, int64_t first_sample = 0);
  // Input k and its gradient (after backward, when it needs one), [batch, ...].
  float* input(int k);
  float* input_gradient(int k);
  // Model output k after forward(): backend memory, [batch, ...].
  const float* output(int k) const;
  const Shape& output_shape(int k) const;
  // Gradient buffer of model output k, [batch, ...]: write ∂loss/∂output here (the
  // loss functions do, a pipeline stage receives it), then call backward().
  float* output_gradient(int k);
  // A kept value's activation buffer in the selected slot, [batch, ...] (pipeline stages
  // send and receive the values crossing a cut from here; a recomputed value is a bug to
  // ask for, since the next forward or backward overwrites it); a model input's or output's
  // gradient buffer (null for an input without one). Other values' gradients live only
  // inside backward() in shared buffers, so asking for one is a bug.
  float* value(int v);
  float* gradient(int v);
  // Whether backward produces a gradient for value v (some trainable parameter, or an
  // input that needs a gradient, is upstream of it).
  bool needs_gradient(int v) const { return needs_grad_[v]; }
  // Adds ∂loss/∂parameters into gradients(). Requires a kTrain forward of the same batch.
  // `after_node(i)` runs once node i's backward is done (nodes go in reverse order):
  // from then on no later node adds into the gradients of node i's parameters unless
  // an earlier node shares them.
  void backward(int64_t batch, const std::function<void(size_t)>& after_node = {});
  // What backward() leaves behind on the host, for a backward replayed from a recording
  // (Backend::record), which runs no host code: later backwards of the step add.
  void backward_replayed() { fresh_step_ = false; }
  // Zeroes the parameter gradients for a new step. Buffers that a single Linear writes
  // are not touched: its next backward overwrites them instead of adding.
  void zero_gradients();

  Backend& backend() { return backend_; }
  // Elements of the gradient buffers of values (activations' gradients, not parameters'):
  // what sharing saves shows here.
  int64_t value_gradient_elements() const;
  // Whether value v is recomputed in backward rather than kept from forward.
  bool recomputed(int v) const { return recomputed_[v]; }
  // Bytes of the buffers this program holds, as asked of the backend (before its rounding):
  // parameters and running statistics; their gradients; activations (kept and recomputed)
  // with what backward saves of them (masks, statistics) and collective staging; the
  // activations' gradients.
  struct Memory {
    int64_t weights = 0, gradients = 0, activations = 0, activation_gradients = 0;
    int64_t total() const { return weights + gradients + activations + activation_gradients; }
  };
  Memory memory() const;

 private:
  Program(const Graph& graph, Backend& backend, int64_t max_batch, const ProgramOptions& options);
  Status plan_tensor_parallel();
  void plan_gradient_writes();
  void plan_recomputed_values();
  void plan_gradient_buffers(bool share);
  void forward_node(size_t i, int64_t batch, Mode mode, uint64_t seed, int64_t first_sample);
  void dropout_forward(size_t i, int64_t batch, uint64_t seed, int64_t first_sample);
  void backward_node(size_t i, int64_t batch);
  const float* param(int p) const;
  float* param_grad(int p);  // null for non-trainable parameters
  // Value v's activation and gradient in the selected slot.
  float* val(int v) const { return value_[v] + slot_ * value_slot_stride_[v]; }
  float* grad(int v) const { return grad_[v] + slot_ * grad_slot_stride_[v]; }

  const Graph& graph_;
  Backend& backend_;
  int64_t max_batch_;
  int slots_ = 1, slot_ = 0;
  Communicator* tensor_ = nullptr;
  std::vector<uint64_t> model_node_ids_;   // [graph nodes]
  ChannelReducer batchnorm_reducer_;       // empty: per-process statistics
  int64_t trainable_elements_ = 0;
  DeviceBuffer params_, grads_, buffers_;  // trainable, their gradients, running stats
  std::vector<int64_t> param_offset_;      // [graph params]; into params_ or buffers_
  std::vector<DeviceBuffer> value_storage_; // [graph values]; empty for a Reshape's output and recomputed values
  std::vector<int64_t> value_slot_stride_;  // [graph values]: elements per slot; 0 for a recomputed value
  // Recomputed values (plan_recomputed_values): their shared one-slot buffers, the values
  // each node's backward recomputes first, and whether the value is there again by its
  // producer's backward (when not, the activation's backward gets y = null).
  std::vector<DeviceBuffer> transient_storage_;
  std::vector<bool> recomputed_;               // [graph values]
  std::vector<std::vector<int>> recompute_before_;  // [graph nodes]
  std::vector<bool> back_for_producer_;        // [graph values]
  std::vector<DeviceBuffer> grad_storage_;  // each a model input's or output's, or shared by several values
  std::vector<float*> value_, grad_;       // [graph values]; Reshape aliases its input
  std::vector<int> owner_;                 // [graph values]: the value whose buffers v aliases (Reshape, AllReduce in place), or v
  std::vector<bool> shared_grad_;          // [graph values]: the gradient lives in a shared buffer
  std::vector<int64_t> grad_slot_stride_;  // [graph values]: elements per slot; 0 when shared
  std::vector<int> first_writer_;          // [graph values]: the node whose backward writes v's gradient first
  std::vector<std::vector<int>> zero_before_;  // [graph nodes]: shared gradients zeroed before the node's backward
  std::vector<DeviceBuffer> saved_a_, saved_b_;  // [graph nodes]: mean/rstd, mask, pre-activation
  std::vector<int> fused_activation_;      // [graph nodes]: Linear -> its activation node, or -1
  std::vector<bool> skip_forward_;         // [graph nodes]: an activation fused into its Linear
  std::vector<bool> needs_grad_;           // [graph values]: some trainable parameter is upstream
  // Tensor parallelism: values holding this shard's slice of the features, and the
  // column-parallel Linears whose input gradient is a partial sum over the shards.
  std::vector<bool> sharded_;              // [graph values]
  std::vector<bool> partial_input_grad_;   // [graph nodes]
  std::vector<DeviceBuffer> scratch_;      // [graph nodes]: AllGather's and partial dx's staging
  // Gradients that one Linear writes alone, so they need no zeroing (GradWrite::kOverwrite):
  std::vector<bool> owns_param_grads_;     // [graph nodes]: a Linear that alone uses its weight and bias
  std::vector<bool> overwritten_;          // [graph values]: read only by one Linear, which writes dx
  std::vector<std::pair<int64_t, int64_t>> zeroed_ranges_;  // [offset, end) of the other parameter gradients
  std::vector<int> cleared_values_;        // own value gradients zeroed after each kTrain forward
  bool fresh_step_ = false;                // zero_gradients() ran and no backward since
  bool forward_only_ = false;
};

}  // namespace pipeshard

#endif  // PIPESHARD_RUNTIME_PROGRAM_H_
