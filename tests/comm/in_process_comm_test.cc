// What only the in-process communicator (testing/in_process_comm.h) promises beyond
// comm/comm.h, which the conformance suite checks (tests/comm/comm_conformance_test.cc): sends
// are buffered, reductions run in rank order, deadlocks and ranks that left are reported
// instead of hanging, and mismatched calls, wrong sizes and waits past the timeout are fatal.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "testing/in_process_comm.h"

namespace pipeshard {
namespace {

InProcessOptions short_timeout() {
  InProcessOptions options;
  options.timeout = std::chrono::milliseconds(200);
  return options;
}

// The message of the InProcessJobError (or other exception) run_ranks throws, or "".
std::string failure_of(int size, const std::function<void(Communicator&)>& body) {
  try {
    run_ranks(size, body);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(InProcessCommTest, SendsAreBufferedAndNeverBlock) {
  run_ranks(2, [](Communicator& world) {
    float x[3] = {1, 2, 3};
    if (world.rank() == 0) {
      // Three sends, one to itself, before anyone receives.
      world.send(x, 3, 1, 0);
      x[0] = 10;  // the send copied the data when it was posted
      world.send(x, 3, 1, 0);
      world.send(x, 1, 0, 5);
      float self = 0;
      world.recv(&self, 1, 0, 5);
      EXPECT_EQ(self, 10.0f);
    }
    world.barrier();
    if (world.rank() == 1) {
      float got[3];
      world.recv(got, 3, 0, 0);
      EXPECT_EQ(got[0], 1.0f);
      world.recv(got, 3, 0, 0);
      EXPECT_EQ(got[0], 10.0f);
    }
  });
}

// Sums run in rank order, so a cancellation that depends on the order comes out the same
// on every run: ((1 + 2^24) − 2^24) = 0 in float, where another order would give 1.
TEST(InProcessCommTest, ReductionsRunInRankOrder) {
  run_ranks(3, [](Communicator& world) {
    const float mine[] = {1.0f, 16777216.0f, -16777216.0f};
    float x = mine[world.rank()];
    world.all_reduce(&x, 1, ReduceOp::kSum);
    EXPECT_EQ(x, 0.0f);
    const double big = 9007199254740992.0;  // 2^53
    const double values[] = {1.0, big, -big};
    EXPECT_EQ(world.all_reduce_sum(values[world.rank()]), 0.0);
  });
}

TEST(InProcessCommTest, ADeadlockIsReportedWithEveryRanksWait) {
  const std::string failure = failure_of(2, [](Communicator& world) {
    float x = 0;
    world.recv(&x, 1, 1 - world.rank(), 4);  // both receive, nobody sends
  });
  EXPECT_NE(failure.find("deadlock in the in-process job"), std::string::npos) << failure;
  EXPECT_NE(failure.find("rank 0 waits in a receive of 1 floats from rank 1 (tag 4) on the world"), std::string::npos)
      << failure;
  EXPECT_NE(failure.find("rank 1 waits in a receive of 1 floats from rank 0 (tag 4)"), std::string::npos) << failure;
}

// A rank whose body returned early (as after a failed ASSERT_) leaves the job; a collective
// that waits for it fails at once, naming it.
TEST(InProcessCommTest, ARankThatLeftIsReported) {
  const std::string failure = failure_of(3, [](Communicator& world) {
    if (world.rank() == 2) return;
    float x = 1;
    world.all_reduce(&x, 1, ReduceOp::kSum);
  });
  EXPECT_NE(failure.find("rank 2 has left"), std::string::npos) << failure;
  EXPECT_NE(failure.find("rank 0 waits in all_reduce of 1 floats (sum) on the world (its collective #0), which rank 2 "
                         "of that group has not called"),
            std::string::npos)
      << failure;
}

// The cause is rethrown, not the errors of the ranks that waited for the rank that threw;
// a group split from the world fails the same way.
TEST(InProcessCommTest, AnExceptionOnARankIsRethrown) {
  const std::string failure = failure_of(3, [](Communicator& world) {
    std::unique_ptr<Communicator> pair = world.split(world.rank() == 2 ? 1 : 0, 0);
    if (world.rank() == 1) throw std::runtime_error("rank 1 gives up");
    float x = 1;
    if (world.rank() == 0) pair->all_reduce(&x, 1, ReduceOp::kSum);
    world.barrier();
  });
  EXPECT_EQ(failure, "rank 1 gives up");
}

// A rank that throws with a request in flight does not wait for it while unwinding once
// the job cannot complete it: here rank 1 waits for a message rank 0 never sends.
TEST(InProcessCommTest, UnwindingPastAnUnfinishedRequestDoesNotWait) {
  const std::string failure = failure_of(2, [](Communicator& world) {
    float x = 1;
    if (world.rank() == 1) world.recv(&x, 1, 0, 0);
    std::unique_ptr<Request> pending = world.all_reduce_async(&x, 1, ReduceOp::kSum);
    if (world.rank() == 0) throw std::runtime_error("rank 0 gives up");
    pending->wait();
  });
  EXPECT_EQ(failure, "rank 0 gives up");
}

TEST(InProcessCommTest, LayoutGroupsOfAP2D2T2Job) {
  run_ranks(8, [](Communicator& world) {
    ProcessGroups groups = make_layout_groups(world, 2, 2);
    EXPECT_EQ(groups.layout.replicas, 2);
    EXPECT_EQ(groups.layout.rank_of(groups.layout.stage, groups.layout.replica, groups.layout.shard), world.rank());
    for (Communicator* group : {groups.data.get(), groups.tensor.get(), groups.pipeline.get()}) {
      EXPECT_EQ(group->size(), 2);
      float rank = static_cast<float>(world.rank()), both[2];
      group->all_gather(&rank, both, 1);
      EXPECT_EQ(both[group->rank()], rank);
    }
  });
}

class InProcessCommDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(InProcessCommDeathTest, AReceiveOfTheWrongSizeIsFatal) {
  EXPECT_DEATH(run_ranks(2,
                         [](Communicator& world) {
                           std::vector<float> buffer(20, 1.0f);
                           if (world.rank() == 0) world.send(buffer.data(), 10, 1, 3);
                           if (world.rank() == 1) world.recv(buffer.data(), 20, 0, 3);
                         }),
               "received 10 floats from rank 0 \\(tag 3\\) where 20 were expected");
}

TEST_F(InProcessCommDeathTest, MismatchedCollectivesAreFatal) {
  EXPECT_DEATH(run_ranks(2,
                         [](Communicator& world) {
                           float x[4] = {};
                           world.barrier();
                           if (world.rank() == 0) world.all_reduce(x, 4, ReduceOp::kSum);
                           if (world.rank() == 1) world.broadcast(x, 4, 0);
                         }),
               "collective #1 of the world: rank [01] calls (broadcast|all_reduce) of 4 floats");
  EXPECT_DEATH(run_ranks(2,
                         [](Communicator& world) {
                           float x[4] = {};
                           world.all_reduce(x, world.rank() == 0 ? 4 : 3, ReduceOp::kSum);
                         }),
               "all_reduce of [34] floats \\(sum\\) where rank [01] called all_reduce of [34] floats");
  // A blocking reduce-scatter does not match an async one (nor in MPI), though they compute the same.
  EXPECT_DEATH(run_ranks(2,
                         [](Communicator& world) {
                           float send[4] = {}, recv[2] = {};
                           if (world.rank() == 0) world.reduce_scatter(send, recv, 2, ReduceOp::kSum);
                           if (world.rank() == 1) world.reduce_scatter_async(send, recv, 2, ReduceOp::kSum)->wait();
                         }),
               "rank [01] calls reduce_scatter(_async)? of 2 floats \\(sum\\) where rank [01] called "
               "reduce_scatter(_async)? of 2 floats");
}

// Not a deadlock (rank 1 is busy), but rank 0 waits past the timeout.
TEST_F(InProcessCommDeathTest, AWaitPastTheTimeoutIsFatal) {
  EXPECT_DEATH(run_ranks(
                   2,
                   [](Communicator& world) {
                     float x = 0;
                     if (world.rank() == 0) world.recv(&x, 1, 1, 0);
                     if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(5));
                   },
                   short_timeout()),
               "rank 0 has waited 0.2 s in a receive of 1 floats from rank 1 \\(tag 0\\)");
}

TEST_F(InProcessCommDeathTest, TagsOutsideMpisLeastRangeAreFatal) {
  EXPECT_DEATH(run_ranks(1,
                         [](Communicator& world) {
                           float x = 0;
                           world.send(&x, 1, 0, 32768);
                         }),
               "tag 32768 outside 0..32767");
}

TEST_F(InProcessCommDeathTest, AbortEndsTheProcess) {
  EXPECT_EXIT(run_ranks(2,
                        [](Communicator& world) {
                          if (world.rank() == 1) world.abort("comm test: rank 1 gives up");
                          world.barrier();
                        }),
              ::testing::ExitedWithCode(1), "comm test: rank 1 gives up");
}

}  // namespace
}  // namespace pipeshard
