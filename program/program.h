// A Program runs a Graph on a Backend: forward in topological order, backward in
// reverse. Where every tensor lives is its plan's business (program/program_plan.h,
// computed before anything is allocated); the Program allocates what the plan lists and
// runs it. Trainable parameters and their gradients each live in one contiguous buffer
// (one memset, one optimizer loop, one all-reduce later); BatchNorm running statistics
// live in a second one. Gradients are summed where a value fans out (residual
// connections, tied weights) because every backward adds (+=).
//
// Backward runs whole (backward(): B), or split in two (backward_input(), I, then later
// backward_weight(), W) for schedules that fill the pipeline bubble with deferred weight
// gradients: I computes every input gradient, and the parameter gradients of nodes other
// than Linear; W the Linears' weight and bias gradients (and a row-parallel AllReduce's
// bias), from the output gradient I left in its own buffer and the input kept from
// forward. The same products in the same order: B and I-then-W give the same bits.
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
#ifndef PIPESHARD_PROGRAM_PROGRAM_H_
#define PIPESHARD_PROGRAM_PROGRAM_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "common/status.h"
#include "ir/graph.h"
#include "program/program_plan.h"

namespace pipeshard {

class Communicator;

enum class Mode { kTrain, kEval };

// The activation kinds whose output a Program keeps where they are fused into the Linear
// before them, because `backend` cannot repeat its fused pass bit for bit
// (Backend::epilogue_recomputes_exactly); what the memory estimate must be told
// (PartitionOptions::kept_when_fused).
std::vector<ActivationKind> kept_when_fused(const Backend& backend);

class Program {
 public:
  // Builds the program for all of `graph` with room for batches of up to `max_batch`
  // samples, and uploads the graph's parameters. `graph` must outlive the Program.
  static Result<std::unique_ptr<Program>> create(const Graph& graph, Backend& backend, int64_t max_batch,
                                                 const ProgramOptions& options = {});
  ~Program();

  const ProgramPlan& plan() const { return plan_; }
  // Trainable parameter elements: the size of parameters() and gradients().
  int64_t trainable_elements() const { return plan_.trainable_elements; }
  float* parameters() { return params_.data(); }  // [trainable_elements]
  // [trainable_elements]; null when forward_only or the gradients live elsewhere
  float* gradients() { return grads_.data(); }
  // Where Graph parameter `p` lives in parameters() (-1 when it is not trainable).
  int64_t parameter_offset(int p) const { return graph_.params[p].trainable ? plan_.param_offset[p] : -1; }

  // Copies parameters and running statistics from the backend into graph.params, or
  // back. `graph` must be the Graph the Program was built from (or a copy of it).
  void download_parameters(Graph& graph) const;
  void upload_parameters(const Graph& graph);
  // This program's parameters and running statistics := `from`'s, on the backend (no host
  // round trip). `from` must be built from the same Graph.
  void copy_parameters_from(const Program& from);

  // Selects the micro-batch slot (0 .. slots − 1; of the selected chunk's slots when chunks
  // have their own counts) that the calls below work on.
  void select_slot(int slot);
  int slots() const { return plan_.slots; }
  int slot() const { return slot_; }
  // Selects the model chunk (ProgramOptions::node_chunk) that forward and backward run:
  // its nodes alone, its model inputs' and outputs' gradients cleared, its parameter
  // gradients overwritten by its own first backward of the step. -1: every chunk (the
  // default). Chunks share the parameter and gradient buffers and the slots.
  void select_chunk(int chunk);
  int chunks() const { return static_cast<int>(fresh_step_.size()); }
  // The slots chunk j's values have (ProgramOptions::chunk_slots; slots() without them).
  int chunk_slots(int j) const { return chunk_slots_.empty() ? plan_.slots : chunk_slots_[j]; }

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
  bool needs_gradient(int v) const { return plan_.needs_grad[v]; }
  // Adds ∂loss/∂parameters into gradients(). Requires a kTrain forward of the same batch.
  // `after_node(i)` runs once node i's backward is done (nodes go in reverse order):
  // from then on no later node adds into the gradients of node i's parameters unless
  // an earlier node shares them.
  // `before_node(i)` runs before node i's backward writes anything.
  void backward(int64_t batch, const std::function<void(size_t)>& after_node = {},
                const std::function<void(size_t)>& before_node = {});
  // backward() in two halves (ProgramOptions::split_backward): backward_input() computes
  // every input gradient and the parameter gradients of nodes other than those
  // plan().deferred_weight_grad names; backward_weight() then adds theirs, in reverse node
  // order, calling `after_node(i)` as backward() does (for every node: after it, node i's
  // parameter gradients are complete). Between the two, the selected slot's activations
  // and output gradients must stay as they are: no forward or backward_input of another
  // micro-batch in the same slot. Both halves of a micro-batch give backward()'s bits.
  void backward_input(int64_t batch);
  void backward_weight(int64_t batch, const std::function<void(size_t)>& after_node = {});
  // What a backward (or its weight half) leaves behind on the host, for one replayed from a
  // recording (Backend::record), which runs no host code: later backwards of the step add.
  void backward_replayed() { set_fresh(false); }
  // The same for backward_input(): only when no weight half follows (it was the whole backward).
  void backward_input_replayed();
  // Zeroes the parameter gradients for a new step. Buffers that a single Linear writes
  // are not touched: its next backward overwrites them instead of adding.
  void zero_gradients();
  // ProgramOptions::gradients_elsewhere: parameter gradients then live at place(offset)
  // for parameter-buffer offset `offset` (parameter_offset()). Each backward overwrites
  // them, but in the ranges zeroed_gradient_ranges() lists, which it adds into: whoever
  // places the gradients fills those with zeros before the backward that writes them.
  // An empty `place`: the gradients live in the program after all, as without the option.
  using GradientPlacement = std::function<float*(int64_t offset)>;
  void place_gradients(GradientPlacement place);
  const std::vector<std::pair<int64_t, int64_t>>& zeroed_gradient_ranges() const { return plan_.zeroed_ranges; }

  Backend& backend() { return backend_; }
  // Elements of the gradient buffers of values (activations' gradients, not parameters'):
  // what sharing saves shows here.
  int64_t value_gradient_elements() const;
  // Whether value v is recomputed in backward rather than kept from forward.
  bool recomputed(int v) const { return plan_.recomputed[v]; }
  // Bytes of the buffers this program holds (ProgramPlan::Memory).
  using Memory = ProgramPlan::Memory;
  Memory memory() const;

 private:
  Program(const Graph& graph, Backend& backend, ProgramPlan plan, const ProgramOptions& options);
  void allocate();
  void assign_chunks(const std::vector<int>& node_chunk);
  // The parts of backward: which parameter gradients a node's backward writes.
  enum class Part { kWhole, kInput, kWeight };
  void backward_nodes(int64_t batch, Part part, const std::function<void(size_t)>& after_node,
                      const std::function<void(size_t)>& before_node = {});
  void forward_node(size_t i, int64_t batch, Mode mode, uint64_t seed, int64_t first_sample);
  void dropout_forward(size_t i, int64_t batch, uint64_t seed, int64_t first_sample);
  void backward_node(size_t i, int64_t batch, Part part);
  void linear_backward(size_t i, int64_t batch, Part part);
  void weight_backward(size_t i, int64_t batch);
  void recompute(int v, int64_t batch);
  const float* param(int p) const;
  float* param_grad(int p);  // null for non-trainable parameters
  // Value v's activation and gradient in the selected slot.
  float* val(int v) const { return value_[v] + slot_ * plan_.value_slot_stride[v]; }
  float* grad(int v) const { return grad_[v] + slot_ * plan_.grad_slot_stride[v]; }
  bool selected(size_t node) const { return chunk_ < 0 || node_chunk_[node] == chunk_; }
  // Whether the selected chunk's backwards of this step have not yet written its parameter
  // gradients (zero_gradients() ran since); set_fresh() sets it for the selected chunk
  // (or every chunk).
  bool fresh() const { return place_gradients_ || fresh_step_[std::max(chunk_, 0)]; }
  void set_fresh(bool fresh);

  const Graph& graph_;
  Backend& backend_;
  const ProgramPlan plan_;
  int slot_ = 0;
  int chunk_ = -1;                  // the selected chunk; -1: all
  std::vector<int> node_chunk_;     // [graph nodes]; all 0 without chunks
  std::vector<int> cleared_chunk_;  // [plan_.cleared_values]: the chunk of each
  std::vector<int> chunk_slots_;    // [chunks] (ProgramOptions::chunk_slots); empty: plan_.slots each
  Communicator* tensor_ = nullptr;
  std::vector<uint64_t> model_node_ids_;  // [graph nodes]
  ChannelReducer batchnorm_reducer_;      // empty: per-process statistics
  // The buffers the plan lists, and where each value's activation and gradient start.
  DeviceBuffer params_, grads_, buffers_;  // trainable, their gradients, running stats
  std::vector<DeviceBuffer> value_storage_, transient_storage_, grad_storage_;
  std::vector<DeviceBuffer> saved_a_, saved_b_;  // [graph nodes]: mean/rstd, mask
  std::vector<DeviceBuffer> scratch_;            // [graph nodes]: AllGather's and partial dx's staging
  std::vector<float*> value_, grad_;             // [graph values]; aliases point at their owner's
  std::vector<bool> fresh_step_;                 // [chunks]: zero_gradients() ran and no backward since
  bool gradients_elsewhere_ = false;             // ProgramOptions::gradients_elsewhere
  GradientPlacement place_gradients_;            // set by place_gradients()
};

}  // namespace pipeshard

#endif  // PIPESHARD_PROGRAM_PROGRAM_H_
