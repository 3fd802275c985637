#include "backend/registry.h"

#include <algorithm>
#include <string>

#include "backend/plugin.h"

namespace pipeshard {
namespace {

// ---- "cpu": built in ----

int cpu_usable_devices(std::string* /*why*/) { return 1; }

bool cpu_device_memory(int /*device*/, int64_t* /*free_bytes*/, int64_t* /*total_bytes*/) { return false; }

void* cpu_work_queue(Backend& /*backend*/) { return nullptr; }

Result<std::unique_ptr<Backend>> make_cpu(const BackendOptions& /*options*/) { return make_cpu_backend(); }

// ---- "cuda": the plugin, opened on first use ----

constexpr char kCudaPlugin[] = "libpipeshard_cuda_plugin.so";

// The CUDA plugin's entry points (backend/cuda/plugin.cc); all null when it did not load.
struct CudaPlugin {
  int (*usable_gpus)(char* why, size_t why_size) = nullptr;
  Backend* (*make_backend)(int device, int precision, char* error, size_t error_size) = nullptr;
  int (*gpu_memory)(int device, int64_t* free_bytes, int64_t* total_bytes) = nullptr;
  void* (*backend_stream)(Backend* backend) = nullptr;
  Status loaded;  // why it could not be loaded
};

const CudaPlugin& cuda_plugin() {
  static const CudaPlugin p = [] {
    CudaPlugin p;
    p.loaded = open_plugin(kCudaPlugin,
                           "this build has no CUDA backend (no " + std::string(kCudaPlugin) +
                               " beside the executable: the CUDA toolkit was not found when it was built)",
                           {{"pipeshard_cuda_usable_gpus", &p.usable_gpus},
                            {"pipeshard_cuda_make_backend", &p.make_backend},
                            {"pipeshard_cuda_gpu_memory", &p.gpu_memory},
                            {"pipeshard_cuda_backend_stream", &p.backend_stream}});
    return p;
  }();
  return p;
}

int cuda_usable_devices(std::string* why) {
  const CudaPlugin& p = cuda_plugin();
  if (!p.loaded) {
    if (why) *why = p.loaded.message();
    return 0;
  }
  char reason[512] = {};
  const int n = p.usable_gpus(reason, sizeof reason);
  if (n == 0 && why) *why = reason;
  return n;
}

bool cuda_device_memory(int device, int64_t* free_bytes, int64_t* total_bytes) {
  const CudaPlugin& p = cuda_plugin();
  return p.loaded && p.gpu_memory(device, free_bytes, total_bytes) != 0;
}

// Null for a backend the plugin did not make: the plugin asks the object itself.
void* cuda_work_queue(Backend& backend) {
  const CudaPlugin& p = cuda_plugin();
  return p.loaded ? p.backend_stream(&backend) : nullptr;
}

Result<std::unique_ptr<Backend>> make_cuda(const BackendOptions& options) {
  const CudaPlugin& p = cuda_plugin();
  if (!p.loaded) return p.loaded;
  char error[512] = {};
  Backend* backend = p.make_backend(options.device, static_cast<int>(options.precision), error, sizeof error);
  if (backend == nullptr) return Status::error(error);
  return std::unique_ptr<Backend>(backend);
}

// The rows, in a function so that they exist whenever they are asked for.
const std::vector<BackendKind>& rows() {
  static const std::vector<BackendKind> kinds = {
      {.name = "cpu",
       .title = "the CPU backend",
       .device_noun = "CPU",
       .memory_noun = "memory",
       .precisions = {Precision::kFp32},
       .records_work = false,
       .why_no_recording = "has no kernel launches to save",
       .memory = BackendMemory::kHost,
       .usable_devices = cpu_usable_devices,
       .device_memory = cpu_device_memory,
       .work_queue = cpu_work_queue,
       .make = make_cpu},
      {.name = "cuda",
       .title = "the CUDA backend",
       .device_noun = "GPU",
       .memory_noun = "GPU memory",
       .precisions = {Precision::kFp32, Precision::kTf32, Precision::kBf16, Precision::kFp16},
       .records_work = true,
       .why_no_recording = "",
       .memory = BackendMemory::kDevice,
       .usable_devices = cuda_usable_devices,
       .device_memory = cuda_device_memory,
       .work_queue = cuda_work_queue,
       .make = make_cuda},
  };
  return kinds;
}

// "a", "a or b", "a, b or c".
std::string or_list(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += i + 1 == items.size() ? " or " : ", ";
    out += items[i];
  }
  return out;
}

}  // namespace

bool BackendKind::computes_in(Precision p) const {
  return std::find(precisions.begin(), precisions.end(), p) != precisions.end();
}

const std::vector<BackendKind>& backend_kinds() { return rows(); }

const BackendKind* find_backend(const std::string& name) {
  for (const BackendKind& kind : rows()) {
    if (name == kind.name) return &kind;
  }
  return nullptr;
}

const BackendKind* backend_kind_of(const Backend& backend) { return find_backend(backend.name()); }

std::string backend_names_where(const std::function<bool(const BackendKind&)>& fact) {
  std::vector<std::string> names;
  for (const BackendKind& kind : rows()) {
    if (fact(kind)) names.push_back(kind.name);
  }
  return or_list(names);
}

std::string precision_list(const BackendKind& kind) {
  std::vector<std::string> names;
  for (Precision p : kind.precisions) names.push_back(precision_name(p));
  return or_list(names);
}

Status check_usable(const BackendKind& kind) {
  std::string why;
  if (kind.usable_devices(&why) > 0) return Status::ok();
  return Status::error(std::string("no usable ") + kind.device_noun + " (" + why + ")");
}

Result<std::unique_ptr<Backend>> make_backend(const std::string& name, const BackendOptions& options) {
  const BackendKind* kind = find_backend(name);
  if (kind == nullptr) {
    return Status::error("no backend '" + name +
                         "' in this build: " + backend_names_where([](const BackendKind&) { return true; }));
  }
  if (!kind->computes_in(options.precision)) {  // before the plugin is opened
    return Status::error(std::string(kind->title) + " computes in " + precision_list(*kind) + " only, not " +
                         precision_name(options.precision));
  }
  PIPESHARD_RETURN_IF_ERROR(check_usable(*kind));
  return kind->make(options);  // which checks options.device against what it has
}

}  // namespace pipeshard
