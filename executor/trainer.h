// The training loop of one process: batches in design.md's order, forward, loss,
// backward, gradient accumulation, clipping, learning-rate schedule, optimizer step;
// evaluation; checkpoints that resume onto exactly the same trajectory.
#ifndef PIPESHARD_EXECUTOR_TRAINER_H_
#define PIPESHARD_EXECUTOR_TRAINER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "executor/backend.h"
#include "executor/comm.h"
#include "executor/dataset.h"
#include "executor/loss.h"
#include "executor/optimizer.h"
#include "executor/program.h"

namespace pipeshard {

struct TrainConfig {
  LossKind loss = LossKind::kCrossEntropy;
  OptimizerConfig optimizer;
  LrSchedule schedule = LrSchedule::kConstant;
  int64_t warmup_steps = 0;
  int64_t batch_size = 32;     // samples per micro-step
  int64_t grad_accum = 1;      // micro-steps per optimizer step: one step sees batch_size * grad_accum samples
  int64_t total_steps = 1;     // optimizer steps of the whole run (the cosine schedule's length)
  bool shuffle = true;
  uint64_t seed = 0;
  double clip_grad_norm = 0;   // 0: off
  int64_t bucket_bytes = 25 << 20;  // data parallel: gradients are all-reduced in buckets this big
};

struct StepResult {
  int64_t step = 0;   // 1-based optimizer step
  int64_t epoch = 0;  // 1-based epoch of the step's first batch
  double loss = 0;    // mean over the step's samples, from its forward pass (before the update)
  double lr = 0;      // the learning rate the step used
  double grad_norm = 0;  // global L2 norm of the gradient before clipping (0 when clipping is off)
};

struct EvalResult {
  double loss = 0;
  double accuracy = -1;  // fraction of correct argmax; -1 for MSE
  int64_t samples = 0;
};

class Trainer {
 public:
  // `graph` holds the initial parameters and must outlive the Trainer; `data` too.
  // With `replicas` (the data-parallel group, may be null for one process), each
  // replica trains on its contiguous slice of every global batch of config.batch_size
  // samples and gradients are summed over the replicas, so every step equals the
  // one-process step.
  static Result<std::unique_ptr<Trainer>> create(const Graph& graph, const Dataset& data, Backend& backend,
                                                 const TrainConfig& config, Communicator* replicas = nullptr);

  // Runs optimizer step steps_done() + 1.
  StepResult step();
  int64_t steps_done() const { return optimizer_->steps_taken(); }
  int64_t batches_per_epoch() const { return order_.batches_per_epoch(); }

  // Loss (and accuracy for cross-entropy) over all of `data`, in eval mode.
  EvalResult evaluate(const Dataset& data);

  // Copies the trained parameters and running statistics into `graph.params`.
  void download_parameters(Graph& graph) const { program_->download_parameters(graph); }

  // Writes DIR/checkpoint.pipeshard atomically: parameters and running statistics by
  // initializer name, optimizer state, the step count. Interrupted writes leave the
  // previous checkpoint intact.
  Status save_checkpoint(const std::string& dir, Graph& scratch) const;
  // Restores a checkpoint written for the same model and optimizer; the run then
  // continues exactly as if it had never stopped.
  Status load_checkpoint(const std::string& dir, Graph& graph);

 private:
  Trainer(const Dataset& data, Backend& backend, const TrainConfig& config);
  void plan_buckets(const Graph& graph);
  // Runs after node i's backward on the last micro-step: starts the all-reduce of every
  // gradient bucket that node completes.
  void on_gradients_ready(size_t node);

  struct Bucket {
    int64_t begin = 0, end = 0;  // [begin, end) of the gradient buffer
    size_t ready_after = 0;      // node whose backward completes the bucket
  };

  const Dataset& data_;
  Backend& backend_;
  TrainConfig config_;
  bool log_probs_ = false;
  BatchOrder order_;
  Communicator* replicas_ = nullptr;   // data-parallel group, or null
  int64_t local_batch_ = 0;            // samples of each micro-step on this replica
  std::vector<Bucket> buckets_;        // in launch order (end of the buffer first)
  std::vector<std::unique_ptr<Request>> in_flight_;
  std::unique_ptr<Program> program_;
  std::unique_ptr<Optimizer> optimizer_;
  DeviceBuffer targets_;              // [batch_size * targets_per_sample]
  std::vector<float> host_features_;  // [batch_size * features_per_sample]
  std::vector<float> host_targets_;   // [batch_size * targets_per_sample]
};

}  // namespace pipeshard

#endif  // PIPESHARD_EXECUTOR_TRAINER_H_
