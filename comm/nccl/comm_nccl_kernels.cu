#include "comm/nccl/comm_nccl_kernels.h"

#include <algorithm>

namespace pipeshard {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;  // a grid-stride loop covers the rest

__global__ void divide_kernel(float* data, int64_t n, float divisor) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = __fdiv_rn(data[i], divisor);
  }
}

}  // namespace

cudaError_t divide_on_device(float* data, int64_t n, int divisor, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
  divide_kernel<<<blocks, kThreads, 0, stream>>>(data, n, static_cast<float>(divisor));
  return cudaGetLastError();
}

}  // namespace pipeshard
