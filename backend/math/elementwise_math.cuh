// The per-element formulas of the CUDA elementwise and optimizer kernels (elementwise.cu,
// optimizer.cu), written once for the device and the host: under nvcc the functions are
// __host__ __device__, under a plain C++ compiler they are ordinary inline functions, so
// tests/backend/cuda_math_test.cc checks them against the CPU backend on a machine without a GPU.
//
// Each formula repeats the CPU backend's (cpu_backend.cc's ReluOp…SiluOp, cpu_training.cc's
// dropout draw and optimizer loops) operation by operation. Arithmetic goes through mul_rn,
// add_rn, sub_rn, div_rn and sqrt_rn: on the device they are the __f*_rn intrinsics, which
// nvcc never contracts into an FMA (it contracts a*b + c by default, and one FMA rounds
// once where the CPU rounds twice) and which stay IEEE-rounded whatever the math flags; on
// the host they are the plain operators, which g++ does not contract in ISO C++ mode. So
// the device computes what the CPU computes bit for bit, except where a formula calls
// exp, erf or tanh: CUDA's expf/erff/tanhf are within 2 ulp of glibc's, not equal to them.
//
// Scalars that the CPU computes once per call in double (dropout's keep scale, Adam's bias
// corrections) are computed here by host-only functions and passed to the kernels as floats.
#ifndef PIPESHARD_BACKEND_MATH_ELEMENTWISE_MATH_CUH_
#define PIPESHARD_BACKEND_MATH_ELEMENTWISE_MATH_CUH_

#include <cmath>
#include <cstdint>

#include "backend/backend.h"
#include "backend/math/host_device.h"

namespace pipeshard::cuda::math {

// ---- rounded float arithmetic, never contracted ----

PIPESHARD_HD inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
PIPESHARD_HD inline float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
PIPESHARD_HD inline float sub_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
PIPESHARD_HD inline float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
PIPESHARD_HD inline float sqrt_rn(float x) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}
// The transcendental functions: CUDA's on the device (not the __expf-style intrinsics,
// which lose accuracy), the C library's on the host.
PIPESHARD_HD inline float exp_f(float x) {
#ifdef __CUDA_ARCH__
  return expf(x);
#else
  return std::exp(x);
#endif
}
PIPESHARD_HD inline float erf_f(float x) {
#ifdef __CUDA_ARCH__
  return erff(x);
#else
  return std::erf(x);
#endif
}
PIPESHARD_HD inline float tanh_f(float x) {
#ifdef __CUDA_ARCH__
  return tanhf(x);
#else
  return std::tanh(x);
#endif
}

// g·0 is 0 for finite g and NaN for ±inf and NaN: the CPU optimizers' test, `bad |= g*0 != 0`.
PIPESHARD_HD inline bool is_non_finite(float g) { return mul_rn(g, 0.0f) != 0.0f; }

// ---- activations: value(x) and grad(dy, x, y) = dy · act'(x), y = act(x) ----
// `alpha` is LeakyRelu's negative slope; the other kinds ignore it.

inline constexpr float kGeluSqrtHalf = static_cast<float>(M_SQRT1_2);
inline constexpr float kGeluPdfScale = static_cast<float>(M_2_SQRTPI * M_SQRT1_2 * 0.5);  // 1/√(2π)
inline constexpr float kGeluTanhBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);    // √(2/π)
inline constexpr float kGeluTanhKappa = 0.044715f;

// Whether grad reads y; for the other kinds backward needs neither y nor its recomputation.
PIPESHARD_HD constexpr bool activation_grad_uses_output(ActivationKind kind) {
  return kind == ActivationKind::kSigmoid || kind == ActivationKind::kTanh;
}

PIPESHARD_HD inline float activation_value(ActivationKind kind, float alpha, float x) {
  switch (kind) {
    case ActivationKind::kRelu: return x < 0.0f ? 0.0f : x;  // NaN propagates, as in torch
    case ActivationKind::kLeakyRelu: return x > 0.0f ? x : mul_rn(x, alpha);
    case ActivationKind::kSigmoid: return div_rn(1.0f, add_rn(1.0f, exp_f(-x)));
    case ActivationKind::kTanh: return tanh_f(x);
    case ActivationKind::kGelu:  // x·Φ(x)
      return mul_rn(mul_rn(x, 0.5f), add_rn(1.0f, erf_f(mul_rn(x, kGeluSqrtHalf))));
    case ActivationKind::kGeluTanh: {  // 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))
      const float inner = mul_rn(kGeluTanhBeta, add_rn(x, mul_rn(kGeluTanhKappa, mul_rn(mul_rn(x, x), x))));
      return mul_rn(mul_rn(0.5f, x), add_rn(1.0f, tanh_f(inner)));
    }
    case ActivationKind::kSilu: return div_rn(x, add_rn(1.0f, exp_f(-x)));
  }
  return x;  // not reached: the launchers reject unknown kinds
}

PIPESHARD_HD inline float activation_grad(ActivationKind kind, float alpha, float dy, float x, float y) {
  switch (kind) {
    case ActivationKind::kRelu: return x > 0.0f ? dy : 0.0f;
    case ActivationKind::kLeakyRelu: return x > 0.0f ? dy : mul_rn(dy, alpha);
    case ActivationKind::kSigmoid: return mul_rn(mul_rn(dy, sub_rn(1.0f, y)), y);
    case ActivationKind::kTanh: return mul_rn(dy, sub_rn(1.0f, mul_rn(y, y)));
    case ActivationKind::kGelu: {
      const float cdf = mul_rn(0.5f, add_rn(1.0f, erf_f(mul_rn(x, kGeluSqrtHalf))));
      const float pdf = mul_rn(kGeluPdfScale, exp_f(mul_rn(mul_rn(-0.5f, x), x)));
      return mul_rn(dy, add_rn(cdf, mul_rn(x, pdf)));
    }
    case ActivationKind::kGeluTanh: {
      const float x_sq = mul_rn(x, x);
      const float inner = mul_rn(kGeluTanhBeta, add_rn(x, mul_rn(kGeluTanhKappa, mul_rn(x_sq, x))));
      const float tanh_inner = tanh_f(inner);
      const float left_derivative = mul_rn(0.5f, add_rn(1.0f, tanh_inner));
      const float right_derivative =
          mul_rn(mul_rn(mul_rn(0.5f, x), sub_rn(1.0f, mul_rn(tanh_inner, tanh_inner))),
                 mul_rn(kGeluTanhBeta, add_rn(1.0f, mul_rn(mul_rn(3.0f, kGeluTanhKappa), x_sq))));
      return mul_rn(dy, add_rn(left_derivative, right_derivative));
    }
    case ActivationKind::kSilu: {
      const float sigmoid = div_rn(1.0f, add_rn(1.0f, exp_f(-x)));
      return mul_rn(mul_rn(dy, sigmoid), add_rn(1.0f, mul_rn(x, sub_rn(1.0f, sigmoid))));
    }
  }
  return 0.0f;  // not reached: the launchers reject unknown kinds
}

// ---- dropout: the CPU backend's counter-based draw (cpu_training.cc) ----
// key = mix64(seed + γ); element i keeps its input when
//   u = (mix64(key + (offset + i)·γ) >> 40) · 2⁻²⁴ >= ratio,
// all in wrapping 64-bit arithmetic.

inline constexpr uint64_t kDropoutGamma = 0x9E3779B97F4A7C15ull;

// splitmix64's finaliser.
PIPESHARD_HD inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
PIPESHARD_HD inline uint64_t dropout_key(uint64_t seed) { return mix64(seed + kDropoutGamma); }
// `counter` is offset + i.
PIPESHARD_HD inline bool dropout_keeps(uint64_t key, uint64_t counter, float ratio) {
  const uint64_t bits = mix64(key + counter * kDropoutGamma);
  const float u = static_cast<float>(bits >> 40) * 0x1p-24f;  // both steps exact
  return u >= ratio;
}
// The kept elements' mask value, 1/(1 − ratio) rounded once from double; ratio 1 drops all.
inline float dropout_keep_scale(float ratio) {
  return ratio < 1.0f ? static_cast<float>(1.0 / (1.0 - static_cast<double>(ratio))) : 0.0f;
}

// ---- SGD (torch.optim.SGD, dampening 0) ----
//   g = grad + wd·param;  buf = g (first step) or momentum·buf + g;
//   g = nesterov ? g + momentum·buf : buf;  param = param − lr·g

struct SgdScalars {
  float neg_lr = 0.0f, momentum = 0.0f, weight_decay = 0.0f;
  bool decay = false, with_momentum = false, first_step = false, nesterov = false;
};
// The flags as the CPU's with_flags derives them (callers check the SgdStep's validity).
inline SgdScalars sgd_scalars(const SgdStep& s) {
  SgdScalars k;
  k.neg_lr = -s.lr;
  k.momentum = s.momentum;
  k.weight_decay = s.weight_decay;
  k.decay = s.weight_decay != 0.0f;
  k.with_momentum = s.momentum != 0.0f;
  k.first_step = k.with_momentum && s.first_step;
  k.nesterov = k.with_momentum && s.nesterov;
  return k;
}
// The updated parameter. *buffer (the element's momentum) is read and written only when
// k.with_momentum, and read only after the first step.
PIPESHARD_HD inline float sgd_update(float param, float grad, float* buffer, const SgdScalars& k) {
  float g = grad;
  if (k.decay) g = add_rn(g, mul_rn(k.weight_decay, param));
  if (k.with_momentum) {
    const float buf = k.first_step ? g : add_rn(mul_rn(*buffer, k.momentum), g);
    *buffer = buf;
    g = k.nesterov ? add_rn(g, mul_rn(k.momentum, buf)) : buf;
  }
  return add_rn(param, mul_rn(k.neg_lr, g));
}

// ---- Adam / AdamW (torch.optim _single_tensor_adam, amsgrad off) ----
//   AdamW: param *= 1 − lr·wd          Adam: g = grad + wd·param
//   m.lerp_(g, 1 − β₁);  v = v·β₂ + (1 − β₂)·g·g
//   denom = √v / √(1 − β₂ᵗ) + eps;  param += (−lr / (1 − β₁ᵗ))·m / denom

struct AdamScalars {
  float neg_step_size = 0.0f;          // −lr / (1 − β₁ᵗ)
  float bias_correction2_sqrt = 1.0f;  // √(1 − β₂ᵗ)
  float decay_factor = 1.0f;           // 1 − lr·wd
  float lerp_weight = 0.0f;            // 1 − β₁
  float sq_weight = 0.0f;              // 1 − β₂
  float beta2 = 0.0f, eps = 0.0f, weight_decay = 0.0f;
  bool decay = false, decoupled = false;
  bool lerp_from_start = false;  // at::lerp's form for weights below 0.5
};
// The scalars as the CPU computes them: in double, rounded to float once (callers check
// that s.step >= 1).
inline AdamScalars adam_scalars(const AdamStep& s) {
  const double beta1 = s.beta1, beta2 = s.beta2, step = static_cast<double>(s.step);
  AdamScalars k;
  k.neg_step_size = static_cast<float>(-(s.lr / (1.0 - std::pow(beta1, step))));
  k.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
  k.decay_factor = static_cast<float>(1.0 - static_cast<double>(s.lr) * s.weight_decay);
  k.lerp_weight = static_cast<float>(1.0 - beta1);
  k.sq_weight = static_cast<float>(1.0 - beta2);
  k.beta2 = s.beta2;
  k.eps = s.eps;
  k.weight_decay = s.weight_decay;
  k.decay = s.weight_decay != 0.0f;
  k.decoupled = s.decoupled;
  k.lerp_from_start = std::fabs(k.lerp_weight) < 0.5f;
  return k;
}
// The updated parameter; exp_avg and exp_avg_sq (the element's moments) in place.
PIPESHARD_HD inline float adam_update(float param, float grad, float& exp_avg, float& exp_avg_sq,
                                      const AdamScalars& k) {
  float p = param, g = grad;
  if (k.decay) {
    if (k.decoupled) {
      p = mul_rn(p, k.decay_factor);
    } else {
      g = add_rn(g, mul_rn(k.weight_decay, p));
    }
  }
  const float m0 = exp_avg;
  // at::lerp: the form that is exact at the nearer end
  const float m = k.lerp_from_start ? add_rn(m0, mul_rn(k.lerp_weight, sub_rn(g, m0)))
                                    : sub_rn(g, mul_rn(sub_rn(g, m0), sub_rn(1.0f, k.lerp_weight)));
  const float v = add_rn(mul_rn(exp_avg_sq, k.beta2), mul_rn(mul_rn(k.sq_weight, g), g));
  const float denom = add_rn(div_rn(sqrt_rn(v), k.bias_correction2_sqrt), k.eps);
  exp_avg = m;
  exp_avg_sq = v;
  return add_rn(p, div_rn(mul_rn(k.neg_step_size, m), denom));
}

}  // namespace pipeshard::cuda::math

#endif  // PIPESHARD_BACKEND_MATH_ELEMENTWISE_MATH_CUH_
