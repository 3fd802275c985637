// The CudaBackend: memory from the caching allocator, one stream for everything, and each
// primitive forwarded to its launcher (launchers.h). Host results (sums, losses, the
// optimizers' finiteness) synchronise the stream; nothing else does, so a step queues its
// kernels without waiting and the host runs ahead to the next host value.
//
// Every precision is accepted. It matters to Linear alone (linear.cu): TF32 GEMMs, or in
// bf16/fp16 mode GEMMs on 16-bit copies of the operands with fp32 accumulation into the
// fp32 buffers; every other kernel — activations, norms, softmax, losses, optimizers —
// computes in fp32 whatever the precision. The buffers, and so the master weights and the
// optimizer state, are fp32 in every mode; loss scaling for fp16 is the trainer's.
//
// record() captures the stream (cudaStreamBeginCapture, thread-local mode) while the work
// runs and instantiates the CUDA graph; replay() launches it on the same stream. Calls that
// cannot be part of a graph — allocation, copies to or from the host, and every host
// result — stop the process with a message when made while recording: they are bugs in
// the caller (backend/backend.h, Backend::record).
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <string>

#include "backend/cuda/allocator.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/launchers.h"

namespace pipeshard {
namespace {

class CudaGraph final : public RecordedWork {
 public:
  CudaGraph(cudaGraphExec_t exec, cudaStream_t stream) : exec_(exec), stream_(stream) {}
  ~CudaGraph() override { cudaGraphExecDestroy(exec_); }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  void replay() override { PIPESHARD_CUDA_CHECK(cudaGraphLaunch(exec_, stream_)); }

 private:
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, Precision precision) : device_(device) {
    PIPESHARD_CUDA_CHECK(cudaSetDevice(device_));
    PIPESHARD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    linear_ = cuda::create_linear_context(precision, &allocator_);
    scratch_ = allocator_.allocate(cuda::reduce_scratch_bytes());
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    cuda::destroy_linear_context(linear_);
    allocator_.deallocate(scratch_);
    cudaStreamDestroy(stream_);
  }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  const char* name() const override { return "cuda"; }

  std::unique_ptr<RecordedWork> record(const std::function<void()>& work) override {
    PIPESHARD_CHECK(!recording_, "a recording inside a recording");
    PIPESHARD_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    recording_ = true;
    work();
    recording_ = false;
    cudaGraph_t graph = nullptr;
    PIPESHARD_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    PIPESHARD_CUDA_CHECK(instantiated);
    return std::make_unique<CudaGraph>(exec, stream_);
  }
  cudaStream_t stream() const { return stream_; }

  float* allocate(int64_t n) override {
    PIPESHARD_CHECK(n >= 0, "allocate(" + std::to_string(n) + ")");
    not_recording("allocate");
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float);
    auto* p = static_cast<float*>(allocator_.allocate(bytes));
    PIPESHARD_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));  // the contract: zero-filled
    return p;
  }
  void deallocate(float* p) override {
    not_recording("deallocate");
    allocator_.deallocate(p);
  }  // stream order keeps reuse safe
  MemoryUse memory_use() const override {
    return MemoryUse{static_cast<int64_t>(allocator_.bytes_in_use()),
                     static_cast<int64_t>(allocator_.peak_bytes_in_use())};
  }
  void upload(float* dst, const float* host, int64_t n) override {
    not_recording("upload");
    if (n <= 0) return;
    PIPESHARD_CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes(n), cudaMemcpyHostToDevice, stream_));
    // The caller may change or free `host` as soon as we return (the staged communicator's
    // buffers do). CUDA promises that of a pageable source only for cudaMemcpy, not for the
    // Async form ("might be synchronous with respect to host"), so wait for the copy: a
    // few uploads a step, each after the work already queued.
    PIPESHARD_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void download(float* host, const float* src, int64_t n) override {
    not_recording("download");
    if (n > 0) PIPESHARD_CUDA_CHECK(cudaMemcpyAsync(host, src, bytes(n), cudaMemcpyDeviceToHost, stream_));
    PIPESHARD_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void synchronize() override {
    not_recording("synchronize");
    PIPESHARD_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void fill(float* dst, float value, int64_t n) override { cuda::fill(dst, value, n, stream_); }
  void copy(float* dst, const float* src, int64_t n) override {
    // cudaMemcpy's areas may not overlap; a buffer onto itself is already a copy.
    if (n > 0 && dst != src)
      PIPESHARD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes(n), cudaMemcpyDeviceToDevice, stream_));
  }
  void axpy(float* y, float a, const float* x, int64_t n) override { cuda::axpy(y, a, x, n, stream_); }
  void scale(float* x, float a, int64_t n) override { cuda::scale(x, a, n, stream_); }
  void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows, int64_t width,
                 bool add) override {
    cuda::copy_rows(dst, dst_stride, src, src_stride, rows, width, add, stream_);
  }
  void add_bias(float* y, const float* b, int64_t rows, int64_t width) override {
    cuda::add_bias(y, b, rows, width, stream_);
  }
  void bias_backward(float* db, const float* dy, int64_t rows, int64_t width) override {
    cuda::bias_backward(db, dy, rows, width, stream_);
  }
  double sum_squares(const float* x, int64_t n) override {
    not_recording("sum_squares");
    return cuda::sum_squares(x, n, scratch_, stream_);
  }
  bool any_non_finite(const float* x, int64_t n) override {
    not_recording("any_non_finite");
    return cuda::any_non_finite(x, n, scratch_, stream_);
  }

  void linear_forward(float* y, const float* x, const float* w, const float* b, const LinearShape& s,
                      const Activation* epilogue, float* pre) override {
    cuda::linear_forward(linear_, y, x, w, b, s, epilogue, pre, stream_);
  }
  bool epilogue_recomputes_exactly(const Activation& a) const override {
    return cuda::epilogue_recomputes_exactly(linear_, a);
  }
  void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                       const LinearShape& s, GradWrite param_grads, GradWrite input_grad) override {
    cuda::linear_backward(linear_, dx, dw, db, dy, x, w, s, param_grads, input_grad, stream_);
  }

  void activation_forward(float* y, const float* x, int64_t n, const Activation& a) override {
    cuda::activation_forward(y, x, n, a, stream_);
  }
  void activation_backward(float* dx, const float* dy, const float* x, const float* y, int64_t n,
                           const Activation& a) override {
    cuda::activation_backward(dx, dy, x, y, n, a, stream_);
  }
  void add_forward(float* y, const float* a, const float* b, int64_t n) override { cuda::add(y, a, b, n, stream_); }

  void softmax_forward(float* y, const float* x, int64_t rows, int64_t width, bool log) override {
    cuda::softmax_forward(y, x, rows, width, log, stream_);
  }
  void softmax_backward(float* dx, const float* dy, const float* y, int64_t rows, int64_t width, bool log) override {
    cuda::softmax_backward(dx, dy, y, rows, width, log, stream_);
  }

  void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w, const float* b,
                         int64_t rows, int64_t width, float eps) override {
    cuda::layernorm_forward(y, mean, rstd, x, w, b, rows, width, eps, stream_);
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                          const float* mean, const float* rstd, int64_t rows, int64_t width) override {
    cuda::layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, rows, width, stream_);
  }

  void batchnorm_forward(float* y, float* mean, float* rstd, float* running_mean, float* running_var, const float* x,
                         const float* w, const float* b, int64_t batch, int64_t channels, int64_t inner, float eps,
                         float momentum, bool training, const ChannelReducer* reduce) override {
    cuda::batchnorm_forward(y, mean, rstd, running_mean, running_var, x, w, b, batch, channels, inner, eps, momentum,
                            training, reduce, &reducer_scratch_, stream_);
  }
  void batchnorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w,
                          const float* mean, const float* rstd, int64_t batch, int64_t channels, int64_t inner,
                          bool training, const ChannelReducer* reduce) override {
    cuda::batchnorm_backward(dx, dw, db, dy, x, w, mean, rstd, batch, channels, inner, training, reduce,
                             &reducer_scratch_, stream_);
  }

  void dropout_forward(float* y, float* mask, const float* x, int64_t n, float ratio, uint64_t seed,
                       uint64_t offset) override {
    cuda::dropout_forward(y, mask, x, n, ratio, seed, offset, stream_);
  }
  void dropout_backward(float* dx, const float* dy, const float* mask, int64_t n) override {
    cuda::dropout_backward(dx, dy, mask, n, stream_);
  }

  double cross_entropy(float* dlogits, const float* logits, const float* labels, int64_t rows, int64_t classes,
                       double denominator, bool log_probs) override {
    not_recording("cross_entropy");
    return cuda::cross_entropy(dlogits, logits, labels, rows, classes, denominator, log_probs, scratch_, stream_);
  }
  double mean_squared_error(float* dpred, const float* pred, const float* target, int64_t n,
                            double denominator) override {
    not_recording("mean_squared_error");
    return cuda::mean_squared_error(dpred, pred, target, n, denominator, scratch_, stream_);
  }

  bool sgd_step(float* param, const float* grad, float* momentum_buffer, int64_t n, const SgdStep& s) override {
    not_recording("sgd_step");
    return cuda::sgd_step(param, grad, momentum_buffer, n, s, scratch_, stream_);
  }
  bool adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                 const AdamStep& s) override {
    not_recording("adam_step");
    return cuda::adam_step(param, grad, exp_avg, exp_avg_sq, n, s, scratch_, stream_);
  }

 private:
  static size_t bytes(int64_t n) { return static_cast<size_t>(n) * sizeof(float); }

  int device_;
  cudaStream_t stream_ = nullptr;
  cuda::CachingAllocator allocator_;
  cuda::LinearContext* linear_ = nullptr;
  void* scratch_ = nullptr;               // for the reductions that return host values
  cuda::ReducerScratch reducer_scratch_;  // synchronized BatchNorm's sums, freed after the stream
  bool recording_ = false;                // inside record(): the stream is being captured

  void not_recording(const char* call) const {
    PIPESHARD_CHECK(!recording_, std::string(call) +
                                     " while recording a CUDA graph: a recorded step may not "
                                     "allocate, copy to or from the host, or return a host value");
  }
};

}  // namespace

int cuda_usable_gpus(std::string* why) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    if (why)
      *why = std::string("cudaGetDeviceCount: error ") + std::to_string(static_cast<int>(rc)) + ", " +
             cudaGetErrorString(rc);
    cudaGetLastError();  // not sticky for the next caller
    return 0;
  }
  if (count == 0 && why) *why = "the driver reports no GPU";
  return count;
}

bool cuda_gpu_memory(int device, int64_t* free_bytes, int64_t* total_bytes) {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  size_t free = 0, total = 0;
  const bool ok = cudaMemGetInfo(&free, &total) == cudaSuccess;
  cudaGetLastError();
  cudaSetDevice(previous);
  *free_bytes = static_cast<int64_t>(free);
  *total_bytes = static_cast<int64_t>(total);
  return ok;
}

CUstream_st* cuda_backend_stream(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  return cuda != nullptr ? cuda->stream() : nullptr;
}

Result<std::unique_ptr<Backend>> make_cuda_backend(int device, Precision precision) {
  std::string why;
  const int count = cuda_usable_gpus(&why);
  if (count == 0) return Status::error("no usable GPU (" + why + ")");
  if (device < 0 || device >= count) {
    return Status::error("GPU " + std::to_string(device) + " asked for, but " + std::to_string(count) + " visible");
  }
  return std::unique_ptr<Backend>(new CudaBackend(device, precision));
}

}  // namespace pipeshard
