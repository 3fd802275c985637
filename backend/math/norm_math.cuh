// The per-element and per-row formulas of the softmax, loss, LayerNorm and BatchNorm
// kernels (softmax.cu, layernorm.cu, batchnorm.cu), written once for device and host:
// under nvcc they are __host__ __device__, under a host compiler plain inline functions,
// so tests/backend/cuda_norm_math_test.cc checks them against the CPU backend on machines without
// a GPU. Each repeats the CPU backend's arithmetic (cpu_normalization.cc, cpu_training.cc)
// operation by operation and in the same types. What the device does differently lies
// outside this header: the order of its row and channel sums (fixed by the kernels, no
// atomics, so results repeat bit for bit), nvcc's contraction of a·b + c into one fma, and
// expf where the CPU's cross-entropy uses its vectorised exp_nonpositive (both < 2 ulp).
//
// Under nvcc the header also holds the block-level reductions the three files share.
#ifndef PIPESHARD_BACKEND_MATH_NORM_MATH_CUH_
#define PIPESHARD_BACKEND_MATH_NORM_MATH_CUH_

#include <math.h>

#include <cstdint>

#ifdef __CUDACC__
#include <string>
#include <type_traits>

#include "common/status.h"
#define PIPESHARD_HOST_DEVICE __host__ __device__
#else
#define PIPESHARD_HOST_DEVICE
#endif

namespace pipeshard::cuda {

// ---- softmax over a row of `width` values; row_max and the sums are the row's ----

// y = exp(x − max) · (1 / Σ exp(x − max))
PIPESHARD_HOST_DEVICE inline float softmax_output(float x, float row_max, float inv_sum) {
  return expf(x - row_max) * inv_sum;
}
// log y = (x − max) − log Σ exp(x − max); the large max is not folded into log_sum.
PIPESHARD_HOST_DEVICE inline float log_softmax_output(float x, float row_max, float log_sum) {
  return (x - row_max) - log_sum;
}
// Added into dx: y ⊙ (dy − Σ dy⊙y), dot = Σ dy⊙y over the row.
PIPESHARD_HOST_DEVICE inline float softmax_input_grad(float dy, float y, float dot) { return y * (dy - dot); }
// Added into dx for y = log p: dy − p·Σdy, dy_sum = Σ dy over the row.
PIPESHARD_HOST_DEVICE inline float log_softmax_input_grad(float dy, float y, float dy_sum) {
  return dy - expf(y) * dy_sum;
}

// ---- cross-entropy and NLL per row; inv_den = float(1 / denominator) ----

// A label is a float-encoded class index in [0, classes); anything else (fractions, NaN,
// negatives) is a bug upstream, which the backends refuse.
PIPESHARD_HOST_DEVICE inline bool is_class_label(float label, int64_t classes) {
  return label >= 0.0f && label < static_cast<float>(classes) &&
         static_cast<float>(static_cast<int64_t>(label)) == label;  // the range is checked first
}
// −log softmax(logits)[k] = log Σ exp(logits − max) − (logits[k] − max), in double;
// exp_sum = Σ exp(logit − max) summed in double.
PIPESHARD_HOST_DEVICE inline double cross_entropy_row_loss(double exp_sum, float row_max, float target_logit) {
  return log(exp_sum) - (static_cast<double>(target_logit) - row_max);
}
// ∂loss/∂logit = (softmax − onehot) / denominator, inv_sum = float(1 / exp_sum).
PIPESHARD_HOST_DEVICE inline float cross_entropy_grad(float logit, float row_max, float inv_sum, float inv_den,
                                                      bool is_target) {
  float d = expf(logit - row_max) * inv_sum * inv_den;
  if (is_target) d -= inv_den;
  return d;
}
// NLL on log-probabilities: the loss is −log p[k], the gradient −1/denominator at k.
PIPESHARD_HOST_DEVICE inline double nll_row_loss(float target_log_prob) {
  return -static_cast<double>(target_log_prob);
}
PIPESHARD_HOST_DEVICE inline float nll_grad(bool is_target, float inv_den) { return is_target ? -inv_den : 0.0f; }

// ---- mean squared error per element; grad_scale = float(2 / denominator) ----

PIPESHARD_HOST_DEVICE inline double squared_error(float pred, float target) {
  const float diff = pred - target;
  return static_cast<double>(diff) * diff;
}
PIPESHARD_HOST_DEVICE inline float squared_error_grad(float pred, float target, float grad_scale) {
  return (pred - target) * grad_scale;
}

// ---- LayerNorm over a row of `width`; w, b [width] or null (scale 1, shift 0) ----

PIPESHARD_HOST_DEVICE inline float layernorm_mean(float row_sum, int64_t width) {
  return row_sum / static_cast<float>(width);
}
// 1/√(var + eps) with the biased variance, squared_deviations = Σ (x − mean)² in float.
PIPESHARD_HOST_DEVICE inline float layernorm_rstd(float squared_deviations, int64_t width, float eps) {
  const float var = squared_deviations / static_cast<float>(width);
  return 1.0f / sqrtf(var + eps);
}
PIPESHARD_HOST_DEVICE inline float layernorm_output(float x, float mean, float rstd, const float* w, const float* b,
                                                    int64_t i) {
  float v = (x - mean) * rstd;
  if (w != nullptr) v *= w[i];
  if (b != nullptr) v += b[i];
  return v;
}
// The row sums backward needs are Σ dnorm and Σ dnorm·norm, each divided by the width.
PIPESHARD_HOST_DEVICE inline float layernorm_norm(float x, float mean, float rstd) { return (x - mean) * rstd; }
PIPESHARD_HOST_DEVICE inline float layernorm_dnorm(float dy, const float* w, int64_t i) {
  return (w != nullptr ? w[i] : 1.0f) * dy;
}
// Added into dx: rstd · (dnorm − mean(dnorm) − norm · mean(dnorm ⊙ norm)).
PIPESHARD_HOST_DEVICE inline float layernorm_input_grad(float x, float dy, const float* w, int64_t i, float mean,
                                                        float rstd, float dnorm_mean, float dnorm_norm_mean) {
  const float norm = layernorm_norm(x, mean, rstd);
  const float dnorm = layernorm_dnorm(dy, w, i);
  return (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rstd;
}
// One row's term of dw[i] = Σ_rows (x − mean)·rstd·dy (db[i] = Σ_rows dy needs none).
PIPESHARD_HOST_DEVICE inline float layernorm_weight_grad(float x, float dy, float mean, float rstd) {
  return (x - mean) * rstd * dy;
}

// ---- BatchNorm per channel; statistics in double, the values in float ----

PIPESHARD_HOST_DEVICE inline double batchnorm_squared_deviation(float x, double mean) {
  return (x - mean) * (x - mean);
}
// squared_deviations = Σ (x − mean)² over the count values of the channel (all processes').
PIPESHARD_HOST_DEVICE inline double batchnorm_training_rstd(double squared_deviations, double count, float eps) {
  const double var = squared_deviations / count;  // biased: what normalisation uses
  return 1.0 / sqrt(var + static_cast<double>(eps));
}
PIPESHARD_HOST_DEVICE inline double batchnorm_unbiased_variance(double squared_deviations, double count) {
  return squared_deviations / (count - 1.0);
}
// ONNX momentum: running = momentum·running + (1 − momentum)·batch.
PIPESHARD_HOST_DEVICE inline float batchnorm_running_update(float running, double batch_value, float momentum) {
  return static_cast<float>(momentum * static_cast<double>(running) + (1.0 - momentum) * batch_value);
}
PIPESHARD_HOST_DEVICE inline double batchnorm_inference_rstd(float running_var, float eps) {
  return 1.0 / sqrt(static_cast<double>(running_var) + static_cast<double>(eps));
}

// y = (x − mean)·scale + shift for channel c, with scale = w·rstd; w, b [channels] or null.
struct BatchNormAffine {
  float mean, scale, shift;
};
PIPESHARD_HOST_DEVICE inline BatchNormAffine batchnorm_affine(double mean, double rstd, const float* w, const float* b,
                                                              int64_t c) {
  return BatchNormAffine{static_cast<float>(mean), static_cast<float>((w != nullptr ? w[c] : 1.0) * rstd),
                         b != nullptr ? b[c] : 0.0f};
}
PIPESHARD_HOST_DEVICE inline float batchnorm_output(float x, const BatchNormAffine& a) {
  return (x - a.mean) * a.scale + a.shift;
}

// One value's term of S2 = Σ dy·x̂ (S1 = Σ dy needs none), mean and rstd as forward saved them.
PIPESHARD_HOST_DEVICE inline double batchnorm_dy_xhat(float x, float dy, double mean, double rstd) {
  return dy * ((x - mean) * rstd);
}
// dx += k_dy·dy − k_mean − k_xhat·x̂ for channel c: the gradient through the batch
// statistics when training (s1, s2 and count over all processes), w·rstd·dy otherwise.
struct BatchNormInputGrad {
  float mean, rstd, k_dy, k_mean, k_xhat;
};
PIPESHARD_HOST_DEVICE inline BatchNormInputGrad batchnorm_input_grad_coefficients(const float* w, const float* mean,
                                                                                  const float* rstd, int64_t c,
                                                                                  double s1, double s2, double count,
                                                                                  bool training) {
  const double gain = (w != nullptr ? w[c] : 1.0) * rstd[c];
  return BatchNormInputGrad{mean[c], rstd[c], static_cast<float>(gain),
                            training ? static_cast<float>(gain * s1 / count) : 0.0f,
                            training ? static_cast<float>(gain * s2 / count) : 0.0f};
}
PIPESHARD_HOST_DEVICE inline float batchnorm_input_grad(float x, float dy, const BatchNormInputGrad& g) {
  const float xhat = (x - g.mean) * g.rstd;
  return g.k_dy * dy - g.k_mean - g.k_xhat * xhat;
}

#ifdef __CUDACC__
// ---- device: reductions over the threads of a row, fixed in order ----
//
// A butterfly (xor shuffle) gives every lane the same bits, since each step adds two
// values whose order does not matter (a + b == b + a in IEEE arithmetic); the warps of a
// block are then combined in warp order by every thread. So a reduction's rounding
// depends on the launch shape alone, which the launchers derive from the problem shape.

inline constexpr int kBlockThreads = 256;  // every row and loss kernel
inline constexpr int kWarpThreads = 32;

struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct MaxOp {  // ignores NaN like the CPU's std::max(m, x) with m the running max
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct MinOp {
  __device__ long long operator()(long long a, long long b) const { return a < b ? a : b; }
};

template <typename T, typename Op>
__device__ T warp_reduce(T v, Op op) {
  for (int mask = kWarpThreads / 2; mask > 0; mask /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, mask));
  return v;
}

// v reduced over the kRowThreads threads of a row: a warp (32), or the whole 1-D block
// (kBlockThreads), which must then all call it; shared [kBlockThreads / 32] is scratch.
// Every thread of the row returns the same value.
template <int kRowThreads, typename T, typename Op>
__device__ T row_reduce(T v, Op op, T* shared) {
  static_assert(kRowThreads == kWarpThreads || kRowThreads == kBlockThreads, "a warp or the block per row");
  v = warp_reduce(v, op);
  if constexpr (kRowThreads > kWarpThreads) {
    if (threadIdx.x % kWarpThreads == 0) shared[threadIdx.x / kWarpThreads] = v;
    __syncthreads();
    v = shared[0];
    for (int w = 1; w < kRowThreads / kWarpThreads; ++w) v = op(v, shared[w]);
    __syncthreads();  // shared is free again for the next reduction
  }
  return v;
}

// Rows up to this width get a warp each (8 rows to a block), wider ones a block of
// kBlockThreads: a warp keeps ≤ 32 values per lane and needs no __syncthreads.
inline constexpr int64_t kWarpRowMaxWidth = 1024;

// The row kernels' launch: calls launch(std::integral_constant<int, kRowThreads>{}).
template <typename Launch>
void with_row_threads(int64_t width, Launch&& launch) {
  if (width <= kWarpRowMaxWidth) {
    launch(std::integral_constant<int, kWarpThreads>{});
  } else {
    launch(std::integral_constant<int, kBlockThreads>{});
  }
}

// Blocks for `rows` rows at kRowThreads threads a row (grid.x is at most 2³¹ − 1).
template <int kRowThreads>
unsigned row_blocks(int64_t rows) {
  constexpr int64_t kRowsPerBlock = kBlockThreads / kRowThreads;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  PIPESHARD_CHECK(blocks <= 0x7fffffff, std::to_string(rows) + " rows are more than one launch takes");
  return static_cast<unsigned>(blocks);
}

// This thread's row (of rows_per_block = kBlockThreads / kRowThreads per block) and lane.
template <int kRowThreads>
struct RowThread {
  static constexpr int kRowsPerBlock = kBlockThreads / kRowThreads;
  int lane;          // in [0, kRowThreads)
  int row_in_block;  // in [0, kRowsPerBlock)
  __device__ RowThread() : lane(threadIdx.x % kRowThreads), row_in_block(threadIdx.x / kRowThreads) {}
  __device__ int64_t row() const { return static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + row_in_block; }
};
#endif  // __CUDACC__

}  // namespace pipeshard::cuda

#endif  // PIPESHARD_BACKEND_MATH_NORM_MATH_CUH_
