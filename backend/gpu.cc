#include "backend/gpu.h"

#include <string>

#include "backend/plugin.h"
#include "backend/registry.h"

namespace pipeshard {
namespace {

constexpr char kNcclPlugin[] = "libpipeshard_nccl_plugin.so";

// The NCCL plugin's entry point (comm/nccl/comm_nccl_plugin.cc).
struct NcclPlugin {
  Communicator* (*make_communicator)(Communicator* mpi_group, int device, void* producer) = nullptr;
  std::string error;  // why it could not be loaded
};

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

bool gpu_nccl_available(std::string* why) {
  const NcclPlugin& p = nccl_plugin();
  if (p.make_communicator == nullptr && why) *why = p.error;
  return p.make_communicator != nullptr;
}

std::unique_ptr<Communicator> make_gpu_nccl_communicator(Communicator& mpi_group, int device, Backend& backend) {
  const NcclPlugin& nccl = nccl_plugin();
  PIPESHARD_CHECK(nccl.make_communicator != nullptr, "make_gpu_nccl_communicator without NCCL: " + nccl.error);
  const BackendKind* kind = backend_kind_of(backend);
  void* producer = kind != nullptr ? kind->work_queue(backend) : nullptr;
  return std::unique_ptr<Communicator>(nccl.make_communicator(&mpi_group, device, producer));
}

}  // namespace pipeshard
