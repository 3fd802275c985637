// The staged communicator (comm_staged.h): device buffers → host buffers → the host
// communicator → device buffers.
#include "comm/comm_staged.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace pipeshard {
namespace {

void check_count(int64_t n) { PIPESHARD_CHECK(n >= 0, "negative element count " + std::to_string(n)); }

// A host copy of a device buffer of n floats (n = 0: empty, nothing read).
std::vector<float> download(Backend& backend, const float* device, int64_t n) {
  check_count(n);
  std::vector<float> host(static_cast<size_t>(n));
  if (n > 0) backend.download(host.data(), device, n);
  return host;
}

void upload(Backend& backend, float* device, const std::vector<float>& host) {
  if (!host.empty()) backend.upload(device, host.data(), static_cast<int64_t>(host.size()));
}

// The host operation in flight and the host buffer it works on; wait() completes it and,
// for operations that produce data, uploads the buffer to `device`. `input`, when the
// operation reads a buffer of its own (a reduce-scatter's, an all-gather's), is kept as
// long as the operation runs.
class StagedRequest final : public Request {
 public:
  StagedRequest(Backend& backend, std::vector<float> host, float* device, std::vector<float> input = {})
      : backend_(backend), host_(std::move(host)), device_(device), input_(std::move(input)) {}
  ~StagedRequest() override { StagedRequest::wait(); }

  // Starts the host operation on host_ (and input_); called once, right after construction,
  // because the operation needs their final addresses.
  template <typename Start>
  void start(Start&& start_operation) {
    inner_ = start_operation(host_.data());
  }
  const float* input() const { return input_.data(); }

  void wait() override {
    if (!inner_) return;
    inner_->wait();
    inner_.reset();
    if (device_) upload(backend_, device_, host_);
  }

 private:
  Backend& backend_;
  std::vector<float> host_;
  float* device_;  // null: nothing comes back (a send)
  std::vector<float> input_;
  std::unique_ptr<Request> inner_;
};

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(Communicator& host, Backend& backend, std::unique_ptr<Communicator> owned = nullptr)
      : owned_(std::move(owned)), host_(host), backend_(backend) {}

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }

  void all_reduce(float* data, int64_t n, ReduceOp op) override {
    std::vector<float> h = download(backend_, data, n);
    host_.all_reduce(h.data(), n, op);
    upload(backend_, data, h);
  }
  std::unique_ptr<Request> all_reduce_async(float* data, int64_t n, ReduceOp op) override {
    auto r = std::make_unique<StagedRequest>(backend_, download(backend_, data, n), data);
    r->start([&](float* h) { return host_.all_reduce_async(h, n, op); });
    return r;
  }
  double all_reduce_sum(double value) override { return host_.all_reduce_sum(value); }
  std::vector<std::string> gather_text(const std::string& text, int root) override {
    return host_.gather_text(text, root);
  }
  // The doubles travel through the float copies as raw bytes: two floats per double.
  void all_reduce_sum(double* data, int64_t n) override {
    check_count(n);
    std::vector<float> bytes = download(backend_, reinterpret_cast<const float*>(data), 2 * n);
    std::vector<double> h(static_cast<size_t>(n));
    if (n > 0) std::memcpy(h.data(), bytes.data(), sizeof(double) * static_cast<size_t>(n));
    host_.all_reduce_sum(h.data(), n);
    if (n > 0) std::memcpy(bytes.data(), h.data(), sizeof(double) * static_cast<size_t>(n));
    upload(backend_, reinterpret_cast<float*>(data), bytes);
  }
  void all_gather(const float* send, float* recv, int64_t n) override {
    // In place (send == recv + rank·n) works too: the send block is read before anything
    // is written back.
    std::vector<float> mine = download(backend_, send, n);
    std::vector<float> all(static_cast<size_t>(n) * static_cast<size_t>(size()));
    host_.all_gather(mine.data(), all.data(), n);
    upload(backend_, recv, all);
  }
  void reduce_scatter(const float* send, float* recv, int64_t n, ReduceOp op) override {
    check_count(n);
    std::vector<float> all = download(backend_, send, n * size());
    std::vector<float> mine(static_cast<size_t>(n));
    host_.reduce_scatter(all.data(), mine.data(), n, op);
    upload(backend_, recv, mine);
  }
  // Both download their input now (in place, before anything is written back) and upload
  // the result in wait().
  std::unique_ptr<Request> all_gather_async(const float* send, float* recv, int64_t n) override {
    check_count(n);
    auto r = std::make_unique<StagedRequest>(backend_, std::vector<float>(static_cast<size_t>(n * size())), recv,
                                             download(backend_, send, n));
    r->start([&, input = r->input()](float* h) { return host_.all_gather_async(input, h, n); });
    return r;
  }
  std::unique_ptr<Request> reduce_scatter_async(const float* send, float* recv, int64_t n, ReduceOp op) override {
    check_count(n);
    auto r = std::make_unique<StagedRequest>(backend_, std::vector<float>(static_cast<size_t>(n)), recv,
                                             download(backend_, send, n * size()));
    r->start([&, input = r->input()](float* h) { return host_.reduce_scatter_async(input, h, n, op); });
    return r;
  }
  void broadcast(float* data, int64_t n, int root) override {
    check_count(n);
    std::vector<float> h = rank() == root ? download(backend_, data, n) : std::vector<float>(static_cast<size_t>(n));
    host_.broadcast(h.data(), n, root);
    if (rank() != root) upload(backend_, data, h);
  }
  void broadcast_bytes(void* bytes, int64_t n, int root) override { host_.broadcast_bytes(bytes, n, root); }

  void send(const float* data, int64_t n, int peer, int tag) override {
    std::vector<float> h = download(backend_, data, n);
    host_.send(h.data(), n, peer, tag);
  }
  void recv(float* data, int64_t n, int peer, int tag) override {
    check_count(n);
    std::vector<float> h(static_cast<size_t>(n));
    host_.recv(h.data(), n, peer, tag);
    upload(backend_, data, h);
  }
  std::unique_ptr<Request> send_async(const float* data, int64_t n, int peer, int tag) override {
    auto r = std::make_unique<StagedRequest>(backend_, download(backend_, data, n), nullptr);
    r->start([&](float* h) { return host_.send_async(h, n, peer, tag); });
    return r;
  }
  std::unique_ptr<Request> recv_async(float* data, int64_t n, int peer, int tag) override {
    check_count(n);
    auto r = std::make_unique<StagedRequest>(backend_, std::vector<float>(static_cast<size_t>(n)), data);
    r->start([&](float* h) { return host_.recv_async(h, n, peer, tag); });
    return r;
  }
  void barrier() override { host_.barrier(); }
  void progress() override { host_.progress(); }

  std::unique_ptr<Communicator> split(int color, int key) override {
    std::unique_ptr<Communicator> group = host_.split(color, key);
    Communicator& host = *group;
    return std::make_unique<StagedCommunicator>(host, backend_, std::move(group));
  }
  [[noreturn]] void abort(const std::string& message) override {
    host_.abort(message);
    std::abort();  // not reached: the host communicator's abort does not return
  }

 private:
  std::unique_ptr<Communicator> owned_;  // host_ when this group came from split()
  Communicator& host_;
  Backend& backend_;
};

}  // namespace

std::unique_ptr<Communicator> make_staged_communicator(Communicator& host, Backend& backend) {
  return std::make_unique<StagedCommunicator>(host, backend);
}

ProcessGroups make_staged_groups(ProcessGroups& host, Backend& backend) {
  ProcessGroups staged;
  staged.layout = host.layout;
  if (host.data) staged.data = make_staged_communicator(*host.data, backend);
  if (host.tensor) staged.tensor = make_staged_communicator(*host.tensor, backend);
  if (host.pipeline) staged.pipeline = make_staged_communicator(*host.pipeline, backend);
  return staged;
}

}  // namespace pipeshard
