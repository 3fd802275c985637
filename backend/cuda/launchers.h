// The CUDA backend's kernels, as launchers: each runs one Backend primitive
// (backend/backend.h, whose comments are the contract: shapes, += for gradients, what
// null means) on device pointers, asynchronously on `stream` unless it returns a host
// value. One op family per .cu file, kernel → launcher → the checked entry point in
// cuda_backend.cc (docs/style.md 4):
//
//   elementwise.cu  fill, axpy, scale, add, copy_rows, add_bias, activations, dropout
//   reduce.cu       bias_backward, sum_squares, any_non_finite
//   softmax.cu      softmax, cross-entropy, mean squared error
//   layernorm.cu    LayerNorm
//   batchnorm.cu    BatchNorm
//   linear.cu       Linear through cuBLASLt, with bias/activation epilogues
//   convert.cu      float32 → bf16/fp16 copies of linear.cu's GEMM operands
//   optimizer.cu    SGD, Adam/AdamW over the contiguous parameter buffer
//
// Every launcher accepts n == 0 (or rows == 0) and then launches nothing. Results must
// equal the CPU backend's to the tolerances tests/backend/backend_check.h states; elementwise
// results that the CPU computes exactly (copies, masks, ReLU) must be bitwise equal.
#ifndef PIPESHARD_BACKEND_CUDA_LAUNCHERS_H_
#define PIPESHARD_BACKEND_CUDA_LAUNCHERS_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/backend.h"

namespace pipeshard::cuda {

// ---- elementwise.cu ----
void fill(float* dst, float value, int64_t n, cudaStream_t stream);
void axpy(float* y, float a, const float* x, int64_t n, cudaStream_t stream);
void scale(float* x, float a, int64_t n, cudaStream_t stream);
void add(float* y, const float* a, const float* b, int64_t n, cudaStream_t stream);
void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows, int64_t width,
               bool add, cudaStream_t stream);
void add_bias(float* y, const float* b, int64_t rows, int64_t width, cudaStream_t stream);
void activation_forward(float* y, const float* x, int64_t n, const Activation& a, cudaStream_t stream);
void activation_backward(float* dx, const float* dy, const float* x, const float* y, int64_t n, const Activation& a,
                         cudaStream_t stream);
// The CPU backend's counter-based draw (cpu_training.cc): the same mask, bit for bit.
void dropout_forward(float* y, float* mask, const float* x, int64_t n, float ratio, uint64_t seed, uint64_t offset,
                     cudaStream_t stream);
void dropout_backward(float* dx, const float* dy, const float* mask, int64_t n, cudaStream_t stream);

// ---- reduce.cu ----
void bias_backward(float* db, const float* dy, int64_t rows, int64_t width, cudaStream_t stream);
// Host results: they synchronise `stream`. `scratch` is device memory of at least
// reduce_scratch_bytes() bytes that the caller owns (no allocation per call).
size_t reduce_scratch_bytes();
double sum_squares(const float* x, int64_t n, void* scratch, cudaStream_t stream);
bool any_non_finite(const float* x, int64_t n, void* scratch, cudaStream_t stream);

// ---- softmax.cu ----
void softmax_forward(float* y, const float* x, int64_t rows, int64_t width, bool log, cudaStream_t stream);
void softmax_backward(float* dx, const float* dy, const float* y, int64_t rows, int64_t width, bool log,
                      cudaStream_t stream);
// Host results (synchronise `stream`); scratch as for reduce.cu.
double cross_entropy(float* dlogits, const float* logits, const float* labels, int64_t rows, int64_t classes,
                     double denominator, bool log_probs, void* scratch, cudaStream_t stream);
double mean_squared_error(float* dpred, const float* pred, const float* target, int64_t n, double denominator,
                          void* scratch, cudaStream_t stream);

// ---- layernorm.cu ----
void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b, int64_t rows,
                       int64_t width, float eps, cudaStream_t stream);
void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int64_t rows, int64_t width, cudaStream_t stream);

// ---- batchnorm.cu ----
// Device doubles for synchronized BatchNorm's sums, which the reducer is handed: plain
// cudaMalloc memory rather than the stream-ordered pool, so that any communicator may use
// it. Grown when too small and otherwise kept, because cudaMalloc and cudaFree wait for
// the whole device, the communicators' streams included. One per backend.
class ReducerScratch {
 public:
  ReducerScratch() = default;
  ~ReducerScratch();
  ReducerScratch(const ReducerScratch&) = delete;
  ReducerScratch& operator=(const ReducerScratch&) = delete;
  // At least n doubles. Growing first waits for `stream`, which may still read the old ones.
  double* get(int64_t n, cudaStream_t stream);

 private:
  double* data_ = nullptr;
  int64_t size_ = 0;
};

// `reduce` is handed device doubles from `scratch`, as Backend documents ("the backend's
// memory"); `scratch` may be null when `reduce` is.
void batchnorm_forward(float* y, float* mean, float* rstd, float* running_mean, float* running_var, const float* x,
                       const float* w, const float* b, int64_t batch, int64_t channels, int64_t inner, float eps,
                       float momentum, bool training, const ChannelReducer* reduce, ReducerScratch* scratch,
                       cudaStream_t stream);
void batchnorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                        const float* mean, const float* rstd, int64_t batch, int64_t channels, int64_t inner,
                        bool training, const ChannelReducer* reduce, ReducerScratch* scratch, cudaStream_t stream);

// ---- linear.cu ----
// cuBLASLt state for one device: the handle, a workspace, the matmul plans cached by shape
// and, in bf16/fp16 mode, the 16-bit copies of the GEMM operands (grow-only scratch from
// `allocator`, which must outlive the context). Owned by the backend; used from its stream
// only. `precision` is what the GEMMs compute in (backend.h's Precision): fp32; TF32; or
// bf16/fp16, where every fp32 operand is rounded to a 16-bit copy first and cuBLASLt
// multiplies those with fp32 accumulation into the same fp32 outputs.
class CachingAllocator;
struct LinearContext;
LinearContext* create_linear_context(Precision precision, CachingAllocator* allocator);
void destroy_linear_context(LinearContext* context);
// Whether activation_forward reproduces bit for bit the y a fused linear_forward writes
// beside `pre` with this activation (Backend::epilogue_recomputes_exactly).
bool epilogue_recomputes_exactly(const LinearContext* context, const Activation& a);
void linear_forward(LinearContext* context, float* y, const float* x, const float* w, const float* b,
                    const LinearShape& s, const Activation* epilogue, float* pre, cudaStream_t stream);
void linear_backward(LinearContext* context, float* dx, float* dw, float* db, const float* dy, const float* x,
                     const float* w, const LinearShape& s, GradWrite param_grads, GradWrite input_grad,
                     cudaStream_t stream);

// ---- convert.cu ----
// dst[n] = src[n] rounded to nearest even to `to` (Precision::kBf16 or kFp16; anything else
// is a bug), as the 16-bit patterns cuBLASLt reads as CUDA_R_16BF / CUDA_R_16F elements
// (convert_math.cuh has the rounding). dst [n] is device memory the caller owns.
void convert_to_16bit(uint16_t* dst, const float* src, int64_t n, Precision to, cudaStream_t stream);

// ---- optimizer.cu ----
// Both return false when a gradient was inf or NaN (they synchronise `stream` to say so);
// `scratch` as for reduce.cu.
bool sgd_step(float* param, const float* grad, float* momentum_buffer, int64_t n, const SgdStep& s, void* scratch,
              cudaStream_t stream);
bool adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamStep& s,
               void* scratch, cudaStream_t stream);

}  // namespace pipeshard::cuda

#endif  // PIPESHARD_BACKEND_CUDA_LAUNCHERS_H_
