#include "backend/gpu.h"

#include <string>

#include "backend/plugin.h"

namespace pipeshard {
namespace {

constexpr char kPlugin[] = "libpipeshard_cuda_plugin.so";
constexpr char kNcclPlugin[] = "libpipeshard_nccl_plugin.so";

// The CUDA plugin's entry points (backend/cuda/plugin.cc).
struct Plugin {
  int (*usable_gpus)(char* why, size_t why_size) = nullptr;
  Backend* (*make_backend)(int device, int precision, char* error, size_t error_size) = nullptr;
  int (*gpu_memory)(int device, int64_t* free_bytes, int64_t* total_bytes) = nullptr;
  void* (*backend_stream)(Backend* backend) = nullptr;
  std::string error;  // why it could not be loaded
};

// The NCCL plugin's entry point (comm/nccl/comm_nccl_plugin.cc).
struct NcclPlugin {
  Communicator* (*make_communicator)(Communicator* mpi_group, int device, void* producer) = nullptr;
  std::string error;  // why it could not be loaded
};

const Plugin& plugin() {
  static const Plugin p = [] {
    Plugin p;
    p.error = open_plugin(kPlugin,
                          "this build has no CUDA backend (no " + std::string(kPlugin) +
                              " beside the executable: the CUDA toolkit was not found when it was built)",
                          {{"pipeshard_cuda_usable_gpus", &p.usable_gpus},
                           {"pipeshard_cuda_make_backend", &p.make_backend},
                           {"pipeshard_cuda_gpu_memory", &p.gpu_memory},
                           {"pipeshard_cuda_backend_stream", &p.backend_stream}})
                  .message();
    return p;
  }();
  return p;
}

const NcclPlugin& nccl_plugin() {
  static const NcclPlugin p = [] {
    NcclPlugin p;
    p.error = open_plugin(kNcclPlugin,
                          "this build has no NCCL communicator (no " + std::string(kNcclPlugin) +
                              " beside the executable: the CUDA toolkit or NCCL was not found when it was built)",
                          {{"pipeshard_nccl_make_communicator", &p.make_communicator}})
                  .message();
    return p;
  }();
  return p;
}

}  // namespace

int usable_gpus(std::string* why) {
  const Plugin& p = plugin();
  if (!p.usable_gpus) {
    if (why) *why = p.error;
    return 0;
  }
  char reason[512] = {};
  const int n = p.usable_gpus(reason, sizeof reason);
  if (n == 0 && why) *why = reason;
  return n;
}

Result<std::unique_ptr<Backend>> make_gpu_backend(int device, Precision precision) {
  const Plugin& p = plugin();
  if (!p.make_backend) return Status::error("--device cuda: " + p.error);
  char error[512] = {};
  Backend* backend = p.make_backend(device, static_cast<int>(precision), error, sizeof error);
  if (backend == nullptr) return Status::error(error);
  return std::unique_ptr<Backend>(backend);
}

bool gpu_memory(int device, int64_t* free_bytes, int64_t* total_bytes) {
  const Plugin& p = plugin();
  return p.gpu_memory != nullptr && p.gpu_memory(device, free_bytes, total_bytes) != 0;
}

bool gpu_nccl_available(std::string* why) {
  const NcclPlugin& p = nccl_plugin();
  if (p.make_communicator == nullptr && why) *why = p.error;
  return p.make_communicator != nullptr;
}

std::unique_ptr<Communicator> make_gpu_nccl_communicator(Communicator& mpi_group, int device, Backend& backend) {
  const NcclPlugin& nccl = nccl_plugin();
  PIPESHARD_CHECK(nccl.make_communicator != nullptr, "make_gpu_nccl_communicator without NCCL: " + nccl.error);
  // A backend the CUDA plugin made has a stream; with any other, the communicator
  // synchronises the device before each operation.
  const Plugin& cuda = plugin();
  void* producer = cuda.backend_stream != nullptr ? cuda.backend_stream(&backend) : nullptr;
  return std::unique_ptr<Communicator>(nccl.make_communicator(&mpi_group, device, producer));
}

}  // namespace pipeshard
