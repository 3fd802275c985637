// The NCCL communicator's one kernel (comm_nccl.cc): kAverage's division, which NCCL's
// ncclAvg would round differently from the MPI communicator's sum-then-divide.
#ifndef PIPESHARD_COMM_NCCL_COMM_NCCL_KERNELS_H_
#define PIPESHARD_COMM_NCCL_COMM_NCCL_KERNELS_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace pipeshard {

// data[n] /= divisor, as float division rounded to nearest (IEEE, as on the CPU), queued on
// `stream` of the current device. Returns the launch's error (cudaSuccess when n == 0).
cudaError_t divide_on_device(float* data, int64_t n, int divisor, cudaStream_t stream);

}  // namespace pipeshard

#endif  // PIPESHARD_COMM_NCCL_COMM_NCCL_KERNELS_H_
