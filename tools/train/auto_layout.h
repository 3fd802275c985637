// train --layout auto: the layout planner (planner/planner.h) chooses the layout flags
// for the processes train runs on, before anything else is set up.
#ifndef PIPESHARD_TOOLS_TRAIN_AUTO_LAYOUT_H_
#define PIPESHARD_TOOLS_TRAIN_AUTO_LAYOUT_H_

#include <optional>
#include <string>

#include "comm/comm.h"
#include "common/status.h"
#include "importer/onnx_importer.h"
#include "tools/train/args.h"

namespace pipeshard::train_cli {

// What the planner chose, for the report at the end.
struct ChosenLayout {
  std::string text;         // Layout::text()
  std::string flags;        // layout_train_flags()
  double predicted_ms = 0;  // per step
  int considered = 0, fit = 0;
};

// Reads --profile, or measures this machine on every rank at once (the CPU backend), plans
// every layout of the model on world.size() processes with train's batch, optimizer and
// buckets, within the memory each process may take (rank 0's host's available memory
// shared by all of them; unlimited on a GPU), and sets `a`'s layout flags to the fastest. Rank 0
// says what it chose on stderr when `say` (pipeshard.train: only when verbose). Collective; every rank decides the same. Errors: the profile, the
// model, a GPU without --profile, and no layout that fits. `model` is the model to plan,
// imported from a.model here when empty and left there for set_up_run() to train.
Result<ChosenLayout> choose_layout(Args& a, Communicator& world, std::optional<ImportedModel>& model, bool say = true);

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_AUTO_LAYOUT_H_
