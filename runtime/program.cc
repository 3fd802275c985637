#include "runtime/program.h"

#include <algorithm>

#include "comm/comm.h"

namespace pipeshard {
namespace {

bool is_model_output(const Graph& g, int v) { return std::find(g.outputs.begin(), g.outputs.end(), v) != g.outputs.end(); }

int64_t per_sample(const Graph& g, int v) { return g.values[v].shape.per_sample_elements(); }

// Rows a last-dim op sees per sample (1 for [batch, features], 4 for [batch, 4, features]).
int64_t rows_per_sample(const Graph& g, int v) { return per_sample(g, v) / g.values[v].shape.features(); }

Activation activation_of(const Node& n) { return Activation{n.activation, n.alpha}; }

// Whether node n's backward reads its input's activation (val(x)); then only when that
// backward runs at all.
bool backward_reads_input(const Node& n) {
  return n.kind == OpKind::kLinear || n.kind == OpKind::kActivation || n.kind == OpKind::kLayerNorm ||
         n.kind == OpKind::kBatchNorm;
}

// Interval colouring's choice for a value of `need` elements among the buffers (their
// sizes) that `usable` allows: one that fits over one that does not; of two that fit, the
// smaller; of two that do not, the larger (it grows least). -1 when none is usable.
template <typename Usable>
int best_buffer(const std::vector<int64_t>& sizes, int64_t need, Usable&& usable) {
  int best = -1;
  for (size_t b = 0; b < sizes.size(); ++b) {
    if (!usable(b)) continue;
    if (best < 0) {
      best = static_cast<int>(b);
      continue;
    }
    const int64_t a_size = sizes[b], b_size = sizes[best];
    const bool a_fits = a_size >= need, b_fits = b_size >= need;
    if (a_fits != b_fits ? a_fits : (a_fits ? a_size < b_size : a_size > b_size)) best = static_cast<int>(b);
  }
  return best;
}

// A row-parallel Linear's partial sums are read by nothing but their AllReduce, which
// then sums them where they lie: the reduced value aliases them, as a Reshape's output
// aliases its input, instead of being a copy held as long (a whole activation per layer
// and slot), and its gradient is theirs (dx = dy).
bool reduces_in_place(const Graph& g, const Node& n, const std::vector<bool>& recomputed) {
  if (n.kind != OpKind::kAllReduce) return false;
  const int x = n.inputs[0];
  const int producer = g.values[x].producer;
  return producer >= 0 && g.nodes[producer].kind == OpKind::kLinear && g.values[x].consumers.size() == 1 &&
         !is_model_output(g, x) && !recomputed[x];
}

}  // namespace

Program::Program(const Graph& graph, Backend& backend, int64_t max_batch, const ProgramOptions& options)
    : graph_(graph), backend_(backend), max_batch_(max_batch), slots_(options.slots), tensor_(options.tensor),
      model_node_ids_(options.model_node_ids), batchnorm_reducer_(options.batchnorm_reducer),
      forward_only_(options.forward_only) {}

Program::~Program() = default;

std::vector<ActivationKind> kept_when_fused(const Backend& backend) {
  std::vector<ActivationKind> kept;
  for (ActivationKind kind : kActivationKinds) {
    if (!backend.epilogue_recomputes_exactly(Activation{kind})) kept.push_back(kind);
  }
  return kept;
}

Result<std::unique_ptr<Program>> Program::create(const Graph& g, Backend& backend, int64_t max_batch,
                                                 const ProgramOptions& options) {
  if (max_batch < 1) return Status::error("the batch size must be at least 1");
  if (options.slots < 1) return Status::error("a program needs at least one micro-batch slot");
  if (!options.input_needs_grad.empty() && options.input_needs_grad.size() != g.inputs.size()) {
    return Status::error("input_needs_grad has " + std::to_string(options.input_needs_grad.size()) +
                         " entries for " + std::to_string(g.inputs.size()) + " inputs");
  }
  if (!options.model_node_ids.empty() && options.model_node_ids.size() != g.nodes.size()) {
    return Status::error("model_node_ids must name every node");
  }
  std::unique_ptr<Program> p(new Program(g, backend, max_batch, options));
  if (p->model_node_ids_.empty()) {
    for (size_t i = 0; i < g.nodes.size(); ++i) p->model_node_ids_.push_back(i);
  }
  // Parameters: trainable ones in one buffer, running statistics in another, each in
  // the order the forward pass first uses them. Backward then finishes the gradient
  // buffer from its end towards its start, so gradient buckets can be reduced while
  // backward continues.
  int64_t buffer_elements = 0;
  p->param_offset_.assign(g.params.size(), -1);
  auto place = [&](int i) {
    if (p->param_offset_[i] >= 0) return;
    int64_t& total = g.params[i].trainable ? p->trainable_elements_ : buffer_elements;
    p->param_offset_[i] = total;
    total += g.params[i].elements();
  };
  for (const Node& n : g.nodes)
    for (int i : g.node_params(n)) place(i);
  for (size_t i = 0; i < g.params.size(); ++i) place(static_cast<int>(i));
  p->params_ = DeviceBuffer(backend, std::max<int64_t>(p->trainable_elements_, 1));
  if (!options.forward_only) p->grads_ = DeviceBuffer(backend, std::max<int64_t>(p->trainable_elements_, 1));
  p->buffers_ = DeviceBuffer(backend, std::max<int64_t>(buffer_elements, 1));
  p->upload_parameters(g);

  // Activations: a buffer per value, with a slot per micro-batch, except that Reshape
  // and an AllReduce in place (reduces_in_place()) share their input's buffers, and
  // recomputed values share one-slot buffers (plan_recomputed_values()). Gradients:
  // plan_gradient_buffers().
  const size_t nv = g.values.size();
  p->value_storage_.resize(nv);
  p->value_.assign(nv, nullptr);
  p->value_slot_stride_.assign(nv, 0);
  p->owner_.assign(nv, -1);
  p->needs_grad_.assign(nv, false);
  for (size_t k = 0; k < g.inputs.size(); ++k) {
    p->needs_grad_[g.inputs[k]] = !options.input_needs_grad.empty() && options.input_needs_grad[k];
  }
  const size_t nn = g.nodes.size();
  p->saved_a_.resize(nn);
  p->saved_b_.resize(nn);
  p->fused_activation_.assign(nn, -1);
  p->skip_forward_.assign(nn, false);
  for (size_t i = 0; i < nn; ++i) {
    const Node& n = g.nodes[i];
    const int x = n.inputs[0], y = n.outputs[0];
    bool upstream = !g.node_params(n).empty();
    for (int in : n.inputs) upstream = upstream || p->needs_grad_[in];
    p->needs_grad_[y] = upstream;
    const int64_t rows = options.slots * max_batch * rows_per_sample(g, x);
    switch (n.kind) {
      case OpKind::kLayerNorm:
        p->saved_a_[i] = DeviceBuffer(backend, rows);  // mean
        p->saved_b_[i] = DeviceBuffer(backend, rows);  // rstd
        break;
      case OpKind::kBatchNorm:
        p->saved_a_[i] = DeviceBuffer(backend, options.slots * g.values[x].shape.dims[1]);
        p->saved_b_[i] = DeviceBuffer(backend, options.slots * g.values[x].shape.dims[1]);
        break;
      case OpKind::kDropout:
        p->saved_a_[i] = DeviceBuffer(backend, options.slots * max_batch * per_sample(g, x));  // mask
        break;
      default:
        break;
    }
  }
  const std::vector<bool> fused = fused_activations(g);
  for (size_t i = 0; i < nn; ++i) {
    if (!fused[i]) continue;
    p->fused_activation_[g.values[g.nodes[i].inputs[0]].producer] = static_cast<int>(i);
    p->skip_forward_[i] = true;
  }
  p->recomputed_ = options.recompute_activations ? recomputable_values(g, kept_when_fused(backend))
                                                 : std::vector<bool>(nv, false);
  auto allocate = [&](int v) {
    p->value_slot_stride_[v] = max_batch * per_sample(g, v);
    p->value_storage_[v] = DeviceBuffer(backend, options.slots * p->value_slot_stride_[v]);
    p->value_[v] = p->value_storage_[v].data();
    p->owner_[v] = v;
  };
  for (int v : g.inputs) allocate(v);
  for (const Node& n : g.nodes) {
    const int x = n.inputs[0], y = n.outputs[0];
    if (n.kind == OpKind::kReshape || reduces_in_place(g, n, p->recomputed_)) {
      p->value_[y] = p->value_[x];
      p->value_slot_stride_[y] = p->value_slot_stride_[x];
      p->owner_[y] = p->owner_[x];
    } else if (p->recomputed_[y]) {
      p->owner_[y] = y;  // its buffer: plan_recomputed_values()
    } else {
      allocate(y);
    }
  }
  for (size_t v = 0; v < nv; ++v) {  // a value nobody makes must be one nobody reads (it gets no buffers)
    if (p->owner_[v] < 0 && (!g.values[v].consumers.empty() || is_model_output(g, static_cast<int>(v)))) {
      return Status::error("value '" + g.values[v].name + "' is read but neither a model input nor made by a node");
    }
  }
  if (options.forward_only) p->needs_grad_.assign(nv, false);
  p->plan_recomputed_values();
  PIPESHARD_RETURN_IF_ERROR(p->plan_tensor_parallel());
  p->plan_gradient_buffers(options.share_gradient_buffers);
  p->plan_gradient_writes();
  return p;
}

// Which values hold one shard's slice of their features, walking back from the
// collectives: AllReduce's input is a row-parallel Linear's partial output, whose input
// is sharded; AllGather's input is sharded; elementwise nodes keep their output's state;
// and a Linear with a sharded output is column-parallel, reading a whole (replicated)
// input whose gradient it only partly computes.
Status Program::plan_tensor_parallel() {
  const Graph& g = graph_;
  sharded_.assign(g.values.size(), false);
  partial_input_grad_.assign(g.nodes.size(), false);
  scratch_.resize(g.nodes.size());
  std::vector<bool> partial(g.values.size(), false);
  for (size_t i = g.nodes.size(); i-- > 0;) {
    const Node& n = g.nodes[i];
    const int x = n.inputs[0], y = n.outputs[0];
    if (n.kind == OpKind::kAllReduce || n.kind == OpKind::kAllGather) {
      if (tensor_ == nullptr || tensor_->size() != n.shards) {
        return Status::error("node '" + n.name + "' (" + op_kind_name(n) + ") needs a tensor-parallel group of " +
                             std::to_string(n.shards) + " ranks" +
                             (tensor_ ? ", this one has " + std::to_string(tensor_->size()) : std::string()));
      }
      (n.kind == OpKind::kAllReduce ? partial : sharded_)[x] = true;
      if (n.kind == OpKind::kAllGather) {
        scratch_[i] = DeviceBuffer(backend_, n.shards * max_batch_ * per_sample(g, x));
      }
      continue;
    }
    if (partial[y]) {
      if (n.kind != OpKind::kLinear) return Status::error("node '" + n.name + "' feeds an AllReduce but is no Linear");
      sharded_[x] = true;
    } else if (sharded_[y]) {
      if (n.kind == OpKind::kLinear) {
        partial_input_grad_[i] = true;
        scratch_[i] = DeviceBuffer(backend_, max_batch_ * per_sample(g, x));
      } else if (n.kind == OpKind::kActivation || n.kind == OpKind::kDropout) {
        sharded_[x] = true;
      } else {
        return Status::error("node '" + n.name + "' (" + op_kind_name(n) + ") cannot run on a feature shard");
      }
    }
  }
  return Status::ok();
}

// Recomputed values live in one-slot buffers they share. Steps run forward 0 .. N−1, then
// backward N−1 .. 0 (step 2N−1−i). A value needs its buffer from the node that writes it
// (its Linear when fused) to its last reader in forward; and, when some node's backward
// reads it, again from just before the first such backward, where it is recomputed from
// the activation's input, to its producer's backward. Values whose spans do not overlap
// share a buffer. A micro-batch's forward and backward each run whole, so the slots can
// share too: whatever a buffer held in between is recomputed before it is read.
void Program::plan_recomputed_values() {
  const Graph& g = graph_;
  const int steps = 2 * static_cast<int>(g.nodes.size());
  recompute_before_.assign(g.nodes.size(), {});
  back_for_producer_.assign(g.values.size(), false);
  std::vector<int64_t> sizes;
  std::vector<std::vector<std::pair<int, int>>> spans;  // [buffer]: [first, last] steps in use
  std::vector<std::vector<int>> users;                  // [buffer]: values
  auto written_at = [&](int v) {  // the fused Linear's step, or the activation's own
    const int p = g.values[v].producer;
    return skip_forward_[p] ? g.values[g.nodes[p].inputs[0]].producer : p;
  };
  std::vector<int> order;  // greedy colouring is tightest in the order the spans start
  for (size_t v = 0; v < g.values.size(); ++v) {
    if (recomputed_[v]) order.push_back(static_cast<int>(v));
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return written_at(a) < written_at(b); });
  for (int v : order) {
    const Value& val = g.values[v];
    const int p = val.producer;
    const int written = written_at(v);
    std::vector<std::pair<int, int>> mine{{written, val.consumers.empty() ? written : val.consumers.back()}};
    int first_reader = -1;  // in backward order: the highest node
    for (int c : val.consumers) {
      if (backward_reads_input(g.nodes[c]) && needs_grad_[g.nodes[c].outputs[0]]) first_reader = std::max(first_reader, c);
    }
    if (first_reader >= 0) {
      recompute_before_[first_reader].push_back(v);
      back_for_producer_[v] = true;
      mine.emplace_back(steps - 1 - first_reader, steps - 1 - p);
    }
    auto overlaps = [&](size_t b) {
      for (const auto& [first, last] : spans[b])
        for (const auto& [mine_first, mine_last] : mine)
          if (first <= mine_last && mine_first <= last) return true;
      return false;
    };
    const int64_t need = max_batch_ * per_sample(g, v);
    int b = best_buffer(sizes, need, [&](size_t b) { return !overlaps(b); });
    if (b < 0) {
      b = static_cast<int>(sizes.size());
      sizes.push_back(0);
      spans.emplace_back();
      users.emplace_back();
    }
    sizes[b] = std::max(sizes[b], need);
    spans[b].insert(spans[b].end(), mine.begin(), mine.end());
    users[b].push_back(v);
  }
  for (size_t b = 0; b < sizes.size(); ++b) {
    transient_storage_.emplace_back(backend_, sizes[b]);
    for (int v : users[b]) value_[v] = transient_storage_.back().data();
  }
}

// Gradient buffers. Values nobody back-propagates into get none. Model inputs and
// outputs (or the values they alias) get their own, one per slot: the loss writes the
// output's after forward, and a pipeline stage receives and sends them around
// backward(). Every other value's gradient is written first by the backward of its
// last reader (or of a Reshape of it) and read last by its producer's, all inside one
// backward(); values whose [producer, last reader] spans do not overlap share a buffer
// (interval colouring, greedily in backward order, reusing the best-fitting free
// buffer and growing the largest one when none fits).
void Program::plan_gradient_buffers(bool share) {
  const Graph& g = graph_;
  const size_t nv = g.values.size();
  std::vector<bool> own(nv, !share), output(nv, false);
  for (int v : g.inputs) own[owner_[v]] = true;
  for (int v : g.outputs) own[owner_[v]] = output[owner_[v]] = !forward_only_;
  std::vector<int> made(nv, -1);
  first_writer_.assign(nv, -1);
  for (size_t v = 0; v < nv; ++v) {
    const int o = owner_[v];
    if (o < 0) continue;  // made by no node and read by none
    if (o == static_cast<int>(v)) made[o] = g.values[v].producer;
    first_writer_[o] = std::max(first_writer_[o], g.values[v].producer);
    for (int c : g.values[v].consumers) first_writer_[o] = std::max(first_writer_[o], c);
  }
  struct Shared {
    int free_below = 0;  // the producer of its latest value: free for spans ending below it
    std::vector<int> values;
  };
  std::vector<Shared> shared;
  std::vector<int64_t> sizes;  // [shared]
  std::vector<int> order;  // owners that need a shared gradient buffer
  grad_slot_stride_.assign(nv, 0);
  grad_.assign(nv, nullptr);
  shared_grad_.assign(nv, false);
  for (size_t v = 0; v < nv; ++v) {
    if (owner_[v] != static_cast<int>(v) || !(needs_grad_[v] || output[v])) continue;
    if (own[v]) {
      grad_storage_.emplace_back(backend_, slots_ * max_batch_ * per_sample(g, static_cast<int>(v)));
      grad_[v] = grad_storage_.back().data();
      grad_slot_stride_[v] = max_batch_ * per_sample(g, static_cast<int>(v));
    } else {
      order.push_back(static_cast<int>(v));
    }
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return first_writer_[a] > first_writer_[b]; });
  for (int v : order) {
    const int64_t need = max_batch_ * per_sample(g, v);
    int best = best_buffer(sizes, need, [&](size_t b) { return shared[b].free_below > first_writer_[v]; });
    if (best < 0) {  // all still in use
      best = static_cast<int>(shared.size());
      shared.emplace_back();
      sizes.push_back(0);
    }
    sizes[best] = std::max(sizes[best], need);
    shared[best].free_below = made[v];
    shared[best].values.push_back(v);
  }
  for (size_t b = 0; b < shared.size(); ++b) {
    grad_storage_.emplace_back(backend_, sizes[b]);
    for (int v : shared[b].values) {
      grad_[v] = grad_storage_.back().data();
      shared_grad_[v] = true;
    }
  }
  for (size_t v = 0; v < nv; ++v) {  // aliases share their owner's gradient too
    const int o = owner_[v];
    if (o < 0) continue;
    grad_[v] = grad_[o];
    grad_slot_stride_[v] = grad_slot_stride_[o];
    shared_grad_[v] = shared_grad_[o];
  }
  zero_before_.assign(g.nodes.size(), {});
}

// Who writes which gradient buffer first, so that buffers one Linear writes alone are
// overwritten by it instead of zeroed and added to: that memset traffic was a fifth of
// the non-GEMM time of a step on a 4 x 1024 MLP.
void Program::plan_gradient_writes() {
  const Graph& g = graph_;
  std::vector<int> users(g.params.size(), 0);
  for (const Node& n : g.nodes)
    for (int q : g.node_params(n)) ++users[q];
  owns_param_grads_.assign(g.nodes.size(), false);
  std::vector<bool> owned(g.params.size(), false);
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    if (n.kind != OpKind::kLinear) continue;
    const bool alone = users[n.weight] == 1 && (n.bias < 0 || users[n.bias] == 1);
    if (!alone) continue;
    owns_param_grads_[i] = true;
    owned[n.weight] = true;
    if (n.bias >= 0) owned[n.bias] = true;
  }
  for (size_t q = 0; q < g.params.size(); ++q) {
    if (!g.params[q].trainable || owned[q]) continue;
    const int64_t begin = param_offset_[q], end = begin + g.params[q].elements();
    if (!zeroed_ranges_.empty() && zeroed_ranges_.back().second == begin) {
      zeroed_ranges_.back().second = end;
    } else {
      zeroed_ranges_.emplace_back(begin, end);
    }
  }
  overwritten_.assign(g.values.size(), false);
  for (size_t v = 0; v < g.values.size(); ++v) {
    const auto& readers = g.values[v].consumers;
    const bool output = is_model_output(g, static_cast<int>(v));
    const bool owner = owner_[v] == static_cast<int>(v);
    overwritten_[v] = owner && readers.size() == 1 &&
                      g.nodes[readers[0]].kind == OpKind::kLinear && needs_grad_[v] && !output;
    // Cleared before each backward: value gradients something adds into. Not values
    // nobody back-propagates into, model outputs (the loss writes them), values whose
    // only reader is a Linear (it overwrites their gradient), nor aliased Reshape
    // buffers (cleared through their owner). A shared buffer is cleared just before
    // its value's first writer, since other values use it until then.
    if (owner && needs_grad_[v] && !overwritten_[v] && !output) {
      if (shared_grad_[v]) {
        zero_before_[first_writer_[v]].push_back(static_cast<int>(v));
      } else {
        cleared_values_.push_back(static_cast<int>(v));
      }
    }
  }
}

const float* Program::param(int p) const {
  if (p < 0) return nullptr;
  return (graph_.params[p].trainable ? params_.data() : buffers_.data()) + param_offset_[p];
}

float* Program::param_grad(int p) {
  if (p < 0 || !graph_.params[p].trainable) return nullptr;
  return grads_.data() + param_offset_[p];
}

void Program::copy_parameters_from(const Program& from) {
  PIPESHARD_CHECK(&from.graph_ == &graph_ && from.params_.size() == params_.size() &&
                      from.buffers_.size() == buffers_.size(),
                  "copy_parameters_from: a program of another graph");
  backend_.copy(params_.data(), from.params_.data(), params_.size());
  backend_.copy(buffers_.data(), from.buffers_.data(), buffers_.size());
}

void Program::upload_parameters(const Graph& g) {
  for (size_t i = 0; i < g.params.size(); ++i) {
    float* dst = (g.params[i].trainable ? params_.data() : buffers_.data()) + param_offset_[i];
    backend_.upload(dst, g.params[i].data.data(), g.params[i].elements());
  }
}

void Program::download_parameters(Graph& g) const {
  for (size_t i = 0; i < g.params.size(); ++i) {
    backend_.download(g.params[i].data.data(), param(static_cast<int>(i)), g.params[i].elements());
  }
}

void Program::select_slot(int slot) {
  PIPESHARD_CHECK(slot >= 0 && slot < slots_, "slot " + std::to_string(slot));
  slot_ = slot;
}

void Program::forward(const std::vector<const float*>& host_inputs, int64_t batch, Mode mode, uint64_t seed,
                      int64_t first_sample) {
  upload_inputs(host_inputs, batch);
  forward_resident(batch, mode, seed, first_sample);
}

void Program::upload_inputs(const std::vector<const float*>& host_inputs, int64_t batch) {
  PIPESHARD_CHECK(batch >= 1 && batch <= max_batch_, "batch " + std::to_string(batch));
  PIPESHARD_CHECK(host_inputs.size() == graph_.inputs.size());
  for (size_t k = 0; k < host_inputs.size(); ++k) {
    const int v = graph_.inputs[k];
    backend_.upload(val(v), host_inputs[k], batch * per_sample(graph_, v));
  }
}

void Program::forward_resident(int64_t batch, Mode mode, uint64_t seed, int64_t first_sample) {
  PIPESHARD_CHECK(batch >= 1 && batch <= max_batch_, "batch " + std::to_string(batch));
  for (size_t i = 0; i < graph_.nodes.size(); ++i) forward_node(i, batch, mode, seed, first_sample);
  if (mode == Mode::kTrain) {
    // Backward adds into value gradients: start from zero (see cleared_values_).
    for (int v : cleared_values_) backend_.fill(grad(v), 0.0f, batch * per_sample(graph_, v));
  }
}

// Element (sample s, feature j) of the whole model's tensor draws from counter
// (node << 40) + s·features + j, whichever piece of the tensor this program holds.
void Program::dropout_forward(size_t i, int64_t batch, uint64_t seed, int64_t first_sample) {
  const Node& n = graph_.nodes[i];
  const int x = n.inputs[0], y = n.outputs[0];
  const uint64_t stream = model_node_ids_[i] << 40;
  float* mask = saved_a_[i].data() + slot_ * max_batch_ * per_sample(graph_, x);
  if (!sharded_[x]) {
    backend_.dropout_forward(val(y), mask, val(x), batch * per_sample(graph_, x), n.ratio, seed,
                             stream + static_cast<uint64_t>(first_sample * per_sample(graph_, x)));
    return;
  }
  const int64_t width = graph_.values[x].shape.features(), full = width * tensor_->size();
  const int64_t rows = batch * rows_per_sample(graph_, x), row0 = first_sample * rows_per_sample(graph_, x);
  for (int64_t r = 0; r < rows; ++r) {
    backend_.dropout_forward(val(y) + r * width, mask + r * width, val(x) + r * width, width, n.ratio, seed,
                             stream + static_cast<uint64_t>((row0 + r) * full + tensor_->rank() * width));
  }
}

void Program::forward_node(size_t i, int64_t batch, Mode mode, uint64_t seed, int64_t first_sample) {
  const Node& n = graph_.nodes[i];
  if (skip_forward_[i]) return;
  const int x = n.inputs[0], y = n.outputs[0];
  const int64_t count = batch * per_sample(graph_, x);
  const bool train = mode == Mode::kTrain;
  switch (n.kind) {
    case OpKind::kLinear: {
      const LinearShape s{batch * rows_per_sample(graph_, x), n.in_features, n.out_features, n.layout, n.alpha, n.beta};
      if (fused_activation_[i] >= 0) {
        const Node& act = graph_.nodes[fused_activation_[i]];
        const Activation a = activation_of(act);
        backend_.linear_forward(val(act.outputs[0]), val(x), param(n.weight), param(n.bias), s, &a, val(y));
      } else {
        backend_.linear_forward(val(y), val(x), param(n.weight), param(n.bias), s);
      }
      return;
    }
    case OpKind::kActivation: backend_.activation_forward(val(y), val(x), count, activation_of(n)); return;
    case OpKind::kSoftmax:
    case OpKind::kLogSoftmax: {
      const int64_t width = graph_.values[x].shape.features();
      backend_.softmax_forward(val(y), val(x), count / width, width, n.kind == OpKind::kLogSoftmax);
      return;
    }
    case OpKind::kLayerNorm: {
      const int64_t width = graph_.values[x].shape.features();
      const int64_t rows = count / width;
      backend_.layernorm_forward(val(y), saved_a_[i].data() + slot_ * rows, saved_b_[i].data() + slot_ * rows, val(x),
                                 param(n.weight), param(n.bias), rows, width, n.epsilon);
      return;
    }
    case OpKind::kBatchNorm: {
      const int64_t channels = graph_.values[x].shape.dims[1];
      // PyTorch's model.train(): batch statistics whatever mode the file was exported in.
      backend_.batchnorm_forward(val(y), saved_a_[i].data() + slot_ * channels, saved_b_[i].data() + slot_ * channels,
                                 const_cast<float*>(param(n.running_mean)),
                                 const_cast<float*>(param(n.running_var)), val(x), param(n.weight), param(n.bias),
                                 batch, channels, count / (batch * channels), n.epsilon, n.momentum, train,
                                 batchnorm_reducer_ ? &batchnorm_reducer_ : nullptr);
      return;
    }
    case OpKind::kDropout:
      if (train && n.ratio > 0.0f) {
        dropout_forward(i, batch, seed, first_sample);
      } else {
        backend_.copy(val(y), val(x), count);
      }
      return;
    case OpKind::kReshape: return;  // aliased
    case OpKind::kAdd: backend_.add_forward(val(y), val(x), val(n.inputs[1]), count); return;
    case OpKind::kAllReduce: {  // y = Σ_shards x (+ bias)
      if (owner_[y] != owner_[x]) backend_.copy(val(y), val(x), count);
      tensor_->all_reduce(val(y), count, ReduceOp::kSum);
      const int64_t width = graph_.values[y].shape.features();
      if (n.bias >= 0) backend_.add_bias(val(y), param(n.bias), count / width, width);
      return;
    }
    case OpKind::kAllGather: {  // y [rows, shards·w] = shard blocks side by side
      const int64_t width = graph_.values[x].shape.features(), rows = count / width, t = tensor_->size();
      float* gathered = scratch_[i].data();  // [shards][rows, w]
      tensor_->all_gather(val(x), gathered, count);
      for (int64_t s = 0; s < t; ++s) backend_.copy_rows(val(y) + s * width, t * width, gathered + s * count, width, rows, width, false);
      return;
    }
  }
}

void Program::backward(int64_t batch, const std::function<void(size_t)>& after_node) {
  PIPESHARD_CHECK(!forward_only_, "backward() of a forward-only program");
  for (size_t i = graph_.nodes.size(); i-- > 0;) {
    for (int v : zero_before_[i]) backend_.fill(grad(v), 0.0f, batch * per_sample(graph_, v));
    for (int v : recompute_before_[i]) {
      const Node& act = graph_.nodes[graph_.values[v].producer];
      backend_.activation_forward(val(v), val(act.inputs[0]), batch * per_sample(graph_, v), activation_of(act));
    }
    backward_node(i, batch);
    if (after_node) after_node(i);
  }
  fresh_step_ = false;  // further backwards (accumulation) add
}

void Program::backward_node(size_t i, int64_t batch) {
  const Node& n = graph_.nodes[i];
  const int x = n.inputs[0], y = n.outputs[0];
  if (!needs_grad_[y]) return;
  const int64_t count = batch * per_sample(graph_, x);
  float* dx = needs_grad_[x] ? grad(x) : nullptr;
  const float* dy = grad(y);
  switch (n.kind) {
    case OpKind::kLinear: {
      const LinearShape s{batch * rows_per_sample(graph_, x), n.in_features, n.out_features, n.layout, n.alpha, n.beta};
      const GradWrite params = fresh_step_ && owns_param_grads_[i] ? GradWrite::kOverwrite : GradWrite::kAdd;
      const GradWrite input = overwritten_[x] ? GradWrite::kOverwrite : GradWrite::kAdd;
      if (!partial_input_grad_[i] || dx == nullptr) {
        backend_.linear_backward(dx, param_grad(n.weight), param_grad(n.bias), dy, val(x), param(n.weight), s, params,
                                 input);
        return;
      }
      // Column-parallel: this shard's dx is a partial sum (Megatron's f in backward).
      float* partial = input == GradWrite::kOverwrite ? dx : scratch_[i].data();
      backend_.linear_backward(partial, param_grad(n.weight), param_grad(n.bias), dy, val(x), param(n.weight), s,
                               params, GradWrite::kOverwrite);
      tensor_->all_reduce(partial, count, ReduceOp::kSum);
      if (partial != dx) backend_.axpy(dx, 1.0f, partial, count);
      return;
    }
    case OpKind::kActivation:
      if (dx) {
        const float* kept = recomputed_[y] && !back_for_producer_[y] ? nullptr : val(y);
        backend_.activation_backward(dx, dy, val(x), kept, count, activation_of(n));
      }
      return;
    case OpKind::kSoftmax:
    case OpKind::kLogSoftmax: {
      const int64_t width = graph_.values[x].shape.features();
      if (dx) backend_.softmax_backward(dx, dy, val(y), count / width, width, n.kind == OpKind::kLogSoftmax);
      return;
    }
    case OpKind::kLayerNorm: {
      const int64_t width = graph_.values[x].shape.features();
      const int64_t rows = count / width;
      backend_.layernorm_backward(dx, param_grad(n.weight), param_grad(n.bias), dy,
                                  val(x), param(n.weight), saved_a_[i].data() + slot_ * rows,
                                  saved_b_[i].data() + slot_ * rows, rows, width);
      return;
    }
    case OpKind::kBatchNorm: {
      const int64_t channels = graph_.values[x].shape.dims[1];
      backend_.batchnorm_backward(dx, param_grad(n.weight), param_grad(n.bias), dy,
                                  val(x), param(n.weight), saved_a_[i].data() + slot_ * channels,
                                  saved_b_[i].data() + slot_ * channels, batch, channels,
                                  count / (batch * channels), true, batchnorm_reducer_ ? &batchnorm_reducer_ : nullptr);
      return;
    }
    case OpKind::kDropout:
      if (!dx) return;
      if (n.ratio > 0.0f) {
        backend_.dropout_backward(dx, dy, saved_a_[i].data() + slot_ * max_batch_ * per_sample(graph_, x), count);
      } else {
        backend_.axpy(dx, 1.0f, dy, count);
      }
      return;
    case OpKind::kReshape: return;  // the gradient buffer is shared with the input
    case OpKind::kAdd:
      for (int in : n.inputs) {
        if (needs_grad_[in]) backend_.axpy(grad(in), 1.0f, dy, count);
      }
      return;
    case OpKind::kAllReduce: {  // every shard's x contributed to y: dx = dy (Megatron's g in backward)
      const int64_t width = graph_.values[y].shape.features();
      if (dx && owner_[y] != owner_[x]) backend_.axpy(dx, 1.0f, dy, count);  // in place: the same buffer
      if (float* db = param_grad(n.bias)) backend_.bias_backward(db, dy, count / width, width);
      return;
    }
    case OpKind::kAllGather: {  // dx = this shard's block of dy
      const int64_t width = graph_.values[x].shape.features(), t = tensor_->size();
      if (dx) backend_.copy_rows(dx, width, dy + tensor_->rank() * width, t * width, count / width, width, true);
      return;
    }
  }
}

void Program::zero_gradients() {
  if (forward_only_) return;
  for (const auto& [begin, end] : zeroed_ranges_) backend_.fill(grads_.data() + begin, 0.0f, end - begin);
  fresh_step_ = true;
}

float* Program::value(int v) {
  PIPESHARD_CHECK(!recomputed_[v], "'" + graph_.values[v].name + "' is recomputed in backward, not kept from forward");
  return val(v);
}

float* Program::gradient(int v) {
  PIPESHARD_CHECK(!shared_grad_[v], "the gradient of '" + graph_.values[v].name +
                                        "' lives only inside backward(); only model inputs' and outputs' are kept");
  return grad(v);
}

int64_t Program::value_gradient_elements() const {
  int64_t n = 0;
  for (const DeviceBuffer& b : grad_storage_) n += b.size();
  return n;
}

Program::Memory Program::memory() const {
  auto bytes = [](const std::vector<DeviceBuffer>& buffers) {
    int64_t n = 0;
    for (const DeviceBuffer& b : buffers) n += b.size();
    return static_cast<int64_t>(sizeof(float)) * n;
  };
  Memory m;
  m.weights = static_cast<int64_t>(sizeof(float)) * (params_.size() + buffers_.size());
  m.gradients = static_cast<int64_t>(sizeof(float)) * grads_.size();
  m.activations =
      bytes(value_storage_) + bytes(transient_storage_) + bytes(saved_a_) + bytes(saved_b_) + bytes(scratch_);
  m.activation_gradients = bytes(grad_storage_);
  return m;
}

float* Program::input(int k) { return val(graph_.inputs[k]); }
float* Program::input_gradient(int k) { return grad(graph_.inputs[k]); }
const float* Program::output(int k) const { return val(graph_.outputs[k]); }
const Shape& Program::output_shape(int k) const { return graph_.values[graph_.outputs[k]].shape; }
float* Program::output_gradient(int k) { return grad(graph_.outputs[k]); }

}  // namespace pipeshard
