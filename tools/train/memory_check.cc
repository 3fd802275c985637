// train's memory check (tools/train/memory_check.h).
#include "tools/train/memory_check.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "comm/device_groups.h"
#include "common/host_memory.h"

namespace pipeshard::train_cli {
namespace {

// "one process" or "3 processes, 1.2 GiB for this one".
std::string who_needs_it(int ranks, int64_t mine) {
  return ranks == 1 ? "one process" : fmt::format("{} processes, {} for this one", ranks, bytes_text(mine));
}

// The processes on `machine` that share this one's device add up their needs.
Status check_device_memory(Communicator& machine, const BackendKind& device, int64_t mine) {
  const int index = device_of_this_process(device);
  std::unique_ptr<Communicator> sharing = machine.split(index, machine.rank());
  const double on_device = sharing->all_reduce_sum(static_cast<double>(mine));
  int64_t free = 0, total = 0;
  if (!device.device_memory(index, &free, &total) || on_device <= static_cast<double>(free)) return Status::ok();
  return Status::error(fmt::format(
      "training needs about {} on {} {} ({}; the partitioner's estimate of parameters, gradients, optimizer "
      "state and activations in flight) but it has {} free of {}: use more {}s (--stages, --tensor-parallel), "
      "a smaller --batch-size or more --micro-batches",
      bytes_text(static_cast<int64_t>(on_device)), device.device_noun, index, who_needs_it(sharing->size(), mine),
      bytes_text(free), bytes_text(total), device.device_noun));
}

// The processes on `machine` add up their needs.
Status check_host_memory(Communicator& machine, int64_t mine) {
  const double here = machine.all_reduce_sum(static_cast<double>(mine));
  const HostMemory memory = read_host_memory();
  if (memory.available < 0 || here <= static_cast<double>(memory.available)) return Status::ok();
  std::string where = memory.cgroup_room >= 0 && memory.cgroup_room == memory.available
                          ? "its cgroup " + memory.cgroup_path + " has room for"
                          : "it has";
  return Status::error(fmt::format(
      "training needs about {} on this machine ({}; the partitioner's estimate of parameters, gradients, optimizer "
      "state and activations in flight) but {} {}: spread it over more machines (--stages, --tensor-parallel), a "
      "smaller --batch-size or more --micro-batches",
      bytes_text(static_cast<int64_t>(here)), who_needs_it(machine.size(), mine), where, bytes_text(memory.available)));
}

}  // namespace

Status check_memory(Communicator& world, const Run& run) {
  const std::vector<int64_t> per_stage =
      Trainer::memory_per_stage(run.model->graph, run.config, run.layout, *run.backend);
  const int64_t mine = per_stage.empty() ? 0 : per_stage[run.layout.stage];
  std::unique_ptr<Communicator> machine = split_by_machine(world);
  if (run.device->memory == BackendMemory::kDevice) return check_device_memory(*machine, *run.device, mine);
  return check_host_memory(*machine, mine);
}

}  // namespace pipeshard::train_cli
