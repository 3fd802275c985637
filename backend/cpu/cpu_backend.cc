// The CPU backend: host memory, OpenBLAS sgemm for Linear, and the elementwise kernels.
// Normalisation and training kernels live in cpu_normalization.cc and cpu_training.cc.
//
// Activation formulas follow PyTorch's CPU kernels (aten/src/ATen/native/cpu/
// Activation.cpp, UnaryOpsKernel.cpp) term by term, so that the derivative at a kink or
// in a saturated region is the one PyTorch uses (Relu'(0) = 0, LeakyRelu'(0) = slope).
#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "backend/backend.h"
#include "backend/cpu/cpu_kernels.h"
#include "common/status.h"

namespace pipeshard {
namespace cpu {
namespace {

std::atomic<int64_t> g_parallel_min_work{kParallelMinWork};

// Each activation: forward(x), and grad(dy, x, y) = dy * act'(x) where y = act(x).
struct ReluOp {
  float forward(float x) const { return x < 0.0f ? 0.0f : x; }  // NaN propagates, as in torch
  float grad(float dy, float x, float) const { return x > 0.0f ? dy : 0.0f; }
};
struct LeakyReluOp {
  float slope;
  float forward(float x) const { return x > 0.0f ? x : x * slope; }
  float grad(float dy, float x, float) const { return x > 0.0f ? dy : dy * slope; }
};
struct SigmoidOp {
  float forward(float x) const { return 1.0f / (1.0f + std::exp(-x)); }
  float grad(float dy, float, float y) const { return dy * (1.0f - y) * y; }
};
struct TanhOp {
  float forward(float x) const { return std::tanh(x); }
  float grad(float dy, float, float y) const { return dy * (1.0f - y * y); }
};
struct GeluOp {  // exact: x·Φ(x)
  static constexpr float kSqrtHalf = static_cast<float>(M_SQRT1_2);
  static constexpr float kPdfScale = static_cast<float>(M_2_SQRTPI * M_SQRT1_2 * 0.5);  // 1/√(2π)
  float forward(float x) const { return x * 0.5f * (1.0f + std::erf(x * kSqrtHalf)); }
  float grad(float dy, float x, float) const {
    const float cdf = 0.5f * (1.0f + std::erf(x * kSqrtHalf));
    const float pdf = kPdfScale * std::exp(-0.5f * x * x);
    return dy * (cdf + x * pdf);
  }
};
struct GeluTanhOp {  // 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))
  static constexpr float kBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
  static constexpr float kKappa = 0.044715f;
  float forward(float x) const {
    const float inner = kBeta * (x + kKappa * (x * x * x));
    return 0.5f * x * (1.0f + std::tanh(inner));
  }
  float grad(float dy, float x, float) const {
    const float x_sq = x * x;
    const float inner = kBeta * (x + kKappa * (x_sq * x));
    const float tanh_inner = std::tanh(inner);
    const float left_derivative = 0.5f * (1.0f + tanh_inner);
    const float right_derivative =
        0.5f * x * (1.0f - tanh_inner * tanh_inner) * (kBeta * (1.0f + 3.0f * kKappa * x_sq));
    return dy * (left_derivative + right_derivative);
  }
};
struct SiluOp {
  float forward(float x) const { return x / (1.0f + std::exp(-x)); }
  float grad(float dy, float x, float) const {
    const float sigmoid = 1.0f / (1.0f + std::exp(-x));
    return dy * sigmoid * (1.0f + x * (1.0f - sigmoid));
  }
};

// Rough cost of one element in float operations, for the parallel threshold.
int64_t activation_cost(ActivationKind kind) {
  return kind == ActivationKind::kRelu || kind == ActivationKind::kLeakyRelu ? 1 : 16;
}

// Calls fn(op) with the functor for `a`, so every loop is compiled once per kind.
template <typename Fn>
void with_activation(const Activation& a, Fn&& fn) {
  switch (a.kind) {
    case ActivationKind::kRelu: return fn(ReluOp{});
    case ActivationKind::kLeakyRelu: return fn(LeakyReluOp{a.alpha});
    case ActivationKind::kSigmoid: return fn(SigmoidOp{});
    case ActivationKind::kTanh: return fn(TanhOp{});
    case ActivationKind::kGelu: return fn(GeluOp{});
    case ActivationKind::kGeluTanh: return fn(GeluTanhOp{});
    case ActivationKind::kSilu: return fn(SiluOp{});
  }
  PIPESHARD_CHECK(false, "unknown activation kind " + std::to_string(static_cast<int>(a.kind)));
}

}  // namespace

int64_t parallel_min_work() { return g_parallel_min_work.load(std::memory_order_relaxed); }
ScopedParallelMinWork::ScopedParallelMinWork(int64_t work) : previous_(g_parallel_min_work.exchange(work)) {}
ScopedParallelMinWork::~ScopedParallelMinWork() { g_parallel_min_work.store(previous_); }

void activation_forward(float* y, const float* x, int64_t n, const Activation& a) {
  with_activation(a, [&](auto op) {
    parallel_ranges(n, n * activation_cost(a.kind), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) y[i] = op.forward(x[i]);
    });
  });
}

void activation_backward(float* dx, const float* dy, const float* x, const float* y, int64_t n, const Activation& a) {
  with_activation(a, [&](auto op) {
    parallel_ranges(n, n * activation_cost(a.kind), [&](int64_t begin, int64_t end) {
      if (y != nullptr) {
        for (int64_t i = begin; i < end; ++i) dx[i] += op.grad(dy[i], x[i], y[i]);
      } else {  // the output was not kept: recompute it where the derivative needs it
        for (int64_t i = begin; i < end; ++i) dx[i] += op.grad(dy[i], x[i], op.forward(x[i]));
      }
    });
  });
}

void bias_activation_rows(float* y, float* pre, const float* b, float beta, int64_t rows, int64_t width,
                          const Activation* act) {
  if (b == nullptr && act == nullptr) return;
  auto add_bias = [&](float* row) {
    if (b == nullptr) return;
    for (int64_t o = 0; o < width; ++o) row[o] += beta * b[o];
  };
  if (act == nullptr) {
    parallel_ranges(rows, rows * width, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) add_bias(y + r * width);
    });
    return;
  }
  with_activation(*act, [&](auto op) {
    parallel_ranges(rows, rows * width * activation_cost(act->kind), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* row = y + r * width;  // one row stays in L1 between the three steps
        add_bias(row);
        if (pre != nullptr) std::memcpy(pre + r * width, row, sizeof(float) * width);
        for (int64_t o = 0; o < width; ++o) row[o] = op.forward(row[o]);
      }
    });
  });
}

}  // namespace cpu

namespace {

// OpenBLAS gives an sgemm one thread per 2^18 multiply-adds (interface/gemm.c), so it
// threads GEMMs from 2^19 multiply-adds up. Measured on a 2-core EPYC with OpenBLAS 0.3.21,
// the second thread only pays from about 2^21 (128×128×128: 0.108 ms on one thread, 0.061
// on two); below, it costs more than it saves (64×256×64: 0.056 against 0.061 ms; a
// 128×10×512 output layer: 0.056 against 0.088 ms, forward and backward). Smaller sgemms
// run on the calling thread alone. OpenBLAS's rounding depends on how it splits a GEMM
// between threads, so this also makes small layers round alike whatever the thread count.
constexpr int64_t kBlasThreadMinMacs = int64_t{1} << 21;

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }

  // ---- memory ----
  float* allocate(int64_t n) override {
    PIPESHARD_CHECK(n >= 0, "allocate(" + std::to_string(n) + ")");
    constexpr size_t kAlign = 64;
    const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float) + kAlign - 1) / kAlign * kAlign;
    void* p = std::aligned_alloc(kAlign, bytes);
    PIPESHARD_CHECK(p != nullptr, "out of host memory allocating " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, bytes);
    const std::lock_guard<std::mutex> lock(sizes_mutex_);
    sizes_[p] = static_cast<int64_t>(bytes);
    memory_.in_use += static_cast<int64_t>(bytes);
    memory_.peak = std::max(memory_.peak, memory_.in_use);
    return static_cast<float*>(p);
  }
  void deallocate(float* p) override {
    if (p == nullptr) return;
    {
      const std::lock_guard<std::mutex> lock(sizes_mutex_);
      auto it = sizes_.find(p);
      PIPESHARD_CHECK(it != sizes_.end(), "deallocate() of a pointer allocate() did not return");
      memory_.in_use -= it->second;
      sizes_.erase(it);
    }
    std::free(p);
  }
  MemoryUse memory_use() const override {
    const std::lock_guard<std::mutex> lock(sizes_mutex_);
    return memory_;
  }
  void upload(float* dst, const float* host, int64_t n) override { copy(dst, host, n); }
  void download(float* host, const float* src, int64_t n) override { copy(host, src, n); }
  void fill(float* dst, float value, int64_t n) override {
    if (n > 0 && value == 0.0f && !std::signbit(value)) {
      // +0.0f is all zero bits. glibc's memset (rep stosb on large blocks) need not read a
      // line before overwriting it, where std::fill's vector stores do: zeroing the
      // gradients of 4M parameters, the commonest fill, took 0.30 ms with std::fill and
      // 0.14 ms with memset.
      std::memset(dst, 0, sizeof(float) * static_cast<size_t>(n));
      return;
    }
    cpu::parallel_ranges(n, n, [&](int64_t begin, int64_t end) { std::fill(dst + begin, dst + end, value); });
  }
  void copy(float* dst, const float* src, int64_t n) override {
    if (n > 0 && dst != src) std::memcpy(dst, src, sizeof(float) * n);
  }
  void axpy(float* y, float a, const float* x, int64_t n) override {
    cpu::parallel_ranges(n, n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) y[i] += a * x[i];
    });
  }
  void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows, int64_t width,
                 bool add) override {
    cpu::parallel_ranges(rows, rows * width, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* d = dst + r * dst_stride;
        const float* x = src + r * src_stride;
        if (add) {
          for (int64_t j = 0; j < width; ++j) d[j] += x[j];
        } else {
          std::memcpy(d, x, sizeof(float) * width);
        }
      }
    });
  }
  void add_bias(float* y, const float* b, int64_t rows, int64_t width) override {
    cpu::parallel_ranges(rows, rows * width, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = 0; j < width; ++j) y[r * width + j] += b[j];
    });
  }
  void bias_backward(float* db, const float* dy, int64_t rows, int64_t width) override {
    bias_backward(db, dy, 1.0f, rows, width);  // linear_backward's own sum, in its order
  }
  void scale(float* x, float a, int64_t n) override {
    cpu::parallel_ranges(n, n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) x[i] *= a;
    });
  }
  double sum_squares(const float* x, int64_t n) override {
    return cpu::deterministic_sum(n, 1, [&](int64_t begin, int64_t end) {
      double s = 0.0;
#pragma omp simd reduction(+ : s)
      for (int64_t i = begin; i < end; ++i) s += static_cast<double>(x[i]) * x[i];
      return s;
    });
  }
  bool any_non_finite(const float* x, int64_t n) override {
    // x·0 is 0 for finite x and NaN for ±inf and NaN; the sum is NaN iff one was.
    const double probe = cpu::deterministic_sum(n, 1, [&](int64_t begin, int64_t end) {
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = begin; i < end; ++i) s += x[i] * 0.0f;
      return static_cast<double>(s);
    });
    return std::isnan(probe);
  }

  // ---- Linear ----
  void linear_forward(float* y, const float* x, const float* w, const float* b, const LinearShape& s,
                      const Activation* epilogue, float* pre) override {
    check_shape(s);
    if (s.rows == 0 || s.out == 0) return;
    if (s.in == 0) {
      fill(y, 0.0f, s.rows * s.out);
    } else {
      const bool out_in = s.layout == WeightLayout::kOutIn;
      // y = alpha · x[rows, in] · W', W' = Wᵀ for [out, in] storage, W for [in, out].
      sgemm(CblasNoTrans, out_in ? CblasTrans : CblasNoTrans, blas_int(s.rows), blas_int(s.out), blas_int(s.in),
            s.alpha, x, blas_int(s.in), w, blas_int(out_in ? s.in : s.out), 0.0f, y, blas_int(s.out));
    }
    cpu::bias_activation_rows(y, epilogue ? pre : nullptr, b, s.beta, s.rows, s.out, epilogue);
  }
  // Both apply the same op.forward() to the same float.
  bool epilogue_recomputes_exactly(const Activation&) const override { return true; }

  void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                       const LinearShape& s, GradWrite param_grads, GradWrite input_grad) override {
    check_shape(s);
    // sgemm's beta: 1 adds into the buffer, 0 overwrites it (same products, same order).
    const float param_beta = param_grads == GradWrite::kOverwrite ? 0.0f : 1.0f;
    const float input_beta = input_grad == GradWrite::kOverwrite ? 0.0f : 1.0f;
    if (param_grads == GradWrite::kOverwrite) {
      if (db != nullptr) std::fill(db, db + s.out, 0.0f);
      if (dw != nullptr && (s.rows == 0 || s.out == 0)) std::fill(dw, dw + s.in * s.out, 0.0f);
    }
    if (input_grad == GradWrite::kOverwrite && dx != nullptr && (s.rows == 0 || s.out == 0)) {
      std::fill(dx, dx + s.rows * s.in, 0.0f);
    }
    if (s.rows == 0 || s.out == 0) return;
    const bool out_in = s.layout == WeightLayout::kOutIn;
    if (dx != nullptr && s.in > 0) {
      // dx[rows, in] += alpha · dy[rows, out] · W'ᵀ
      sgemm(CblasNoTrans, out_in ? CblasNoTrans : CblasTrans, blas_int(s.rows), blas_int(s.in), blas_int(s.out),
            s.alpha, dy, blas_int(s.out), w, blas_int(out_in ? s.in : s.out), input_beta, dx, blas_int(s.in));
    }
    if (dw != nullptr && s.in > 0) {
      if (out_in) {  // dw[out, in] += alpha · dyᵀ · x
        sgemm(CblasTrans, CblasNoTrans, blas_int(s.out), blas_int(s.in), blas_int(s.rows), s.alpha, dy, blas_int(s.out),
              x, blas_int(s.in), param_beta, dw, blas_int(s.in));
      } else {  // dw[in, out] += alpha · xᵀ · dy
        sgemm(CblasTrans, CblasNoTrans, blas_int(s.in), blas_int(s.out), blas_int(s.rows), s.alpha, x, blas_int(s.in),
              dy, blas_int(s.out), param_beta, dw, blas_int(s.out));
      }
    }
    if (db != nullptr) bias_backward(db, dy, s.beta, s.rows, s.out);
  }

  // ---- elementwise ----
  void activation_forward(float* y, const float* x, int64_t n, const Activation& a) override {
    cpu::activation_forward(y, x, n, a);
  }
  void activation_backward(float* dx, const float* dy, const float* x, const float* y, int64_t n,
                           const Activation& a) override {
    cpu::activation_backward(dx, dy, x, y, n, a);
  }
  void add_forward(float* y, const float* a, const float* b, int64_t n) override {
    cpu::parallel_ranges(n, n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) y[i] = a[i] + b[i];
    });
  }

  // ---- softmax, LayerNorm, BatchNorm ----
  void softmax_forward(float* y, const float* x, int64_t rows, int64_t width, bool log) override {
    cpu::softmax_forward(y, x, rows, width, log);
  }
  void softmax_backward(float* dx, const float* dy, const float* y, int64_t rows, int64_t width, bool log) override {
    cpu::softmax_backward(dx, dy, y, rows, width, log);
  }
  void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                         int64_t rows, int64_t width, float eps) override {
    cpu::layernorm_forward(y, mean, rstd, x, w, b, rows, width, eps);
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                          const float* mean, const float* rstd, int64_t rows, int64_t width) override {
    cpu::layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, rows, width);
  }
  void batchnorm_forward(float* y, float* mean, float* rstd, float* running_mean, float* running_var, const float* x,
                         const float* w, const float* b, int64_t batch, int64_t channels, int64_t inner, float eps,
                         float momentum, bool training, const ChannelReducer* reduce) override {
    cpu::batchnorm_forward(y, mean, rstd, running_mean, running_var, x, w, b, batch, channels, inner, eps, momentum,
                           training, reduce);
  }
  void batchnorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                          const float* mean, const float* rstd, int64_t batch, int64_t channels, int64_t inner,
                          bool training, const ChannelReducer* reduce) override {
    cpu::batchnorm_backward(dx, dw, db, dy, x, w, mean, rstd, batch, channels, inner, training, reduce);
  }

  // ---- dropout, losses, optimizers ----
  void dropout_forward(float* y, float* mask, const float* x, int64_t n, float ratio, uint64_t seed,
                       uint64_t offset) override {
    cpu::dropout_forward(y, mask, x, n, ratio, seed, offset);
  }
  void dropout_backward(float* dx, const float* dy, const float* mask, int64_t n) override {
    cpu::parallel_ranges(n, n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dx[i] += dy[i] * mask[i];
    });
  }
  double cross_entropy(float* dlogits, const float* logits, const float* labels, int64_t rows, int64_t classes,
                       double denominator, bool log_probs) override {
    return cpu::cross_entropy(dlogits, logits, labels, rows, classes, denominator, log_probs);
  }
  double mean_squared_error(float* dpred, const float* pred, const float* target, int64_t n,
                            double denominator) override {
    return cpu::mean_squared_error(dpred, pred, target, n, denominator);
  }
  bool sgd_step(float* param, const float* grad, float* momentum_buffer, int64_t n, const SgdStep& s) override {
    return cpu::sgd_step(param, grad, momentum_buffer, n, s);
  }
  bool adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                 const AdamStep& s) override {
    return cpu::adam_step(param, grad, exp_avg, exp_avg_sq, n, s);
  }

 private:
  static void check_shape(const LinearShape& s) {
    PIPESHARD_CHECK(s.rows >= 0 && s.in >= 0 && s.out >= 0, "linear shape rows=" + std::to_string(s.rows) + " in=" +
                                                                std::to_string(s.in) + " out=" + std::to_string(s.out));
  }
  // C[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C, row-major, on OpenBLAS's
  // threads only when the GEMM is big enough to pay for them (kBlasThreadMinMacs).
  static void sgemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, blasint m, blasint n, blasint k, float alpha,
                    const float* a, blasint lda, const float* b, blasint ldb, float beta, float* c, blasint ldc) {
    const bool small = static_cast<int64_t>(m) * n * k < kBlasThreadMinMacs;
    // Only with OpenBLAS's own pthreads (openblas_get_parallel() == 1): the OpenMP build's
    // setter also sets OpenMP's thread count and reallocates buffers.
    const int threads = small && openblas_get_parallel() == 1 ? openblas_get_num_threads() : 1;
    if (threads > 1) openblas_set_num_threads(1);
    cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    if (threads > 1) openblas_set_num_threads(threads);
  }
  // OpenBLAS takes 32-bit dimensions (the LP64 build Debian ships).
  static blasint blas_int(int64_t v) {
    PIPESHARD_CHECK(v <= INT32_MAX, "matrix dimension " + std::to_string(v) + " exceeds the BLAS int range");
    return static_cast<blasint>(v);
  }
  // db[out] += beta · Σ_rows dy[rows, out]: threads own column ranges and add the rows in
  // order, so the sum does not depend on the thread count.
  static void bias_backward(float* db, const float* dy, float beta, int64_t rows, int64_t out) {
    cpu::parallel_ranges(out, rows * out, [&](int64_t o0, int64_t o1) {
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = dy + r * out;
        for (int64_t o = o0; o < o1; ++o) db[o] += beta * row[o];
      }
    });
  }

  mutable std::mutex sizes_mutex_;            // allocate() may be called from any thread
  std::unordered_map<void*, int64_t> sizes_;  // bytes of each live buffer
  MemoryUse memory_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace pipeshard
