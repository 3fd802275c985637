#include "runtime/zero_shards.h"

#include <algorithm>

#include "common/check.h"

namespace pipeshard {

ZeroShards::ZeroShards(const std::vector<std::pair<int64_t, int64_t>>& buckets, int replica, int replicas)
    : replica_(replica), replicas_(replicas) {
  PIPESHARD_CHECK(replicas >= 1 && replica >= 0 && replica < replicas,
                  "replica " + std::to_string(replica) + " of " + std::to_string(replicas));
  for (const auto& [begin, end] : buckets) {
    Piece p;
    p.begin = begin;
    p.end = end;
    p.block = (end - begin) / replicas;
    p.tail = begin + p.block * replicas;
    pieces_.push_back(p);
  }
  for (Piece& p : pieces_) {
    p.slice_at = owned_elements_;
    ranges_.push_back({p.begin + replica_ * p.block, p.block});
    owned_elements_ += p.block;
  }
  for (Piece& p : pieces_) {
    p.tail_at = owned_elements_;
    ranges_.push_back({p.tail, p.end - p.tail});
    owned_elements_ += p.end - p.tail;
  }
}

std::vector<Optimizer::Span> ZeroShards::spans(float* params, float* grads, float* packed) const {
  std::vector<Optimizer::Span> out;
  int64_t at = 0;
  for (const Range& r : ranges_) {
    out.push_back({params + r.at, packed ? packed + at : grads + r.at, r.n});
    at += r.n;
  }
  return out;
}

std::vector<float> ZeroShards::to_whole(const std::vector<float>& owned, int64_t elements) const {
  PIPESHARD_CHECK(static_cast<int64_t>(owned.size()) == owned_elements_, "owned optimizer state's size");
  std::vector<float> whole(static_cast<size_t>(elements), 0.0f);
  int64_t from = 0;
  for (const Range& r : ranges_) {
    PIPESHARD_CHECK(r.at + r.n <= elements, "a ZeRO range beyond the buffer");
    std::copy(owned.begin() + from, owned.begin() + from + r.n, whole.begin() + r.at);
    from += r.n;
  }
  return whole;
}

std::vector<float> ZeroShards::to_owned(const std::vector<float>& whole) const {
  std::vector<float> owned;
  owned.reserve(static_cast<size_t>(owned_elements_));
  for (const Range& r : ranges_) {
    PIPESHARD_CHECK(r.at + r.n <= static_cast<int64_t>(whole.size()), "a ZeRO range beyond the whole state");
    owned.insert(owned.end(), whole.begin() + r.at, whole.begin() + r.at + r.n);
  }
  return owned;
}

void ZeroShards::gather(float* whole, Communicator& replicas) const {
  PIPESHARD_CHECK(replicas.size() == replicas_, "ZeRO's replicas");
  for (const Piece& p : pieces_) {
    if (p.block > 0) replicas.all_gather(whole + p.begin + replica_ * p.block, whole + p.begin, p.block);
  }
}

}  // namespace pipeshard
