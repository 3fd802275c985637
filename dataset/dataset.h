// Training data from NumPy files, checked against the model, served as batches in the
// order docs/design.md fixes ("Training semantics"): in file order, or in a per-epoch
// permutation drawn from the seed; an incomplete last batch is dropped and the next epoch
// starts over.
#ifndef PIPESHARD_DATASET_DATASET_H_
#define PIPESHARD_DATASET_DATASET_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "dataset/npy.h"
#include "ir/graph.h"

namespace pipeshard {

// What the labels hold: class indices (for cross-entropy: int64 or int32 [N], stored as
// floats) or values shaped like the model's output (for a regression loss: float32).
enum class Targets { kClassIndices, kValues };

// What every row of a Rows must hold.
enum class RowRule {
  kFinite,      // features and regression targets: no NaN, no infinity
  kClassIndex,  // class labels: an integer in [0, classes)
};

// An array this size or smaller is checked whole when it is loaded, in one streaming pass;
// a bigger one row by row as batches read it, so that start-up stays O(1) in the data's
// size (docs/design.md, "Data").
inline constexpr int64_t kCheckAtLoadBytes = int64_t{256} << 20;

// The rows of one side of a data set (its features, or its labels), concatenated over the
// arrays it is split into, read where they lie: files mapped read-only (map_npy), or arrays
// in memory. Nothing is copied until a batch gathers its rows.
class Rows {
 public:
  Rows() = default;
  // `parts`: arrays [n_i, ...] of `width` elements per row, in order; `noun` names them in
  // messages ("features", "targets", "labels"); `classes` is kClassIndex's bound.
  Rows(std::vector<NpyView> parts, int64_t width, RowRule rule, std::string noun, int64_t classes = 0);
  // Rows held in memory (tests, generated data): [values.size() / width, width] floats.
  static Rows of_floats(std::vector<float> values, int64_t width, RowRule rule = RowRule::kFinite, int64_t classes = 0);

  int64_t count() const { return count_; }
  int64_t width() const { return width_; }
  int64_t bytes() const;  // of the elements, over every part
  const std::vector<NpyView>& parts() const { return parts_; }
  // Whether every row has been checked (check_all, at load).
  bool checked() const { return checked_; }

  // Reads every row once and checks it: the first bad one's message ("x.npy: row 12,
  // column 3 is nan: ..."). Once it has passed, reads skip their checks.
  Status check_all();
  // The rows [first, first + n) in place, as floats, when they lie in one float32 part at
  // a float's alignment; else nullptr. Check them with check_rows unless checked().
  const float* in_place(int64_t first, int64_t n) const;
  Status check_rows(int64_t first, int64_t n) const;
  // Copies the rows `indices` into `out` ([indices, width] floats; class ids as floats)
  // and, unless checked(), checks each: the first bad row's message. The copy is whole
  // either way.
  Status gather(const std::vector<int64_t>& indices, std::vector<float>& out) const;

 private:
  // The part holding row `row`, and the row's index within it.
  std::pair<size_t, int64_t> locate(int64_t row) const;
  Status check_part_rows(size_t part, int64_t first, int64_t n) const;

  std::vector<NpyView> parts_;
  std::vector<int64_t> starts_;  // the first row of each part, then count_
  int64_t count_ = 0, width_ = 0, classes_ = 0;
  RowRule rule_ = RowRule::kFinite;
  std::string noun_;
  bool checked_ = false;
};

struct Dataset {
  int64_t samples = 0;
  int64_t features_per_sample = 0;  // elements of one sample of the model input
  int64_t targets_per_sample = 0;   // 1 (a class id) for class indices, the output size for values
  Rows features;                    // [samples, features_per_sample]
  Rows targets;                     // [samples, targets_per_sample]; class ids read as floats
};

// The .npy files `spec` names, in order: the file itself; every *.npy file of a folder,
// in name order; or the files a glob pattern (with *, ? or [) matches, in name order.
// Errors: nothing matches, or the file does not exist.
Result<std::vector<std::string>> data_files(const std::string& spec);

// Maps features (float32 [N, ...] matching the model input's dims after the batch) and
// labels (int64/int32 class ids in [0, classes) for kClassIndices; float32 shaped like
// the model output for kValues), each a file, a folder or a glob of shards (data_files),
// and checks them against the model: shapes and types at once; the values (finite, in
// range) at once where an array is at most kCheckAtLoadBytes, else as batches read them.
// Every mismatch is a Status naming the file.
Result<Dataset> load_dataset(const std::string& features_path, const std::string& labels_path, const Graph& graph,
                             Targets targets);

// The same checks and result for arrays already read (parse_npy, read_npy): messages name
// each array by its NpyArray::path. The arrays are copied, not moved from.
Result<Dataset> make_dataset(const NpyArray& features, const NpyArray& labels, const Graph& graph, Targets targets);

// The same checks and result for arrays that lie elsewhere in memory (the Python module's
// NumPy arrays), read in place, never copied: messages name each by its NpyView::path,
// and each view's `owner` keeps its bytes alive for as long as the data set.
Result<Dataset> dataset_of_views(NpyView features, NpyView labels, const Graph& graph, Targets targets);

// Data sets up to this many samples are shuffled by a Fisher–Yates permutation held in
// memory (8 bytes a sample: 8 MiB here); bigger ones by a keyed bijection computed per
// index (a Feistel network), which holds nothing, so that memory does not grow with the data.
inline constexpr int64_t kHeldPermutationSamples = int64_t{1} << 20;

// Which samples make up each batch of each epoch.
class BatchOrder {
 public:
  // `batch` samples per batch from `samples`; shuffled per epoch from `seed` unless
  // `shuffle` is false.
  BatchOrder(int64_t samples, int64_t batch, bool shuffle, uint64_t seed);
  int64_t batches_per_epoch() const { return samples_ / batch_; }
  // The sample indices of batch `b` (0-based, counted across epochs).
  std::vector<int64_t> indices(int64_t b);
  // Epoch (1-based) of batch b.
  int64_t epoch_of(int64_t b) const { return b / batches_per_epoch() + 1; }

 private:
  // Position i of epoch `epoch`'s order, above kHeldPermutationSamples.
  int64_t feistel(int64_t epoch, int64_t i) const;

  int64_t samples_, batch_;
  bool shuffle_;
  uint64_t seed_;
  int64_t permutation_epoch_ = -1;
  std::vector<int64_t> permutation_;
};

}  // namespace pipeshard

#endif  // PIPESHARD_DATASET_DATASET_H_
