// The in-process communicator: the ranks of a job as threads of one process, so that a
// pipeline schedule, a stage runner or gradient sync is tested in one process before any
// mpiexec run (docs/style.md 15; the model is leveldb's in-memory Env). It implements the whole
// Communicator interface (comm/comm.h) with MPI's semantics, on host memory:
//
// - Collectives match by their order on each rank, as in MPI. Every rank must call the same
//   operation with the same element count, root and ReduceOp; a rank that calls another is
//   a fatal error naming both calls (MPI would hang or mix up the data). A blocking and a
//   non-blocking all-reduce, all-gather or reduce-scatter do not match each other (nor do
//   they in MPI).
// - Reductions are deterministic: a sum in rank order (((r0 + r1) + r2) + …), in float for
//   float buffers and in double for doubles; kAverage is that float sum divided by size()
//   in float. A reduce-scatter's block is bit for bit the MPI communicator's. Async
//   collectives complete once every rank has posted them; their results are written to
//   the caller's buffer in Request::wait(), so a buffer must not be touched between the
//   call and wait() (comm.h's rule; here breaking it shows as wrong values).
// - Point to point: messages from one rank to another match receives in the order both
//   were issued, per (source, destination, tag), as in MPI. Every send is buffered (as if
//   by MPI_Bsend): the data is copied when the send is posted, and send/send_async never
//   block. A schedule that relies on that could still deadlock under MPI with messages too
//   large for its eager buffers; the schedules' own deadlock check covers that. A receive
//   blocks until its message exists; an element count other than the one sent is a fatal
//   error naming both counts, as in the MPI communicator. Tags are 0..32767, the least
//   range an MPI provides.
// - split(color, key) is collective and makes new in-process groups: the ranks with the
//   same color (≥ 0), ordered by key and then by their rank in the parent.
// - Thread safety: each communicator (a rank's view of a group) is used from one thread at
//   a time, normally its own; any number of ranks may call into a group at once. Requests
//   may be waited for from the thread of the rank that made them.
// - Hangs are never silent. When every rank that still holds a communicator of the job
//   waits in one of its operations, and none of the waits can complete, the job is in
//   deadlock: every waiting call throws InProcessJobError, whose message lists what each
//   rank waits for (and which ranks have left: destroyed all their communicators, e.g.
//   because their body returned after a failed ASSERT_). A wait that lasts longer than
//   InProcessOptions::timeout (a rank stuck in a loop) is fatal, naming the rank and the
//   operation it waits in.
// - abort(message) prints `message` and ends the process with status 1: every rank.
#ifndef PIPESHARD_TESTING_IN_PROCESS_COMM_H_
#define PIPESHARD_TESTING_IN_PROCESS_COMM_H_

#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace pipeshard {

struct InProcessOptions {
  // A blocking wait (a collective, a receive, Request::wait) longer than this is fatal.
  std::chrono::duration<double> timeout = std::chrono::seconds(60);
};

// Thrown by a blocking call of an in-process communicator when the job cannot go on: its
// ranks are in deadlock (what() lists every rank's wait), or an earlier call of the job
// already found that. Destroying an unfinished Request in a job that failed so returns
// without the result, so that unwinding never waits.
class InProcessJobError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The ranks of a new job of `size` ≥ 1 ranks: element i is rank i's world. The group
// lives as long as any of its communicators, requests or split groups.
std::vector<std::unique_ptr<Communicator>> make_in_process_group(int size, const InProcessOptions& options = {});

// Runs body(world) on `size` threads, one per rank of a new in-process job, and returns
// when all have returned. Each rank's world is destroyed on its thread as soon as its body
// returns, so ranks still waiting for it learn that it has left. GoogleTest assertions
// work inside body as in any thread. The first exception a body threw is rethrown here:
// one that is not an InProcessJobError (the cause) before those that are (the ranks
// stopped by it), the lowest rank first; a job that failed without any body throwing
// throws InProcessJobError.
void run_ranks(int size, const std::function<void(Communicator& world)>& body, const InProcessOptions& options = {});

// The groups of this rank in the layout of `stages` pipeline stages × `shards`
// tensor-parallel shards (replicas: the rest) over `world`: ProcessLayout::for_rank, then
// make_process_groups (collective over world). A layout that does not fit world.size() is
// a fatal error. Works on any communicator; inside run_ranks it builds a P × D × T job's
// ProcessGroups in one process.
ProcessGroups make_layout_groups(Communicator& world, int stages, int shards);

}  // namespace pipeshard

#endif  // PIPESHARD_TESTING_IN_PROCESS_COMM_H_
