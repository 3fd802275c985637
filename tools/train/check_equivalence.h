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

// --check-equivalence K: the requested layout trains K steps; rank 0 also trains the
// same K steps alone on the whole batch, on a backend like the layout's own (`make_backend`: the
// CPU's, or a second one on its GPU in the same precision, so that the check compares
// layouts, not devices), then prints the largest differences. Every rank returns 0 when
// they agree to float rounding (1e-5 relative), 1 otherwise.
int check_equivalence(const Graph& graph, const Dataset& data, const TrainConfig& config, Trainer& distributed,
                      int64_t steps, Communicator& world,
                      const std::function<std::unique_ptr<Backend>()>& make_backend);

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_CHECK_EQUIVALENCE_H_
