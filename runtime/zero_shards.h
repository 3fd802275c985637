// ZeRO stage 1 (Rajbhandari et al., 2020, §5.1): the data-parallel replicas of a stage
// (and shard) split the optimizer state between them. Each replica keeps the state of its
// slice of every gradient bucket (runtime/gradient_sync.h), so that the traffic stays
// in the buckets' large messages:
//
//   bucket [begin, end) of L elements, D replicas, block = floor(L / D):
//     [begin + r·block, begin + (r+1)·block)   replica r's slice: reduce-scattered
//     [begin + D·block, end)                  the tail (< D elements): all-reduced, every
//                                             replica updates it alike
//
// A step then reduce-scatters each bucket's gradients (summed into the replica's slice,
// in a buffer of its own), updates the slice (the optimizer's Spans), and all-gathers the
// updated weights back into every replica's parameter buffer. The sum each replica's slice
// receives is the one all-reduce gives, so every layout stays one process's training, to
// float rounding.
//
// This class is the bookkeeping: which elements each replica owns, where their reduced
// gradients lie, and the mapping between the optimizer's state (owned elements, in span
// order) and whole-buffer state (checkpoints hold whole tensors), with the all-gather that
// puts every replica's slices together.
#ifndef PIPESHARD_RUNTIME_ZERO_SHARDS_H_
#define PIPESHARD_RUNTIME_ZERO_SHARDS_H_

#include <cstdint>
#include <vector>

#include "comm/comm.h"
#include "program/optimizer.h"

namespace pipeshard {

class ZeroShards {
 public:
  struct Piece {
    int64_t begin = 0, end = 0;  // the bucket, in the parameter and gradient buffers
    int64_t block = 0;           // each replica's slice: floor((end - begin) / replicas)
    int64_t tail = 0;            // begin + replicas · block: the tail is [tail, end)
    int64_t owned_at = 0;        // where this replica's reduced slice lies in the owned-gradient buffer
  };

  // Over `buckets` ([begin, end) of the gradient buffer, in launch order) for replica
  // `replica` of `replicas`.
  ZeroShards(const std::vector<std::pair<int64_t, int64_t>>& buckets, int replica, int replicas);

  int replica() const { return replica_; }
  int replicas() const { return replicas_; }
  const std::vector<Piece>& pieces() const { return pieces_; }  // one per bucket, in launch order
  // Elements this replica updates: its slices and every tail.
  int64_t owned_elements() const { return owned_elements_; }
  // Floats of the owned-gradient buffer: the slices (tails are reduced in place).
  int64_t slice_elements() const { return slice_elements_; }

  // What the optimizer updates on this replica: each slice (its reduced gradients in
  // `owned_grads`), then each tail (in `grads`), in piece order.
  std::vector<Optimizer::Span> spans(float* params, float* grads, float* owned_grads) const;
  // Whole-buffer positions of those spans, in the same order: [at, at + n).
  struct Range {
    int64_t at = 0, n = 0;
  };
  std::vector<Range> ranges() const;

  // Optimizer state: `owned` (owned_elements(), span order) into a whole buffer of
  // `elements` (zeros where other replicas own), and back.
  std::vector<float> to_whole(const std::vector<float>& owned, int64_t elements) const;
  std::vector<float> to_owned(const std::vector<float>& whole) const;
  // Every replica's slices of `whole` (each replica's own filled in; in the memory
  // `replicas` carries) onto every replica: an all-gather per bucket, in place (collective).
  void gather(float* whole, Communicator& replicas) const;

 private:
  int replica_, replicas_;
  std::vector<Piece> pieces_;
  int64_t owned_elements_ = 0, slice_elements_ = 0;
};

}  // namespace pipeshard

#endif  // PIPESHARD_RUNTIME_ZERO_SHARDS_H_
