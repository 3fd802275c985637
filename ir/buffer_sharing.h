// How values whose lives do not overlap share buffers: the greedy interval colouring that a
// Program's plan uses for its shared buffers (program/program_plan.cc) and that the
// partitioner's memory estimate repeats (partitioner/plan.cc), so that the two agree on
// how many bytes the buffers take. Plain data in, plain data out: no Graph, no backend.
#ifndef PIPESHARD_IR_BUFFER_SHARING_H_
#define PIPESHARD_IR_BUFFER_SHARING_H_

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace pipeshard {

// Interval colouring's choice of a buffer for a value of `need` elements (or bytes) among
// the buffers whose sizes are `sizes` and that `usable(b)` allows: one that fits over one
// that does not; of two that fit, the smaller; of two that do not, the larger (it grows
// least). -1 when none is usable.
template <typename Usable>
int best_buffer(const std::vector<int64_t>& sizes, int64_t need, Usable&& usable) {
  int best = -1;
  for (size_t b = 0; b < sizes.size(); ++b) {
    if (!usable(b)) continue;
    if (best < 0) {
      best = static_cast<int>(b);
      continue;
    }
    const int64_t a_size = sizes[b], b_size = sizes[best];
    const bool a_fits = a_size >= need, b_fits = b_size >= need;
    if (a_fits != b_fits ? a_fits : (a_fits ? a_size < b_size : a_size > b_size)) best = static_cast<int>(b);
  }
  return best;
}

// The steps at which a value needs its buffer: inclusive [first, last] spans of a
// timeline the caller numbers (forward steps, then backward ones), and its size.
struct BufferLife {
  std::vector<std::pair<int, int>> spans;  // [first, last] steps, inclusive
  int64_t size = 0;                        // elements or bytes: any unit, the same for every value
};

struct SharedBuffers {
  std::vector<int> buffer;     // [values]: index into sizes
  std::vector<int64_t> sizes;  // [buffers]: the largest value each holds, in the values' unit
};

// Buffers for values such that values sharing one never need it at the same step: greedily,
// in the order given, each value takes best_buffer() among those none of whose values'
// spans overlap its own, growing it when it is too small, or a new buffer when none is
// free. Greedy colouring is tightest when values come in the order their spans start.
SharedBuffers share_buffers(std::span<const BufferLife> values);

// A value's gradient inside one backward pass, which runs the nodes from the last to the
// first: it is written first by the backward of `first_writer` (the value's last reader)
// and read last by that of `producer`, and lives in between.
struct GradientSpan {
  int producer = -1;      // node index
  int first_writer = -1;  // node index, at least `producer`
  int64_t size = 0;       // elements or bytes: any unit, the same for every span
};

// share_buffers() for value gradients, in backward order (first writers from the last node
// down; spans with the same first writer in the order given): a chain of nodes needs two
// buffers whatever its length; a residual branch holds one more for the gradient of the
// value that skips it. SharedBuffers::buffer is indexed like `spans`.
SharedBuffers share_gradient_buffers(std::span<const GradientSpan> spans);

}  // namespace pipeshard

#endif  // PIPESHARD_IR_BUFFER_SHARING_H_
