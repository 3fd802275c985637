// The in-process communicator (in_process_comm.h).
//
// A Group holds what its ranks share: the collectives in flight, by their sequence number
// (each rank numbers its own calls, so the k-th call of every rank meets in slot k), and
// the point-to-point channels, one per (source, destination, tag), whose messages and
// receives are numbered in issue order so that the k-th receive takes the k-th message.
// Contributions are copied when posted and results copied out when collected, so a rank's
// buffers are only ever touched by its own thread. InProcessCommunicator is one rank's
// view of a Group.
#include "testing/in_process_comm.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "common/status.h"
#include "testing/in_process_job.h"

namespace pipeshard {
namespace in_process {
namespace {

constexpr int kMaxTag = 32767;  // the least MPI_TAG_UB an MPI may have

enum class CollectiveKind {
  kAllReduce,
  kAllReduceAsync,
  kDoubleSum,
  kDoubleArraySum,
  kGatherText,
  kAllGather,
  kAllGatherAsync,
  kReduceScatter,
  kReduceScatterAsync,
  kBroadcast,
  kBroadcastBytes,
  kBarrier,
  kSplit
};

// How each kind is named in messages, and which of its arguments every rank must share.
struct KindFacts {
  const char* name;
  const char* unit;  // of n; null: n is not shared
  bool has_op, has_root;
};

const KindFacts& facts(CollectiveKind kind) {
  static const KindFacts table[] = {
      {"all_reduce", "floats", true, false},       {"all_reduce_async", "floats", true, false},
      {"all_reduce_sum", "doubles", false, false},  // of one value
      {"all_reduce_sum", "doubles", false, false}, {"gather_text", nullptr, false, true},
      {"all_gather", "floats", false, false},      {"all_gather_async", "floats", false, false},
      {"reduce_scatter", "floats", true, false},   {"reduce_scatter_async", "floats", true, false},
      {"broadcast", "floats", false, true},        {"broadcast_bytes", "bytes", false, true},
      {"barrier", nullptr, false, false},          {"split", nullptr, false, false},
  };
  return table[static_cast<int>(kind)];
}

// One rank's call of a collective: what every rank must agree on.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::kBarrier;
  int64_t n = 0;
  int root = 0;
  ReduceOp op = ReduceOp::kSum;

  bool operator==(const CollectiveCall&) const = default;
  std::string describe() const {
    const KindFacts& f = facts(kind);
    std::string text = f.name;
    if (f.unit != nullptr) text += " of " + std::to_string(n) + " " + f.unit;
    if (f.has_op) text += op == ReduceOp::kSum ? " (sum)" : " (average)";
    if (f.has_root) text += (kind == CollectiveKind::kGatherText ? " to rank " : " from rank ") + std::to_string(root);
    return text;
  }
};

// One rank's part of a collective: the one field its kind uses.
struct Contribution {
  std::vector<float> floats;
  std::vector<double> doubles;
  std::string bytes;
  int color = 0, key = 0;  // split

  static Contribution of_floats(std::vector<float> v) {
    Contribution c;
    c.floats = std::move(v);
    return c;
  }
  static Contribution of_doubles(std::vector<double> v) {
    Contribution c;
    c.doubles = std::move(v);
    return c;
  }
  static Contribution of_bytes(std::string v) {
    Contribution c;
    c.bytes = std::move(v);
    return c;
  }
  static Contribution of_split(int color, int key) {
    Contribution c;
    c.color = color;
    c.key = key;
    return c;
  }
};

class Group;

struct Collective {
  CollectiveCall call;  // as the first rank to post it called it
  int first_rank = 0;
  std::vector<Contribution> inputs;  // [rank]
  std::vector<bool> posted;          // [rank]
  int posted_count = 0, collected = 0;
  bool complete = false;
  // The result, once complete.
  std::vector<float> floats;
  std::vector<double> doubles;
  std::vector<std::string> texts;
  std::string bytes;
  std::vector<std::pair<std::shared_ptr<Group>, int>> split;  // [rank]: its new group and rank there
};

struct ChannelKey {
  int source, destination, tag;
  auto operator<=>(const ChannelKey&) const = default;
};

struct Channel {
  std::map<int64_t, std::vector<float>> messages;  // by send number, until received
  int64_t sent = 0, receives_posted = 0;
};

enum class WaitMode { kThrow, kQuiet };  // Request::wait, or a destructor

// Sums in rank order: in float for floats, in double for doubles.
template <typename T>
std::vector<T> sum_in_rank_order(const std::vector<Contribution>& inputs, std::vector<T> Contribution::*values) {
  std::vector<T> sum = inputs[0].*values;
  for (size_t r = 1; r < inputs.size(); ++r) {
    const std::vector<T>& x = inputs[r].*values;
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += x[i];
  }
  return sum;
}

std::vector<float> reduce_floats(const std::vector<Contribution>& inputs, ReduceOp op) {
  std::vector<float> result = sum_in_rank_order(inputs, &Contribution::floats);
  if (op == ReduceOp::kAverage) {
    const float divisor = static_cast<float>(inputs.size());
    for (float& x : result) x /= divisor;
  }
  return result;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

class Group {
 public:
  // `name` for messages: "the world", or empty for "the group of world ranks …".
  Group(std::shared_ptr<Job> job, std::vector<int> world_ranks, std::string name = "")
      : job_(std::move(job)), world_ranks_(std::move(world_ranks)),
        name_(name.empty() ? "the group of world ranks " + rank_list(world_ranks_) : std::move(name)) {}

  Job& job() { return *job_; }
  int size() const { return static_cast<int>(world_ranks_.size()); }
  int world_rank(int rank) const { return world_ranks_[static_cast<size_t>(rank)]; }
  const std::string& name() const { return name_; }

  // Posts `rank`'s call number `seq`; the last rank to post computes the result.
  void post(int rank, int64_t seq, const CollectiveCall& call, Contribution input) {
    const std::lock_guard<std::mutex> lock(job_->mutex());
    auto [it, created] = collectives_.try_emplace(seq);
    Collective& c = it->second;
    if (created) {
      c.call = call;
      c.first_rank = rank;
      c.inputs.resize(static_cast<size_t>(size()));
      c.posted.resize(static_cast<size_t>(size()), false);
    }
    PIPESHARD_CHECK(c.call == call, "in-process communicator: collective #" + std::to_string(seq) + " of " + name() +
                                        ": rank " + std::to_string(rank) + " calls " + call.describe() +
                                        " where rank " + std::to_string(c.first_rank) + " called " + c.call.describe());
    c.inputs[static_cast<size_t>(rank)] = std::move(input);
    c.posted[static_cast<size_t>(rank)] = true;
    if (++c.posted_count == size()) {
      complete(c);
      job_->changed();
    }
  }

  // Waits until collective `seq` is complete and hands it to take() (under the lock).
  // False when the job failed first (kQuiet); kThrow throws InProcessJobError instead.
  bool collect(int rank, int64_t seq, WaitMode mode, const std::function<void(const Collective&)>& take) {
    std::unique_lock<std::mutex> lock(job_->mutex());
    Collective& c = collectives_.at(seq);
    const std::function<bool()> ready = [&c] { return c.complete; };
    const std::function<std::string()> describe = [&] {
      std::vector<int> missing;
      for (int r = 0; r < size(); ++r) {
        if (!c.posted[static_cast<size_t>(r)]) missing.push_back(r);
      }
      return c.call.describe() + " on " + name() + " (its collective #" + std::to_string(seq) + "), which rank" +
             (missing.size() == 1 ? " " : "s ") + rank_list(missing) + " of that group " +
             (missing.size() == 1 ? "has" : "have") + " not called";
    };
    if (job_->wait(lock, world_rank(rank), ready, describe) == WaitResult::kJobFailed) return job_failed(mode);
    take(c);
    if (++c.collected == size()) collectives_.erase(seq);
    return true;
  }

  void send(int rank, int peer, int tag, const float* data, int64_t n) {
    const std::lock_guard<std::mutex> lock(job_->mutex());
    Channel& channel = channels_[{rank, peer, tag}];
    channel.messages.emplace(channel.sent++, std::vector<float>(data, data + n));
    job_->changed();
  }

  // The number of the receive `rank` posts now: it takes the message with that number.
  int64_t post_receive(int rank, int peer, int tag) {
    const std::lock_guard<std::mutex> lock(job_->mutex());
    return channels_[{peer, rank, tag}].receives_posted++;
  }

  // Waits for message `ticket` from `peer` and copies it into data[n]; false or a throw
  // as collect().
  bool receive(int rank, int peer, int tag, int64_t ticket, float* data, int64_t n, WaitMode mode) {
    std::unique_lock<std::mutex> lock(job_->mutex());
    Channel& channel = channels_[{peer, rank, tag}];
    const std::function<bool()> ready = [&] { return channel.messages.count(ticket) > 0; };
    const std::function<std::string()> describe = [&] {
      return "a receive of " + std::to_string(n) + " floats from rank " + std::to_string(peer) + " (tag " +
             std::to_string(tag) + ") on " + name() + ": it takes message #" + std::to_string(ticket) +
             " from that rank with that tag, and " + std::to_string(channel.sent) + " have been sent";
    };
    if (job_->wait(lock, world_rank(rank), ready, describe) == WaitResult::kJobFailed) return job_failed(mode);
    auto it = channel.messages.find(ticket);
    const std::vector<float> message = std::move(it->second);
    channel.messages.erase(it);
    PIPESHARD_CHECK(static_cast<int64_t>(message.size()) == n,
                    "received " + std::to_string(message.size()) + " floats from rank " + std::to_string(peer) +
                        " (tag " + std::to_string(tag) + ") where " + std::to_string(n) + " were expected");
    if (n > 0) std::memcpy(data, message.data(), sizeof(float) * static_cast<size_t>(n));
    return true;
  }

 private:
  bool job_failed(WaitMode mode) const {
    if (mode == WaitMode::kThrow) throw InProcessJobError(job_->failure());
    return false;
  }

  void complete(Collective& c) {
    switch (c.call.kind) {
      case CollectiveKind::kAllReduce:
      case CollectiveKind::kAllReduceAsync:
      case CollectiveKind::kReduceScatter:  // every block; each rank takes its own
      case CollectiveKind::kReduceScatterAsync: c.floats = reduce_floats(c.inputs, c.call.op); break;
      case CollectiveKind::kDoubleSum:
      case CollectiveKind::kDoubleArraySum: c.doubles = sum_in_rank_order(c.inputs, &Contribution::doubles); break;
      case CollectiveKind::kGatherText:
        for (const Contribution& in : c.inputs) c.texts.push_back(in.bytes);
        break;
      case CollectiveKind::kAllGather:
      case CollectiveKind::kAllGatherAsync:
        for (const Contribution& in : c.inputs) c.floats.insert(c.floats.end(), in.floats.begin(), in.floats.end());
        break;
      case CollectiveKind::kBroadcast: c.floats = c.inputs[static_cast<size_t>(c.call.root)].floats; break;
      case CollectiveKind::kBroadcastBytes: c.bytes = c.inputs[static_cast<size_t>(c.call.root)].bytes; break;
      case CollectiveKind::kBarrier: break;
      case CollectiveKind::kSplit: split(c); break;
    }
    c.complete = true;
  }

  // The ranks of each color, ordered by key and then by rank here, become a new group.
  void split(Collective& c) {
    std::map<int, std::vector<int>> members;  // by color
    for (int r = 0; r < size(); ++r) members[c.inputs[static_cast<size_t>(r)].color].push_back(r);
    c.split.resize(static_cast<size_t>(size()));
    for (auto& [color, ranks] : members) {
      std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
        return c.inputs[static_cast<size_t>(a)].key < c.inputs[static_cast<size_t>(b)].key;
      });
      std::vector<int> world;
      for (int r : ranks) world.push_back(world_rank(r));
      auto group = std::make_shared<Group>(job_, std::move(world));
      for (size_t i = 0; i < ranks.size(); ++i) c.split[static_cast<size_t>(ranks[i])] = {group, static_cast<int>(i)};
    }
  }

  std::shared_ptr<Job> job_;
  std::vector<int> world_ranks_;  // [rank in this group]
  std::string name_;
  std::map<int64_t, Collective> collectives_;  // by sequence number, until every rank collected
  std::map<ChannelKey, Channel> channels_;
};

class CompletedRequest final : public Request {
 public:
  void wait() override {}
};

// An operation that completes in finish(mode): a collective to collect or a receive.
class InProcessRequest final : public Request {
 public:
  explicit InProcessRequest(std::function<bool(WaitMode)> finish) : finish_(std::move(finish)) {}
  ~InProcessRequest() override {
    if (!done_) finish_(WaitMode::kQuiet);
  }
  InProcessRequest(const InProcessRequest&) = delete;
  InProcessRequest& operator=(const InProcessRequest&) = delete;
  void wait() override {
    if (done_) return;
    done_ = true;
    finish_(WaitMode::kThrow);
  }

 private:
  std::function<bool(WaitMode)> finish_;
  bool done_ = false;
};

template <typename T>
void check_buffer(const T* data, int64_t n) {
  PIPESHARD_CHECK(n >= 0, "negative element count " + std::to_string(n));
  PIPESHARD_CHECK(data != nullptr || n == 0, "null buffer for " + std::to_string(n) + " elements");
}

template <typename T>
std::vector<T> copy_of(const T* data, int64_t n) {
  return n > 0 ? std::vector<T>(data, data + n) : std::vector<T>();
}

template <typename T>
void copy_out(const std::vector<T>& from, size_t offset, T* to, int64_t n) {
  if (n > 0) std::memcpy(to, from.data() + offset, sizeof(T) * static_cast<size_t>(n));
}

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {
    const std::lock_guard<std::mutex> lock(group_->job().mutex());
    group_->job().enter(group_->world_rank(rank_));
  }
  ~InProcessCommunicator() override {
    const std::lock_guard<std::mutex> lock(group_->job().mutex());
    group_->job().leave(group_->world_rank(rank_));
  }
  InProcessCommunicator(const InProcessCommunicator&) = delete;
  InProcessCommunicator& operator=(const InProcessCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }

  void all_reduce(float* data, int64_t n, ReduceOp op) override {
    check_buffer(data, n);
    const int64_t seq = post({CollectiveKind::kAllReduce, n, 0, op}, Contribution::of_floats(copy_of(data, n)));
    collect(seq, WaitMode::kThrow, [&](const Collective& c) { copy_out(c.floats, 0, data, n); });
  }
  std::unique_ptr<Request> all_reduce_async(float* data, int64_t n, ReduceOp op) override {
    check_buffer(data, n);
    const int64_t seq = post({CollectiveKind::kAllReduceAsync, n, 0, op}, Contribution::of_floats(copy_of(data, n)));
    return std::make_unique<InProcessRequest>([group = group_, rank = rank_, seq, data, n](WaitMode mode) {
      return group->collect(rank, seq, mode, [&](const Collective& c) { copy_out(c.floats, 0, data, n); });
    });
  }
  double all_reduce_sum(double value) override {
    const int64_t seq = post({CollectiveKind::kDoubleSum, 1, 0, ReduceOp::kSum}, Contribution::of_doubles({value}));
    collect(seq, WaitMode::kThrow, [&](const Collective& c) { value = c.doubles[0]; });
    return value;
  }
  std::vector<std::string> gather_text(const std::string& text, int root) override {
    check_root(root);
    const int64_t seq = post({CollectiveKind::kGatherText, 0, root, ReduceOp::kSum}, Contribution::of_bytes(text));
    std::vector<std::string> all;
    collect(seq, WaitMode::kThrow, [&](const Collective& c) {
      if (rank_ == root) all = c.texts;
    });
    return all;
  }
  void all_reduce_sum(double* data, int64_t n) override {
    check_buffer(data, n);
    const int64_t seq =
        post({CollectiveKind::kDoubleArraySum, n, 0, ReduceOp::kSum}, Contribution::of_doubles(copy_of(data, n)));
    collect(seq, WaitMode::kThrow, [&](const Collective& c) { copy_out(c.doubles, 0, data, n); });
  }
  void all_gather(const float* send, float* recv, int64_t n) override {
    const int64_t seq = post_all_gather(CollectiveKind::kAllGather, send, recv, n);
    collect(seq, WaitMode::kThrow, [&](const Collective& c) { copy_out(c.floats, 0, recv, n * size()); });
  }
  std::unique_ptr<Request> all_gather_async(const float* send, float* recv, int64_t n) override {
    const int64_t seq = post_all_gather(CollectiveKind::kAllGatherAsync, send, recv, n);
    return std::make_unique<InProcessRequest>(
        [group = group_, rank = rank_, seq, recv, total = n * size()](WaitMode mode) {
          return group->collect(rank, seq, mode, [&](const Collective& c) { copy_out(c.floats, 0, recv, total); });
        });
  }
  void reduce_scatter(const float* send, float* recv, int64_t n, ReduceOp op) override {
    const int64_t seq = post_reduce_scatter(CollectiveKind::kReduceScatter, send, recv, n, op);
    collect(seq, WaitMode::kThrow,
            [&](const Collective& c) { copy_out(c.floats, static_cast<size_t>(rank_ * n), recv, n); });
  }
  std::unique_ptr<Request> reduce_scatter_async(const float* send, float* recv, int64_t n, ReduceOp op) override {
    const int64_t seq = post_reduce_scatter(CollectiveKind::kReduceScatterAsync, send, recv, n, op);
    return std::make_unique<InProcessRequest>([group = group_, rank = rank_, seq, recv, n](WaitMode mode) {
      return group->collect(rank, seq, mode,
                            [&](const Collective& c) { copy_out(c.floats, static_cast<size_t>(rank * n), recv, n); });
    });
  }
  void broadcast(float* data, int64_t n, int root) override {
    check_buffer(data, n);
    check_root(root);
    const int64_t seq = post({CollectiveKind::kBroadcast, n, root, ReduceOp::kSum},
                             Contribution::of_floats(rank_ == root ? copy_of(data, n) : std::vector<float>()));
    collect(seq, WaitMode::kThrow, [&](const Collective& c) {
      if (rank_ != root) copy_out(c.floats, 0, data, n);
    });
  }
  void broadcast_bytes(void* bytes, int64_t n, int root) override {
    auto* data = static_cast<char*>(bytes);
    check_buffer(data, n);
    check_root(root);
    const int64_t seq = post(
        {CollectiveKind::kBroadcastBytes, n, root, ReduceOp::kSum},
        Contribution::of_bytes(rank_ == root && n > 0 ? std::string(data, static_cast<size_t>(n)) : std::string()));
    collect(seq, WaitMode::kThrow, [&](const Collective& c) {
      if (rank_ != root && n > 0) std::memcpy(data, c.bytes.data(), static_cast<size_t>(n));
    });
  }

  void send(const float* data, int64_t n, int peer, int tag) override {
    check_transfer(data, n, peer, tag);
    group_->send(rank_, peer, tag, data, n);
  }
  void recv(float* data, int64_t n, int peer, int tag) override {
    check_transfer(data, n, peer, tag);
    const int64_t ticket = group_->post_receive(rank_, peer, tag);
    group_->receive(rank_, peer, tag, ticket, data, n, WaitMode::kThrow);
  }
  std::unique_ptr<Request> send_async(const float* data, int64_t n, int peer, int tag) override {
    send(data, n, peer, tag);  // buffered: complete once posted
    return std::make_unique<CompletedRequest>();
  }
  std::unique_ptr<Request> recv_async(float* data, int64_t n, int peer, int tag) override {
    check_transfer(data, n, peer, tag);
    const int64_t ticket = group_->post_receive(rank_, peer, tag);
    return std::make_unique<InProcessRequest>(
        [group = group_, rank = rank_, peer, tag, ticket, data, n](WaitMode mode) {
          return group->receive(rank, peer, tag, ticket, data, n, mode);
        });
  }
  void barrier() override {
    const int64_t seq = post({CollectiveKind::kBarrier, 0, 0, ReduceOp::kSum}, {});
    collect(seq, WaitMode::kThrow, [](const Collective&) {});
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    PIPESHARD_CHECK(color >= 0, "split color " + std::to_string(color) + " (colors are ≥ 0)");
    const int64_t seq = post({CollectiveKind::kSplit, 0, 0, ReduceOp::kSum}, Contribution::of_split(color, key));
    std::pair<std::shared_ptr<Group>, int> mine;
    collect(seq, WaitMode::kThrow, [&](const Collective& c) { mine = c.split[static_cast<size_t>(rank_)]; });
    return std::make_unique<InProcessCommunicator>(std::move(mine.first), mine.second);
  }

  [[noreturn]] void abort(const std::string& message) override {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(stderr);
    std::_Exit(1);  // every rank is a thread of this process; exit() would race them in destructors
  }

 private:
  int64_t post(const CollectiveCall& call, Contribution input) {
    const int64_t seq = next_collective_++;
    group_->post(rank_, seq, call, std::move(input));
    return seq;
  }
  void collect(int64_t seq, WaitMode mode, const std::function<void(const Collective&)>& take) {
    group_->collect(rank_, seq, mode, take);
  }
  // Post this rank's part of an all-gather or reduce-scatter (blocking or not), its buffers
  // checked as MPI would have them.
  int64_t post_all_gather(CollectiveKind kind, const float* send, float* recv, int64_t n) {
    check_buffer(send, n);
    check_buffer(recv, n);
    const int64_t total = n * size();
    // In place is send == recv + rank·n; any other overlap is an error in MPI.
    PIPESHARD_CHECK(n == 0 || send == recv + rank_ * n || send + n <= recv || recv + total <= send,
                    "all_gather's send buffer overlaps its receive buffer other than at this rank's block");
    return post({kind, n, 0, ReduceOp::kSum}, Contribution::of_floats(copy_of(send, n)));
  }
  int64_t post_reduce_scatter(CollectiveKind kind, const float* send, float* recv, int64_t n, ReduceOp op) {
    check_buffer(send, n);
    check_buffer(recv, n);
    const int64_t total = n * size();
    // In place is recv == send + rank·n; any other overlap is an error in MPI.
    PIPESHARD_CHECK(n == 0 || recv == send + rank_ * n || send + total <= recv || recv + n <= send,
                    "reduce_scatter's receive buffer overlaps its send buffer other than at this rank's block");
    return post({kind, n, 0, op}, Contribution::of_floats(copy_of(send, total)));
  }
  void check_root(int root) const {
    PIPESHARD_CHECK(root >= 0 && root < size(),
                    "root " + std::to_string(root) + " of " + std::to_string(size()) + " ranks");
  }
  void check_transfer(const float* data, int64_t n, int peer, int tag) const {
    check_buffer(data, n);
    PIPESHARD_CHECK(peer >= 0 && peer < size(),
                    "peer " + std::to_string(peer) + " of " + std::to_string(size()) + " ranks");
    PIPESHARD_CHECK(tag >= 0 && tag <= kMaxTag, "tag " + std::to_string(tag) + " outside 0.." +
                                                    std::to_string(kMaxTag) + ", the range every MPI provides");
  }

  std::shared_ptr<Group> group_;
  int rank_;
  int64_t next_collective_ = 0;  // this rank's calls of collectives on the group
};

struct JobWorlds {
  std::shared_ptr<Job> job;
  std::vector<std::unique_ptr<Communicator>> worlds;
};

JobWorlds make_job(int size, const InProcessOptions& options) {
  PIPESHARD_CHECK(size >= 1, "an in-process group of " + std::to_string(size) + " ranks");
  JobWorlds made;
  made.job = std::make_shared<Job>(size, options);
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) ranks[static_cast<size_t>(r)] = r;
  auto world = std::make_shared<Group>(made.job, std::move(ranks), "the world");
  for (int r = 0; r < size; ++r) made.worlds.push_back(std::make_unique<InProcessCommunicator>(world, r));
  return made;
}

bool is_job_error(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const InProcessJobError&) {
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace
}  // namespace in_process

std::vector<std::unique_ptr<Communicator>> make_in_process_group(int size, const InProcessOptions& options) {
  return in_process::make_job(size, options).worlds;
}

void run_ranks(int size, const std::function<void(Communicator& world)>& body, const InProcessOptions& options) {
  in_process::JobWorlds job = in_process::make_job(size, options);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(*job.worlds[static_cast<size_t>(r)]);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
      job.worlds[static_cast<size_t>(r)].reset();  // leaves the job: waits for this rank fail now
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& error : errors) {
    if (error && !in_process::is_job_error(error)) std::rethrow_exception(error);
  }
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  const std::lock_guard<std::mutex> lock(job.job->mutex());
  if (!job.job->failure().empty()) throw InProcessJobError(job.job->failure());
}

ProcessGroups make_layout_groups(Communicator& world, int stages, int shards) {
  Result<ProcessLayout> layout = ProcessLayout::for_rank(world.rank(), world.size(), stages, shards);
  PIPESHARD_CHECK(layout.is_ok(), layout.status().message());
  return make_process_groups(world, *layout);
}

}  // namespace pipeshard
