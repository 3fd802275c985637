#include "schedule/registry.h"

#include <algorithm>
#include <list>

#include "schedule/builders.h"

namespace pipeshard {
namespace {

Action forward(int k) { return {ActionKind::kForward, k, 0}; }
Action backward(int k) { return {ActionKind::kBackward, k, 0}; }
Action backward_input(int k) { return {ActionKind::kBackwardInput, k, 0}; }
Action backward_weight(int k) { return {ActionKind::kBackwardWeight, k, 0}; }

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

// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each
// backward split into I, which sends the input gradient upstream at once, and W, which
// only adds into this stage's weight gradients and so can wait. Stage s forwards
// P − 1 − s micro-batches as 1F1B does, then runs F, I pairs, of which the first s leave
// their W for later; after that each pair is followed by the oldest W still owed, and the
// W's still owed end the list, filling the drain. So every stage keeps at most P
// micro-batches alive (from F to W), which is 1F1B's peak (its stage 0), and the gradient
// goes up the pipeline at I's pace: the bubble is (P − 1)(F + I − W) instead of 1F1B's
// (P − 1)(F + I + W). W's run in micro-batch order, so each weight gradient adds up the
// micro-batches in 1F1B's order: bitwise 1F1B.
ComputeOrder zb_h1(int stages, int micro_batches) {
  ComputeOrder order(stages);
  for (int s = 0; s < stages; ++s) {
    const int warmup = std::min(stages - 1 - s, micro_batches);
    int forwards = 0, inputs = 0, weights = 0, pairs = 0;
    auto input_then_owed_weight = [&] {
      order[s].push_back(backward_input(inputs++));
      if (pairs++ >= s) order[s].push_back(backward_weight(weights++));
    };
    while (forwards < warmup) order[s].push_back(forward(forwards++));
    while (forwards < micro_batches) {
      order[s].push_back(forward(forwards++));
      input_then_owed_weight();
    }
    while (inputs < micro_batches) input_then_owed_weight();
    while (weights < micro_batches) order[s].push_back(backward_weight(weights++));
  }
  return order;
}

// (P − 1)/(M + P − 1): the fill and drain of a pipeline of P stages over M micro-batches.
double fill_and_drain(int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / (micro_batches + stages - 1);
}

// ZB-H1's (P − 1)(F + I − W) of idle time beside each stage's M(F + I + W) of work, with
// every pass as long as the forward (so B = I + W = 2F, as the other rows assume).
double zero_bubble_h1(int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / (3.0 * micro_batches + stages - 1);
}

// A builder, in-flight count or bubble of one chunk per stage as a row's function, which
// takes the chunks per stage too: always 1 for such a row.
std::function<ComputeOrder(int, int, int)> one_chunk_builder(ComputeOrder (*build)(int, int)) {
  return [build](int stages, int micro_batches, int) { return build(stages, micro_batches); };
}
std::function<double(int, int, int)> one_chunk_bubble(double (*bubble)(int, int)) {
  return [bubble](int stages, int micro_batches, int) { return bubble(stages, micro_batches); };
}

std::list<ScheduleInfo>& table() {
  static std::list<ScheduleInfo> rows = {
      {"gpipe", "GPipe", "all forwards, then all backwards; M micro-batches alive on every stage", 1, nullptr,
       one_chunk_builder(gpipe), [](int, int m, int, int) { return m; }, one_chunk_bubble(fill_and_drain),
       "(P-1)/(M+P-1)", nullptr},
      {"1f1b", "1F1B", "one forward, one backward (PipeDream-flush); stage s keeps at most P - s micro-batches alive",
       1, nullptr, one_chunk_builder(one_f_one_b), [](int p, int m, int s, int) { return std::min(p - s, m); },
       one_chunk_bubble(fill_and_drain), "(P-1)/(M+P-1)", nullptr},
      {"zb-h1", "ZB-H1",
       "zero bubble H1: backward split into input (I) and weight (W) halves, W's deferred into the bubble; every "
       "stage keeps at most P micro-batches alive, 1F1B's peak",
       1, nullptr, one_chunk_builder(zb_h1), [](int p, int m, int, int) { return std::min(p, m); },
       one_chunk_bubble(zero_bubble_h1), "(P-1)/(3M+P-1)", nullptr},
      {"interleaved", "Interleaved 1F1B",
       "interleaved 1F1B (Megatron-LM): v chunks per stage (--virtual-stages, default 2), chunk c on stage c mod P; "
       "1F1B over groups of micro-batches that pass through each chunk in turn, which cuts the fill and drain v-fold",
       0, nullptr, interleaved_one_f_one_b, interleaved_in_flight, interleaved_bubble,
       "(P-1)/(vM+P-1); M<P: (v(P-M)+M-1)/(vP+M-1)", nullptr},
      {"zb-v", "ZB-V",
       "zero bubble V: 2 chunks per stage in a V (stage s holds chunks s and 2P-1-s, so stage 0 computes the "
       "loss), backward split into I and W, W's placed where stages would wait; every stage keeps at most 2P "
       "half-stage chunks alive, 1F1B's peak; needs M >= P",
       2, [](int p, int) { return zero_bubble_v_placement(p); }, [](int p, int m, int) { return zero_bubble_v(p, m); },
       [](int p, int m, int, int) { return zero_bubble_v_in_flight(p, m); },
       [](int p, int m, int) { return zero_bubble_v_bubble(p, m); }, "(P-1)/(6M+P-1)",
       [](int p, int m, int) { return zero_bubble_v_accepts(p, m); }},
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

int chunks_per_stage_of(const ScheduleInfo& info, int virtual_stages) {
  if (info.chunks_per_stage > 0) return info.chunks_per_stage;
  return virtual_stages >= 1 ? virtual_stages : 2;
}

Status check_schedule_counts(std::string_view name, int stages, int micro_batches, int virtual_stages) {
  PIPESHARD_RETURN_IF_ERROR(check_schedule_name(name));
  const ScheduleInfo& info = *find_schedule(name);
  if (stages < 1)
    return Status::invalid("stages", "a pipeline needs at least one stage, not " + std::to_string(stages));
  if (micro_batches < 1) {
    return Status::invalid("micro_batches",
                           "there must be at least one micro-batch, not " + std::to_string(micro_batches));
  }
  const std::string row = "schedule '" + info.name + "'";
  if (virtual_stages < 0) {
    return Status::invalid("virtual_stages", "a count of chunks per stage cannot be " + std::to_string(virtual_stages));
  }
  if (info.chunks_per_stage > 0 && virtual_stages > 0 && virtual_stages != info.chunks_per_stage) {
    return Status::invalid("virtual_stages", row + " holds " + std::to_string(info.chunks_per_stage) + " chunk" +
                                                 (info.chunks_per_stage == 1 ? "" : "s") +
                                                 " per stage; a chosen count (" + std::to_string(virtual_stages) +
                                                 ") does not apply");
  }
  const int v = chunks_per_stage_of(info, virtual_stages);
  if (info.chunks_per_stage == 0 && v < 2) {
    return Status::invalid("virtual_stages", row + " needs at least 2 chunks per stage, not " + std::to_string(v));
  }
  return info.accepts ? info.accepts(stages, micro_batches, v) : Status::ok();
}

ScheduleRegistration::ScheduleRegistration(ScheduleInfo info) : name_(info.name) {
  PIPESHARD_CHECK(!name_.empty() && find_schedule(name_) == nullptr, "schedule '" + name_ + "' is registered already");
  PIPESHARD_CHECK(info.build && info.in_flight && info.bubble && info.chunks_per_stage >= 0,
                  "schedule '" + name_ + "' lacks a builder, an in-flight count or a bubble formula");
  table().push_back(std::move(info));
}

ScheduleRegistration::~ScheduleRegistration() {
  table().remove_if([&](const ScheduleInfo& row) { return row.name == name_; });
}

}  // namespace pipeshard
