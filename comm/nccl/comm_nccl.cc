// The NCCL communicator (comm_nccl.h).
//
// Non-blocking NCCL. The communicator is created with blocking = 0, so that no NCCL call
// can hang inside NCCL: a call returns ncclSuccess, an error, or ncclInProgress while NCCL
// finishes it on a thread of its own; then the communicator's state
// (ncclCommGetAsyncError) turns from ncclInProgress into the result, and nothing may touch
// the communicator or its stream before it has (NCCL's rule for non-blocking mode). Every
// such wait, and every wait for an operation on the GPU, is a poll loop that also reads
// the state (a peer that died shows there as ncclRemoteError or ncclSystemError) and that
// registers with the watchdog, which ends the process when a wait lasts too long.
//
// An operation: make the NCCL stream wait for the producer's work (order_after_producer),
// launch, record an event. Blocking calls wait for the event; async ones hand it to their
// Request.
#include "comm/nccl/comm_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/nccl/comm_nccl_kernels.h"
#include "comm/watchdog.h"

namespace pipeshard {
namespace {

// Waits poll: yields first (a small collective takes microseconds), then sleeps briefly so
// that a long wait leaves the core to other threads.
class Backoff {
 public:
  void pause() {
    if (++spins_ < kSpins) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  static constexpr int kSpins = 4096;
  int spins_ = 0;
};

// A query that finds work unfinished may leave cudaErrorNotReady as the thread's last
// error (PyTorch clears it after such queries too), and the backend's next launch check
// (cudaGetLastError) would then stop the process with "device not ready". Clears that,
// and only that: a real error stays for whoever checks next.
void forget_not_ready() {
  if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
}

// Whether the work before `event` has finished, leaving no error behind when not.
bool event_done(cudaEvent_t event) {
  if (cudaEventQuery(event) == cudaSuccess) return true;
  forget_not_ready();
  return false;
}

// A CUDA event, destroyed with its last owner.
class Event {
 public:
  Event() {
    const cudaError_t rc = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming);
    if (rc != cudaSuccess) event_ = nullptr;  // the owner checks valid()
  }
  ~Event() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  bool valid() const { return event_ != nullptr; }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// When an operation is done: the event recorded after it on the NCCL stream. Null until
// the operation is launched (a transfer with itself waits for its partner to be posted).
struct Completion {
  std::shared_ptr<Event> event;
};

// A transfer with this rank itself, posted and waiting for its partner.
struct SelfTransfer {
  const float* send = nullptr;  // for a send
  float* recv = nullptr;        // for a receive
  int64_t n = 0;
  std::shared_ptr<Completion> completion;
};

class CompletedRequest final : public Request {
 public:
  void wait() override {}
};

ncclConfig_t non_blocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

std::string describe(ncclResult_t rc) {
  return std::string(ncclGetErrorString(rc)) + " (ncclResult_t " + std::to_string(static_cast<int>(rc)) + ")";
}

class NcclCommunicator;

class NcclRequest final : public Request {
 public:
  NcclRequest(NcclCommunicator* owner, std::shared_ptr<Completion> completion, const char* operation,
              const std::string* peers)
      : owner_(owner), completion_(std::move(completion)), operation_(operation), peers_(peers) {}
  ~NcclRequest() override { wait(); }
  NcclRequest(const NcclRequest&) = delete;
  NcclRequest& operator=(const NcclRequest&) = delete;
  void wait() override;

 private:
  NcclCommunicator* owner_;
  std::shared_ptr<Completion> completion_;
  const char* operation_;
  const std::string* peers_;
  bool done_ = false;
};

}  // namespace
}  // namespace pipeshard

// A CUDA or NCCL failure inside the communicator: abort NCCL, then the job.
#define PIPESHARD_NCCL_FAIL(what) fail(what, __FILE__, __LINE__)
// A CUDA call inside the communicator (common/check.h's checked call), failing as above.
#define PIPESHARD_NCCL_CUDA(call)                                                                      \
  PIPESHARD_CHECKED_CALL_OR(                                                                           \
      "CUDA", call, #call, [](cudaError_t rc) { return rc == cudaSuccess; }, cudaGetErrorString,       \
      [this](const char*, std::string_view text, std::string_view error, const char* file, int line) { \
        fail(std::string(text) + ": " + std::string(error), file, line);                               \
      })
// An NCCL call that must succeed, waited for when NCCL finishes it in the background.
#define PIPESHARD_NCCL_CALL(call, during) complete((call), #call, during, __FILE__, __LINE__)

namespace pipeshard {
namespace {

class NcclCommunicator final : public Communicator {
 public:
  // Not yet connected: bootstrap() or adopt() does that. `host` is borrowed (split() hands
  // its child the ownership of the child's host group).
  NcclCommunicator(Communicator& host, int device, cudaStream_t producer)
      : host_(&host), device_(device), producer_(producer), rank_(host.rank()), size_(host.size()) {
    name_ranks();
    PIPESHARD_NCCL_CUDA(cudaSetDevice(device_));
    PIPESHARD_NCCL_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    done_ = std::make_shared<Event>();
    ready_ = std::make_shared<Event>();
    if (!done_->valid() || !ready_->valid()) PIPESHARD_NCCL_FAIL("cudaEventCreateWithFlags failed");
  }

  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // Group rank 0 draws the unique id; every rank gets it over the host group.
  void bootstrap();
  // Takes over a communicator that ncclCommSplit made.
  void adopt(ncclComm_t comm);

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce(float* data, int64_t n, ReduceOp op) override {
    check_device_buffer(data, n, "all-reduce");
    if (n == 0) return;
    enqueue_all_reduce(data, n, op);
    record_and_wait("the NCCL all-reduce with", &others_);
  }
  std::unique_ptr<Request> all_reduce_async(float* data, int64_t n, ReduceOp op) override {
    check_device_buffer(data, n, "all-reduce");
    if (n == 0) return std::make_unique<CompletedRequest>();
    enqueue_all_reduce(data, n, op);
    return record_request("the NCCL all-reduce with", &others_);
  }
  double all_reduce_sum(double value) override { return host_->all_reduce_sum(value); }
  std::vector<std::string> gather_text(const std::string& text, int root) override {
    return host_->gather_text(text, root);
  }
  void all_reduce_sum(double* data, int64_t n) override {
    check_device_buffer(data, n, "double all-reduce");
    if (n == 0) return;
    order_after_producer();
    PIPESHARD_NCCL_CALL(ncclAllReduce(data, data, static_cast<size_t>(n), ncclDouble, ncclSum, comm_, stream_),
                        "the NCCL all-reduce with");
    record_and_wait("the NCCL all-reduce with", &others_);
  }
  void all_gather(const float* send, float* recv, int64_t n) override {
    if (!enqueue_all_gather(send, recv, n)) return;
    record_and_wait("the NCCL all-gather with", &others_);
  }
  std::unique_ptr<Request> all_gather_async(const float* send, float* recv, int64_t n) override {
    if (!enqueue_all_gather(send, recv, n)) return std::make_unique<CompletedRequest>();
    return record_request("the NCCL all-gather with", &others_);
  }
  void reduce_scatter(const float* send, float* recv, int64_t n, ReduceOp op) override {
    if (!enqueue_reduce_scatter(send, recv, n, op)) return;
    record_and_wait("the NCCL reduce-scatter with", &others_);
  }
  std::unique_ptr<Request> reduce_scatter_async(const float* send, float* recv, int64_t n, ReduceOp op) override {
    if (!enqueue_reduce_scatter(send, recv, n, op)) return std::make_unique<CompletedRequest>();
    return record_request("the NCCL reduce-scatter with", &others_);
  }
  void broadcast(float* data, int64_t n, int root) override {
    check_device_buffer(data, n, "broadcast");
    if (root < 0 || root >= size_) {
      PIPESHARD_NCCL_FAIL("broadcast from root " + std::to_string(root) + " of " + std::to_string(size_) + " ranks");
    }
    if (n == 0) return;
    order_after_producer();
    PIPESHARD_NCCL_CALL(ncclBroadcast(data, data, static_cast<size_t>(n), ncclFloat, root, comm_, stream_),
                        "the NCCL broadcast with");
    record_and_wait("the NCCL broadcast with", &others_);
  }
  void broadcast_bytes(void* bytes, int64_t n, int root) override { host_->broadcast_bytes(bytes, n, root); }

  void send(const float* data, int64_t n, int peer, int tag) override {
    check_transfer(data, n, peer, tag, "send");
    if (n == 0) return;
    if (peer == rank_) return wait_self(post_self(data, nullptr, n, true), "a blocking send");
    launch_transfer(data, nullptr, n, peer);
    record_and_wait("the NCCL send to", &peer_names_[peer]);
  }
  void recv(float* data, int64_t n, int peer, int tag) override {
    check_transfer(data, n, peer, tag, "receive");
    if (n == 0) return;
    if (peer == rank_) return wait_self(post_self(nullptr, data, n, true), "a blocking receive");
    launch_transfer(nullptr, data, n, peer);
    record_and_wait("the NCCL receive from", &peer_names_[peer]);
  }
  std::unique_ptr<Request> send_async(const float* data, int64_t n, int peer, int tag) override {
    check_transfer(data, n, peer, tag, "send");
    if (n == 0) return std::make_unique<CompletedRequest>();
    if (peer == rank_) {
      return std::make_unique<NcclRequest>(this, post_self(data, nullptr, n, false), "the send to", &self_name_);
    }
    launch_transfer(data, nullptr, n, peer);
    return record_request("the NCCL send to", &peer_names_[peer]);
  }
  std::unique_ptr<Request> recv_async(float* data, int64_t n, int peer, int tag) override {
    check_transfer(data, n, peer, tag, "receive");
    if (n == 0) return std::make_unique<CompletedRequest>();
    if (peer == rank_) {
      return std::make_unique<NcclRequest>(this, post_self(nullptr, data, n, false), "the receive from", &self_name_);
    }
    launch_transfer(nullptr, data, n, peer);
    return record_request("the NCCL receive from", &peer_names_[peer]);
  }
  void barrier() override { host_->barrier(); }
  // The GPU moves NCCL's work along by itself; this only notices a failure early.
  void progress() override { check_state("the NCCL communicator's progress"); }

  std::unique_ptr<Communicator> split(int color, int key) override;
  [[noreturn]] void abort(const std::string& message) override { fail_with(message); }

  // For NcclRequest::wait(): the completion's event, polled with the communicator's state.
  void wait_for(const Completion& completion, const char* operation, const std::string* peers);

 private:
  [[noreturn]] void fail(const std::string& what, const char* file, int line) {
    std::string message =
        "pipeshard: NCCL communicator error at " + std::string(file) + ":" + std::to_string(line) + ": " + what;
    const char* last = ncclGetLastError(comm_);
    if (last != nullptr && last[0] != '\0') message += std::string(" [NCCL: ") + last + "]";
    fail_with(message);
  }
  // Stops this rank's NCCL kernels (a peer may never answer them), then ends the job.
  [[noreturn]] void fail_with(const std::string& message) {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    host_->abort(message);
    std::abort();  // not reached: abort() ends the job
  }

  void complete(ncclResult_t rc, const char* call, const char* during, const char* file, int line) {
    if (rc == ncclInProgress) rc = settle(comm_, during, &others_);
    if (rc != ncclSuccess) fail(std::string(call) + ": " + describe(rc), file, line);
  }
  ncclResult_t settle(ncclComm_t comm, const char* during, const std::string* peers);
  void check_state(const char* during) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
    if (rc != ncclSuccess) PIPESHARD_NCCL_FAIL(std::string("ncclCommGetAsyncError: ") + describe(rc));
    if (state != ncclSuccess && state != ncclInProgress) {
      PIPESHARD_NCCL_FAIL(std::string(during) + ": " + describe(state));
    }
  }

  void order_after_producer();
  void enqueue_all_reduce(float* data, int64_t n, ReduceOp op) {
    order_after_producer();
    PIPESHARD_NCCL_CALL(ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat, ncclSum, comm_, stream_),
                        "the NCCL all-reduce with");
    if (op == ReduceOp::kAverage) divide(data, n);
  }
  // Queue the collective on the NCCL stream; false when there is nothing to move (n = 0).
  bool enqueue_all_gather(const float* send, float* recv, int64_t n) {
    check_device_buffer(send, n, "all-gather");
    check_device_buffer(recv, n, "all-gather");
    if (n == 0) return false;
    order_after_producer();
    PIPESHARD_NCCL_CALL(ncclAllGather(send, recv, static_cast<size_t>(n), ncclFloat, comm_, stream_),
                        "the NCCL all-gather with");
    return true;
  }
  bool enqueue_reduce_scatter(const float* send, float* recv, int64_t n, ReduceOp op) {
    check_device_buffer(send, n, "reduce-scatter");
    check_device_buffer(recv, n, "reduce-scatter");
    if (n == 0) return false;
    order_after_producer();
    PIPESHARD_NCCL_CALL(ncclReduceScatter(send, recv, static_cast<size_t>(n), ncclFloat, ncclSum, comm_, stream_),
                        "the NCCL reduce-scatter with");
    if (op == ReduceOp::kAverage) divide(recv, n);
    return true;
  }
  void divide(float* data, int64_t n) {
    const cudaError_t rc = divide_on_device(data, n, size_, stream_);
    if (rc != cudaSuccess) PIPESHARD_NCCL_FAIL(std::string("the kAverage division: ") + cudaGetErrorString(rc));
  }
  // One NCCL group: a send of `send`, or a receive into `recv`, or both (with itself).
  void launch_transfer(const float* send, float* recv, int64_t n, int peer);
  void record_and_wait(const char* operation, const std::string* peers) {
    PIPESHARD_NCCL_CUDA(cudaEventRecord(done_->get(), stream_));
    wait_event(done_->get(), operation, peers);
  }
  std::unique_ptr<Request> record_request(const char* operation, const std::string* peers) {
    auto completion = std::make_shared<Completion>();
    completion->event = recorded_event();
    return std::make_unique<NcclRequest>(this, std::move(completion), operation, peers);
  }
  std::shared_ptr<Event> recorded_event() {
    auto event = std::make_shared<Event>();
    if (!event->valid()) PIPESHARD_NCCL_FAIL("cudaEventCreateWithFlags failed");
    PIPESHARD_NCCL_CUDA(cudaEventRecord(event->get(), stream_));
    return event;
  }
  void wait_event(cudaEvent_t event, const char* operation, const std::string* peers);

  std::shared_ptr<Completion> post_self(const float* send, float* recv, int64_t n, bool blocking);
  void wait_self(const std::shared_ptr<Completion>& completion, const char* what);

  void check_device_buffer(const void* data, int64_t n, const char* operation);
  void check_transfer(const float* data, int64_t n, int peer, int tag, const char* operation) {
    check_device_buffer(data, n, operation);
    if (peer < 0 || peer >= size_ || tag < 0) {
      PIPESHARD_NCCL_FAIL(std::string(operation) + " with rank " + std::to_string(peer) + ", tag " +
                          std::to_string(tag) + " in a group of " + std::to_string(size_));
    }
  }
  void verify_membership();
  void name_ranks();

  std::unique_ptr<Communicator> owned_host_;  // split() groups own their MPI group
  Communicator* host_;                        // host-memory methods and the bootstrap
  int device_;
  cudaStream_t producer_;  // or null: synchronise the device instead
  int rank_, size_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<Event> done_;                       // completion of blocking calls
  std::shared_ptr<Event> ready_;                      // the producer's work so far
  std::deque<SelfTransfer> self_sends_, self_recvs_;  // posted, partner not yet
  // For the watchdog's messages: group ranks (the NCCL group does not know world ranks).
  std::vector<std::string> peer_names_;
  std::string others_, self_name_;
};

void NcclRequest::wait() {
  if (done_) return;
  done_ = true;
  // A request that outlived its communicator finds its event complete (the destructor
  // drained the stream) and so never touches the owner.
  if (completion_->event != nullptr && event_done(completion_->event->get())) return;
  owner_->wait_for(*completion_, operation_, peers_);
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ == nullptr) return;
  if (!self_sends_.empty() || !self_recvs_.empty()) {
    PIPESHARD_NCCL_FAIL(std::to_string(self_sends_.size()) + " send(s) and " + std::to_string(self_recvs_.size()) +
                        " receive(s) with itself never found their partner");
  }
  cudaSetDevice(device_);
  record_and_wait("the NCCL operations in flight with", &others_);
  PIPESHARD_NCCL_CALL(ncclCommFinalize(comm_), "the NCCL shutdown with");
  const ncclResult_t rc = ncclCommDestroy(comm_);
  if (rc != ncclSuccess) PIPESHARD_NCCL_FAIL("ncclCommDestroy: " + describe(rc));
  comm_ = nullptr;
  done_.reset();
  ready_.reset();
  cudaStreamDestroy(stream_);
}

void NcclCommunicator::bootstrap() {
  ncclUniqueId id{};
  if (rank_ == 0) {
    const ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess) PIPESHARD_NCCL_FAIL("ncclGetUniqueId: " + describe(rc));
  }
  host_->broadcast_bytes(&id, sizeof id, 0);
  ncclConfig_t config = non_blocking_config();
  ncclComm_t comm = nullptr;
  ncclResult_t rc = ncclCommInitRankConfig(&comm, size_, id, rank_, &config);
  // Set before the call returns, also in non-blocking mode (NCCL's set-up thread may store
  // the same value again: read it atomically).
  comm_ = std::atomic_ref<ncclComm_t>(comm).load(std::memory_order_acquire);
  if (rc == ncclInProgress && comm_ != nullptr) rc = settle(comm_, "the NCCL set-up with", &others_);
  if (rc != ncclSuccess) PIPESHARD_NCCL_FAIL("ncclCommInitRankConfig: " + describe(rc));
  verify_membership();
}

void NcclCommunicator::adopt(ncclComm_t comm) {
  comm_ = comm;
  const ncclResult_t state = settle(comm_, "the NCCL set-up with", &others_);
  if (state != ncclSuccess) PIPESHARD_NCCL_FAIL("the split communicator's set-up: " + describe(state));
  verify_membership();
}

// NCCL and MPI both order a split's ranks by key, then by rank in the parent: the two
// groups must agree, or every transfer would go to the wrong rank.
void NcclCommunicator::verify_membership() {
  int count = 0, rank = -1;
  if (ncclCommCount(comm_, &count) != ncclSuccess || ncclCommUserRank(comm_, &rank) != ncclSuccess || count != size_ ||
      rank != rank_) {
    PIPESHARD_NCCL_FAIL("the NCCL group has rank " + std::to_string(rank) + " of " + std::to_string(count) +
                        " where its MPI group has rank " + std::to_string(rank_) + " of " + std::to_string(size_));
  }
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
  if (color < 0) PIPESHARD_NCCL_FAIL("split color " + std::to_string(color) + " (colors are >= 0)");
  std::unique_ptr<Communicator> host = host_->split(color, key);
  auto child = std::make_unique<NcclCommunicator>(*host, device_, producer_);
  child->owned_host_ = std::move(host);
  ncclConfig_t config = non_blocking_config();
  ncclComm_t comm = nullptr;
  const ncclResult_t rc = ncclCommSplit(comm_, color, key, &comm, &config);
  if (rc != ncclSuccess && rc != ncclInProgress) PIPESHARD_NCCL_FAIL("ncclCommSplit: " + describe(rc));
  // The split runs on NCCL's thread and may still do so when the call returned ncclSuccess
  // (NCCL 2.2x): the parent's state says when it is done, and the thread stores the new
  // handle on its way out. The loop only covers that store's visibility.
  const ncclResult_t state = settle(comm_, "the NCCL group split with", &others_);
  if (state != ncclSuccess) PIPESHARD_NCCL_FAIL("ncclCommSplit: " + describe(state));
  std::atomic_ref<ncclComm_t> handle(comm);
  {
    const WatchdogWait watched("the NCCL group split with", &others_);
    for (Backoff backoff; handle.load(std::memory_order_acquire) == nullptr; backoff.pause()) {
      check_state("the NCCL group split");
    }
  }
  child->adopt(handle.load(std::memory_order_acquire));
  return child;
}

ncclResult_t NcclCommunicator::settle(ncclComm_t comm, const char* during, const std::string* peers) {
  const WatchdogWait watched(during, peers);
  ncclResult_t state = ncclInProgress;
  for (Backoff backoff;; backoff.pause()) {
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
    if (rc != ncclSuccess) return rc;
    if (state != ncclInProgress) return state;
  }
}

void NcclCommunicator::order_after_producer() {
  PIPESHARD_NCCL_CUDA(cudaSetDevice(device_));
  if (producer_ != nullptr) {
    PIPESHARD_NCCL_CUDA(cudaEventRecord(ready_->get(), producer_));
    PIPESHARD_NCCL_CUDA(cudaStreamWaitEvent(stream_, ready_->get(), 0));
    return;
  }
  const WatchdogWait watched("the device's queued work before an NCCL call with", &others_);
  PIPESHARD_NCCL_CUDA(cudaDeviceSynchronize());
}

void NcclCommunicator::launch_transfer(const float* send, float* recv, int64_t n, int peer) {
  order_after_producer();
  const char* during = send != nullptr ? "the NCCL send to" : "the NCCL receive from";
  PIPESHARD_NCCL_CALL(ncclGroupStart(), during);
  if (send != nullptr) {
    PIPESHARD_NCCL_CALL(ncclSend(send, static_cast<size_t>(n), ncclFloat, peer, comm_, stream_), during);
  }
  if (recv != nullptr) {
    PIPESHARD_NCCL_CALL(ncclRecv(recv, static_cast<size_t>(n), ncclFloat, peer, comm_, stream_), during);
  }
  PIPESHARD_NCCL_CALL(ncclGroupEnd(), during);
}

void NcclCommunicator::wait_event(cudaEvent_t event, const char* operation, const std::string* peers) {
  const WatchdogWait watched(operation, peers);
  for (Backoff backoff;; backoff.pause()) {
    const cudaError_t rc = cudaEventQuery(event);
    if (rc == cudaSuccess) return;
    forget_not_ready();
    if (rc != cudaErrorNotReady) {
      PIPESHARD_NCCL_FAIL(std::string("cudaEventQuery, waiting for ") + operation + " " + *peers + ": " +
                          cudaGetErrorString(rc));
    }
    check_state(operation);
  }
}

void NcclCommunicator::wait_for(const Completion& completion, const char* operation, const std::string* peers) {
  if (completion.event == nullptr) {
    PIPESHARD_NCCL_FAIL(std::string("waiting for ") + operation + " itself, whose partner (a " +
                        (std::string(operation).find("send") != std::string::npos ? "receive" : "send") +
                        " with itself) was never posted: it could never complete");
  }
  wait_event(completion.event->get(), operation, peers);
}

// Pairs a send and a receive with itself in posting order (tags are MPI's alone), and runs
// each pair as one NCCL group, which is how NCCL moves data from a rank to itself.
std::shared_ptr<Completion> NcclCommunicator::post_self(const float* send, float* recv, int64_t n, bool blocking) {
  auto completion = std::make_shared<Completion>();
  std::deque<SelfTransfer>& partners = send != nullptr ? self_recvs_ : self_sends_;
  if (partners.empty()) {
    if (blocking) return completion;  // no event: wait_self reports it
    (send != nullptr ? self_sends_ : self_recvs_).push_back(SelfTransfer{send, recv, n, completion});
    return completion;
  }
  SelfTransfer partner = std::move(partners.front());
  partners.pop_front();
  if (partner.n != n) {
    PIPESHARD_NCCL_FAIL("a receive of " + std::to_string(send != nullptr ? partner.n : n) +
                        " floats from itself matched a send of " + std::to_string(send != nullptr ? n : partner.n));
  }
  order_after_producer();
  PIPESHARD_NCCL_CALL(ncclGroupStart(), "the NCCL transfer to itself");
  PIPESHARD_NCCL_CALL(
      ncclSend(send != nullptr ? send : partner.send, static_cast<size_t>(n), ncclFloat, rank_, comm_, stream_),
      "the NCCL transfer to itself");
  PIPESHARD_NCCL_CALL(
      ncclRecv(recv != nullptr ? recv : partner.recv, static_cast<size_t>(n), ncclFloat, rank_, comm_, stream_),
      "the NCCL transfer to itself");
  PIPESHARD_NCCL_CALL(ncclGroupEnd(), "the NCCL transfer to itself");
  completion->event = recorded_event();
  partner.completion->event = completion->event;
  return completion;
}

void NcclCommunicator::wait_self(const std::shared_ptr<Completion>& completion, const char* what) {
  if (completion->event == nullptr) {
    PIPESHARD_NCCL_FAIL(std::string(what) + " with itself (rank " + std::to_string(rank_) +
                        ") and no partner posted could never complete: post one side with send_async or recv_async");
  }
  wait_event(completion->event->get(), "the transfer with", &self_name_);
}

void NcclCommunicator::check_device_buffer(const void* data, int64_t n, const char* operation) {
  if (n < 0) PIPESHARD_NCCL_FAIL(std::string("the ") + operation + " of " + std::to_string(n) + " elements");
  if (n == 0) return;
  if (data == nullptr) PIPESHARD_NCCL_FAIL(std::string("null buffer for the ") + operation);
  cudaPointerAttributes attributes{};
  PIPESHARD_NCCL_CUDA(cudaPointerGetAttributes(&attributes, data));
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) {
    PIPESHARD_NCCL_FAIL(std::string("the ") + operation +
                        " got a pointer to host memory; the NCCL communicator's buffers are device memory");
  }
}

void NcclCommunicator::name_ranks() {
  std::string list;
  for (int r = 0; r < size_; ++r) {
    peer_names_.push_back("rank " + std::to_string(r) + " of its NCCL group");
    if (r != rank_) list += (list.empty() ? "" : ", ") + std::to_string(r);
  }
  others_ =
      size_ == 1 ? "no other rank (a group of one)" : (size_ == 2 ? "rank " : "ranks ") + list + " of its NCCL group";
  self_name_ = "itself (rank " + std::to_string(rank_) + " of its NCCL group)";
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& mpi_group, int device, CUstream_st* producer) {
  auto comm = std::make_unique<NcclCommunicator>(mpi_group, device, producer);
  comm->bootstrap();
  return comm;
}

}  // namespace pipeshard
