// The MPI communicator under mpiexec: every test runs on every rank, with expected values
// that depend on the rank, so a wrong order or a missing contribution shows. Registered
// in tests/CMakeLists.txt for -np 1, 2, 4 and 6 (label "mpi"); not a *_test.cc, because
// those run without a launcher.
//
// Each test runs three times: on the world as make_world_communicator() gives it, on a
// world that moves at most kSmallPiece floats per MPI call, which sends every buffer of
// these tests through the piece-by-piece path that real runs take only above INT_MAX
// floats, and on the world staged over the CPU backend (comm/comm_staged.h: what
// GPU processes use, every buffer copied through the backend's download and upload).
//
// Then the Communicator conformance suite (testing/comm_conformance.h), which every
// communicator runs, on the same three: MpiConformance, MpiSmallPiecesConformance and
// MpiStagedConformance (over the CPU backend's memory).
//
// Only rank 0 prints GoogleTest's report; other ranks print their failures prefixed with
// their rank. Every rank exits non-zero when a test failed on any rank.
//
// `--abort-mode=abort|truncate|short|exit|exit0|mismatch` runs one failure instead of the
// tests: one rank fails while the others wait in a barrier, and the job must end rather
// than hang. exit0 leaves with status 0 while still holding the world (as a library's
// exit() would); mismatch has rank 0 all-reduce while the last rank waits for a message,
// which only the watchdog (comm/watchdog.h, armed at 2 s) ends.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "comm/comm_mpi.h"
#include "comm/comm_staged.h"
#include "comm/watchdog.h"
#include "testing/comm_conformance.h"

namespace pipeshard {
namespace {

constexpr int64_t kSmallPiece = 7;  // ≥ the largest -np, which a piece must hold once per rank

Communicator* g_world = nullptr;         // make_world_communicator()
Communicator* g_small_pieces = nullptr;  // the same ranks, kSmallPiece floats per MPI call
Communicator* g_staged = nullptr;        // g_world staged over the CPU backend

enum class Transport { kWhole, kSmallPieces, kStaged };

class CommTest : public ::testing::TestWithParam<Transport> {
 protected:
  Communicator& comm() {
    switch (GetParam()) {
      case Transport::kWhole: return *g_world;
      case Transport::kSmallPieces: return *g_small_pieces;
      case Transport::kStaged: return *g_staged;
    }
    return *g_world;
  }
};

void PrintTo(Transport transport, std::ostream* out) {
  *out << (transport == Transport::kWhole         ? "whole buffers"
           : transport == Transport::kSmallPieces ? "small pieces"
                                                  : "staged over the CPU backend");
}

std::string transport_name(const ::testing::TestParamInfo<Transport>& info) {
  return info.param == Transport::kWhole ? "Whole" : info.param == Transport::kSmallPieces ? "SmallPieces" : "Staged";
}

// The world ranks of a group's members, in the group's rank order.
std::vector<int> world_ranks_of(Communicator& group) {
  const float mine = static_cast<float>(g_world->rank());
  std::vector<float> all(group.size());
  group.all_gather(&mine, all.data(), 1);
  return std::vector<int>(all.begin(), all.end());
}

// ---- Collectives --------------------------------------------------------------------------

TEST_P(CommTest, AllReduceSumAndAverage) {
  Communicator& c = comm();
  const int size = c.size(), rank = c.rank();
  const int64_t n = 13;
  std::vector<float> data(n);
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>(rank * 10 + i);
  c.all_reduce(data.data(), n, ReduceOp::kSum);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(data[i], 5.0f * size * (size - 1) + size * i) << "i=" << i;

  // rank + 1 + i·size averages to (size + 1) / 2 + i·size, exactly.
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>(rank + 1 + i * size);
  c.all_reduce(data.data(), n, ReduceOp::kAverage);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(data[i], 0.5f * (size + 1) + size * i) << "i=" << i;

  c.all_reduce(nullptr, 0, ReduceOp::kSum);  // nothing to do, on every rank alike
}

TEST_P(CommTest, AsyncAllReduceOverlapsOtherWork) {
  Communicator& c = comm();
  const int size = c.size(), rank = c.rank();
  const int64_t n = 29;
  std::vector<float> a(n, static_cast<float>(rank + 1)), b(n, static_cast<float>(2 * rank));
  std::unique_ptr<Request> first = c.all_reduce_async(a.data(), n, ReduceOp::kSum);
  std::unique_ptr<Request> second = c.all_reduce_async(b.data(), n, ReduceOp::kAverage);
  // Work while both are in flight: arithmetic, and a blocking collective on the same group.
  double local = 0;
  for (int i = 1; i <= 100000; ++i) local += 1.0 / i;
  EXPECT_DOUBLE_EQ(c.all_reduce_sum(local), size * local);
  second->wait();  // in the other order than they started
  first->wait();
  first->wait();  // a second wait is harmless
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(a[i], 0.5f * size * (size + 1));
    EXPECT_EQ(b[i], static_cast<float>(size - 1));  // mean of 0, 2, 4, …
  }

  // A request destroyed unfinished waits for its operation.
  std::vector<float> c_data(n, 1.0f);
  { std::unique_ptr<Request> dropped = c.all_reduce_async(c_data.data(), n, ReduceOp::kSum); }
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(c_data[i], static_cast<float>(size));
}

TEST_P(CommTest, AllReduceSumIsDouble) {
  Communicator& c = comm();
  const int size = c.size();
  // 1 + 1e-10 has no float32 neighbour closer than 1 ± 6e-8.
  const double sum = c.all_reduce_sum(1.0 + 1e-10 * (c.rank() + 1));
  EXPECT_NEAR(sum, size + 1e-10 * size * (size + 1) / 2, 1e-13);
  EXPECT_NE(sum, static_cast<double>(size));
}

TEST_P(CommTest, GatherTextToEveryRoot) {
  Communicator& c = comm();
  const int size = c.size(), rank = c.rank();
  const std::string mine = std::string(static_cast<size_t>(rank), 'x') + "rank " + std::to_string(rank);
  for (int root = 0; root < size; ++root) {
    const std::vector<std::string> all = c.gather_text(mine, root);
    if (rank != root) {
      EXPECT_TRUE(all.empty());
      continue;
    }
    ASSERT_EQ(all.size(), static_cast<size_t>(size));
    for (int r = 0; r < size; ++r)
      EXPECT_EQ(all[r], std::string(static_cast<size_t>(r), 'x') + "rank " + std::to_string(r));
  }
  EXPECT_EQ(c.gather_text("", 0).size(), rank == 0 ? static_cast<size_t>(size) : 0u);
}

TEST_P(CommTest, AllReduceSumOfDoubleArraysIsElementWiseAndExact) {
  Communicator& c = comm();
  const int size = c.size(), rank = c.rank();
  // i + (rank + 1)·2^-30 needs 38 bits of mantissa: exact in double, rounded in float. 19
  // elements go through several pieces of kSmallPiece.
  const int64_t n = 19;
  const double tiny = std::ldexp(1.0, -30);
  std::vector<double> data(n);
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<double>(i) + (rank + 1) * tiny;
  c.all_reduce_sum(data.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_EQ(data[i], static_cast<double>(size * i) + 0.5 * size * (size + 1) * tiny) << "i=" << i;
  }
  c.all_reduce_sum(static_cast<double*>(nullptr), 0);  // nothing to do, on every rank alike
}

TEST_P(CommTest, AllGatherConcatenatesInRankOrder) {
  Communicator& c = comm();
  const int size = c.size(), rank = c.rank();
  const int64_t n = 5;
  std::vector<float> send(n), recv(size * n, -1.0f);
  for (int64_t j = 0; j < n; ++j) send[j] = static_cast<float>(rank * 100 + j);
  c.all_gather(send.data(), recv.data(), n);
  for (int r = 0; r < size; ++r) {
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(recv[r * n + j], r * 100 + j) << "block " << r;
  }

  // In place: this rank's block already where it belongs in recv.
  std::vector<float> in_place(size * n, -1.0f);
  std::copy(send.begin(), send.end(), in_place.begin() + rank * n);
  c.all_gather(in_place.data() + rank * n, in_place.data(), n);
  EXPECT_EQ(in_place, recv);
}

TEST_P(CommTest, ReduceScatterGivesEachRankItsBlock) {
  Communicator& c = comm();
  const int size = c.size(), rank = c.rank();
  const int64_t n = 6;
  std::vector<float> send(size * n), recv(n, -1.0f);
  for (int b = 0; b < size; ++b) {
    for (int64_t j = 0; j < n; ++j) send[b * n + j] = static_cast<float>(rank + b * 1000 + j);
  }
  c.reduce_scatter(send.data(), recv.data(), n, ReduceOp::kSum);
  const float rank_sum = 0.5f * size * (size - 1);
  for (int64_t j = 0; j < n; ++j) EXPECT_EQ(recv[j], rank_sum + size * (rank * 1000.0f + j)) << "j=" << j;

  c.reduce_scatter(send.data(), recv.data(), n, ReduceOp::kAverage);
  for (int64_t j = 0; j < n; ++j) EXPECT_EQ(recv[j], 0.5f * (size - 1) + rank * 1000.0f + j) << "j=" << j;
}

// Reduce-scatter and all-gather go by direct exchange over point-to-point, in messages of
// at most the per-call limit: block sizes below, at and above kSmallPiece, none a multiple
// of it but one, blocking and async, in place and not.
TEST_P(CommTest, ReduceScatterAndAllGatherAtAwkwardSizes) {
  Communicator& c = comm();
  const int size = c.size(), rank = c.rank();
  for (int64_t n : {int64_t{1}, int64_t{6}, kSmallPiece, kSmallPiece + 1, int64_t{13}, int64_t{50}}) {
    for (bool async : {false, true}) {
      SCOPED_TRACE("n=" + std::to_string(n) + (async ? ", async" : ", blocking"));
      std::vector<float> send(size * n), recv(n, -1.0f);
      for (int64_t i = 0; i < size * n; ++i) send[i] = static_cast<float>(rank + 10 * i);
      if (async) {
        c.reduce_scatter_async(send.data(), recv.data(), n, ReduceOp::kSum)->wait();
      } else {
        c.reduce_scatter(send.data(), recv.data(), n, ReduceOp::kSum);
      }
      for (int64_t j = 0; j < n; ++j) EXPECT_EQ(recv[j], 0.5f * size * (size - 1) + 10.0f * size * (rank * n + j));
      std::vector<float> reduced_in_place = send;  // recv = send + rank·n
      if (async) {
        c.reduce_scatter_async(reduced_in_place.data(), reduced_in_place.data() + rank * n, n, ReduceOp::kSum)->wait();
      } else {
        c.reduce_scatter(reduced_in_place.data(), reduced_in_place.data() + rank * n, n, ReduceOp::kSum);
      }
      EXPECT_TRUE(std::equal(recv.begin(), recv.end(), reduced_in_place.begin() + rank * n)) << "in place";

      std::vector<float> gathered(size * n, -1.0f), in_place(size * n, -1.0f);
      for (int64_t j = 0; j < n; ++j) in_place[rank * n + j] = recv[j];
      if (async) {
        std::unique_ptr<Request> out = c.all_gather_async(recv.data(), gathered.data(), n);
        c.all_gather_async(in_place.data() + rank * n, in_place.data(), n)->wait();
        out->wait();
      } else {
        c.all_gather(recv.data(), gathered.data(), n);
        c.all_gather(in_place.data() + rank * n, in_place.data(), n);
      }
      for (int64_t i = 0; i < size * n; ++i) EXPECT_EQ(gathered[i], 0.5f * size * (size - 1) + 10.0f * size * i);
      EXPECT_EQ(in_place, gathered);
    }
  }
}

TEST_P(CommTest, BroadcastFromEveryRoot) {
  Communicator& c = comm();
  const int64_t n = 11;
  for (int root = 0; root < c.size(); ++root) {
    std::vector<float> data(n, -1.0f);
    if (c.rank() == root) {
      for (int64_t j = 0; j < n; ++j) data[j] = static_cast<float>(root * 7 + j);
    }
    c.broadcast(data.data(), n, root);
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(data[j], root * 7 + j) << "root " << root;
  }
}

// Bytes travel unchanged, whatever their value as floats would be (an NCCL unique id).
TEST_P(CommTest, BroadcastBytesFromEveryRoot) {
  Communicator& c = comm();
  const int64_t n = 130;  // not a multiple of 4, and more than one piece of kSmallPiece
  for (int root = 0; root < c.size(); ++root) {
    std::vector<unsigned char> data(n, 0);
    if (c.rank() == root) {
      for (int64_t j = 0; j < n; ++j) data[j] = static_cast<unsigned char>(255 - j - root);
    }
    c.broadcast_bytes(data.data(), n, root);
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(data[j], static_cast<unsigned char>(255 - j - root)) << "root " << root;
  }
  c.broadcast_bytes(nullptr, 0, 0);
}

TEST_P(CommTest, BarrierWaitsForTheLastRank) {
  Communicator& c = comm();
  if (c.size() == 1) {
    c.barrier();
    return;
  }
  // The last rank arrives 300 ms late; everyone else must wait for it. The ranks leave the
  // previous test at different times (10 ms and more under the sanitizers, with more ranks
  // than cores), so a first barrier lines them up; the margin is for the skew with which
  // they leave it. A barrier that did not wait would return at once.
  c.barrier();
  const auto start = std::chrono::steady_clock::now();
  if (c.rank() == c.size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  c.barrier();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(waited, 0.2);
}

// ---- Point to point -----------------------------------------------------------------------

TEST_P(CommTest, TokenRingWithTags) {
  Communicator& c = comm();
  const int size = c.size(), rank = c.rank();
  if (size == 1) GTEST_SKIP() << "a ring of blocking transfers needs two ranks";
  const int64_t n = 17;
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  // The token leaves rank 0 as 0, 1, 2, …; each rank adds its rank and passes it on. The
  // hop is the tag.
  std::vector<float> token(n);
  if (rank == 0) {
    std::iota(token.begin(), token.end(), 0.0f);
    c.send(token.data(), n, right, 100);
    c.recv(token.data(), n, left, 100 + size - 1);
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(token[j], j + 0.5f * size * (size - 1)) << "j=" << j;
  } else {
    c.recv(token.data(), n, left, 100 + rank - 1);
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(token[j], j + 0.5f * rank * (rank - 1)) << "j=" << j;
    for (float& x : token) x += static_cast<float>(rank);
    c.send(token.data(), n, right, 100 + rank);
  }
}

TEST_P(CommTest, TagsTellTransfersApart) {
  Communicator& c = comm();
  const int size = c.size(), rank = c.rank();
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  const int64_t n = 9;
  std::vector<float> first(n, static_cast<float>(rank)), second(n, static_cast<float>(rank + 1000));
  std::unique_ptr<Request> s1 = c.send_async(first.data(), n, right, 1);
  std::unique_ptr<Request> s2 = c.send_async(second.data(), n, right, 2);
  // Received in the other order than sent: the tags match them up.
  std::vector<float> got2(n), got1(n);
  c.recv(got2.data(), n, left, 2);
  c.recv(got1.data(), n, left, 1);
  s1->wait();
  s2->wait();
  EXPECT_EQ(got1, std::vector<float>(n, static_cast<float>(left)));
  EXPECT_EQ(got2, std::vector<float>(n, static_cast<float>(left + 1000)));
}

TEST_P(CommTest, AsyncExchangeWithEveryRank) {
  Communicator& c = comm();
  const int size = c.size(), rank = c.rank();
  const int64_t n = 10;
  std::vector<std::vector<float>> to(size, std::vector<float>(n)), from(size, std::vector<float>(n, -1.0f));
  std::vector<std::unique_ptr<Request>> requests;
  for (int peer = 0; peer < size; ++peer) {  // self included
    for (int64_t j = 0; j < n; ++j) to[peer][j] = static_cast<float>(rank * 1000 + peer * 10 + j);
    requests.push_back(c.recv_async(from[peer].data(), n, peer, 7));
  }
  for (int peer = size - 1; peer >= 0; --peer) requests.push_back(c.send_async(to[peer].data(), n, peer, 7));
  // Half are waited for explicitly, the rest by their destructors.
  for (size_t i = 0; i < requests.size(); i += 2) requests[i]->wait();
  requests.clear();
  for (int peer = 0; peer < size; ++peer) {
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(from[peer][j], peer * 1000 + rank * 10 + j) << "from " << peer;
  }
}

TEST_P(CommTest, EmptyTransfers) {
  Communicator& c = comm();
  const int right = (c.rank() + 1) % c.size(), left = (c.rank() + c.size() - 1) % c.size();
  std::unique_ptr<Request> r = c.recv_async(nullptr, 0, left, 3);
  c.send_async(nullptr, 0, right, 3)->wait();
  r->wait();
  std::vector<float> none;
  c.all_gather(none.data(), none.data(), 0);
  c.broadcast(none.data(), 0, 0);
}

// ---- Groups -------------------------------------------------------------------------------

TEST_P(CommTest, SplitGroupsByColorOrderedByKey) {
  Communicator& c = comm();
  const int size = c.size(), rank = c.rank();
  // Colors by parity; keys reverse the order.
  std::unique_ptr<Communicator> group = c.split(rank % 2, size - rank);
  std::vector<int> expected;
  for (int r = size - 1; r >= 0; --r) {
    if (r % 2 == rank % 2) expected.push_back(r);
  }
  EXPECT_EQ(group->size(), static_cast<int>(expected.size()));
  EXPECT_EQ(world_ranks_of(*group), expected);
  EXPECT_EQ(expected[group->rank()], rank);
  EXPECT_EQ(group->all_reduce_sum(1.0), static_cast<double>(expected.size()));

  // Equal keys keep the parent's order; a group split again.
  std::unique_ptr<Communicator> all = c.split(0, 0);
  EXPECT_EQ(all->rank(), rank);
  std::unique_ptr<Communicator> alone = all->split(rank, 0);
  EXPECT_EQ(alone->size(), 1);
  EXPECT_EQ(alone->rank(), 0);
}

INSTANTIATE_TEST_SUITE_P(Mpi, CommTest,
                         ::testing::Values(Transport::kWhole, Transport::kSmallPieces, Transport::kStaged),
                         transport_name);

// ---- A large message, whole ---------------------------------------------------------------

TEST(LargeMessageTest, FourMillionFloats) {
  Communicator& c = *g_world;
  const int size = c.size(), rank = c.rank();
  const int64_t n = int64_t{4} << 20;
  std::vector<float> data(n);
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>(i % 4096 + rank);
  c.all_reduce(data.data(), n, ReduceOp::kSum);
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += data[i] != static_cast<float>(size * (i % 4096) + size * (size - 1) / 2);
  EXPECT_EQ(wrong, 0);

  // Around the ring, asynchronously both ways at once.
  const int right = (rank + 1) % size, left = (rank + size - 1) % size;
  std::vector<float> out(n), in(n, -1.0f);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(rank * 8192 + i % 8192);
  std::unique_ptr<Request> receive = c.recv_async(in.data(), n, left, 9);
  c.send_async(out.data(), n, right, 9)->wait();
  receive->wait();
  wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += in[i] != static_cast<float>(left * 8192 + i % 8192);
  EXPECT_EQ(wrong, 0);
}

// Making a world communicator is local: a rank makes one when it needs one (the Python
// package's world_size() on rank 0 alone). The duplicate that reduce-scatters and all-gathers
// use is made by the first of them, a collective call, not by the constructor.
TEST(WorldTest, OneRankAloneMakesAWorld) {
  if (g_world->rank() == 0) {
    std::unique_ptr<Communicator> alone = make_mpi_world_communicator(kMaxMpiCount);
    EXPECT_EQ(alone->size(), g_world->size());
  }
  g_world->barrier();
}

// Reduce-scatters travel in messages of 4 MiB (comm_mpi.cc): blocks of one such chunk and
// 3 floats, so the last is short, several in flight, exact sums and averages.
TEST(LargeMessageTest, ReduceScatterAndAllGatherAcrossChunks) {
  Communicator& c = *g_world;
  const int size = c.size(), rank = c.rank();
  const int64_t n = (int64_t{1} << 20) + 3, total = size * n;
  std::vector<float> send(total), summed(n, -1.0f), averaged(n, -1.0f), gathered(total, -1.0f);
  for (int64_t i = 0; i < total; ++i) send[i] = static_cast<float>(i % 4096 + rank);
  // rank + 1 + i·size averages to (size + 1)/2 + i·size exactly; its sum needs no rounding either.
  std::vector<float> spread(total);
  for (int64_t i = 0; i < total; ++i) spread[i] = static_cast<float>(rank + 1 + (i % 1024) * size);
  std::unique_ptr<Request> sum = c.reduce_scatter_async(send.data(), summed.data(), n, ReduceOp::kSum);
  std::unique_ptr<Request> average = c.reduce_scatter_async(spread.data(), averaged.data(), n, ReduceOp::kAverage);
  c.progress();
  average->wait();
  sum->wait();
  int64_t wrong_sums = 0, wrong_averages = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = rank * n + j;
    wrong_sums += summed[j] != static_cast<float>(size * (i % 4096) + size * (size - 1) / 2);
    wrong_averages += averaged[j] != 0.5f * (size + 1) + static_cast<float>((i % 1024) * size);
  }
  EXPECT_EQ(wrong_sums, 0);
  EXPECT_EQ(wrong_averages, 0);

  std::copy(summed.begin(), summed.end(), gathered.begin() + rank * n);
  c.all_gather(gathered.data() + rank * n, gathered.data(), n);
  int64_t wrong = 0;
  for (int64_t i = 0; i < total; ++i)
    wrong += gathered[i] != static_cast<float>(size * (i % 4096) + size * (size - 1) / 2);
  EXPECT_EQ(wrong, 0);
}

// ---- Runner -------------------------------------------------------------------------------

// On ranks other than 0: failures only, each line marked with the rank.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.message());
  }

 private:
  int rank_;
};

// One rank fails in the way `mode` names while the others wait in a barrier.
int run_failure(Communicator& world, const std::string& mode) {
  const int last = world.size() - 1;
  if (world.size() < 2) {
    std::fprintf(stderr, "comm_mpi_test: --abort-mode needs two ranks\n");
    return 2;
  }
  std::vector<float> buffer(10, 1.0f);
  world.barrier();  // every rank up and running
  if (mode == "abort") {
    if (world.rank() == last) world.abort("comm_mpi_test: rank " + std::to_string(last) + " gives up");
  } else if (mode == "truncate" || mode == "short") {
    // Rank 0 sends 10 floats; the last rank expects 5 (truncated) or 20 (short).
    if (world.rank() == 0) world.send(buffer.data(), 10, last, 3);
    if (world.rank() == last) {
      buffer.resize(20);
      world.recv(buffer.data(), mode == "truncate" ? 5 : 20, 0, 3);
    }
  } else if (mode == "exit") {
    if (world.rank() == last) {
      std::fprintf(stderr, "comm_mpi_test: rank %d exits with status 2\n", last);
      return 2;
    }
  } else if (mode == "exit0") {
    if (world.rank() == last) std::exit(0);
  } else if (mode == "mismatch") {
    watchdog_arm(2, "comm_mpi_test", "rank " + std::to_string(world.rank()));
    if (world.rank() == last) {
      world.recv(buffer.data(), 10, 0, 3);
    } else {
      world.all_reduce(buffer.data(), 10, ReduceOp::kSum);
    }
  } else {
    std::fprintf(stderr, "comm_mpi_test: unknown --abort-mode '%s'\n", mode.c_str());
    return 2;
  }
  world.barrier();  // the failing rank never gets here
  std::fprintf(stderr, "comm_mpi_test: rank %d passed the barrier (the job should have ended)\n", world.rank());
  return 0;
}

}  // namespace
}  // namespace pipeshard

int main(int argc, char** argv) {
  using namespace pipeshard;
  ::testing::InitGoogleTest(&argc, argv);
  if (!launched_by_mpi()) {
    std::fprintf(stderr, "comm_mpi_test: run me under mpiexec (ctest -L mpi does)\n");
    return 2;
  }
  std::unique_ptr<Communicator> world = make_world_communicator();
  const std::string kModeFlag = "--abort-mode=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], kModeFlag.c_str(), kModeFlag.size()) == 0) {
      return run_failure(*world, argv[i] + kModeFlag.size());
    }
  }
  std::unique_ptr<Communicator> small_pieces = make_mpi_world_communicator(kSmallPiece);
  g_world = world.get();
  g_small_pieces = small_pieces.get();
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Communicator> staged = make_staged_communicator(*world, *cpu);
  g_staged = staged.get();
  std::unique_ptr<CommMemory> host_memory = make_host_comm_memory();
  std::unique_ptr<CommMemory> cpu_memory = make_backend_comm_memory(*cpu);
  register_comm_conformance_tests("MpiConformance", [&](const ConformanceCase& c) { c.run({*world, *host_memory}); });
  register_comm_conformance_tests("MpiSmallPiecesConformance", [&](const ConformanceCase& c) {
    // 64 KiB in pieces of 7 floats would be thousands of MPI calls per rank, for nothing the
    // whole-buffer run does not cover.
    if (std::string(c.name) == "LargeBuffers") GTEST_SKIP() << "large buffers run whole, not in small pieces";
    c.run({*small_pieces, *host_memory});
  });
  register_comm_conformance_tests("MpiStagedConformance", [&](const ConformanceCase& c) {
    c.run({*staged, *cpu_memory});
  });

  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (world->rank() != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world->rank()));
  }
  const int failed_here = RUN_ALL_TESTS() != 0 ? 1 : 0;
  const double failed_ranks = world->all_reduce_sum(failed_here);
  if (world->rank() == 0 && failed_ranks > 0) {
    std::fprintf(stderr, "comm_mpi_test: tests failed on %g of %d ranks\n", failed_ranks, world->size());
  }
  return failed_ranks > 0 ? 1 : 0;
}
