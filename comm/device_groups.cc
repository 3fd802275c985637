#include "comm/device_groups.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <functional>

#include "backend/plugin.h"
#include "comm/comm_staged.h"

namespace pipeshard {
namespace {

// ---- "host" and "staged" ----

Status always_available() { return Status::ok(); }

ProcessGroups make_host(ProcessGroups& /*host*/, Backend& /*backend*/, int /*device*/) { return {}; }

ProcessGroups make_staged(ProcessGroups& host, Backend& backend, int /*device*/) {
  return make_staged_groups(host, backend);
}

// ---- "nccl": the plugin, opened on first use ----

constexpr char kNcclPlugin[] = "libpipeshard_nccl_plugin.so";

// The NCCL plugin's entry point (comm/nccl/comm_nccl_plugin.cc); null when it did not load.
struct NcclPlugin {
  Communicator* (*make_communicator)(Communicator* mpi_group, int device, void* producer) = nullptr;
  Status loaded;  // why it could not be loaded
};

const NcclPlugin& nccl_plugin() {
  static const NcclPlugin p = [] {
    NcclPlugin p;
    p.loaded = open_plugin(kNcclPlugin,
                           "this build has no NCCL communicator (no " + std::string(kNcclPlugin) +
                               " beside the executable: the CUDA toolkit or NCCL was not found when it was built)",
                           {{"pipeshard_nccl_make_communicator", &p.make_communicator}});
    return p;
  }();
  return p;
}

Status nccl_available() { return nccl_plugin().loaded; }

// An NCCL communicator over the ranks of `mpi_group` on GPU `device` (make_nccl_communicator,
// comm/nccl/comm_nccl.h), whose operations start after the work queued so far on `backend`
// (its work queue: a CUDA backend's stream; with a backend that has none, the communicator
// synchronises the whole device before each operation). Collective over `mpi_group`.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& mpi_group, int device, Backend& backend) {
  const NcclPlugin& nccl = nccl_plugin();
  PIPESHARD_CHECK(nccl.loaded.is_ok(), "NCCL groups without NCCL: " + nccl.loaded.message());
  const BackendKind* kind = backend_kind_of(backend);
  void* producer = kind != nullptr ? kind->work_queue(backend) : nullptr;
  return std::unique_ptr<Communicator>(nccl.make_communicator(&mpi_group, device, producer));
}

ProcessGroups make_nccl(ProcessGroups& host, Backend& backend, int device) {
  // Gradient all-reduces (data) and the tensor-parallel all-reduces and gathers over NCCL,
  // in the GPU's memory, after the backend's queued work. Every rank makes the data group,
  // then the tensor group; groups of one stay staged (the trainer does not use them).
  //
  // The pipeline group stays staged. NCCL runs one communicator's operations one after
  // another on the GPU, in the order they were issued (comm/nccl/comm_nccl.h). The 1F1B
  // schedules post a send_async of activations and then block on receiving gradients,
  // while the neighbouring stage does the mirror image: over NCCL each send would sit
  // behind its rank's receive, and once a message exceeds NCCL's buffers both ranks wait
  // forever. MPI moves both sends along; NCCL would need the exchange issued in matching
  // order, or one communicator per direction.
  ProcessGroups groups = make_staged_groups(host, backend);
  if (host.data->size() > 1) groups.data = make_nccl_communicator(*host.data, device, backend);
  if (host.tensor->size() > 1) groups.tensor = make_nccl_communicator(*host.tensor, device, backend);
  return groups;
}

// The groups make_nccl put on NCCL; the staged pipeline group is destroyed as usual.
void abandon_nccl(ProcessGroups& groups) {
  (void)groups.data.release();
  (void)groups.tensor.release();
}

const std::vector<DeviceGroupKind>& rows() {
  static const std::vector<DeviceGroupKind> kinds = {
      {.name = "host",
       .carries = {BackendMemory::kHost},
       .one_process_per_device = false,
       .why_one_process_per_device = "",
       .available = always_available,
       .make = make_host,
       .abandon = nullptr},
      {.name = "staged",
       .carries = {BackendMemory::kHost, BackendMemory::kDevice},
       .one_process_per_device = false,
       .why_one_process_per_device = "",
       .available = always_available,
       .make = make_staged,
       .abandon = nullptr},
      {.name = "nccl",
       .carries = {BackendMemory::kDevice},
       .one_process_per_device = true,
       .why_one_process_per_device = "NCCL refuses two ranks on one GPU",
       .available = nccl_available,
       .make = make_nccl,
       .abandon = abandon_nccl},
  };
  return kinds;
}

const DeviceGroupKind& row(const std::string& name) {
  const DeviceGroupKind* kind = find_device_groups(name);
  PIPESHARD_CHECK(kind != nullptr, "no device groups called '" + name + "'");
  return *kind;
}

}  // namespace

bool DeviceGroupKind::carries_memory(BackendMemory memory) const {
  return std::find(carries.begin(), carries.end(), memory) != carries.end();
}

const std::vector<DeviceGroupKind>& device_group_kinds() { return rows(); }

const DeviceGroupKind* find_device_groups(const std::string& name) {
  for (const DeviceGroupKind& kind : rows()) {
    if (name == kind.name) return &kind;
  }
  return nullptr;
}

const DeviceGroupKind& choose_device_groups(const BackendKind& backend, int world_size, const std::string& requested) {
  if (world_size == 1) return row("host");
  if (backend.memory == BackendMemory::kHost) {
    const char* stage = std::getenv("PIPESHARD_STAGE_COMM");
    return row(stage != nullptr && std::string(stage) == "1" ? "staged" : "host");
  }
  const DeviceGroupKind& kind = row(requested);
  PIPESHARD_CHECK(kind.carries_memory(backend.memory),
                  std::string("device groups '") + kind.name + "' do not carry " + backend.title + "'s tensors");
  return kind;
}

DeviceGroups::DeviceGroups() : kind_(&row("host")) {}

DeviceGroups::DeviceGroups(const DeviceGroupKind& kind, ProcessGroups groups)
    : kind_(&kind), groups_(std::move(groups)) {}

// "host" makes no groups: the host groups carry the tensors.
ProcessGroups* DeviceGroups::for_trainer() { return groups_.data != nullptr ? &groups_ : nullptr; }

void DeviceGroups::abandon() {
  if (kind_->abandon != nullptr) kind_->abandon(groups_);
}

DeviceGroups make_device_groups(const DeviceGroupKind& kind, ProcessGroups& host, Backend& backend, int device) {
  return DeviceGroups(kind, kind.make(host, backend, device));
}

int local_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != 0) return std::atoi(v);
  }
  return 0;
}

int device_of_this_process(const BackendKind& backend) {
  return local_rank() % std::max(1, backend.usable_devices(nullptr));
}

std::unique_ptr<Communicator> split_by_machine(Communicator& world) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const uint64_t color = std::hash<std::string>{}(host)&0x3fffffff;
  return world.split(static_cast<int>(color), world.rank());
}

Crowding crowded_machines(Communicator& world, const BackendKind& backend) {
  std::unique_ptr<Communicator> machine = split_by_machine(world);
  const int devices = backend.usable_devices(nullptr);
  const bool leader = machine->rank() == 0;  // counts its machine once
  const bool crowded = leader && machine->size() > devices;
  Crowding c;
  c.machines = static_cast<int>(world.all_reduce_sum(crowded ? 1.0 : 0.0));
  c.processes = static_cast<int>(world.all_reduce_sum(crowded ? machine->size() : 0.0));
  c.devices = static_cast<int>(world.all_reduce_sum(crowded ? devices : 0.0));
  return c;
}

}  // namespace pipeshard
