// The smallest piece of the CUDA backend: asks the driver how many GPUs this process
// can use. Built only where the CUDA toolkit exists, so CI compiles CUDA code from day
// one; the CUDA backend proper (issue "train on GPUs") grows beside it.
#ifndef PIPESHARD_BACKEND_CUDA_DEVICE_QUERY_H_
#define PIPESHARD_BACKEND_CUDA_DEVICE_QUERY_H_

#include <string>

namespace pipeshard::cuda {

struct DeviceQuery {
  int devices = 0;      // usable GPUs; 0 when the driver reports an error
  int error_code = 0;   // the cudaError_t of cudaGetDeviceCount (35: no driver)
  std::string message;  // cudaGetErrorString for error_code
};

DeviceQuery query_devices();

// Adds two float vectors on the first GPU; returns false (with `message`) when there
// is no usable GPU. Exists to prove that kernels build, link and, on a GPU, run.
bool add_vectors_on_device(const float* a, const float* b, float* out, int n, std::string* message);

}  // namespace pipeshard::cuda

#endif  // PIPESHARD_BACKEND_CUDA_DEVICE_QUERY_H_
