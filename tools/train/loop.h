// train's step loop: the steps, what rank 0 says after each (progress, skipped steps,
// evaluation), --metrics and --tensorboard rows, checkpoints, and SIGINT/SIGTERM, which
// end it after the step in progress with a checkpoint (tools/train/stop_signal.h).
#ifndef PIPESHARD_TOOLS_TRAIN_LOOP_H_
#define PIPESHARD_TOOLS_TRAIN_LOOP_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "comm/comm.h"
#include "tools/plot/pictures.h"
#include "tools/train/args.h"
#include "tools/train/run.h"

namespace pipeshard::train_cli {

// How the loop ended, for the report (tools/train/report.h).
struct LoopOutcome {
  // Set when the run stopped before its last step: a step that went bad, a signal, a file
  // that could not be written. The exit status; what went wrong has been said.
  std::optional<int> exit;
  int64_t skipped = 0;                            // --on-nonfinite skip: steps whose loss or gradients were not finite
  int64_t overflowed = 0;                         // --loss-scale dynamic: steps skipped for a gradient that overflowed
  std::chrono::steady_clock::time_point started;  // before the first step
  std::optional<TrainingCurves> curves;           // --plot, on rank 0: the run so far
  std::vector<double> step_seconds;               // each step's time, as --metrics reports it
};

// Runs the steps of run.config.total_steps that run.trainer has not taken yet (--resume),
// saying first, on rank 0, what it trains. Collective over `world`: every rank runs the same
// steps and stops after the same one.
LoopOutcome run_steps(const Args& a, Run& run, Communicator& world);

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_LOOP_H_
