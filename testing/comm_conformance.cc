// The Communicator conformance suite (comm_conformance.h). Each case names the promise of
// comm/comm.h it checks; expected values are written as formulas of rank and size.
#include "testing/comm_conformance.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <utility>

namespace pipeshard {
namespace {

// ---- Memory -------------------------------------------------------------------------------

class HostCommMemory final : public CommMemory {
 public:
  float* allocate(int64_t n) override {
    return static_cast<float*>(::operator new(sizeof(float) * static_cast<size_t>(n), kAlignment));
  }
  void deallocate(float* p) override { ::operator delete(p, kAlignment); }
  void upload(float* dst, const float* host, int64_t n) override {
    std::memcpy(dst, host, sizeof(float) * static_cast<size_t>(n));
  }
  void download(float* host, const float* src, int64_t n) override {
    std::memcpy(host, src, sizeof(float) * static_cast<size_t>(n));
  }

 private:
  static constexpr std::align_val_t kAlignment{64};
};

class BackendCommMemory final : public CommMemory {
 public:
  explicit BackendCommMemory(Backend& backend) : backend_(backend) {}
  float* allocate(int64_t n) override { return backend_.allocate(n); }
  void deallocate(float* p) override { backend_.deallocate(p); }
  void upload(float* dst, const float* host, int64_t n) override { backend_.upload(dst, host, n); }
  void download(float* host, const float* src, int64_t n) override { backend_.download(host, src, n); }

 private:
  Backend& backend_;
};

// n floats in the communicator's memory.
class Buffer {
 public:
  Buffer(CommMemory& memory, const std::vector<float>& values)
      : memory_(memory), n_(static_cast<int64_t>(values.size())), data_(memory.allocate(std::max<int64_t>(n_, 1))) {
    write(values);
  }
  Buffer(CommMemory& memory, int64_t n, float fill)
      : Buffer(memory, std::vector<float>(static_cast<size_t>(n), fill)) {}
  ~Buffer() { memory_.deallocate(data_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  float* data() const { return data_; }
  std::vector<float> read() const {
    std::vector<float> host(static_cast<size_t>(n_));
    if (n_ > 0) memory_.download(host.data(), data_, n_);
    return host;
  }
  void write(const std::vector<float>& values) {
    if (!values.empty()) memory_.upload(data_, values.data(), static_cast<int64_t>(values.size()));
  }

 private:
  CommMemory& memory_;
  int64_t n_;
  float* data_;
};

// n doubles in the communicator's memory, stored as 2n floats.
class DoubleBuffer {
 public:
  DoubleBuffer(CommMemory& memory, const std::vector<double>& values)
      : floats_(memory, as_floats(values)), n_(values.size()) {}
  double* data() const { return reinterpret_cast<double*>(floats_.data()); }
  std::vector<double> read() const {
    const std::vector<float> floats = floats_.read();
    std::vector<double> values(n_);
    if (n_ > 0) std::memcpy(values.data(), floats.data(), sizeof(double) * n_);
    return values;
  }

 private:
  static std::vector<float> as_floats(const std::vector<double>& values) {
    std::vector<float> floats(2 * values.size());
    if (!values.empty()) std::memcpy(floats.data(), values.data(), sizeof(double) * values.size());
    return floats;
  }
  Buffer floats_;
  size_t n_;
};

// ---- Helpers ------------------------------------------------------------------------------

std::vector<float> values(int64_t n, const std::function<float(int64_t)>& value) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = value(i);
  return v;
}

// Expects got[i] == want(i) exactly, reporting the first few differences.
void expect_values(const std::vector<float>& got, const std::function<float(int64_t)>& want, const std::string& what) {
  int reported = 0;
  for (size_t i = 0; i < got.size() && reported < 5; ++i) {
    if (got[i] != want(static_cast<int64_t>(i))) {
      ++reported;
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want(static_cast<int64_t>(i));
    }
  }
}

// The world ranks of a group's members, in the group's rank order.
std::vector<int> world_ranks_of(const CommUnderTest& t, Communicator& group) {
  Buffer mine(t.memory, {static_cast<float>(t.world.rank())});
  Buffer all(t.memory, group.size(), -1.0f);
  group.all_gather(mine.data(), all.data(), 1);
  const std::vector<float> ranks = all.read();
  return std::vector<int>(ranks.begin(), ranks.end());
}

bool no_transfers(const CommUnderTest& t) { return t.world.size() == 1 && t.self_transfers == SelfTransfers::kRefused; }

int64_t steady_nanoseconds() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---- Collectives --------------------------------------------------------------------------

void rank_and_size_name_every_rank_once(const CommUnderTest& t) {
  Communicator& c = t.world;
  EXPECT_GE(c.rank(), 0);
  EXPECT_LT(c.rank(), c.size());
  std::vector<int> expected(static_cast<size_t>(c.size()));
  for (int r = 0; r < c.size(); ++r) expected[static_cast<size_t>(r)] = r;
  EXPECT_EQ(world_ranks_of(t, c), expected);
}

void all_reduce_sums_and_averages_in_float(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int64_t n = 13;
  Buffer data(t.memory, values(n, [&](int64_t i) { return static_cast<float>(rank * 10 + i); }));
  c.all_reduce(data.data(), n, ReduceOp::kSum);
  expect_values(
      data.read(), [&](int64_t i) { return 5.0f * size * (size - 1) + size * i; }, "sum");

  // rank + 1 + i·size averages to (size + 1) / 2 + i·size, exactly.
  data.write(values(n, [&](int64_t i) { return static_cast<float>(rank + 1 + i * size); }));
  c.all_reduce(data.data(), n, ReduceOp::kAverage);
  expect_values(
      data.read(), [&](int64_t i) { return 0.5f * (size + 1) + size * i; }, "average");

  // The average is the float sum divided by size() in float: 1 / size, rounded once.
  data.write(values(n, [&](int64_t) { return rank == 0 ? 1.0f : 0.0f; }));
  c.all_reduce(data.data(), n, ReduceOp::kAverage);
  expect_values(
      data.read(), [&](int64_t) { return 1.0f / static_cast<float>(size); }, "average of one 1");

  c.all_reduce(nullptr, 0, ReduceOp::kSum);
}

void async_all_reduces_complete_in_any_order(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int64_t n = 29;
  Buffer a(t.memory, n, static_cast<float>(rank + 1)), b(t.memory, n, static_cast<float>(2 * rank));
  std::unique_ptr<Request> first = c.all_reduce_async(a.data(), n, ReduceOp::kSum);
  std::unique_ptr<Request> second = c.all_reduce_async(b.data(), n, ReduceOp::kAverage);
  c.progress();
  // A blocking collective on the same group while both are in flight.
  EXPECT_EQ(c.all_reduce_sum(static_cast<double>(rank + 1)), 0.5 * size * (size + 1));
  c.progress();
  second->wait();  // in the other order than they started
  first->wait();
  first->wait();  // a second wait returns at once
  expect_values(
      a.read(), [&](int64_t) { return 0.5f * size * (size + 1); }, "first");
  expect_values(
      b.read(), [&](int64_t) { return static_cast<float>(size - 1); }, "second");  // mean of 0, 2, 4, …

  Buffer dropped_data(t.memory, n, 1.0f);
  { std::unique_ptr<Request> dropped = c.all_reduce_async(dropped_data.data(), n, ReduceOp::kSum); }
  expect_values(
      dropped_data.read(), [&](int64_t) { return static_cast<float>(size); }, "destroyed unwaited");
  c.all_reduce_async(nullptr, 0, ReduceOp::kSum)->wait();
}

void all_reduce_sum_of_a_double_is_double(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size();
  // 1 + k·2^-30 needs 31 bits of mantissa: exact in double, lost in float.
  const double tiny = std::ldexp(1.0, -30);
  EXPECT_EQ(c.all_reduce_sum(1.0 + tiny * (c.rank() + 1)), size + tiny * 0.5 * size * (size + 1));
}

void all_reduce_sum_of_doubles_is_element_wise(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int64_t n = 19;
  const double tiny = std::ldexp(1.0, -30);
  std::vector<double> mine(n);
  for (int64_t i = 0; i < n; ++i) mine[static_cast<size_t>(i)] = static_cast<double>(i) + (rank + 1) * tiny;
  DoubleBuffer data(t.memory, mine);
  c.all_reduce_sum(data.data(), n);
  const std::vector<double> got = data.read();
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(got[static_cast<size_t>(i)], static_cast<double>(size * i) + 0.5 * size * (size + 1) * tiny) << "i=" << i;
  }
  c.all_reduce_sum(static_cast<double*>(nullptr), 0);
}

void gather_text_to_every_root(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  auto text_of = [](int r) { return std::string(static_cast<size_t>(r), 'x') + "rank " + std::to_string(r); };
  for (int root = 0; root < size; ++root) {
    const std::vector<std::string> all = c.gather_text(text_of(rank), root);
    if (rank != root) {
      EXPECT_TRUE(all.empty()) << "root " << root;
      continue;
    }
    ASSERT_EQ(all.size(), static_cast<size_t>(size));
    for (int r = 0; r < size; ++r) EXPECT_EQ(all[static_cast<size_t>(r)], text_of(r));
  }
  const std::vector<std::string> empties = c.gather_text("", 0);
  EXPECT_EQ(empties, rank == 0 ? std::vector<std::string>(static_cast<size_t>(size)) : std::vector<std::string>());
}

void all_gather_concatenates_in_rank_order(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int64_t n = 5;
  auto value = [](int r, int64_t j) { return static_cast<float>(r * 100 + j); };
  Buffer send(t.memory, values(n, [&](int64_t j) { return value(rank, j); }));
  Buffer recv(t.memory, size * n, -1.0f);
  c.all_gather(send.data(), recv.data(), n);
  expect_values(
      recv.read(), [&](int64_t i) { return value(static_cast<int>(i / n), i % n); }, "all_gather");

  // In place: this rank's block already where it belongs.
  Buffer in_place(t.memory, values(size * n, [&](int64_t i) { return i / n == rank ? value(rank, i % n) : -1.0f; }));
  c.all_gather(in_place.data() + rank * n, in_place.data(), n);
  expect_values(
      in_place.read(), [&](int64_t i) { return value(static_cast<int>(i / n), i % n); }, "in place");
}

void reduce_scatter_gives_each_rank_its_block(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int64_t n = 6;
  Buffer send(t.memory, values(size * n, [&](int64_t i) { return static_cast<float>(rank + (i / n) * 1000 + i % n); }));
  Buffer recv(t.memory, n, -1.0f);
  c.reduce_scatter(send.data(), recv.data(), n, ReduceOp::kSum);
  const float rank_sum = 0.5f * size * (size - 1);
  expect_values(
      recv.read(), [&](int64_t j) { return rank_sum + size * (rank * 1000.0f + j); }, "sum");
  c.reduce_scatter(send.data(), recv.data(), n, ReduceOp::kAverage);
  expect_values(
      recv.read(), [&](int64_t j) { return 0.5f * (size - 1) + rank * 1000.0f + j; }, "average");
}

// Several reduce-scatters and all-gathers in flight at once, in place and not, with a
// blocking collective among them, waited for in another order than they started.
void async_reduce_scatters_and_all_gathers_in_flight(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int64_t a_n = 5, b_n = 300, d_n = 1;
  auto block_value = [](int from, int64_t i) { return static_cast<float>(from + 1000 * i); };
  auto own = [&](int from, int64_t n) {
    return values(n, [&](int64_t j) { return static_cast<float>(from * 100 + j); });
  };
  Buffer a_send(t.memory, values(size * a_n, [&](int64_t i) { return block_value(rank, i); }));
  Buffer a_recv(t.memory, a_n, -1.0f);
  Buffer b_all(t.memory,
               values(size * b_n, [&](int64_t i) { return i / b_n == rank ? rank * 100.0f + i % b_n : -1.0f; }));
  Buffer d_send(t.memory, values(size * d_n, [&](int64_t i) { return block_value(rank, i); }));
  Buffer d_recv(t.memory, d_n, -1.0f);
  Buffer e_send(t.memory, own(rank, a_n));
  Buffer e_all(t.memory, size * a_n, -1.0f);

  std::unique_ptr<Request> a = c.reduce_scatter_async(a_send.data(), a_recv.data(), a_n, ReduceOp::kSum);
  std::unique_ptr<Request> b = c.all_gather_async(b_all.data() + rank * b_n, b_all.data(), b_n);  // in place
  std::unique_ptr<Request> d = c.reduce_scatter_async(d_send.data(), d_recv.data(), d_n, ReduceOp::kAverage);
  Buffer g_all(t.memory, values(size * b_n, [&](int64_t i) { return block_value(rank, i); }));
  std::unique_ptr<Request> g = c.reduce_scatter_async(g_all.data(), g_all.data() + rank * b_n, b_n, ReduceOp::kSum);
  std::unique_ptr<Request> e = c.all_gather_async(e_send.data(), e_all.data(), a_n);
  c.progress();
  // Blocking collectives on the same group while the five are in flight.
  EXPECT_EQ(c.all_reduce_sum(static_cast<double>(rank + 1)), 0.5 * size * (size + 1));
  Buffer f_recv(t.memory, a_n, -1.0f);
  c.reduce_scatter(a_send.data(), f_recv.data(), a_n, ReduceOp::kSum);
  c.progress();
  e->wait();
  b->wait();
  d->wait();
  g->wait();
  a->wait();
  a->wait();  // a second wait returns at once

  // Σ over ranks r of (r + 1000·i) at i = rank·n + j.
  const float rank_sum = 0.5f * size * (size - 1);
  auto reduced = [&](int64_t n) { return [&, n](int64_t j) { return rank_sum + size * 1000.0f * (rank * n + j); }; };
  expect_values(a_recv.read(), reduced(a_n), "reduce_scatter_async (sum)");
  expect_values(f_recv.read(), reduced(a_n), "reduce_scatter while others are in flight");
  expect_values(
      d_recv.read(), [&](int64_t j) { return reduced(d_n)(j) / static_cast<float>(size); },
      "reduce_scatter_async (average)");
  expect_values(
      b_all.read(), [&](int64_t i) { return (i / b_n) * 100.0f + i % b_n; }, "all_gather_async in place");
  const std::vector<float> g_result = g_all.read();
  expect_values(std::vector<float>(g_result.begin() + rank * b_n, g_result.begin() + (rank + 1) * b_n), reduced(b_n),
                "reduce_scatter_async in place");
  expect_values(
      e_all.read(), [&](int64_t i) { return (i / a_n) * 100.0f + i % a_n; }, "all_gather_async");

  // Destroyed without wait(): the destructor waits.
  Buffer dropped(t.memory, a_n, -1.0f);
  { std::unique_ptr<Request> r = c.reduce_scatter_async(a_send.data(), dropped.data(), a_n, ReduceOp::kSum); }
  expect_values(dropped.read(), reduced(a_n), "destroyed unwaited");
  c.reduce_scatter_async(nullptr, nullptr, 0, ReduceOp::kSum)->wait();
  c.all_gather_async(nullptr, nullptr, 0)->wait();
}

// Floats whose sums round, and at every fourth element (1, 2^24, −2^24, then small ones) a
// sum that depends on the order: ((1 + 2^24) − 2^24) = 0 in float, (2^24 − 2^24) + 1 = 1.
float rounding_value(int rank, int64_t i) {
  if (i % 4 == 0) {
    const float pattern[] = {1.0f, 16777216.0f, -16777216.0f};
    return rank < 3 ? pattern[rank] : 0.25f * static_cast<float>(rank);
  }
  const uint32_t h = (static_cast<uint32_t>(rank) + 1) * 2654435761u ^ static_cast<uint32_t>(i) * 40503u;
  return static_cast<float>(h % 100003) / 7.0f - 5000.0f;
}

// The float sum of rounding_value over ranks 0, 1, …, size − 1, in that order.
float rank_order_sum(int size, int64_t i) {
  float sum = rounding_value(0, i);
  for (int r = 1; r < size; ++r) sum += rounding_value(r, i);
  return sum;
}

// got[i] and want(i) have the same bits (== would let −0 pass for +0).
void expect_bits(const std::vector<float>& got, const std::function<float(int64_t)>& want, const std::string& what) {
  int reported = 0;
  for (size_t i = 0; i < got.size() && reported < 5; ++i) {
    const float w = want(static_cast<int64_t>(i));
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(w)) {
      ++reported;
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << w << " (bit for bit)";
    }
  }
}

// comm.h's exactness promise for MPI and the in-process group: a reduce-scatter sums in rank
// order, blocking or not, so the two agree bit for bit.
void reduce_scatter_sums_in_rank_order(const CommUnderTest& t) {
  if (t.reduce_scatter_order != ReduceScatterOrder::kRankOrder) {
    GTEST_SKIP() << "this communicator sums in an order of its own";
  }
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int64_t n = 37;  // odd, and several pieces of the small-piece MPI world
  Buffer send(t.memory, values(size * n, [&](int64_t i) { return rounding_value(rank, i); }));
  Buffer recv(t.memory, n, -1.0f);
  auto want = [&](int64_t j) { return rank_order_sum(size, rank * n + j); };
  c.reduce_scatter(send.data(), recv.data(), n, ReduceOp::kSum);
  expect_bits(recv.read(), want, "reduce_scatter");
  recv.write(std::vector<float>(n, -1.0f));
  c.reduce_scatter_async(send.data(), recv.data(), n, ReduceOp::kSum)->wait();
  expect_bits(recv.read(), want, "reduce_scatter_async");
  c.reduce_scatter_async(send.data(), recv.data(), n, ReduceOp::kAverage)->wait();
  expect_bits(
      recv.read(), [&](int64_t j) { return want(j) / static_cast<float>(size); }, "reduce_scatter_async (average)");

  // In place: this rank's block of the input becomes its result.
  Buffer in_place(t.memory, values(size * n, [&](int64_t i) { return rounding_value(rank, i); }));
  c.reduce_scatter(in_place.data(), in_place.data() + rank * n, n, ReduceOp::kSum);
  const std::vector<float> all = in_place.read();
  expect_bits(std::vector<float>(all.begin() + rank * n, all.begin() + (rank + 1) * n), want,
              "reduce_scatter in place");
  in_place.write(values(size * n, [&](int64_t i) { return rounding_value(rank, i); }));
  c.reduce_scatter_async(in_place.data(), in_place.data() + rank * n, n, ReduceOp::kSum)->wait();
  const std::vector<float> again = in_place.read();
  expect_bits(std::vector<float>(again.begin() + rank * n, again.begin() + (rank + 1) * n), want,
              "reduce_scatter_async in place");
}

// 64-bit FNV-1a of the floats' bits.
uint64_t fingerprint(const std::vector<float>& v) {
  uint64_t h = 14695981039346656037ull;
  for (float x : v) {
    const uint32_t bits = std::bit_cast<uint32_t>(x);
    for (int k = 0; k < 4; ++k) h = (h ^ ((bits >> (8 * k)) & 0xff)) * 1099511628211ull;
  }
  return h;
}

// ZeRO's round trip on floats that round: reduce-scatter, then all-gather the blocks. Every
// rank must end with the same bits (compared by fingerprint with rank 0's), and the blocking
// and async forms must agree bit for bit, in any communicator's order.
void gathered_bits_agree_on_every_rank(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int64_t n = 37;
  Buffer send(t.memory, values(size * n, [&](int64_t i) { return rounding_value(rank, i); }));
  Buffer blocking_all(t.memory, size * n, -1.0f), async_block(t.memory, n, -1.0f), async_all(t.memory, size * n, -1.0f);
  c.reduce_scatter(send.data(), blocking_all.data() + rank * n, n, ReduceOp::kAverage);
  c.all_gather(blocking_all.data() + rank * n, blocking_all.data(), n);  // in place
  std::unique_ptr<Request> rs = c.reduce_scatter_async(send.data(), async_block.data(), n, ReduceOp::kAverage);
  rs->wait();
  c.all_gather_async(async_block.data(), async_all.data(), n)->wait();
  const std::vector<float> gathered = blocking_all.read();
  expect_bits(
      async_all.read(), [&](int64_t i) { return gathered[static_cast<size_t>(i)]; }, "async against blocking");
  const uint64_t mine = fingerprint(gathered);
  uint64_t root = mine;
  c.broadcast_bytes(&root, sizeof root, 0);
  EXPECT_EQ(mine, root) << "rank " << rank << "'s all-gathered bits differ from rank 0's";
}

void broadcast_from_every_root(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int64_t n = 11;
  for (int root = 0; root < c.size(); ++root) {
    Buffer data(t.memory,
                values(n, [&](int64_t j) { return c.rank() == root ? static_cast<float>(root * 7 + j) : -1.0f; }));
    c.broadcast(data.data(), n, root);
    expect_values(
        data.read(), [&](int64_t j) { return static_cast<float>(root * 7 + j); }, "root " + std::to_string(root));
  }
}

// Bytes travel unchanged, whatever they would be as floats (an NCCL unique id).
void broadcast_bytes_from_every_root(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int64_t n = 130;  // not a multiple of 4
  for (int root = 0; root < c.size(); ++root) {
    std::vector<unsigned char> data(static_cast<size_t>(n), 0);
    if (c.rank() == root) {
      for (int64_t j = 0; j < n; ++j) data[static_cast<size_t>(j)] = static_cast<unsigned char>(255 - j - root);
    }
    c.broadcast_bytes(data.data(), n, root);
    for (int64_t j = 0; j < n; ++j) {
      EXPECT_EQ(data[static_cast<size_t>(j)], static_cast<unsigned char>(255 - j - root))
          << "root " << root << ", byte " << j;
    }
  }
  c.broadcast_bytes(nullptr, 0, 0);
}

// No rank leaves a barrier before the last one has entered it: the last rank, late on
// purpose, notes when it enters, and every rank compares that with when it left.
void barrier_waits_for_every_rank(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int last = c.size() - 1;
  c.barrier();  // lines the ranks up
  int64_t entered = 0;
  if (c.rank() == last) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    entered = steady_nanoseconds();
  }
  c.barrier();
  const int64_t left = steady_nanoseconds();
  c.broadcast_bytes(&entered, sizeof entered, last);
  EXPECT_GE(left, entered) << "rank " << c.rank() << " left the barrier " << (entered - left) / 1000
                           << " µs before the last rank entered it";
}

// ---- Point to point -----------------------------------------------------------------------

// Messages between two ranks match receives in the order both were issued, tags or not:
// receives posted in the order of the sends get the right messages, whatever order they
// are waited in, and a blocking receive among them takes its turn.
void transfers_match_in_issue_order(const CommUnderTest& t) {
  if (no_transfers(t)) GTEST_SKIP() << "a group of one without point-to-point";
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  const int tags[] = {1, 2, 1, 1, 2};
  constexpr int kMessages = 5;
  auto length = [](int k) { return int64_t{3} * (k + 1); };  // every message a different length
  auto value = [](int from, int k, int64_t j) { return static_cast<float>(from * 1000 + k * 100 + j); };
  std::vector<std::unique_ptr<Buffer>> out, in;
  std::vector<std::unique_ptr<Request>> sends, receives(kMessages);
  for (int k = 0; k < kMessages; ++k) {
    out.push_back(std::make_unique<Buffer>(t.memory, values(length(k), [&](int64_t j) { return value(rank, k, j); })));
    sends.push_back(c.send_async(out[k]->data(), length(k), right, tags[k]));
  }
  for (int k = 0; k < kMessages; ++k) {
    in.push_back(std::make_unique<Buffer>(t.memory, length(k), -1.0f));
    if (k == 2) {
      c.recv(in[k]->data(), length(k), left, tags[k]);
    } else {
      receives[k] = c.recv_async(in[k]->data(), length(k), left, tags[k]);
    }
  }
  for (int k = kMessages - 1; k >= 0; --k) {
    if (receives[k]) receives[k]->wait();
  }
  for (auto& s : sends) s->wait();
  for (int k = 0; k < kMessages; ++k) {
    expect_values(
        in[k]->read(), [&](int64_t j) { return value(left, k, j); }, "message " + std::to_string(k));
  }
}

// MPI and the in-process group match by tag too: receives in the other order than the sends.
void tags_tell_transfers_apart(const CommUnderTest& t) {
  if (no_transfers(t)) GTEST_SKIP() << "a group of one without point-to-point";
  if (t.tags == TagMatching::kIssueOrderOnly) GTEST_SKIP() << "this communicator matches by issue order only";
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  const int64_t n = 9;
  Buffer first(t.memory, n, static_cast<float>(rank)), second(t.memory, n, static_cast<float>(rank + 1000));
  std::unique_ptr<Request> s1 = c.send_async(first.data(), n, right, 1);
  std::unique_ptr<Request> s2 = c.send_async(second.data(), n, right, 2);
  Buffer got2(t.memory, n, -1.0f), got1(t.memory, n, -1.0f);
  c.recv(got2.data(), n, left, 2);
  c.recv(got1.data(), n, left, 1);
  s1->wait();
  s2->wait();
  expect_values(
      got1.read(), [&](int64_t) { return static_cast<float>(left); }, "tag 1");
  expect_values(
      got2.read(), [&](int64_t) { return static_cast<float>(left + 1000); }, "tag 2");
}

// Blocking transfers: a token goes round the ring, each rank adding its rank.
void blocking_transfers_around_a_ring(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  if (size == 1) GTEST_SKIP() << "a ring of blocking transfers needs two ranks";
  const int64_t n = 17;
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  Buffer token(t.memory, values(n, [](int64_t j) { return static_cast<float>(j); }));
  if (rank == 0) {
    c.send(token.data(), n, right, 100);
    c.recv(token.data(), n, left, 100 + size - 1);
    expect_values(
        token.read(), [&](int64_t j) { return j + 0.5f * size * (size - 1); }, "back at rank 0");
  } else {
    c.recv(token.data(), n, left, 100 + rank - 1);
    std::vector<float> got = token.read();
    expect_values(
        got, [&](int64_t j) { return j + 0.5f * rank * (rank - 1); }, "at rank " + std::to_string(rank));
    for (float& x : got) x += static_cast<float>(rank);
    token.write(got);
    c.send(token.data(), n, right, 100 + rank);
  }
}

void async_exchange_with_every_rank(const CommUnderTest& t) {
  if (no_transfers(t)) GTEST_SKIP() << "a group of one without point-to-point";
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int64_t n = 10;
  auto value = [](int from, int to, int64_t j) { return static_cast<float>(from * 1000 + to * 10 + j); };
  std::vector<std::unique_ptr<Buffer>> to, from;
  std::vector<std::unique_ptr<Request>> requests;
  for (int peer = 0; peer < size; ++peer) {  // itself included
    to.push_back(std::make_unique<Buffer>(t.memory, values(n, [&](int64_t j) { return value(rank, peer, j); })));
    from.push_back(std::make_unique<Buffer>(t.memory, n, -1.0f));
    requests.push_back(c.recv_async(from[peer]->data(), n, peer, 7));
  }
  for (int peer = size - 1; peer >= 0; --peer) requests.push_back(c.send_async(to[peer]->data(), n, peer, 7));
  // Half are waited for explicitly, the rest by their destructors.
  for (size_t i = 0; i < requests.size(); i += 2) requests[i]->wait();
  requests.clear();
  for (int peer = 0; peer < size; ++peer) {
    expect_values(
        from[peer]->read(), [&](int64_t j) { return value(peer, rank, j); }, "from rank " + std::to_string(peer));
  }
}

// Nothing to move, on every operation that takes a count.
void empty_operations(const CommUnderTest& t) {
  Communicator& c = t.world;
  c.all_reduce(nullptr, 0, ReduceOp::kAverage);
  c.all_reduce_async(nullptr, 0, ReduceOp::kSum)->wait();
  c.all_reduce_sum(static_cast<double*>(nullptr), 0);
  c.all_gather(nullptr, nullptr, 0);
  c.reduce_scatter(nullptr, nullptr, 0, ReduceOp::kSum);
  c.all_gather_async(nullptr, nullptr, 0)->wait();
  c.reduce_scatter_async(nullptr, nullptr, 0, ReduceOp::kAverage)->wait();
  c.broadcast(nullptr, 0, c.size() - 1);
  c.broadcast_bytes(nullptr, 0, c.size() - 1);
  if (no_transfers(t)) return;
  const int right = (c.rank() + 1) % c.size(), left = (c.rank() + c.size() - 1) % c.size();
  std::unique_ptr<Request> r = c.recv_async(nullptr, 0, left, 3);
  c.send_async(nullptr, 0, right, 3)->wait();
  r->wait();
}

// Buffers of 64 KiB and more (past the eager limits of MPI's transports, so they take the
// rendezvous path), reduced and passed round the ring.
void large_buffers(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  const int64_t n = (int64_t{1} << 14) + 3;
  Buffer data(t.memory, values(n, [&](int64_t i) { return static_cast<float>(i % 4096 + rank); }));
  c.all_reduce(data.data(), n, ReduceOp::kSum);
  expect_values(
      data.read(), [&](int64_t i) { return static_cast<float>(size * (i % 4096) + size * (size - 1) / 2); }, "sum");
  if (no_transfers(t)) return;
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  Buffer out(t.memory, values(n, [&](int64_t i) { return static_cast<float>(rank * 8192 + i % 8192); }));
  Buffer in(t.memory, n, -1.0f);
  std::unique_ptr<Request> sent = c.send_async(out.data(), n, right, 9);
  std::unique_ptr<Request> received = c.recv_async(in.data(), n, left, 9);
  received->wait();
  sent->wait();
  expect_values(
      in.read(), [&](int64_t i) { return static_cast<float>(left * 8192 + i % 8192); }, "from the left");
}

// ---- Groups -------------------------------------------------------------------------------

void split_groups_by_color_ordered_by_key(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  // Colors by parity; keys reverse the order.
  std::unique_ptr<Communicator> parity = c.split(rank % 2, size - rank);
  std::vector<int> expected;
  for (int r = size - 1; r >= 0; --r) {
    if (r % 2 == rank % 2) expected.push_back(r);
  }
  EXPECT_EQ(parity->size(), static_cast<int>(expected.size()));
  EXPECT_EQ(world_ranks_of(t, *parity), expected);
  if (parity->rank() < static_cast<int>(expected.size())) {
    EXPECT_EQ(expected[static_cast<size_t>(parity->rank())], rank);
  }
  Buffer ones(t.memory, 4, 1.0f);
  parity->all_reduce(ones.data(), 4, ReduceOp::kSum);
  expect_values(
      ones.read(), [&](int64_t) { return static_cast<float>(expected.size()); }, "sum over the group");

  // Equal keys keep the parent's order; a split group splits again, into groups of one.
  std::unique_ptr<Communicator> all = c.split(0, 0);
  EXPECT_EQ(all->rank(), rank);
  EXPECT_EQ(all->size(), size);
  std::unique_ptr<Communicator> alone = all->split(rank, 0);
  EXPECT_EQ(alone->size(), 1);
  EXPECT_EQ(alone->rank(), 0);
  EXPECT_EQ(alone->all_reduce_sum(2.5), 2.5);
}

void process_groups_for_every_layout_that_fits(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  for (int stages = 1; stages <= size; ++stages) {
    for (int shards = 1; shards <= size; ++shards) {
      if (size % (stages * shards) != 0) continue;
      SCOPED_TRACE("P=" + std::to_string(stages) + " T=" + std::to_string(shards));
      Result<ProcessLayout> layout = ProcessLayout::for_rank(rank, size, stages, shards);
      ASSERT_TRUE(layout.is_ok()) << layout.status().message();
      const ProcessLayout& l = *layout;
      ProcessGroups groups = make_process_groups(c, l);
      EXPECT_EQ(groups.layout.rank_of(groups.layout.stage, groups.layout.replica, groups.layout.shard), rank);
      EXPECT_EQ(groups.data->rank(), l.replica);
      EXPECT_EQ(groups.tensor->rank(), l.shard);
      EXPECT_EQ(groups.pipeline->rank(), l.stage);
      std::vector<int> data_members, tensor_members, pipeline_members;
      for (int d = 0; d < l.replicas; ++d) data_members.push_back(l.rank_of(l.stage, d, l.shard));
      for (int s = 0; s < l.shards; ++s) tensor_members.push_back(l.rank_of(l.stage, l.replica, s));
      for (int p = 0; p < l.stages; ++p) pipeline_members.push_back(l.rank_of(p, l.replica, l.shard));
      EXPECT_EQ(world_ranks_of(t, *groups.data), data_members);
      EXPECT_EQ(world_ranks_of(t, *groups.tensor), tensor_members);
      EXPECT_EQ(world_ranks_of(t, *groups.pipeline), pipeline_members);
    }
  }
}

// An async all-reduce on the world stays in flight while a split group works.
void groups_work_side_by_side(const CommUnderTest& t) {
  Communicator& c = t.world;
  const int size = c.size(), rank = c.rank();
  std::unique_ptr<Communicator> parity = c.split(rank % 2, rank);
  Buffer world_data(t.memory, 8, 1.0f);
  std::unique_ptr<Request> pending = c.all_reduce_async(world_data.data(), 8, ReduceOp::kSum);
  Buffer group_data(t.memory, 8, static_cast<float>(rank));
  parity->all_reduce(group_data.data(), 8, ReduceOp::kSum);
  float same_parity_sum = 0;
  for (int r = rank % 2; r < size; r += 2) same_parity_sum += static_cast<float>(r);
  EXPECT_EQ(parity->all_reduce_sum(1.0), static_cast<double>(parity->size()));
  pending->wait();
  expect_values(
      group_data.read(), [&](int64_t) { return same_parity_sum; }, "group");
  expect_values(
      world_data.read(), [&](int64_t) { return static_cast<float>(size); }, "world");
}

class ConformanceTest : public ::testing::Test {
 public:
  explicit ConformanceTest(std::function<void()> body) : body_(std::move(body)) {}
  void TestBody() override { body_(); }

 private:
  std::function<void()> body_;
};

}  // namespace

std::unique_ptr<CommMemory> make_host_comm_memory() { return std::make_unique<HostCommMemory>(); }

std::unique_ptr<CommMemory> make_backend_comm_memory(Backend& backend) {
  return std::make_unique<BackendCommMemory>(backend);
}

const std::vector<ConformanceCase>& comm_conformance_cases() {
  static const std::vector<ConformanceCase> cases = {
      {"RankAndSizeNameEveryRankOnce", rank_and_size_name_every_rank_once},
      {"AllReduceSumsAndAveragesInFloat", all_reduce_sums_and_averages_in_float},
      {"AsyncAllReducesCompleteInAnyOrder", async_all_reduces_complete_in_any_order},
      {"AllReduceSumOfADoubleIsDouble", all_reduce_sum_of_a_double_is_double},
      {"AllReduceSumOfDoublesIsElementWise", all_reduce_sum_of_doubles_is_element_wise},
      {"GatherTextToEveryRoot", gather_text_to_every_root},
      {"AllGatherConcatenatesInRankOrder", all_gather_concatenates_in_rank_order},
      {"ReduceScatterGivesEachRankItsBlock", reduce_scatter_gives_each_rank_its_block},
      {"AsyncReduceScattersAndAllGathersInFlight", async_reduce_scatters_and_all_gathers_in_flight},
      {"ReduceScatterSumsInRankOrder", reduce_scatter_sums_in_rank_order},
      {"GatheredBitsAgreeOnEveryRank", gathered_bits_agree_on_every_rank},
      {"BroadcastFromEveryRoot", broadcast_from_every_root},
      {"BroadcastBytesFromEveryRoot", broadcast_bytes_from_every_root},
      {"BarrierWaitsForEveryRank", barrier_waits_for_every_rank},
      {"TransfersMatchInIssueOrder", transfers_match_in_issue_order},
      {"TagsTellTransfersApart", tags_tell_transfers_apart},
      {"BlockingTransfersAroundARing", blocking_transfers_around_a_ring},
      {"AsyncExchangeWithEveryRank", async_exchange_with_every_rank},
      {"EmptyOperations", empty_operations},
      {"LargeBuffers", large_buffers},
      {"SplitGroupsByColorOrderedByKey", split_groups_by_color_ordered_by_key},
      {"ProcessGroupsForEveryLayoutThatFits", process_groups_for_every_layout_that_fits},
      {"GroupsWorkSideBySide", groups_work_side_by_side},
  };
  return cases;
}

void register_comm_conformance_tests(const std::string& suite,
                                     const std::function<void(const ConformanceCase&)>& run_case) {
  for (const ConformanceCase& c : comm_conformance_cases()) {
    ::testing::RegisterTest(suite.c_str(), c.name, nullptr, nullptr, __FILE__, __LINE__,
                            [run_case, c]() { return new ConformanceTest([run_case, c] { run_case(c); }); });
  }
}

}  // namespace pipeshard
