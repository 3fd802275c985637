#include "backend/cuda/device_query.h"

#include <cuda_runtime.h>

namespace pipeshard::cuda {
namespace {

__global__ void add_kernel(const float* a, const float* b, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

}  // namespace

DeviceQuery query_devices() {
  DeviceQuery q;
  cudaError_t err = cudaGetDeviceCount(&q.devices);
  if (err != cudaSuccess) {
    q.devices = 0;
    q.error_code = static_cast<int>(err);
    q.message = cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error
  }
  return q;
}

bool add_vectors_on_device(const float* a, const float* b, float* out, int n, std::string* message) {
  DeviceQuery q = query_devices();
  if (q.devices == 0) {
    *message = "no usable GPU: " + q.message;
    return false;
  }
  const size_t bytes = sizeof(float) * static_cast<size_t>(n);
  float *da = nullptr, *db = nullptr, *dout = nullptr;
  bool ok = cudaMalloc(&da, bytes) == cudaSuccess && cudaMalloc(&db, bytes) == cudaSuccess &&
            cudaMalloc(&dout, bytes) == cudaSuccess &&
            cudaMemcpy(da, a, bytes, cudaMemcpyHostToDevice) == cudaSuccess &&
            cudaMemcpy(db, b, bytes, cudaMemcpyHostToDevice) == cudaSuccess;
  if (ok) {
    const int threads = 256;
    add_kernel<<<(n + threads - 1) / threads, threads>>>(da, db, dout, n);
    ok = cudaGetLastError() == cudaSuccess && cudaMemcpy(out, dout, bytes, cudaMemcpyDeviceToHost) == cudaSuccess;
  }
  if (!ok) *message = cudaGetErrorString(cudaGetLastError());
  cudaFree(da);
  cudaFree(db);
  cudaFree(dout);
  return ok;
}

}  // namespace pipeshard::cuda
