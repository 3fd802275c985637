// The end of a run whose steps all ran, in this order: on rank 0 the "done" line, the
// peak memory every process's backend held and what rank 0's held; then what the flags
// ask to be written — --save first (the trained model; what follows only describes the
// run), the pipeline bubble, --trace, --plot.
#ifndef PIPESHARD_TOOLS_TRAIN_REPORT_H_
#define PIPESHARD_TOOLS_TRAIN_REPORT_H_

#include "comm/comm.h"
#include "tools/train/args.h"
#include "tools/train/loop.h"
#include "tools/train/run.h"

namespace pipeshard::train_cli {

// Reports and writes the results of the finished run `loop` describes. Collective over
// `world` (the peaks, the gathered model, the trace); the exit status.
int report_finished_run(const Args& a, Run& run, Communicator& world, const LoopOutcome& loop);

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_REPORT_H_
