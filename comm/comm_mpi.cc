// The MPI communicator: host-memory float32 collectives and transfers.
//
// Every communicator is set to MPI_ERRORS_RETURN so that a failed call is reported here,
// with file:line and the call, before MPI_Abort ends the whole job (docs/style.md 6): with
// MPI's default handler the job would still die, but nobody would know where. The report
// and the ending are common/check.h's, whose job abort hook this file installs once MPI is
// up, so that a failed PIPESHARD_CHECK anywhere in the process ends every rank too.
//
// MPI counts are `int`. Buffers longer than the per-call limit (INT_MAX floats, lower in
// tests) travel in pieces; all ranks cut the same pieces because they pass the same sizes,
// and point-to-point pieces cannot overtake each other (MPI orders messages with the same
// source, tag and communicator).
//
// kAverage is MPI_SUM in float followed by a division by size() in float, on every rank
// alike (MPI has no average), so all ranks hold bitwise-equal results.
//
// Reduce-scatter and all-gather are not MPI's collectives but a direct exchange over
// point-to-point (ReduceScatterExchange below says why), on a duplicate of the group's
// MPI communicator so that their messages never meet the caller's.
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "comm/comm_mpi.h"
#include "comm/watchdog.h"
#include "common/check.h"

namespace pipeshard {
namespace {

bool mpi_is_running() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

// Ends the job: MPI_Abort on the world, so that no rank waits for this one. Before MPI is
// up (or after it is down) there is no job to end but this process.
[[noreturn]] void abort_job(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (mpi_is_running()) MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();  // MPI_Abort does not return; this keeps [[noreturn]] honest if it did
}

// The thread that initialised MPI: the only one that may call it (MPI_THREAD_FUNNELED).
std::thread::id mpi_thread;

// common/check.h's job abort hook, installed once MPI is up: a failed check or call on any
// rank ends every rank. A check that fails on another thread (an OpenMP worker's) returns
// here without MPI; its process then aborts, and mpirun ends the rest of the job.
void abort_job_after_fatal_error() {
  if (std::this_thread::get_id() == mpi_thread) abort_job(1);
}

bool mpi_succeeded(int code) { return code == MPI_SUCCESS; }

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "error code " + std::to_string(code);
  return text;
}

}  // namespace
}  // namespace pipeshard

// A call into MPI that must succeed (common/check.h): "pipeshard: MPI error at FILE:LINE in
// CALL: MPI's text for the error", then the whole job ends.
#define PIPESHARD_MPI_CALL(call) \
  PIPESHARD_CHECKED_CALL("MPI", call, #call, ::pipeshard::mpi_succeeded, ::pipeshard::mpi_error_text)

namespace pipeshard {
namespace {

// World communicators alive: the program is done with MPI once none is.
std::atomic<int> live_worlds{0};

// MPI_Finalize when the process exits normally, having let go of its world. Otherwise
// MPI is left alone: after a non-zero status MPI_Finalize would wait for ranks that may
// in turn wait for this one, and an exit(0) from the middle of a run (a library's, a
// bug's) would wait for ranks that are still training. A process that exits without
// finalizing makes mpirun end the whole job, at once.
void finalize_mpi_at_exit(int status, void*) {
  if (status == 0 && live_worlds.load() == 0 && mpi_is_running()) MPI_Finalize();
}

void initialize_mpi_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    PIPESHARD_MPI_CALL(MPI_Initialized(&initialized));
    if (initialized) return;  // someone else's MPI: they finalize it
    int provided = 0;
    // FUNNELED: worker threads (OpenMP) never call MPI, only the thread that started it.
    PIPESHARD_MPI_CALL(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    mpi_thread = std::this_thread::get_id();
    set_job_abort_hook(abort_job_after_fatal_error);
    PIPESHARD_CHECK(provided >= MPI_THREAD_FUNNELED, "MPI provides thread level " + std::to_string(provided));
    PIPESHARD_MPI_CALL(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    on_exit(finalize_mpi_at_exit, nullptr);  // glibc: like atexit, but sees the exit status
  });
}

// Calls fn(offset, count) for consecutive pieces of [0, n) of at most `max` elements.
template <typename Fn>
void for_each_piece(int64_t n, int64_t max, Fn fn) {
  for (int64_t offset = 0; offset < n; offset += max) fn(offset, static_cast<int>(std::min(max, n - offset)));
}

void divide(float* data, int64_t n, int size) {
  const float divisor = static_cast<float>(size);
  for (int64_t i = 0; i < n; ++i) data[i] /= divisor;
}

// A receive must get the floats it asked for: MPI refuses longer messages, not shorter ones.
void check_received(const MPI_Status& status, int expected, int peer, int tag) {
  int received = 0;
  PIPESHARD_MPI_CALL(MPI_Get_count(&status, MPI_FLOAT, &received));
  PIPESHARD_CHECK(received == expected, "received " + std::to_string(received) + " floats from rank " +
                                            std::to_string(peer) + " (tag " + std::to_string(tag) + ") where " +
                                            std::to_string(expected) + " were expected");
}

// Operations in flight: one MPI_Request per piece; receives are checked as they complete.
class MpiRequest final : public Request {
 public:
  struct Receive {
    int expected = 0;  // floats in this piece
    int peer = 0, tag = 0;
  };

  // `operation` and `peers` name the wait for the watchdog (comm/watchdog.h).
  MpiRequest(std::vector<MPI_Request> requests, std::vector<Receive> receives, float* average_data, int64_t average_n,
             int average_size, const char* operation, const std::string* peers)
      : requests_(std::move(requests)), receives_(std::move(receives)), average_data_(average_data),
        average_n_(average_n), average_size_(average_size), operation_(operation), peers_(peers) {}
  ~MpiRequest() override {
    if (!done_ && mpi_is_running()) wait();
  }
  MpiRequest(const MpiRequest&) = delete;
  MpiRequest& operator=(const MpiRequest&) = delete;

  void wait() override {
    if (done_) return;
    done_ = true;
    const WatchdogWait watched(operation_, peers_);
    // One MPI_Wait per piece rather than MPI_Waitall, whose MPI_ERR_IN_STATUS hides the error.
    for (size_t i = 0; i < requests_.size(); ++i) {
      MPI_Status status;
      PIPESHARD_MPI_CALL(MPI_Wait(&requests_[i], &status));
      if (i < receives_.size()) check_received(status, receives_[i].expected, receives_[i].peer, receives_[i].tag);
    }
    if (average_data_ != nullptr) divide(average_data_, average_n_, average_size_);
  }

 private:
  std::vector<MPI_Request> requests_;
  std::vector<Receive> receives_;  // for receive requests: receives_[i] describes requests_[i]
  float* average_data_;            // divided by average_size_ once complete (kAverage), or null
  int64_t average_n_;
  int average_size_;
  const char* operation_;
  const std::string* peers_;
  bool done_ = false;
};

// Whether [a, a + a_n) and [b, b + b_n) share a float.
bool overlap(const float* a, int64_t a_n, const float* b, int64_t b_n) {
  const auto a0 = reinterpret_cast<uintptr_t>(a), b0 = reinterpret_cast<uintptr_t>(b);
  return a_n > 0 && b_n > 0 && a0 < b0 + sizeof(float) * b_n && b0 < a0 + sizeof(float) * a_n;
}

// Host buffers that reduce-scatters receive into, kept for the next one: a fresh buffer's
// pages fault in on first touch, which costs as much as moving them. Shared by a group and
// its requests, which may outlive it.
class ScratchPool {
 public:
  // At least n floats, contents undefined.
  std::vector<float> take(int64_t n) {
    for (size_t i = 0; i < spare_.size(); ++i) {
      if (static_cast<int64_t>(spare_[i].size()) < n) continue;
      std::vector<float> buffer = std::move(spare_[i]);
      spare_.erase(spare_.begin() + static_cast<std::ptrdiff_t>(i));
      return buffer;
    }
    return std::vector<float>(static_cast<size_t>(n));
  }
  void give(std::vector<float> buffer) {
    if (buffer.empty()) return;
    if (spare_.size() == kKept) spare_.erase(spare_.begin());  // the oldest goes
    spare_.push_back(std::move(buffer));
  }

 private:
  static constexpr size_t kKept = 4;  // one per reduce-scatter in flight, for a few buckets
  std::vector<std::vector<float>> spare_;
};

// What an exchange needs of its group.
struct ExchangeGroup {
  MPI_Comm comm;  // the group's duplicate, for exchanges only
  int rank, size;
  int64_t chunk;  // floats per message: ≤ the per-call limit
  std::shared_ptr<ScratchPool> scratch;
  const std::string* others;  // the group's other ranks, for the watchdog
};

// A reduce-scatter's messages are 4 MiB, so that where the transport moves data by itself (a
// network) the sums of one chunk overlap the transfer of the next; in shared memory the
// receiver copies (CMA), inside its MPI calls, so nothing overlaps and each message only costs
// a rendezvous: on the 2-core VM at 16 MiB over 2 ranks, 64 KiB chunks took 1.2× the time of
// whole blocks, 1 MiB 1.1×, 4 MiB 1.07×.
constexpr int64_t kExchangeChunkFloats = int64_t{1} << 20;
constexpr int kExchangeTag = 0;  // on the duplicate: exchanges match by issue order alone

// A reduce-scatter by direct exchange, in flight.
//
// Why not MPI_Reduce_scatter_block: Open MPI 4.1's coll/tuned decision rules send it, for
// blocks of 128 KiB and more on 2 or 3 ranks (1 MiB and more on 4 to 7), to its basic_linear
// algorithm: an MPI_Reduce of the WHOLE buffer to rank 0 (a segmented pipeline on 2 ranks,
// one whole buffer after another on 4), then an MPI_Scatter. Rank 0 receives and sums
// everything alone while the others wait, then sends their blocks back: at 16 MiB on 2
// ranks 2 to 6 times the time of an MPI_Allreduce of the same buffer (it varies from run to
// run), which is itself a reduce-scatter and an all-gather inside (Rabenseifner's algorithm). Its other algorithms,
// forced through OMPI_MCA_coll_tuned_use_dynamic_rules (recursive doubling, recursive halving,
// butterfly), took 1.5 to 4 times the all-reduce's time on their own. bench/README.md has the
// figures (bench_allreduce).
//
// Instead every rank sends block b of its buffer straight to rank b and receives its own
// block from every other rank, in messages of `chunk` floats: (size − 1)/size of the buffer
// in and out of each rank, what a ring moves, in one round. Every transfer is posted when
// the operation starts, so MPI moves them along inside any MPI call of this process (a
// ring's later steps would wait for this process to post them, and a rank blocked
// elsewhere, in a receive from another stage, would stall its peers). wait() sums each chunk
// once all its contributions are in, in rank order, ((x0 + x1) + x2) + …: the same float
// sum whatever the timing, and the in-process group's order. kAverage divides that by size
// in float.
//
// Out of place, rank 0's (or, on rank 0, rank 1's) contribution lands in recv itself and the
// others' in scratch, so 2 ranks need none; in place (recv = send + rank·n, where this rank's
// own contribution is), every peer's lands in scratch.
class ReduceScatterExchange final : public Request {
 public:
  ReduceScatterExchange(const ExchangeGroup& group, const float* send, float* recv, int64_t n, ReduceOp op)
      : group_(group), recv_(recv), n_(n), op_(op), sources_(static_cast<size_t>(group.size)) {
    const int size = group.size, rank = group.rank;
    const bool in_place = recv == send + rank * n;
    const int in_recv = in_place ? -1 : rank == 0 ? 1 : 0;  // the peer whose block lands in recv
    const int in_scratch = in_place ? size - 1 : size - 2;
    if (in_scratch > 0) scratch_ = group.scratch->take(in_scratch * n);
    std::vector<float*> landing(static_cast<size_t>(size));  // where each peer's block arrives
    for (int r = 0, slot = 0; r < size; ++r) {
      if (r == rank) {
        sources_[r] = send + rank * n;
      } else {
        landing[r] = r == in_recv ? recv : scratch_.data() + (slot++) * n;
        sources_[r] = landing[r];
      }
    }
    // Chunk by chunk, each peer's piece of it: receives from rank − k, sends to rank + k, so
    // that the ranks do not all start with the same peer.
    for (int64_t offset = 0; offset < n; offset += group.chunk) {
      const int count = static_cast<int>(std::min(group.chunk, n - offset));
      for (int k = 1; k < size; ++k) {
        const int from = (rank - k + size) % size, to = (rank + k) % size;
        receives_.emplace_back();
        PIPESHARD_MPI_CALL(
            MPI_Irecv(landing[from] + offset, count, MPI_FLOAT, from, kExchangeTag, group.comm, &receives_.back()));
        sends_.emplace_back();
        PIPESHARD_MPI_CALL(
            MPI_Isend(send + to * n + offset, count, MPI_FLOAT, to, kExchangeTag, group.comm, &sends_.back()));
      }
    }
  }
  ~ReduceScatterExchange() override {
    if (!done_ && mpi_is_running()) wait();
  }
  ReduceScatterExchange(const ReduceScatterExchange&) = delete;
  ReduceScatterExchange& operator=(const ReduceScatterExchange&) = delete;

  void wait() override {
    if (done_) return;
    done_ = true;
    const WatchdogWait watched("the reduce-scatter with", group_.others);
    const int size = group_.size, rank = group_.rank;
    size_t next = 0;  // receives_[next] is the first not waited for
    for (int64_t offset = 0; offset < n_; offset += group_.chunk) {
      const int count = static_cast<int>(std::min(group_.chunk, n_ - offset));
      for (int k = 1; k < size; ++k, ++next) {
        MPI_Status status;
        PIPESHARD_MPI_CALL(MPI_Wait(&receives_[next], &status));
        check_received(status, count, (rank - k + size) % size, kExchangeTag);
      }
      sum_chunk(offset, count);
    }
    for (MPI_Request& request : sends_) PIPESHARD_MPI_CALL(MPI_Wait(&request, MPI_STATUS_IGNORE));
    group_.scratch->give(std::move(scratch_));
  }

 private:
  // recv[offset, offset + count) = Σ in rank order of sources_[r][...], then / size for kAverage.
  // Tile by tile through a float accumulator that stays in L1, so that recv may be one of the
  // sources (it is read before it is written) and every pass vectorizes.
  void sum_chunk(int64_t offset, int count) {
    constexpr int kTile = 1024;
    float sum[kTile];
    const float divisor = static_cast<float>(sources_.size());
    for (int start = 0; start < count; start += kTile) {
      const int m = std::min(kTile, count - start);
      const float* x0 = sources_[0] + offset + start;
      const float* x1 = sources_[1] + offset + start;
      for (int i = 0; i < m; ++i) sum[i] = x0[i] + x1[i];
      for (size_t r = 2; r < sources_.size(); ++r) {
        const float* x = sources_[r] + offset + start;
        for (int i = 0; i < m; ++i) sum[i] += x[i];
      }
      float* out = recv_ + offset + start;
      if (op_ == ReduceOp::kAverage) {
        for (int i = 0; i < m; ++i) out[i] = sum[i] / divisor;
      } else {
        std::memcpy(out, sum, sizeof(float) * static_cast<size_t>(m));
      }
    }
  }

  ExchangeGroup group_;
  float* recv_;
  int64_t n_;
  ReduceOp op_;
  std::vector<float> scratch_;         // [(size − 2 or 1) · n]: the blocks that do not land in recv
  std::vector<const float*> sources_;  // [size]: where rank r's contribution to this block is
  std::vector<MPI_Request> receives_;  // [chunk][k]: from rank − k
  std::vector<MPI_Request> sends_;     // [chunk][k]: to rank + k
  bool done_ = false;
};

enum class Ownership { kBorrowed, kOwned };

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, Ownership ownership, int64_t max_elements_per_call)
      : comm_(comm), ownership_(ownership), max_count_(max_elements_per_call) {
    if (ownership_ == Ownership::kBorrowed) ++live_worlds;
    PIPESHARD_MPI_CALL(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    PIPESHARD_MPI_CALL(MPI_Comm_rank(comm_, &rank_));
    PIPESHARD_MPI_CALL(MPI_Comm_size(comm_, &size_));
    PIPESHARD_CHECK(max_count_ >= size_ && max_count_ <= kMaxMpiCount,
                    "per-call limit " + std::to_string(max_count_) + " for " + std::to_string(size_) + " ranks");
    int* tag_ub = nullptr;
    int found = 0;
    PIPESHARD_MPI_CALL(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found));
    max_tag_ = found ? *tag_ub : 32767;  // the least the standard allows
    name_ranks();
  }
  ~MpiCommunicator() override {
    // Freed only while MPI runs: a communicator that outlives MPI_Finalize has nothing to free.
    if (exchange_comm_ != MPI_COMM_NULL && mpi_is_running()) PIPESHARD_MPI_CALL(MPI_Comm_free(&exchange_comm_));
    if (ownership_ == Ownership::kOwned && mpi_is_running()) PIPESHARD_MPI_CALL(MPI_Comm_free(&comm_));
    if (ownership_ == Ownership::kBorrowed) --live_worlds;
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce(float* data, int64_t n, ReduceOp op) override {
    check_buffer(data, n);
    const WatchdogWait watched("the all-reduce with", &others_);
    for_each_piece(n, max_count_, [&](int64_t offset, int count) {
      PIPESHARD_MPI_CALL(MPI_Allreduce(MPI_IN_PLACE, data + offset, count, MPI_FLOAT, MPI_SUM, comm_));
    });
    if (op == ReduceOp::kAverage) divide(data, n, size_);
  }

  std::unique_ptr<Request> all_reduce_async(float* data, int64_t n, ReduceOp op) override {
    check_buffer(data, n);
    std::vector<MPI_Request> requests;
    for_each_piece(n, max_count_, [&](int64_t offset, int count) {
      MPI_Request request;
      PIPESHARD_MPI_CALL(MPI_Iallreduce(MPI_IN_PLACE, data + offset, count, MPI_FLOAT, MPI_SUM, comm_, &request));
      requests.push_back(request);
    });
    return std::make_unique<MpiRequest>(std::move(requests), std::vector<MpiRequest::Receive>{},
                                        op == ReduceOp::kAverage ? data : nullptr, n, size_, "the all-reduce with",
                                        &others_);
  }

  double all_reduce_sum(double value) override {
    const WatchdogWait watched("the all-reduce with", &others_);
    PIPESHARD_MPI_CALL(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_DOUBLE, MPI_SUM, comm_));
    return value;
  }

  void progress() override {
    // A probe that matches nothing in particular runs Open MPI's progress engine, which
    // advances every request in flight (libnbc's collectives included) without completing
    // any on the caller's behalf.
    int flag = 0;
    PIPESHARD_MPI_CALL(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, MPI_STATUS_IGNORE));
  }

  std::vector<std::string> gather_text(const std::string& text, int root) override {
    PIPESHARD_CHECK(text.size() <= static_cast<size_t>(kMaxMpiCount),
                    "text of " + std::to_string(text.size()) + " bytes");
    const WatchdogWait watched("the gather with", &others_);
    int length = static_cast<int>(text.size());
    std::vector<int> lengths(rank_ == root ? size_ : 0), offsets(lengths.size());
    PIPESHARD_MPI_CALL(MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, root, comm_));
    int64_t total = 0;
    for (size_t r = 0; r < lengths.size(); ++r) {
      offsets[r] = static_cast<int>(total);
      total += lengths[r];
    }
    PIPESHARD_CHECK(total <= kMaxMpiCount, "gathering " + std::to_string(total) + " bytes");
    std::string all(static_cast<size_t>(total), '\0');
    PIPESHARD_MPI_CALL(
        MPI_Gatherv(text.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(), MPI_CHAR, root, comm_));
    std::vector<std::string> out;
    for (size_t r = 0; r < lengths.size(); ++r) out.push_back(all.substr(offsets[r], lengths[r]));
    return out;
  }

  void all_reduce_sum(double* data, int64_t n) override {
    check_buffer(data, n);
    const WatchdogWait watched("the all-reduce with", &others_);
    for_each_piece(n, max_count_, [&](int64_t offset, int count) {
      PIPESHARD_MPI_CALL(MPI_Allreduce(MPI_IN_PLACE, data + offset, count, MPI_DOUBLE, MPI_SUM, comm_));
    });
  }

  void all_gather(const float* send, float* recv, int64_t n) override { all_gather_async(send, recv, n)->wait(); }
  void reduce_scatter(const float* send, float* recv, int64_t n, ReduceOp op) override {
    reduce_scatter_async(send, recv, n, op)->wait();
  }

  // Every rank sends its block straight to every other rank and receives theirs where they
  // belong, all posted now: the traffic of a ring, in one round, moved along by MPI alone.
  // MPI_Allgather was about as fast, but its non-blocking twin runs on libnbc's schedules
  // (MPI_Iallreduce there takes twice MPI_Allreduce's time): one exchange serves both calls.
  std::unique_ptr<Request> all_gather_async(const float* send, float* recv, int64_t n) override {
    check_buffer(send, n);
    check_buffer(recv, n);
    const bool in_place = send == recv + rank_ * n;
    PIPESHARD_CHECK(in_place || !overlap(send, n, recv, n * size_),
                    "all_gather's send buffer overlaps its receive buffer other than at this rank's block");
    const MPI_Comm exchange = exchange_comm();
    std::vector<MPI_Request> requests;
    std::vector<MpiRequest::Receive> receives;
    for (int k = 1; k < size_; ++k) {
      const int from = (rank_ - k + size_) % size_;
      for_each_piece(n, max_count_, [&](int64_t offset, int count) {
        requests.emplace_back();
        PIPESHARD_MPI_CALL(
            MPI_Irecv(recv + from * n + offset, count, MPI_FLOAT, from, kExchangeTag, exchange, &requests.back()));
        receives.push_back({count, from, kExchangeTag});
      });
    }
    for (int k = 1; k < size_; ++k) {
      const int to = (rank_ + k) % size_;
      for_each_piece(n, max_count_, [&](int64_t offset, int count) {
        requests.emplace_back();
        PIPESHARD_MPI_CALL(MPI_Isend(send + offset, count, MPI_FLOAT, to, kExchangeTag, exchange, &requests.back()));
      });
    }
    if (!in_place && n > 0) std::memcpy(recv + rank_ * n, send, sizeof(float) * static_cast<size_t>(n));
    return std::make_unique<MpiRequest>(std::move(requests), std::move(receives), nullptr, 0, size_,
                                        "the all-gather with", &others_);
  }

  std::unique_ptr<Request> reduce_scatter_async(const float* send, float* recv, int64_t n, ReduceOp op) override {
    check_buffer(send, n);
    check_buffer(recv, n);
    PIPESHARD_CHECK(recv == send + rank_ * n || !overlap(send, n * size_, recv, n),
                    "reduce_scatter's receive buffer overlaps its send buffer other than at this rank's block");
    if (size_ == 1 || n == 0) {
      if (n > 0 && recv != send) std::memcpy(recv, send, sizeof(float) * static_cast<size_t>(n));  // / 1 is exact
      return std::make_unique<MpiRequest>(std::vector<MPI_Request>{}, std::vector<MpiRequest::Receive>{}, nullptr, 0,
                                          size_, "the reduce-scatter with", &others_);
    }
    return std::make_unique<ReduceScatterExchange>(exchange_group(), send, recv, n, op);
  }

  void broadcast(float* data, int64_t n, int root) override {
    check_buffer(data, n);
    PIPESHARD_CHECK(root >= 0 && root < size_,
                    "root " + std::to_string(root) + " of " + std::to_string(size_) + " ranks");
    const WatchdogWait watched("the broadcast with", &others_);
    for_each_piece(n, max_count_, [&](int64_t offset, int count) {
      PIPESHARD_MPI_CALL(MPI_Bcast(data + offset, count, MPI_FLOAT, root, comm_));
    });
  }

  void broadcast_bytes(void* bytes, int64_t n, int root) override {
    auto* data = static_cast<char*>(bytes);
    check_buffer(data, n);
    PIPESHARD_CHECK(root >= 0 && root < size_,
                    "root " + std::to_string(root) + " of " + std::to_string(size_) + " ranks");
    const WatchdogWait watched("the broadcast with", &others_);
    for_each_piece(n, max_count_, [&](int64_t offset, int count) {
      PIPESHARD_MPI_CALL(MPI_Bcast(data + offset, count, MPI_BYTE, root, comm_));
    });
  }

  void send(const float* data, int64_t n, int peer, int tag) override {
    check_transfer(data, n, peer, tag);
    const WatchdogWait watched("the send to", &peer_names_[peer]);
    for_each_piece(n, max_count_, [&](int64_t offset, int count) {
      PIPESHARD_MPI_CALL(MPI_Send(data + offset, count, MPI_FLOAT, peer, tag, comm_));
    });
  }

  void recv(float* data, int64_t n, int peer, int tag) override {
    check_transfer(data, n, peer, tag);
    const WatchdogWait watched("the receive from", &peer_names_[peer]);
    for_each_piece(n, max_count_, [&](int64_t offset, int count) {
      MPI_Status status;
      PIPESHARD_MPI_CALL(MPI_Recv(data + offset, count, MPI_FLOAT, peer, tag, comm_, &status));
      check_received(status, count, peer, tag);
    });
  }

  std::unique_ptr<Request> send_async(const float* data, int64_t n, int peer, int tag) override {
    check_transfer(data, n, peer, tag);
    std::vector<MPI_Request> requests;
    for_each_piece(n, max_count_, [&](int64_t offset, int count) {
      MPI_Request request;
      PIPESHARD_MPI_CALL(MPI_Isend(data + offset, count, MPI_FLOAT, peer, tag, comm_, &request));
      requests.push_back(request);
    });
    return std::make_unique<MpiRequest>(std::move(requests), std::vector<MpiRequest::Receive>{}, nullptr, 0, size_,
                                        "the send to", &peer_names_[peer]);
  }

  std::unique_ptr<Request> recv_async(float* data, int64_t n, int peer, int tag) override {
    check_transfer(data, n, peer, tag);
    std::vector<MPI_Request> requests;
    std::vector<MpiRequest::Receive> receives;
    for_each_piece(n, max_count_, [&](int64_t offset, int count) {
      MPI_Request request;
      PIPESHARD_MPI_CALL(MPI_Irecv(data + offset, count, MPI_FLOAT, peer, tag, comm_, &request));
      requests.push_back(request);
      receives.push_back({count, peer, tag});
    });
    return std::make_unique<MpiRequest>(std::move(requests), std::move(receives), nullptr, 0, size_, "the receive from",
                                        &peer_names_[peer]);
  }

  void barrier() override {
    const WatchdogWait watched("the barrier with", &others_);
    PIPESHARD_MPI_CALL(MPI_Barrier(comm_));
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    PIPESHARD_CHECK(color >= 0, "split color " + std::to_string(color) + " (colors are ≥ 0)");
    MPI_Comm group = MPI_COMM_NULL;
    const WatchdogWait watched("the group split with", &others_);
    PIPESHARD_MPI_CALL(MPI_Comm_split(comm_, color, key, &group));
    return std::make_unique<MpiCommunicator>(group, Ownership::kOwned, max_count_);
  }

  [[noreturn]] void abort(const std::string& message) override {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", message.c_str());
    abort_job(1);  // the world, not comm_: the contract ends every process of the job
  }

 private:
  template <typename T>
  void check_buffer(const T* data, int64_t n) const {
    PIPESHARD_CHECK(n >= 0, "negative element count " + std::to_string(n));
    PIPESHARD_CHECK(data != nullptr || n == 0, "null buffer for " + std::to_string(n) +
                                                   (sizeof(T) == 8   ? " doubles"
                                                    : sizeof(T) == 1 ? " bytes"
                                                                     : " floats"));
  }
  void check_transfer(const float* data, int64_t n, int peer, int tag) const {
    check_buffer(data, n);
    PIPESHARD_CHECK(peer >= 0 && peer < size_,
                    "peer " + std::to_string(peer) + " of " + std::to_string(size_) + " ranks");
    PIPESHARD_CHECK(tag >= 0 && tag <= max_tag_,
                    "tag " + std::to_string(tag) + " outside 0.." + std::to_string(max_tag_));
  }

  // The duplicate of comm_ that exchanges use, made on the first of them: a collective call on
  // every rank of the group, where the constructor is not (a rank makes its world when it needs
  // one; the Python package's world_size() on rank 0 alone, say).
  MPI_Comm exchange_comm() {
    if (exchange_comm_ == MPI_COMM_NULL) {
      const WatchdogWait watched("the group duplication with", &others_);
      PIPESHARD_MPI_CALL(MPI_Comm_dup(comm_, &exchange_comm_));
      PIPESHARD_MPI_CALL(MPI_Comm_set_errhandler(exchange_comm_, MPI_ERRORS_RETURN));
    }
    return exchange_comm_;
  }
  ExchangeGroup exchange_group() {
    return ExchangeGroup{exchange_comm(), rank_, size_, std::min(kExchangeChunkFloats, max_count_), scratch_, &others_};
  }

  // World ranks, for the watchdog's messages: peer_names_[r] = "rank W" for group rank r,
  // others_ = "rank W" or "ranks W1, W2, ..." for the group's other ranks.
  void name_ranks() {
    MPI_Group world_group, group;
    PIPESHARD_MPI_CALL(MPI_Comm_group(MPI_COMM_WORLD, &world_group));
    PIPESHARD_MPI_CALL(MPI_Comm_group(comm_, &group));
    std::vector<int> mine(static_cast<size_t>(size_)), world(mine.size());
    for (int r = 0; r < size_; ++r) mine[r] = r;
    PIPESHARD_MPI_CALL(MPI_Group_translate_ranks(group, size_, mine.data(), world_group, world.data()));
    PIPESHARD_MPI_CALL(MPI_Group_free(&group));
    PIPESHARD_MPI_CALL(MPI_Group_free(&world_group));
    std::string list;
    for (int r = 0; r < size_; ++r) {
      peer_names_.push_back("rank " + std::to_string(world[r]));
      if (r != rank_) list += (list.empty() ? "" : ", ") + std::to_string(world[r]);
    }
    others_ = (size_ == 2 ? "rank " : "ranks ") + list;
  }

  MPI_Comm comm_;
  MPI_Comm exchange_comm_ = MPI_COMM_NULL;  // comm_'s duplicate for reduce-scatters and all-gathers, or none yet
  std::shared_ptr<ScratchPool> scratch_ = std::make_shared<ScratchPool>();
  Ownership ownership_;
  int64_t max_count_;  // elements (floats, doubles for all_reduce_sum, bytes for broadcast_bytes) per MPI call
  int rank_ = 0, size_ = 0;
  int max_tag_ = 32767;
  std::vector<std::string> peer_names_;
  std::string others_;
};

bool env_set(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0';
}

}  // namespace

bool launched_by_mpi() {
  // Open MPI's mpirun, PMI-1/2 launchers (MPICH's hydra, srun --mpi=pmi2), PMIx launchers
  // (srun --mpi=pmix, prterun), and srun's own task id.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID"}) {
    if (env_set(name)) return true;
  }
  return false;
}

std::unique_ptr<Communicator> make_mpi_world_communicator(int64_t max_elements_per_call) {
  initialize_mpi_once();
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, Ownership::kBorrowed, max_elements_per_call);
}

std::unique_ptr<Communicator> make_world_communicator() {
  // Without a launcher MPI stays untouched: singleton MPI_Init is slow, and refused as root.
  if (!launched_by_mpi()) return make_single_process_communicator();
  return make_mpi_world_communicator(kMaxMpiCount);
}

}  // namespace pipeshard
