// Everything train does before its first step, in the order run_training calls it: check
// the flags and load the model and data, choose and check the device and its groups,
// create the backend, check memory, make the device groups, create the trainer. Each rank
// runs every step; agree_on_set_up says how each went, once, on rank 0.
#ifndef PIPESHARD_TOOLS_TRAIN_SETUP_H_
#define PIPESHARD_TOOLS_TRAIN_SETUP_H_

#include "comm/comm.h"
#include "common/status.h"
#include "tools/train/args.h"
#include "tools/train/run.h"

namespace pipeshard::train_cli {

// Everything before the first step. Every rank runs it and stops at its first error. The
// one collective inside, splitting the world into groups, comes right after the layout,
// which the flags alone decide: every rank reaches it or none does.
Status set_up(const Args& a, Communicator& world, Run& run);

// --gpu-comm nccl: NCCL refuses two ranks of one communicator on one GPU, so every process
// needs a GPU of its own, and the NCCL plugin must load. Collective over `world`, and the
// verdict is the same on every rank (sums over the world): NCCL's set-up waits for every
// rank of a group, so if one rank went on without the others it would hang.
Status check_gpu_comm(const Args& a, Communicator& world);

// Before anything big is allocated (the backend exists, holding next to nothing, and
// says which activations it keeps): the ranks on this machine together must fit in the
// memory it has left (its MemAvailable, or its cgroup's limit less usage when lower), by
// the partitioner's estimate of each rank's parameters, gradients, optimizer state and
// activations in flight. Collective over `world`: the ranks of one machine add up their
// needs (a machine is the ranks that share a host name).
Status check_memory(const Args& a, Communicator& world, const Run& run);

// The GPU this process computes on: by design.md, its rank on the machine.
int my_gpu();

Status create_backend(const Args& a, Run& run);

// The groups over the backend's memory (Parallel::device_groups). Collective over `world`
// with --gpu-comm nccl, where every rank must get here (after check_gpu_comm and
// create_backend succeeded everywhere); NCCL failures inside end the job.
void make_device_groups(const Args& a, Communicator& world, Run& run);

// A rank that leaves with an error (or a signal, or a failed equivalence check) does not
// shut its NCCL communicators down in order: ncclCommDestroy waits for the other ranks of
// the machine, which may still be training or waiting on this one. The process's exit frees
// the GPU's resources, and mpirun ends the job, as for MPI (comm.h: no MPI_Finalize then).
void abandon_nccl(Run& run);

// The trainer, which allocates the parameters, gradients, optimizer state and
// activations; then --resume, and the files the run writes as it goes.
Status create_trainer(const Args& a, Communicator& world, Run& run);

// Every rank reports how its set-up went, and rank 0 prints each distinct failure once —
// naming the ranks when not all of them hit it — instead of one copy per process.
// Collective; true when every rank succeeded.
bool agree_on_set_up(Communicator& world, const Status& mine);

// How the processes exchange the tensors in the backend's memory, said once by rank 0
// before the first step (--check-equivalence included: the tests read it).
void say_how_tensors_travel(const Args& a, const Run& run);

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_SETUP_H_
