#include "runtime/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "comm/watchdog.h"
#include "common/fault_injection.h"
#include "partitioner/layout_search.h"
#include "schedule/registry.h"

namespace pipeshard {
namespace {

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

// How the stages are cut, and what the memory estimate assumes: `config` on `layout` as
// the layout search (partitioner/layout_search.h) sees a layout, so that what it estimates
// is what train checks: the replica's batch, its micro-batches, the schedule, the
// optimizer's state per parameter, the ZeRO stage and the activations `backend` keeps.
PartitionOptions partition_options(const TrainConfig& config, const ProcessLayout& layout, const Backend& backend) {
  Layout l;
  l.replicas = layout.replicas;
  l.stages = layout.stages;
  l.shards = layout.shards;
  l.micro_batches = config.micro_batches;
  l.schedule = config.pipeline_schedule;
  l.virtual_stages = config.virtual_stages;
  l.keep_activations = config.keep_activations;
  l.zero = config.zero;
  LayoutSearchOptions o;
  o.batch_size = config.batch_size;
  const OptimizerConfig& opt = config.optimizer;
  o.optimizer_slots = opt.kind != OptimizerKind::kSgd ? 2 : opt.momentum != 0.0f ? 1 : 0;
  o.bucket_bytes = config.bucket_bytes;
  o.balance = config.balance;
  o.kept_when_fused = kept_when_fused(backend);
  return layout_partition_options(l, o);
}

}  // namespace

std::vector<int64_t> Trainer::memory_per_stage(const Graph& graph, const TrainConfig& config,
                                               const ProcessLayout& layout, const Backend& backend) {
  const int64_t d = layout.replicas, m = config.micro_batches;
  // A batch that does not divide is create()'s to refuse, with its own message.
  if (config.batch_size % d != 0 || m < 1 || (config.batch_size / d) % m != 0) return {};
  if (find_schedule(config.pipeline_schedule) == nullptr) return {};
  Result<Plan> plan = make_plan(graph, "", partition_options(config, layout, backend));
  if (!plan) return {};
  return pipeshard::memory_per_stage(*plan);
}

Trainer::Trainer(const Dataset& data, Backend& backend, const TrainConfig& config, RankModel rank)
    : data_(data), backend_(backend), config_(config), rank_(std::move(rank)), scaler_(config.loss_scaling),
      order_(data.samples, config.batch_size, config.shuffle, config.seed) {}

Trainer::~Trainer() = default;

Trainer::Memory Trainer::memory() const {
  Memory m{program_->memory(), optimizer_->state_bytes(), backend_.memory_use().peak};
  if (zero_stage() == 2) m.program.gradients = sync_->gradient_bytes();  // its windows and sums
  return m;
}

Result<std::unique_ptr<Trainer>> Trainer::create(const Graph& graph, const Dataset& data, Backend& backend,
                                                 const TrainConfig& config, const Parallel& parallel) {
  const ProcessLayout layout = parallel.groups ? parallel.groups->layout : ProcessLayout{};
  PIPESHARD_RETURN_IF_ERROR(check_train_config(config, layout, graph, data.samples));
  const int64_t local_batch = config.batch_size / layout.replicas;
  RankModel rank = layout.stages == 1 && layout.shards == 1 ? RankModel::whole(graph, layout) : RankModel();
  if (layout.stages > 1 || layout.shards > 1) {
    PIPESHARD_CHECK(parallel.model != nullptr && &parallel.model->graph == &graph,
                    "cutting stages needs the ImportedModel the graph belongs to");
    Result<RankModel> cut = RankModel::create(*parallel.model, layout, partition_options(config, layout, backend));
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
  ProcessGroups* device = parallel.device_groups ? parallel.device_groups : parallel.groups;
  Communicator* device_replicas = t->replicas_ ? device->data.get() : nullptr;
  Communicator* device_tensor = t->tensor_ ? device->tensor.get() : nullptr;
  Communicator* device_pipeline = t->pipeline_ ? device->pipeline.get() : nullptr;
  t->local_batch_ = local_batch;
  t->micro_ = micro_batch_rows(config, layout);
  LowerOptions lowering;
  lowering.reduce_gradients = t->replicas_ != nullptr;
  t->schedule_ = make_pipeline_schedule(config.pipeline_schedule, layout.stages, config.micro_batches, lowering,
                                        config.virtual_stages);
  // The schedule is data anything may register: check it before running it.
  if (Status s = check_pipeline_schedule(t->schedule_); !s) {
    return Status::invalid("pipeline_schedule", "schedule '" + config.pipeline_schedule + "': " + s.message());
  }
  PIPESHARD_RETURN_IF_ERROR(t->build(config, device_replicas, device_tensor, device_pipeline));
  return t;
}

// The program, optimizer and buffers of this rank, and the runner of its stage.
Status Trainer::build(const TrainConfig& config, Communicator* device_replicas, Communicator* device_tensor,
                      Communicator* device_pipeline) {
  const ProcessLayout& layout = rank_.layout();
  const Graph& g = rank_.graph();
  ProgramOptions options;
  for (int j = 0; j < rank_.chunks(); ++j) {
    options.chunk_slots.push_back(StageRunner::slots_needed(schedule_, layout.stage, j));
  }
  options.slots = *std::max_element(options.chunk_slots.begin(), options.chunk_slots.end());
  if (rank_.chunks() == 1) options.chunk_slots.clear();
  options.node_chunk = rank_.node_chunk();
  options.input_needs_grad = rank_.input_needs_grad();
  options.tensor = device_tensor;
  options.model_node_ids = rank_.model_node_ids();
  options.recompute_activations = !config.keep_activations;
  options.split_backward = splits_backward(schedule_.actions[layout.stage]);
  // ZeRO stage 2 keeps the gradients in windows, where every backward pass writes them
  // whole (runtime/gradient_sync.h); with I and W passes or model chunks it runs as stage 1.
  options.gradients_elsewhere = config.zero >= 2 && device_replicas && !options.split_backward && rank_.chunks() == 1;
  if (config.sync_batchnorm && device_replicas) {
    options.batchnorm_reducer = [device_replicas](double* data, int64_t n) {
      device_replicas->all_reduce_sum(data, n);
    };
  }
  // One micro-batch per slot: what the memory estimate counts, and what micro-batches are
  // for. Evaluation, in whole batches, has a program of its own (evaluate()).
  Result<std::unique_ptr<Program>> program = Program::create(g, backend_, micro_, options);
  if (!program) return program.status();
  program_ = std::move(*program);
  log_probs_ = computes_loss() && ends_in_log_softmax(g);
  targets_ = DeviceBuffer(backend_, std::max(local_batch_, config.batch_size) * data_.targets_per_sample);
  if (device_replicas) {
    sync_ = std::make_unique<GradientSync>(g, *program_, *device_replicas, config.bucket_bytes);
    if (config.zero >= 1) {
      // PIPESHARD_ZERO_WINDOWS=always: stage 2's windows even where they save nothing (the
      // tests'). The replicas agree on it, so that all run the same collectives.
      const char* env = std::getenv("PIPESHARD_ZERO_WINDOWS");
      const double always = env && std::string(env) == "always" ? 1.0 : 0.0;
      sync_->shard(backend_, options.gradients_elsewhere, replicas_->all_reduce_sum(always) > 0);
    }
  }
  if (sync_ && sync_->zero()) {
    spans_ = sync_->spans();
  } else {
    spans_ = {{program_->parameters(), program_->gradients(), program_->trainable_elements()}};
  }
  // Under ZeRO each replica keeps the state of its slices only.
  optimizer_ = std::make_unique<Optimizer>(backend_, config.optimizer,
                                           zero() ? zero()->owned_elements() : program_->trainable_elements());
  runner_ = std::make_unique<StageRunner>(rank_, *program_, backend_, device_pipeline, sync_.get(), schedule_, micro_,
                                          data_.features_per_sample, tracer_);
  return Status::ok();
}

void Trainer::note_data_error(Status s) {
  if (data_error_.is_ok()) data_error_ = std::move(s);
}

// The features of `rows`: where they lie in order in one shard (unshuffled data, or any
// slice of it), read in place; else gathered into host_features_. A batch of the benchmark's
// large MLP is 256 MiB, a copy that costs a GPU step's worth of time to no purpose.
const float* Trainer::batch_rows(const std::vector<int64_t>& rows) {
  bool in_order = !rows.empty();
  for (size_t i = 1; in_order && i < rows.size(); ++i) in_order = rows[i] == rows[0] + static_cast<int64_t>(i);
  if (in_order) {
    if (const float* p = data_.features.in_place(rows[0], static_cast<int64_t>(rows.size()))) {
      note_data_error(data_.features.check_rows(rows[0], static_cast<int64_t>(rows.size())));
      return p;
    }
  }
  note_data_error(data_.features.gather(rows, host_features_));
  return host_features_.data();
}

StageRunner::MicroStep Trainer::micro_step(int64_t step, int64_t micro, int64_t batch_index) {
  const ProcessLayout& layout = rank_.layout();
  const int64_t b = local_batch_;
  // This replica's contiguous slice of the global batch.
  std::vector<int64_t> rows = order_.indices(batch_index);
  rows = std::vector<int64_t>(rows.begin() + layout.replica * b, rows.begin() + (layout.replica + 1) * b);
  StageRunner::MicroStep ms;
  ms.step = step;
  ms.index = micro;
  ms.last = micro == config_.grad_accum - 1;
  // One seed per batch for every rank; masks depend on the sample's place in the batch.
  ms.seed = batch_seed(config_.seed, batch_index);
  ms.first_sample = layout.replica * b;
  ms.replay = config_.cuda_graph && warmed_up_;
  if (reads_data()) ms.features = batch_rows(rows);
  if (computes_loss()) {
    note_data_error(data_.targets.gather(rows, host_targets_));
    backend_.upload(targets_.data(), host_targets_.data(), b * data_.targets_per_sample);
  }
  return ms;
}

// Divided by the global sample count: the sum over micro-batches and replicas is the
// global mean. The output gradient is scaled for loss scaling (exact: a power of two).
double Trainer::micro_batch_loss(int k) {
  const int64_t global = config_.batch_size * config_.grad_accum;
  const double loss = apply_loss(*program_, config_.loss, log_probs_,
                                 targets_.data() + k * micro_ * data_.targets_per_sample, micro_, global);
  if (scaler_.scale() != 1.0) {
    backend_.scale(program_->output_gradient(0), static_cast<float>(scaler_.scale()),
                   micro_ * program_->output_shape(0).per_sample_elements());
  }
  return loss;
}

StepResult Trainer::step() {
  StepResult r;
  r.step = steps_done() + 1;
  const int64_t k = config_.grad_accum;
  program_->zero_gradients();
  const auto loss = [this](int micro_batch) { return micro_batch_loss(micro_batch); };
  for (int64_t micro = 0; micro < k; ++micro) {
    const int64_t batch_index = (r.step - 1) * k + micro;
    if (micro == 0) r.epoch = order_.epoch_of(batch_index);
    r.loss += runner_->run(micro_step(r.step, micro, batch_index), loss);
  }
  if (!data_error_.is_ok()) {
    r.bad_data = data_error_.message();
    data_error_ = Status::ok();
  }
  warmed_up_ = true;
  watchdog_activity(r.step, "loss all-reduce");
  fault_point(FaultWhere::kAllReduce, r.step);
  if (pipeline_) r.loss = pipeline_->all_reduce_sum(r.loss);  // the last stage has it
  if (replicas_) r.loss = replicas_->all_reduce_sum(r.loss);
  if (scaler_.enabled()) r.loss_scale = scaler_.scale();
  if (skip_non_finite(r)) return r;
  if (scaler_.enabled() && scaler_.scale() != 1.0) {  // exact: a power of two
    for (const Optimizer::Span& s : gradient_spans()) {
      backend_.scale(const_cast<float*>(s.grads), static_cast<float>(1.0 / scaler_.scale()), s.n);
    }
  }
  scaler_.updated();
  double begin = tracer_.now_us();
  watchdog_activity(r.step, "optimizer");
  fault_point(FaultWhere::kOptimizer, r.step);
  if (config_.clip_grad_norm > 0) {
    r.grad_norm = clip_gradients();
    tracer_.add("clip gradients", "optimizer", begin, r.step, -1);
  }
  r.lr = config_.optimizer.lr * lr_factor(config_.schedule, r.step, config_.warmup_steps, config_.total_steps);
  begin = tracer_.now_us();
  r.gradients_finite = optimizer_->step(gradient_spans(), static_cast<float>(r.lr));
  tracer_.add("optimizer step", "optimizer", begin, r.step, -1);
  if (zero()) {  // every replica's updated slices, to every replica
    begin = tracer_.now_us();
    watchdog_activity(r.step, "all-gather of the updated weights");
    sync_->gather_parameters();
    tracer_.add("all-gather weights", "allreduce", begin, r.step, -1);
  }
  return r;
}

// Inf or NaN. Every rank sees a bad loss alike. Bad gradients only the ranks holding them
// see: under kSkip all ranks check before the update and agree (a read of every gradient
// and one all-reduce); under kStop the optimizer notices as it goes, and the caller agrees
// after the step (StepResult::gradients_finite). Returns whether the step is over.
bool Trainer::skip_non_finite(StepResult& r) {
  const bool skip = config_.on_nonfinite == NonFinite::kSkip;
  watchdog_activity(r.step, "checking gradients");
  const bool loss_finite = std::isfinite(r.loss);
  if (loss_finite && !((skip || scaler_.dynamic()) && gradients_non_finite_anywhere())) return false;
  if (scaler_.dynamic() && loss_finite) {  // the scale's doing: skip, and try half of it
    r.scale_overflow = true;
    scaler_.overflowed();
    optimizer_->skip_step();
    return true;
  }
  r.non_finite = true;
  r.first_non_finite = first_non_finite_gradient();
  if (skip) optimizer_->skip_step();
  return true;
}

// Calls fn(grads, n, everywhere) for the pieces of [at, at + elements) of the gradient
// buffer this rank holds reduced: all of it, or under ZeRO its parts in this replica's
// slices (`everywhere` false) and in the tails every replica holds (true).
template <typename Fn>
void Trainer::for_each_gradient_piece(int64_t at, int64_t elements, Fn fn) {
  if (!zero()) {
    fn(spans_[0].grads + at, elements, false);
    return;
  }
  const std::vector<ZeroShards::Range>& ranges = zero()->ranges();
  for (size_t i = 0; i < ranges.size(); ++i) {
    const int64_t begin = std::max(at, ranges[i].at), end = std::min(at + elements, ranges[i].at + ranges[i].n);
    if (begin < end) fn(spans_[i].grads + (begin - ranges[i].at), end - begin, i >= zero()->pieces().size());
  }
}

bool Trainer::gradients_non_finite_anywhere() {
  bool mine = false;
  for (const Optimizer::Span& s : gradient_spans()) mine = mine || (s.n > 0 && backend_.any_non_finite(s.grads, s.n));
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
      if (at < 0) continue;
      bool bad = false;
      for_each_gradient_piece(at, g.params[q].elements(), [&](const float* grads, int64_t n, bool) {
        bad = bad || backend_.any_non_finite(grads, n);
      });
      if (!bad) continue;
      const int stage = rank_.layout().stage;
      // Backward runs the model's chunks last to first (a stage's chunk when it holds one).
      const int chunk = rank_.model_chunk(rank_.node_chunk().empty() ? 0 : rank_.node_chunk()[i]);
      found = fmt_key(chunk, i) + " '" + rank_.full().params[rank_.full_param(q)].name + "' (node '" + g.nodes[i].name +
              "'" + (rank_.layout().stages > 1 ? ", stage " + std::to_string(stage) : "") + ")";
      break;
    }
  }
  const std::vector<std::string> all =
      world_ && world_->size() > 1 ? world_->gather_text(found, 0) : std::vector<std::string>{found};
  std::string first;
  for (const std::string& f : all) {
    if (!f.empty() && (first.empty() || f.substr(0, kKeyWidth) > first.substr(0, kKeyWidth))) first = f;
  }
  return first.empty() ? first : first.substr(kKeyWidth + 1);
}

std::vector<double> Trainer::gradient_magnitudes() const {
  PIPESHARD_CHECK(rank_.is_whole() && !zero(), "gradient magnitudes of a trainer of part of a model, or under ZeRO");
  const Graph& g = rank_.graph();
  std::vector<float> grads(static_cast<size_t>(program_->trainable_elements()));
  backend_.download(grads.data(), program_->gradients(), program_->trainable_elements());
  std::vector<double> out(g.params.size(), 0.0);
  for (size_t q = 0; q < g.params.size(); ++q) {
    const int64_t at = program_->parameter_offset(static_cast<int>(q));
    for (int64_t i = 0; at >= 0 && i < g.params[q].elements(); ++i) {
      out[q] = std::max(out[q], static_cast<double>(std::fabs(grads[at + i])));
    }
  }
  return out;
}

// torch's clip_grad_norm_ over the whole model: each rank adds up its parameters' squares
// by whole-model parameter, a parameter split over the shards counting every slice and a
// replicated one once; the sums travel as one vector, and every rank adds it up in the
// model's parameter order. So the norm does not depend on how the stages are cut into
// ranks or chunks: P stages of v chunks clip as P·v stages do, bit for bit.
double Trainer::clip_gradients() {
  float* grads = program_->gradients();
  const int64_t n = program_->trainable_elements();
  if (rank_.is_whole() && !zero()) return clip_grad_norm(backend_, grads, n, config_.clip_grad_norm);
  const Graph& g = rank_.graph();
  std::vector<double> by_param(rank_.full().params.size(), 0.0);
  for (size_t q = 0; q < g.params.size(); ++q) {
    const int64_t at = program_->parameter_offset(static_cast<int>(q));
    if (at < 0 || (rank_.layout().shard != 0 && rank_.shard_axis(static_cast<int>(q)) < 0)) continue;
    double& sum = by_param[rank_.full_param(static_cast<int>(q))];
    for_each_gradient_piece(at, g.params[q].elements(), [&](const float* piece, int64_t count, bool everywhere) {
      // Under ZeRO a tail is on every replica: replica 0 counts it.
      if (!everywhere || rank_.layout().replica == 0) sum += backend_.sum_squares(piece, count);
    });
  }
  const int64_t count = static_cast<int64_t>(by_param.size());
  if (zero()) replicas_->all_reduce_sum(by_param.data(), count);
  if (tensor_) tensor_->all_reduce_sum(by_param.data(), count);
  if (pipeline_) pipeline_->all_reduce_sum(by_param.data(), count);
  double squares = 0;
  for (double s : by_param) squares += s;
  const double norm = std::sqrt(squares);
  const double coef = config_.clip_grad_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (const Optimizer::Span& s : gradient_spans())
      backend_.scale(const_cast<float*>(s.grads), static_cast<float>(coef), s.n);
  }
  return norm;
}

}  // namespace pipeshard
