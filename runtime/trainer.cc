#include "runtime/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/atomic_file.h"
#include "common/fault_injection.h"
#include "comm/watchdog.h"

namespace pipeshard {
namespace {

std::string fmt_double(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

// Dropout masks depend on the run's seed and the batch, never on how the run was split
// into invocations.
uint64_t batch_seed(uint64_t seed, int64_t batch) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(batch + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A sort key for (stage, node): fixed-width decimals compare as text.
constexpr size_t kKeyWidth = 20;
std::string fmt_key(int stage, size_t node) {
  char key[kKeyWidth + 1];
  std::snprintf(key, sizeof key, "%09d %010zu", stage, node);
  return key;
}

// How the stages are cut, and what the memory estimate assumes: the replica's batch, its
// micro-batches, the schedule, the optimizer's state per parameter and the activations
// `backend` keeps.
PartitionOptions partition_options(const TrainConfig& config, int64_t local_batch, const Backend& backend) {
  PartitionOptions o;
  o.kept_when_fused = kept_when_fused(backend);
  o.balance = config.balance;
  o.batch_size = local_batch;
  o.micro_batches = config.micro_batches;
  o.schedule = config.pipeline_schedule;
  o.recompute_activations = !config.keep_activations;
  const OptimizerConfig& opt = config.optimizer;
  o.optimizer_slots = opt.kind != OptimizerKind::kSgd ? 2 : opt.momentum != 0.0f ? 1 : 0;
  return o;
}

}  // namespace

std::vector<int64_t> Trainer::memory_per_stage(const Graph& graph, const TrainConfig& config, const ProcessLayout& layout,
                                               const Backend& backend) {
  const int64_t d = layout.replicas, m = config.micro_batches;
  // A batch that does not divide is create()'s to refuse, with its own message.
  if (config.batch_size % d != 0 || m < 1 || (config.batch_size / d) % m != 0) return {};
  PartitionOptions o = partition_options(config, config.batch_size / d, backend);
  o.stages = layout.stages;
  o.tensor_parallel = layout.shards;
  Result<Plan> plan = make_plan(graph, "", o);
  if (!plan) return {};
  std::vector<int64_t> bytes;
  for (const StagePlan& s : plan->stages) bytes.push_back(s.memory_bytes);
  return bytes;
}

Trainer::Trainer(const Dataset& data, Backend& backend, const TrainConfig& config, RankModel rank)
    : data_(data), backend_(backend), config_(config), rank_(std::move(rank)),
      order_(data.samples, config.batch_size, config.shuffle, config.seed) {}

Trainer::~Trainer() = default;

Result<std::unique_ptr<Trainer>> Trainer::create(const Graph& graph, const Dataset& data, Backend& backend,
                                                 const TrainConfig& config, const Parallel& parallel) {
  if (config.batch_size < 1) return Status::error("--batch-size must be at least 1");
  const ProcessLayout layout = parallel.groups ? parallel.groups->layout : ProcessLayout{};
  const int64_t d = layout.replicas, m = config.micro_batches;
  if (config.batch_size % d != 0) {
    return Status::error("--batch-size " + std::to_string(config.batch_size) + " does not divide among " +
                         std::to_string(d) + " data-parallel replicas");
  }
  const int64_t local_batch = config.batch_size / d;
  if (config.loss_scaling.mode != LossScaling::Mode::kNone) {
    int exponent = 0;
    const double initial = config.loss_scaling.initial;
    if (!(initial >= LossScaling::kMin && initial <= LossScaling::kMax) || std::frexp(initial, &exponent) != 0.5) {
      return Status::error("a loss scale must be a power of two from 2^-64 to 2^64, not " + fmt_double(initial));
    }
    if (config.loss_scaling.growth_interval < 1) return Status::error("the loss scale's growth interval must be ≥ 1");
  }
  if (m < 1) return Status::error("--micro-batches must be at least 1");
  if (config.cuda_graph) {
    if (layout.world_size() > 1) {
      return Status::error("--cuda-graph records one process's step so far: leave it out under mpirun");
    }
    for (const Node& n : graph.nodes) {
      if (n.kind == OpKind::kDropout) {
        return Status::error("--cuda-graph: node '" + n.name + "' (Dropout) draws new masks every step, which a "
                             "recorded step cannot; leave --cuda-graph out for this model");
      }
    }
  }
  if (local_batch % m != 0) {
    return Status::error("--micro-batches " + std::to_string(m) + " does not divide the " + std::to_string(local_batch) +
                         " samples each replica gets per step (--batch-size " + std::to_string(config.batch_size) +
                         (d > 1 ? " over " + std::to_string(d) + " replicas)" : ")"));
  }
  if (config.grad_accum < 1) return Status::error("--grad-accum must be at least 1");
  if (data.samples < config.batch_size) {
    return Status::error("the data has " + std::to_string(data.samples) + " samples, fewer than one batch of " +
                         std::to_string(config.batch_size));
  }
  const int64_t micro = local_batch / m;
  for (const Node& n : graph.nodes) {
    if (n.kind != OpKind::kBatchNorm) continue;
    const Shape& s = graph.values[n.inputs[0]].shape;
    const int64_t stat_batch = config.sync_batchnorm ? config.batch_size : micro;
    if (m > 1) {
      return Status::error("node '" + n.name + "' (BatchNorm) would normalise each of the " + std::to_string(m) +
                           " micro-batches alone, unlike one process; use --micro-batches 1");
    }
    if (stat_batch * (s.per_sample_elements() / s.dims[1]) < 2) {
      return Status::error("node '" + n.name + "' (BatchNorm) needs more than one value per channel to train, and " +
                           (d > 1 && !config.sync_batchnorm
                                ? "each of the " + std::to_string(d) + " replicas normalises only its " +
                                      std::to_string(micro) + " samples; use a larger --batch-size or --sync-batchnorm"
                                : "the batch gives it " + std::to_string(stat_batch) + "; use a larger --batch-size"));
    }
  }

  RankModel rank = layout.stages == 1 && layout.shards == 1 ? RankModel::whole(graph, layout) : RankModel();
  if (layout.stages > 1 || layout.shards > 1) {
    PIPESHARD_CHECK(parallel.model != nullptr && &parallel.model->graph == &graph,
                    "cutting stages needs the ImportedModel the graph belongs to");
    Result<RankModel> cut = RankModel::create(*parallel.model, layout, partition_options(config, local_batch, backend));
    if (!cut) return cut.status();
    rank = std::move(*cut);
  }
  std::unique_ptr<Trainer> t(new Trainer(data, backend, config, std::move(rank)));
  t->world_ = parallel.world;
  if (parallel.groups) {
    t->replicas_ = layout.replicas > 1 ? parallel.groups->data.get() : nullptr;
    t->tensor_ = layout.shards > 1 ? parallel.groups->tensor.get() : nullptr;
    t->pipeline_ = layout.stages > 1 ? parallel.groups->pipeline.get() : nullptr;
  }
  // Buffers in the backend's memory travel over the device groups: the same groups, or
  // NCCL's or staged ones over them for a GPU backend (Parallel::device_groups).
  t->device_replicas_ = t->replicas_;
  t->device_tensor_ = t->tensor_;
  t->device_pipeline_ = t->pipeline_;
  if (parallel.device_groups) {
    if (t->replicas_) t->device_replicas_ = parallel.device_groups->data.get();
    if (t->tensor_) t->device_tensor_ = parallel.device_groups->tensor.get();
    if (t->pipeline_) t->device_pipeline_ = parallel.device_groups->pipeline.get();
  }
  t->local_batch_ = local_batch;
  t->micro_ = micro;
  if (config.loss_scaling.mode != LossScaling::Mode::kNone) t->loss_scale_ = config.loss_scaling.initial;
  t->schedule_ = make_pipeline_schedule(config.pipeline_schedule, layout.stages, static_cast<int>(m));
  const int slots = max_in_flight(t->schedule_, layout.stage);
  const Graph& g = t->rank_.graph();
  ProgramOptions options;
  options.slots = slots;
  options.input_needs_grad = t->rank_.input_needs_grad();
  options.tensor = t->device_tensor_;
  options.model_node_ids = t->rank_.model_node_ids();
  options.recompute_activations = !config.keep_activations;
  if (config.sync_batchnorm && t->device_replicas_) {
    Communicator* replicas = t->device_replicas_;
    options.batchnorm_reducer = [replicas](double* data, int64_t n) { replicas->all_reduce_sum(data, n); };
  }
  // One micro-batch per slot: what the memory estimate counts, and what micro-batches are
  // for. Evaluation, in whole batches, has a program of its own (evaluate()).
  Result<std::unique_ptr<Program>> program = Program::create(g, backend, micro, options);
  if (!program) return program.status();
  t->program_ = std::move(*program);
  t->sends_.resize(static_cast<size_t>(slots));
  const bool last_stage = layout.stage == layout.stages - 1;
  t->log_probs_ = last_stage && ends_in_log_softmax(g);
  t->optimizer_ = std::make_unique<Optimizer>(backend, config.optimizer, t->program_->trainable_elements());
  t->targets_ = DeviceBuffer(backend, std::max(local_batch, config.batch_size) * data.targets_per_sample);
  for (const auto* side : {&t->rank_.incoming(), &t->rank_.outgoing()}) {
    for (const LinkValue& l : *side) {
      if (l.local >= 0 || t->carried_.count(l.name)) continue;
      Carried& c = t->carried_[l.name];
      c.value = DeviceBuffer(backend, slots * micro * l.per_sample);
      c.grad = DeviceBuffer(backend, slots * micro * l.per_sample);
    }
  }
  for (const LinkValue& l : t->rank_.outgoing()) {
    // Read here and passed on: the later stages' gradient is staged, then added.
    if (l.local >= 0 && g.values[l.local].producer < 0 && !t->carried_.count(l.name)) {
      Carried& c = t->carried_[l.name];
      c.grad = DeviceBuffer(backend, slots * micro * l.per_sample);
    }
  }
  if (t->replicas_) t->plan_buckets();
  return t;
}

// Neighbouring stages agree on what crosses their cut before any training: stage s
// sends its list of (elements per sample, gradient flows back) to stage s + 1, which
// compares it with what it expects. Ranks that cut their stages from different files
// fail here with a message instead of exchanging mis-sized messages later.
Status Trainer::check_links() {
  if (!pipeline_) return Status::ok();
  constexpr int kLinkTag = 3;
  const int stage = rank_.layout().stage, stages = rank_.layout().stages;
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
  if (stage + 1 < stages) {
    pipeline_->send(outgoing.data(), 1, stage + 1, kLinkTag);
    sent = pipeline_->send_async(outgoing.data() + 1, static_cast<int64_t>(outgoing.size()) - 1, stage + 1, kLinkTag);
  }
  if (stage > 0) {
    const std::vector<float> expected = describe(rank_.incoming());
    pipeline_->recv(count.data(), 1, stage - 1, kLinkTag);
    std::vector<float> got(static_cast<size_t>(2 * count[0]));  // (per_sample, needs_grad) per value
    pipeline_->recv(got.data(), static_cast<int64_t>(got.size()), stage - 1, kLinkTag);
    got.insert(got.begin(), count[0]);
    if (got != expected) {
      return Status::error("stage " + std::to_string(stage - 1) + " sends " + std::to_string(got.size() / 2) +
                           " values across its cut, which do not match the " + std::to_string(expected.size() / 2) +
                           " stage " + std::to_string(stage) + " expects: did every rank get the same model and flags?");
    }
  }
  if (sent) sent->wait();
  return Status::ok();
}

// Buckets cover the gradient buffer from its end (the last layers, whose gradients
// backward finishes first) towards its start, each about config.bucket_bytes, never
// splitting a parameter. A bucket is complete once backward has passed the earliest
// node using any of its parameters.
void Trainer::plan_buckets() {
  const Graph& graph = rank_.graph();
  std::vector<size_t> first_user(graph.params.size(), graph.nodes.size());
  for (size_t i = graph.nodes.size(); i-- > 0;)
    for (int p : graph.node_params(graph.nodes[i])) first_user[p] = i;
  std::vector<int> order;  // trainable parameters by descending offset
  for (size_t p = 0; p < graph.params.size(); ++p) if (graph.params[p].trainable) order.push_back(static_cast<int>(p));
  std::sort(order.begin(), order.end(), [&](int a, int b) { return program_->parameter_offset(a) > program_->parameter_offset(b); });
  const int64_t per_bucket = std::max<int64_t>(1, config_.bucket_bytes / static_cast<int64_t>(sizeof(float)));
  Bucket current;
  bool open = false;
  for (int p : order) {
    const int64_t begin = program_->parameter_offset(p), end = begin + graph.params[p].elements();
    if (!open) {
      current = Bucket{begin, end, first_user[p]};
      open = true;
    } else {
      current.begin = begin;
      current.ready_after = std::min(current.ready_after, first_user[p]);
    }
    if (current.end - current.begin >= per_bucket) {
      buckets_.push_back(current);
      open = false;
    }
  }
  if (open) buckets_.push_back(current);
}

void Trainer::on_gradients_ready(size_t node) {
  // Every replica launches the same buckets in the same order: backward visits nodes
  // in the same order everywhere.
  for (const Bucket& b : buckets_) {
    // The bucket backward completes last has nothing left to overlap with: step() reduces
    // it with a blocking all-reduce, which MPI runs at twice the speed of a non-blocking
    // one (16 MiB over shared memory: 2.6 against 5.5 ms).
    if (b.ready_after == node && b.ready_after != buckets_.back().ready_after) {
      in_flight_.push_back(device_replicas_->all_reduce_async(program_->gradients() + b.begin, b.end - b.begin, ReduceOp::kSum));
    }
  }
  if (!in_flight_.empty()) device_replicas_->progress();  // between layers, the buckets launched move on
}

void Trainer::wait_slot(int slot) {
  for (auto& request : sends_[slot]) request->wait();
  sends_[slot].clear();
}

float* Trainer::link_value(const LinkValue& l) {
  if (l.local >= 0) return program_->value(l.local);
  return carried_.at(l.name).value.data() + program_->slot() * micro_ * l.per_sample;
}

// `received`: the gradient arriving from the next stage (for values this stage reads
// and passes on, it is staged apart and added after backward); otherwise the gradient
// this stage sends back.
float* Trainer::link_gradient(const LinkValue& l, bool received) {
  auto it = carried_.find(l.name);
  const bool staged = it != carried_.end() && (l.local < 0 || received);
  if (!staged) return program_->gradient(l.local);
  return it->second.grad.data() + program_->slot() * micro_ * l.per_sample;
}

// One recording per (forward or backward, micro-step of the accumulation, micro-batch):
// the calls differ between them (where gradients are overwritten or added, which slice
// of the input). A backend that cannot record runs `work` as it is, every time.
void Trainer::replay_or_record(int what, int micro_batch, const std::function<void()>& work) {
  const std::tuple<int, int64_t, int> key{what, micro_step_, micro_batch};
  auto it = recorded_.find(key);
  if (it == recorded_.end()) it = recorded_.emplace(key, backend_.record(work)).first;
  if (it->second) {
    it->second->replay();
  } else {
    work();
  }
}

int64_t Trainer::recordings() const {
  int64_t n = 0;
  for (const auto& [key, work] : recorded_) n += work != nullptr;
  return n;
}

double Trainer::run_schedule(bool last_micro_step, uint64_t seed, int64_t first_sample) {
  constexpr int kActivationTag = 1, kGradientTag = 2;
  const ProcessLayout& layout = rank_.layout();
  const int stage = layout.stage, m = schedule_.micro_batches;
  const bool first = stage == 0, last = stage == layout.stages - 1;
  const int64_t global = config_.batch_size * config_.grad_accum;
  double loss = 0;
  static constexpr const char* kNames[] = {"forward", "backward", "send activation", "recv activation",
                                           "send gradient", "recv gradient"};
  static constexpr const char* kCategories[] = {"compute", "compute", "send", "recv", "send", "recv"};
  const double schedule_begin = tracer_.now_us();
  // --cuda-graph: from this process's second step on, forward and backward run as
  // recordings (step() decides; the first step runs eagerly, so that every plan and
  // scratch buffer the recorded calls need already exists).
  const bool replayed = replay_this_step_;
  for (const Action& a : schedule_.actions[stage]) {
    const int k = a.micro_batch, slot = k % program_->slots();
    const int kind = static_cast<int>(a.kind);
    program_->select_slot(slot);
    watchdog_activity(tracing_step_, kNames[kind], k);
    if (k == 0 && a.kind == ActionKind::kForward) fault_point(FaultWhere::kForward, tracing_step_);
    if (k == 0 && a.kind == ActionKind::kBackward) fault_point(FaultWhere::kBackward, tracing_step_);
    const double begin = tracer_.now_us();
    switch (a.kind) {
      case ActionKind::kRecvActivation:
        wait_slot(slot);
        for (const LinkValue& l : rank_.incoming()) device_pipeline_->recv(link_value(l), micro_ * l.per_sample, stage - 1, kActivationTag);
        break;
      case ActionKind::kForward: {
        wait_slot(slot);
        if (first && replayed) {  // the upload stays outside: the recording reads input(0)
          program_->upload_inputs({batch_features_ + k * micro_ * data_.features_per_sample}, micro_);
          replay_or_record(kForwardKey, k, [&] { program_->forward_resident(micro_, Mode::kTrain, seed, first_sample + k * micro_); });
        } else if (first) {
          program_->forward({batch_features_ + k * micro_ * data_.features_per_sample}, micro_, Mode::kTrain, seed,
                            first_sample + k * micro_);
        } else {
          program_->forward_resident(micro_, Mode::kTrain, seed, first_sample + k * micro_);
        }
        if (last) {
          // Divided by the global sample count: the sum over micro-batches and replicas is the global mean.
          loss += apply_loss(*program_, config_.loss, log_probs_, targets_.data() + k * micro_ * data_.targets_per_sample,
                             micro_, global);
          if (loss_scale_ != 1.0) {  // exact: a power of two
            backend_.scale(program_->output_gradient(0), static_cast<float>(loss_scale_),
                           micro_ * program_->output_shape(0).per_sample_elements());
          }
        }
        break;
      }
      case ActionKind::kSendActivation:
        for (const LinkValue& l : rank_.outgoing()) {
          sends_[slot].push_back(device_pipeline_->send_async(link_value(l), micro_ * l.per_sample, stage + 1, kActivationTag));
        }
        break;
      case ActionKind::kRecvGradient:
        for (const LinkValue& l : rank_.outgoing()) {
          if (l.needs_grad) device_pipeline_->recv(link_gradient(l, true), micro_ * l.per_sample, stage + 1, kGradientTag);
        }
        break;
      case ActionKind::kBackward:
        // Backwards run in micro-batch order: the last one completes the gradients.
        if (replayed) {
          replay_or_record(kBackwardKey, k, [&] { program_->backward(micro_); });
          program_->backward_replayed();
        } else if (replicas_ && last_micro_step && k == m - 1) {
          program_->backward(micro_, [this](size_t node) { on_gradients_ready(node); });
        } else {
          program_->backward(micro_);  // accumulating: no communication until the last micro-step
        }
        for (const LinkValue& l : rank_.outgoing()) {
          if (l.needs_grad && l.local >= 0 && carried_.count(l.name)) {
            backend_.axpy(program_->gradient(l.local), 1.0f, link_gradient(l, true), micro_ * l.per_sample);
          }
        }
        break;
      case ActionKind::kSendGradient:
        for (const LinkValue& l : rank_.incoming()) {
          if (!l.needs_grad) continue;
          sends_[slot].push_back(device_pipeline_->send_async(link_gradient(l, false), micro_ * l.per_sample, stage - 1, kGradientTag));
        }
        break;
    }
    if (a.kind == ActionKind::kForward || a.kind == ActionKind::kBackward) {
      if (time_device_work_) backend_.synchronize();  // a GPU's queued kernels count as this action's time
      tracer_.add_busy(tracer_.now_us() - begin);
    }
    tracer_.add(kNames[kind], kCategories[kind], begin, tracing_step_, k);
  }
  const double drain = tracer_.now_us();
  watchdog_activity(tracing_step_, "wait for sends");
  for (int s = 0; s < program_->slots(); ++s) wait_slot(s);
  if (pipeline_) tracer_.add("wait for sends", "send", drain, tracing_step_, -1);
  tracer_.add_schedule(tracer_.now_us() - schedule_begin);
  return loss;
}

// The features of `rows`: where the dataset holds them in order (unshuffled data, or any
// slice of it), read in place; else gathered into host_features_. A batch of the benchmark's
// large MLP is 256 MiB, a copy that costs a GPU step's worth of time to no purpose.
const float* Trainer::batch_rows(const std::vector<int64_t>& rows) {
  const int64_t width = data_.features_per_sample;
  bool in_order = !rows.empty();
  for (size_t i = 1; in_order && i < rows.size(); ++i) in_order = rows[i] == rows[0] + static_cast<int64_t>(i);
  if (in_order) return data_.features.data() + rows[0] * width;
  gather_rows(data_.features, width, rows, host_features_);
  return host_features_.data();
}

StepResult Trainer::step() {
  StepResult r;
  r.step = steps_done() + 1;
  tracing_step_ = r.step;
  const ProcessLayout& layout = rank_.layout();
  const int64_t k = config_.grad_accum, b = local_batch_;
  const bool first = layout.stage == 0, last = layout.stage == layout.stages - 1;
  program_->zero_gradients();
  replay_this_step_ = config_.cuda_graph && warmed_up_;
  warmed_up_ = true;
  for (int64_t micro = 0; micro < k; ++micro) {
    const int64_t batch_index = (r.step - 1) * k + micro;
    if (micro == 0) r.epoch = order_.epoch_of(batch_index);
    // This replica's contiguous slice of the global batch.
    std::vector<int64_t> rows = order_.indices(batch_index);
    rows = std::vector<int64_t>(rows.begin() + layout.replica * b, rows.begin() + (layout.replica + 1) * b);
    if (first) batch_features_ = batch_rows(rows);
    if (last) {
      gather_rows(data_.targets, data_.targets_per_sample, rows, host_targets_);
      backend_.upload(targets_.data(), host_targets_.data(), b * data_.targets_per_sample);
    }
    // One seed per batch for every rank; masks depend on the sample's place in the batch.
    const uint64_t seed = batch_seed(config_.seed, batch_index);
    micro_step_ = micro;
    r.loss += run_schedule(micro == k - 1, seed, layout.replica * b);
  }
  double begin = tracer_.now_us();
  watchdog_activity(r.step, "gradient and loss all-reduce");
  fault_point(FaultWhere::kAllReduce, r.step);
  if (replicas_) {
    for (const Bucket& b : buckets_) {
      if (b.ready_after == buckets_.back().ready_after) {
        device_replicas_->all_reduce(program_->gradients() + b.begin, b.end - b.begin, ReduceOp::kSum);
      }
    }
    for (auto& request : in_flight_) request->wait();
    in_flight_.clear();
    tracer_.add("all-reduce gradients (last bucket, and wait)", "all-reduce", begin, r.step, -1);
  }
  if (pipeline_) r.loss = pipeline_->all_reduce_sum(r.loss);  // the last stage has it
  if (replicas_) r.loss = replicas_->all_reduce_sum(r.loss);
  // Inf or NaN. Every rank sees a bad loss alike. Bad gradients only the ranks holding
  // them see: under kSkip all ranks check before the update and agree (a read of every
  // gradient and one all-reduce); under kStop the optimizer notices as it goes, and the
  // caller agrees after the step (StepResult::gradients_finite).
  const bool skip = config_.on_nonfinite == NonFinite::kSkip;
  const bool scaled = config_.loss_scaling.mode != LossScaling::Mode::kNone;
  const bool dynamic = config_.loss_scaling.mode == LossScaling::Mode::kDynamic;
  if (scaled) r.loss_scale = loss_scale_;
  watchdog_activity(r.step, "checking gradients");
  const bool loss_finite = std::isfinite(r.loss);
  if (!loss_finite || ((skip || dynamic) && gradients_non_finite_anywhere())) {
    if (dynamic && loss_finite) {  // the scale's doing: skip, and try half of it
      r.scale_overflow = true;
      loss_scale_ = std::max(loss_scale_ * 0.5, LossScaling::kMin);
      scale_good_steps_ = 0;
      optimizer_->skip_step();
      return r;
    }
    r.non_finite = true;
    r.first_non_finite = first_non_finite_gradient();
    if (skip) optimizer_->skip_step();
    return r;
  }
  if (scaled && loss_scale_ != 1.0) {  // exact: a power of two
    backend_.scale(program_->gradients(), static_cast<float>(1.0 / loss_scale_), program_->trainable_elements());
  }
  if (dynamic && ++scale_good_steps_ == config_.loss_scaling.growth_interval) {
    loss_scale_ = std::min(loss_scale_ * 2.0, LossScaling::kMax);
    scale_good_steps_ = 0;
  }
  begin = tracer_.now_us();
  watchdog_activity(r.step, "optimizer");
  fault_point(FaultWhere::kOptimizer, r.step);
  if (config_.clip_grad_norm > 0) {
    r.grad_norm = clip_gradients();
    tracer_.add("clip gradients", "optimizer", begin, r.step, -1);
  }
  r.lr = config_.optimizer.lr * lr_factor(config_.schedule, r.step, config_.warmup_steps, config_.total_steps);
  begin = tracer_.now_us();
  r.gradients_finite = optimizer_->step(program_->parameters(), program_->gradients(), static_cast<float>(r.lr));
  tracer_.add("optimizer step", "optimizer", begin, r.step, -1);
  return r;
}

void Trainer::start_trace(bool record) {
  if (world_) world_->barrier();
  tracer_.start(record);
  // The trace and the pipeline bubble time forward and backward on the host clock; on a
  // backend that queues work (a GPU) that is when the work was queued, unless the action
  // waits for it. Waiting costs the host's run-ahead, so only where the figures are shown.
  time_device_work_ = record || rank_.layout().stages > 1;
}

Status Trainer::write_trace(const std::string& path) {
  const ProcessLayout& l = rank_.layout();
  const int rank = world_ ? world_->rank() : 0;
  const std::string label = "rank " + std::to_string(rank) + ": stage " + std::to_string(l.stage) + ", replica " +
                            std::to_string(l.replica) + ", shard " + std::to_string(l.shard);
  // Rank 0 gathers every rank's text in one buffer: keep the whole under 1 GiB.
  const size_t budget = (size_t{1} << 30) / static_cast<size_t>(world_ ? world_->size() : 1);
  const std::string mine = tracer_.events_json(rank, label, budget);
  const std::vector<std::string> all = world_ ? world_->gather_text(mine, 0) : std::vector<std::string>{mine};
  if (rank != 0) return Status::ok();
  return write_file_atomically(path, chrome_trace_json(all));
}

Trainer::Bubble Trainer::pipeline_bubble() {
  Bubble b;
  const double idle = tracer_.schedule_us() > 0 ? 1.0 - tracer_.busy_us() / tracer_.schedule_us() : 0.0;
  b.measured = world_ ? world_->all_reduce_sum(idle) / world_->size() : idle;
  const double p = rank_.layout().stages, m = schedule_.micro_batches;
  b.theoretical = (p - 1) / (m + p - 1);
  return b;
}

Trainer::StageTimes Trainer::stage_times() {
  const ProcessLayout& l = rank_.layout();
  std::vector<double> sums(2 * l.stages, 0.0);  // [compute of each stage, then schedule of each stage]
  sums[l.stage] = tracer_.busy_us();
  sums[l.stages + l.stage] = tracer_.schedule_us();
  if (world_) world_->all_reduce_sum(sums.data(), static_cast<int64_t>(sums.size()));
  const double ranks_per_stage = static_cast<double>(l.replicas) * l.shards;
  StageTimes t;
  for (int p = 0; p < l.stages; ++p) {
    t.compute_us.push_back(sums[p] / ranks_per_stage);
    t.schedule_us.push_back(sums[l.stages + p] / ranks_per_stage);
  }
  return t;
}

bool Trainer::gradients_non_finite_anywhere() {
  const bool mine = backend_.any_non_finite(program_->gradients(), program_->trainable_elements());
  if (!world_ || world_->size() == 1) return mine;
  return world_->all_reduce_sum(mine ? 1.0 : 0.0) > 0;
}

std::string Trainer::first_non_finite_gradient() {
  // Backward runs the last stage first and each stage's nodes last to first: the first
  // gradient to go bad is the one of the highest stage, latest node.
  std::string found;  // "<stage> <node> <description>" for the comparison on rank 0
  const Graph& g = rank_.graph();
  for (size_t i = g.nodes.size(); i-- > 0 && found.empty();) {
    for (int q : g.node_params(g.nodes[i])) {
      const int64_t at = program_->parameter_offset(q);
      if (at < 0 || !backend_.any_non_finite(program_->gradients() + at, g.params[q].elements())) continue;
      const int stage = rank_.layout().stage;
      found = fmt_key(stage, i) + " '" + rank_.full().params[rank_.full_param(q)].name + "' (node '" + g.nodes[i].name +
              "'" + (rank_.layout().stages > 1 ? ", stage " + std::to_string(stage) : "") + ")";
      break;
    }
  }
  const std::vector<std::string> all = world_ && world_->size() > 1 ? world_->gather_text(found, 0)
                                                                    : std::vector<std::string>{found};
  std::string first;
  for (const std::string& f : all) {
    if (!f.empty() && (first.empty() || f.substr(0, kKeyWidth) > first.substr(0, kKeyWidth))) first = f;
  }
  return first.empty() ? first : first.substr(kKeyWidth + 1);
}

// torch's clip_grad_norm_ over the whole model: each stage adds its parameters' squares,
// a parameter split over the shards counts every slice, a replicated one counts once.
double Trainer::clip_gradients() {
  float* grads = program_->gradients();
  const int64_t n = program_->trainable_elements();
  if (rank_.is_whole()) return clip_grad_norm(backend_, grads, n, config_.clip_grad_norm);
  const Graph& g = rank_.graph();
  double squares = 0;
  for (size_t q = 0; q < g.params.size(); ++q) {
    const int64_t at = program_->parameter_offset(static_cast<int>(q));
    if (at < 0 || (rank_.layout().shard != 0 && rank_.shard_axis(static_cast<int>(q)) < 0)) continue;
    squares += backend_.sum_squares(grads + at, g.params[q].elements());
  }
  if (tensor_) squares = tensor_->all_reduce_sum(squares);
  if (pipeline_) squares = pipeline_->all_reduce_sum(squares);
  const double norm = std::sqrt(squares);
  const double coef = config_.clip_grad_norm / (norm + 1e-6);
  if (coef < 1.0) backend_.scale(grads, static_cast<float>(coef), n);
  return norm;
}

std::vector<std::vector<float>> Trainer::local_values() const {
  Graph copy = rank_.graph();
  program_->download_parameters(copy);
  std::vector<std::vector<float>> out;
  for (Parameter& p : copy.params) out.push_back(std::move(p.data));
  return out;
}

std::vector<std::vector<float>> Trainer::local_slot(int s) const {
  const Graph& g = rank_.graph();
  const std::vector<float> slot = optimizer_->state()[s];
  std::vector<std::vector<float>> out(g.params.size());
  for (size_t q = 0; q < g.params.size(); ++q) {
    const int64_t at = program_->parameter_offset(static_cast<int>(q));
    if (at >= 0) out[q].assign(slot.begin() + at, slot.begin() + at + g.params[q].elements());
  }
  return out;
}

void Trainer::download_parameters(Graph& graph) {
  if (rank_.is_whole()) {
    program_->download_parameters(graph);
    return;
  }
  std::vector<std::vector<float>> whole;
  rank_.gather(local_values(), whole, *world_, tensor_, false);
  for (size_t p = 0; p < whole.size(); ++p) {
    if (!whole[p].empty()) graph.params[p].data = std::move(whole[p]);
  }
}

// The forward-only program evaluation runs `graph` through, in chunks of the whole batch;
// made on first use.
Program& Trainer::eval_program(const Graph& graph) {
  if (!eval_program_) {
    ProgramOptions forward_only;
    forward_only.forward_only = true;
    Result<std::unique_ptr<Program>> p = Program::create(graph, backend_, config_.batch_size, forward_only);
    PIPESHARD_CHECK(p.is_ok(), p.status().message());
    eval_program_ = std::move(*p);
  }
  return *eval_program_;
}

EvalResult Trainer::evaluate(const Dataset& data) {
  EvalResult e;
  Program* program = program_.get();
  if (!rank_.is_whole()) {
    if (!eval_graph_) eval_graph_ = std::make_unique<Graph>(rank_.full());
    download_parameters(*eval_graph_);
    if (world_->rank() != 0) return e;
    program = &eval_program(*eval_graph_);
    program->upload_parameters(*eval_graph_);
  } else if (world_ && world_->rank() != 0) {
    return e;  // every replica holds the same model: rank 0 evaluates it
  } else if (config_.batch_size > micro_) {
    // The training program holds one micro-batch. Evaluation goes in chunks of the whole
    // batch in every layout (the same chunks give the same sums), through a forward-only
    // program made the first time, holding no gradients, with the training weights
    // copied in on the device.
    program = &eval_program(rank_.graph());
    program->copy_parameters_from(*program_);
  }
  program->select_slot(0);
  const int64_t b = config_.batch_size;
  const int64_t per_out = program->output_shape(0).per_sample_elements();
  const bool log_probs = ends_in_log_softmax(rank_.full());
  std::vector<float> outputs, features, targets_host;
  DeviceBuffer targets(backend_, b * data.targets_per_sample);
  int64_t correct = 0;
  for (int64_t first = 0; first < data.samples; first += b) {
    const int64_t rows = std::min(b, data.samples - first);
    std::vector<int64_t> idx(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) idx[i] = first + i;
    gather_rows(data.features, data.features_per_sample, idx, features);
    gather_rows(data.targets, data.targets_per_sample, idx, targets_host);
    backend_.upload(targets.data(), targets_host.data(), rows * data.targets_per_sample);
    program->forward({features.data()}, rows, Mode::kEval, 0);
    e.loss += apply_loss(*program, config_.loss, log_probs, targets.data(), rows, data.samples);
    if (config_.loss == LossKind::kCrossEntropy) {
      outputs.resize(static_cast<size_t>(rows * per_out));
      backend_.download(outputs.data(), program->output(0), rows * per_out);
      for (int64_t r = 0; r < rows; ++r) {
        const float* o = &outputs[r * per_out];
        const int64_t best = std::max_element(o, o + per_out) - o;
        correct += best == static_cast<int64_t>(targets_host[r]);
      }
    }
  }
  e.samples = data.samples;
  e.accuracy = config_.loss == LossKind::kCrossEntropy ? static_cast<double>(correct) / data.samples : -1.0;
  // Evaluation runs more rows than a training micro-batch, which may have grown scratch
  // buffers of the backend (the 16-bit GEMM operands) and moved them from where --cuda-graph's
  // recordings point: the next step records afresh.
  recorded_.clear();
  return e;
}

}  // namespace pipeshard
