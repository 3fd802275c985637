// check_pipeline_schedule(): the structural rules of schedule.h, then the simulation.
#include <algorithm>
#include <map>
#include <tuple>

#include "schedule/schedule.h"
#include "schedule/simulation.h"

namespace pipeshard {
namespace {

// Where on one stage each (chunk, kind, micro-batch) occurs: indices into its action
// list. R is kept under micro-batch -1.
using Key = std::tuple<int, ActionKind, int>;
using Positions = std::map<Key, std::vector<int>>;

class StructureCheck {
 public:
  explicit StructureCheck(const PipelineSchedule& sc) : sc_(sc), chunks_named_(sc.names_chunks()) {}

  Status run() {
    if (sc_.stages < 1 || sc_.micro_batches < 1) {
      return Status::error("a schedule needs at least one stage and one micro-batch (got " +
                           std::to_string(sc_.stages) + " and " + std::to_string(sc_.micro_batches) + ")");
    }
    if (static_cast<int>(sc_.actions.size()) != sc_.stages) {
      return Status::error("the schedule has action lists for " + std::to_string(sc_.actions.size()) + " stages, not " +
                           std::to_string(sc_.stages));
    }
    PIPESHARD_RETURN_IF_ERROR(check_placement());
    std::vector<std::pair<int, int>> reducing, silent;  // (stage, chunk j) with an R, and without
    for (s_ = 0; s_ < sc_.stages; ++s_) {
      const std::string here = "stage " + std::to_string(s_);
      Result<Positions> at = positions_of(s_);
      if (!at.is_ok()) return at.status();
      for (int j = 0; j < static_cast<int>(sc_.stage_chunks[s_].size()); ++j) {
        for (int k = 0; k < sc_.micro_batches; ++k) {
          Status st = check_computes(*at, j, k);
          if (st.is_ok()) st = check_transfers(*at, s_, j, k);
          if (st.is_ok()) st = check_neighbour_on_stage(*at, s_, j, k);
          if (!st.is_ok()) return st.with_context(here);
        }
        Result<bool> reduces = check_reduce(*at, j);
        if (!reduces.is_ok()) return reduces.status().with_context(here);
        (*reduces ? reducing : silent).emplace_back(s_, j);
      }
    }
    if (!reducing.empty() && !silent.empty()) {
      s_ = silent[0].first;
      return Status::error(
          "stage " + std::to_string(s_) + ": no " + name({ActionKind::kReduceGradients, -1, silent[0].second}) +
          " after the last gradient pass, which other " + (chunks_named_ ? "chunks" : "stages") + " have");
    }
    for (int from = 0; from < sc_.stages; ++from) {
      for (int to = 0; to < sc_.stages; ++to) {
        if (from == to) continue;
        PIPESHARD_RETURN_IF_ERROR(check_link(from, to, ActionKind::kSendActivation));
        PIPESHARD_RETURN_IF_ERROR(check_link(from, to, ActionKind::kSendGradient));
      }
    }
    return Status::ok();
  }

 private:
  // Names as the grid prints them (action_label()): on stage s_, the stage being checked.
  std::string name(const Action& a) const { return action_label(sc_, s_, a); }
  std::string name(ActionKind kind, int k, int j) const { return name(Action{kind, k, j}); }
  std::string unit() const { return chunks_named_ ? "chunk" : "stage"; }
  int stage_of(int chunk) const { return sc_.place_of(chunk).stage; }

  // Every model chunk 0 .. C − 1 on exactly one stage, and every stage holding one.
  Status check_placement() const {
    if (static_cast<int>(sc_.stage_chunks.size()) != sc_.stages) {
      return Status::error("the schedule places chunks on " + std::to_string(sc_.stage_chunks.size()) +
                           " stages, not " + std::to_string(sc_.stages));
    }
    std::vector<int> seen(sc_.chunks(), 0);
    for (int s = 0; s < sc_.stages; ++s) {
      if (sc_.stage_chunks[s].empty()) return Status::error("stage " + std::to_string(s) + " holds no chunk");
      for (int c : sc_.stage_chunks[s]) {
        if (c < 0 || c >= sc_.chunks() || seen[c]++ > 0) {
          return Status::error("stage " + std::to_string(s) + " holds chunk " + std::to_string(c) + ": chunks 0.." +
                               std::to_string(sc_.chunks() - 1) + " go on one stage each");
        }
      }
    }
    return Status::ok();
  }

  // Why chunk c's stage s may not hold a transfer of `kind` at all; empty when it may.
  std::string missing_peer(ActionKind kind, int c, int s) const {
    const bool towards_previous = kind == ActionKind::kRecvActivation || kind == ActionKind::kSendGradient;
    const bool towards_next = kind == ActionKind::kSendActivation || kind == ActionKind::kRecvGradient;
    const int last = sc_.chunks() - 1;
    if (towards_previous && c == 0) return unit() + " 0 has no previous " + unit();
    if (towards_next && c == last) return "it is the last " + unit();
    if (towards_previous && stage_of(c - 1) == s) return "chunk " + std::to_string(c - 1) + " is on this stage";
    if (towards_next && stage_of(c + 1) == s) return "chunk " + std::to_string(c + 1) + " is on this stage";
    return "";
  }

  Result<Positions> positions_of(int s) const {
    Positions at;
    const auto& actions = sc_.actions[s];
    for (int i = 0; i < static_cast<int>(actions.size()); ++i) {
      const Action& a = actions[i];
      const int held = static_cast<int>(sc_.stage_chunks[s].size());
      const bool chunk_held = a.chunk >= 0 && a.chunk < held;
      const std::string here = "stage " + std::to_string(s) + ": action " + std::to_string(i) + " (" +
                               (chunk_held ? name(a) : action_name(a)) + ")";
      if (!chunk_held) {
        return Status::error(here + " names its chunk " + std::to_string(a.chunk) + ", but the stage holds " +
                             std::to_string(held));
      }
      const bool reduce = a.kind == ActionKind::kReduceGradients;
      if (!reduce && (a.micro_batch < 0 || a.micro_batch >= sc_.micro_batches)) {
        return Status::error(here + " has a micro-batch outside 0.." + std::to_string(sc_.micro_batches - 1));
      }
      const std::string why = missing_peer(a.kind, sc_.chunk_of(s, a.chunk), s);
      if (action_kind_info(a.kind).role != ActionRole::kCompute && !reduce && !why.empty()) {
        return Status::error("stage " + std::to_string(s) + ": " + name(a) + ", but " + why);
      }
      at[{a.chunk, a.kind, reduce ? -1 : a.micro_batch}].push_back(i);
    }
    return at;
  }

  static const std::vector<int>& find(const Positions& at, int c, ActionKind kind, int k) {
    static const std::vector<int> kNone;
    auto it = at.find({c, kind, k});
    return it == at.end() ? kNone : it->second;
  }

  Status at_most_once(const Positions& at, int c, ActionKind kind, int k) const {
    const auto& where = find(at, c, kind, k);
    if (where.size() > 1)
      return Status::error(name(kind, k, c) + " appears " + std::to_string(where.size()) + " times");
    return Status::ok();
  }

  // The pass that computes the input gradient of (c, k): B or I. Valid after check_computes.
  Action backward_of(const Positions& at, int c, int k) const {
    return find(at, c, ActionKind::kBackward, k).empty() ? Action{ActionKind::kBackwardInput, k, c}
                                                         : Action{ActionKind::kBackward, k, c};
  }

  Status check_computes(const Positions& at, int c, int k) const {
    for (ActionKind kind :
         {ActionKind::kForward, ActionKind::kBackward, ActionKind::kBackwardInput, ActionKind::kBackwardWeight}) {
      PIPESHARD_RETURN_IF_ERROR(at_most_once(at, c, kind, k));
    }
    const auto& f = find(at, c, ActionKind::kForward, k);
    const auto& b = find(at, c, ActionKind::kBackward, k);
    const auto& i = find(at, c, ActionKind::kBackwardInput, k);
    const auto& w = find(at, c, ActionKind::kBackwardWeight, k);
    if (f.empty()) return Status::error("no " + name(ActionKind::kForward, k, c));
    if (b.empty() && i.empty()) return Status::error("no " + name(ActionKind::kBackward, k, c));
    if (!b.empty() && (!i.empty() || !w.empty())) {
      return Status::error(name(ActionKind::kBackward, k, c) + " and " +
                           name(i.empty() ? ActionKind::kBackwardWeight : ActionKind::kBackwardInput, k, c) +
                           " both: a micro-batch's backward is one B, or one I and one W");
    }
    if (!i.empty() && w.empty()) {
      return Status::error("no " + name(ActionKind::kBackwardWeight, k, c) + " after " +
                           name(ActionKind::kBackwardInput, k, c));
    }
    if (i.empty() && !w.empty()) {
      return Status::error(name(ActionKind::kBackwardWeight, k, c) + " without " +
                           name(ActionKind::kBackwardInput, k, c));
    }
    const Action back = backward_of(at, c, k);
    if (find(at, c, back.kind, k)[0] < f[0]) {
      return Status::error(name(back) + " comes before " + name(ActionKind::kForward, k, c));
    }
    if (!w.empty() && w[0] < i[0]) {
      return Status::error(name(ActionKind::kBackwardWeight, k, c) + " comes before " +
                           name(ActionKind::kBackwardInput, k, c));
    }
    return Status::ok();
  }

  // A transfer that must accompany a compute action: `transfer` comes before the compute
  // (a receive) or after it (a send).
  struct TransferRule {
    ActionKind transfer;
    bool forward;  // beside F; otherwise beside B or I
    bool receive;  // true: before the compute; false: after it
  };

  Status check_transfers(const Positions& at, int s, int c, int k) const {
    const int model_chunk = sc_.chunk_of(s, c);
    static constexpr TransferRule kRules[] = {
        {ActionKind::kRecvActivation, true, true},
        {ActionKind::kSendActivation, true, false},
        {ActionKind::kRecvGradient, false, true},
        {ActionKind::kSendGradient, false, false},
    };
    for (const TransferRule& rule : kRules) {
      if (!missing_peer(rule.transfer, model_chunk, s).empty()) continue;  // none allowed, none found
      PIPESHARD_RETURN_IF_ERROR(at_most_once(at, c, rule.transfer, k));
      const Action compute = rule.forward ? Action{ActionKind::kForward, k, c} : backward_of(at, c, k);
      const int when = find(at, c, compute.kind, k)[0];
      const auto& where = find(at, c, rule.transfer, k);
      const std::string what = name(rule.transfer, k, c);
      if (where.empty()) return Status::error("no " + what + (rule.receive ? " before " : " after ") + name(compute));
      if ((where[0] < when) != rule.receive) {
        return Status::error(what + " comes" + (rule.receive ? " after " : " before ") + name(compute));
      }
    }
    return Status::ok();
  }

  // Chunks c − 1 and c on one stage hand over in place: F(c − 1, k) before F(c, k), and the
  // backward of (c, k) before that of (c − 1, k).
  Status check_neighbour_on_stage(const Positions& at, int s, int j, int k) const {
    const int c = sc_.chunk_of(s, j);
    if (c == 0 || stage_of(c - 1) != s) return Status::ok();
    const int i = sc_.place_of(c - 1).j;  // the stage's index of chunk c − 1
    const int earlier = find(at, i, ActionKind::kForward, k)[0], later = find(at, j, ActionKind::kForward, k)[0];
    if (later < earlier) {
      return Status::error(name(ActionKind::kForward, k, j) + " comes before " + name(ActionKind::kForward, k, i));
    }
    const Action up = backward_of(at, j, k), down = backward_of(at, i, k);
    if (find(at, i, down.kind, k)[0] < find(at, j, up.kind, k)[0]) {
      return Status::error(name(down) + " comes before " + name(up));
    }
    return Status::ok();
  }

  // At most one R for chunk c, after every gradient pass of it. Returns whether it has one.
  Result<bool> check_reduce(const Positions& at, int c) const {
    PIPESHARD_RETURN_IF_ERROR(at_most_once(at, c, ActionKind::kReduceGradients, -1));
    const auto& r = find(at, c, ActionKind::kReduceGradients, -1);
    if (r.empty()) return false;
    for (int k = 0; k < sc_.micro_batches; ++k) {
      for (ActionKind kind : {ActionKind::kBackward, ActionKind::kBackwardWeight}) {
        const auto& g = find(at, c, kind, k);
        if (!g.empty() && g[0] > r[0]) {
          return Status::error(name({ActionKind::kReduceGradients, -1, c}) + " comes before " + name(kind, k, c));
        }
      }
    }
    return true;
  }

  // Transfers of one kind from stage `from` to stage `to` in issue order (NCCL matches them
  // so): the i-th send and the i-th receive must carry the same chunk and micro-batch.
  Status check_link(int from, int to, ActionKind send) const {
    const bool activations = send == ActionKind::kSendActivation;
    const ActionKind recv = activations ? ActionKind::kRecvActivation : ActionKind::kRecvGradient;
    const int step = activations ? 1 : -1;  // a send of chunk c reaches chunk c + step
    // (model chunk of the action, the action) of the link's sends and receives, in order.
    std::vector<std::pair<int, Action>> sent, received;
    for (const Action& a : sc_.actions[from]) {
      const int c = sc_.chunk_of(from, a.chunk);
      if (a.kind == send && stage_of(c + step) == to) sent.emplace_back(c, a);
    }
    for (const Action& a : sc_.actions[to]) {
      const int c = sc_.chunk_of(to, a.chunk);
      if (a.kind == recv && stage_of(c - step) == from) received.emplace_back(c, a);
    }
    const std::string link = std::string(activations ? "activations" : "gradients") + " stage " + std::to_string(from) +
                             " -> stage " + std::to_string(to);
    for (size_t i = 0; i < std::min(sent.size(), received.size()); ++i) {
      const auto& [sent_chunk, s] = sent[i];
      const auto& [received_chunk, r] = received[i];
      if (s.micro_batch != r.micro_batch || sent_chunk + step != received_chunk) {
        return Status::error(link + ": send #" + std::to_string(i) + " is " + action_label(sc_, from, s) +
                             " but receive #" + std::to_string(i) + " is " + action_label(sc_, to, r) +
                             " (transfers on a link match in order)");
      }
    }
    return Status::ok();
  }

  const PipelineSchedule& sc_;
  const bool chunks_named_;
  int s_ = 0;  // the stage being checked, for names
};

}  // namespace

Status check_pipeline_schedule(const PipelineSchedule& schedule, SendMode mode) {
  PIPESHARD_RETURN_IF_ERROR(StructureCheck(schedule).run());
  return simulate(schedule, mode).status;
}

}  // namespace pipeshard
