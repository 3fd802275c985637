#include "schedule/schedule.h"

#include <algorithm>
#include <array>
#include <map>
#include <sstream>
#include <tuple>

namespace pipeshard {
namespace {

constexpr int kActionKinds = 6;

int index_of(ActionKind kind) { return static_cast<int>(kind); }

// ---- building ----

// Appends the actions of micro-batch k's forward (or backward) on stage s, with the
// transfers around it that the conventions in schedule.h prescribe.
void append_forward(std::vector<Action>& out, int s, int stages, int k) {
  if (s > 0) out.push_back({ActionKind::kRecvActivation, k});
  out.push_back({ActionKind::kForward, k});
  if (s < stages - 1) out.push_back({ActionKind::kSendActivation, k});
}

void append_backward(std::vector<Action>& out, int s, int stages, int k) {
  if (s < stages - 1) out.push_back({ActionKind::kRecvGradient, k});
  out.push_back({ActionKind::kBackward, k});
  if (s > 0) out.push_back({ActionKind::kSendGradient, k});
}

std::vector<Action> gpipe_stage(int s, int stages, int micro_batches) {
  std::vector<Action> out;
  for (int k = 0; k < micro_batches; ++k) append_forward(out, s, stages, k);
  for (int k = 0; k < micro_batches; ++k) append_backward(out, s, stages, k);
  return out;
}

std::vector<Action> one_f_one_b_stage(int s, int stages, int micro_batches) {
  std::vector<Action> out;
  // Stage s must have forwarded P − 1 − s micro-batches before the first gradient
  // can come back to it; after that, each backward frees the slot a new forward uses.
  const int warmup = std::min(stages - 1 - s, micro_batches);
  int forwards = 0, backwards = 0;
  while (forwards < warmup) append_forward(out, s, stages, forwards++);
  while (forwards < micro_batches) {
    append_forward(out, s, stages, forwards++);
    append_backward(out, s, stages, backwards++);
  }
  while (backwards < micro_batches) append_backward(out, s, stages, backwards++);
  return out;
}

// ---- structural checks ----

std::string name(ActionKind kind, int k) { return action_name({kind, k}); }

// Why stage s may not hold a transfer of `kind` at all; empty when it may.
std::string missing_peer(ActionKind kind, int s, int stages) {
  const bool towards_previous = kind == ActionKind::kRecvActivation || kind == ActionKind::kSendGradient;
  const bool towards_next = kind == ActionKind::kSendActivation || kind == ActionKind::kRecvGradient;
  if (towards_previous && s == 0) return "stage 0 has no previous stage";
  if (towards_next && s == stages - 1) return "it is the last stage";
  return "";
}

// Positions of every (kind, micro-batch) on one stage: at[kind][k] lists the indices
// into the stage's action list where that action occurs.
using Positions = std::array<std::vector<std::vector<int>>, kActionKinds>;

Result<Positions> positions_of(const std::vector<Action>& actions, int s, int stages, int micro_batches) {
  Positions at;
  for (auto& per_kind : at) per_kind.assign(micro_batches, {});
  for (int i = 0; i < static_cast<int>(actions.size()); ++i) {
    const Action& a = actions[i];
    if (a.micro_batch < 0 || a.micro_batch >= micro_batches) {
      return Status::error("stage " + std::to_string(s) + ": action " + std::to_string(i) + " (" +
                           action_name(a) + ") has a micro-batch outside 0.." +
                           std::to_string(micro_batches - 1));
    }
    std::string why = missing_peer(a.kind, s, stages);
    if (!why.empty()) {
      return Status::error("stage " + std::to_string(s) + ": " + action_name(a) + ", but " + why);
    }
    at[index_of(a.kind)][a.micro_batch].push_back(i);
  }
  return at;
}

// A transfer that must accompany a compute action: `transfer` comes before `compute`
// (a receive) or after it (a send).
struct TransferRule {
  ActionKind transfer;
  ActionKind compute;
  bool receive;  // true: before the compute; false: after it
};

constexpr std::array<TransferRule, 4> kTransferRules = {{
    {ActionKind::kRecvActivation, ActionKind::kForward, true},
    {ActionKind::kSendActivation, ActionKind::kForward, false},
    {ActionKind::kRecvGradient, ActionKind::kBackward, true},
    {ActionKind::kSendGradient, ActionKind::kBackward, false},
}};

Status check_computes(const Positions& at, int k) {
  for (ActionKind kind : {ActionKind::kForward, ActionKind::kBackward}) {
    const auto& where = at[index_of(kind)][k];
    if (where.empty()) return Status::error("no " + name(kind, k));
    if (where.size() > 1) {
      return Status::error(name(kind, k) + " appears " + std::to_string(where.size()) + " times");
    }
  }
  if (at[index_of(ActionKind::kBackward)][k][0] < at[index_of(ActionKind::kForward)][k][0]) {
    return Status::error(name(ActionKind::kBackward, k) + " comes before " + name(ActionKind::kForward, k));
  }
  return Status::ok();
}

Status check_transfers(const Positions& at, int s, int stages, int k) {
  for (const TransferRule& rule : kTransferRules) {
    if (!missing_peer(rule.transfer, s, stages).empty()) continue;  // none allowed, none found
    const auto& where = at[index_of(rule.transfer)][k];
    const int compute = at[index_of(rule.compute)][k][0];
    const std::string what = name(rule.transfer, k), side = rule.receive ? " before " : " after ";
    if (where.empty()) return Status::error("no " + what + side + name(rule.compute, k));
    if (where.size() > 1) {
      return Status::error(what + " appears " + std::to_string(where.size()) + " times");
    }
    if ((where[0] < compute) != rule.receive) {
      return Status::error(what + " comes" + (rule.receive ? " after " : " before ") + name(rule.compute, k));
    }
  }
  return Status::ok();
}

// Micro-batches of the `kind` transfers on one stage, in issue order.
std::vector<int> transfer_order(const std::vector<Action>& actions, ActionKind kind) {
  std::vector<int> order;
  for (const Action& a : actions) {
    if (a.kind == kind) order.push_back(a.micro_batch);
  }
  return order;
}

// Transfers on a link pair in issue order (NCCL matches them so), so the i-th send and
// the i-th receive must carry the same micro-batch.
Status check_link(const PipelineSchedule& sc, int from, int to, ActionKind send, ActionKind recv) {
  const std::vector<int> sent = transfer_order(sc.actions[from], send);
  const std::vector<int> received = transfer_order(sc.actions[to], recv);
  const std::string link = std::string(send == ActionKind::kSendActivation ? "activations" : "gradients") +
                           " stage " + std::to_string(from) + " -> stage " + std::to_string(to);
  for (size_t i = 0; i < std::min(sent.size(), received.size()); ++i) {
    if (sent[i] != received[i]) {
      return Status::error(link + ": send #" + std::to_string(i) + " is " + name(send, sent[i]) +
                           " but receive #" + std::to_string(i) + " is " + name(recv, received[i]) +
                           " (transfers on a link match in order)");
    }
  }
  return Status::ok();
}

Status check_structure(const PipelineSchedule& sc) {
  if (sc.stages < 1 || sc.micro_batches < 1) {
    return Status::error("a schedule needs at least one stage and one micro-batch (got " +
                         std::to_string(sc.stages) + " and " + std::to_string(sc.micro_batches) + ")");
  }
  if (static_cast<int>(sc.actions.size()) != sc.stages) {
    return Status::error("the schedule has action lists for " + std::to_string(sc.actions.size()) +
                         " stages, not " + std::to_string(sc.stages));
  }
  for (int s = 0; s < sc.stages; ++s) {
    Result<Positions> at = positions_of(sc.actions[s], s, sc.stages, sc.micro_batches);
    if (!at.is_ok()) return at.status();
    for (int k = 0; k < sc.micro_batches; ++k) {
      Status st = check_computes(*at, k);
      if (st.is_ok()) st = check_transfers(*at, s, sc.stages, k);
      if (!st.is_ok()) return st.with_context("stage " + std::to_string(s));
    }
  }
  for (int s = 0; s + 1 < sc.stages; ++s) {
    PIPESHARD_RETURN_IF_ERROR(
        check_link(sc, s, s + 1, ActionKind::kSendActivation, ActionKind::kRecvActivation));
    PIPESHARD_RETURN_IF_ERROR(
        check_link(sc, s + 1, s, ActionKind::kSendGradient, ActionKind::kRecvGradient));
  }
  return Status::ok();
}

// ---- simulation ----

// One run of the schedule in lock-step: grid[step][stage] is the index of the action
// that stage ran in that step, or -1. `status` says whether every stage finished.
struct Simulation {
  std::vector<std::vector<int>> grid;
  Status status;
};

class Simulator {
 public:
  Simulator(const PipelineSchedule& sc, SendMode mode)
      : sc_(sc), mode_(mode), next_(sc.actions.size(), 0) {}

  Simulation run() {
    Simulation sim;
    const int stages = static_cast<int>(sc_.actions.size());
    while (!finished()) {
      std::vector<int> row(stages, -1);
      bool progress = false;
      for (int s = 0; s < stages; ++s) {
        if (can_run(s)) row[s] = next_[s], progress = true;
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
  using Message = std::tuple<ActionKind, int, int>;  // (send kind, sending stage, micro-batch)

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
  bool peer_is_at(int peer, ActionKind kind, int k) const {
    const Action* a = pending(peer);
    return a && a->kind == kind && a->micro_batch == k;
  }

  bool can_run(int s) const {
    const Action* a = pending(s);
    if (!a) return false;
    const int k = a->micro_batch;
    switch (a->kind) {
      case ActionKind::kForward:
      case ActionKind::kBackward: return true;
      case ActionKind::kSendActivation:
        return mode_ == SendMode::kBuffered || peer_is_at(s + 1, ActionKind::kRecvActivation, k);
      case ActionKind::kSendGradient:
        return mode_ == SendMode::kBuffered || peer_is_at(s - 1, ActionKind::kRecvGradient, k);
      case ActionKind::kRecvActivation: return can_receive(s - 1, ActionKind::kSendActivation, k);
      case ActionKind::kRecvGradient: return can_receive(s + 1, ActionKind::kSendGradient, k);
    }
    return false;
  }
  // A receive completes with a send issued in an earlier step (buffered only) or one
  // its peer issues in this step.
  bool can_receive(int peer, ActionKind send, int k) const {
    if (peer_is_at(peer, send, k)) return true;
    if (mode_ == SendMode::kRendezvous) return false;
    auto it = in_transit_.find({send, peer, k});
    return it != in_transit_.end() && it->second > 0;
  }

  void complete(int s) {
    const Action& a = *pending(s);
    switch (a.kind) {
      case ActionKind::kSendActivation:
      case ActionKind::kSendGradient: ++in_transit_[{a.kind, s, a.micro_batch}]; break;
      case ActionKind::kRecvActivation: --in_transit_[{ActionKind::kSendActivation, s - 1, a.micro_batch}]; break;
      case ActionKind::kRecvGradient: --in_transit_[{ActionKind::kSendGradient, s + 1, a.micro_batch}]; break;
      default: break;
    }
    ++next_[s];
  }

  Status deadlock(int step) const {
    std::vector<std::string> waits;
    for (int s = 0; s < static_cast<int>(next_.size()); ++s) {
      if (const Action* a = pending(s)) waits.push_back("stage " + std::to_string(s) + " waits at " + action_name(*a));
    }
    std::string message = std::string("deadlock (") + send_mode_name(mode_) + ") at step " + std::to_string(step) + ": ";
    for (size_t i = 0; i < waits.size(); ++i) {
      if (i > 0) message += i + 1 == waits.size() ? " while " : ", ";
      message += waits[i];
    }
    return Status::error(message);
  }

  const PipelineSchedule& sc_;
  SendMode mode_;
  std::vector<size_t> next_;          // [stages] index of the next action to run
  std::map<Message, int> in_transit_; // sends issued and not yet received
};

// ---- printing ----

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
    for (const Action& a : sc.actions[s]) cell = std::max(cell, action_name(a).size());
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
      line += pad(i < 0 ? "." : action_name(sc.actions[s][i]), cell);
    }
    out << trim_right(line) << '\n';
  }
  if (!sim.status.is_ok()) out << sim.status.message() << '\n';
  return out.str();
}

}  // namespace

PipelineSchedule make_pipeline_schedule(ScheduleKind kind, int stages, int micro_batches) {
  PIPESHARD_CHECK(stages >= 1 && micro_batches >= 1,
                  "stages " + std::to_string(stages) + ", micro-batches " + std::to_string(micro_batches));
  PipelineSchedule sc{kind, stages, micro_batches, {}};
  for (int s = 0; s < stages; ++s) {
    sc.actions.push_back(kind == ScheduleKind::kGPipe ? gpipe_stage(s, stages, micro_batches)
                                                      : one_f_one_b_stage(s, stages, micro_batches));
  }
  return sc;
}

Status check_pipeline_schedule(const PipelineSchedule& schedule, SendMode mode) {
  PIPESHARD_RETURN_IF_ERROR(check_structure(schedule));
  return Simulator(schedule, mode).run().status;
}

std::string format_pipeline_schedule(const PipelineSchedule& schedule, SendMode mode) {
  return render_grid(schedule, Simulator(schedule, mode).run());
}

Result<int> pipeline_schedule_steps(const PipelineSchedule& schedule, SendMode mode) {
  Simulation sim = Simulator(schedule, mode).run();
  if (!sim.status.is_ok()) return sim.status;
  return static_cast<int>(sim.grid.size());
}

int max_in_flight(const PipelineSchedule& schedule, int stage) {
  PIPESHARD_CHECK(stage >= 0 && stage < static_cast<int>(schedule.actions.size()));
  int in_flight = 0, most = 0;
  for (const Action& a : schedule.actions[stage]) {
    if (a.kind == ActionKind::kForward) most = std::max(most, ++in_flight);
    if (a.kind == ActionKind::kBackward) --in_flight;
  }
  return most;
}

std::string action_name(const Action& action) {
  static constexpr std::array<const char*, kActionKinds> kPrefix = {"F", "B", "sA", "rA", "sG", "rG"};
  return kPrefix[index_of(action.kind)] + std::to_string(action.micro_batch);
}

const char* schedule_kind_name(ScheduleKind kind) {
  return kind == ScheduleKind::kGPipe ? "gpipe" : "1f1b";
}

const char* send_mode_name(SendMode mode) {
  return mode == SendMode::kBuffered ? "buffered sends" : "rendezvous sends";
}

}  // namespace pipeshard
