// The timed prediction (predict.h): an event-driven run of the stages' lists.
#include "schedule/predict.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>

#include "schedule/simulation.h"

namespace pipeshard {
namespace {

void check_costs(const std::vector<double>& costs, int chunks, const char* what) {
  PIPESHARD_CHECK(
      static_cast<int>(costs.size()) == chunks,
      std::string(what) + " costs for " + std::to_string(costs.size()) + " chunks, not " + std::to_string(chunks));
  for (double c : costs) PIPESHARD_CHECK(c >= 0, std::string(what) + " cost " + std::to_string(c) + " below 0");
}

// What compute action `a` of model chunk `c` takes; 0 for the rest.
double cost_of(const PassCosts& costs, const Action& a, int c) {
  switch (a.kind) {
    case ActionKind::kForward: return costs.forward[c];
    case ActionKind::kBackward: return costs.backward_input[c] + costs.backward_weight[c];
    case ActionKind::kBackwardInput: return costs.backward_input[c];
    case ActionKind::kBackwardWeight: return costs.backward_weight[c];
    default: return 0;
  }
}

class Predictor {
 public:
  Predictor(const PipelineSchedule& sc, const PassCosts& costs) : sc_(sc), costs_(costs), next_(sc.stages, 0) {
    const int stages = sc.stages;
    p_.timeline.resize(stages);
    p_.busy.assign(stages, 0.0);
    p_.end.assign(stages, 0.0);
  }

  SchedulePrediction run() {
    // An action's times follow from its stage's previous action and, for a receive, its
    // send alone (stages share nothing else), so advancing the stages in any order, each
    // as far as its messages allow, gives every action the same times.
    for (bool progress = true; progress;) {
      progress = false;
      for (int s = 0; s < sc_.stages; ++s) {
        while (advance(s)) progress = true;
      }
    }
    PIPESHARD_CHECK(finished(), "predict_schedule: schedule '" + sc_.name + "' deadlocks: " + waits());
    double idle = 0;
    for (int s = 0; s < sc_.stages; ++s) {
      p_.step = std::max(p_.step, p_.end[s]);
      // Trainer::pipeline_bubble(): the stage's idle share of its own schedule time.
      if (p_.end[s] > 0) idle += 1.0 - p_.busy[s] / p_.end[s];
      p_.peak_in_flight.push_back(max_in_flight(sc_, s));
    }
    p_.bubble = idle / sc_.stages;
    return std::move(p_);
  }

 private:
  // Runs stage s's next action when it can complete; false when the stage has finished
  // or waits for a message not yet sent.
  bool advance(int s) {
    const auto& list = sc_.actions[s];
    if (next_[s] >= list.size()) return false;
    const Action& a = list[next_[s]];
    const double start = p_.end[s];
    double finish = start;
    const std::optional<Message> m = message_of(sc_, s, a);
    switch (action_kind_info(a.kind).role) {
      case ActionRole::kCompute: {
        const double cost = cost_of(costs_, a, sc_.chunk_of(s, a.chunk));
        finish += cost;
        p_.busy[s] += cost;
        break;
      }
      case ActionRole::kSend: arrival_[*m] = start + costs_.transfer; break;
      case ActionRole::kRecv: {
        auto it = arrival_.find(*m);
        if (it == arrival_.end()) return false;
        finish = std::max(start, it->second);
        break;
      }
      case ActionRole::kReduce: break;  // not the schedule's time
    }
    p_.timeline[s].push_back({start, finish});
    p_.end[s] = finish;
    ++next_[s];
    return true;
  }

  bool finished() const {
    for (int s = 0; s < sc_.stages; ++s) {
      if (next_[s] < sc_.actions[s].size()) return false;
    }
    return true;
  }

  std::string waits() const {
    std::string text;
    for (int s = 0; s < sc_.stages; ++s) {
      if (next_[s] >= sc_.actions[s].size()) continue;
      text += (text.empty() ? "" : ", ") +
              ("stage " + std::to_string(s) + " waits at " + action_label(sc_, s, sc_.actions[s][next_[s]]));
    }
    return text;
  }

  const PipelineSchedule& sc_;
  const PassCosts& costs_;
  std::vector<size_t> next_;           // [stages] index of the next action to run
  std::map<Message, double> arrival_;  // when each message sent so far is there for its receiver
  SchedulePrediction p_;
};

}  // namespace

PassCosts uniform_pass_costs(int chunks, double f, double i, double w, double transfer) {
  PassCosts costs;
  costs.forward.assign(chunks, f);
  costs.backward_input.assign(chunks, i);
  costs.backward_weight.assign(chunks, w);
  costs.transfer = transfer;
  return costs;
}

SchedulePrediction predict_schedule(const PipelineSchedule& schedule, const PassCosts& costs) {
  PIPESHARD_CHECK(static_cast<int>(schedule.actions.size()) == schedule.stages,
                  "schedule '" + schedule.name + "' lists actions for " + std::to_string(schedule.actions.size()) +
                      " stages, not " + std::to_string(schedule.stages));
  const int chunks = schedule.chunks();
  check_costs(costs.forward, chunks, "forward");
  check_costs(costs.backward_input, chunks, "input-gradient");
  check_costs(costs.backward_weight, chunks, "weight-gradient");
  PIPESHARD_CHECK(costs.transfer >= 0, "transfer time " + std::to_string(costs.transfer) + " below 0");
  return Predictor(schedule, costs).run();
}

}  // namespace pipeshard
