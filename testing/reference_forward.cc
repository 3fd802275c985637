#include "testing/reference_forward.h"

#include <cmath>

#include "ir/op_table.h"

namespace pipeshard {
namespace {

int64_t product(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

float activate(const Node& n, float x) {
  switch (n.activation) {
    case ActivationKind::kRelu: return x > 0 ? x : 0.0f;
    case ActivationKind::kLeakyRelu: return x > 0 ? x : n.alpha * x;
    case ActivationKind::kSigmoid: return 1.0f / (1.0f + std::exp(-x));
    case ActivationKind::kTanh: return std::tanh(x);
    case ActivationKind::kGelu: return 0.5f * x * (1.0f + std::erf(x / std::sqrt(2.0f)));
    case ActivationKind::kGeluTanh: {
      const float k = std::sqrt(2.0f / static_cast<float>(M_PI));
      return 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x)));
    }
    case ActivationKind::kSilu: return x / (1.0f + std::exp(-x));
  }
  return x;
}

// y[r, o] = alpha * sum_i x[r, i] W(o, i) + beta * b[o]
HostTensor linear(const Graph& g, const Node& n, const HostTensor& x) {
  const int64_t in = n.in_features, out = n.out_features, rows = product(x.dims) / in;
  const std::vector<float>& w = g.params[n.weight].data;
  HostTensor y{x.dims, std::vector<float>(static_cast<size_t>(rows * out))};
  y.dims.back() = out;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0.0;
      for (int64_t i = 0; i < in; ++i) {
        const float wv = n.layout == WeightLayout::kOutIn ? w[o * in + i] : w[i * out + o];
        acc += static_cast<double>(x.data[r * in + i]) * wv;
      }
      double v = n.alpha * acc;
      if (n.bias >= 0) v += n.beta * g.params[n.bias].data[o];
      y.data[r * out + o] = static_cast<float>(v);
    }
  }
  return y;
}

HostTensor softmax(const Node& n, const HostTensor& x, bool log) {
  HostTensor y = x;
  const int64_t width = x.dims.back(), rows = product(x.dims) / width;
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = &x.data[r * width];
    float* out = &y.data[r * width];
    float m = in[0];
    for (int64_t i = 1; i < width; ++i) m = std::max(m, in[i]);
    double sum = 0.0;
    for (int64_t i = 0; i < width; ++i) sum += std::exp(static_cast<double>(in[i] - m));
    for (int64_t i = 0; i < width; ++i) {
      out[i] = log ? static_cast<float>(in[i] - m - std::log(sum))
                   : static_cast<float>(std::exp(static_cast<double>(in[i] - m)) / sum);
    }
  }
  (void)n;
  return y;
}

HostTensor layernorm(const Graph& g, const Node& n, const HostTensor& x) {
  HostTensor y = x;
  const int64_t width = x.dims.back(), rows = product(x.dims) / width;
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = &x.data[r * width];
    double mean = 0.0, var = 0.0;
    for (int64_t i = 0; i < width; ++i) mean += in[i];
    mean /= width;
    for (int64_t i = 0; i < width; ++i) var += (in[i] - mean) * (in[i] - mean);
    var /= width;
    const double inv = 1.0 / std::sqrt(var + n.epsilon);
    for (int64_t i = 0; i < width; ++i) {
      double v = (in[i] - mean) * inv;
      if (n.weight >= 0) v *= g.params[n.weight].data[i];
      if (n.bias >= 0) v += g.params[n.bias].data[i];
      y.data[r * width + i] = static_cast<float>(v);
    }
  }
  return y;
}

// Per channel (dim 1); statistics over the batch and any trailing dims.
HostTensor batchnorm(const Graph& g, const Node& n, const HostTensor& x) {
  HostTensor y = x;
  const int64_t batch = x.dims[0], channels = x.dims[1], inner = product(x.dims) / (batch * channels);
  for (int64_t c = 0; c < channels; ++c) {
    double mean = g.params[n.running_mean].data[c], var = g.params[n.running_var].data[c];
    if (n.training) {
      mean = var = 0.0;
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t k = 0; k < inner; ++k) mean += x.data[(b * channels + c) * inner + k];
      mean /= batch * inner;
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t k = 0; k < inner; ++k) {
          const double d = x.data[(b * channels + c) * inner + k] - mean;
          var += d * d;
        }
      var /= batch * inner;
    }
    const double scale = g.params[n.weight].data[c] / std::sqrt(var + n.epsilon);
    const double shift = g.params[n.bias].data[c];
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t k = 0; k < inner; ++k) {
        const int64_t at = (b * channels + c) * inner + k;
        y.data[at] = static_cast<float>((x.data[at] - mean) * scale + shift);
      }
  }
  return y;
}

}  // namespace

HostTensor forward_node(const Graph& g, const Node& n, const std::vector<const HostTensor*>& in) {
  const HostTensor& x = *in[0];
  switch (n.kind) {
    case OpKind::kLinear: return linear(g, n, x);
    case OpKind::kActivation: {
      HostTensor y = x;
      for (float& v : y.data) v = activate(n, v);
      return y;
    }
    case OpKind::kSoftmax: return softmax(n, x, false);
    case OpKind::kLogSoftmax: return softmax(n, x, true);
    case OpKind::kLayerNorm: return layernorm(g, n, x);
    case OpKind::kBatchNorm: return batchnorm(g, n, x);
    case OpKind::kReshape: {
      HostTensor y = x;
      y.dims = {x.dims[0]};
      y.dims.insert(y.dims.end(), n.target.begin(), n.target.end());
      return y;
    }
    case OpKind::kAdd: {
      HostTensor y = x;
      for (size_t i = 0; i < y.data.size(); ++i) y.data[i] += in[1]->data[i];
      return y;
    }
    case OpKind::kDropout:
    case OpKind::kAllReduce:
    case OpKind::kAllGather:
      PIPESHARD_CHECK(n.kind == OpKind::kDropout, "communication nodes are combined by the caller");
      return x;
  }
  return x;
}

Result<std::map<std::string, HostTensor>> run_forward(const Graph& g, const std::map<std::string, HostTensor>& inputs) {
  std::vector<HostTensor> values(g.values.size());
  std::vector<bool> have(g.values.size(), false);
  for (int v : g.inputs) {
    auto it = inputs.find(g.values[v].name);
    if (it == inputs.end()) return Status::error("no data for model input '" + g.values[v].name + "'");
    const auto& want = g.values[v].shape.dims;
    const auto& got = it->second.dims;
    bool ok = got.size() == want.size() && product(got) == static_cast<int64_t>(it->second.data.size());
    for (size_t k = 1; ok && k < want.size(); ++k) ok = got[k] == want[k];
    if (!ok)
      return Status::error("input '" + g.values[v].name + "' does not have shape " + g.values[v].shape.to_string());
    values[v] = it->second;
    have[v] = true;
  }
  for (const Node& n : g.nodes) {
    std::vector<const HostTensor*> in;
    for (int v : n.inputs) {
      PIPESHARD_CHECK(have[v], "value computed before use");
      in.push_back(&values[v]);
    }
    if (op_info(n.kind).tensor_parallel == ShardUse::kCombinesShards) {
      return Status::error("node '" + n.name + "' needs the other tensor-parallel shards; run the shards together");
    }
    values[n.outputs[0]] = forward_node(g, n, in);
    have[n.outputs[0]] = true;
  }
  std::map<std::string, HostTensor> out;
  for (size_t v = 0; v < values.size(); ++v) {
    if (have[v]) out[g.values[v].name] = std::move(values[v]);
  }
  return out;
}

}  // namespace pipeshard
