#include "backend/gpu.h"

#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <mutex>
#include <string>

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

// The folder of the running executable, where the build puts the plugins.
std::string executable_folder() {
  char path[PATH_MAX] = {};
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return ".";
  std::string p(path, static_cast<size_t>(n));
  return p.substr(0, p.find_last_of('/'));
}

// Opens `name` beside the executable; null with the reason in `error`: `absent` when there
// is no such file. RTLD_LOCAL: what the plugins define stays theirs. Libraries they share
// with the process (libcudart, libpipeshard_watchdog) are found already loaded, by their
// soname, and not loaded twice.
void* open_plugin(const char* name, const std::string& absent, std::string* error) {
  const std::string path = executable_folder() + "/" + name;
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* e = ::dlerror();
    *error = ::access(path.c_str(), F_OK) != 0 ? absent : "cannot load " + path + ": " + (e ? e : "?");
  }
  return handle;
}

template <typename F>
void find(void* handle, const char* symbol, F* entry) {
  *entry = reinterpret_cast<F>(::dlsym(handle, symbol));
}

const Plugin& plugin() {
  static Plugin p;
  static std::once_flag once;
  std::call_once(once, [] {
    void* handle = open_plugin(kPlugin,
                               "this build has no CUDA backend (no " + std::string(kPlugin) +
                                   " beside the executable: the CUDA toolkit was not found when it was built)",
                               &p.error);
    if (handle == nullptr) return;
    find(handle, "pipeshard_cuda_usable_gpus", &p.usable_gpus);
    find(handle, "pipeshard_cuda_make_backend", &p.make_backend);
    find(handle, "pipeshard_cuda_gpu_memory", &p.gpu_memory);
    find(handle, "pipeshard_cuda_backend_stream", &p.backend_stream);
    if (!p.usable_gpus || !p.make_backend || !p.gpu_memory || !p.backend_stream) {
      p.error = executable_folder() + "/" + kPlugin + " lacks the pipeshard_cuda_* entry points: a plugin from "
                "another build?";
      p.usable_gpus = nullptr;
      p.make_backend = nullptr;
      p.gpu_memory = nullptr;
      p.backend_stream = nullptr;
    }
  });
  return p;
}

const NcclPlugin& nccl_plugin() {
  static NcclPlugin p;
  static std::once_flag once;
  std::call_once(once, [] {
    void* handle = open_plugin(kNcclPlugin,
                               "this build has no NCCL communicator (no " + std::string(kNcclPlugin) +
                                   " beside the executable: the CUDA toolkit or NCCL was not found when it was built)",
                               &p.error);
    if (handle == nullptr) return;
    find(handle, "pipeshard_nccl_make_communicator", &p.make_communicator);
    if (!p.make_communicator) {
      p.error = executable_folder() + "/" + kNcclPlugin + " lacks pipeshard_nccl_make_communicator: a plugin from "
                "another build?";
    }
  });
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
