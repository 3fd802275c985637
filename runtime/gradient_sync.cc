#include "runtime/gradient_sync.h"

#include <algorithm>

namespace pipeshard {

// A bucket is complete once backward has passed the earliest node using any of its
// parameters.
GradientSync::GradientSync(const Graph& graph, Program& program, Communicator& replicas, int64_t bucket_bytes)
    : program_(program), replicas_(replicas) {
  std::vector<size_t> first_user(graph.params.size(), graph.nodes.size());
  for (size_t i = graph.nodes.size(); i-- > 0;)
    for (int p : graph.node_params(graph.nodes[i])) first_user[p] = i;
  std::vector<int> order;  // trainable parameters by descending offset
  for (size_t p = 0; p < graph.params.size(); ++p) {
    if (graph.params[p].trainable) order.push_back(static_cast<int>(p));
  }
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return program.parameter_offset(a) > program.parameter_offset(b); });
  const int64_t per_bucket = std::max<int64_t>(1, bucket_bytes / static_cast<int64_t>(sizeof(float)));
  Bucket current;
  bool open = false;
  for (int p : order) {
    const int64_t begin = program.parameter_offset(p), end = begin + graph.params[p].elements();
    if (!open) {
      current = Bucket{begin, end, first_user[p]};
      open = true;
    } else {
      current.begin = begin;
      current.ready_after = std::min(current.ready_after, first_user[p]);
    }
    if (current.end - current.begin >= per_bucket) {
      buckets_.push_back(current);
      open = false;
    }
  }
  if (open) buckets_.push_back(current);
  launched_.assign(buckets_.size(), false);
}

void GradientSync::shard(Backend& backend) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const Bucket& b : buckets_) ranges.emplace_back(b.begin, b.end);
  zero_ = std::make_unique<ZeroShards>(ranges, replicas_.rank(), replicas_.size());
  owned_ = DeviceBuffer(backend, std::max<int64_t>(zero_->slice_elements(), 1));
}

void GradientSync::reduce(size_t bucket) {
  const Bucket& b = buckets_[bucket];
  float* grads = program_.gradients();
  if (!zero_) {
    replicas_.all_reduce(grads + b.begin, b.end - b.begin, ReduceOp::kSum);
    return;
  }
  const ZeroShards::Piece& p = zero_->pieces()[bucket];
  if (p.block > 0) replicas_.reduce_scatter(grads + p.begin, owned_.data() + p.owned_at, p.block, ReduceOp::kSum);
  if (p.end > p.tail) replicas_.all_reduce(grads + p.tail, p.end - p.tail, ReduceOp::kSum);
}

void GradientSync::gather_parameters() { zero_->gather(program_.parameters(), replicas_); }

void GradientSync::node_done(size_t node) {
  if (zero_) return;  // reduce-scatters wait for reduce_rest() (no asynchronous form yet)
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket& b = buckets_[i];
    if (b.ready_after == node && b.ready_after != buckets_.back().ready_after && !launched_[i]) {
      in_flight_.push_back(replicas_.all_reduce_async(program_.gradients() + b.begin, b.end - b.begin, ReduceOp::kSum));
      launched_[i] = true;
    }
  }
  if (!in_flight_.empty()) replicas_.progress();  // between layers, the buckets launched move on
}

void GradientSync::reduce_rest() {
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (!launched_[i]) reduce(i);
  }
  for (auto& request : in_flight_) request->wait();
  in_flight_.clear();
  launched_.assign(buckets_.size(), false);
}

}  // namespace pipeshard
