#include "ir/buffer_sharing.h"

#include <algorithm>
#include <numeric>

namespace pipeshard {

SharedBuffers share_buffers(std::span<const BufferLife> values) {
  SharedBuffers out;
  out.buffer.assign(values.size(), -1);
  std::vector<std::vector<std::pair<int, int>>> held;  // [buffer]: the spans of its values
  for (size_t v = 0; v < values.size(); ++v) {
    const BufferLife& mine = values[v];
    auto free = [&](size_t b) {
      for (const auto& [first, last] : held[b])
        for (const auto& [my_first, my_last] : mine.spans)
          if (first <= my_last && my_first <= last) return false;
      return true;
    };
    int b = best_buffer(out.sizes, mine.size, free);
    if (b < 0) {  // all in use
      b = static_cast<int>(out.sizes.size());
      out.sizes.push_back(0);
      held.emplace_back();
    }
    out.sizes[b] = std::max(out.sizes[b], mine.size);
    held[b].insert(held[b].end(), mine.spans.begin(), mine.spans.end());
    out.buffer[v] = b;
  }
  return out;
}

SharedBuffers share_gradient_buffers(std::span<const GradientSpan> spans) {
  std::vector<int> order(spans.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return spans[a].first_writer > spans[b].first_writer; });
  std::vector<BufferLife> lives;
  for (int s : order) lives.push_back({{{spans[s].producer, spans[s].first_writer}}, spans[s].size});
  const SharedBuffers ordered = share_buffers(lives);
  SharedBuffers out{std::vector<int>(spans.size()), ordered.sizes};
  for (size_t k = 0; k < order.size(); ++k) out.buffer[order[k]] = ordered.buffer[k];
  return out;
}

}  // namespace pipeshard
