// Data-parallel gradient reduction: the replicas of a stage (or of the whole model) sum
// their parameter gradients (under ZeRO, reduce-scatter them: runtime/zero_shards.h) in
// buckets, each launched as soon as the backward pass that
// completes the step's gradients has finished every node using its parameters, so that
// communication overlaps the rest of backward (PyTorch DDP's buckets).
//
// The stage runner (runtime/stage_runner.h) drives it from the schedule: during the
// chunk's last gradient pass of the step (its last B, or W after I) it reports each node
// done, and at R (REDUCE_GRAD) the rest is reduced and every reduction waited for. Every
// replica runs the same schedule over the same program, so all launch the same buckets in
// the same order.
#ifndef PIPESHARD_RUNTIME_GRADIENT_SYNC_H_
#define PIPESHARD_RUNTIME_GRADIENT_SYNC_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "ir/graph.h"
#include "program/program.h"
#include "runtime/zero_shards.h"

namespace pipeshard {

class GradientSync {
 public:
  struct Bucket {
    int64_t begin = 0, end = 0;  // [begin, end) of the program's gradient buffer
    size_t ready_after = 0;      // the node whose backward completes the bucket
  };

  // Buckets cover the gradient buffer of `program` (built from `graph`) from its end (the
  // last layers, whose gradients backward finishes first) towards its start, each about
  // `bucket_bytes`, never splitting a parameter. `replicas` carries buffers in the
  // program's backend memory. All three must outlive the GradientSync.
  GradientSync(const Graph& graph, Program& program, Communicator& replicas, int64_t bucket_bytes);
  // ZeRO stage 1 (runtime/zero_shards.h): each bucket is reduce-scattered into this
  // replica's slice, which it alone updates (its reduced gradients in owned_gradients(),
  // `backend` memory), and its tail all-reduced; gather_parameters() then shares the
  // updated slices. Call before the first step.
  void shard(Backend& backend);

  // Node `node`'s backward is done in the pass that completes the step's gradients:
  // launches every bucket it completes, but the last (reduce_rest() does that one).
  void node_done(size_t node);
  // Every gradient is final: reduces the buckets not launched yet, blocking (the last
  // bucket has nothing left to overlap with, and MPI runs a blocking all-reduce at twice
  // the speed of a non-blocking one: 16 MiB over shared memory, 2.6 against 5.5 ms), and
  // waits for those in flight. The gradients are then the sum over the replicas (under
  // ZeRO: this replica's slices, in owned_gradients(), and the tails), and the next step
  // starts afresh.
  void reduce_rest();

  const std::vector<Bucket>& buckets() const { return buckets_; }
  // ZeRO: the slices, null when not sharded.
  const ZeroShards* zero() const { return zero_.get(); }
  float* owned_gradients() { return owned_.data(); }
  // ZeRO: every replica's updated slices into every replica's parameters (collective).
  void gather_parameters();

 private:
  Program& program_;
  Communicator& replicas_;
  std::vector<Bucket> buckets_;  // in launch order (end of the buffer first)
  std::vector<bool> launched_;   // [buckets]: in this step
  std::vector<std::unique_ptr<Request>> in_flight_;
  std::unique_ptr<ZeroShards> zero_;
  DeviceBuffer owned_;  // ZeRO: [zero_->slice_elements()], this replica's reduced slices

  void reduce(size_t bucket);  // blocking
};

}  // namespace pipeshard

#endif  // PIPESHARD_RUNTIME_GRADIENT_SYNC_H_
