// The lock-step simulator, and what is read off it: the grid and the step count.
#include "schedule/simulation.h"

#include <algorithm>
#include <map>
#include <sstream>

namespace pipeshard {
namespace {

class Simulator {
 public:
  Simulator(const PipelineSchedule& sc, SendMode mode) : sc_(sc), mode_(mode), next_(sc.actions.size(), 0) {}

  Simulation run() {
    Simulation sim;
    const int stages = static_cast<int>(sc_.actions.size());
    while (!finished()) {
      std::vector<int> row(stages, -1);
      bool progress = false;
      for (int s = 0; s < stages; ++s) {
        if (can_run(s)) row[s] = static_cast<int>(next_[s]), progress = true;
      }
      if (!progress) {
        sim.status = deadlock(static_cast<int>(sim.grid.size()));
        return sim;
      }
      for (int s = 0; s < stages; ++s) {
        if (row[s] >= 0) complete(s);
      }
      sim.grid.push_back(std::move(row));
    }
    return sim;
  }

 private:
  bool finished() const {
    for (size_t s = 0; s < next_.size(); ++s) {
      if (next_[s] < sc_.actions[s].size()) return false;
    }
    return true;
  }
  const Action* pending(int s) const {
    if (s < 0 || s >= static_cast<int>(next_.size()) || next_[s] >= sc_.actions[s].size()) return nullptr;
    return &sc_.actions[s][next_[s]];
  }
  // Whether stage `s` is about to run the `role` end of message `m`.
  bool is_at(int s, const Message& m, ActionRole role) const {
    const Action* a = pending(s);
    return a && action_kind_info(a->kind).role == role && message_of(sc_, s, *a) == m;
  }
  int stage_of(int chunk) const { return sc_.place_of(chunk).stage; }

  bool can_run(int s) const {
    const Action* a = pending(s);
    if (!a) return false;
    const std::optional<Message> m = message_of(sc_, s, *a);
    if (!m) return true;  // compute and R
    if (action_kind_info(a->kind).role == ActionRole::kSend) {
      return mode_ == SendMode::kBuffered || is_at(stage_of(m->to), *m, ActionRole::kRecv);
    }
    // A receive completes with a send issued in an earlier step (buffered only) or one its
    // peer issues in this step.
    if (is_at(stage_of(m->from), *m, ActionRole::kSend)) return true;
    if (mode_ == SendMode::kRendezvous) return false;
    auto it = in_transit_.find(*m);
    return it != in_transit_.end() && it->second > 0;
  }

  void complete(int s) {
    const Action& a = *pending(s);
    if (const std::optional<Message> m = message_of(sc_, s, a)) {
      in_transit_[*m] += action_kind_info(a.kind).role == ActionRole::kSend ? 1 : -1;
    }
    ++next_[s];
  }

  Status deadlock(int step) const {
    std::vector<std::string> waits;
    for (int s = 0; s < static_cast<int>(next_.size()); ++s) {
      if (const Action* a = pending(s)) {
        waits.push_back("stage " + std::to_string(s) + " waits at " + action_label(sc_, s, *a));
      }
    }
    std::string message =
        std::string("deadlock (") + send_mode_name(mode_) + ") at step " + std::to_string(step) + ": ";
    for (size_t i = 0; i < waits.size(); ++i) {
      if (i > 0) message += i + 1 == waits.size() ? " while " : ", ";
      message += waits[i];
    }
    return Status::error(message);
  }

  const PipelineSchedule& sc_;
  SendMode mode_;
  std::vector<size_t> next_;           // [stages] index of the next action to run
  std::map<Message, int> in_transit_;  // sends issued and not yet received
};

std::string pad(const std::string& text, size_t width) {
  return text.size() >= width ? text : text + std::string(width - text.size(), ' ');
}

std::string trim_right(std::string line) {
  while (!line.empty() && line.back() == ' ') line.pop_back();
  return line;
}

std::string render_grid(const PipelineSchedule& sc, const Simulation& sim) {
  const int stages = static_cast<int>(sc.actions.size());
  size_t cell = 0;
  for (int s = 0; s < stages; ++s) {
    cell = std::max(cell, ("stage" + std::to_string(s)).size());
    for (const Action& a : sc.actions[s]) cell = std::max(cell, action_label(sc, s, a).size());
  }
  cell += 2;
  const size_t step_width = std::max<size_t>(4, std::to_string(sim.grid.size()).size()) + 2;
  std::ostringstream out;
  std::string header = pad("step", step_width);
  for (int s = 0; s < stages; ++s) header += pad("stage" + std::to_string(s), cell);
  out << trim_right(header) << '\n';
  for (size_t step = 0; step < sim.grid.size(); ++step) {
    std::string line = pad(std::to_string(step), step_width);
    for (int s = 0; s < stages; ++s) {
      const int i = sim.grid[step][s];
      line += pad(i < 0 ? "." : action_label(sc, s, sc.actions[s][i]), cell);
    }
    out << trim_right(line) << '\n';
  }
  if (!sim.status.is_ok()) out << sim.status.message() << '\n';
  return out.str();
}

}  // namespace

std::optional<Message> message_of(const PipelineSchedule& schedule, int stage, const Action& a) {
  const auto& held = schedule.stage_chunks[stage];
  const int c = a.chunk >= 0 && a.chunk < static_cast<int>(held.size()) ? held[a.chunk] : -1;
  const int k = a.micro_batch;
  switch (a.kind) {
    case ActionKind::kSendActivation: return Message{ActionKind::kSendActivation, c, c + 1, k};
    case ActionKind::kRecvActivation: return Message{ActionKind::kSendActivation, c - 1, c, k};
    case ActionKind::kSendGradient: return Message{ActionKind::kSendGradient, c, c - 1, k};
    case ActionKind::kRecvGradient: return Message{ActionKind::kSendGradient, c + 1, c, k};
    default: return std::nullopt;
  }
}

Simulation simulate(const PipelineSchedule& schedule, SendMode mode) { return Simulator(schedule, mode).run(); }

std::string format_pipeline_schedule(const PipelineSchedule& schedule, SendMode mode) {
  return render_grid(schedule, simulate(schedule, mode));
}

Result<int> pipeline_schedule_steps(const PipelineSchedule& schedule, SendMode mode) {
  Simulation sim = simulate(schedule, mode);
  if (!sim.status.is_ok()) return sim.status;
  return static_cast<int>(sim.grid.size());
}

}  // namespace pipeshard
