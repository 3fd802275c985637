// TrainConfig: what a Trainer (runtime/trainer.h) is asked to do, and the one check of it.
// Errors speak of values and name the setting they are about (Status::invalid: the field's
// name, "micro_batches"), so that each tool (or binding) says it in its own words: train
// names the flag.
#ifndef PIPESHARD_RUNTIME_TRAIN_CONFIG_H_
#define PIPESHARD_RUNTIME_TRAIN_CONFIG_H_

#include <cstdint>
#include <string>

#include "comm/comm.h"
#include "common/status.h"
#include "dataset/dataset.h"
#include "ir/graph.h"
#include "partitioner/plan.h"
#include "program/loss.h"
#include "program/optimizer.h"
#include "runtime/loss_scaler.h"

namespace pipeshard {

// What a step does when its loss or a gradient is inf or NaN: it never updates the
// weights; kStop then reports it (StepResult::non_finite) for the caller to stop, kSkip
// goes on with the next step, counting this one as taken (what fp16 loss scaling does).
enum class NonFinite { kStop, kSkip };

struct TrainConfig {
  LossKind loss = LossKind::kCrossEntropy;
  OptimizerConfig optimizer;
  LrSchedule schedule = LrSchedule::kConstant;
  int64_t warmup_steps = 0;
  int64_t batch_size = 32;  // samples per micro-step
  int64_t grad_accum = 1;   // micro-steps per optimizer step: one step sees batch_size * grad_accum samples
  int64_t total_steps = 1;  // optimizer steps of the whole run (the cosine schedule's length)
  bool shuffle = true;
  uint64_t seed = 0;
  double clip_grad_norm = 0;               // 0: off
  int64_t bucket_bytes = 25 << 20;         // data parallel: gradients are all-reduced in buckets this big
  int micro_batches = 1;                   // pipeline micro-batches per replica batch (M)
  std::string pipeline_schedule = "1f1b";  // a registered schedule (schedule/registry.h)
  int virtual_stages = 0;                  // chunks per stage where the schedule lets it be chosen; 0: its default
  BalanceBy balance = BalanceBy::kParams;  // how stages are cut
  bool sync_batchnorm = false;             // BatchNorm statistics over all replicas, not each replica's slice
  // ZeRO stage: 0 (each replica holds all optimizer state), 1 (1/D of it: runtime/zero_shards.h)
  // or 2 (and 1/D of the reduced gradients: runtime/gradient_sync.h)
  int zero = 0;
  NonFinite on_nonfinite = NonFinite::kStop;  // a step whose loss or gradients are not finite
  LossScaling loss_scaling;
  // Record each forward and backward the first step runs, and from the second step on
  // replay the recordings as one launch each (Backend::record; a CUDA graph). One process,
  // no Dropout (its masks change every step). The loss, clipping, loss scaling and the
  // optimizer stay outside, so the learning rate, Adam's step count and the checks on the
  // loss and gradients go on changing as they must; the results are those of the run
  // without it, bit for bit.
  bool cuda_graph = false;
  // Keep every activation's output from forward to backward instead of recomputing it
  // there from the activation's input (ProgramOptions::recompute_activations): one
  // elementwise pass per activation less, one tensor per activation more. Same results.
  bool keep_activations = false;
};

// The labels a loss reads: class indices for cross-entropy, values for MSE.
inline Targets targets_of(LossKind loss) {
  return loss == LossKind::kCrossEntropy ? Targets::kClassIndices : Targets::kValues;
}

// OK when `config` can train `graph` on `samples` samples in `layout`: a loss the model's
// output can train (not cross-entropy over one output, which is 0 whatever the weights),
// batch sizes, micro-batches and accumulation that divide, a registered schedule, a valid loss scale,
// a recorded step only where it can be, BatchNorm statistics over enough values. Errors
// are Status::invalid, naming the TrainConfig field they are about; Trainer::create runs
// the same check.
Status check_train_config(const TrainConfig& config, const ProcessLayout& layout, const Graph& graph, int64_t samples);

// Samples of each micro-batch on one replica: batch_size / replicas / micro_batches, for a
// config check_train_config() accepted.
int64_t micro_batch_rows(const TrainConfig& config, const ProcessLayout& layout);

}  // namespace pipeshard

#endif  // PIPESHARD_RUNTIME_TRAIN_CONFIG_H_
