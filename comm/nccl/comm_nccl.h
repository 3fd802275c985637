// The NCCL communicator: the Communicator interface (comm/comm.h) on GPU memory, for
// the CUDA backend. Built only with the CUDA toolkit (library pipeshard_comm_nccl); no CUDA
// or NCCL header is included here.
//
// It spans the ranks of an MPI group (or of the group of one), in the same order, and is
// bootstrapped through it: group rank 0 draws the NCCL unique id and broadcasts it over
// the group. One GPU per rank; NCCL refuses two ranks of one communicator on one GPU.
//
// Memory. float buffers, and the doubles of all_reduce_sum(double*, n) (BatchNorm's
// ChannelReducer), are DEVICE memory, checked on every call (a host pointer is an error
// with a message, not a crash in a kernel). all_reduce_sum(double), gather_text,
// broadcast_bytes and barrier work on host memory through the MPI group.
//
// Streams. NCCL runs on the communicator's own stream. An operation starts after the
// device work that produces its buffers: after the work queued so far on `producer` (the
// CUDA backend's stream; an event, the host does not wait), or, with no producer, after
// everything queued on the device (cudaDeviceSynchronize before each operation, correct
// but without overlap). Blocking calls return, and Request::wait() returns, once the
// operation is complete on the GPU, so work queued afterwards on any stream sees the result.
//
// Semantics that differ from MPI's:
// - Operations on one NCCL communicator run one after another on the GPU, in the order
//   they were issued. A send_async therefore does not move while an earlier operation of
//   the same communicator waits for a peer, and two ranks that each send_async to the
//   other and then recv can deadlock once messages exceed NCCL's buffers; MPI would let
//   both sends progress. Schedules over NCCL must issue such exchanges in an order that
//   matches on both sides (or use two communicators, one per direction).
// - Transfers with itself (peer == rank()) are paired in this process: a send and a
//   receive with itself run as one NCCL group once both are posted, in either order. The
//   first of the two must be async; a blocking one with no partner posted, or waiting for
//   a partner that never comes, is an error, where MPI could buffer a small message.
// - kAverage is an NCCL sum, then a division by size() in float on the GPU: bitwise the
//   arithmetic of the MPI communicator (NCCL's own ncclAvg rounds differently).
//
// Failures. The communicator is non-blocking (NCCL's blocking = 0): every wait polls the
// CUDA event of the operation and ncclCommGetAsyncError, registered with the watchdog
// (comm/watchdog.h) so that a stuck operation ends the process. An NCCL or CUDA error
// calls ncclCommAbort (which stops this rank's NCCL kernels) and then aborts the job
// through the MPI group with file:line and NCCL's message. Requests must complete before
// their communicator is destroyed; destruction waits for the operations in flight.
#ifndef PIPESHARD_COMM_NCCL_COMM_NCCL_H_
#define PIPESHARD_COMM_NCCL_COMM_NCCL_H_

#include <memory>

#include "comm/comm.h"

struct CUstream_st;  // what cudaStream_t points to

namespace pipeshard {

// An NCCL communicator over the ranks of `mpi_group` (collective over it), on GPU `device`
// (0-based among the visible ones; by docs/design.md, the local rank). `mpi_group` must outlive
// it; a group split() from it holds its own MPI group, split from this one the same way.
// `producer`: see "Streams" above; it must outlive the communicator and its splits.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& mpi_group, int device,
                                                     CUstream_st* producer = nullptr);

}  // namespace pipeshard

#endif  // PIPESHARD_COMM_NCCL_COMM_NCCL_H_
