// Checked CUDA, cuBLAS(Lt) calls: a failure is fatal, with file:line and the call, as for
// broken invariants (docs/style.md 6): common/check.h's PIPESHARD_CHECKED_CALL ("pipeshard: CUDA
// error at FILE:LINE in CALL: the error's text"). Under mpirun no rank waits on this one:
// the process aborts, and mpirun ends the job.
#ifndef PIPESHARD_BACKEND_CUDA_CUDA_CHECK_H_
#define PIPESHARD_BACKEND_CUDA_CUDA_CHECK_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "common/check.h"

namespace pipeshard::cuda {

inline bool cuda_succeeded(cudaError_t rc) { return rc == cudaSuccess; }
inline bool cublas_succeeded(cublasStatus_t rc) { return rc == CUBLAS_STATUS_SUCCESS; }

}  // namespace pipeshard::cuda

#define PIPESHARD_CUDA_CHECK(call) \
  PIPESHARD_CHECKED_CALL("CUDA", call, #call, ::pipeshard::cuda::cuda_succeeded, cudaGetErrorString)

// After a kernel launch: launch errors (bad configuration) show at once, not at the next sync.
#define PIPESHARD_CUDA_LAUNCHED() PIPESHARD_CUDA_CHECK(cudaGetLastError())

#define PIPESHARD_CUBLAS_CHECK(call) \
  PIPESHARD_CHECKED_CALL("CUDA", call, #call, ::pipeshard::cuda::cublas_succeeded, cublasLtGetStatusString)

#endif  // PIPESHARD_BACKEND_CUDA_CUDA_CHECK_H_
