// ZB-V (schedule/builders.h).
//
// The model is cut into 2P chunks laid out as a V: stage s holds chunk s on the way down
// (its chunk j = 0) and chunk 2P − 1 − s on the way back up (j = 1), so stage 0 holds the
// first and the last chunk and computes the loss, and stage P − 1 holds chunks P − 1 and
// P, which hand over in place. A micro-batch's forward goes down the stages and back up;
// its input gradient (I) goes down the up-chunks and back up the down-chunks.
//
// Forwards and input halves run in a fixed order. In round n = 0, 1, ... stage s runs, of
// the micro-batches that exist:
//   F of its down chunk for micro-batch n,
//   F of its up chunk for n − (P − 1 − s),
//   I of its up chunk for n − (P − 1),
//   I of its down chunk for n − (2P − 2 − s).
// The lags are the least that keep one round's six passes (these four and two W's) free of
// waiting once the pipeline is full, rounds starting one pass later on each stage down the
// V: a micro-batch's forward through the up chunk arrives from stage s + 1 one round after
// stage s + 1 ran it (the up way runs against the rounds' stagger), and so does its input
// gradient through the down chunk; the down way runs with it, no round later.
//
// The weight halves (W), each in the order of its I — so every chunk's in micro-batch order,
// and every weight gradient adds up its micro-batches in one process's order — are placed
// by running the schedule in unit time (every pass one unit, transfers free): a stage runs
// its next fixed action when its inputs are there, except a forward that would take it past
// 2P micro-batches alive (from F to W, over both chunks), and otherwise its oldest W owed;
// the W's still owed end the list. So W's fill what would be waits — at the start, while
// the pipeline fills; at the end, while the last input gradients climb back up the V — and
// run in the steady state as soon as the memory limit asks for them.
//
// It is neither the paper's hand-drawn ZB-V nor the greedy search of its repository
// (sail-sg/zero-bubble-pipeline-parallelism, zbv.py), but keeps their two promises, which
// tests/schedule/multi_chunk_schedule_test.cc checks for P ≤ 6 and M from P to 3P: at most
// 2P chunk-micro-batches alive on every stage, each chunk half a stage's layers, so the
// activations of P whole micro-batches, which is 1F1B's peak (its stage 0); and at unit
// costs a step of 6M + P − 1, which no order beats: stage P − 1 cannot start before chunk
// P − 1's first forward, P − 1 passes in, and has 6M passes of work. With fewer
// micro-batches than stages the same order is correct but idles more than that (the rounds
// never fill), which is why the row refuses M < P.
#include <algorithm>
#include <deque>
#include <vector>

#include "schedule/builders.h"

namespace pipeshard {
namespace {

constexpr int kUnknown = -1;  // a pass that has not run

// The model chunk of stage s's chunk j.
int v_chunk(int stages, int stage, int j) { return j == 0 ? stage : 2 * stages - 1 - stage; }

// Stage s's forwards and input halves in the fixed order above.
std::vector<Action> fixed_order(int stages, int micro_batches, int s) {
  struct Pass {
    ActionKind kind;
    int lag;  // rounds behind the round's number
    int j;
  };
  const Pass passes[] = {{ActionKind::kForward, 0, 0},
                         {ActionKind::kForward, stages - 1 - s, 1},
                         {ActionKind::kBackwardInput, stages - 1, 1},
                         {ActionKind::kBackwardInput, 2 * stages - 2 - s, 0}};
  std::vector<Action> order;
  for (int n = 0; n < micro_batches + 2 * stages - 1 - s; ++n) {  // through the last I
    for (const Pass& pass : passes) {
      const int k = n - pass.lag;
      if (k >= 0 && k < micro_batches) order.push_back({pass.kind, k, pass.j});
    }
  }
  return order;
}

// The unit-time run that places the W's.
class WeightPlacement {
 public:
  WeightPlacement(int stages, int micro_batches)
      : p_(stages), m_(micro_batches), forward_done_(2 * stages, std::vector<int>(micro_batches, kUnknown)),
        input_done_(forward_done_), order_(stages), next_(stages, 0), alive_(stages, 0), owed_(stages) {
    for (int s = 0; s < p_; ++s) fixed_.push_back(fixed_order(p_, m_, s));
  }

  ComputeOrder run() {
    int left = 6 * m_ * p_;
    for (int t = 0; left > 0; ++t) {
      std::vector<std::pair<int, Action>> ran;  // (stage, action) of this step
      for (int s = 0; s < p_; ++s) {
        if (const Action* a = next_action(s, t)) ran.emplace_back(s, *a);
      }
      // A pass's output is there for others from the next step on.
      PIPESHARD_CHECK(!ran.empty(), "zb-v: no stage can run at step " + std::to_string(t));
      for (const auto& [s, a] : ran) finish(s, a, t + 1);
      left -= static_cast<int>(ran.size());
    }
    return std::move(order_);
  }

 private:
  // Stage s's action at step t (appended to its order), or null when it waits.
  const Action* next_action(int s, int t) {
    if (next_[s] < fixed_[s].size()) {
      const Action& a = fixed_[s][next_[s]];
      const bool room = a.kind != ActionKind::kForward || alive_[s] < 2 * p_;
      if (room && inputs_there(s, a, t)) {
        ++next_[s];
        if (a.kind == ActionKind::kForward) ++alive_[s];
        order_[s].push_back(a);
        return &order_[s].back();
      }
    }
    if (owed_[s].empty()) return nullptr;
    order_[s].push_back(owed_[s].front());
    owed_[s].pop_front();
    --alive_[s];
    return &order_[s].back();
  }

  bool done_by(const std::vector<std::vector<int>>& done, int chunk, int k, int t) const {
    return done[chunk][k] != kUnknown && done[chunk][k] <= t;
  }

  bool inputs_there(int s, const Action& a, int t) const {
    const int c = v_chunk(p_, s, a.chunk);
    if (a.kind == ActionKind::kForward) return c == 0 || done_by(forward_done_, c - 1, a.micro_batch, t);
    const bool last = c == 2 * p_ - 1;
    return done_by(forward_done_, c, a.micro_batch, t) && (last || done_by(input_done_, c + 1, a.micro_batch, t));
  }

  void finish(int s, const Action& a, int when) {
    const int c = v_chunk(p_, s, a.chunk);
    if (a.kind == ActionKind::kForward) forward_done_[c][a.micro_batch] = when;
    if (a.kind == ActionKind::kBackwardInput) {
      input_done_[c][a.micro_batch] = when;
      owed_[s].push_back({ActionKind::kBackwardWeight, a.micro_batch, a.chunk});
    }
  }

  const int p_, m_;
  std::vector<std::vector<int>> forward_done_, input_done_;  // [model chunk][micro-batch] step its output is there
  std::vector<std::vector<Action>> fixed_;                   // [stage] the fixed order
  ComputeOrder order_;                                       // [stage] what ran, in order
  std::vector<size_t> next_;                                 // [stage] next index into fixed_
  std::vector<int> alive_;                                   // [stage] micro-batches from F to W
  std::vector<std::deque<Action>> owed_;                     // [stage] W's owed, oldest first
};

}  // namespace

std::vector<int> zero_bubble_v_placement(int stages) {
  std::vector<int> chunk_stage(2 * stages);
  for (int s = 0; s < stages; ++s) {
    chunk_stage[v_chunk(stages, s, 0)] = s;
    chunk_stage[v_chunk(stages, s, 1)] = s;
  }
  return chunk_stage;
}

ComputeOrder zero_bubble_v(int stages, int micro_batches) {
  PIPESHARD_CHECK(stages >= 1 && micro_batches >= 1,
                  "zb-v of " + std::to_string(stages) + " stages, " + std::to_string(micro_batches) + " micro-batches");
  return WeightPlacement(stages, micro_batches).run();
}

int zero_bubble_v_in_flight(int stages, int micro_batches) { return 2 * std::min(stages, micro_batches); }

double zero_bubble_v_bubble(int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / (6 * micro_batches + stages - 1);
}

Status zero_bubble_v_accepts(int stages, int micro_batches) {
  if (micro_batches >= stages) return Status::ok();
  return Status::invalid("micro_batches", "zb-v needs at least as many micro-batches (" +
                                              std::to_string(micro_batches) + ") as stages (" + std::to_string(stages) +
                                              ")");
}

}  // namespace pipeshard
