// The CUDA backend: a second implementation of Backend (backend/backend.h) on one GPU,
// tested against the CPU backend (the reference) by the same suites. It is built into a
// plugin (plugin.cc) that the tools open only when asked for a GPU: use backend/registry.h.
#ifndef PIPESHARD_BACKEND_CUDA_CUDA_BACKEND_H_
#define PIPESHARD_BACKEND_CUDA_CUDA_BACKEND_H_

#include <memory>
#include <string>

#include "backend/backend.h"
#include "common/status.h"

struct CUstream_st;  // what cudaStream_t points to

namespace pipeshard {

// A backend on GPU `device` (0-based among the visible ones), computing in `precision`:
// kFp32; kTf32 (GEMMs on tensor cores with TF32 inputs and fp32 accumulation); kBf16 or
// kFp16 (GEMMs on bf16/fp16 copies of their fp32 operands, rounded to nearest even, with
// fp32 accumulation; buffers, weights and optimizer state stay fp32, every other kernel
// computes in fp32, and fp16's loss scaling is the caller's). Errors: "no usable GPU (<the
// driver's reason>)", a device index beyond the count.
Result<std::unique_ptr<Backend>> make_cuda_backend(int device, Precision precision);

// GPUs this process can use; 0 with the driver's reason in `why` (cudaGetDeviceCount
// fails with error 35, cudaErrorInsufficientDriver, on a machine without a driver).
int cuda_usable_gpus(std::string* why);

// Free and total memory of GPU `device` (cudaMemGetInfo), in bytes; false when it cannot
// be asked.
bool cuda_gpu_memory(int device, int64_t* free_bytes, int64_t* total_bytes);

// The stream `backend` queues all its work on (a cudaStream_t; it lives as long as the
// backend), or null when `backend` is not a CUDA backend. Communicators order their
// operations after it (make_nccl_communicator's `producer`).
CUstream_st* cuda_backend_stream(Backend& backend);

}  // namespace pipeshard

#endif  // PIPESHARD_BACKEND_CUDA_CUDA_BACKEND_H_
