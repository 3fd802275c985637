// The group of one: what a process started without mpirun talks to. Collectives leave the
// data as it is (or copy it to the output), and point-to-point has nobody to talk to.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "common/check.h"
#include "common/status.h"

namespace pipeshard {
namespace {

class CompletedRequest final : public Request {
 public:
  void wait() override {}
};

template <typename T>
void check_buffer(const T* data, int64_t n) {
  PIPESHARD_CHECK(n >= 0, "negative element count " + std::to_string(n));
  PIPESHARD_CHECK(data != nullptr || n == 0, "null buffer for " + std::to_string(n) +
                                                 (sizeof(T) == 8   ? " doubles"
                                                  : sizeof(T) == 1 ? " bytes"
                                                                   : " floats"));
}

void copy_floats(const float* from, float* to, int64_t n) {
  check_buffer(from, n);
  check_buffer(to, n);
  if (from != to && n > 0) std::memmove(to, from, sizeof(float) * static_cast<size_t>(n));
}

[[noreturn]] void no_peers(const char* what, int peer, int tag) {
  fatal(__FILE__, __LINE__,
        std::string(what) + " with rank " + std::to_string(peer) + " (tag " + std::to_string(tag) +
            "): a single process has no peers");
}

class SingleProcessCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }

  void all_reduce(float* data, int64_t n, ReduceOp) override { check_buffer(data, n); }
  std::unique_ptr<Request> all_reduce_async(float* data, int64_t n, ReduceOp) override {
    check_buffer(data, n);
    return std::make_unique<CompletedRequest>();
  }
  double all_reduce_sum(double value) override { return value; }
  std::vector<std::string> gather_text(const std::string& text, int root) override {
    PIPESHARD_CHECK(root == 0, "gather to rank " + std::to_string(root) + " in a group of one");
    return {text};
  }
  void all_reduce_sum(double* data, int64_t n) override { check_buffer(data, n); }
  void all_gather(const float* send, float* recv, int64_t n) override { copy_floats(send, recv, n); }
  void reduce_scatter(const float* send, float* recv, int64_t n, ReduceOp) override { copy_floats(send, recv, n); }
  std::unique_ptr<Request> all_gather_async(const float* send, float* recv, int64_t n) override {
    copy_floats(send, recv, n);
    return std::make_unique<CompletedRequest>();
  }
  std::unique_ptr<Request> reduce_scatter_async(const float* send, float* recv, int64_t n, ReduceOp) override {
    copy_floats(send, recv, n);
    return std::make_unique<CompletedRequest>();
  }
  void broadcast(float* data, int64_t n, int root) override {
    check_buffer(data, n);
    PIPESHARD_CHECK(root == 0, "broadcast from rank " + std::to_string(root) + " in a group of one");
  }
  void broadcast_bytes(void* bytes, int64_t n, int root) override {
    check_buffer(static_cast<const char*>(bytes), n);
    PIPESHARD_CHECK(root == 0, "broadcast from rank " + std::to_string(root) + " in a group of one");
  }

  void send(const float*, int64_t, int peer, int tag) override { no_peers("send", peer, tag); }
  void recv(float*, int64_t, int peer, int tag) override { no_peers("recv", peer, tag); }
  std::unique_ptr<Request> send_async(const float*, int64_t, int peer, int tag) override {
    no_peers("send_async", peer, tag);
  }
  std::unique_ptr<Request> recv_async(float*, int64_t, int peer, int tag) override {
    no_peers("recv_async", peer, tag);
  }
  void barrier() override {}

  std::unique_ptr<Communicator> split(int color, int) override {
    PIPESHARD_CHECK(color >= 0, "split color " + std::to_string(color) + " (colors are ≥ 0)");
    return std::make_unique<SingleProcessCommunicator>();
  }

  [[noreturn]] void abort(const std::string& message) override {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", message.c_str());
    std::exit(1);
  }
};

// Knows its place in a group and carries nothing (make_placeholder_communicator()).
class PlaceholderCommunicator final : public Communicator {
 public:
  PlaceholderCommunicator(int rank, int size, std::string who) : rank_(rank), size_(size), who_(std::move(who)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce(float*, int64_t, ReduceOp) override { carried("all_reduce"); }
  std::unique_ptr<Request> all_reduce_async(float*, int64_t, ReduceOp) override { carried("all_reduce_async"); }
  double all_reduce_sum(double) override { carried("all_reduce_sum"); }
  std::vector<std::string> gather_text(const std::string&, int) override { carried("gather_text"); }
  void all_reduce_sum(double*, int64_t) override { carried("all_reduce_sum"); }
  void all_gather(const float*, float*, int64_t) override { carried("all_gather"); }
  void reduce_scatter(const float*, float*, int64_t, ReduceOp) override { carried("reduce_scatter"); }
  std::unique_ptr<Request> all_gather_async(const float*, float*, int64_t) override { carried("all_gather_async"); }
  std::unique_ptr<Request> reduce_scatter_async(const float*, float*, int64_t, ReduceOp) override {
    carried("reduce_scatter_async");
  }
  void broadcast(float*, int64_t, int) override { carried("broadcast"); }
  void broadcast_bytes(void*, int64_t, int) override { carried("broadcast_bytes"); }
  void send(const float*, int64_t, int, int) override { carried("send"); }
  void recv(float*, int64_t, int, int) override { carried("recv"); }
  std::unique_ptr<Request> send_async(const float*, int64_t, int, int) override { carried("send_async"); }
  std::unique_ptr<Request> recv_async(float*, int64_t, int, int) override { carried("recv_async"); }
  void barrier() override { carried("barrier"); }
  std::unique_ptr<Communicator> split(int, int) override { carried("split"); }
  [[noreturn]] void abort(const std::string& message) override { fatal(__FILE__, __LINE__, message); }

 private:
  [[noreturn]] void carried(const char* what) const {
    fatal(__FILE__, __LINE__, std::string(what) + " on " + who_ + ", which carries nothing");
  }
  int rank_, size_;
  std::string who_;
};

}  // namespace

std::unique_ptr<Communicator> make_placeholder_communicator(int rank, int size, const std::string& who) {
  PIPESHARD_CHECK(size >= 1 && rank >= 0 && rank < size,
                  "rank " + std::to_string(rank) + " of a group of " + std::to_string(size));
  return std::make_unique<PlaceholderCommunicator>(rank, size, who);
}

std::unique_ptr<Communicator> make_single_process_communicator() {
  return std::make_unique<SingleProcessCommunicator>();
}

}  // namespace pipeshard
