// Device groups: the groups that carry tensors in a backend's memory between processes
// (Parallel::device_groups, runtime/trainer.h), one row per kind, chosen by name:
//
//   "host"    the host groups themselves (no device groups): one process, or a backend in
//             the host's memory (the CPU), whose buffers MPI reads as they are.
//   "staged"  every group staged through host memory over the host groups
//             (comm/comm_staged.h): any backend, any number of processes per device, MPI's
//             matching and ordering; the results are the host groups', bit for bit.
//   "nccl"    the data-parallel and tensor-parallel groups over NCCL (comm/nccl/comm_nccl.h)
//             in the device's memory, ordered after the backend's work queue, and the
//             pipeline group staged. NCCL lives in a plugin, libpipeshard_nccl_plugin.so
//             beside the executable (backend/plugin.h; libnccl is 200 MB), opened only
//             for this kind. NCCL refuses two ranks of one communicator on one GPU, so it
//             needs a device per process.
//
// Also here, what choosing needs to know about the machine: this process's rank on it, the
// device that rank computes on, and the machines that run more processes than they have
// devices. Errors speak of values; the tools add their flags' names.
#ifndef PIPESHARD_COMM_DEVICE_GROUPS_H_
#define PIPESHARD_COMM_DEVICE_GROUPS_H_

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/registry.h"
#include "comm/comm.h"
#include "common/status.h"

namespace pipeshard {

// One row of the registry.
struct DeviceGroupKind {
  const char* name;  // "host", "staged", "nccl"
  // The memories of the backends whose tensors it carries (BackendKind::memory).
  std::vector<BackendMemory> carries;
  // Every process needs a device of its own (crowded_machines says where they do not), and
  // why, for a sentence: "NCCL refuses two ranks on one GPU".
  bool one_process_per_device;
  const char* why_one_process_per_device;
  // Ok when this kind can be made in this process; otherwise why not ("this build has no
  // NCCL communicator (…)"). Local, not collective; "nccl" opens the plugin on first use.
  Status (*available)();
  // The groups over `host` (make_process_groups) for `backend`'s memory on device
  // `device`; empty groups for "host". Collective over the host world, where "nccl"'s
  // set-up waits on every rank of each group: call it on every rank, after available() and
  // the device check agreed everywhere. NCCL and CUDA failures inside end the job.
  ProcessGroups (*make)(ProcessGroups& host, Backend& backend, int device);
  // On an exit with an error, lets go of the communicators that must not be shut down in
  // order (ncclCommDestroy waits for the other ranks of the machine, which may still be
  // training or waiting on this one; the process's exit frees the GPU, and mpirun ends
  // the job, as for MPI); null when every group may be destroyed as usual.
  void (*abandon)(ProcessGroups& groups);

  bool carries_memory(BackendMemory memory) const;
};

// Every kind, "host" first.
const std::vector<DeviceGroupKind>& device_group_kinds();

// The row called `name`; null when there is none.
const DeviceGroupKind* find_device_groups(const std::string& name);

// The kind a run of `world_size` processes on `backend` uses: "host" for one process;
// for a backend in host memory "host" too, or "staged" when the environment says
// PIPESHARD_STAGE_COMM=1 (so that tests check the staging without a GPU); otherwise the
// kind called `requested`, which must exist and carry the backend's memory.
const DeviceGroupKind& choose_device_groups(const BackendKind& backend, int world_size, const std::string& requested);

// Device groups as made, owned. Destroy them after whatever uses them (a Trainer: its
// requests in flight) and before the backend (an NCCL communicator orders its work after
// the backend's queue) and the host groups (which "staged" and "nccl" communicate over).
class DeviceGroups {
 public:
  DeviceGroups();  // "host"
  DeviceGroups(const DeviceGroupKind& kind, ProcessGroups groups);

  const DeviceGroupKind& kind() const { return *kind_; }
  // For Parallel::device_groups: null for "host", whose tensors the host groups carry.
  ProcessGroups* for_trainer();
  // On an exit with an error, before the destructor: DeviceGroupKind::abandon.
  void abandon();

 private:
  const DeviceGroupKind* kind_;
  ProcessGroups groups_;
};

// The groups of `kind` (DeviceGroupKind::make, collective likewise) for `backend` on
// device `device`, over `host`, which must outlive them, as `backend` must.
DeviceGroups make_device_groups(const DeviceGroupKind& kind, ProcessGroups& host, Backend& backend, int device);

// This process's rank among the processes of its machine, from the launcher
// (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID); 0 without one.
int local_rank();

// The device of `backend`'s kind this process computes on: its local rank modulo the
// devices usable here (docs/design.md, "Processes, ranks and groups"), so that processes
// share devices round robin; 0 for the CPU.
int device_of_this_process(const BackendKind& backend);

// The ranks of `world` on this machine (those that share its host name), in world order.
// Collective over `world`.
std::unique_ptr<Communicator> split_by_machine(Communicator& world);

// The machines that run more processes than they have usable devices of `backend`, and
// the processes and devices on them, summed. Collective over `world`; the same on every
// rank (sums over the world), so that every rank reaches the same verdict.
struct Crowding {
  int machines = 0, processes = 0, devices = 0;
};
Crowding crowded_machines(Communicator& world, const BackendKind& backend);

}  // namespace pipeshard

#endif  // PIPESHARD_COMM_DEVICE_GROUPS_H_
