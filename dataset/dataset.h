// Training data from NumPy files, checked against the model, served as batches in the
// order docs/design.md fixes ("Training semantics"): in file order, or in a per-epoch
// permutation drawn from the seed; an incomplete last batch is dropped and the next epoch
// starts over.
#ifndef PIPESHARD_DATASET_DATASET_H_
#define PIPESHARD_DATASET_DATASET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "dataset/npy.h"
#include "ir/graph.h"

namespace pipeshard {

// What the labels hold: class indices (for cross-entropy: int64 or int32 [N], stored as
// floats) or values shaped like the model's output (for a regression loss: float32).
enum class Targets { kClassIndices, kValues };

struct Dataset {
  int64_t samples = 0;
  int64_t features_per_sample = 0;  // elements of one sample of the model input
  int64_t targets_per_sample = 0;   // 1 (a class id) for class indices, the output size for values
  std::vector<float> features;      // [samples, features_per_sample]
  std::vector<float> targets;       // [samples, targets_per_sample]; class ids stored as floats
};

// Loads features (float32 [N, ...] matching the model input's dims after the batch)
// and labels (int64/int32 class ids in [0, classes) for kClassIndices; float32 shaped
// like the model output for kValues). Every mismatch is a Status naming the file.
Result<Dataset> load_dataset(const std::string& features_path, const std::string& labels_path, const Graph& graph,
                             Targets targets);

// The same checks and result for arrays already read (parse_npy, read_npy): messages name
// each array by its NpyArray::path. The arrays are copied, not moved from.
Result<Dataset> make_dataset(const NpyArray& features, const NpyArray& labels, const Graph& graph, Targets targets);

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
  int64_t samples_, batch_;
  bool shuffle_;
  uint64_t seed_;
  int64_t permutation_epoch_ = -1;
  std::vector<int64_t> permutation_;
};

// Copies the rows `indices` of `data` ([*, width]) into `out` ([indices, width]).
void gather_rows(const std::vector<float>& data, int64_t width, const std::vector<int64_t>& indices,
                 std::vector<float>& out);

}  // namespace pipeshard

#endif  // PIPESHARD_DATASET_DATASET_H_
