// The NCCL communicator, loaded on demand: a plugin, libpipeshard_nccl_plugin.so beside
// the executable (libnccl is 200 MB), opened only for NCCL groups (backend/plugin.h). A
// build without NCCL has no plugin, and these functions say so. (The CUDA backend is in
// the backend registry, backend/registry.h.)
#ifndef PIPESHARD_BACKEND_GPU_H_
#define PIPESHARD_BACKEND_GPU_H_

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "backend/backend.h"
#include "comm/comm.h"

namespace pipeshard {

// Whether NCCL communicators can be made in this process: false, with the reason in `why`,
// when this build has no NCCL plugin or it cannot be loaded. Loads the plugin (and
// libnccl) on first use; local, not collective.
bool gpu_nccl_available(std::string* why);

// An NCCL communicator over the ranks of `mpi_group` on GPU `device` (make_nccl_communicator,
// comm/nccl/comm_nccl.h), whose operations start after the work queued so far on `backend`
// (its work queue, BackendKind::work_queue: a CUDA backend's stream; with a backend that
// has none, the whole device is synchronised before each operation). Collective over
// `mpi_group`: every rank of it must call it, so check gpu_nccl_available on every rank and
// agree first; an NCCL or CUDA failure inside aborts the job. `mpi_group` and `backend` must outlive the communicator
// and the groups split from it; it must be destroyed before them.
std::unique_ptr<Communicator> make_gpu_nccl_communicator(Communicator& mpi_group, int device, Backend& backend);

}  // namespace pipeshard

#endif  // PIPESHARD_BACKEND_GPU_H_
