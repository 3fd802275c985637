// The lock-step simulator, and what is read off it: the grid and the step count.
#include "schedule/simulation.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

namespace pipeshard {
namespace {

// A message in flight: (the send's kind, the sending chunk, the micro-batch).
using Message = std::tuple<ActionKind, int, int>;

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
  // The model chunk of stage s's action `a`; -1 when `a` names no chunk of s (a schedule
  // the structural check would refuse still prints as far as it runs).
  int model_chunk(int s, const Action& a) const {
    const auto& held = sc_.stage_chunks[s];
    return a.chunk >= 0 && a.chunk < static_cast<int>(held.size()) ? held[a.chunk] : -1;
  }
  // Whether the stage holding model chunk `chunk` is about to run `kind` of it for micro-batch k.
  bool chunk_is_at(int chunk, ActionKind kind, int k) const {
    const PipelineSchedule::Place p = sc_.place_of(chunk);
    const Action* a = pending(p.stage);
    return a && *a == Action{kind, k, p.j};
  }

  bool can_run(int s) const {
    const Action* a = pending(s);
    if (!a) return false;
    const int k = a->micro_batch, c = model_chunk(s, *a);
    switch (a->kind) {
      case ActionKind::kSendActivation:
        return mode_ == SendMode::kBuffered || chunk_is_at(c + 1, ActionKind::kRecvActivation, k);
      case ActionKind::kSendGradient:
        return mode_ == SendMode::kBuffered || chunk_is_at(c - 1, ActionKind::kRecvGradient, k);
      case ActionKind::kRecvActivation: return can_receive({ActionKind::kSendActivation, c - 1, k});
      case ActionKind::kRecvGradient: return can_receive({ActionKind::kSendGradient, c + 1, k});
      default: return true;  // compute and R
    }
  }
  // A receive completes with a send issued in an earlier step (buffered only) or one its
  // peer issues in this step.
  bool can_receive(const Message& send) const {
    const auto& [kind, chunk, k] = send;
    if (c_in_range(chunk) && chunk_is_at(chunk, kind, k)) return true;
    if (mode_ == SendMode::kRendezvous) return false;
    auto it = in_transit_.find(send);
    return it != in_transit_.end() && it->second > 0;
  }
  bool c_in_range(int chunk) const { return chunk >= 0 && chunk < sc_.chunks(); }

  void complete(int s) {
    const Action& a = *pending(s);
    const int c = model_chunk(s, a);
    switch (a.kind) {
      case ActionKind::kSendActivation:
      case ActionKind::kSendGradient: ++in_transit_[{a.kind, c, a.micro_batch}]; break;
      case ActionKind::kRecvActivation: --in_transit_[{ActionKind::kSendActivation, c - 1, a.micro_batch}]; break;
      case ActionKind::kRecvGradient: --in_transit_[{ActionKind::kSendGradient, c + 1, a.micro_batch}]; break;
      default: break;
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
