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
  const int chunks = static_cast<int>(schedule.stage_chunks[stage_].size());
  PIPESHARD_CHECK(chunks == rank.chunks() && program.chunks() == chunks,
                  "schedule '" + schedule.name + "' places " + std::to_string(chunks) + " chunks on stage " +
                      std::to_string(stage_) + ", which holds " + std::to_string(rank.chunks()));
  const std::vector<Action>& list = schedule.actions[stage_];
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].kind == ActionKind::kReduceGradients) last_reduce_ = static_cast<int>(i);
  }
  const Graph& g = rank.graph();
  chunks_.resize(static_cast<size_t>(chunks));
  for (int j = 0; j < chunks; ++j) {
    Chunk& c = chunks_[j];
    const int model_chunk = schedule.chunk_of(stage_, j);
    PIPESHARD_CHECK(model_chunk == rank.model_chunk(j), "stage " + std::to_string(stage_) + " holds chunk " +
                                                            std::to_string(rank.model_chunk(j)) + ", the schedule " +
                                                            std::to_string(model_chunk));
    c.first = model_chunk == 0;
    c.last = model_chunk == schedule.chunks() - 1;
    c.after_local = !c.first && peer(j, -1) == stage_;
    c.before_local = !c.last && peer(j, +1) == stage_;
    std::vector<Action> mine;
    for (const Action& a : list) {
      if (a.chunk == j && a.kind != ActionKind::kReduceGradients) mine.push_back(a);
    }
    int used = 0;
    c.slot_of = slots_of_micro_batches(mine, schedule.micro_batches, &used);
    c.slots = std::max(used, 1);
    PIPESHARD_CHECK(c.slots <= program.chunk_slots(j), "schedule '" + schedule.name + "' keeps " +
                                                           std::to_string(c.slots) + " micro-batches alive in chunk " +
                                                           std::to_string(model_chunk) + ", the program has " +
                                                           std::to_string(program.chunk_slots(j)) + " slots");
    c.last_gradient_action = last_gradient_action(schedule, stage_, j);
    c.sends.resize(static_cast<size_t>(c.slots));
    for (const auto* side : {&rank.incoming(j), &rank.outgoing(j)}) {
      for (const LinkValue& l : *side) {
        if (l.local >= 0 || c.carried.count(l.name)) continue;
        Carried& carried = c.carried[l.name];
        carried.value = DeviceBuffer(backend, c.slots * micro_ * l.per_sample);
        carried.grad = DeviceBuffer(backend, c.slots * micro_ * l.per_sample);
      }
    }
    for (const LinkValue& l : rank.outgoing(j)) {
      // Read here and passed on: the later chunks' gradient is staged, then added.
      if (l.local >= 0 && g.values[l.local].producer < 0 && !c.carried.count(l.name)) {
        c.carried[l.name].grad = DeviceBuffer(backend, c.slots * micro_ * l.per_sample);
      }
    }
  }
  reset_pass_times();
}

int StageRunner::slots_needed(const PipelineSchedule& schedule, int stage, int j) {
  std::vector<Action> mine;
  for (const Action& a : schedule.actions[stage]) {
    if (a.chunk == j && a.kind != ActionKind::kReduceGradients) mine.push_back(a);
  }
  int used = 0;
  slots_of_micro_batches(mine, schedule.micro_batches, &used);
  return std::max(used, 1);
}

void StageRunner::reset_pass_times() {
  pass_times_ = {};
  pass_times_.us.resize(chunks_.size());
  pass_times_.count.resize(chunks_.size());
}

// Each chunk sends its list of (elements per sample, gradient flows back) to the stage
// holding the next chunk, which compares it with what it expects. Ranks that cut their
// stages from different files fail here with a message instead of exchanging mis-sized
// messages later. Both sides go through their chunks in model order, so the messages
// between two stages match in order.
Status StageRunner::check_links() {
  if (!pipeline_) return Status::ok();
  auto describe = [](const std::vector<LinkValue>& links) {
    std::vector<float> d{static_cast<float>(links.size())};
    for (const LinkValue& l : links) {
      d.push_back(static_cast<float>(l.per_sample));
      d.push_back(l.needs_grad ? 1.0f : 0.0f);
    }
    return d;
  };
  std::vector<std::vector<float>> outgoing;
  std::vector<std::unique_ptr<Request>> sent;
  for (size_t j = 0; j < chunks_.size(); ++j) {
    const Chunk& c = chunks_[j];
    if (c.last || c.before_local) continue;
    outgoing.push_back(describe(rank_.outgoing(static_cast<int>(j))));
    const std::vector<float>& d = outgoing.back();
    const int to = peer(static_cast<int>(j), +1);
    pipeline_->send(d.data(), 1, to, kLinkTag);
    sent.push_back(pipeline_->send_async(d.data() + 1, static_cast<int64_t>(d.size()) - 1, to, kLinkTag));
  }
  Status status = Status::ok();
  for (size_t j = 0; j < chunks_.size(); ++j) {
    const Chunk& c = chunks_[j];
    if (c.first || c.after_local) continue;
    const int from = peer(static_cast<int>(j), -1);
    const std::vector<float> expected = describe(rank_.incoming(static_cast<int>(j)));
    std::vector<float> count(1);
    pipeline_->recv(count.data(), 1, from, kLinkTag);
    std::vector<float> got(static_cast<size_t>(2 * count[0]));  // (per_sample, needs_grad) per value
    pipeline_->recv(got.data(), static_cast<int64_t>(got.size()), from, kLinkTag);
    got.insert(got.begin(), count[0]);
    if (got != expected && status) {
      status =
          Status::error("stage " + std::to_string(from) + " sends " + std::to_string(got.size() / 2) +
                        " values across its cut, which do not match the " + std::to_string(expected.size() / 2) +
                        " stage " + std::to_string(stage_) + " expects: did every rank get the same model and flags?");
    }
  }
  for (auto& request : sent) request->wait();
  return status;
}

double StageRunner::run(const MicroStep& ms, const LossFn& loss) {
  double total = 0;
  reduce_us_ = 0;
  const double schedule_begin = tracer_.now_us();
  const std::vector<Action>& list = schedule_.actions[stage_];
  for (size_t i = 0; i < list.size(); ++i) run_action(i, list[i], ms, loss, total);
  const double drain = tracer_.now_us();
  watchdog_activity(ms.step, "wait for sends");
  for (size_t j = 0; j < chunks_.size(); ++j) {
    for (int s = 0; s < chunks_[j].slots; ++s) wait_slot(static_cast<int>(j), s);
  }
  if (pipeline_) tracer_.add("wait for sends", "send", drain, ms.step, -1);
  tracer_.add_schedule(tracer_.now_us() - schedule_begin - reduce_us_);
  return total;
}

int StageRunner::peer(int j, int offset) const {
  return schedule_.place_of(schedule_.chunk_of(stage_, j) + offset).stage;
}

void StageRunner::select(int j, int k) {
  program_.select_chunk(chunks_.size() > 1 ? j : -1);
  program_.select_slot(chunks_[j].slot_of[k]);
}

void StageRunner::run_action(size_t index, const Action& a, const MicroStep& ms, const LossFn& loss, double& total) {
  const ActionKindInfo& info = action_kind_info(a.kind);
  const double begin = tracer_.now_us();
  if (a.kind == ActionKind::kReduceGradients) {  // REDUCE_GRAD: not the schedule's own time
    // Buckets of the other chunks fire as their passes finish; the rest waits for the
    // stage's last chunk to be done.
    if (!sync_ || !ms.last || static_cast<int>(index) != last_reduce_) return;
    watchdog_activity(ms.step, "gradient all-reduce");
    fault_point(FaultWhere::kAllReduce, ms.step);
    sync_->reduce_rest();
    // The buckets not launched during backward (the last), and the wait for all (under ZeRO
    // stage 2 each pass did that already, in pass_done()).
    tracer_.add("reduce gradients (buckets left, and wait)", category(info.role), begin, ms.step, -1);
    reduce_us_ += tracer_.now_us() - begin;
    return;
  }
  const int j = a.chunk, k = a.micro_batch, slot = chunks_[j].slot_of[k];
  select(j, k);
  watchdog_activity(ms.step, info.trace_name, k);
  if (k == 0 && a.kind == ActionKind::kForward) fault_point(FaultWhere::kForward, ms.step);
  if (k == 0 && info.input_gradient) fault_point(FaultWhere::kBackward, ms.step);
  switch (a.kind) {
    case ActionKind::kRecvActivation:
      wait_slot(j, slot);
      for (const LinkValue& l : rank_.incoming(j)) {
        pipeline_->recv(link_value(j, l), micro_ * l.per_sample, peer(j, -1), kActivationTag);
      }
      break;
    case ActionKind::kForward:
      wait_slot(j, slot);
      if (chunks_[j].after_local) take_from_previous(j, k);
      forward(a, ms);
      if (chunks_[j].last) total += loss(k);
      break;
    case ActionKind::kSendActivation:
      for (const LinkValue& l : rank_.outgoing(j)) {
        chunks_[j].sends[slot].push_back(
            pipeline_->send_async(link_value(j, l), micro_ * l.per_sample, peer(j, +1), kActivationTag));
      }
      break;
    case ActionKind::kRecvGradient:
      for (const LinkValue& l : rank_.outgoing(j)) {
        if (l.needs_grad) {
          pipeline_->recv(link_gradient(j, l, true), micro_ * l.per_sample, peer(j, +1), kGradientTag);
        }
      }
      break;
    case ActionKind::kBackward:
    case ActionKind::kBackwardInput:
    case ActionKind::kBackwardWeight:
      backward(index, a, ms);
      if (info.input_gradient && chunks_[j].after_local) give_to_previous(j, k);
      break;
    case ActionKind::kSendGradient:
      for (const LinkValue& l : rank_.incoming(j)) {
        if (!l.needs_grad) continue;
        chunks_[j].sends[slot].push_back(
            pipeline_->send_async(link_gradient(j, l, false), micro_ * l.per_sample, peer(j, -1), kGradientTag));
      }
      break;
    case ActionKind::kReduceGradients: break;
  }
  // A GPU's queued kernels count as this action's time.
  if (info.role == ActionRole::kCompute && time_device_work_) backend_.synchronize();
  const double took = tracer_.now_us() - begin;
  if (info.role == ActionRole::kCompute) tracer_.add_busy(took);
  pass_times_.us[j][static_cast<int>(a.kind)] += took;
  pass_times_.count[j][static_cast<int>(a.kind)] += 1;
  if (info.role == ActionRole::kRecv &&
      (pass_times_.fastest_receive_us == 0 || took < pass_times_.fastest_receive_us)) {
    pass_times_.fastest_receive_us = took;
  }
  tracer_.add(info.trace_name, category(info.role), begin, ms.step, k,
              chunks_.size() > 1 ? schedule_.chunk_of(stage_, j) : -1);
  if (a.kind == ActionKind::kBackward && sync_ && sync_->windows() && !ms.replay) {
    // ZeRO stage 2: the pass's gradients reduced, as at R, not the pass's own time.
    const double reduce_begin = tracer_.now_us();
    sync_->pass_done();
    const ActionKindInfo& reduce = action_kind_info(ActionKind::kReduceGradients);
    tracer_.add("reduce gradients (the pass's buckets left, and wait)", category(reduce.role), reduce_begin, ms.step,
                k);
    reduce_us_ += tracer_.now_us() - reduce_begin;
  }
}

// Chunk j − 1's output that chunk j receives as input `in` (the same value by name).
const LinkValue& StageRunner::previous_output(int j, const LinkValue& in) const {
  const auto& out = rank_.outgoing(j - 1);
  const auto it = std::find_if(out.begin(), out.end(), [&](const LinkValue& l) { return l.name == in.name; });
  PIPESHARD_CHECK(it != out.end(), "'" + in.name + "' is not among the previous chunk's outputs");
  return *it;
}

// Chunk j − 1's outputs, as chunk j's inputs for micro-batch k: a copy between the two
// chunks' slots.
void StageRunner::take_from_previous(int j, int k) {
  for (const LinkValue& in : rank_.incoming(j)) {
    select(j - 1, k);
    const float* source = link_value(j - 1, previous_output(j, in));
    select(j, k);
    backend_.copy(link_value(j, in), source, micro_ * in.per_sample);
  }
  select(j, k);
}

// Chunk j's input gradients of micro-batch k, as the gradients chunk j − 1 receives.
void StageRunner::give_to_previous(int j, int k) {
  for (const LinkValue& in : rank_.incoming(j)) {
    if (!in.needs_grad) continue;
    select(j, k);
    const float* source = link_gradient(j, in, false);
    select(j - 1, k);
    backend_.copy(link_gradient(j - 1, previous_output(j, in), true), source, micro_ * in.per_sample);
  }
  select(j, k);
}

void StageRunner::forward(const Action& a, const MicroStep& ms) {
  const int k = a.micro_batch;
  const bool first = chunks_[a.chunk].first;
  const int64_t first_sample = ms.first_sample + k * micro_;
  const float* features = first ? ms.features + k * micro_ * features_per_sample_ : nullptr;
  if (first && ms.replay) {  // the upload stays outside: the recording reads input(0)
    program_.upload_inputs({features}, micro_);
    replay_or_record(ActionKind::kForward, ms, k,
                     [&] { program_.forward_resident(micro_, Mode::kTrain, ms.seed, first_sample); });
  } else if (first) {
    // The model's input is the program's first: the first chunk's come first.
    std::vector<const float*> inputs(rank_.graph().inputs.size(), nullptr);
    inputs[0] = features;
    program_.forward(inputs, micro_, Mode::kTrain, ms.seed, first_sample);
  } else {
    program_.forward_resident(micro_, Mode::kTrain, ms.seed, first_sample);
  }
}

// B, I or W of one micro-batch. The pass that completes the chunk's gradients of the step
// (its last B or W, in the last micro-step) reports each node to the gradient sync, which
// launches the buckets it completes; under ZeRO stage 2's windows every B does, and the
// sync readies each window before it is written and reduces every pass. Replayed from a
// recording (--cuda-graph) a pass runs no host code: the buckets then all go at R, and
// the program is told what the pass would have left behind on the host.
void StageRunner::backward(size_t index, const Action& a, const MicroStep& ms) {
  const int k = a.micro_batch;
  const bool completes = ms.last && static_cast<int>(index) == chunks_[a.chunk].last_gradient_action;
  const bool windows = sync_ && sync_->windows();
  std::function<void(size_t)> node_done, node_starts;
  if (sync_ && (completes || windows)) node_done = [this](size_t node) { sync_->node_done(node); };
  if (windows) node_starts = [this](size_t node) { sync_->node_starts(node); };
  switch (a.kind) {
    case ActionKind::kBackward:
      if (ms.replay) {
        replay_or_record(ActionKind::kBackward, ms, k, [&] { program_.backward(micro_); });
        program_.backward_replayed();
      } else {
        program_.backward(micro_, node_done, node_starts);  // run_action() then calls pass_done()
      }
      add_carried_gradients(a.chunk);
      return;
    case ActionKind::kBackwardInput:
      if (ms.replay) {
        replay_or_record(ActionKind::kBackwardInput, ms, k, [&] { program_.backward_input(micro_); });
        program_.backward_input_replayed();
      } else {
        program_.backward_input(micro_);
      }
      add_carried_gradients(a.chunk);
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

// The gradient of a value chunk j reads and also passes on: the later chunks' part,
// received apart, is added to this chunk's before it goes back.
void StageRunner::add_carried_gradients(int j) {
  for (const LinkValue& l : rank_.outgoing(j)) {
    if (l.needs_grad && l.local >= 0 && chunks_[j].carried.count(l.name)) {
      backend_.axpy(program_.gradient(l.local), 1.0f, link_gradient(j, l, true), micro_ * l.per_sample);
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

void StageRunner::wait_slot(int j, int slot) {
  for (auto& request : chunks_[j].sends[slot]) request->wait();
  chunks_[j].sends[slot].clear();
}

float* StageRunner::link_value(int j, const LinkValue& l) {
  if (l.local >= 0) return program_.value(l.local);
  return chunks_[j].carried.at(l.name).value.data() + program_.slot() * micro_ * l.per_sample;
}

float* StageRunner::link_gradient(int j, const LinkValue& l, bool received) {
  auto& carried = chunks_[j].carried;
  auto it = carried.find(l.name);
  const bool staged = it != carried.end() && (l.local < 0 || received);
  if (!staged) return program_.gradient(l.local);
  return it->second.grad.data() + program_.slot() * micro_ * l.per_sample;
}

}  // namespace pipeshard
