// Backend: memory and kernels for one device. Everything above it — programs, autograd,
// losses, optimizers, schedules — sees only this interface, so the CUDA backend is a
// second implementation of the same thing, tested against the CPU one.
//
// Conventions (llm.c style):
// - Pointers are float32 buffers in the backend's memory, from allocate(). Shapes are
//   given as counts; comments give each buffer's shape, e.g. x [rows, in].
// - Each layer is a forward/backward pair. Backward ADDS into parameter gradients and
//   into input gradients (+=), so fan-out (residuals, shared weights) needs no special
//   case: the caller zeroes gradient buffers once per step.
// - Kernels never fail on valid shapes; invalid shapes are bugs (PIPESHARD_CHECK).
// No CUDA header is included here.
#ifndef PIPESHARD_BACKEND_BACKEND_H_
#define PIPESHARD_BACKEND_BACKEND_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "ir/graph.h"

namespace pipeshard {

// y[rows, out] = alpha * x[rows, in] · W + beta * b[out], W stored as `layout` says.
struct LinearShape {
  int64_t rows = 0;  // batch × any dims between the batch and the features
  int64_t in = 0;
  int64_t out = 0;
  WeightLayout layout = WeightLayout::kOutIn;
  float alpha = 1.0f;
  float beta = 1.0f;
};

// How a backward writes a gradient buffer: add into it (the default, so fan-out needs
// no special case), or overwrite it — for a buffer that this call alone writes, which
// spares the caller zeroing it first (PyTorch gets the same from fresh gradients).
enum class GradWrite { kAdd, kOverwrite };

// Sums per-channel partial statistics over the processes that share a BatchNorm
// (the data-parallel replicas under --sync-batchnorm), in place. Every process calls
// it the same number of times with the same n.
using ChannelReducer = std::function<void(double* data, int64_t n)>;

// What a backend computes in: the CPU backend fp32 only. The CUDA backend also kTf32
// GEMMs (fp32 storage, tensor-core products with 10-bit mantissas, fp32 accumulation) and
// kBf16 / kFp16 GEMMs: fp32 master weights and optimizer state, every buffer fp32 as
// above; Linear rounds its GEMM operands to bf16 (8 significant bits, float32's range) or
// fp16 (11 bits, at most 65504) to nearest even and multiplies them with fp32 accumulation
// into fp32 results. Only Linear's products change; every other kernel computes in fp32.
// fp16's loss scaling is the trainer's, not the backend's.
enum class Precision { kFp32, kTf32, kBf16, kFp16 };
inline const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kFp32: return "fp32";
    case Precision::kTf32: return "tf32";
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
  }
  return "?";
}

struct Activation {
  ActivationKind kind = ActivationKind::kRelu;
  float alpha = 0.01f;  // LeakyRelu's negative slope
};

// Hyper-parameters of one optimizer step, torch.optim semantics.
struct SgdStep {
  float lr = 0.01f, momentum = 0.0f, weight_decay = 0.0f;
  bool nesterov = false;
  bool first_step = true;  // torch initialises the momentum buffer to the first gradient
};
struct AdamStep {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  bool decoupled = false;  // AdamW: decay the weights, not the gradient
  int64_t step = 1;        // 1-based, for bias correction
};

// Backend work recorded once and replayed as a whole (Backend::record).
class RecordedWork {
 public:
  virtual ~RecordedWork() = default;
  // Runs the recorded calls again, in order, with the arguments they were recorded with.
  virtual void replay() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // ---- recorded work (train --cuda-graph) ----
  // Records the calls `work` makes on this backend without running them, for replay()
  // later: the CUDA backend captures its stream into a CUDA graph, which then runs as one
  // launch. Arguments are frozen as they were at recording, so what changes between
  // replays must change in the buffers, not in the arguments; and nothing recorded may
  // allocate, free or return a host value (sums, losses, the optimizers' finiteness), which
  // is a bug that fails the recording. Host code inside `work` runs once, at recording.
  // Null when this backend cannot record (the CPU backend: its calls cost nothing to start).
  virtual std::unique_ptr<RecordedWork> record(const std::function<void()>& work) {
    (void)work;
    return nullptr;
  }

  // Returns once the work queued so far has finished: for timing it (the trainer's trace and
  // pipeline bubble), not for correctness, which every host result and copy already waits
  // for. The CPU backend's calls finish before they return. Never while recording.
  virtual void synchronize() {}

  // ---- memory (float32 elements) ----
  // A zero-filled buffer of n elements; owned by the caller, released with deallocate().
  virtual float* allocate(int64_t n) = 0;
  virtual void deallocate(float* p) = 0;
  // Bytes of backend memory held now and the most held at once since the backend was
  // made, as allocated (rounding included): the CPU backend counts its allocate()
  // buffers; the CUDA backend every block of its caching allocator that is in use, its
  // own scratch from there (16-bit operand copies, reductions) included, not the cache's
  // free blocks, cuBLASLt's 32 MiB workspace nor synchronized BatchNorm's few doubles
  // (cudaMalloc'd apart).
  struct MemoryUse {
    int64_t in_use = 0, peak = 0;
  };
  virtual MemoryUse memory_use() const = 0;
  virtual void upload(float* dst, const float* host, int64_t n) = 0;
  virtual void download(float* host, const float* src, int64_t n) = 0;
  virtual void fill(float* dst, float value, int64_t n) = 0;
  virtual void copy(float* dst, const float* src, int64_t n) = 0;
  // y[n] += a * x[n]
  virtual void axpy(float* y, float a, const float* x, int64_t n) = 0;
  // x[n] *= a
  virtual void scale(float* x, float a, int64_t n) = 0;
  // dst[r, 0:width] = src[r, 0:width] (or += when `add`) for r < rows, with rows
  // `dst_stride` and `src_stride` elements apart: moves a column block of a matrix
  // (tensor-parallel gathers and their backward).
  virtual void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                         int64_t width, bool add) = 0;
  // y[rows, width] += b[width]
  virtual void add_bias(float* y, const float* b, int64_t rows, int64_t width) = 0;
  // db[width] += Σ_rows dy[rows, width]
  virtual void bias_backward(float* db, const float* dy, int64_t rows, int64_t width) = 0;
  // sum of x[i]^2 in double precision (gradient clipping)
  virtual double sum_squares(const float* x, int64_t n) = 0;
  // 1 when any x[i] is NaN or infinite
  virtual bool any_non_finite(const float* x, int64_t n) = 0;

  // ---- Linear ----
  // y [rows, out]; x [rows, in]; w [out, in] or [in, out]; b [out] or null.
  // `epilogue`, when given, is applied to y in the same pass (fused bias + activation);
  // pre [rows, out] then receives the pre-activation values backward needs.
  virtual void linear_forward(float* y, const float* x, const float* w, const float* b, const LinearShape& s,
                              const Activation* epilogue = nullptr, float* pre = nullptr) = 0;
  // Whether activation_forward(y, pre, …) writes, bit for bit, the y that linear_forward
  // wrote with epilogue `a` beside `pre`. Where it does, a Program recomputes such a y in
  // backward instead of keeping it from forward (ProgramOptions::recompute_activations).
  virtual bool epilogue_recomputes_exactly(const Activation& a) const = 0;
  // dx [rows, in] += alpha·dy·W ; dw += alpha·dyᵀx laid out like w ; db [out] += beta·Σ_rows dy.
  // Any of dx, dw, db may be null (not needed). dy [rows, out] is not modified.
  // `param_grads` applies to dw and db, `input_grad` to dx (kOverwrite: = instead of +=).
  virtual void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                               const LinearShape& s, GradWrite param_grads = GradWrite::kAdd,
                               GradWrite input_grad = GradWrite::kAdd) = 0;

  // ---- elementwise ----
  // y[n] = act(x[n])
  virtual void activation_forward(float* y, const float* x, int64_t n, const Activation& a) = 0;
  // dx[n] += dy[n] * act'(x[n]); y = act(x), or null: the kinds whose derivative uses y
  // then recompute it from x.
  virtual void activation_backward(float* dx, const float* dy, const float* x, const float* y, int64_t n,
                                   const Activation& a) = 0;
  // y[n] = a[n] + b[n]
  virtual void add_forward(float* y, const float* a, const float* b, int64_t n) = 0;

  // ---- softmax over the last dim: x, y [rows, width] ----
  virtual void softmax_forward(float* y, const float* x, int64_t rows, int64_t width, bool log) = 0;
  // dx += softmax' · dy, using the forward output y.
  virtual void softmax_backward(float* dx, const float* dy, const float* y, int64_t rows, int64_t width, bool log) = 0;

  // ---- LayerNorm over the last dim: x, y [rows, width]; w, b [width] or null ----
  // mean, rstd [rows] are saved for backward.
  virtual void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                                 int64_t rows, int64_t width, float eps) = 0;
  virtual void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                                  const float* mean, const float* rstd, int64_t rows, int64_t width) = 0;

  // ---- BatchNorm per channel: x, y [batch, channels, inner]; w, b, running_* [channels] ----
  // training: normalise with the batch's statistics (biased variance), save mean and
  // rstd [channels] (in both modes: inference saves the running mean and
  // 1/sqrt(running_var + eps), which backward needs), and update running_mean/var as ONNX does:
  //   running = momentum * running + (1 - momentum) * batch, with the UNBIASED variance
  // (PyTorch's rule; ONNX momentum = 1 - torch momentum). Otherwise use the running stats.
  //
  // `reduce` (synchronized BatchNorm; training only, inference ignores it): the batch is
  // the union of the slices x of every process that `reduce` sums over, and the results
  // are those of one process on that whole batch, up to rounding. Null: this process's
  // batch alone. It is handed partial sums as doubles in the backend's memory:
  // - forward calls it twice: with [channels + 1] = Σx per channel and this process's
  //   count batch·inner last, then with [channels] = Σ(x − mean)² about the global mean.
  //   Every process then holds the same mean, rstd and running statistics.
  // - backward calls it once, and only when dx is wanted (not null): with
  //   [2·channels + 1] = Σdy per channel, Σdy·x̂ per channel, and the local count again
  //   (so that backward needs nothing from forward but mean and rstd). dw and db receive
  //   THIS process's Σdy·x̂ and Σdy: the data-parallel gradient all-reduce sums them, as
  //   PyTorch's SyncBatchNorm under DDP does. dx uses the global sums and count.
  // A training batch needs more than one value per channel: locally without `reduce`,
  // over all processes with it (a process may then hold batch·inner == 1).
  virtual void batchnorm_forward(float* y, float* mean, float* rstd, float* running_mean, float* running_var,
                                 const float* x, const float* w, const float* b, int64_t batch, int64_t channels,
                                 int64_t inner, float eps, float momentum, bool training,
                                 const ChannelReducer* reduce = nullptr) = 0;
  // dx [batch, channels, inner] += ∂L/∂x; dw, db [channels] += Σ dy·x̂ and Σ dy (either
  // may be null); dy as y. mean, rstd [channels] are what forward saved (forward with the
  // same `reduce`, when backward has one). training: the gradient also flows through the
  // batch statistics.
  virtual void batchnorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                                  const float* mean, const float* rstd, int64_t batch, int64_t channels, int64_t inner,
                                  bool training, const ChannelReducer* reduce = nullptr) = 0;

  // ---- Dropout: y[n] = x[n] * mask[n], mask[n] in {0, 1/(1-ratio)} drawn from (seed, offset) ----
  virtual void dropout_forward(float* y, float* mask, const float* x, int64_t n, float ratio, uint64_t seed,
                               uint64_t offset) = 0;
  // dx += dy * mask
  virtual void dropout_backward(float* dx, const float* dy, const float* mask, int64_t n) = 0;

  // ---- losses, mean over `rows` (the GLOBAL batch: pass its size as `denominator`) ----
  // logits [rows, classes], labels [rows] as float-encoded class indices.
  // Returns Σ losses / denominator and writes dlogits [rows, classes] = ∂loss/∂logits.
  // log_probs: the logits are already log-probabilities (model ends in LogSoftmax): NLL.
  virtual double cross_entropy(float* dlogits, const float* logits, const float* labels, int64_t rows, int64_t classes,
                               double denominator, bool log_probs) = 0;
  // pred, target, dpred [n]; Σ (pred - target)^2 / denominator.
  virtual double mean_squared_error(float* dpred, const float* pred, const float* target, int64_t n,
                                    double denominator) = 0;

  // ---- optimizers over contiguous buffers: param, grad, state [n] ----
  // Both return false when a gradient was inf or NaN (the step is applied all the same):
  // the check rides on the pass the step makes anyway, where a separate one would cost a
  // read of every gradient (--on-nonfinite stop, runtime/trainer.h).
  virtual bool sgd_step(float* param, const float* grad, float* momentum_buffer, int64_t n, const SgdStep& s) = 0;
  virtual bool adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                         const AdamStep& s) = 0;
};

// The CPU reference: OpenBLAS sgemm for Linear, plain loops (OpenMP where it pays) for
// the rest.
std::unique_ptr<Backend> make_cpu_backend();

// A buffer owned by a Backend, released when it goes out of scope.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend& backend, int64_t n) : backend_(&backend), data_(backend.allocate(n)), size_(n) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      backend_ = o.backend_;
      data_ = o.data_;
      size_ = o.size_;
      o.data_ = nullptr;
      o.size_ = 0;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  float* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  void reset() {
    if (data_) backend_->deallocate(data_);
    data_ = nullptr;
  }
  Backend* backend_ = nullptr;
  float* data_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace pipeshard

#endif  // PIPESHARD_BACKEND_BACKEND_H_
