// What the GPU tests share: whether this machine has a GPU they can use.
#ifndef PIPESHARD_TESTS_CUDA_GPU_TEST_UTIL_H_
#define PIPESHARD_TESTS_CUDA_GPU_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <string>

namespace pipeshard::testing {

// Why this process cannot use a GPU ("no usable GPU (cudaGetDeviceCount: error 35, CUDA
// driver version is insufficient …)"), or empty when it can. Clears the CUDA error, so the
// next call starts clean.
inline std::string no_usable_gpu() {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    return "no usable GPU (cudaGetDeviceCount: error " + std::to_string(static_cast<int>(rc)) + ", " +
           cudaGetErrorString(rc) + ")";
  }
  if (count == 0) return "no usable GPU (the driver reports none)";
  return "";
}

}  // namespace pipeshard::testing

#endif  // PIPESHARD_TESTS_CUDA_GPU_TEST_UTIL_H_
