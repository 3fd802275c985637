// Communicators: collectives and point-to-point transfers on a process group.
//
// One interface, two implementations: MPI on host memory (comm/comm_mpi.cc) and
// NCCL on device memory (comm/nccl/comm_nccl.h). Buffers live in the memory the
// communicator works on and hold float32, but for the double-precision sums (and the
// host bytes of broadcast_bytes, whatever the communicator). Operations
// are collective over the group unless they name a peer: every rank of the group must
// call them in the same order with the same sizes (the pipeline schedules are checked
// for this before they run). Failures of the transport are fatal and abort the whole
// job, so no rank is left waiting for a dead peer.
//
// - Results of an async operation are valid only after wait(); until then its input is
//   not to be written and its output not to be read or written. Any number may be in
//   flight, on one group or several, and waited for in any order. kAverage is a float
//   sum divided by size() in float.
// - Point-to-point messages between two ranks match in the order they are issued;
//   tags exist for MPI's benefit only (NCCL has none), so schedules never rely on a
//   tag to reorder receives.
// - In place: reduce_scatter when recv == send + rank() * n (this rank's block of the input
//   becomes its result), all_gather when send == recv + rank() * n (this rank's block is
//   already where it belongs). Otherwise their send and recv must not overlap.
// - Exactness: every rank ends an all_gather with the same bits (it only copies), and an
//   all-reduce or reduce_scatter sums each element in an order that depends on the
//   communicator and the sizes, never on timing, so a rerun gives the same bits. MPI and
//   the in-process group sum a reduce_scatter in rank order, ((x0 + x1) + x2) + …, so
//   the two give the same block bit for bit; NCCL sums in the order of its ring.
// - Calls come from the thread that created the world (MPI_THREAD_FUNNELED). Groups
//   are destroyed in the same order on every rank (freeing is collective in MPI).
#ifndef PIPESHARD_COMM_COMM_H_
#define PIPESHARD_COMM_COMM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace pipeshard {

enum class ReduceOp { kSum, kAverage };

// An operation in flight. wait() returns once the buffers may be reused; destroying an
// unfinished Request waits for it.
class Request {
 public:
  virtual ~Request() = default;
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // 0 .. size()-1 within this group
  virtual int size() const = 0;

  // data[n] = op over ranks of data[n], in place.
  virtual void all_reduce(float* data, int64_t n, ReduceOp op) = 0;
  virtual std::unique_ptr<Request> all_reduce_async(float* data, int64_t n, ReduceOp op) = 0;
  // Sum of `value` over ranks, in double precision (losses, norms, counts).
  virtual double all_reduce_sum(double value) = 0;
  // On `root`: every rank's `text`, in rank order (elsewhere: empty). Host memory; for
  // small things such as trace events, not tensors.
  virtual std::vector<std::string> gather_text(const std::string& text, int root) = 0;
  // data[n] = Σ over ranks of data[n], element-wise and in double precision, in place
  // (per-channel statistics of synchronized BatchNorm). A group of one leaves data as it is.
  virtual void all_reduce_sum(double* data, int64_t n) = 0;
  // recv[size * n] = concatenation of every rank's send[n], in rank order.
  virtual void all_gather(const float* send, float* recv, int64_t n) = 0;
  // recv[n] = op over ranks of block `rank()` of send[size * n].
  virtual void reduce_scatter(const float* send, float* recv, int64_t n, ReduceOp op) = 0;
  // The same, started and finished by the Request's wait(), with the same result bit for
  // bit (ZeRO reduce-scatters gradient buckets while backward runs, then all-gathers the
  // updated weights). A blocking call and an async one are different collectives: every
  // rank issues the same kind in the same order, as in MPI.
  virtual std::unique_ptr<Request> all_gather_async(const float* send, float* recv, int64_t n) = 0;
  virtual std::unique_ptr<Request> reduce_scatter_async(const float* send, float* recv, int64_t n, ReduceOp op) = 0;
  // data[n] = root's data[n].
  virtual void broadcast(float* data, int64_t n, int root) = 0;
  // bytes[n] = root's bytes[n], in HOST memory whatever memory the communicator works on:
  // small control data such as the NCCL unique id a group is bootstrapped with.
  virtual void broadcast_bytes(void* bytes, int64_t n, int root) = 0;
  // Point to point; `tag` tells apart transfers between the same pair of ranks.
  virtual void send(const float* data, int64_t n, int peer, int tag) = 0;
  virtual void recv(float* data, int64_t n, int peer, int tag) = 0;
  virtual std::unique_ptr<Request> send_async(const float* data, int64_t n, int peer, int tag) = 0;
  virtual std::unique_ptr<Request> recv_async(float* data, int64_t n, int peer, int tag) = 0;
  virtual void barrier() = 0;
  // Lets operations in flight advance without waiting for them. MPI moves non-blocking
  // collectives and large sends along only inside MPI calls, so a caller computing
  // between launch and wait() calls this now and then to overlap for real.
  virtual void progress() {}

  // The ranks with the same `color` form a new group, ordered by `key`.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  // Ends every process of the job with `message` on stderr and a non-zero status.
  [[noreturn]] virtual void abort(const std::string& message) = 0;
};

// The world of this job: MPI's when the process was started by mpirun/mpiexec/srun,
// otherwise a group of one that needs no MPI. Initialises MPI on first use; MPI is
// finalised at a normal (status 0) exit once every world communicator is destroyed. A
// rank that exits with an error, or exits while it still holds its world (an exit(0)
// from the middle of a run), skips finalisation so that mpirun ends the job instead of
// waiting on it.
std::unique_ptr<Communicator> make_world_communicator();
// A group of one process: collectives copy, point-to-point is an error.
std::unique_ptr<Communicator> make_single_process_communicator();
// A group in which this process is `rank` of `size` and which carries nothing, for code
// that needs a group's shape but must not communicate: building a tensor-parallel program
// only to measure it, restoring one rank's checkpoint. Any operation on it is a bug and
// ends the process, naming `who`.
std::unique_ptr<Communicator> make_placeholder_communicator(int rank, int size, const std::string& who);
// True when this process was launched by an MPI launcher.
bool launched_by_mpi();

// Where a rank sits in a P × D × T job: docs/design.md's rank = (p·D + d)·T + t keeps
// tensor-parallel peers adjacent and pipeline stages furthest apart.
struct ProcessLayout {
  int stages = 1, replicas = 1, shards = 1;  // P, D, T
  int stage = 0, replica = 0, shard = 0;     // p, d, t of this rank

  int world_size() const { return stages * replicas * shards; }
  int rank_of(int p, int d, int t) const { return (p * replicas + d) * shards + t; }
  // Errors when world_size does not divide into stages × shards, or an argument is < 1.
  static Result<ProcessLayout> for_rank(int world_rank, int world_size, int stages, int shards);
};

// The groups one rank belongs to.
struct ProcessGroups {
  ProcessLayout layout;
  std::unique_ptr<Communicator> data;      // same stage and shard: the replicas (gradient averaging)
  std::unique_ptr<Communicator> tensor;    // same stage and replica: the shards of one stage
  std::unique_ptr<Communicator> pipeline;  // same replica and shard: the stages, rank = stage
};

// Splits `world` into the groups of `layout` (collective over world).
ProcessGroups make_process_groups(Communicator& world, const ProcessLayout& layout);

}  // namespace pipeshard

#endif  // PIPESHARD_COMM_COMM_H_
