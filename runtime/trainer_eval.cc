// The Trainer's evaluation and the host copies of its parameters (runtime/trainer.h:
// evaluate, download_parameters): rank 0 evaluates the whole model, assembled from every
// stage and shard when the model is cut, in chunks of the whole batch in every layout.
#include <algorithm>

#include "runtime/trainer.h"

namespace pipeshard {

std::vector<std::vector<float>> Trainer::local_values() const {
  Graph copy = rank_.graph();
  program_->download_parameters(copy);
  std::vector<std::vector<float>> out;
  for (Parameter& p : copy.params) out.push_back(std::move(p.data));
  return out;
}

std::vector<std::vector<float>> Trainer::local_slot(int s) const {
  const Graph& g = rank_.graph();
  std::vector<float> slot = optimizer_->state()[s];
  if (zero()) {  // this replica's slices, then every replica's (collective over the replicas)
    slot = zero()->to_whole(slot, program_->trainable_elements());
    zero()->gather(slot.data(), *replicas_);
  }
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
    Status read = data.features.gather(idx, features);
    if (read.is_ok()) read = data.targets.gather(idx, targets_host);
    if (!read.is_ok() && e.bad_data.empty()) e.bad_data = read.message();
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
  runner_->clear_recordings();
  return e;
}

}  // namespace pipeshard
