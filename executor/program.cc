#include "executor/program.h"

#include <algorithm>

namespace pipeshard {
namespace {

bool is_model_output(const Graph& g, int v) { return std::find(g.outputs.begin(), g.outputs.end(), v) != g.outputs.end(); }

int64_t per_sample(const Graph& g, int v) { return g.values[v].shape.per_sample_elements(); }

// Rows a last-dim op sees per sample (1 for [batch, features], 4 for [batch, 4, features]).
int64_t rows_per_sample(const Graph& g, int v) { return per_sample(g, v) / g.values[v].shape.features(); }

Activation activation_of(const Node& n) { return Activation{n.activation, n.alpha}; }

}  // namespace

Program::Program(const Graph& graph, Backend& backend, int64_t max_batch)
    : graph_(graph), backend_(backend), max_batch_(max_batch) {}

Program::~Program() = default;

Result<std::unique_ptr<Program>> Program::create(const Graph& g, Backend& backend, int64_t max_batch) {
  if (max_batch < 1) return Status::error("the batch size must be at least 1");
  for (const Node& n : g.nodes) {
    if (n.kind == OpKind::kAllReduce || n.kind == OpKind::kAllGather) {
      return Status::error("node '" + n.name + "' is a tensor-parallel collective; train the unsharded model");
    }
  }
  std::unique_ptr<Program> p(new Program(g, backend, max_batch));
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
  p->grads_ = DeviceBuffer(backend, std::max<int64_t>(p->trainable_elements_, 1));
  p->buffers_ = DeviceBuffer(backend, std::max<int64_t>(buffer_elements, 1));
  p->upload_parameters(g);

  // Activations and gradients; Reshape shares its input's buffers.
  const size_t nv = g.values.size();
  p->value_storage_.resize(nv);
  p->grad_storage_.resize(nv);
  p->value_.assign(nv, nullptr);
  p->grad_.assign(nv, nullptr);
  p->needs_grad_.assign(nv, false);
  auto allocate = [&](int v) {
    const int64_t n = max_batch * per_sample(g, v);
    p->value_storage_[v] = DeviceBuffer(backend, n);
    p->grad_storage_[v] = DeviceBuffer(backend, n);
    p->value_[v] = p->value_storage_[v].data();
    p->grad_[v] = p->grad_storage_[v].data();
  };
  for (int v : g.inputs) allocate(v);
  const size_t nn = g.nodes.size();
  p->saved_a_.resize(nn);
  p->saved_b_.resize(nn);
  p->fused_activation_.assign(nn, -1);
  p->skip_forward_.assign(nn, false);
  for (size_t i = 0; i < nn; ++i) {
    const Node& n = g.nodes[i];
    const int x = n.inputs[0], y = n.outputs[0];
    if (n.kind == OpKind::kReshape) {
      p->value_[y] = p->value_[x];
      p->grad_[y] = p->grad_[x];
    } else {
      allocate(y);
    }
    bool upstream = !g.node_params(n).empty();
    for (int in : n.inputs) upstream = upstream || p->needs_grad_[in];
    p->needs_grad_[y] = upstream;
    const int64_t rows = max_batch * rows_per_sample(g, x);
    switch (n.kind) {
      case OpKind::kLayerNorm:
        p->saved_a_[i] = DeviceBuffer(backend, rows);  // mean
        p->saved_b_[i] = DeviceBuffer(backend, rows);  // rstd
        break;
      case OpKind::kBatchNorm:
        p->saved_a_[i] = DeviceBuffer(backend, g.values[x].shape.dims[1]);
        p->saved_b_[i] = DeviceBuffer(backend, g.values[x].shape.dims[1]);
        break;
      case OpKind::kDropout:
        p->saved_a_[i] = DeviceBuffer(backend, max_batch * per_sample(g, x));  // mask
        break;
      case OpKind::kLinear: {
        const auto& readers = g.values[y].consumers;
        if (readers.size() == 1 && g.nodes[readers[0]].kind == OpKind::kActivation && !is_model_output(g, y)) {
          p->fused_activation_[i] = readers[0];
          p->skip_forward_[readers[0]] = true;
        }
        break;
      }
      default:
        break;
    }
  }
  p->plan_gradient_writes();
  return p;
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
    overwritten_[v] = grad_storage_[v].data() != nullptr && readers.size() == 1 &&
                      g.nodes[readers[0]].kind == OpKind::kLinear && needs_grad_[v] && !output;
    // Cleared before each backward: value gradients something adds into. Not values
    // nobody back-propagates into, model outputs (the loss writes them), values whose
    // only reader is a Linear (it overwrites their gradient), nor aliased Reshape
    // buffers (cleared through their owner, which has the storage).
    if (grad_storage_[v].data() != nullptr && needs_grad_[v] && !overwritten_[v] && !output) {
      cleared_values_.push_back(static_cast<int>(v));
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

void Program::forward(const std::vector<const float*>& host_inputs, int64_t batch, Mode mode, uint64_t seed) {
  PIPESHARD_CHECK(batch >= 1 && batch <= max_batch_, "batch " + std::to_string(batch));
  PIPESHARD_CHECK(host_inputs.size() == graph_.inputs.size());
  for (size_t k = 0; k < host_inputs.size(); ++k) {
    const int v = graph_.inputs[k];
    backend_.upload(value_[v], host_inputs[k], batch * per_sample(graph_, v));
  }
  for (size_t i = 0; i < graph_.nodes.size(); ++i) forward_node(i, batch, mode, seed);
  if (mode == Mode::kTrain) {
    // Backward adds into value gradients: start from zero (see cleared_values_).
    for (int v : cleared_values_) backend_.fill(grad_storage_[v].data(), 0.0f, batch * per_sample(graph_, v));
  }
}

void Program::forward_node(size_t i, int64_t batch, Mode mode, uint64_t seed) {
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
        backend_.linear_forward(value_[act.outputs[0]], value_[x], param(n.weight), param(n.bias), s, &a, value_[y]);
      } else {
        backend_.linear_forward(value_[y], value_[x], param(n.weight), param(n.bias), s);
      }
      return;
    }
    case OpKind::kActivation: backend_.activation_forward(value_[y], value_[x], count, activation_of(n)); return;
    case OpKind::kSoftmax:
    case OpKind::kLogSoftmax: {
      const int64_t width = graph_.values[x].shape.features();
      backend_.softmax_forward(value_[y], value_[x], count / width, width, n.kind == OpKind::kLogSoftmax);
      return;
    }
    case OpKind::kLayerNorm: {
      const int64_t width = graph_.values[x].shape.features();
      backend_.layernorm_forward(value_[y], saved_a_[i].data(), saved_b_[i].data(), value_[x], param(n.weight),
                                 param(n.bias), count / width, width, n.epsilon);
      return;
    }
    case OpKind::kBatchNorm: {
      const int64_t channels = graph_.values[x].shape.dims[1];
      // PyTorch's model.train(): batch statistics whatever mode the file was exported in.
      backend_.batchnorm_forward(value_[y], saved_a_[i].data(), saved_b_[i].data(), const_cast<float*>(param(n.running_mean)),
                                 const_cast<float*>(param(n.running_var)), value_[x], param(n.weight), param(n.bias),
                                 batch, channels, count / (batch * channels), n.epsilon, n.momentum, train);
      return;
    }
    case OpKind::kDropout:
      if (train && n.ratio > 0.0f) {
        backend_.dropout_forward(value_[y], saved_a_[i].data(), value_[x], count, n.ratio, seed,
                                 static_cast<uint64_t>(i) << 40);
      } else {
        backend_.copy(value_[y], value_[x], count);
      }
      return;
    case OpKind::kReshape: return;  // aliased
    case OpKind::kAdd: backend_.add_forward(value_[y], value_[x], value_[n.inputs[1]], count); return;
    case OpKind::kAllReduce:
    case OpKind::kAllGather: PIPESHARD_CHECK(false, "collectives are refused at create()");
  }
}

void Program::backward(int64_t batch, const std::function<void(size_t)>& after_node) {
  for (size_t i = graph_.nodes.size(); i-- > 0;) {
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
  float* dx = needs_grad_[x] ? grad_[x] : nullptr;
  const float* dy = grad_[y];
  switch (n.kind) {
    case OpKind::kLinear: {
      const LinearShape s{batch * rows_per_sample(graph_, x), n.in_features, n.out_features, n.layout, n.alpha, n.beta};
      const GradWrite params = fresh_step_ && owns_param_grads_[i] ? GradWrite::kOverwrite : GradWrite::kAdd;
      const GradWrite input = overwritten_[x] ? GradWrite::kOverwrite : GradWrite::kAdd;
      backend_.linear_backward(dx, param_grad(n.weight), param_grad(n.bias), dy, value_[x], param(n.weight), s, params,
                               input);
      return;
    }
    case OpKind::kActivation:
      if (dx) backend_.activation_backward(dx, dy, value_[x], value_[y], count, activation_of(n));
      return;
    case OpKind::kSoftmax:
    case OpKind::kLogSoftmax: {
      const int64_t width = graph_.values[x].shape.features();
      if (dx) backend_.softmax_backward(dx, dy, value_[y], count / width, width, n.kind == OpKind::kLogSoftmax);
      return;
    }
    case OpKind::kLayerNorm: {
      const int64_t width = graph_.values[x].shape.features();
      backend_.layernorm_backward(grad_[x], param_grad(n.weight), param_grad(n.bias), dy, value_[x], param(n.weight),
                                  saved_a_[i].data(), saved_b_[i].data(), count / width, width);
      return;
    }
    case OpKind::kBatchNorm: {
      const int64_t channels = graph_.values[x].shape.dims[1];
      backend_.batchnorm_backward(grad_[x], param_grad(n.weight), param_grad(n.bias), dy, value_[x], param(n.weight),
                                  saved_a_[i].data(), saved_b_[i].data(), batch, channels,
                                  count / (batch * channels), true);
      return;
    }
    case OpKind::kDropout:
      if (!dx) return;
      if (n.ratio > 0.0f) {
        backend_.dropout_backward(dx, dy, saved_a_[i].data(), count);
      } else {
        backend_.axpy(dx, 1.0f, dy, count);
      }
      return;
    case OpKind::kReshape: return;  // the gradient buffer is shared with the input
    case OpKind::kAdd:
      for (int in : n.inputs) {
        if (needs_grad_[in]) backend_.axpy(grad_[in], 1.0f, dy, count);
      }
      return;
    case OpKind::kAllReduce:
    case OpKind::kAllGather: return;
  }
}

void Program::zero_gradients() {
  for (const auto& [begin, end] : zeroed_ranges_) backend_.fill(grads_.data() + begin, 0.0f, end - begin);
  fresh_step_ = true;
}

const float* Program::output(int k) const { return value_[graph_.outputs[k]]; }
const Shape& Program::output_shape(int k) const { return graph_.values[graph_.outputs[k]].shape; }
float* Program::output_gradient(int k) { return grad_[graph_.outputs[k]]; }

}  // namespace pipeshard
