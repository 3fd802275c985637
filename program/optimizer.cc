#include "program/optimizer.h"

#include <cmath>

#include "common/status.h"

namespace pipeshard {

double lr_factor(LrSchedule schedule, int64_t step, int64_t warmup, int64_t total) {
  if (warmup > 0 && step <= warmup) return static_cast<double>(step) / static_cast<double>(warmup);
  if (schedule != LrSchedule::kCosine || total <= warmup) return 1.0;
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
  return 0.5 * (1.0 + std::cos(M_PI * progress));
}

Optimizer::Optimizer(Backend& backend, const OptimizerConfig& config, int64_t n)
    : backend_(backend), config_(config), n_(n) {
  int slots = config.kind == OptimizerKind::kSgd ? (config.momentum != 0.0f ? 1 : 0) : 2;
  for (int s = 0; s < slots; ++s) state_.emplace_back(backend, std::max<int64_t>(n, 1));
}

bool Optimizer::step(float* params, const float* grads, float lr) { return step({{params, grads, n_}}, lr); }

bool Optimizer::step(const std::vector<Span>& spans, float lr) {
  ++steps_;
  ++updates_;
  bool finite = true;
  int64_t at = 0;  // where the span's state starts
  for (const Span& span : spans) {
    PIPESHARD_CHECK(at + span.n <= n_, "optimizer spans cover more than its " + std::to_string(n_) + " elements");
    if (span.n > 0) finite = update(span, at, lr) && finite;
    at += span.n;
  }
  return finite;
}

bool Optimizer::update(const Span& span, int64_t at, float lr) {
  if (config_.kind == OptimizerKind::kSgd) {
    SgdStep s;
    s.lr = lr;
    s.momentum = config_.momentum;
    s.weight_decay = config_.weight_decay;
    s.nesterov = config_.nesterov;
    s.first_step = updates_ == 1;
    return backend_.sgd_step(span.params, span.grads, state_.empty() ? nullptr : state_[0].data() + at, span.n, s);
  }
  AdamStep s;
  s.lr = lr;
  s.beta1 = config_.beta1;
  s.beta2 = config_.beta2;
  s.eps = config_.eps;
  s.weight_decay = config_.weight_decay;
  s.decoupled = config_.kind == OptimizerKind::kAdamW;
  s.step = updates_;
  return backend_.adam_step(span.params, span.grads, state_[0].data() + at, state_[1].data() + at, span.n, s);
}

std::vector<std::vector<float>> Optimizer::state() const {
  std::vector<std::vector<float>> out;
  for (const auto& b : state_) {
    out.emplace_back(static_cast<size_t>(n_));
    backend_.download(out.back().data(), b.data(), n_);
  }
  return out;
}

void Optimizer::restore(int64_t steps, int64_t updates, const std::vector<std::vector<float>>& slots) {
  PIPESHARD_CHECK(slots.size() == state_.size(), "optimizer state slots");
  PIPESHARD_CHECK(updates >= 0 && updates <= steps,
                  "updates " + std::to_string(updates) + " of " + std::to_string(steps));
  steps_ = steps;
  updates_ = updates;
  for (size_t s = 0; s < slots.size(); ++s) backend_.upload(state_[s].data(), slots[s].data(), n_);
}

double clip_grad_norm(Backend& backend, float* grads, int64_t n, double max_norm) {
  const double norm = std::sqrt(backend.sum_squares(grads, n));
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) backend.scale(grads, static_cast<float>(coef), n);
  return norm;
}

}  // namespace pipeshard
