#include "dataset/dataset.h"

#include <numeric>
#include <random>

#include "dataset/npy.h"

namespace pipeshard {
namespace {

std::string dims_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

Status check_model(const Graph& g) {
  if (g.inputs.size() != 1 || g.outputs.size() != 1) {
    return Status::error("train needs a model with one input and one output");
  }
  return Status::ok();
}

Status check_features(const NpyArray& x, const Graph& g) {
  PIPESHARD_RETURN_IF_ERROR(x.expect_type(NpyType::kFloat32));
  const Shape& in = g.values[g.inputs[0]].shape;
  std::vector<int64_t> want(in.dims.begin() + 1, in.dims.end());
  std::vector<int64_t> got(x.shape.begin() + (x.shape.empty() ? 0 : 1), x.shape.end());
  if (x.shape.empty() || got != want) {
    return Status::error(x.path + ": features have shape " + dims_text(x.shape) + ", the model's input '" +
                         g.values[g.inputs[0]].name + "' takes [N, " + dims_text(want).substr(1));
  }
  return Status::ok();
}

// Class label `label` of row `row` is outside [0, classes). A model with one output is no
// classifier (a softmax over one class is 1 whatever the weights) but a regression: say
// what it needs.
Status label_outside_classes(const std::string& path, int64_t label, size_t row, int64_t classes) {
  const std::string range =
      classes == 1 ? "1 class [0, 0]" : std::to_string(classes) + " classes [0, " + std::to_string(classes - 1) + "]";
  std::string message =
      path + ": label " + std::to_string(label) + " at row " + std::to_string(row) + " is outside the model's " + range;
  if (classes == 1) {
    message +=
        "; a model with one output is a regression model: train it on float32 targets with the "
        "mean-squared-error loss (--loss mse)";
  }
  return Status::error(message);
}

}  // namespace

Result<Dataset> load_dataset(const std::string& features_path, const std::string& labels_path, const Graph& g,
                             Targets targets) {
  PIPESHARD_RETURN_IF_ERROR(check_model(g));
  Result<NpyArray> x = read_npy(features_path);
  if (!x) return x.status();
  // The features are checked before the labels are read, so a bad features file is
  // reported as such even when the labels are bad too.
  PIPESHARD_RETURN_IF_ERROR(check_features(*x, g));
  Result<NpyArray> y = read_npy(labels_path);
  if (!y) return y.status();
  return make_dataset(*x, *y, g, targets);
}

Result<Dataset> make_dataset(const NpyArray& x, const NpyArray& y, const Graph& g, Targets targets) {
  PIPESHARD_RETURN_IF_ERROR(check_model(g));
  PIPESHARD_RETURN_IF_ERROR(check_features(x, g));
  const std::string& labels_path = y.path;
  const Shape& in = g.values[g.inputs[0]].shape;
  Dataset d;
  d.samples = x.shape[0];
  d.features_per_sample = in.per_sample_elements();
  d.features = x.as_float();
  if (y.shape.empty() || y.shape[0] != d.samples) {
    return Status::error(labels_path + ": has " +
                         (y.shape.empty() ? std::string("no rows") : std::to_string(y.shape[0]) + " rows") +
                         " but the features have " + std::to_string(d.samples));
  }
  const Shape& out = g.values[g.outputs[0]].shape;
  if (targets == Targets::kClassIndices) {
    if (y.type == NpyType::kFloat32) {
      return Status::error(labels_path +
                           ": cross-entropy needs integer class labels (int64 or int32), got float32 "
                           "(regression targets need the mean-squared-error loss)");
    }
    if (y.shape.size() != 1)
      return Status::error(labels_path + ": class labels must have shape [N], got " + dims_text(y.shape));
    if (out.rank() != 2)
      return Status::error("cross-entropy needs a model output of shape [batch, classes], got " + out.to_string());
    const int64_t classes = out.features();
    const std::vector<int64_t> labels = y.as_int64();
    d.targets.resize(labels.size());
    for (size_t i = 0; i < labels.size(); ++i) {
      if (labels[i] < 0 || labels[i] >= classes) return label_outside_classes(labels_path, labels[i], i, classes);
      d.targets[i] = static_cast<float>(labels[i]);
    }
    d.targets_per_sample = 1;
  } else {
    PIPESHARD_RETURN_IF_ERROR(y.expect_type(NpyType::kFloat32));
    std::vector<int64_t> want_y(out.dims.begin() + 1, out.dims.end());
    std::vector<int64_t> got_y(y.shape.begin() + 1, y.shape.end());
    if (got_y != want_y) {
      return Status::error(labels_path + ": targets have shape " + dims_text(y.shape) + ", the model's output is [N, " +
                           dims_text(want_y).substr(1));
    }
    d.targets = y.as_float();
    d.targets_per_sample = out.per_sample_elements();
  }
  return d;
}

BatchOrder::BatchOrder(int64_t samples, int64_t batch, bool shuffle, uint64_t seed)
    : samples_(samples), batch_(batch), shuffle_(shuffle), seed_(seed) {}

std::vector<int64_t> BatchOrder::indices(int64_t b) {
  const int64_t epoch = b / batches_per_epoch();
  const int64_t first = (b % batches_per_epoch()) * batch_;
  std::vector<int64_t> out(static_cast<size_t>(batch_));
  if (!shuffle_) {
    std::iota(out.begin(), out.end(), first);
    return out;
  }
  if (permutation_epoch_ != epoch) {
    // One generator per epoch, seeded from (seed, epoch): any epoch's order can be
    // recomputed on resume without replaying the ones before it.
    std::mt19937_64 rng(seed_ ^ (0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(epoch + 1)));
    permutation_.resize(static_cast<size_t>(samples_));
    std::iota(permutation_.begin(), permutation_.end(), int64_t{0});
    for (int64_t i = samples_ - 1; i > 0; --i) {
      std::uniform_int_distribution<int64_t> pick(0, i);
      std::swap(permutation_[i], permutation_[pick(rng)]);
    }
    permutation_epoch_ = epoch;
  }
  std::copy(permutation_.begin() + first, permutation_.begin() + first + batch_, out.begin());
  return out;
}

void gather_rows(const std::vector<float>& data, int64_t width, const std::vector<int64_t>& indices,
                 std::vector<float>& out) {
  out.resize(indices.size() * static_cast<size_t>(width));
  for (size_t r = 0; r < indices.size(); ++r) {
    std::copy(data.begin() + indices[r] * width, data.begin() + (indices[r] + 1) * width, out.begin() + r * width);
  }
}

}  // namespace pipeshard
