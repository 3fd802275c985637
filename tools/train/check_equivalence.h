// train --check-equivalence: the layout against one process, on the same kind of backend.
#ifndef PIPESHARD_TOOLS_TRAIN_CHECK_EQUIVALENCE_H_
#define PIPESHARD_TOOLS_TRAIN_CHECK_EQUIVALENCE_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "backend/backend.h"
#include "comm/comm.h"
#include "dataset/dataset.h"
#include "ir/graph.h"
#include "runtime/trainer.h"

namespace pipeshard::train_cli {

// Float rounding, relative: what --check-equivalence allows each loss and each tensor.
inline constexpr double kEquivalenceTolerance = 1e-5;

// --check-equivalence K: the requested layout trains K steps; rank 0 also trains the
// same K steps alone on the whole batch, on a backend like the layout's own (`make_backend`: the
// CPU's, or a second one on its GPU in the same precision, so that the check compares
// layouts, not devices), then prints the largest loss and weight differences and the tensor
// that differs most for what it is allowed, with its gradient. Every rank returns 0 when the
// two agree to float rounding, 1 otherwise (the status train exits with).
//
// Float rounding: each step's loss within kEquivalenceTolerance of the reference's
// (relative), and each tensor within kEquivalenceTolerance of the larger of 1 and its
// largest value — except where Adam or AdamW turns rounding into whole steps. Adam
// divides a step by the gradient's own size, so a tensor whose gradient is rounding noise
// (a bias right before BatchNorm: its gradient is 0, computed as ~1e-8) moves up to the
// learning rate per step in a direction the noise picks, differently in every layout (and
// in PyTorch at float32 against float64). A tensor whose largest gradient element is at
// most kEquivalenceTolerance of the model's largest in every step of the reference run is
// held instead to twice the most Adam can move an element over the run (both runs moving
// it as far as they can, in opposite directions), and so is the running mean of a
// BatchNorm that such a bias feeds, which averages the bias in.
int check_equivalence(const Graph& graph, const Dataset& data, const TrainConfig& config, Trainer& distributed,
                      int64_t steps, Communicator& world,
                      const std::function<std::unique_ptr<Backend>()>& make_backend);

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_CHECK_EQUIVALENCE_H_
