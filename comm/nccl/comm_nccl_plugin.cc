// The NCCL plugin's C entry point, which comm/device_groups.cc opens through
// backend/plugin.h. Like the CUDA plugin (backend/cuda/plugin.cc), objects cross the
// boundary as C++ objects: the plugin and its loader come from one build.
//
// What the plugin holds and what it borrows. It holds the NCCL communicator
// (comm_nccl.cc) and libnccl. It borrows, from the process that opens it: the MPI group the
// communicator is bootstrapped over, reached only through the Communicator interface (so
// the plugin carries none of comm_mpi.cc and none of MPI's state); the watchdog, through
// libpipeshard_watchdog.so, the one copy that train arms; the CUDA runtime, libcudart.so,
// which the CUDA plugin loaded first, so that the backend's stream is valid here.
#include "comm/comm.h"
#include "comm/nccl/comm_nccl.h"

extern "C" {

// An NCCL communicator over `mpi_group` on GPU `device`, ordered after the work queued on
// `producer` (a cudaStream_t, or null): make_nccl_communicator (comm/nccl/comm_nccl.h).
// Collective over `mpi_group`; NCCL and CUDA failures abort the job. Owned by the caller.
__attribute__((visibility("default"))) pipeshard::Communicator* pipeshard_nccl_make_communicator(
    pipeshard::Communicator* mpi_group, int device, void* producer) {
  return pipeshard::make_nccl_communicator(*mpi_group, device, static_cast<CUstream_st*>(producer)).release();
}

}  // extern "C"
