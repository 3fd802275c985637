// A communicator on a Backend's memory that stages through host memory: each operation
// downloads its device buffers into host buffers, runs the same operation on a host
// communicator (MPI's), and uploads the results. What it gives up is speed (two copies
// per transfer, and the device synchronises at each download); what it gives is any
// number of ranks per GPU, which NCCL refuses, with MPI's matching and ordering rules
// unchanged, so every schedule that runs on the CPU runs on GPUs the same way, bit for bit.
//
// - float buffers, and the doubles of all_reduce_sum(double*, n), are in `backend`'s
//   memory; they are read and written only through backend.download/upload.
// - all_reduce_sum(double), gather_text, broadcast_bytes, barrier, progress and abort go
//   to the host communicator as they are (their arguments are host values).
// - Asynchronous operations download when they start and upload in wait(), so the backend
//   must not be asked to free or overwrite a buffer before wait() (the Communicator
//   contract already says so). An upload is ordered on the backend like any other work.
// - split() splits the host communicator the same way and stages over the new group.
//
// The host communicator and the backend must outlive the staged communicator; a group
// split() from it owns its own host group.
#ifndef PIPESHARD_COMM_COMM_STAGED_H_
#define PIPESHARD_COMM_COMM_STAGED_H_

#include <memory>

#include "backend/backend.h"
#include "comm/comm.h"

namespace pipeshard {

std::unique_ptr<Communicator> make_staged_communicator(Communicator& host, Backend& backend);

// The groups of `host` (make_process_groups), each staged over `backend`; null members of
// `host` stay null.
ProcessGroups make_staged_groups(ProcessGroups& host, Backend& backend);

}  // namespace pipeshard

#endif  // PIPESHARD_COMM_COMM_STAGED_H_
