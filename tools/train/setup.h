// Everything train does before its first step: check the flags, load the model and the
// data, check the device and its groups, create the backend, check memory, make the device
// groups, create the trainer. Every rank runs every step and they agree on how each went.
#ifndef PIPESHARD_TOOLS_TRAIN_SETUP_H_
#define PIPESHARD_TOOLS_TRAIN_SETUP_H_

#include "comm/comm.h"
#include "common/status.h"
#include "tools/train/args.h"
#include "tools/train/run.h"

namespace pipeshard::train_cli {

// Every set-up step, in order, each agreed over `world` (collective): the flags (`parsed`:
// how the command line parsed) and the files, the device and its groups, the backend, the
// memory, the device groups, the trainer and what it writes as it goes. False when a step
// failed on any rank: rank 0 has said why, once. From its end on, the watchdog is armed.
bool set_up_run(const Args& a, const Status& parsed, Communicator& world, Run& run);

// A second backend like the one set_up_run made (the same row, device and precision), for
// --check-equivalence's one-process run.
Result<std::unique_ptr<Backend>> make_backend_like_this_one(const Args& a, const Run& run);

// How the processes exchange the tensors in the backend's memory, said once by rank 0
// before the first step (--check-equivalence included: the tests read it).
void say_how_tensors_travel(const Run& run);

// "note: ZeRO stage 1: …" (rank 0): how --zero shares the optimizer state, or that it has no effect.
void say_how_zero_shards(const Run& run);

// What BatchNorm's statistics are over in this layout, said once by rank 0 before the
// first step where it matters (--check-equivalence included): that each data-parallel
// replica normalises its own slice unless --sync-batchnorm, or that --sync-batchnorm has
// no effect (no BatchNorm, or one replica).
void say_how_batchnorm_normalises(const Run& run);

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_SETUP_H_
