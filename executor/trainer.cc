#include "executor/trainer.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "common/atomic_file.h"

namespace pipeshard {
namespace {

constexpr char kCheckpointFile[] = "checkpoint.pipeshard";
constexpr char kCheckpointMagic[8] = {'P', 'S', 'C', 'K', 'P', 'T', '0', '1'};

// Dropout masks depend on the run's seed and the batch, never on how the run was split
// into invocations.
uint64_t batch_seed(uint64_t seed, int64_t batch) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(batch + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

const char* optimizer_name(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdamW: return "adamw";
  }
  return "?";
}

}  // namespace

Trainer::Trainer(const Dataset& data, Backend& backend, const TrainConfig& config)
    : data_(data), backend_(backend), config_(config),
      order_(data.samples, config.batch_size, config.shuffle, config.seed) {}

Result<std::unique_ptr<Trainer>> Trainer::create(const Graph& graph, const Dataset& data, Backend& backend,
                                                 const TrainConfig& config, Communicator* replicas) {
  if (config.batch_size < 1) return Status::error("--batch-size must be at least 1");
  const int64_t d = replicas ? replicas->size() : 1;
  if (config.batch_size % d != 0) {
    return Status::error("--batch-size " + std::to_string(config.batch_size) + " does not divide among " +
                         std::to_string(d) + " data-parallel replicas");
  }
  if (config.grad_accum < 1) return Status::error("--grad-accum must be at least 1");
  if (data.samples < config.batch_size) {
    return Status::error("the data has " + std::to_string(data.samples) + " samples, fewer than one batch of " +
                         std::to_string(config.batch_size));
  }
  for (const Node& n : graph.nodes) {
    const Shape& s = graph.values[n.inputs[0]].shape;
    if (n.kind == OpKind::kBatchNorm && config.batch_size / d * (s.per_sample_elements() / s.dims[1]) < 2) {
      return Status::error("node '" + n.name + "' (BatchNorm) needs more than one value per channel to train; use a batch of 2 or more");
    }
  }
  std::unique_ptr<Trainer> t(new Trainer(data, backend, config));
  t->replicas_ = d > 1 ? replicas : nullptr;
  t->local_batch_ = config.batch_size / d;
  Result<std::unique_ptr<Program>> program = Program::create(graph, backend, std::max(t->local_batch_, config.batch_size));
  if (!program) return program.status();
  t->program_ = std::move(*program);
  t->log_probs_ = ends_in_log_softmax(graph);
  t->optimizer_ = std::make_unique<Optimizer>(backend, config.optimizer, t->program_->trainable_elements());
  t->targets_ = DeviceBuffer(backend, config.batch_size * data.targets_per_sample);
  if (t->replicas_) t->plan_buckets(graph);
  return t;
}

// Buckets cover the gradient buffer from its end (the last layers, whose gradients
// backward finishes first) towards its start, each about config.bucket_bytes, never
// splitting a parameter. A bucket is complete once backward has passed the earliest
// node using any of its parameters.
void Trainer::plan_buckets(const Graph& graph) {
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
    if (b.ready_after == node) {
      in_flight_.push_back(replicas_->all_reduce_async(program_->gradients() + b.begin, b.end - b.begin, ReduceOp::kSum));
    }
  }
}

StepResult Trainer::step() {
  StepResult r;
  r.step = steps_done() + 1;
  const int64_t k = config_.grad_accum, b = local_batch_, global = config_.batch_size * k;
  const int replica = replicas_ ? replicas_->rank() : 0;
  program_->zero_gradients();
  for (int64_t micro = 0; micro < k; ++micro) {
    const int64_t batch_index = (r.step - 1) * k + micro;
    if (micro == 0) r.epoch = order_.epoch_of(batch_index);
    // This replica's contiguous slice of the global batch.
    std::vector<int64_t> rows = order_.indices(batch_index);
    rows = std::vector<int64_t>(rows.begin() + replica * b, rows.begin() + (replica + 1) * b);
    gather_rows(data_.features, data_.features_per_sample, rows, host_features_);
    gather_rows(data_.targets, data_.targets_per_sample, rows, host_targets_);
    backend_.upload(targets_.data(), host_targets_.data(), b * data_.targets_per_sample);
    const uint64_t seed = batch_seed(config_.seed ^ (0x5851f42d4c957f2dULL * static_cast<uint64_t>(replica)), batch_index);
    program_->forward({host_features_.data()}, b, Mode::kTrain, seed);
    // Divided by the global sample count: the sum over replicas is the global mean.
    r.loss += apply_loss(*program_, config_.loss, log_probs_, targets_.data(), b, global);
    const bool last = micro == k - 1;
    if (replicas_ && last) {
      program_->backward(b, [this](size_t node) { on_gradients_ready(node); });
    } else {
      program_->backward(b);  // accumulating: no communication until the last micro-step
    }
  }
  if (replicas_) {
    for (auto& request : in_flight_) request->wait();
    in_flight_.clear();
    r.loss = replicas_->all_reduce_sum(r.loss);
  }
  const int64_t n = program_->trainable_elements();
  if (config_.clip_grad_norm > 0) r.grad_norm = clip_grad_norm(backend_, program_->gradients(), n, config_.clip_grad_norm);
  r.lr = config_.optimizer.lr * lr_factor(config_.schedule, r.step, config_.warmup_steps, config_.total_steps);
  optimizer_->step(program_->parameters(), program_->gradients(), static_cast<float>(r.lr));
  return r;
}

EvalResult Trainer::evaluate(const Dataset& data) {
  EvalResult e;
  const int64_t b = config_.batch_size;
  const int64_t per_out = program_->output_shape(0).per_sample_elements();
  std::vector<float> outputs;
  DeviceBuffer targets(backend_, b * data.targets_per_sample);
  int64_t correct = 0;
  for (int64_t first = 0; first < data.samples; first += b) {
    const int64_t rows = std::min(b, data.samples - first);
    std::vector<int64_t> idx(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) idx[i] = first + i;
    gather_rows(data.features, data.features_per_sample, idx, host_features_);
    gather_rows(data.targets, data.targets_per_sample, idx, host_targets_);
    backend_.upload(targets.data(), host_targets_.data(), rows * data.targets_per_sample);
    program_->forward({host_features_.data()}, rows, Mode::kEval, 0);
    e.loss += apply_loss(*program_, config_.loss, log_probs_, targets.data(), rows, data.samples);
    // Every replica evaluates everything (eval data is small); results are identical.
    if (config_.loss == LossKind::kCrossEntropy) {
      outputs.resize(static_cast<size_t>(rows * per_out));
      backend_.download(outputs.data(), program_->output(0), rows * per_out);
      for (int64_t r = 0; r < rows; ++r) {
        const float* o = &outputs[r * per_out];
        const int64_t best = std::max_element(o, o + per_out) - o;
        correct += best == static_cast<int64_t>(host_targets_[r]);
      }
    }
  }
  e.samples = data.samples;
  e.accuracy = config_.loss == LossKind::kCrossEntropy ? static_cast<double>(correct) / data.samples : -1.0;
  return e;
}

// Layout: 8-byte magic, 8-byte little-endian header length, a JSON header, then the
// float32 arrays it lists, in its order.
Status Trainer::save_checkpoint(const std::string& dir, Graph& scratch) const {
  program_->download_parameters(scratch);
  nlohmann::json header;
  header["format"] = 1;
  header["step"] = steps_done();
  header["optimizer"] = optimizer_name(config_.optimizer.kind);
  header["tensors"] = nlohmann::json::array();
  std::string body;
  auto add = [&](const std::string& name, const std::string& role, const float* data, int64_t n) {
    header["tensors"].push_back({{"name", name}, {"role", role}, {"elements", n}});
    body.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n) * sizeof(float));
  };
  for (const Parameter& p : scratch.params) add(p.name, "value", p.data.data(), p.elements());
  // Optimizer slots are stored per parameter too, so a checkpoint does not depend on
  // how parameters are laid out in memory (a later resharding reads them by name).
  const auto slots = optimizer_->state();
  for (size_t s = 0; s < slots.size(); ++s) {
    for (size_t i = 0; i < scratch.params.size(); ++i) {
      const int64_t at = program_->parameter_offset(static_cast<int>(i));
      if (!scratch.params[i].trainable) continue;
      add(scratch.params[i].name, "slot" + std::to_string(s), slots[s].data() + at, scratch.params[i].elements());
    }
  }
  const std::string head = header.dump();
  std::string file(kCheckpointMagic, 8);
  const uint64_t len = head.size();
  file.append(reinterpret_cast<const char*>(&len), 8);
  file += head;
  file += body;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::error("cannot create checkpoint folder '" + dir + "'");
  return write_file_atomically((std::filesystem::path(dir) / kCheckpointFile).string(), file);
}

Status Trainer::load_checkpoint(const std::string& dir, Graph& graph) {
  const std::string path = (std::filesystem::path(dir) / kCheckpointFile).string();
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(path + ": no checkpoint here");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t len = 0;
  if (bytes.size() < 16 || std::memcmp(bytes.data(), kCheckpointMagic, 8) != 0) {
    return Status::error(path + ": not a pipeshard checkpoint");
  }
  std::memcpy(&len, bytes.data() + 8, 8);
  if (len > bytes.size() - 16) return Status::error(path + ": truncated checkpoint header");
  nlohmann::json header = nlohmann::json::parse(bytes.substr(16, len), nullptr, false);
  if (header.is_discarded() || !header.contains("tensors") || !header.contains("step")) {
    return Status::error(path + ": corrupt checkpoint header");
  }
  if (header.value("optimizer", "") != optimizer_name(config_.optimizer.kind)) {
    return Status::error(path + ": written with optimizer '" + header.value("optimizer", "?") + "', this run uses '" +
                         optimizer_name(config_.optimizer.kind) + "'");
  }
  std::unordered_map<std::string, int> by_name;
  for (size_t i = 0; i < graph.params.size(); ++i) by_name[graph.params[i].name] = static_cast<int>(i);
  std::vector<std::vector<float>> slots(static_cast<size_t>(optimizer_->slots()),
                                        std::vector<float>(static_cast<size_t>(program_->trainable_elements())));
  size_t at = 16 + len;
  std::vector<bool> restored(graph.params.size(), false);
  for (const auto& t : header["tensors"]) {
    const std::string name = t.value("name", ""), role = t.value("role", "");
    const int64_t n = t.value("elements", int64_t{-1});
    auto it = by_name.find(name);
    if (it == by_name.end()) return Status::error(path + ": tensor '" + name + "' is not in this model");
    if (n != graph.params[it->second].elements()) return Status::error(path + ": tensor '" + name + "' has the wrong size");
    if (n * sizeof(float) > bytes.size() - at) return Status::error(path + ": truncated checkpoint");
    float* dst = nullptr;
    if (role == "value") {
      dst = graph.params[it->second].data.data();
      restored[it->second] = true;
    } else if (role.rfind("slot", 0) == 0 && graph.params[it->second].trainable) {
      const size_t s = static_cast<size_t>(std::atoi(role.c_str() + 4));
      if (s >= slots.size()) return Status::error(path + ": optimizer state does not match this optimizer");
      dst = slots[s].data() + program_->parameter_offset(it->second);
    } else {
      return Status::error(path + ": unknown tensor role '" + role + "'");
    }
    std::memcpy(dst, bytes.data() + at, static_cast<size_t>(n) * sizeof(float));
    at += static_cast<size_t>(n) * sizeof(float);
  }
  for (size_t p = 0; p < restored.size(); ++p) {
    if (!restored[p]) return Status::error(path + ": has no values for '" + graph.params[p].name + "'");
  }
  program_->upload_parameters(graph);
  optimizer_->restore(header["step"].get<int64_t>(), slots);
  return Status::ok();
}

}  // namespace pipeshard
