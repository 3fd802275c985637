// The backends of this build, by name: one row each, with what the rest of the program
// needs to know about it as data (ggml's backend registry). "cpu" is built in
// (make_cpu_backend); "cuda" lives in a plugin, libpipeshard_cuda_plugin.so beside the
// executable (backend/plugin.h), opened the first time a row function of it is called, so
// that a run on the CPU never loads cuBLASLt. A build without the CUDA toolkit has no
// plugin: its row stays, and says so (usable_devices: 0, "this build has no CUDA backend").
//
// Errors speak of values ("the CPU backend computes in fp32 only, not bf16"); the tools
// add their flags' names.
#ifndef PIPESHARD_BACKEND_REGISTRY_H_
#define PIPESHARD_BACKEND_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/status.h"

namespace pipeshard {

// Where a backend's buffers live: in the host's memory, where host communicators (MPI)
// carry them as they are, or in a device's, which needs device groups
// (comm/device_groups.h) between processes.
enum class BackendMemory { kHost, kDevice };

// What make_backend is asked for besides the name.
struct BackendOptions {
  int device = 0;  // which device of the kind, 0-based among those usable here (a GPU); the CPU has one
  Precision precision = Precision::kFp32;
};

// One row of the registry. Every function may be called before any backend exists.
struct BackendKind {
  const char* name;         // "cpu", "cuda"
  const char* title;        // "the CPU backend", for sentences
  const char* device_noun;  // what one device of the kind is called: "CPU", "GPU"
  const char* memory_noun;  // what its memory is called: "memory", "GPU memory"
  // What it computes in (backend.h Precision), the default first.
  std::vector<Precision> precisions;
  // Whether Backend::record gives recordings (--cuda-graph); when not, why it has no use
  // for them, as the end of a sentence that starts with `title` ("has no kernel launches
  // to save").
  bool records_work;
  const char* why_no_recording;
  BackendMemory memory;
  // Devices of the kind this process can use (the CPU: 1); 0 with the reason in `why`
  // ("cudaGetDeviceCount: error 35, …", or that this build has no such backend).
  int (*usable_devices)(std::string* why);
  // Free and total bytes of device `device`; false when there is no such figure (the CPU,
  // whose memory common/host_memory.h reads) or it cannot be asked.
  bool (*device_memory)(int device, int64_t* free_bytes, int64_t* total_bytes);
  // The queue a backend of this kind runs its work on (a CUDA backend: its cudaStream_t),
  // that communicators order their operations after; null for a backend that finishes
  // each call before returning (the CPU) or was not made by this row.
  void* (*work_queue)(Backend& backend);
  // A backend on options.device computing in options.precision. make_backend checks the
  // options first; call that.
  Result<std::unique_ptr<Backend>> (*make)(const BackendOptions& options);

  bool computes_in(Precision p) const;
};

// Every backend of this build, "cpu" first.
const std::vector<BackendKind>& backend_kinds();

// The row called `name`; null when there is none.
const BackendKind* find_backend(const std::string& name);

// The row a backend was made by (by Backend::name()); null when none was.
const BackendKind* backend_kind_of(const Backend& backend);

// The names of the rows for which `fact` holds, as a list for a sentence: "cuda",
// "cpu or cuda", "a, b or c".
std::string backend_names_where(const std::function<bool(const BackendKind&)>& fact);

// The precisions `kind` computes in, for a sentence: "fp32", "fp32, tf32, bf16 or fp16".
std::string precision_list(const BackendKind& kind);

// Ok when a device of `kind` can be used here; otherwise "no usable GPU (<reason>)".
Status check_usable(const BackendKind& kind);

// A backend of kind `name`. Errors: no such backend ("no backend 'x' in this build: cpu or
// cuda"), a precision it does not compute in ("the CPU backend computes in fp32 only, not
// bf16"), no usable device ("no usable GPU (<reason>)"), a device index beyond those
// usable, and whatever else stops the row from making one.
Result<std::unique_ptr<Backend>> make_backend(const std::string& name, const BackendOptions& options);

}  // namespace pipeshard

#endif  // PIPESHARD_BACKEND_REGISTRY_H_
