#include "dataset/dataset.h"

#include <glob.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
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

// The model input's dims after the batch.
std::vector<int64_t> sample_dims(const Graph& g, int value) {
  const Shape& shape = g.values[value].shape;
  return std::vector<int64_t>(shape.dims.begin() + 1, shape.dims.end());
}

Status check_features(const NpyView& x, const Graph& g) {
  if (x.type != NpyType::kFloat32) {
    return Status::error(x.path + ": holds " + npy_type_name(x.type) + " data, expected float32");
  }
  const std::vector<int64_t> want = sample_dims(g, g.inputs[0]);
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
Status label_outside_classes(const std::string& path, int64_t label, int64_t row, int64_t classes) {
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

Status check_labels(const NpyView& y, const Graph& g, Targets targets) {
  const Shape& out = g.values[g.outputs[0]].shape;
  if (targets == Targets::kClassIndices) {
    if (y.type == NpyType::kFloat32) {
      return Status::error(y.path +
                           ": cross-entropy needs integer class labels (int64 or int32), got float32 "
                           "(regression targets need the mean-squared-error loss)");
    }
    if (y.shape.size() != 1)
      return Status::error(y.path + ": class labels must have shape [N], got " + dims_text(y.shape));
    if (out.rank() != 2)
      return Status::error("cross-entropy needs a model output of shape [batch, classes], got " + out.to_string());
    return Status::ok();
  }
  if (y.type != NpyType::kFloat32) {
    return Status::error(y.path + ": holds " + npy_type_name(y.type) + " data, expected float32");
  }
  const std::vector<int64_t> want = sample_dims(g, g.outputs[0]);
  std::vector<int64_t> got(y.shape.begin() + (y.shape.empty() ? 0 : 1), y.shape.end());
  if (y.shape.empty() || got != want) {
    return Status::error(y.path + ": targets have shape " + dims_text(y.shape) + ", the model's output is [N, " +
                         dims_text(want).substr(1));
  }
  return Status::ok();
}

// Checks the views against the model and makes the data set. Small arrays are checked
// whole now; see kCheckAtLoadBytes.
Result<Dataset> assemble(std::vector<NpyView> xs, std::vector<NpyView> ys, const Graph& g, Targets targets) {
  Dataset d;
  d.features_per_sample = g.values[g.inputs[0]].shape.per_sample_elements();
  const Shape& out = g.values[g.outputs[0]].shape;
  const bool classes = targets == Targets::kClassIndices;
  d.targets_per_sample = classes ? 1 : out.per_sample_elements();
  d.features = Rows(std::move(xs), d.features_per_sample, RowRule::kFinite, "features");
  d.targets = Rows(std::move(ys), d.targets_per_sample, classes ? RowRule::kClassIndex : RowRule::kFinite,
                   classes ? "labels" : "targets", classes ? out.features() : 0);
  d.samples = d.features.count();
  if (d.targets.count() != d.samples) {
    const std::string where = d.targets.parts().size() == 1 ? d.targets.parts()[0].path : "the labels";
    return Status::error(where + ": has " + std::to_string(d.targets.count()) + " rows but the features have " +
                         std::to_string(d.samples));
  }
  if (d.features.bytes() <= kCheckAtLoadBytes) PIPESHARD_RETURN_IF_ERROR(d.features.check_all());
  if (d.targets.bytes() <= kCheckAtLoadBytes) PIPESHARD_RETURN_IF_ERROR(d.targets.check_all());
  return d;
}

bool has_glob_characters(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

// The value of a non-finite float, as numpy prints it.
std::string non_finite_text(float v) { return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"; }

// Whether any of the floats at `p` is NaN or infinite: exponent bits all set. Written on
// the bits so that it vectorises and reads unaligned data.
bool any_non_finite(const uint8_t* p, int64_t n) {
  uint32_t all = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + 4 * i, 4);
    all |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return all != 0;
}

int64_t integer_at(const NpyView& v, int64_t i) {
  if (v.type == NpyType::kInt64) {
    int64_t x;
    std::memcpy(&x, v.data + 8 * i, 8);
    return x;
  }
  int32_t x;
  std::memcpy(&x, v.data + 4 * i, 4);
  return x;
}

}  // namespace

Result<std::vector<std::string>> data_files(const std::string& spec) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<std::string> files;
  if (fs::is_directory(spec, ec)) {
    for (const fs::directory_entry& e : fs::directory_iterator(spec, ec)) {
      if (e.path().extension() == ".npy" && e.is_regular_file(ec)) files.push_back(e.path().string());
    }
    if (ec) return Status::error(spec + ": cannot list the folder: " + ec.message());
    if (files.empty()) return Status::error(spec + ": the folder holds no .npy files");
  } else if (has_glob_characters(spec) && !fs::exists(spec, ec)) {
    glob_t g{};
    const int rc = ::glob(spec.c_str(), 0, nullptr, &g);
    for (size_t i = 0; rc == 0 && i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    if (files.empty()) return Status::error("'" + spec + "' matches no file");
  } else {
    return std::vector<std::string>{spec};
  }
  std::sort(files.begin(), files.end());  // name order, bytewise: the same on every machine
  return files;
}

Result<Dataset> load_dataset(const std::string& features_path, const std::string& labels_path, const Graph& g,
                             Targets targets) {
  PIPESHARD_RETURN_IF_ERROR(check_model(g));
  // The features are checked before the labels are opened, so a bad features file is
  // reported as such even when the labels are bad too.
  Result<std::vector<std::string>> x_files = data_files(features_path);
  if (!x_files) return x_files.status();
  std::vector<NpyView> xs, ys;
  for (const std::string& f : *x_files) {
    Result<NpyView> x = map_npy(f);
    if (!x) return x.status();
    PIPESHARD_RETURN_IF_ERROR(check_features(*x, g));
    xs.push_back(std::move(*x));
  }
  Result<std::vector<std::string>> y_files = data_files(labels_path);
  if (!y_files) return y_files.status();
  for (const std::string& f : *y_files) {
    Result<NpyView> y = map_npy(f);
    if (!y) return y.status();
    PIPESHARD_RETURN_IF_ERROR(check_labels(*y, g, targets));
    ys.push_back(std::move(*y));
  }
  return assemble(std::move(xs), std::move(ys), g, targets);
}

Result<Dataset> make_dataset(const NpyArray& x, const NpyArray& y, const Graph& g, Targets targets) {
  return dataset_of_views(view_npy(x), view_npy(y), g, targets);
}

Result<Dataset> dataset_of_views(NpyView xv, NpyView yv, const Graph& g, Targets targets) {
  PIPESHARD_RETURN_IF_ERROR(check_model(g));
  PIPESHARD_RETURN_IF_ERROR(check_features(xv, g));
  PIPESHARD_RETURN_IF_ERROR(check_labels(yv, g, targets));
  return assemble({std::move(xv)}, {std::move(yv)}, g, targets);
}

Rows::Rows(std::vector<NpyView> parts, int64_t width, RowRule rule, std::string noun, int64_t classes)
    : parts_(std::move(parts)), width_(width), classes_(classes), rule_(rule), noun_(std::move(noun)) {
  for (const NpyView& p : parts_) {
    starts_.push_back(count_);
    count_ += p.shape.empty() ? 0 : p.shape[0];
  }
  starts_.push_back(count_);
}

Rows Rows::of_floats(std::vector<float> values, int64_t width, RowRule rule, int64_t classes) {
  NpyArray a;
  a.path = "memory";
  a.shape = {width > 0 ? static_cast<int64_t>(values.size()) / width : 0, width};
  a.bytes.resize(values.size() * sizeof(float));
  if (!values.empty()) std::memcpy(a.bytes.data(), values.data(), a.bytes.size());
  return Rows({view_npy(std::move(a))}, width, rule, "values", classes);
}

int64_t Rows::bytes() const {
  int64_t n = 0;
  for (const NpyView& p : parts_) n += p.bytes();
  return n;
}

std::pair<size_t, int64_t> Rows::locate(int64_t row) const {
  PIPESHARD_CHECK(row >= 0 && row < count_, "row " + std::to_string(row) + " of " + std::to_string(count_));
  // The last start not after `row`; empty parts share their start with the next and are skipped.
  const auto it = std::upper_bound(starts_.begin(), starts_.end() - 1, row);
  const auto part = static_cast<size_t>(it - starts_.begin() - 1);
  return {part, row - starts_[part]};
}

Status Rows::check_part_rows(size_t part, int64_t first, int64_t n) const {
  const NpyView& v = parts_[part];
  if (rule_ == RowRule::kClassIndex) {
    for (int64_t r = first; r < first + n; ++r) {
      const int64_t label = integer_at(v, r);
      if (label < 0 || label >= classes_) return label_outside_classes(v.path, label, r, classes_);
    }
    return Status::ok();
  }
  // Blocks of rows are scanned for any bad value first; only a block holding one is
  // searched for where it is.
  constexpr int64_t kBlockRows = 1024;
  for (int64_t r0 = first; r0 < first + n; r0 += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, first + n - r0);
    if (!any_non_finite(v.data + 4 * r0 * width_, rows * width_)) continue;
    for (int64_t i = 0; i < rows * width_; ++i) {
      float value;
      std::memcpy(&value, v.data + 4 * (r0 * width_ + i), 4);
      if (std::isfinite(value)) continue;
      return Status::error(v.path + ": row " + std::to_string(r0 + i / width_) + ", column " +
                           std::to_string(i % width_) + " holds " + non_finite_text(value) + "; " + noun_ +
                           " must be finite numbers (the data is bad, not the training: fix or drop that row)");
    }
  }
  return Status::ok();
}

Status Rows::check_all() {
  for (size_t p = 0; p < parts_.size(); ++p) {
    PIPESHARD_RETURN_IF_ERROR(check_part_rows(p, 0, starts_[p + 1] - starts_[p]));
  }
  checked_ = true;
  return Status::ok();
}

const float* Rows::in_place(int64_t first, int64_t n) const {
  if (n <= 0) return nullptr;
  const auto [part, row] = locate(first);
  const NpyView& v = parts_[part];
  if (v.type != NpyType::kFloat32 || starts_[part] + row + n > starts_[part + 1]) return nullptr;
  const uint8_t* p = v.data + 4 * row * width_;
  if (reinterpret_cast<uintptr_t>(p) % alignof(float) != 0) return nullptr;
  return reinterpret_cast<const float*>(p);
}

Status Rows::check_rows(int64_t first, int64_t n) const {
  if (checked_) return Status::ok();
  for (int64_t r = first; r < first + n;) {
    const auto [part, row] = locate(r);
    const int64_t take = std::min(first + n, starts_[part + 1]) - r;
    PIPESHARD_RETURN_IF_ERROR(check_part_rows(part, row, take));
    r += take;
  }
  return Status::ok();
}

Status Rows::gather(const std::vector<int64_t>& indices, std::vector<float>& out) const {
  out.resize(indices.size() * static_cast<size_t>(width_));
  // Shuffled rows of a mapped file lie on 4 KiB pages all over it: each costs a TLB miss and a
  // page walk, which the copies would take one after another. Touching every row first lets
  // the CPU overlap them.
  std::vector<std::pair<size_t, int64_t>> where(indices.size());  // part, row within it
  for (size_t i = 0; i < indices.size(); ++i) {
    where[i] = locate(indices[i]);
    const NpyView& v = parts_[where[i].first];
    __builtin_prefetch(v.data + where[i].second * width_ * npy_type_size(v.type));
  }
  Status status;
  for (size_t i = 0; i < indices.size(); ++i) {
    const auto [part, row] = where[i];
    const NpyView& v = parts_[part];
    float* to = out.data() + i * width_;
    if (v.type == NpyType::kFloat32) {
      std::memcpy(to, v.data + 4 * row * width_, static_cast<size_t>(width_) * 4);
    } else {
      for (int64_t k = 0; k < width_; ++k) to[k] = static_cast<float>(integer_at(v, row * width_ + k));
    }
    if (!checked_ && status.is_ok()) status = check_part_rows(part, row, 1);
  }
  return status;
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
  if (samples_ > kHeldPermutationSamples) {
    for (int64_t i = 0; i < batch_; ++i) out[i] = feistel(epoch, first + i);
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

namespace {

// splitmix64's finaliser: a 64-bit mix in which every input bit moves every output bit.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

// A balanced Feistel network over [0, 4^h), the smallest at least `samples_` (h bits a half),
// six rounds keyed by (seed, epoch, round): a bijection of that range. Positions that map
// past the data are mapped again (cycle walking) until they land in it, which restricted to
// [0, samples_) is still a bijection; 4^h < 4 samples_, so that takes under 4 tries on average.
int64_t BatchOrder::feistel(int64_t epoch, int64_t i) const {
  int half = 1;
  while ((int64_t{1} << (2 * half)) < samples_) ++half;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  const uint64_t key = mix64(seed_ ^ (0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(epoch + 1)));
  auto x = static_cast<uint64_t>(i);
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t round = 0; round < 6; ++round) {
      const uint64_t next = left ^ (mix64(key + (round << 56) + right) & mask);
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= static_cast<uint64_t>(samples_));
  return static_cast<int64_t>(x);
}

}  // namespace pipeshard
