#include "program/program_plan.h"

#include <algorithm>
#include <span>

#include "ir/buffer_sharing.h"
#include "ir/op_table.h"

namespace pipeshard {
namespace {

bool is_model_output(const Graph& g, int v) {
  return std::find(g.outputs.begin(), g.outputs.end(), v) != g.outputs.end();
}

int64_t per_sample(const Graph& g, int v) { return g.values[v].shape.per_sample_elements(); }

// A row-parallel Linear's partial sums are read by nothing but their AllReduce, which
// then sums them where they lie: the reduced value aliases them, as a Reshape's output
// aliases its input, instead of being a copy held as long (a whole activation per layer
// and slot), and its gradient is theirs (dx = dy).
bool reduces_in_place(const Graph& g, const Node& n, const std::vector<bool>& recomputed) {
  if (op_info(n.kind).output != OutputBuffer::kInPlace) return false;
  const int x = n.inputs[0];
  const int producer = g.values[x].producer;
  return producer >= 0 && g.nodes[producer].kind == OpKind::kLinear && g.values[x].consumers.size() == 1 &&
         !is_model_output(g, x) && !recomputed[x];
}

class Planner {
 public:
  Planner(const Graph& g, int64_t max_batch, const ProgramOptions& options) : g_(g), o_(options) {
    p_.max_batch = max_batch;
    p_.slots = options.slots;
    p_.forward_only = options.forward_only;
    p_.value_chunk.assign(g.values.size(), 0);
    for (size_t v = 0; v < g.values.size() && !options.node_chunk.empty(); ++v) {
      const Value& value = g.values[v];
      const int node = value.producer >= 0 ? value.producer : value.consumers.empty() ? -1 : value.consumers[0];
      if (node >= 0) p_.value_chunk[v] = options.node_chunk[node];
    }
  }

  // The slots of value v's chunk.
  int64_t slots_of(int v) const { return o_.chunk_slots.empty() ? o_.slots : o_.chunk_slots[p_.value_chunk[v]]; }

  Result<ProgramPlan> run(int tensor_shards, const std::vector<ActivationKind>& kept_when_fused) {
    plan_parameters();
    plan_nodes();
    p_.recomputed = o_.recompute_activations ? recomputable_values(g_, kept_when_fused)
                                             : std::vector<bool>(g_.values.size(), false);
    PIPESHARD_RETURN_IF_ERROR(plan_values());
    if (o_.forward_only) p_.needs_grad.assign(g_.values.size(), false);
    plan_recomputed_values();
    PIPESHARD_RETURN_IF_ERROR(plan_tensor_parallel(tensor_shards));
    plan_deferred_weight_gradients();
    plan_gradient_buffers();
    plan_gradient_writes();
    return std::move(p_);
  }

 private:
  // Parameters: trainable ones in one buffer, running statistics in another, each in the
  // order the forward pass first uses them. Backward then finishes the gradient buffer
  // from its end towards its start, so gradient buckets can be reduced while backward
  // continues.
  void plan_parameters() {
    p_.param_offset.assign(g_.params.size(), -1);
    auto place = [&](int i) {
      if (p_.param_offset[i] >= 0) return;
      int64_t& total = g_.params[i].trainable ? p_.trainable_elements : p_.buffer_elements;
      p_.param_offset[i] = total;
      total += g_.params[i].elements();
    };
    for (const Node& n : g_.nodes)
      for (int i : g_.node_params(n)) place(i);
    for (size_t i = 0; i < g_.params.size(); ++i) place(static_cast<int>(i));
  }

  // Which values need a gradient, what each node saves for backward, which activations
  // run fused into their Linear.
  void plan_nodes() {
    const size_t nv = g_.values.size(), nn = g_.nodes.size();
    p_.needs_grad.assign(nv, false);
    for (size_t k = 0; k < g_.inputs.size(); ++k) {
      p_.needs_grad[g_.inputs[k]] = !o_.input_needs_grad.empty() && o_.input_needs_grad[k];
    }
    p_.saved_a_size.assign(nn, 0);
    p_.saved_b_size.assign(nn, 0);
    for (size_t i = 0; i < nn; ++i) {
      const Node& n = g_.nodes[i];
      const int y = n.outputs[0];
      bool upstream = !g_.node_params(n).empty();
      for (int in : n.inputs) upstream = upstream || p_.needs_grad[in];
      p_.needs_grad[y] = upstream;
      // What its backward needs from forward (ir/op_table.h): LayerNorm's mean and rstd per
      // row, BatchNorm's per channel, Dropout's mask; a slot's worth per micro-batch.
      const std::span<const SavedBuffer> saved = saved_buffers(n.kind);
      for (size_t k = 0; k < saved.size(); ++k) {
        (k == 0 ? p_.saved_a_size : p_.saved_b_size)[i] = slots_of(y) * saved_elements(g_, n, saved[k], p_.max_batch);
      }
    }
    p_.fused_activation.assign(nn, -1);
    p_.skip_forward.assign(nn, false);
    const std::vector<bool> fused = fused_activations(g_);
    for (size_t i = 0; i < nn; ++i) {
      if (!fused[i]) continue;
      p_.fused_activation[g_.values[g_.nodes[i].inputs[0]].producer] = static_cast<int>(i);
      p_.skip_forward[i] = true;
    }
  }

  // Activations: a buffer per value, with a slot per micro-batch, except that Reshape
  // and an AllReduce in place (reduces_in_place()) share their input's buffers, and
  // recomputed values share one-slot buffers (plan_recomputed_values()).
  Status plan_values() {
    const size_t nv = g_.values.size();
    p_.owner.assign(nv, -1);
    p_.value_slot_stride.assign(nv, 0);
    p_.value_buffer.assign(nv, -1);
    auto own = [&](int v) {
      p_.value_slot_stride[v] = p_.max_batch * per_sample(g_, v);
      p_.value_buffer[v] = static_cast<int>(p_.value_buffer_sizes.size());
      p_.value_buffer_sizes.push_back(slots_of(v) * p_.value_slot_stride[v]);
      p_.owner[v] = v;
    };
    for (int v : g_.inputs) own(v);
    for (const Node& n : g_.nodes) {
      const int x = n.inputs[0], y = n.outputs[0];
      if (output_aliases_input(n.kind) || reduces_in_place(g_, n, p_.recomputed)) {
        p_.value_slot_stride[y] = p_.value_slot_stride[x];
        p_.owner[y] = p_.owner[x];
      } else if (p_.recomputed[y]) {
        p_.owner[y] = y;  // its buffer: plan_recomputed_values()
      } else {
        own(y);
      }
    }
    for (size_t v = 0; v < nv; ++v) {  // a value nobody makes must be one nobody reads (it gets no buffers)
      if (p_.owner[v] < 0 && (!g_.values[v].consumers.empty() || is_model_output(g_, static_cast<int>(v)))) {
        return Status::error("value '" + g_.values[v].name + "' is read but neither a model input nor made by a node");
      }
    }
    return Status::ok();
  }

  // Recomputed values live in one-slot buffers they share. Steps run forward 0 .. N−1, then
  // backward N−1 .. 0 (step 2N−1−i). A value needs its buffer from the node that writes it
  // (its Linear when fused) to its last reader in forward; and, when some node's backward
  // reads it, again from just before the first such backward, where it is recomputed from
  // the activation's input, to its producer's backward. Values whose spans do not overlap
  // share a buffer (share_buffers(), ir/buffer_sharing.h; partitioner/plan.cc's memory
  // estimate colours the same). A micro-batch's forward and backward each run whole, so the
  // slots can share too: whatever a buffer held in between is recomputed before it is read
  // (a split backward's W recomputes what it reads too: Program::backward_weight()).
  void plan_recomputed_values() {
    const int steps = 2 * static_cast<int>(g_.nodes.size());
    p_.recompute_before.assign(g_.nodes.size(), {});
    p_.back_for_producer.assign(g_.values.size(), false);
    p_.transient_buffer.assign(g_.values.size(), -1);
    auto written_at = [&](int v) {  // the fused Linear's step, or the activation's own
      const int p = g_.values[v].producer;
      return p_.skip_forward[p] ? g_.values[g_.nodes[p].inputs[0]].producer : p;
    };
    std::vector<int> order;  // greedy colouring is tightest in the order the spans start
    for (size_t v = 0; v < g_.values.size(); ++v) {
      if (p_.recomputed[v]) order.push_back(static_cast<int>(v));
    }
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return written_at(a) < written_at(b); });
    std::vector<BufferLife> lives;
    for (int v : order) {
      const Value& val = g_.values[v];
      const int p = val.producer;
      const int written = written_at(v);
      BufferLife& mine = lives.emplace_back();
      mine.spans.emplace_back(written, val.consumers.empty() ? written : val.consumers.back());
      mine.size = p_.max_batch * per_sample(g_, v);
      int first_reader = -1;  // in backward order: the highest node
      for (int c : val.consumers) {
        if (backward_reads_input(g_.nodes[c].kind) && p_.needs_grad[g_.nodes[c].outputs[0]]) {
          first_reader = std::max(first_reader, c);
        }
      }
      if (first_reader >= 0) {
        p_.recompute_before[first_reader].push_back(v);
        p_.back_for_producer[v] = true;
        mine.spans.emplace_back(steps - 1 - first_reader, steps - 1 - p);
      }
    }
    const SharedBuffers shared = share_buffers(lives);
    p_.transient_sizes = shared.sizes;
    for (size_t k = 0; k < order.size(); ++k) p_.transient_buffer[order[k]] = shared.buffer[k];
  }

  // Which values hold one shard's slice of their features, walking back from the
  // collectives: AllReduce's input is a row-parallel Linear's partial output, whose input
  // is sharded; AllGather's input is sharded; elementwise nodes keep their output's state;
  // and a Linear with a sharded output is column-parallel, reading a whole (replicated)
  // input whose gradient it only partly computes.
  Status plan_tensor_parallel(int tensor_shards) {
    p_.sharded.assign(g_.values.size(), false);
    p_.partial_input_grad.assign(g_.nodes.size(), false);
    p_.scratch_size.assign(g_.nodes.size(), 0);
    std::vector<bool> partial(g_.values.size(), false);
    for (size_t i = g_.nodes.size(); i-- > 0;) {
      const Node& n = g_.nodes[i];
      const int x = n.inputs[0], y = n.outputs[0];
      if (n.kind == OpKind::kAllReduce || n.kind == OpKind::kAllGather) {
        if (tensor_shards < 1 || tensor_shards != n.shards) {
          return Status::error(
              node_label(n) + " needs a tensor-parallel group of " + std::to_string(n.shards) + " ranks" +
              (tensor_shards >= 1 ? ", this one has " + std::to_string(tensor_shards) : std::string()));
        }
        (n.kind == OpKind::kAllReduce ? partial : p_.sharded)[x] = true;
        if (n.kind == OpKind::kAllGather) p_.scratch_size[i] = n.shards * p_.max_batch * per_sample(g_, x);
        continue;
      }
      if (partial[y]) {
        if (n.kind != OpKind::kLinear)
          return Status::error("node '" + n.name + "' feeds an AllReduce but is no Linear");
        p_.sharded[x] = true;
      } else if (p_.sharded[y]) {
        if (n.kind == OpKind::kLinear) {
          p_.partial_input_grad[i] = true;
          p_.scratch_size[i] = p_.max_batch * per_sample(g_, x);
        } else if (runs_on_feature_shard(n.kind)) {
          p_.sharded[x] = true;
        } else {
          return Status::error(node_label(n) + " cannot run on a feature shard");
        }
      }
    }
    return Status::ok();
  }

  // A split backward (ProgramOptions::split_backward) leaves the parameter gradients of a
  // Linear, and the bias of an AllReduce, to backward_weight(); other nodes compute theirs
  // in backward_input(), together with their input gradient.
  void plan_deferred_weight_gradients() {
    p_.deferred_weight_grad.assign(g_.nodes.size(), false);
    if (!o_.split_backward || o_.forward_only) return;
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      const Node& n = g_.nodes[i];
      if (!p_.needs_grad[n.outputs[0]]) continue;
      if (n.kind == OpKind::kLinear || (n.kind == OpKind::kAllReduce && n.bias >= 0)) {
        p_.deferred_weight_grad[i] = true;
      }
    }
  }

  // Gradient buffers. Values nobody back-propagates into get none. Model inputs and
  // outputs (or the values they alias) get their own, one per slot: the loss writes the
  // output's after forward, and a pipeline stage receives and sends them around
  // backward(); so do the outputs of nodes whose weight gradient a split backward's W
  // computes, which read them after backward_input(). Every other value's gradient is
  // written first by the backward of its last reader (or of a Reshape of it) and read last
  // by its producer's, all inside one backward(); values whose [producer, last reader] spans
  // do not overlap share a buffer (share_gradient_buffers(), ir/buffer_sharing.h: interval
  // colouring, greedily in backward order, reusing the best-fitting free buffer and growing
  // the largest one when none fits; partitioner/plan.cc's memory estimate colours the same).
  void plan_gradient_buffers() {
    const size_t nv = g_.values.size();
    std::vector<bool> own(nv, !o_.share_gradient_buffers), output(nv, false);
    for (int v : g_.inputs) own[p_.owner[v]] = true;
    for (int v : g_.outputs) own[p_.owner[v]] = output[p_.owner[v]] = !o_.forward_only;
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      if (p_.deferred_weight_grad[i]) own[p_.owner[g_.nodes[i].outputs[0]]] = true;
    }
    std::vector<int> made(nv, -1);
    p_.first_writer.assign(nv, -1);
    for (size_t v = 0; v < nv; ++v) {
      const int o = p_.owner[v];
      if (o < 0) continue;  // made by no node and read by none
      if (o == static_cast<int>(v)) made[o] = g_.values[v].producer;
      p_.first_writer[o] = std::max(p_.first_writer[o], g_.values[v].producer);
      for (int c : g_.values[v].consumers) p_.first_writer[o] = std::max(p_.first_writer[o], c);
    }
    std::vector<int> order;  // owners that need a shared gradient buffer
    p_.grad_slot_stride.assign(nv, 0);
    p_.grad_buffer.assign(nv, -1);
    p_.shared_grad.assign(nv, false);
    for (size_t v = 0; v < nv; ++v) {
      if (p_.owner[v] != static_cast<int>(v) || !(p_.needs_grad[v] || output[v])) continue;
      if (own[v]) {
        p_.grad_slot_stride[v] = p_.max_batch * per_sample(g_, static_cast<int>(v));
        p_.grad_buffer[v] = static_cast<int>(p_.grad_buffer_sizes.size());
        p_.grad_buffer_sizes.push_back(slots_of(static_cast<int>(v)) * p_.grad_slot_stride[v]);
      } else {
        order.push_back(static_cast<int>(v));
      }
    }
    std::vector<GradientSpan> spans;
    for (int v : order) spans.push_back({made[v], p_.first_writer[v], p_.max_batch * per_sample(g_, v)});
    const SharedBuffers shared = share_gradient_buffers(spans);
    const int first_shared = static_cast<int>(p_.grad_buffer_sizes.size());
    p_.grad_buffer_sizes.insert(p_.grad_buffer_sizes.end(), shared.sizes.begin(), shared.sizes.end());
    for (size_t k = 0; k < order.size(); ++k) {
      p_.grad_buffer[order[k]] = first_shared + shared.buffer[k];
      p_.shared_grad[order[k]] = true;
    }
    for (size_t v = 0; v < nv; ++v) {  // aliases share their owner's gradient too
      const int o = p_.owner[v];
      if (o < 0) continue;
      p_.grad_buffer[v] = p_.grad_buffer[o];
      p_.grad_slot_stride[v] = p_.grad_slot_stride[o];
      p_.shared_grad[v] = p_.shared_grad[o];
    }
    p_.zero_before.assign(g_.nodes.size(), {});
  }

  // Who writes which gradient buffer first, so that buffers one Linear writes alone are
  // overwritten by it instead of zeroed and added to: that memset traffic was a fifth of
  // the non-GEMM time of a step on a 4 x 1024 MLP.
  void plan_gradient_writes() {
    std::vector<int> users(g_.params.size(), 0);
    for (const Node& n : g_.nodes)
      for (int q : g_.node_params(n)) ++users[q];
    p_.owns_param_grads.assign(g_.nodes.size(), false);
    std::vector<bool> owned(g_.params.size(), false);
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      const Node& n = g_.nodes[i];
      if (n.kind != OpKind::kLinear) continue;
      const bool alone = users[n.weight] == 1 && (n.bias < 0 || users[n.bias] == 1);
      if (!alone) continue;
      p_.owns_param_grads[i] = true;
      owned[n.weight] = true;
      if (n.bias >= 0) owned[n.bias] = true;
    }
    for (size_t q = 0; q < g_.params.size(); ++q) {
      if (!g_.params[q].trainable || owned[q]) continue;
      const int64_t begin = p_.param_offset[q], end = begin + g_.params[q].elements();
      if (!p_.zeroed_ranges.empty() && p_.zeroed_ranges.back().second == begin) {
        p_.zeroed_ranges.back().second = end;
      } else {
        p_.zeroed_ranges.emplace_back(begin, end);
      }
    }
    p_.overwritten.assign(g_.values.size(), false);
    for (size_t v = 0; v < g_.values.size(); ++v) {
      const auto& readers = g_.values[v].consumers;
      const bool output = is_model_output(g_, static_cast<int>(v));
      const bool owner = p_.owner[v] == static_cast<int>(v);
      p_.overwritten[v] =
          owner && readers.size() == 1 && g_.nodes[readers[0]].kind == OpKind::kLinear && p_.needs_grad[v] && !output;
      // Cleared before each backward: value gradients something adds into. Not values
      // nobody back-propagates into, model outputs (the loss writes them), values whose
      // only reader is a Linear (it overwrites their gradient), nor aliased Reshape
      // buffers (cleared through their owner). A shared buffer is cleared just before
      // its value's first writer, since other values use it until then.
      if (owner && p_.needs_grad[v] && !p_.overwritten[v] && !output) {
        if (p_.shared_grad[v]) {
          p_.zero_before[p_.first_writer[v]].push_back(static_cast<int>(v));
        } else {
          p_.cleared_values.push_back(static_cast<int>(v));
        }
      }
    }
  }

  const Graph& g_;
  const ProgramOptions& o_;
  ProgramPlan p_;
};

int64_t sum(const std::vector<int64_t>& sizes) {
  int64_t n = 0;
  for (int64_t s : sizes) n += s;
  return n;
}

}  // namespace

Result<ProgramPlan> plan_program(const Graph& graph, int64_t max_batch, const ProgramOptions& options,
                                 int tensor_shards, const std::vector<ActivationKind>& kept_when_fused) {
  if (max_batch < 1) return Status::error("the batch size must be at least 1");
  if (options.slots < 1) return Status::error("a program needs at least one micro-batch slot");
  if (!options.node_chunk.empty()) {
    if (options.node_chunk.size() != graph.nodes.size()) return Status::error("node_chunk must name every node");
    const int chunks = *std::max_element(options.node_chunk.begin(), options.node_chunk.end()) + 1;
    const bool fits = options.chunk_slots.empty() ||
                      (static_cast<int>(options.chunk_slots.size()) >= chunks &&
                       *std::max_element(options.chunk_slots.begin(), options.chunk_slots.end()) == options.slots &&
                       *std::min_element(options.chunk_slots.begin(), options.chunk_slots.end()) >= 1);
    if (!fits) return Status::error("chunk_slots must give each chunk 1 to `slots` slots, and one `slots`");
  }
  if (!options.input_needs_grad.empty() && options.input_needs_grad.size() != graph.inputs.size()) {
    return Status::error("input_needs_grad has " + std::to_string(options.input_needs_grad.size()) + " entries for " +
                         std::to_string(graph.inputs.size()) + " inputs");
  }
  return Planner(graph, max_batch, options).run(tensor_shards, kept_when_fused);
}

ProgramPlan::Memory ProgramPlan::memory() const {
  constexpr int64_t kFloat = sizeof(float);
  Memory m;
  // Program::create allocates at least one element for each of these three buffers.
  m.weights = kFloat * (std::max<int64_t>(trainable_elements, 1) + std::max<int64_t>(buffer_elements, 1));
  m.gradients = forward_only ? 0 : kFloat * std::max<int64_t>(trainable_elements, 1);
  m.activations = kFloat * (sum(value_buffer_sizes) + sum(transient_sizes) + sum(saved_a_size) + sum(saved_b_size) +
                            sum(scratch_size));
  m.activation_gradients = kFloat * sum(grad_buffer_sizes);
  return m;
}

}  // namespace pipeshard
