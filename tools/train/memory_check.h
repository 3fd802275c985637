// train's memory check, before anything big is allocated (the backend exists, holding
// next to nothing, and says which activations it keeps): the processes that share memory
// must fit in what it has left, by the partitioner's estimate of each rank's parameters,
// gradients, optimizer state and activations in flight (Trainer::memory_per_stage).
#ifndef PIPESHARD_TOOLS_TRAIN_MEMORY_CHECK_H_
#define PIPESHARD_TOOLS_TRAIN_MEMORY_CHECK_H_

#include "comm/comm.h"
#include "common/status.h"
#include "tools/train/run.h"

namespace pipeshard::train_cli {

// A backend in host memory: the ranks on this machine (those that share a host name)
// together, against its MemAvailable, or its cgroup's limit less usage when that is lower.
// A backend in device memory: the ranks that share this rank's device, against the
// device's free memory. Collective over `world`.
Status check_memory(Communicator& world, const Run& run);

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_MEMORY_CHECK_H_
