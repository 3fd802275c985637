// Where each rank sits in a P × D × T job, and the groups it talks to.
#include <cstdint>
#include <string>

#include "comm/comm.h"
#include "common/status.h"

namespace pipeshard {
namespace {

std::string count_of(int64_t n, const std::string& one, const std::string& many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

}  // namespace

Result<ProcessLayout> ProcessLayout::for_rank(int world_rank, int world_size, int stages, int shards) {
  if (stages < 1)
    return Status::error("the number of pipeline stages must be at least 1, got " + std::to_string(stages));
  if (shards < 1) {
    return Status::error("the number of tensor-parallel shards must be at least 1, got " + std::to_string(shards));
  }
  if (world_size < 1)
    return Status::error("the number of processes must be at least 1, got " + std::to_string(world_size));
  if (world_rank < 0 || world_rank >= world_size) {
    return Status::error("rank " + std::to_string(world_rank) + " is outside a job of " +
                         count_of(world_size, "process", "processes"));
  }
  const int64_t per_replica = int64_t{stages} * shards;
  if (world_size % per_replica != 0) {
    return Status::error("mpirun started " + count_of(world_size, "process", "processes") +
                         ", which do not divide into " + count_of(stages, "pipeline stage", "pipeline stages") + " × " +
                         count_of(shards, "tensor-parallel shard", "tensor-parallel shards") +
                         "; the number of processes must be a multiple of " + std::to_string(per_replica));
  }
  ProcessLayout layout;
  layout.stages = stages;
  layout.shards = shards;
  layout.replicas = static_cast<int>(world_size / per_replica);
  // rank = (p·D + d)·T + t
  layout.shard = world_rank % shards;
  layout.replica = (world_rank / shards) % layout.replicas;
  layout.stage = world_rank / (shards * layout.replicas);
  return layout;
}

ProcessGroups make_process_groups(Communicator& world, const ProcessLayout& layout) {
  const int p = layout.stage, d = layout.replica, t = layout.shard;
  const int D = layout.replicas, T = layout.shards;
  PIPESHARD_CHECK(layout.world_size() == world.size(), "a layout of " + std::to_string(layout.world_size()) +
                                                           " ranks for a world of " + std::to_string(world.size()));
  PIPESHARD_CHECK(p >= 0 && p < layout.stages && d >= 0 && d < D && t >= 0 && t < T,
                  "coordinates (" + std::to_string(p) + ", " + std::to_string(d) + ", " + std::to_string(t) + ")");
  PIPESHARD_CHECK(layout.rank_of(p, d, t) == world.rank(), "the layout is rank " +
                                                               std::to_string(layout.rank_of(p, d, t)) +
                                                               "'s, not rank " + std::to_string(world.rank()) + "'s");
  // Color: the coordinates the group shares; key: the one that varies, so that the group's
  // rank is that coordinate. Every rank makes the three splits in the same order.
  ProcessGroups groups;
  groups.layout = layout;
  groups.data = world.split(p * T + t, d);
  groups.tensor = world.split(p * D + d, t);
  groups.pipeline = world.split(d * T + t, p);
  return groups;
}

}  // namespace pipeshard
