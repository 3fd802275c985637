// The GPU backend, loaded on demand: the CUDA backend and its libraries (cuBLASLt alone is
// 540 MB, and linking it costs every process 0.17 s and 200 MB of memory at start-up)
// live in a plugin, libpipeshard_cuda_plugin.so beside the executable, that is opened only
// when something asks for a GPU. A build without the CUDA toolkit has no plugin, and
// these functions say so.
#ifndef PIPESHARD_EXECUTOR_GPU_H_
#define PIPESHARD_EXECUTOR_GPU_H_

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "executor/backend.h"

namespace pipeshard {

// GPUs this process can use; 0 with the reason in `why` (no plugin in this build, or the
// driver's error: cudaGetDeviceCount fails with 35 on a machine without a driver).
int usable_gpus(std::string* why);

// A CUDA backend on GPU `device`, computing in `precision` (executor/cuda/cuda_backend.h).
Result<std::unique_ptr<Backend>> make_gpu_backend(int device, Precision precision);

// Free and total memory of GPU `device`, in bytes; false when it cannot be asked.
bool gpu_memory(int device, int64_t* free_bytes, int64_t* total_bytes);

}  // namespace pipeshard

#endif  // PIPESHARD_EXECUTOR_GPU_H_
