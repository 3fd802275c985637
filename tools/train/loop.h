// train's step loop: steps, what each says, signals and checkpoints.
#ifndef PIPESHARD_TOOLS_TRAIN_LOOP_H_
#define PIPESHARD_TOOLS_TRAIN_LOOP_H_

#include <cstdint>
#include <string>

#include "comm/comm.h"
#include "runtime/trainer.h"
#include "tools/train/args.h"
#include "tools/train/run.h"

namespace pipeshard::train_cli {

// "step 7: the gradient of 'fc2.weight' (node 'fc2') became inf or NaN first, in backward
// order (loss 2.31)", or "step 7: the loss became nan (...)".
std::string non_finite_message(const StepResult& r);

// The end of a run that SIGINT or SIGTERM stopped after `step`: a checkpoint, unless
// this step has just written one, then every rank waits until it is on disk (a rank that
// exits first makes mpirun end the job, rank 0 included). Returns 128 + the signal, as a
// shell reports a process the signal ended: 130 for SIGINT, 143 for SIGTERM.
int stop_on_signal(int signal, int64_t step, int64_t total_steps, bool checkpointed, const Args& a, Run& run,
                   Communicator& world);

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_LOOP_H_
