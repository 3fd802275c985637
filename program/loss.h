// Losses over a Program's output 0, PyTorch's reduction='mean' over the GLOBAL batch:
// the caller passes how many samples the mean runs over, so data-parallel replicas and
// accumulated micro-batches each add their share and the sum equals one big batch.
#ifndef PIPESHARD_PROGRAM_LOSS_H_
#define PIPESHARD_PROGRAM_LOSS_H_

#include <cstdint>

#include "ir/graph.h"
#include "program/program.h"

namespace pipeshard {

enum class LossKind {
  kCrossEntropy,  // integer class labels; F.cross_entropy, or F.nll_loss after LogSoftmax
  kMse,           // float targets shaped like the output; F.mse_loss
};

// True when the model's output is already log-probabilities (it ends in LogSoftmax):
// cross-entropy must then not apply log-softmax again and becomes NLL.
bool ends_in_log_softmax(const Graph& graph);

// Computes the loss of `batch` samples of the program's output 0 against `targets`
// (backend memory: class ids stored as floats [batch] for cross-entropy, or
// [batch, outputs...] for MSE), divided by `global_samples` (and, for MSE, by the
// output elements per sample). Writes ∂loss/∂output into the program's output
// gradient and returns this batch's share of the loss.
double apply_loss(Program& program, LossKind kind, bool log_probs, const float* targets, int64_t batch,
                  int64_t global_samples);

}  // namespace pipeshard

#endif  // PIPESHARD_PROGRAM_LOSS_H_
