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
#include <mpi.h>

#include <algorithm>
#include <atomic>
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

  void all_gather(const float* send, float* recv, int64_t n) override {
    check_buffer(send, n);
    check_buffer(recv, n);
    const WatchdogWait watched("the all-gather with", &others_);
    if (n * size_ <= max_count_) {
      // In place when this rank's block already sits where it belongs.
      const void* source = send == recv + rank_ * n ? MPI_IN_PLACE : send;
      PIPESHARD_MPI_CALL(
          MPI_Allgather(source, static_cast<int>(n), MPI_FLOAT, recv, static_cast<int>(n), MPI_FLOAT, comm_));
      return;
    }
    // Piece by piece through a staging buffer of size × piece floats.
    const int64_t piece = max_count_ / size_;
    std::vector<float> staging(static_cast<size_t>(piece * size_));
    for_each_piece(n, piece, [&](int64_t offset, int count) {
      PIPESHARD_MPI_CALL(MPI_Allgather(send + offset, count, MPI_FLOAT, staging.data(), count, MPI_FLOAT, comm_));
      for (int r = 0; r < size_; ++r) {
        std::memcpy(recv + r * n + offset, staging.data() + int64_t{r} * count, sizeof(float) * count);
      }
    });
  }

  void reduce_scatter(const float* send, float* recv, int64_t n, ReduceOp op) override {
    check_buffer(send, n);
    check_buffer(recv, n);
    const WatchdogWait watched("the reduce-scatter with", &others_);
    if (n * size_ <= max_count_) {
      PIPESHARD_MPI_CALL(MPI_Reduce_scatter_block(send, recv, static_cast<int>(n), MPI_FLOAT, MPI_SUM, comm_));
    } else {
      const int64_t piece = max_count_ / size_;
      std::vector<float> staging(static_cast<size_t>(piece * size_));
      for_each_piece(n, piece, [&](int64_t offset, int count) {
        for (int r = 0; r < size_; ++r) {
          std::memcpy(staging.data() + int64_t{r} * count, send + r * n + offset, sizeof(float) * count);
        }
        PIPESHARD_MPI_CALL(MPI_Reduce_scatter_block(staging.data(), recv + offset, count, MPI_FLOAT, MPI_SUM, comm_));
      });
    }
    if (op == ReduceOp::kAverage) divide(recv, n, size_);
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
