// The lowering pass (schedule.h: the transfers and R every schedule needs alike), and the
// figures read off a lowered schedule.
#include <algorithm>
#include <map>
#include <utility>

#include "schedule/registry.h"
#include "schedule/schedule.h"

namespace pipeshard {

int PipelineSchedule::chunks() const {
  int n = 0;
  for (const auto& held : stage_chunks) n += static_cast<int>(held.size());
  return n;
}

bool PipelineSchedule::backward_whole_in_one_chunk() const {
  if (names_chunks()) return false;
  for (const auto& list : actions) {
    if (splits_backward(list)) return false;
  }
  return true;
}

PipelineSchedule::Place PipelineSchedule::place_of(int chunk) const {
  for (int s = 0; s < static_cast<int>(stage_chunks.size()); ++s) {
    for (int j = 0; j < static_cast<int>(stage_chunks[s].size()); ++j) {
      if (stage_chunks[s][j] == chunk) return {s, j};
    }
  }
  return {};
}

std::string action_label(const PipelineSchedule& schedule, int stage, const Action& action) {
  if (!schedule.names_chunks()) return action_name(action);
  Action global = action;
  const auto& held = schedule.stage_chunks[stage];
  global.chunk = action.chunk >= 0 && action.chunk < static_cast<int>(held.size()) ? held[action.chunk] : -1;
  return action_name(global, true);
}

namespace {

// The compute `a` on stage `s`, with the transfers around it that the conventions in
// schedule.h prescribe.
void append_lowered(std::vector<Action>& out, const Action& a, const PipelineSchedule& sc, int s) {
  const int c = sc.chunk_of(s, a.chunk), last = sc.chunks() - 1;
  const bool previous_elsewhere = c > 0 && sc.place_of(c - 1).stage != s;
  const bool next_elsewhere = c < last && sc.place_of(c + 1).stage != s;
  switch (a.kind) {
    case ActionKind::kForward:
      if (previous_elsewhere) out.push_back({ActionKind::kRecvActivation, a.micro_batch, a.chunk});
      out.push_back(a);
      if (next_elsewhere) out.push_back({ActionKind::kSendActivation, a.micro_batch, a.chunk});
      return;
    case ActionKind::kBackward:
    case ActionKind::kBackwardInput:
      if (next_elsewhere) out.push_back({ActionKind::kRecvGradient, a.micro_batch, a.chunk});
      out.push_back(a);
      if (previous_elsewhere) out.push_back({ActionKind::kSendGradient, a.micro_batch, a.chunk});
      return;
    default: out.push_back(a); return;
  }
}

}  // namespace

PipelineSchedule lower_schedule(std::string name, int stages, int micro_batches, const std::vector<int>& chunk_stage,
                                const ComputeOrder& compute, const LowerOptions& options) {
  PIPESHARD_CHECK(stages >= 1 && micro_batches >= 1 && static_cast<int>(compute.size()) == stages,
                  "stages " + std::to_string(stages) + ", micro-batches " + std::to_string(micro_batches) +
                      ", compute lists " + std::to_string(compute.size()));
  PipelineSchedule sc;
  sc.name = std::move(name);
  sc.stages = stages;
  sc.micro_batches = micro_batches;
  sc.stage_chunks.assign(stages, {});
  for (int c = 0; c < static_cast<int>(chunk_stage.size()); ++c) {
    PIPESHARD_CHECK(chunk_stage[c] >= 0 && chunk_stage[c] < stages,
                    "chunk " + std::to_string(c) + " on stage " + std::to_string(chunk_stage[c]));
    sc.stage_chunks[chunk_stage[c]].push_back(c);
  }
  sc.actions.resize(stages);
  for (int s = 0; s < stages; ++s) {
    PIPESHARD_CHECK(!sc.stage_chunks[s].empty(), "stage " + std::to_string(s) + " holds no chunk");
    // Where each chunk's last gradient pass is, so R can follow it (and its send).
    std::map<int, size_t> last_gradient;
    for (size_t i = 0; i < compute[s].size(); ++i) {
      if (action_kind_info(compute[s][i].kind).weight_gradient) last_gradient[compute[s][i].chunk] = i;
    }
    for (size_t i = 0; i < compute[s].size(); ++i) {
      const Action& a = compute[s][i];
      PIPESHARD_CHECK(a.chunk >= 0 && a.chunk < static_cast<int>(sc.stage_chunks[s].size()),
                      "stage " + std::to_string(s) + ": " + action_name(a, true) + " of a chunk it does not hold");
      append_lowered(sc.actions[s], a, sc, s);
      auto it = last_gradient.find(a.chunk);
      if (options.reduce_gradients && it != last_gradient.end() && it->second == i) {
        sc.actions[s].push_back({ActionKind::kReduceGradients, -1, a.chunk});
      }
    }
  }
  return sc;
}

PipelineSchedule make_pipeline_schedule(std::string_view name, int stages, int micro_batches,
                                        const LowerOptions& options, int virtual_stages) {
  const Status counts = check_schedule_counts(name, stages, micro_batches, virtual_stages);
  PIPESHARD_CHECK(counts.is_ok(), counts.message());
  const ScheduleInfo& info = *find_schedule(name);
  const int v = chunks_per_stage_of(info, virtual_stages);
  std::vector<int> chunk_stage;
  if (info.placement) {
    chunk_stage = info.placement(stages, v);
  } else {
    for (int c = 0; c < stages * v; ++c) chunk_stage.push_back(c % stages);
  }
  PIPESHARD_CHECK(static_cast<int>(chunk_stage.size()) == stages * v, "schedule '" + info.name + "' places " +
                                                                          std::to_string(chunk_stage.size()) +
                                                                          " chunks, not " + std::to_string(stages * v));
  return lower_schedule(info.name, stages, micro_batches, chunk_stage, info.build(stages, micro_batches, v), options);
}

namespace {

// Most micro-batches of the chunks `counts` accepts alive at once on `stage`: a forward
// opens one, the backward that finishes it (B, or W after I) closes it.
template <typename Counts>
int most_alive(const PipelineSchedule& schedule, int stage, Counts&& counts) {
  PIPESHARD_CHECK(stage >= 0 && stage < static_cast<int>(schedule.actions.size()), "stage " + std::to_string(stage));
  int alive = 0, most = 0;
  for (const Action& a : schedule.actions[stage]) {
    if (!counts(a.chunk)) continue;
    if (a.kind == ActionKind::kForward) most = std::max(most, ++alive);
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) --alive;
  }
  return most;
}

}  // namespace

int max_in_flight(const PipelineSchedule& schedule, int stage) {
  return most_alive(schedule, stage, [](int) { return true; });
}

int max_in_flight_of_chunk(const PipelineSchedule& schedule, int stage, int j) {
  return most_alive(schedule, stage, [j](int c) { return c == j; });
}

int last_gradient_action(const PipelineSchedule& schedule, int stage, int j) {
  const auto& list = schedule.actions[stage];
  for (int i = static_cast<int>(list.size()); i-- > 0;) {
    if (list[i].chunk == j && action_kind_info(list[i].kind).weight_gradient) return i;
  }
  return -1;
}

const char* send_mode_name(SendMode mode) {
  return mode == SendMode::kBuffered ? "buffered sends" : "rendezvous sends";
}

}  // namespace pipeshard
