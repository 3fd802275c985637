#include "runtime/stage_runner.h"

#include <algorithm>

#include "comm/watchdog.h"
#include "common/fault_injection.h"

namespace pipeshard {
namespace {

// MPI tags of the two kinds of transfer between stages; transfers of one kind between
// two stages match in issue order (schedule/schedule.h checks it), as NCCL's would.
constexpr int kActivationTag = 1, kGradientTag = 2, kLinkTag = 3;

const char* category(ActionRole role) {
  switch (role) {
    case ActionRole::kCompute: return "compute";
    case ActionRole::kSend: return "send";
    case ActionRole::kRecv: return "recv";
    case ActionRole::kReduce: return "all-reduce";
  }
  return "?";
}

// The slot of each micro-batch on a stage whose actions are `list`: a micro-batch takes
// the lowest free slot at its first action and frees it after its last one (its last
// backward pass, or the send after it). `slots_used` receives the most slots busy at once.
std::vector<int> slots_of_micro_batches(const std::vector<Action>& list, int micro_batches, int* slots_used) {
  std::vector<int> last_use(micro_batches, -1), slot_of(micro_batches, -1);
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].kind != ActionKind::kReduceGradients) last_use[list[i].micro_batch] = static_cast<int>(i);
  }
  std::vector<bool> busy;
  *slots_used = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].kind == ActionKind::kReduceGradients) continue;
    const int k = list[i].micro_batch;
    if (slot_of[k] < 0) {
      const auto free = std::find(busy.begin(), busy.end(), false);
      slot_of[k] = static_cast<int>(free - busy.begin());
      if (free == busy.end())
        busy.push_back(true);
      else
        *free = true;
      *slots_used = std::max(*slots_used, static_cast<int>(std::count(busy.begin(), busy.end(), true)));
    }
    if (last_use[k] == static_cast<int>(i)) busy[slot_of[k]] = false;
  }
  return slot_of;
}

}  // namespace

StageRunner::StageRunner(const RankModel& rank, Program& program, Backend& backend, Communicator* pipeline,
                         GradientSync* sync, const PipelineSchedule& schedule, int64_t micro_rows,
                         int64_t features_per_sample, Tracer& tracer)
    : rank_(rank), program_(program), backend_(backend), pipeline_(pipeline), sync_(sync), schedule_(schedule),
      stage_(rank.layout().stage), micro_(micro_rows), features_per_sample_(features_per_sample), tracer_(tracer) {
  PIPESHARD_CHECK(schedule.stages == rank.layout().stages && stage_ < schedule.stages,
                  "a schedule of " + std::to_string(schedule.stages) + " stages for stage " + std::to_string(stage_) +
                      " of " + std::to_string(rank.layout().stages));
  PIPESHARD_CHECK(schedule.stage_chunks[stage_].size() == 1,
                  "schedule '" + schedule.name + "' places several chunks on a stage; a stage runs one so far");
  const int chunk = schedule.chunk_of(stage_, 0);
  first_chunk_ = chunk == 0;
  last_chunk_ = chunk == schedule.chunks() - 1;
  int used = 0;
  slot_of_ = slots_of_micro_batches(schedule.actions[stage_], schedule.micro_batches, &used);
  PIPESHARD_CHECK(used <= program.slots(), "schedule '" + schedule.name + "' keeps " + std::to_string(used) +
                                               " micro-batches alive on stage " + std::to_string(stage_) +
                                               ", the program has " + std::to_string(program.slots()) + " slots");
  last_gradient_action_ = last_gradient_action(schedule, stage_, 0);
  const int slots = program.slots();
  sends_.resize(static_cast<size_t>(slots));
  for (const auto* side : {&rank.incoming(), &rank.outgoing()}) {
    for (const LinkValue& l : *side) {
      if (l.local >= 0 || carried_.count(l.name)) continue;
      Carried& c = carried_[l.name];
      c.value = DeviceBuffer(backend, slots * micro_ * l.per_sample);
      c.grad = DeviceBuffer(backend, slots * micro_ * l.per_sample);
    }
  }
  const Graph& g = rank.graph();
  for (const LinkValue& l : rank.outgoing()) {
    // Read here and passed on: the later stages' gradient is staged, then added.
    if (l.local >= 0 && g.values[l.local].producer < 0 && !carried_.count(l.name)) {
      Carried& c = carried_[l.name];
      c.grad = DeviceBuffer(backend, slots * micro_ * l.per_sample);
    }
  }
}

int StageRunner::slots_needed(const PipelineSchedule& schedule, int stage) {
  int used = 0;
  slots_of_micro_batches(schedule.actions[stage], schedule.micro_batches, &used);
  return std::max(used, 1);
}

// Stage s sends its list of (elements per sample, gradient flows back) to stage s + 1,
// which compares it with what it expects. Ranks that cut their stages from different
// files fail here with a message instead of exchanging mis-sized messages later.
Status StageRunner::check_links() {
  if (!pipeline_) return Status::ok();
  const int stages = rank_.layout().stages;
  auto describe = [](const std::vector<LinkValue>& links) {
    std::vector<float> d{static_cast<float>(links.size())};
    for (const LinkValue& l : links) {
      d.push_back(static_cast<float>(l.per_sample));
      d.push_back(l.needs_grad ? 1.0f : 0.0f);
    }
    return d;
  };
  std::unique_ptr<Request> sent;
  const std::vector<float> outgoing = describe(rank_.outgoing());
  std::vector<float> count(1);
  if (stage_ + 1 < stages) {
    pipeline_->send(outgoing.data(), 1, stage_ + 1, kLinkTag);
    sent = pipeline_->send_async(outgoing.data() + 1, static_cast<int64_t>(outgoing.size()) - 1, stage_ + 1, kLinkTag);
  }
  if (stage_ > 0) {
    const std::vector<float> expected = describe(rank_.incoming());
    pipeline_->recv(count.data(), 1, stage_ - 1, kLinkTag);
    std::vector<float> got(static_cast<size_t>(2 * count[0]));  // (per_sample, needs_grad) per value
    pipeline_->recv(got.data(), static_cast<int64_t>(got.size()), stage_ - 1, kLinkTag);
    got.insert(got.begin(), count[0]);
    if (got != expected) {
      return Status::error("stage " + std::to_string(stage_ - 1) + " sends " + std::to_string(got.size() / 2) +
                           " values across its cut, which do not match the " + std::to_string(expected.size() / 2) +
                           " stage " + std::to_string(stage_) +
                           " expects: did every rank get the same model and flags?");
    }
  }
  if (sent) sent->wait();
  return Status::ok();
}

double StageRunner::run(const MicroStep& ms, const LossFn& loss) {
  double total = 0;
  reduce_us_ = 0;
  const double schedule_begin = tracer_.now_us();
  const std::vector<Action>& list = schedule_.actions[stage_];
  for (size_t i = 0; i < list.size(); ++i) run_action(i, list[i], ms, loss, total);
  const double drain = tracer_.now_us();
  watchdog_activity(ms.step, "wait for sends");
  for (int s = 0; s < program_.slots(); ++s) wait_slot(s);
  if (pipeline_) tracer_.add("wait for sends", "send", drain, ms.step, -1);
  tracer_.add_schedule(tracer_.now_us() - schedule_begin - reduce_us_);
  return total;
}

int StageRunner::peer(int j, int offset) const {
  return schedule_.place_of(schedule_.chunk_of(stage_, j) + offset).stage;
}

void StageRunner::run_action(size_t index, const Action& a, const MicroStep& ms, const LossFn& loss, double& total) {
  const ActionKindInfo& info = action_kind_info(a.kind);
  const double begin = tracer_.now_us();
  if (a.kind == ActionKind::kReduceGradients) {  // REDUCE_GRAD: not the schedule's own time
    if (!sync_ || !ms.last) return;
    watchdog_activity(ms.step, "gradient all-reduce");
    fault_point(FaultWhere::kAllReduce, ms.step);
    sync_->reduce_rest();
    tracer_.add("all-reduce gradients (last bucket, and wait)", category(info.role), begin, ms.step, -1);
    reduce_us_ += tracer_.now_us() - begin;
    return;
  }
  const int k = a.micro_batch, slot = slot_of_[k];
  program_.select_slot(slot);
  watchdog_activity(ms.step, info.trace_name, k);
  if (k == 0 && a.kind == ActionKind::kForward) fault_point(FaultWhere::kForward, ms.step);
  if (k == 0 && info.input_gradient) fault_point(FaultWhere::kBackward, ms.step);
  switch (a.kind) {
    case ActionKind::kRecvActivation:
      wait_slot(slot);
      for (const LinkValue& l : rank_.incoming()) {
        pipeline_->recv(link_value(l), micro_ * l.per_sample, peer(a.chunk, -1), kActivationTag);
      }
      break;
    case ActionKind::kForward:
      wait_slot(slot);
      forward(a, ms);
      if (last_chunk_) total += loss(k);
      break;
    case ActionKind::kSendActivation:
      for (const LinkValue& l : rank_.outgoing()) {
        sends_[slot].push_back(
            pipeline_->send_async(link_value(l), micro_ * l.per_sample, peer(a.chunk, +1), kActivationTag));
      }
      break;
    case ActionKind::kRecvGradient:
      for (const LinkValue& l : rank_.outgoing()) {
        if (l.needs_grad) {
          pipeline_->recv(link_gradient(l, true), micro_ * l.per_sample, peer(a.chunk, +1), kGradientTag);
        }
      }
      break;
    case ActionKind::kBackward:
    case ActionKind::kBackwardInput:
    case ActionKind::kBackwardWeight: backward(index, a, ms); break;
    case ActionKind::kSendGradient:
      for (const LinkValue& l : rank_.incoming()) {
        if (!l.needs_grad) continue;
        sends_[slot].push_back(
            pipeline_->send_async(link_gradient(l, false), micro_ * l.per_sample, peer(a.chunk, -1), kGradientTag));
      }
      break;
    case ActionKind::kReduceGradients: break;
  }
  // A GPU's queued kernels count as this action's time.
  if (info.role == ActionRole::kCompute && time_device_work_) backend_.synchronize();
  const double took = tracer_.now_us() - begin;
  if (info.role == ActionRole::kCompute) tracer_.add_busy(took);
  pass_times_.us[static_cast<int>(a.kind)] += took;
  pass_times_.count[static_cast<int>(a.kind)] += 1;
  if (info.role == ActionRole::kRecv &&
      (pass_times_.fastest_receive_us == 0 || took < pass_times_.fastest_receive_us)) {
    pass_times_.fastest_receive_us = took;
  }
  tracer_.add(info.trace_name, category(info.role), begin, ms.step, k);
}

void StageRunner::forward(const Action& a, const MicroStep& ms) {
  const int k = a.micro_batch;
  const int64_t first_sample = ms.first_sample + k * micro_;
  const float* features = first_chunk_ ? ms.features + k * micro_ * features_per_sample_ : nullptr;
  if (first_chunk_ && ms.replay) {  // the upload stays outside: the recording reads input(0)
    program_.upload_inputs({features}, micro_);
    replay_or_record(ActionKind::kForward, ms, k,
                     [&] { program_.forward_resident(micro_, Mode::kTrain, ms.seed, first_sample); });
  } else if (first_chunk_) {
    program_.forward({features}, micro_, Mode::kTrain, ms.seed, first_sample);
  } else {
    program_.forward_resident(micro_, Mode::kTrain, ms.seed, first_sample);
  }
}

// B, I or W of one micro-batch. The pass that completes the step's gradients (the chunk's
// last B or W, in the last micro-step) reports each node to the gradient sync, which
// launches the buckets it completes. Replayed from a recording (--cuda-graph) a pass runs
// no host code: the buckets then all go at R, and the program is told what the pass
// would have left behind on the host.
void StageRunner::backward(size_t index, const Action& a, const MicroStep& ms) {
  const int k = a.micro_batch;
  const bool completes = ms.last && static_cast<int>(index) == last_gradient_action_;
  std::function<void(size_t)> node_done;
  if (sync_ && completes) node_done = [this](size_t node) { sync_->node_done(node); };
  switch (a.kind) {
    case ActionKind::kBackward:
      if (ms.replay) {
        replay_or_record(ActionKind::kBackward, ms, k, [&] { program_.backward(micro_); });
        program_.backward_replayed();
      } else {
        program_.backward(micro_, node_done);
      }
      add_carried_gradients();
      return;
    case ActionKind::kBackwardInput:
      if (ms.replay) {
        replay_or_record(ActionKind::kBackwardInput, ms, k, [&] { program_.backward_input(micro_); });
        program_.backward_input_replayed();
      } else {
        program_.backward_input(micro_);
      }
      add_carried_gradients();
      return;
    case ActionKind::kBackwardWeight:
      if (ms.replay) {
        replay_or_record(ActionKind::kBackwardWeight, ms, k, [&] { program_.backward_weight(micro_); });
        program_.backward_replayed();
      } else {
        program_.backward_weight(micro_, node_done);
      }
      return;
    default: PIPESHARD_CHECK(false, "not a backward pass: " + action_name(a));
  }
}

// The gradient of a value this stage reads and also passes on: the later stages' part,
// received apart, is added to this stage's before it goes back.
void StageRunner::add_carried_gradients() {
  for (const LinkValue& l : rank_.outgoing()) {
    if (l.needs_grad && l.local >= 0 && carried_.count(l.name)) {
      backend_.axpy(program_.gradient(l.local), 1.0f, link_gradient(l, true), micro_ * l.per_sample);
    }
  }
}

// One recording per (pass, micro-step of the accumulation, micro-batch): the calls differ
// between them (where gradients are overwritten or added, which slice of the input). A
// backend that cannot record runs `work` as it is, every time.
void StageRunner::replay_or_record(ActionKind kind, const MicroStep& ms, int micro_batch,
                                   const std::function<void()>& work) {
  const std::tuple<ActionKind, int64_t, int> key{kind, ms.index, micro_batch};
  auto it = recorded_.find(key);
  if (it == recorded_.end()) it = recorded_.emplace(key, backend_.record(work)).first;
  if (it->second) {
    it->second->replay();
  } else {
    work();
  }
}

int64_t StageRunner::recordings() const {
  int64_t n = 0;
  for (const auto& [key, work] : recorded_) n += work != nullptr;
  return n;
}

void StageRunner::wait_slot(int slot) {
  for (auto& request : sends_[slot]) request->wait();
  sends_[slot].clear();
}

float* StageRunner::link_value(const LinkValue& l) {
  if (l.local >= 0) return program_.value(l.local);
  return carried_.at(l.name).value.data() + program_.slot() * micro_ * l.per_sample;
}

float* StageRunner::link_gradient(const LinkValue& l, bool received) {
  auto it = carried_.find(l.name);
  const bool staged = it != carried_.end() && (l.local < 0 || received);
  if (!staged) return program_.gradient(l.local);
  return it->second.grad.data() + program_.slot() * micro_ * l.per_sample;
}

}  // namespace pipeshard
