// The plugin's C entry points, which the backend registry (backend/registry.cc) finds with
// dlsym. The Backend object crosses the boundary as a C++ object: the plugin and its loader
// come from one build.
#include <cstdint>
#include <cstdio>
#include <string>

#include "backend/cuda/cuda_backend.h"

namespace {

void put(char* out, size_t size, const std::string& text) {
  if (size > 0) std::snprintf(out, size, "%s", text.c_str());
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int pipeshard_cuda_usable_gpus(char* why, size_t why_size) {
  std::string reason;
  const int n = pipeshard::cuda_usable_gpus(&reason);
  put(why, why_size, reason);
  return n;
}

__attribute__((visibility("default"))) pipeshard::Backend* pipeshard_cuda_make_backend(int device, int precision,
                                                                                       char* error, size_t error_size) {
  auto backend = pipeshard::make_cuda_backend(device, static_cast<pipeshard::Precision>(precision));
  if (!backend) {
    put(error, error_size, backend.status().message());
    return nullptr;
  }
  return backend->release();
}

__attribute__((visibility("default"))) int pipeshard_cuda_gpu_memory(int device, int64_t* free_bytes,
                                                                     int64_t* total_bytes) {
  return pipeshard::cuda_gpu_memory(device, free_bytes, total_bytes) ? 1 : 0;
}

// The CUDA stream of a backend this plugin made (a cudaStream_t), or null for any other
// backend: the producer an NCCL communicator orders its operations after.
__attribute__((visibility("default"))) void* pipeshard_cuda_backend_stream(pipeshard::Backend* backend) {
  return backend != nullptr ? pipeshard::cuda_backend_stream(*backend) : nullptr;
}

}  // extern "C"
