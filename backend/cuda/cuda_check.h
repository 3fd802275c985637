// Checked CUDA, cuBLAS(Lt) calls: a failure is fatal, with file:line and the call, as for
// broken invariants (style.md 6). Under mpirun the process's non-zero exit makes mpirun
// end the job, so no rank waits on this one.
#ifndef PIPESHARD_BACKEND_CUDA_CUDA_CHECK_H_
#define PIPESHARD_BACKEND_CUDA_CUDA_CHECK_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace pipeshard::cuda {

[[noreturn]] inline void cuda_call_failed(const char* what, const char* call, const char* file, int line) {
  std::fprintf(stderr, "pipeshard: CUDA error at %s:%d in %s: %s\n", file, line, call, what);
  std::fflush(stderr);
  std::abort();
}

}  // namespace pipeshard::cuda

#define PIPESHARD_CUDA_CHECK(call)                                                                   \
  do {                                                                                               \
    const cudaError_t _cuda_rc = (call);                                                             \
    if (_cuda_rc != cudaSuccess) {                                                                   \
      ::pipeshard::cuda::cuda_call_failed(cudaGetErrorString(_cuda_rc), #call, __FILE__, __LINE__); \
    }                                                                                                \
  } while (0)

// After a kernel launch: launch errors (bad configuration) show at once, not at the next sync.
#define PIPESHARD_CUDA_LAUNCHED() PIPESHARD_CUDA_CHECK(cudaGetLastError())

#define PIPESHARD_CUBLAS_CHECK(call)                                                                         \
  do {                                                                                                       \
    const cublasStatus_t _cublas_rc = (call);                                                                \
    if (_cublas_rc != CUBLAS_STATUS_SUCCESS) {                                                               \
      ::pipeshard::cuda::cuda_call_failed(cublasLtGetStatusString(_cublas_rc), #call, __FILE__, __LINE__); \
    }                                                                                                        \
  } while (0)

#endif  // PIPESHARD_BACKEND_CUDA_CUDA_CHECK_H_
