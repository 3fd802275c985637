// Dropout, losses and optimizer steps on the CPU.
//
// Optimizers repeat torch.optim's single-tensor (foreach=False) code operation by
// operation, scalars included: torch computes hyper-parameter expressions such as
// 1 − β₂ᵗ in Python double precision and rounds them to float when a tensor op uses them;
// we do the same, so the remaining differences are FMA contraction in torch's vector
// loops, a few float ulps per step.
#include <atomic>
#include <cmath>
#include <type_traits>

#include "backend/cpu/cpu_kernels.h"
#include "backend/math/elementwise_math.cuh"
#include "common/status.h"

namespace pipeshard::cpu {

// Element i of a dropout draw keeps its input when u >= ratio, with
//   key  = mix64(seed + γ),  bits = mix64(key + (offset + i) · γ),  γ = 0x9E3779B97F4A7C15,
//   u    = (bits >> 40) · 2⁻²⁴  (uniform on [0, 1) in steps of 2⁻²⁴),
// a counter-based generator: element i's draw depends on (seed, offset + i) only, so a
// tensor drawn in pieces or by any number of threads gets the same mask. The formulas are
// the ones the CUDA kernels run (backend/math/elementwise_math.cuh, host and device).
void dropout_forward(float* y, float* mask, const float* x, int64_t n, float ratio, uint64_t seed, uint64_t offset) {
  PIPESHARD_CHECK(ratio >= 0.0f && ratio <= 1.0f, "dropout ratio " + std::to_string(ratio));
  const uint64_t key = cuda::math::dropout_key(seed);
  // torch: noise.bernoulli_(1 - p).div_(1 - p); p = 1 drops everything.
  const float keep_scale = cuda::math::dropout_keep_scale(ratio);
  parallel_ranges(n, n * 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      mask[i] = cuda::math::dropout_keeps(key, offset + static_cast<uint64_t>(i), ratio) ? keep_scale : 0.0f;
      y[i] = x[i] * mask[i];
    }
  });
}

double cross_entropy(float* dlogits, const float* logits, const float* labels, int64_t rows, int64_t classes,
                     double denominator, bool log_probs) {
  PIPESHARD_CHECK(rows >= 0 && classes > 0, "cross_entropy over " + std::to_string(classes) + " classes");
  PIPESHARD_CHECK(denominator > 0.0, "cross_entropy denominator " + std::to_string(denominator));
  const float inv_den = static_cast<float>(1.0 / denominator);
  const double total = deterministic_sum(rows, classes * 16, [&](int64_t r0, int64_t r1) {
    double loss = 0.0;
    for (int64_t r = r0; r < r1; ++r) {
      const float label = labels[r];
      const int64_t k = static_cast<int64_t>(label);
      // The data loader validates labels; one out of range here is a bug upstream.
      PIPESHARD_CHECK(label >= 0.0f && label < static_cast<float>(classes) && static_cast<float>(k) == label,
                      "row " + std::to_string(r) + ": label " + std::to_string(label) + " is not a class in [0, " +
                          std::to_string(classes) + ")");
      const float* in = logits + r * classes;
      float* d = dlogits != nullptr ? dlogits + r * classes : nullptr;
      if (log_probs) {  // NLL on log-probabilities
        loss -= in[k];
        if (d != nullptr) {
          for (int64_t i = 0; i < classes; ++i) d[i] = 0.0f;
          d[k] = -inv_den;
        }
        continue;
      }
      // −log softmax(in)[k] = log Σ exp(in − max) − (in[k] − max)
      // The max is order-free, so it runs on vectors (a NaN logit makes the loss and every
      // gradient NaN either way). The exps and their in-order double sum are separate
      // loops: the calls then overlap instead of waiting on the chain of additions.
      float m = in[0];
#pragma omp simd reduction(max : m)
      for (int64_t i = 1; i < classes; ++i) m = std::max(m, in[i]);
      // exp on vectors (exp_nonpositive: in - m <= 0) and a vectorised double sum: the
      // order of the additions is fixed by the binary, so results stay deterministic.
      double sum = 0.0;
      if (d != nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < classes; ++i) d[i] = exp_nonpositive(in[i] - m);
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < classes; ++i) sum += d[i];
        const float inv_sum = static_cast<float>(1.0 / sum);
        for (int64_t i = 0; i < classes; ++i) d[i] = d[i] * inv_sum * inv_den;
        d[k] -= inv_den;
      } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < classes; ++i) sum += exp_nonpositive(in[i] - m);
      }
      loss += std::log(sum) - (static_cast<double>(in[k]) - m);
    }
    return loss;
  });
  return total / denominator;
}

double mean_squared_error(float* dpred, const float* pred, const float* target, int64_t n, double denominator) {
  PIPESHARD_CHECK(n >= 0 && denominator > 0.0, "mean_squared_error denominator " + std::to_string(denominator));
  const float grad_scale = static_cast<float>(2.0 / denominator);
  const double total = deterministic_sum(n, 3, [&](int64_t begin, int64_t end) {
    double s = 0.0;
    for (int64_t i = begin; i < end; ++i) {
      const float diff = pred[i] - target[i];
      s += static_cast<double>(diff) * diff;
      if (dpred != nullptr) dpred[i] = diff * grad_scale;
    }
    return s;
  });
  return total / denominator;
}

// Calls fn(std::bool_constant<f>...) with each runtime flag turned into a compile-time
// one, so that an optimizer loop has no branch left inside and compiles to vector code
// (with the flags tested per element GCC kept the SGD loop scalar: 4.0 ms instead of
// 1.1 ms for 4M parameters). The arithmetic per element is the same in every variant.
template <typename Fn>
void with_flags(Fn&& fn) {
  fn();
}
template <typename Fn, typename... Rest>
void with_flags(Fn&& fn, bool flag, Rest... rest) {
  if (flag) {
    with_flags([&](auto... known) { fn(std::true_type{}, known...); }, rest...);
  } else {
    with_flags([&](auto... known) { fn(std::false_type{}, known...); }, rest...);
  }
}

// torch.optim.SGD, dampening 0:
//   g = grad + wd·param;  buf = g (first step) or momentum·buf + g;
//   g = nesterov ? g + momentum·buf : buf;  param = param − lr·g
bool sgd_step(float* param, const float* grad, float* momentum_buffer, int64_t n, const SgdStep& s) {
  const bool use_momentum = s.momentum != 0.0f;
  std::atomic<bool> non_finite{false};
  PIPESHARD_CHECK(!use_momentum || momentum_buffer != nullptr, "SGD with momentum needs its buffer");
  PIPESHARD_CHECK(!s.nesterov || use_momentum, "Nesterov SGD needs momentum");
  const float wd = s.weight_decay, momentum = s.momentum, neg_lr = -s.lr;
  auto loop = [&](auto decay, auto with_momentum, auto first_step, auto nesterov) {
    parallel_ranges(n, n * 4, [&](int64_t begin, int64_t end) {
      int bad = 0;  // g·0 is 0 for finite g, NaN for inf and NaN: an int OR vectorizes, a float sum would not
      for (int64_t i = begin; i < end; ++i) {
        float g = grad[i];
        bad |= g * 0.0f != 0.0f;
        if constexpr (decay) g = g + wd * param[i];
        if constexpr (with_momentum) {
          const float buf = first_step ? g : momentum_buffer[i] * momentum + g;
          momentum_buffer[i] = buf;
          g = nesterov ? g + momentum * buf : buf;
        }
        param[i] = param[i] + neg_lr * g;
      }
      if (bad) non_finite.store(true, std::memory_order_relaxed);
    });
  };
  with_flags(loop, wd != 0.0f, use_momentum, use_momentum && s.first_step, use_momentum && s.nesterov);
  return !non_finite.load();
}

// torch.optim.Adam / AdamW (_single_tensor_adam, amsgrad off):
//   AdamW: param *= 1 − lr·wd          Adam: g = grad + wd·param
//   m.lerp_(g, 1 − β₁);  v = v·β₂ + (1 − β₂)·g·g
//   denom = √v / √(1 − β₂ᵗ) + eps;  param += (−lr / (1 − β₁ᵗ))·m / denom
bool adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamStep& s) {
  std::atomic<bool> non_finite{false};
  PIPESHARD_CHECK(s.step >= 1, "Adam step " + std::to_string(s.step) + " (steps count from 1)");
  const double beta1 = s.beta1, beta2 = s.beta2, step = static_cast<double>(s.step);
  const float neg_step_size = static_cast<float>(-(s.lr / (1.0 - std::pow(beta1, step))));
  const float bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  const float decay_factor = static_cast<float>(1.0 - static_cast<double>(s.lr) * s.weight_decay);
  const float lerp_weight = static_cast<float>(1.0 - beta1);
  const float sq_weight = static_cast<float>(1.0 - beta2);
  const float b2 = s.beta2, eps = s.eps, wd = s.weight_decay;
  const bool small_lerp = std::fabs(lerp_weight) < 0.5f;
  auto loop = [&](auto decay, auto decoupled, auto lerp_from_start) {
    // By value: with the scalars behind references GCC could not prove that the stores
    // to param leave them alone, and did not vectorize.
    parallel_ranges(n, n * 12, [=, &non_finite](int64_t begin, int64_t end) {
      int bad = 0;  // g·0 is 0 for finite g, NaN for inf and NaN: an int OR vectorizes, a float sum would not
      for (int64_t i = begin; i < end; ++i) {
        float p = param[i], g = grad[i];
        bad |= g * 0.0f != 0.0f;
        if constexpr (decay) {
          if constexpr (decoupled) {
            p = p * decay_factor;
          } else {
            g = g + wd * p;
          }
        }
        const float m0 = exp_avg[i];
        // at::lerp: the form that is exact at the nearer end
        const float m = lerp_from_start ? m0 + lerp_weight * (g - m0) : g - (g - m0) * (1.0f - lerp_weight);
        const float v = exp_avg_sq[i] * b2 + sq_weight * g * g;
        const float denom = std::sqrt(v) / bias_correction2_sqrt + eps;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = p + neg_step_size * m / denom;
      }
      if (bad) non_finite.store(true, std::memory_order_relaxed);
    });
  };
  with_flags(loop, wd != 0.0f, s.decoupled, small_lerp);
  return !non_finite.load();
}

}  // namespace pipeshard::cpu
