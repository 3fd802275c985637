// The end of a finished run (tools/train/report.h).
#include "tools/train/report.h"

#include <algorithm>
#include <cstdint>

#include <fmt/core.h>

#include "common/host_memory.h"

namespace pipeshard::train_cli {

std::string peak_memory_line(const std::vector<std::string>& peaks, const std::string& device,
                             const Trainer::Memory& mine) {
  const char* where = device == "cuda" ? "GPU memory held by the backend" : "memory held by the backend";
  std::vector<int64_t> bytes;
  for (const std::string& p : peaks) bytes.push_back(std::stoll(p));
  const Program::Memory& m = mine.program;
  const int64_t other = mine.peak - m.total() - mine.optimizer;
  const std::string parts =
      fmt::format("weights {}, gradients {}, optimizer state {}, activations {}, activation gradients {}, other {}",
                  bytes_text(m.weights), bytes_text(m.gradients), bytes_text(mine.optimizer), bytes_text(m.activations),
                  bytes_text(m.activation_gradients), bytes_text(std::max<int64_t>(other, 0)));
  if (bytes.size() == 1) return fmt::format("peak {}: {} ({})", where, bytes_text(bytes[0]), parts);
  const auto [lo, hi] = std::minmax_element(bytes.begin(), bytes.end());
  return fmt::format("peak {} per process: {} at most (rank {}), {} at least (rank {}); rank 0: {}", where,
                     bytes_text(*hi), hi - bytes.begin(), bytes_text(*lo), lo - bytes.begin(), parts);
}

}  // namespace pipeshard::train_cli
