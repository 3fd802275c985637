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
                                                 const TrainConfig& config) {
  if (config.batch_size < 1) return Status::error("--batch-size must be at least 1");
  if (config.grad_accum < 1) return Status::error("--grad-accum must be at least 1");
  if (data.samples < config.batch_size) {
    return Status::error("the data has " + std::to_string(data.samples) + " samples, fewer than one batch of " +
                         std::to_string(config.batch_size));
  }
  for (const Node& n : graph.nodes) {
    const Shape& s = graph.values[n.inputs[0]].shape;
    if (n.kind == OpKind::kBatchNorm && config.batch_size * (s.per_sample_elements() / s.dims[1]) < 2) {
      return Status::error("node '" + n.name + "' (BatchNorm) needs more than one value per channel to train; use a batch of 2 or more");
    }
  }
  std::unique_ptr<Trainer> t(new Trainer(data, backend, config));
  Result<std::unique_ptr<Program>> program = Program::create(graph, backend, config.batch_size);
  if (!program) return program.status();
  t->program_ = std::move(*program);
  t->log_probs_ = ends_in_log_softmax(graph);
  t->optimizer_ = std::make_unique<Optimizer>(backend, config.optimizer, t->program_->trainable_elements());
  t->targets_ = DeviceBuffer(backend, config.batch_size * data.targets_per_sample);
  return t;
}

StepResult Trainer::step() {
  StepResult r;
  r.step = steps_done() + 1;
  const int64_t k = config_.grad_accum, b = config_.batch_size;
  program_->zero_gradients();
  for (int64_t micro = 0; micro < k; ++micro) {
    const int64_t batch_index = (r.step - 1) * k + micro;
    if (micro == 0) r.epoch = order_.epoch_of(batch_index);
    const std::vector<int64_t> rows = order_.indices(batch_index);
    gather_rows(data_.features, data_.features_per_sample, rows, host_features_);
    gather_rows(data_.targets, data_.targets_per_sample, rows, host_targets_);
    backend_.upload(targets_.data(), host_targets_.data(), b * data_.targets_per_sample);
    program_->forward({host_features_.data()}, b, Mode::kTrain, batch_seed(config_.seed, batch_index));
    r.loss += apply_loss(*program_, config_.loss, log_probs_, targets_.data(), b, b * k);
    program_->backward(b);
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
  program_->upload_parameters(graph);
  optimizer_->restore(header["step"].get<int64_t>(), slots);
  return Status::ok();
}

}  // namespace pipeshard
