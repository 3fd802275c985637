// Data-parallel gradient reduction: the replicas of a stage (or of the whole model) sum
// their parameter gradients (under ZeRO, reduce-scatter them: runtime/zero_shards.h) in
// buckets, each launched as soon as the backward pass that
// completes the step's gradients has finished every node using its parameters, so that
// communication overlaps the rest of backward (PyTorch DDP's buckets).
//
// The stage runner (runtime/stage_runner.h) drives it from the schedule: during the
// chunk's last gradient pass of the step (its last B, or W after I) it reports each node
// done, and at R (REDUCE_GRAD) the rest is reduced and every reduction waited for (under
// ZeRO stage 2 every B pass does both, the rest after the pass: pass_done()). Every
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
    size_t first_write = 0;      // the node whose backward writes into it first (ZeRO-2 windows)
  };

  // Buckets cover the gradient buffer of `program` (built from `graph`) from its end (the
  // last layers, whose gradients backward finishes first) towards its start, each about
  // `bucket_bytes`, never splitting a parameter. `replicas` carries buffers in the
  // program's backend memory. All three must outlive the GradientSync.
  GradientSync(const Graph& graph, Program& program, Communicator& replicas, int64_t bucket_bytes);
  ~GradientSync();
  // ZeRO (runtime/zero_shards.h): each bucket is reduce-scattered, this replica's slice of
  // it updated by this replica alone, its tail all-reduced; gather_parameters() then
  // shares the updated slices. Call before the first step.
  // - Stage 1 (`windows` false): in place, in the program's whole gradient buffer.
  // - Stage 2 (`windows` true; the program built with ProgramOptions::gradients_elsewhere,
  //   whole backwards only): the program's gradients live in a few bucket-sized windows
  //   (two for a chain of layers; assign_windows() in the .cc), reused bucket after bucket
  //   within a backward pass, and each pass's reduced slices
  //   and tails are added up in a packed buffer of the owned elements (ZeroShards::spans):
  //   gradients take 1/D of the memory and a few buckets. Every backward pass is reduced,
  //   each micro-batch's of an accumulated step too (pass_done()). Where the windows and
  //   slices would be no smaller than the whole buffer (a few large buckets), stage 1,
  //   unless `windows_always` (the tests' way to run stage 2 on small models).
  void shard(Backend& backend, bool windows, bool windows_always = false);

  // Node `node`'s backward is done in the pass that completes the step's gradients (with
  // windows: in any pass): launches every bucket it completes, but those the last bucket's
  // node completes (reduce_rest() or pass_done() reduces those, blocking).
  void node_done(size_t node);
  // With windows, before node `node`'s backward: the windows of the buckets it writes first
  // are made ready (their last occupants' reductions finished and added up, their
  // zeroed_gradient_ranges() filled).
  void node_starts(size_t node);
  // With windows, after each backward pass: reduces what the pass left and adds it up.
  void pass_done();
  // Every gradient is final: reduces the buckets not launched yet, blocking (the last
  // bucket has nothing left to overlap with, and MPI runs a blocking all-reduce at twice
  // the speed of a non-blocking one: 16 MiB over shared memory, 2.6 against 5.5 ms), and
  // waits for those in flight. The gradients are then the sum over the replicas (under
  // ZeRO: this replica's slices and the tails, at spans()), and the next step starts
  // afresh.
  void reduce_rest();

  const std::vector<Bucket>& buckets() const { return buckets_; }
  // ZeRO: the slices, null when not sharded.
  const ZeroShards* zero() const { return zero_.get(); }
  // ZeRO stage 2's gradient windows are in use.
  bool windows() const { return !windows_.empty(); }
  // ZeRO: what the optimizer updates on this replica, and where its reduced gradients lie.
  const std::vector<Optimizer::Span>& spans() const { return spans_; }
  // ZeRO stage 2: bytes of the windows and the packed gradients (the program holds none).
  int64_t gradient_bytes() const;
  // ZeRO: every replica's updated slices into every replica's parameters (collective).
  void gather_parameters();

 private:
  Program& program_;
  Communicator& replicas_;
  Backend* backend_ = nullptr;   // ZeRO stage 2
  std::vector<Bucket> buckets_;  // in launch order (end of the buffer first)
  std::vector<bool> launched_;   // [buckets]: in this step (with windows: this pass)
  std::unique_ptr<ZeroShards> zero_;
  std::vector<Optimizer::Span> spans_;
  // ZeRO stage 2. Bucket i lives in window window_of_[i], the packed sums in packed_.
  std::vector<DeviceBuffer> windows_;
  std::vector<int> window_of_;
  std::vector<int64_t> begins_;                                 // [buckets], ascending, for where()
  std::vector<size_t> by_begin_;                                // [buckets]: the bucket of each begin
  std::vector<int> occupant_;                                   // [windows]: the bucket in it, -1: none
  std::vector<std::vector<std::unique_ptr<Request>>> pending_;  // [buckets]: its reductions in flight
  DeviceBuffer packed_;
  std::vector<bool> summed_;  // [buckets]: a pass of this step has been added into packed_

  void reduce(size_t bucket);  // blocking
  std::vector<std::unique_ptr<Request>> launch(size_t bucket);
  float* bucket_data(size_t bucket);  // where the bucket's gradients lie
  void claim(size_t bucket);          // with windows: readies the bucket's window
  float* where(int64_t offset);       // a gradient's place, with windows
  void retire(size_t bucket);         // with windows: waits for its reductions and adds them up
};

}  // namespace pipeshard

#endif  // PIPESHARD_RUNTIME_GRADIENT_SYNC_H_
