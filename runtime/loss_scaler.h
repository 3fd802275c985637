// Loss scaling, fp16's companion (torch.cuda.amp.GradScaler's rules): the gradient of the
// loss is multiplied by the scale before backward, so that small gradients survive fp16,
// and every gradient is divided by it again before clipping and the update. Scales are
// powers of two, which multiply and divide exactly in binary floating point: in fp32 a
// scale changes no bit, unless a gradient overflows or underflows under it.
#ifndef PIPESHARD_RUNTIME_LOSS_SCALER_H_
#define PIPESHARD_RUNTIME_LOSS_SCALER_H_

#include <cstdint>

#include "common/status.h"

namespace pipeshard {

// - kStatic: always `initial`.
// - kDynamic: a step whose gradients became inf or NaN under the scale (the loss itself
//   finite) is skipped, as NonFinite::kSkip skips, and the scale halves; after
//   `growth_interval` updates in a row without that, it doubles. The scale and that count
//   are kept in checkpoints. A non-finite loss is not the scale's doing: on_nonfinite
//   decides as without scaling.
struct LossScaling {
  enum class Mode { kNone, kStatic, kDynamic };
  Mode mode = Mode::kNone;
  double initial = 65536.0;        // 2^16, GradScaler's init_scale
  int64_t growth_interval = 2000;  // GradScaler's
  // Scales stay within these powers of two, whose reciprocals are normal floats.
  static constexpr double kMin = 0x1p-64, kMax = 0x1p64;
};

// OK for no scaling, or a power of two from 2^-64 to 2^64 growing after ≥ 1 good steps.
Status check_loss_scaling(const LossScaling& scaling);

// The scale of the next step, and how it changes.
class LossScaler {
 public:
  explicit LossScaler(const LossScaling& scaling);

  bool enabled() const { return scaling_.mode != LossScaling::Mode::kNone; }
  bool dynamic() const { return scaling_.mode == LossScaling::Mode::kDynamic; }
  // The scale the next step's backward uses (1 when scaling is off).
  double scale() const { return scale_; }
  // Dynamic scaling: a gradient overflowed under the scale; the step is skipped and the
  // scale halves.
  void overflowed();
  // The step updated the weights: after growth_interval such steps in a row the scale
  // doubles.
  void updated();

  // What checkpoints keep: the scale and the updates since it last changed.
  int64_t good_steps() const { return good_steps_; }
  // Goes on from a checkpoint's state; only dynamic scaling has state to go on from (a
  // static scale is the configuration's, and a checkpoint without one, scale <= 0, starts
  // this run's scaling afresh).
  void restore(double scale, int64_t good_steps);

 private:
  LossScaling scaling_;
  double scale_ = 1.0;
  int64_t good_steps_ = 0;
};

}  // namespace pipeshard

#endif  // PIPESHARD_RUNTIME_LOSS_SCALER_H_
