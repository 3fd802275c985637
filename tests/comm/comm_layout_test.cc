// Tests without mpirun: where ranks sit in a P × D × T job, the refusals of layouts that do
// not fit, and the group of one that a process started without mpirun talks to. The MPI
// communicator has its own binary, run by mpiexec (tests/comm/comm_mpi_main.cc).
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "comm/comm.h"

namespace pipeshard {
namespace {

// ---- ProcessLayout ------------------------------------------------------------------------

TEST(ProcessLayoutTest, EveryRankRoundTripsForManyLayouts) {
  for (int stages = 1; stages <= 5; ++stages) {
    for (int shards = 1; shards <= 4; ++shards) {
      for (int replicas = 1; replicas <= 4; ++replicas) {
        const int world = stages * replicas * shards;
        std::set<std::tuple<int, int, int>> seen;
        for (int rank = 0; rank < world; ++rank) {
          Result<ProcessLayout> layout = ProcessLayout::for_rank(rank, world, stages, shards);
          ASSERT_TRUE(layout.is_ok()) << layout.status().message();
          EXPECT_EQ(layout->stages, stages);
          EXPECT_EQ(layout->replicas, replicas);
          EXPECT_EQ(layout->shards, shards);
          EXPECT_EQ(layout->world_size(), world);
          EXPECT_EQ(layout->rank_of(layout->stage, layout->replica, layout->shard), rank)
              << "P=" << stages << " D=" << replicas << " T=" << shards;
          EXPECT_GE(layout->stage, 0);
          EXPECT_LT(layout->stage, stages);
          EXPECT_GE(layout->replica, 0);
          EXPECT_LT(layout->replica, replicas);
          EXPECT_GE(layout->shard, 0);
          EXPECT_LT(layout->shard, shards);
          seen.insert({layout->stage, layout->replica, layout->shard});
        }
        EXPECT_EQ(static_cast<int>(seen.size()), world) << "two ranks share coordinates";
      }
    }
  }
}

TEST(ProcessLayoutTest, RankOrderKeepsShardsAdjacentAndStagesFurthestApart) {
  // P=2, D=3, T=2: ranks 0,1 are the shards of (p0, d0); stage 1 starts at rank 6.
  const int stages = 2, shards = 2, world = 12;
  const std::vector<std::tuple<int, int, int>> expected = {{0, 0, 0}, {0, 0, 1}, {0, 1, 0}, {0, 1, 1},
                                                           {0, 2, 0}, {0, 2, 1}, {1, 0, 0}, {1, 0, 1},
                                                           {1, 1, 0}, {1, 1, 1}, {1, 2, 0}, {1, 2, 1}};
  for (int rank = 0; rank < world; ++rank) {
    Result<ProcessLayout> layout = ProcessLayout::for_rank(rank, world, stages, shards);
    ASSERT_TRUE(layout.is_ok()) << layout.status().message();
    EXPECT_EQ(std::make_tuple(layout->stage, layout->replica, layout->shard), expected[rank]) << "rank " << rank;
  }
}

TEST(ProcessLayoutTest, RefusesAWorldThatDoesNotDivide) {
  Result<ProcessLayout> layout = ProcessLayout::for_rank(0, 6, 4, 1);
  ASSERT_FALSE(layout.is_ok());
  EXPECT_EQ(layout.status().message(),
            "mpirun started 6 processes, which do not divide into 4 pipeline stages × 1 tensor-parallel shard; "
            "the number of processes must be a multiple of 4");

  layout = ProcessLayout::for_rank(0, 1, 2, 1);
  ASSERT_FALSE(layout.is_ok());
  EXPECT_NE(layout.status().message().find("1 process, which do not divide into 2 pipeline stages"), std::string::npos)
      << layout.status().message();

  layout = ProcessLayout::for_rank(3, 8, 2, 3);
  ASSERT_FALSE(layout.is_ok());
  EXPECT_NE(layout.status().message().find("2 pipeline stages × 3 tensor-parallel shards"), std::string::npos)
      << layout.status().message();
  EXPECT_NE(layout.status().message().find("multiple of 6"), std::string::npos) << layout.status().message();
}

TEST(ProcessLayoutTest, RefusesArgumentsBelowOne) {
  struct Case {
    int rank, world, stages, shards;
    const char* expected;
  };
  const Case cases[] = {
      {0, 4, 0, 1, "pipeline stages must be at least 1, got 0"},
      {0, 4, 1, 0, "tensor-parallel shards must be at least 1, got 0"},
      {0, 4, -2, 1, "got -2"},
      {0, 0, 1, 1, "processes must be at least 1, got 0"},
      {4, 4, 1, 1, "rank 4 is outside a job of 4 processes"},
      {-1, 4, 1, 1, "rank -1 is outside"},
  };
  for (const Case& c : cases) {
    Result<ProcessLayout> layout = ProcessLayout::for_rank(c.rank, c.world, c.stages, c.shards);
    ASSERT_FALSE(layout.is_ok()) << c.expected;
    EXPECT_NE(layout.status().message().find(c.expected), std::string::npos)
        << "message: " << layout.status().message() << "\nexpected to contain: " << c.expected;
  }
}

TEST(ProcessLayoutTest, OneProcessIsTheTrivialLayout) {
  Result<ProcessLayout> layout = ProcessLayout::for_rank(0, 1, 1, 1);
  ASSERT_TRUE(layout.is_ok()) << layout.status().message();
  EXPECT_EQ(layout->world_size(), 1);
  EXPECT_EQ(layout->stage + layout->replica + layout->shard, 0);
}

// ---- The group of one ---------------------------------------------------------------------

TEST(SingleProcessCommunicatorTest, CollectivesKeepOrCopyTheData) {
  std::unique_ptr<Communicator> comm = make_single_process_communicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);

  std::vector<float> data = {1.5f, -2.0f, 3.25f};
  const std::vector<float> original = data;
  comm->all_reduce(data.data(), 3, ReduceOp::kSum);
  EXPECT_EQ(data, original);
  comm->all_reduce(data.data(), 3, ReduceOp::kAverage);
  EXPECT_EQ(data, original);
  comm->all_reduce_async(data.data(), 3, ReduceOp::kAverage)->wait();
  EXPECT_EQ(data, original);
  EXPECT_EQ(comm->all_reduce_sum(2.5), 2.5);
  std::vector<double> sums = {1.0 + 1e-12, -3.0, 0.125};
  const std::vector<double> original_sums = sums;
  comm->all_reduce_sum(sums.data(), 3);
  EXPECT_EQ(sums, original_sums);

  std::vector<float> out(3, 0.0f);
  comm->all_gather(data.data(), out.data(), 3);
  EXPECT_EQ(out, original);
  out.assign(3, 0.0f);
  comm->reduce_scatter(data.data(), out.data(), 3, ReduceOp::kAverage);
  EXPECT_EQ(out, original);
  comm->all_gather(data.data(), data.data(), 3);  // in place
  EXPECT_EQ(data, original);

  comm->broadcast(data.data(), 3, 0);
  EXPECT_EQ(data, original);
  comm->barrier();
  comm->all_reduce(nullptr, 0, ReduceOp::kSum);  // empty buffers are fine

  std::unique_ptr<Communicator> group = comm->split(7, 3);
  EXPECT_EQ(group->rank(), 0);
  EXPECT_EQ(group->size(), 1);
}

TEST(SingleProcessCommunicatorDeathTest, PointToPointHasNoPeers) {
  std::unique_ptr<Communicator> comm = make_single_process_communicator();
  float x = 1.0f;
  EXPECT_DEATH(comm->send(&x, 1, 0, 0), "a single process has no peers");
  EXPECT_DEATH(comm->recv(&x, 1, 0, 5), "recv with rank 0 \\(tag 5\\): a single process has no peers");
  EXPECT_DEATH(comm->send_async(&x, 1, 0, 0), "a single process has no peers");
  EXPECT_DEATH(comm->recv_async(&x, 1, 0, 0), "a single process has no peers");
  EXPECT_DEATH(comm->broadcast(&x, 1, 1), "broadcast from rank 1 in a group of one");
}

TEST(SingleProcessCommunicatorDeathTest, AbortPrintsTheMessageAndFails) {
  std::unique_ptr<Communicator> comm = make_single_process_communicator();
  EXPECT_EXIT(comm->abort("train: error: stage 2 lost its data"), ::testing::ExitedWithCode(1),
              "train: error: stage 2 lost its data");
}

TEST(PlaceholderCommunicatorDeathTest, KnowsItsPlaceAndCarriesNothing) {
  std::unique_ptr<Communicator> group = make_placeholder_communicator(1, 4, "a measured program's group");
  EXPECT_EQ(group->rank(), 1);
  EXPECT_EQ(group->size(), 4);
  float x = 1.0f;
  EXPECT_DEATH(group->all_reduce(&x, 1, ReduceOp::kSum),
               "all_reduce on a measured program's group, which carries nothing");
  EXPECT_DEATH(group->send(&x, 1, 0, 0), "send on a measured program's group");
  EXPECT_DEATH(group->split(0, 0), "split on a measured program's group");
  EXPECT_DEATH(make_placeholder_communicator(4, 4, "x"), "rank 4 of a group of 4");
}

TEST(SingleProcessCommunicatorTest, ProcessGroupsOfOne) {
  std::unique_ptr<Communicator> world = make_single_process_communicator();
  Result<ProcessLayout> layout = ProcessLayout::for_rank(0, 1, 1, 1);
  ASSERT_TRUE(layout.is_ok());
  ProcessGroups groups = make_process_groups(*world, *layout);
  for (Communicator* group : {groups.data.get(), groups.tensor.get(), groups.pipeline.get()}) {
    ASSERT_NE(group, nullptr);
    EXPECT_EQ(group->size(), 1);
    EXPECT_EQ(group->rank(), 0);
  }
}

// ---- Launch detection ---------------------------------------------------------------------

// Sets an environment variable for one scope, restoring what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(LaunchTest, LauncherVariablesMeanMpi) {
  const char* kNames[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_PROCID"};
  ScopedEnv a(kNames[0], nullptr), b(kNames[1], nullptr), c(kNames[2], nullptr), d(kNames[3], nullptr);
  EXPECT_FALSE(launched_by_mpi());
  for (const char* name : kNames) {
    ScopedEnv set(name, "0");
    EXPECT_TRUE(launched_by_mpi()) << name;
  }
  ScopedEnv empty(kNames[0], "");
  EXPECT_FALSE(launched_by_mpi()) << "an empty variable is no launcher";
  // Without a launcher the world is a group of one, and MPI is not touched.
  std::unique_ptr<Communicator> world = make_world_communicator();
  EXPECT_EQ(world->size(), 1);
  EXPECT_EQ(world->rank(), 0);
}

}  // namespace
}  // namespace pipeshard
