// ZeRO (Rajbhandari et al., 2020, §5): the data-parallel replicas of a stage (and shard)
// split the optimizer state between them (stage 1), and the reduced gradients too
// (stage 2). Each replica keeps the state of its slice of every gradient bucket
// (runtime/gradient_sync.h), so that the traffic stays in the buckets' large messages:
//
//   bucket [begin, end) of L elements, D replicas, block = floor(L / D):
//     [begin + r·block, begin + (r+1)·block)   replica r's slice: reduce-scattered
//     [begin + D·block, end)                  the tail (< D elements): all-reduced, every
//                                             replica updates it alike
//
// A step then reduce-scatters each bucket's gradients, updates the slice (the optimizer's
// Spans), and all-gathers the updated weights back into every replica's parameter buffer.
// The sum each replica's slice receives is the one all-reduce gives, so every layout stays
// one process's training, to float rounding.
//
// This class is the bookkeeping: which elements each replica owns, where their reduced
// gradients lie (in place in the whole gradient buffer, or packed into a buffer of the
// owned elements alone), and the mapping between the optimizer's state (owned elements, in
// span order) and whole-buffer state (checkpoints hold whole tensors), with the all-gather
// that puts every replica's slices together.
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
    int64_t slice_at = 0;        // in the packed buffer: this replica's slice ...
    int64_t tail_at = 0;         // ... and the tail
  };

  // Over `buckets` ([begin, end) of the gradient buffer, in launch order) for replica
  // `replica` of `replicas`.
  ZeroShards(const std::vector<std::pair<int64_t, int64_t>>& buckets, int replica, int replicas);

  int replica() const { return replica_; }
  int replicas() const { return replicas_; }
  const std::vector<Piece>& pieces() const { return pieces_; }  // one per bucket, in launch order
  // Elements this replica updates: its slices and every tail (the packed buffer's size).
  int64_t owned_elements() const { return owned_elements_; }

  // What this replica updates, as whole-buffer positions [at, at + n): each slice, then
  // each tail, in piece order. The packed buffer holds them one after another, so.
  struct Range {
    int64_t at = 0, n = 0;
  };
  const std::vector<Range>& ranges() const { return ranges_; }
  // The optimizer's spans over ranges(): parameters in `params`; the reduced gradients in
  // place in `grads` (the whole buffer) or, with `packed` given, there in range order.
  std::vector<Optimizer::Span> spans(float* params, float* grads, float* packed = nullptr) const;

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
  std::vector<Range> ranges_;
  int64_t owned_elements_ = 0;
};

}  // namespace pipeshard

#endif  // PIPESHARD_RUNTIME_ZERO_SHARDS_H_
