#include "program/program.h"

#include <algorithm>

#include "comm/comm.h"

namespace pipeshard {
namespace {

int64_t per_sample(const Graph& g, int v) { return g.values[v].shape.per_sample_elements(); }

// Rows a last-dim op sees per sample (1 for [batch, features], 4 for [batch, 4, features]).
int64_t rows_per_sample(const Graph& g, int v) { return per_sample(g, v) / g.values[v].shape.features(); }

Activation activation_of(const Node& n) { return Activation{n.activation, n.alpha}; }

}  // namespace

Program::Program(const Graph& graph, Backend& backend, ProgramPlan plan, const ProgramOptions& options)
    : graph_(graph), backend_(backend), plan_(std::move(plan)), tensor_(options.tensor),
      model_node_ids_(options.model_node_ids), batchnorm_reducer_(options.batchnorm_reducer),
      gradients_elsewhere_(options.gradients_elsewhere) {}

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
  Result<ProgramPlan> plan =
      plan_program(g, max_batch, options, options.tensor ? options.tensor->size() : 0, kept_when_fused(backend));
  if (!plan) return plan.status();
  if (!options.model_node_ids.empty() && options.model_node_ids.size() != g.nodes.size()) {
    return Status::error("model_node_ids must name every node");
  }
  std::unique_ptr<Program> p(new Program(g, backend, std::move(*plan), options));
  if (p->model_node_ids_.empty()) {
    for (size_t i = 0; i < g.nodes.size(); ++i) p->model_node_ids_.push_back(i);
  }
  p->assign_chunks(options.node_chunk);
  p->chunk_slots_ = options.chunk_slots;
  p->allocate();
  return p;
}

// Each node's chunk, and each cleared gradient's (ProgramPlan::value_chunk).
void Program::assign_chunks(const std::vector<int>& node_chunk) {
  node_chunk_ = node_chunk.empty() ? std::vector<int>(graph_.nodes.size(), 0) : node_chunk;
  int chunks = 1;
  for (int c : node_chunk_) chunks = std::max(chunks, c + 1);
  fresh_step_.assign(static_cast<size_t>(chunks), false);
  for (int v : plan_.cleared_values) cleared_chunk_.push_back(plan_.value_chunk[v]);
}

void Program::select_chunk(int chunk) {
  PIPESHARD_CHECK(chunk >= -1 && chunk < chunks(), "chunk " + std::to_string(chunk));
  chunk_ = chunk;
}

void Program::set_fresh(bool fresh) {
  if (chunk_ >= 0) {
    fresh_step_[chunk_] = fresh;
  } else {
    fresh_step_.assign(fresh_step_.size(), fresh);
  }
}

// The buffers the plan lists, and where each value's activation and gradient start.
void Program::allocate() {
  const Graph& g = graph_;
  const size_t nv = g.values.size(), nn = g.nodes.size();
  params_ = DeviceBuffer(backend_, std::max<int64_t>(plan_.trainable_elements, 1));
  if (!plan_.forward_only && !gradients_elsewhere_) {
    grads_ = DeviceBuffer(backend_, std::max<int64_t>(plan_.trainable_elements, 1));
  }
  buffers_ = DeviceBuffer(backend_, std::max<int64_t>(plan_.buffer_elements, 1));
  upload_parameters(g);
  saved_a_.resize(nn);
  saved_b_.resize(nn);
  scratch_.resize(nn);
  for (size_t i = 0; i < nn; ++i) {
    if (plan_.saved_a_size[i] > 0) saved_a_[i] = DeviceBuffer(backend_, plan_.saved_a_size[i]);
    if (plan_.saved_b_size[i] > 0) saved_b_[i] = DeviceBuffer(backend_, plan_.saved_b_size[i]);
  }
  value_.assign(nv, nullptr);
  for (size_t v = 0; v < nv; ++v) {
    if (plan_.value_buffer[v] < 0) continue;
    value_storage_.emplace_back(backend_, plan_.value_buffer_sizes[plan_.value_buffer[v]]);
    value_[v] = value_storage_.back().data();
  }
  for (int64_t size : plan_.transient_sizes) transient_storage_.emplace_back(backend_, size);
  for (size_t v = 0; v < nv; ++v) {
    if (plan_.transient_buffer[v] >= 0) value_[v] = transient_storage_[plan_.transient_buffer[v]].data();
  }
  for (size_t v = 0; v < nv; ++v) {  // aliases: a Reshape's output, an AllReduce in place
    const int o = plan_.owner[v];
    if (o >= 0 && o != static_cast<int>(v)) value_[v] = value_[o];
  }
  for (size_t i = nn; i-- > 0;) {
    if (plan_.scratch_size[i] > 0) scratch_[i] = DeviceBuffer(backend_, plan_.scratch_size[i]);
  }
  for (int64_t size : plan_.grad_buffer_sizes) grad_storage_.emplace_back(backend_, size);
  grad_.assign(nv, nullptr);
  for (size_t v = 0; v < nv; ++v) {
    if (plan_.grad_buffer[v] >= 0) grad_[v] = grad_storage_[plan_.grad_buffer[v]].data();
  }
}

const float* Program::param(int p) const {
  if (p < 0) return nullptr;
  return (graph_.params[p].trainable ? params_.data() : buffers_.data()) + plan_.param_offset[p];
}

float* Program::param_grad(int p) {
  if (p < 0 || !graph_.params[p].trainable) return nullptr;
  if (place_gradients_) return place_gradients_(plan_.param_offset[p]);
  PIPESHARD_CHECK(!gradients_elsewhere_, "a backward before place_gradients()");
  return grads_.data() + plan_.param_offset[p];
}

void Program::place_gradients(GradientPlacement place) {
  PIPESHARD_CHECK(gradients_elsewhere_ && !place_gradients_,
                  "place_gradients() once, with ProgramOptions::gradients_elsewhere");
  if (!place) {
    gradients_elsewhere_ = false;
    grads_ = DeviceBuffer(backend_, std::max<int64_t>(plan_.trainable_elements, 1));
    zero_gradients();
    return;
  }
  place_gradients_ = std::move(place);
}

Program::Memory Program::memory() const {
  Memory m = plan_.memory();
  if (gradients_elsewhere_) m.gradients = 0;  // the placer's to count
  return m;
}

void Program::copy_parameters_from(const Program& from) {
  PIPESHARD_CHECK(
      &from.graph_ == &graph_ && from.params_.size() == params_.size() && from.buffers_.size() == buffers_.size(),
      "copy_parameters_from: a program of another graph");
  backend_.copy(params_.data(), from.params_.data(), params_.size());
  backend_.copy(buffers_.data(), from.buffers_.data(), buffers_.size());
}

void Program::upload_parameters(const Graph& g) {
  for (size_t i = 0; i < g.params.size(); ++i) {
    float* dst = (g.params[i].trainable ? params_.data() : buffers_.data()) + plan_.param_offset[i];
    backend_.upload(dst, g.params[i].data.data(), g.params[i].elements());
  }
}

void Program::download_parameters(Graph& g) const {
  for (size_t i = 0; i < g.params.size(); ++i) {
    backend_.download(g.params[i].data.data(), param(static_cast<int>(i)), g.params[i].elements());
  }
}

void Program::select_slot(int slot) {
  const int slots = chunk_ >= 0 ? chunk_slots(chunk_) : plan_.slots;
  PIPESHARD_CHECK(slot >= 0 && slot < slots, "slot " + std::to_string(slot) + " of " + std::to_string(slots));
  slot_ = slot;
}

void Program::forward(const std::vector<const float*>& host_inputs, int64_t batch, Mode mode, uint64_t seed,
                      int64_t first_sample) {
  upload_inputs(host_inputs, batch);
  forward_resident(batch, mode, seed, first_sample);
}

void Program::upload_inputs(const std::vector<const float*>& host_inputs, int64_t batch) {
  PIPESHARD_CHECK(batch >= 1 && batch <= plan_.max_batch, "batch " + std::to_string(batch));
  PIPESHARD_CHECK(host_inputs.size() == graph_.inputs.size());
  for (size_t k = 0; k < host_inputs.size(); ++k) {
    if (host_inputs[k] == nullptr) continue;  // resident already (another chunk's input)
    const int v = graph_.inputs[k];
    backend_.upload(val(v), host_inputs[k], batch * per_sample(graph_, v));
  }
}

void Program::forward_resident(int64_t batch, Mode mode, uint64_t seed, int64_t first_sample) {
  PIPESHARD_CHECK(batch >= 1 && batch <= plan_.max_batch, "batch " + std::to_string(batch));
  for (size_t i = 0; i < graph_.nodes.size(); ++i) {
    if (selected(i)) forward_node(i, batch, mode, seed, first_sample);
  }
  if (mode == Mode::kTrain) {
    // Backward adds into value gradients: start from zero (see plan_.cleared_values).
    for (size_t c = 0; c < plan_.cleared_values.size(); ++c) {
      const int v = plan_.cleared_values[c];
      if (chunk_ < 0 || cleared_chunk_[c] == chunk_) backend_.fill(grad(v), 0.0f, batch * per_sample(graph_, v));
    }
  }
}

// Element (sample s, feature j) of the whole model's tensor draws from counter
// (node << 40) + s·features + j, whichever piece of the tensor this program holds.
void Program::dropout_forward(size_t i, int64_t batch, uint64_t seed, int64_t first_sample) {
  const Node& n = graph_.nodes[i];
  const int x = n.inputs[0], y = n.outputs[0];
  const uint64_t stream = model_node_ids_[i] << 40;
  float* mask = saved_a_[i].data() + slot_ * plan_.max_batch * per_sample(graph_, x);
  if (!plan_.sharded[x]) {
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
  if (plan_.skip_forward[i]) return;
  const int x = n.inputs[0], y = n.outputs[0];
  const int64_t count = batch * per_sample(graph_, x);
  const bool train = mode == Mode::kTrain;
  switch (n.kind) {
    case OpKind::kLinear: {
      const LinearShape s{batch * rows_per_sample(graph_, x), n.in_features, n.out_features, n.layout, n.alpha, n.beta};
      if (plan_.fused_activation[i] >= 0) {
        const Node& act = graph_.nodes[plan_.fused_activation[i]];
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
                                 const_cast<float*>(param(n.running_mean)), const_cast<float*>(param(n.running_var)),
                                 val(x), param(n.weight), param(n.bias), batch, channels, count / (batch * channels),
                                 n.epsilon, n.momentum, train, batchnorm_reducer_ ? &batchnorm_reducer_ : nullptr);
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
      if (plan_.owner[y] != plan_.owner[x]) backend_.copy(val(y), val(x), count);
      tensor_->all_reduce(val(y), count, ReduceOp::kSum);
      const int64_t width = graph_.values[y].shape.features();
      if (n.bias >= 0) backend_.add_bias(val(y), param(n.bias), count / width, width);
      return;
    }
    case OpKind::kAllGather: {  // y [rows, shards·w] = shard blocks side by side
      const int64_t width = graph_.values[x].shape.features(), rows = count / width, t = tensor_->size();
      float* gathered = scratch_[i].data();  // [shards][rows, w]
      tensor_->all_gather(val(x), gathered, count);
      for (int64_t s = 0; s < t; ++s)
        backend_.copy_rows(val(y) + s * width, t * width, gathered + s * count, width, rows, width, false);
      return;
    }
  }
}

void Program::backward(int64_t batch, const std::function<void(size_t)>& after_node,
                       const std::function<void(size_t)>& before_node) {
  PIPESHARD_CHECK(!plan_.forward_only, "backward() of a forward-only program");
  backward_nodes(batch, Part::kWhole, after_node, before_node);
  set_fresh(false);  // further backwards (accumulation) add
}

void Program::backward_input(int64_t batch) {
  PIPESHARD_CHECK(!plan_.forward_only, "backward_input() of a forward-only program");
  backward_nodes(batch, Part::kInput, {});
  backward_input_replayed();
}

void Program::backward_input_replayed() {
  // Without deferred nodes backward_input() was the whole backward, Linears' parameter
  // gradients included.
  if (std::none_of(plan_.deferred_weight_grad.begin(), plan_.deferred_weight_grad.end(), [](bool d) { return d; })) {
    set_fresh(false);
  }
}

void Program::backward_weight(int64_t batch, const std::function<void(size_t)>& after_node) {
  PIPESHARD_CHECK(!plan_.forward_only, "backward_weight() of a forward-only program");
  backward_nodes(batch, Part::kWeight, after_node);
  set_fresh(false);
}

void Program::backward_nodes(int64_t batch, Part part, const std::function<void(size_t)>& after_node,
                             const std::function<void(size_t)>& before_node) {
  PIPESHARD_CHECK(!gradients_elsewhere_ || part == Part::kWhole, "a split backward of gradients placed elsewhere");
  for (size_t i = graph_.nodes.size(); i-- > 0;) {
    if (!selected(i)) continue;
    if (before_node) before_node(i);
    if (part == Part::kWeight) {
      if (plan_.deferred_weight_grad[i]) weight_backward(i, batch);
    } else {
      for (int v : plan_.zero_before[i]) backend_.fill(grad(v), 0.0f, batch * per_sample(graph_, v));
      for (int v : plan_.recompute_before[i]) recompute(v, batch);
      backward_node(i, batch, part);
    }
    if (after_node) after_node(i);
  }
}

// Recomputed value v := its activation of the activation's input, which is kept.
void Program::recompute(int v, int64_t batch) {
  const Node& act = graph_.nodes[graph_.values[v].producer];
  backend_.activation_forward(val(v), val(act.inputs[0]), batch * per_sample(graph_, v), activation_of(act));
}

void Program::backward_node(size_t i, int64_t batch, Part part) {
  const Node& n = graph_.nodes[i];
  const int x = n.inputs[0], y = n.outputs[0];
  if (!plan_.needs_grad[y]) return;
  const int64_t count = batch * per_sample(graph_, x);
  float* dx = plan_.needs_grad[x] ? grad(x) : nullptr;
  const float* dy = grad(y);
  // Whether this pass writes the node's parameter gradients: a split backward leaves the
  // deferred nodes' to backward_weight().
  const bool weights = part == Part::kWhole || !plan_.deferred_weight_grad[i];
  switch (n.kind) {
    case OpKind::kLinear: linear_backward(i, batch, part); return;
    case OpKind::kActivation:
      if (dx) {
        const float* kept = plan_.recomputed[y] && !plan_.back_for_producer[y] ? nullptr : val(y);
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
      backend_.layernorm_backward(dx, param_grad(n.weight), param_grad(n.bias), dy, val(x), param(n.weight),
                                  saved_a_[i].data() + slot_ * rows, saved_b_[i].data() + slot_ * rows, rows, width);
      return;
    }
    case OpKind::kBatchNorm: {
      const int64_t channels = graph_.values[x].shape.dims[1];
      backend_.batchnorm_backward(dx, param_grad(n.weight), param_grad(n.bias), dy, val(x), param(n.weight),
                                  saved_a_[i].data() + slot_ * channels, saved_b_[i].data() + slot_ * channels, batch,
                                  channels, count / (batch * channels), true,
                                  batchnorm_reducer_ ? &batchnorm_reducer_ : nullptr);
      return;
    }
    case OpKind::kDropout:
      if (!dx) return;
      if (n.ratio > 0.0f) {
        backend_.dropout_backward(dx, dy, saved_a_[i].data() + slot_ * plan_.max_batch * per_sample(graph_, x), count);
      } else {
        backend_.axpy(dx, 1.0f, dy, count);
      }
      return;
    case OpKind::kReshape: return;  // the gradient buffer is shared with the input
    case OpKind::kAdd:
      for (int in : n.inputs) {
        if (plan_.needs_grad[in]) backend_.axpy(grad(in), 1.0f, dy, count);
      }
      return;
    case OpKind::kAllReduce: {  // every shard's x contributed to y: dx = dy (Megatron's g in backward)
      if (dx && plan_.owner[y] != plan_.owner[x]) backend_.axpy(dx, 1.0f, dy, count);  // in place: the same buffer
      if (weights) weight_backward(i, batch);
      return;
    }
    case OpKind::kAllGather: {  // dx = this shard's block of dy
      const int64_t width = graph_.values[x].shape.features(), t = tensor_->size();
      if (dx) backend_.copy_rows(dx, width, dy + tensor_->rank() * width, t * width, count / width, width, true);
      return;
    }
  }
}

// dx, and unless a split backward defers them, dw and db: one call, as the backend's
// linear_backward computes each with its own product (so a split changes no bit).
void Program::linear_backward(size_t i, int64_t batch, Part part) {
  const Node& n = graph_.nodes[i];
  const int x = n.inputs[0], y = n.outputs[0];
  const int64_t count = batch * per_sample(graph_, x);
  const LinearShape s{batch * rows_per_sample(graph_, x), n.in_features, n.out_features, n.layout, n.alpha, n.beta};
  const bool weights = part == Part::kWhole || !plan_.deferred_weight_grad[i];
  float* dx = plan_.needs_grad[x] ? grad(x) : nullptr;
  float* dw = weights ? param_grad(n.weight) : nullptr;
  float* db = weights ? param_grad(n.bias) : nullptr;
  const GradWrite params = fresh() && plan_.owns_param_grads[i] ? GradWrite::kOverwrite : GradWrite::kAdd;
  const GradWrite input = plan_.overwritten[x] ? GradWrite::kOverwrite : GradWrite::kAdd;
  if (!plan_.partial_input_grad[i] || dx == nullptr) {
    if (dx || dw || db) backend_.linear_backward(dx, dw, db, grad(y), val(x), param(n.weight), s, params, input);
    return;
  }
  // Column-parallel: this shard's dx is a partial sum (Megatron's f in backward).
  float* partial = input == GradWrite::kOverwrite ? dx : scratch_[i].data();
  backend_.linear_backward(partial, dw, db, grad(y), val(x), param(n.weight), s, params, GradWrite::kOverwrite);
  tensor_->all_reduce(partial, count, ReduceOp::kSum);
  if (partial != dx) backend_.axpy(dx, 1.0f, partial, count);
}

// The parameter gradients of a node whose backward_input() left them: a Linear's weight
// and bias from its output gradient and input, an AllReduce's bias from its output
// gradient. A recomputed input is recomputed again, since other values have used its
// buffer since backward_input().
void Program::weight_backward(size_t i, int64_t batch) {
  const Node& n = graph_.nodes[i];
  const int x = n.inputs[0], y = n.outputs[0];
  const int64_t count = batch * per_sample(graph_, x);
  if (n.kind == OpKind::kAllReduce) {
    const int64_t width = graph_.values[y].shape.features();
    if (float* db = param_grad(n.bias)) backend_.bias_backward(db, grad(y), count / width, width);
    return;
  }
  float* dw = param_grad(n.weight);
  float* db = param_grad(n.bias);
  if (dw == nullptr && db == nullptr) return;
  if (plan_.recomputed[x]) recompute(x, batch);
  const LinearShape s{batch * rows_per_sample(graph_, x), n.in_features, n.out_features, n.layout, n.alpha, n.beta};
  const GradWrite params = fresh() && plan_.owns_param_grads[i] ? GradWrite::kOverwrite : GradWrite::kAdd;
  backend_.linear_backward(nullptr, dw, db, grad(y), val(x), param(n.weight), s, params);
}

void Program::zero_gradients() {
  if (plan_.forward_only) return;
  if (!gradients_elsewhere_) {
    for (const auto& [begin, end] : plan_.zeroed_ranges) backend_.fill(grads_.data() + begin, 0.0f, end - begin);
  }
  fresh_step_.assign(fresh_step_.size(), true);
}

float* Program::value(int v) {
  PIPESHARD_CHECK(!plan_.recomputed[v],
                  "'" + graph_.values[v].name + "' is recomputed in backward, not kept from forward");
  return val(v);
}

float* Program::gradient(int v) {
  PIPESHARD_CHECK(!plan_.shared_grad[v],
                  "the gradient of '" + graph_.values[v].name +
                      "' lives only inside backward(); only model inputs' and outputs' are kept");
  return grad(v);
}

int64_t Program::value_gradient_elements() const {
  int64_t n = 0;
  for (const DeviceBuffer& b : grad_storage_) n += b.size();
  return n;
}

float* Program::input(int k) { return val(graph_.inputs[k]); }
float* Program::input_gradient(int k) { return grad(graph_.inputs[k]); }
const float* Program::output(int k) const { return val(graph_.outputs[k]); }
const Shape& Program::output_shape(int k) const { return graph_.values[graph_.outputs[k]].shape; }
float* Program::output_gradient(int k) { return grad(graph_.outputs[k]); }

}  // namespace pipeshard
