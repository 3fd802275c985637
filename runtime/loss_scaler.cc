#include "runtime/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

namespace pipeshard {

Status check_loss_scaling(const LossScaling& scaling) {
  if (scaling.mode == LossScaling::Mode::kNone) return Status::ok();
  int exponent = 0;
  const double initial = scaling.initial;
  if (!(initial >= LossScaling::kMin && initial <= LossScaling::kMax) || std::frexp(initial, &exponent) != 0.5) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", initial);
    return Status::error(std::string("a loss scale must be a power of two from 2^-64 to 2^64, not ") + text);
  }
  if (scaling.growth_interval < 1) return Status::error("the loss scale's growth interval must be ≥ 1");
  return Status::ok();
}

LossScaler::LossScaler(const LossScaling& scaling) : scaling_(scaling) {
  if (enabled()) scale_ = scaling.initial;
}

void LossScaler::overflowed() {
  scale_ = std::max(scale_ * 0.5, LossScaling::kMin);
  good_steps_ = 0;
}

void LossScaler::updated() {
  if (dynamic() && ++good_steps_ == scaling_.growth_interval) {
    scale_ = std::min(scale_ * 2.0, LossScaling::kMax);
    good_steps_ = 0;
  }
}

void LossScaler::restore(double scale, int64_t good_steps) {
  if (!dynamic() || scale <= 0) return;
  scale_ = std::clamp(scale, LossScaling::kMin, LossScaling::kMax);
  good_steps_ = std::min(good_steps, scaling_.growth_interval - 1);
}

}  // namespace pipeshard
