// Optimizers over the contiguous parameter buffer, exactly as torch.optim computes them,
// plus the learning-rate schedule and gradient clipping that wrap a step.
#ifndef PIPESHARD_PROGRAM_OPTIMIZER_H_
#define PIPESHARD_PROGRAM_OPTIMIZER_H_

#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace pipeshard {

enum class OptimizerKind { kSgd, kAdam, kAdamW };
enum class LrSchedule { kConstant, kWarmup, kCosine };

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  float lr = 0.01f;
  float momentum = 0.0f;                            // SGD
  bool nesterov = false;                            // SGD
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;  // Adam, AdamW
  float weight_decay = 0.0f;
};

// Learning-rate factor f(t) for optimizer step t (1-based) of `total` steps:
// t / warmup while t <= warmup (warmup > 0); then 1 (constant, warmup) or
// 0.5 (1 + cos(pi (t - warmup) / (total - warmup))) (cosine).
double lr_factor(LrSchedule schedule, int64_t step, int64_t warmup, int64_t total);

class Optimizer {
 public:
  // State for `n` parameters in `backend` memory (momentum, or exp_avg and exp_avg_sq).
  Optimizer(Backend& backend, const OptimizerConfig& config, int64_t n);
  // One step: params[n] -= update(grads[n]) at learning rate `lr`. Returns false when a
  // gradient was inf or NaN (the step is taken all the same).
  bool step(float* params, const float* grads, float lr);
  // Pieces of the buffers, updated as one step: span i's state follows span i-1's (ZeRO,
  // runtime/zero_shards.h: a replica updates its slice of every bucket). Their lengths add up
  // to at most n.
  struct Span {
    float* params;
    const float* grads;
    int64_t n;
  };
  bool step(const std::vector<Span>& spans, float lr);
  // A step that changes nothing (its gradients were not finite): it counts as taken, not
  // as an update, so Adam's bias correction and SGD's first momentum step see only updates.
  void skip_step() { ++steps_; }
  int64_t steps_taken() const { return steps_; }
  int64_t updates() const { return updates_; }  // steps taken less those skipped

  // State as host arrays, for checkpoints: the step count and one [n] array per slot.
  std::vector<std::vector<float>> state() const;
  // Restores what state() returned (same config and n), after `steps` steps of which
  // `updates` were not skipped.
  void restore(int64_t steps, int64_t updates, const std::vector<std::vector<float>>& slots);
  int slots() const { return static_cast<int>(state_.size()); }
  int64_t state_bytes() const { return static_cast<int64_t>(state_.size() * sizeof(float)) * n_; }

 private:
  bool update(const Span& span, int64_t at, float lr);  // one span whose state starts at `at`

  Backend& backend_;
  OptimizerConfig config_;
  int64_t n_;
  int64_t steps_ = 0;
  int64_t updates_ = 0;
  std::vector<DeviceBuffer> state_;  // SGD with momentum: 1 slot; Adam/AdamW: 2
};

// Scales grads[n] so their global L2 norm is at most max_norm (torch's
// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), applied when below 1).
// Returns the norm before clipping.
double clip_grad_norm(Backend& backend, float* grads, int64_t n, double max_norm);

}  // namespace pipeshard

#endif  // PIPESHARD_PROGRAM_OPTIMIZER_H_
