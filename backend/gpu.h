// The GPU backend, loaded on demand: the CUDA backend and its libraries (cuBLASLt alone is
// 540 MB, and linking it costs every process 0.17 s and 200 MB of memory at start-up)
// live in a plugin, libpipeshard_cuda_plugin.so beside the executable, that is opened only
// when something asks for a GPU. A build without the CUDA toolkit has no plugin, and
// these functions say so. The NCCL communicator is a second plugin,
// libpipeshard_nccl_plugin.so (libnccl is 200 MB more), opened only for NCCL groups.
#ifndef PIPESHARD_BACKEND_GPU_H_
#define PIPESHARD_BACKEND_GPU_H_

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "backend/backend.h"
#include "comm/comm.h"

namespace pipeshard {

// GPUs this process can use; 0 with the reason in `why` (no plugin in this build, or the
// driver's error: cudaGetDeviceCount fails with 35 on a machine without a driver).
int usable_gpus(std::string* why);

// A CUDA backend on GPU `device`, computing in `precision` (backend/cuda/cuda_backend.h).
Result<std::unique_ptr<Backend>> make_gpu_backend(int device, Precision precision);

// Free and total memory of GPU `device`, in bytes; false when it cannot be asked.
bool gpu_memory(int device, int64_t* free_bytes, int64_t* total_bytes);

// Whether NCCL communicators can be made in this process: false, with the reason in `why`,
// when this build has no NCCL plugin or it cannot be loaded. Loads the plugin (and
// libnccl) on first use; local, not collective.
bool gpu_nccl_available(std::string* why);

// An NCCL communicator over the ranks of `mpi_group` on GPU `device` (make_nccl_communicator,
// comm/nccl/comm_nccl.h), whose operations start after the work queued so far on `backend`
// (a CUDA backend from make_gpu_backend: its stream; another backend: the whole device is
// synchronised before each operation). Collective over `mpi_group`: every rank of it must
// call it, so check gpu_nccl_available on every rank and agree first; an NCCL or CUDA
// failure inside aborts the job. `mpi_group` and `backend` must outlive the communicator
// and the groups split from it; it must be destroyed before them.
std::unique_ptr<Communicator> make_gpu_nccl_communicator(Communicator& mpi_group, int device, Backend& backend);

}  // namespace pipeshard

#endif  // PIPESHARD_BACKEND_GPU_H_
