#include "runtime/gradient_sync.h"

#include <algorithm>
#include <numeric>

#include "common/check.h"

namespace pipeshard {

// A bucket is complete once backward has passed the earliest node using any of its
// parameters, and first written at the latest.
GradientSync::GradientSync(const Graph& graph, Program& program, Communicator& replicas, int64_t bucket_bytes)
    : program_(program), replicas_(replicas) {
  const size_t none = graph.nodes.size();
  std::vector<size_t> first_user(graph.params.size(), none), last_user(graph.params.size(), none);
  for (size_t i = graph.nodes.size(); i-- > 0;) {
    for (int p : graph.node_params(graph.nodes[i])) {
      first_user[p] = i;
      if (last_user[p] == none) last_user[p] = i;
    }
  }
  std::vector<int> order;  // trainable parameters by descending offset
  for (size_t p = 0; p < graph.params.size(); ++p) {
    if (graph.params[p].trainable) order.push_back(static_cast<int>(p));
  }
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return program.parameter_offset(a) > program.parameter_offset(b); });
  const int64_t per_bucket = std::max<int64_t>(1, bucket_bytes / static_cast<int64_t>(sizeof(float)));
  // An unused parameter is never written: a bucket of nothing else gets its window (zeros)
  // at the pass's end; in a bucket with used ones it is zeroed when the window is claimed.
  const auto written_first = [&](int p, size_t so_far) {
    return last_user[p] == none ? so_far : so_far == none ? last_user[p] : std::max(so_far, last_user[p]);
  };
  Bucket current;
  bool open = false;
  for (int p : order) {
    const int64_t begin = program.parameter_offset(p), end = begin + graph.params[p].elements();
    if (!open) {
      current = Bucket{begin, end, first_user[p], written_first(p, none)};
      open = true;
    } else {
      current.begin = begin;
      current.ready_after = std::min(current.ready_after, first_user[p]);
      current.first_write = written_first(p, current.first_write);
    }
    if (current.end - current.begin >= per_bucket) {
      buckets_.push_back(current);
      open = false;
    }
  }
  if (open) buckets_.push_back(current);
  launched_.assign(buckets_.size(), false);
  pending_.resize(buckets_.size());
}

GradientSync::~GradientSync() = default;

namespace {

// Buckets launched by node_done(): those whose last node is not the last bucket's (the
// rest go at the pass's or step's end).
bool launched_early(const std::vector<GradientSync::Bucket>& buckets, size_t i) {
  return buckets[i].ready_after != buckets.back().ready_after;
}

// The window of each bucket: a backward pass played through, nodes last to first, as
// node_starts() and node_done() see it. A bucket first written takes an empty window, else
// the one whose bucket was launched longest ago (its reduction has had the most time), else
// a new one; buckets no node writes take window 0 at the pass's end, when every bucket is
// launched. Chains of layers need two windows; a parameter shared by distant nodes holds
// its bucket's window from its last user to its first, and the others rotate around it.
std::vector<int> assign_windows(const std::vector<GradientSync::Bucket>& buckets, size_t nodes, size_t& windows) {
  std::vector<int> window_of(buckets.size(), 0);
  std::vector<int> occupant(windows, -1);
  std::vector<int64_t> launched_at(buckets.size(), -1);  // the launch's place in the pass
  int64_t launches = 0;
  for (size_t n = nodes; n-- > 0;) {
    for (size_t j = 0; j < buckets.size(); ++j) {
      if (buckets[j].first_write != n) continue;
      int chosen = -1;
      for (size_t w = 0; w < occupant.size() && chosen < 0; ++w)
        if (occupant[w] < 0) chosen = static_cast<int>(w);
      if (chosen < 0) {
        for (size_t w = 0; w < occupant.size(); ++w) {
          const int64_t at = launched_at[occupant[w]];
          if (at >= 0 && (chosen < 0 || at < launched_at[occupant[chosen]])) chosen = static_cast<int>(w);
        }
      }
      if (chosen < 0) {
        chosen = static_cast<int>(occupant.size());
        occupant.push_back(-1);
      }
      occupant[chosen] = static_cast<int>(j);
      window_of[j] = chosen;
    }
    for (size_t j = 0; j < buckets.size(); ++j) {
      if (buckets[j].ready_after == n && launched_early(buckets, j)) launched_at[j] = launches++;
    }
  }
  windows = occupant.size();
  return window_of;
}

}  // namespace

void GradientSync::shard(Backend& backend, bool windows, bool windows_always) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const Bucket& b : buckets_) ranges.emplace_back(b.begin, b.end);
  zero_ = std::make_unique<ZeroShards>(ranges, replicas_.rank(), replicas_.size());
  if (!windows) {
    spans_ = zero_->spans(program_.parameters(), program_.gradients());
    return;
  }
  backend_ = &backend;
  size_t nodes = 0;
  for (const Bucket& b : buckets_) nodes = std::max({nodes, b.ready_after + 1, b.first_write + 1});
  // Two windows at least, so that one bucket's reduction overlaps the next one's backward.
  size_t count = std::min<size_t>(2, buckets_.size());
  window_of_ = assign_windows(buckets_, nodes, count);
  std::vector<int64_t> sizes(count, 1);
  for (size_t j = 0; j < buckets_.size(); ++j) {
    sizes[window_of_[j]] = std::max(sizes[window_of_[j]], buckets_[j].end - buckets_[j].begin);
  }
  // Windows as big as the buffer they replace save nothing (few buckets, or one parameter
  // holding most of the model): then stage 1, in place, in the program's own buffer.
  if (!windows_always && std::accumulate(sizes.begin(), sizes.end(), int64_t{0}) + zero_->owned_elements() >=
                             program_.trainable_elements()) {
    program_.place_gradients({});
    spans_ = zero_->spans(program_.parameters(), program_.gradients());
    return;
  }
  for (int64_t size : sizes) windows_.emplace_back(backend, size);
  occupant_.assign(count, -1);
  for (size_t j = 0; j < buckets_.size(); ++j) by_begin_.push_back(j);
  std::sort(by_begin_.begin(), by_begin_.end(),
            [&](size_t a, size_t b) { return buckets_[a].begin < buckets_[b].begin; });
  for (size_t j : by_begin_) begins_.push_back(buckets_[j].begin);
  summed_.assign(buckets_.size(), false);
  packed_ = DeviceBuffer(backend, std::max<int64_t>(zero_->owned_elements(), 1));
  spans_ = zero_->spans(program_.parameters(), nullptr, packed_.data());
  program_.place_gradients([this](int64_t offset) { return where(offset); });
}

int64_t GradientSync::gradient_bytes() const {
  int64_t n = packed_.size();
  for (const DeviceBuffer& w : windows_) n += w.size();
  return n * static_cast<int64_t>(sizeof(float));
}

float* GradientSync::bucket_data(size_t bucket) {
  if (windows_.empty()) return program_.gradients() + buckets_[bucket].begin;
  return windows_[window_of_[bucket]].data();
}

float* GradientSync::where(int64_t offset) {
  const size_t k = static_cast<size_t>(std::upper_bound(begins_.begin(), begins_.end(), offset) - begins_.begin());
  PIPESHARD_CHECK(k > 0, "a gradient offset before every bucket");
  const size_t j = by_begin_[k - 1];
  PIPESHARD_CHECK(occupant_[window_of_[j]] == static_cast<int>(j) && offset < buckets_[j].end,
                  "a gradient written outside its bucket's window");
  return windows_[window_of_[j]].data() + (offset - buckets_[j].begin);
}

std::vector<std::unique_ptr<Request>> GradientSync::launch(size_t bucket) {
  const Bucket& b = buckets_[bucket];
  float* data = bucket_data(bucket);
  std::vector<std::unique_ptr<Request>> out;
  if (!zero_) {
    out.push_back(replicas_.all_reduce_async(data, b.end - b.begin, ReduceOp::kSum));
    return out;
  }
  const ZeroShards::Piece& p = zero_->pieces()[bucket];
  // In place: this replica's block of the bucket becomes its sum.
  if (p.block > 0)
    out.push_back(replicas_.reduce_scatter_async(data, data + zero_->replica() * p.block, p.block, ReduceOp::kSum));
  if (p.end > p.tail)
    out.push_back(replicas_.all_reduce_async(data + (p.tail - p.begin), p.end - p.tail, ReduceOp::kSum));
  return out;
}

void GradientSync::reduce(size_t bucket) {
  const Bucket& b = buckets_[bucket];
  float* data = bucket_data(bucket);
  if (!zero_) {
    replicas_.all_reduce(data, b.end - b.begin, ReduceOp::kSum);
    return;
  }
  const ZeroShards::Piece& p = zero_->pieces()[bucket];
  if (p.block > 0) replicas_.reduce_scatter(data, data + zero_->replica() * p.block, p.block, ReduceOp::kSum);
  if (p.end > p.tail) replicas_.all_reduce(data + (p.tail - p.begin), p.end - p.tail, ReduceOp::kSum);
}

void GradientSync::gather_parameters() { zero_->gather(program_.parameters(), replicas_); }

void GradientSync::node_done(size_t node) {
  bool any = false;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (buckets_[i].ready_after == node && launched_early(buckets_, i) && !launched_[i]) {
      pending_[i] = launch(i);
      launched_[i] = true;
    }
    any = any || !pending_[i].empty();
  }
  if (any) replicas_.progress();  // between layers, the buckets launched move on
}

// Bucket `bucket`'s window, free and zeroed where the program adds.
void GradientSync::claim(size_t bucket) {
  int& occupant = occupant_[window_of_[bucket]];
  if (occupant == static_cast<int>(bucket)) return;
  if (occupant >= 0) {
    PIPESHARD_CHECK(launched_[occupant], "a gradient window taken before its bucket was reduced");
    retire(static_cast<size_t>(occupant));
  }
  occupant = static_cast<int>(bucket);
  const Bucket& b = buckets_[bucket];
  for (const auto& [begin, end] : program_.zeroed_gradient_ranges()) {
    const int64_t from = std::max(begin, b.begin), to = std::min(end, b.end);
    if (from < to) backend_->fill(windows_[window_of_[bucket]].data() + (from - b.begin), 0.0f, to - from);
  }
}

void GradientSync::node_starts(size_t node) {
  for (size_t j = 0; j < buckets_.size(); ++j) {
    if (buckets_[j].first_write == node) claim(j);
  }
}

// Waits for the bucket's reductions and adds its slice and tail into the packed sums (the
// step's first pass copies), freeing its window.
void GradientSync::retire(size_t bucket) {
  for (auto& request : pending_[bucket]) request->wait();
  pending_[bucket].clear();
  const ZeroShards::Piece& p = zero_->pieces()[bucket];
  const float* data = windows_[window_of_[bucket]].data();
  const auto add = [&](float* to, const float* from, int64_t n) {
    if (n == 0) return;
    if (summed_[bucket]) {
      backend_->axpy(to, 1.0f, from, n);
    } else {
      backend_->copy(to, from, n);
    }
  };
  add(packed_.data() + p.slice_at, data + zero_->replica() * p.block, p.block);
  add(packed_.data() + p.tail_at, data + (p.tail - p.begin), p.end - p.tail);
  summed_[bucket] = true;
  occupant_[window_of_[bucket]] = -1;
}

void GradientSync::pass_done() {
  const auto holds = [&](size_t j) { return occupant_[window_of_[j]] == static_cast<int>(j); };
  for (size_t j = 0; j < buckets_.size(); ++j) {  // the buckets node_done() leaves
    if (!launched_[j] && holds(j)) {
      reduce(j);
      launched_[j] = true;
    }
  }
  for (size_t j = 0; j < buckets_.size(); ++j) {  // those no node writes (unused parameters): zeros
    if (launched_[j]) continue;
    claim(j);
    reduce(j);
    launched_[j] = true;
  }
  for (size_t j = 0; j < buckets_.size(); ++j) {
    if (holds(j)) retire(j);
  }
  launched_.assign(buckets_.size(), false);
}

void GradientSync::reduce_rest() {
  if (!windows_.empty()) {  // every pass reduced its own (pass_done())
    summed_.assign(buckets_.size(), false);
    return;
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (!launched_[i]) reduce(i);
  }
  for (auto& requests : pending_) {
    for (auto& request : requests) request->wait();
    requests.clear();
  }
  launched_.assign(buckets_.size(), false);
}

}  // namespace pipeshard
