// Internal to the CPU backend: its kernels as free functions (one .cc per op family) and
// the two loop helpers they share. Shapes, units and the += convention are those of the
// matching Backend methods in backend/backend.h; only cpu_backend.cc calls these.
#ifndef PIPESHARD_BACKEND_CPU_CPU_KERNELS_H_
#define PIPESHARD_BACKEND_CPU_CPU_KERNELS_H_

#include <algorithm>
#include <bit>
#include <cstdint>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "backend/backend.h"

namespace pipeshard::cpu {

// exp(x) for x <= 0 in branch-free float arithmetic that vectorises (glibc's expf is a
// scalar call; the files using it build with -fno-trapping-math, see backend/cpu/CMakeLists.txt,
// without which GCC keeps the clamp's compare scalar): Cephes' range reduction
// x = n·ln2 + r, |r| <= ln2/2, a
// degree-6 polynomial for e^r, and 2^n put together from its exponent bits. Error under
// 2 ulp on [-87, 0] (tests/backend/backend_training_test.cc checks it against std::exp);
// arguments below -87.3 give 0's neighbour e^-87.3 ≈ 1.2e-38 rather than denormals, and
// NaN gives NaN.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  // n = log2(e)·x rounded to nearest (ties to even) by the 1.5·2^23 trick: branch-free,
  // so the loops around it vectorise; either neighbour of a tie keeps |r| <= ln2/2.
  constexpr float kRound = 12582912.0f;
  const float fn = (x * 1.44269504088896341f + kRound) - kRound;
  // fn is in [-126, 0] for every x the contract allows. A NaN x (the logits of NaN
  // weights) made fn NaN, whose conversion to int is undefined behaviour: the clamp turns
  // it into -127, whose 2^n is 0, and the result stays NaN through e.
  const int n = static_cast<int>(std::min(std::max(-127.0f, fn), 0.0f));
  float r = x - fn * 0.693359375f;  // ln2 in two parts, exact products
  r = r + fn * 2.12194440e-4f;
  const float z = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * z + r + 1.0f;
  // 2^n, n in [-126, 0], from its exponent bits (std::bit_cast, unlike memcpy through the
  // stack, lets the loops around this vectorise).
  return e * std::bit_cast<float>((n + 127) << 23);
}

// Threads. The CPU backend has two thread pools that do not know each other: OpenBLAS's
// own (pthreads) inside every sgemm, and OpenMP's for the loops below. libgomp's workers
// spin for milliseconds after each parallel region (its default wait policy; ~8 ms of a
// core measured on a 2-core EPYC), so a parallel loop between two sgemms left a spinning
// OpenMP worker on the core that OpenBLAS's worker needed: 300 steps of the digits MLP
// (64-256-128-10, batch 64) took 0.45 s against 0.05 s with either pool alone, and a step
// of a 4×1024 MLP (batch 256) 64 ms against 31 ms. The loops here are memory-bound (a
// second core gave no speed-up on the SGD step) or cheap next to the GEMMs around them, so
// they run on the calling thread and OpenBLAS alone threads the sgemms. Only a loop of
// more than kParallelMinWork units of work (about one float operation each: tens of
// milliseconds on one core, far longer than the spin it leaves behind) uses OpenMP.
inline constexpr int64_t kParallelMinWork = int64_t{1} << 26;

// The threshold parallel_ranges applies: kParallelMinWork, unless a ScopedParallelMinWork
// is alive. Tests lower it to run the threaded paths on small inputs.
int64_t parallel_min_work();
class ScopedParallelMinWork {
 public:
  explicit ScopedParallelMinWork(int64_t work);
  ~ScopedParallelMinWork();
  ScopedParallelMinWork(const ScopedParallelMinWork&) = delete;
  ScopedParallelMinWork& operator=(const ScopedParallelMinWork&) = delete;

 private:
  int64_t previous_;
};

// Calls body(begin, end) on contiguous pieces that cover [0, n) once, one piece per
// thread when `work` pays for the threads. Bodies must compute each index the same way
// whatever the piece, so results do not depend on the thread count.
template <typename Body>
void parallel_ranges(int64_t n, [[maybe_unused]] int64_t work, Body&& body) {  // work: unused without OpenMP
  if (n <= 0) return;
#ifdef _OPENMP
  if (work >= parallel_min_work() && n > 1 && omp_get_max_threads() > 1) {
#pragma omp parallel
    {
      const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
      if (begin < end) body(begin, end);
    }
    return;
  }
#endif
  body(0, n);
}

// Work per piece of deterministic_sum. Fixed, and independent of the threading
// threshold, so that a sum's rounding never changes with either.
inline constexpr int64_t kSumPieceWork = 32768;

// Σ chunk(begin, end) over [0, n), in double. The pieces depend on n and work_per_item
// only (at most 64, each worth at least kSumPieceWork) and their partial sums are added
// in order, so the result is the same for any thread count.
template <typename Chunk>
double deterministic_sum(int64_t n, int64_t work_per_item, Chunk&& chunk) {
  constexpr int64_t kMaxPieces = 64;
  if (n <= 0) return 0.0;
  const int64_t pieces = std::clamp<int64_t>(n * work_per_item / kSumPieceWork, 1, std::min(n, kMaxPieces));
  double partial[kMaxPieces];
  parallel_ranges(pieces, n * work_per_item, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) partial[p] = chunk(n * p / pieces, n * (p + 1) / pieces);
  });
  double total = 0.0;
  for (int64_t p = 0; p < pieces; ++p) total += partial[p];
  return total;
}

// ---- elementwise (cpu_backend.cc) ----
void activation_forward(float* y, const float* x, int64_t n, const Activation& a);
void activation_backward(float* dx, const float* dy, const float* x, const float* y, int64_t n, const Activation& a);
// y[rows, width] = act(y + beta * b) in place, b [width] or null, act optional; pre
// [rows, width] (or null) receives the values before the activation.
void bias_activation_rows(float* y, float* pre, const float* b, float beta, int64_t rows, int64_t width,
                          const Activation* act);

// ---- softmax, LayerNorm, BatchNorm (cpu_normalization.cc) ----
void softmax_forward(float* y, const float* x, int64_t rows, int64_t width, bool log);
void softmax_backward(float* dx, const float* dy, const float* y, int64_t rows, int64_t width, bool log);
void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b, int64_t rows,
                       int64_t width, float eps);
void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int64_t rows, int64_t width);
void batchnorm_forward(float* y, float* mean, float* rstd, float* running_mean, float* running_var, const float* x,
                       const float* w, const float* b, int64_t batch, int64_t channels, int64_t inner, float eps,
                       float momentum, bool training, const ChannelReducer* reduce);
void batchnorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int64_t batch, int64_t channels, int64_t inner,
                        bool training, const ChannelReducer* reduce);

// ---- dropout, losses, optimizers (cpu_training.cc) ----
void dropout_forward(float* y, float* mask, const float* x, int64_t n, float ratio, uint64_t seed, uint64_t offset);
double cross_entropy(float* dlogits, const float* logits, const float* labels, int64_t rows, int64_t classes,
                     double denominator, bool log_probs);
double mean_squared_error(float* dpred, const float* pred, const float* target, int64_t n, double denominator);
// Both return false when a gradient was inf or NaN.
bool sgd_step(float* param, const float* grad, float* momentum_buffer, int64_t n, const SgdStep& s);
bool adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamStep& s);

}  // namespace pipeshard::cpu

#endif  // PIPESHARD_BACKEND_CPU_CPU_KERNELS_H_
