#include "executor/gpu.h"

#include <dlfcn.h>
#include <unistd.h>

#include <climits>
#include <mutex>
#include <string>

namespace pipeshard {
namespace {

constexpr char kPlugin[] = "libpipeshard_cuda_plugin.so";

// The plugin's entry points (executor/cuda/plugin.cc).
struct Plugin {
  int (*usable_gpus)(char* why, size_t why_size) = nullptr;
  Backend* (*make_backend)(int device, int precision, char* error, size_t error_size) = nullptr;
  int (*gpu_memory)(int device, int64_t* free_bytes, int64_t* total_bytes) = nullptr;
  std::string error;  // why it could not be loaded
};

// The folder of the running executable, where the build puts the plugin.
std::string executable_folder() {
  char path[PATH_MAX] = {};
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return ".";
  std::string p(path, static_cast<size_t>(n));
  return p.substr(0, p.find_last_of('/'));
}

const Plugin& plugin() {
  static Plugin p;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string path = executable_folder() + "/" + kPlugin;
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* e = ::dlerror();
      p.error = ::access(path.c_str(), F_OK) != 0
                    ? "this build has no CUDA backend (no " + std::string(kPlugin) +
                          " beside the executable: the CUDA toolkit was not found when it was built)"
                    : "cannot load " + path + ": " + (e ? e : "?");
      return;
    }
    p.usable_gpus = reinterpret_cast<decltype(p.usable_gpus)>(::dlsym(handle, "pipeshard_cuda_usable_gpus"));
    p.make_backend = reinterpret_cast<decltype(p.make_backend)>(::dlsym(handle, "pipeshard_cuda_make_backend"));
    p.gpu_memory = reinterpret_cast<decltype(p.gpu_memory)>(::dlsym(handle, "pipeshard_cuda_gpu_memory"));
    if (!p.usable_gpus || !p.make_backend || !p.gpu_memory) {
      p.error = path + " lacks the pipeshard_cuda_* entry points: a plugin from another build?";
      p.usable_gpus = nullptr;
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

}  // namespace pipeshard
