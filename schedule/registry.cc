#include "schedule/registry.h"

#include <algorithm>
#include <list>

namespace pipeshard {
namespace {

Action forward(int k) { return {ActionKind::kForward, k, 0}; }
Action backward(int k) { return {ActionKind::kBackward, k, 0}; }

// GPipe: all M forwards, then all M backwards, each in micro-batch order (as PyTorch's
// ScheduleGPipe), so gradients accumulate in the order 1F1B adds them too, which keeps
// the two bitwise-comparable.
ComputeOrder gpipe(int stages, int micro_batches) {
  ComputeOrder order(stages);
  for (auto& stage : order) {
    for (int k = 0; k < micro_batches; ++k) stage.push_back(forward(k));
    for (int k = 0; k < micro_batches; ++k) stage.push_back(backward(k));
  }
  return order;
}

// 1F1B (PipeDream-flush): stage s must have forwarded P − 1 − s micro-batches before the
// first gradient can come back to it; after that, each backward frees the slot a new
// forward uses, and the remaining backwards drain at the end.
ComputeOrder one_f_one_b(int stages, int micro_batches) {
  ComputeOrder order(stages);
  for (int s = 0; s < stages; ++s) {
    const int warmup = std::min(stages - 1 - s, micro_batches);
    int forwards = 0, backwards = 0;
    while (forwards < warmup) order[s].push_back(forward(forwards++));
    while (forwards < micro_batches) {
      order[s].push_back(forward(forwards++));
      order[s].push_back(backward(backwards++));
    }
    while (backwards < micro_batches) order[s].push_back(backward(backwards++));
  }
  return order;
}

// (P − 1)/(M + P − 1): the fill and drain of a pipeline of P stages over M micro-batches.
double fill_and_drain(int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / (micro_batches + stages - 1);
}

std::list<ScheduleInfo>& table() {
  static std::list<ScheduleInfo> rows = {
      {"gpipe", "GPipe", "all forwards, then all backwards; M micro-batches alive on every stage", 1, nullptr, gpipe,
       [](int, int m, int) { return m; }, fill_and_drain, "(P-1)/(M+P-1)"},
      {"1f1b", "1F1B", "one forward, one backward (PipeDream-flush); stage s keeps at most P - s micro-batches alive",
       1, nullptr, one_f_one_b, [](int p, int m, int s) { return std::min(p - s, m); }, fill_and_drain,
       "(P-1)/(M+P-1)"},
  };
  return rows;
}

}  // namespace

const ScheduleInfo* find_schedule(std::string_view name) {
  for (const ScheduleInfo& row : table()) {
    if (row.name == name) return &row;
  }
  return nullptr;
}

std::vector<std::string> schedule_names() {
  std::vector<std::string> names;
  for (const ScheduleInfo& row : table()) names.push_back(row.name);
  return names;
}

std::string schedule_names_text() {
  std::string text;
  for (const std::string& n : schedule_names()) text += (text.empty() ? "" : ", ") + n;
  return text;
}

Status check_schedule_name(std::string_view name) {
  if (find_schedule(name) != nullptr) return Status::ok();
  return Status::error("no pipeline schedule '" + std::string(name) + "' (there are " + schedule_names_text() + ")");
}

ScheduleRegistration::ScheduleRegistration(ScheduleInfo info) : name_(info.name) {
  PIPESHARD_CHECK(!name_.empty() && find_schedule(name_) == nullptr, "schedule '" + name_ + "' is registered already");
  PIPESHARD_CHECK(info.build && info.in_flight && info.bubble && info.chunks_per_stage >= 1,
                  "schedule '" + name_ + "' lacks a builder, an in-flight count or a bubble formula");
  table().push_back(std::move(info));
}

ScheduleRegistration::~ScheduleRegistration() {
  table().remove_if([&](const ScheduleInfo& row) { return row.name == name_; });
}

}  // namespace pipeshard
