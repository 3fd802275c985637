// Everything before train's first step (tools/train/setup.h).
#include "tools/train/setup.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "backend/gpu.h"
#include "backend/registry.h"
#include "comm/comm_staged.h"
#include "common/host_memory.h"
#include "comm/watchdog.h"
#include "tools/plot/plot.h"

namespace pipeshard::train_cli {
namespace {

// A file a flag will write at the end of the run: its folder must exist and it must not
// be a folder itself. Checked before any work, so a typo never costs a finished run.
Status check_output_file(const std::string& flag, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path), folder = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (fs::is_directory(p, ec)) return Status::error(flag + " '" + path + "' is a folder; give a file name");
  if (!fs::is_directory(folder, ec)) return Status::error(flag + " '" + path + "': no folder '" + folder.string() + "'");
  return Status::ok();
}

// The process's rank among those of its machine, from the launcher: it picks the GPU.
int local_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != 0) return std::atoi(v);
  }
  return 0;
}

// --device, --precision, --cuda-graph and --gpu-comm, before anything is loaded: what
// the backend registry says `device` (the --device row) does.
Status check_device(const Args& a, const BackendKind& device) {
  const Precision precision = precision_of(a);
  if (!device.computes_in(precision)) {
    const std::string where = backend_names_where([&](const BackendKind& k) { return k.computes_in(precision); });
    return Status::error("--precision " + a.precision + " needs --device " + where + ": " + device.title +
                         " computes in " + precision_list(device));
  }
  if (a.cuda_graph && !device.records_work) {
    const std::string where = backend_names_where([](const BackendKind& k) { return k.records_work; });
    return Status::error("--cuda-graph needs --device " + where + ": " + device.title + " " + device.why_no_recording);
  }
  if (device.memory == BackendMemory::kHost && a.gpu_comm != "staged") {
    const std::string where =
        backend_names_where([](const BackendKind& k) { return k.memory == BackendMemory::kDevice; });
    return Status::error("--gpu-comm " + a.gpu_comm + " needs --device " + where + ": " + device.title +
                         "'s tensors travel over MPI");
  }
  return check_usable(device).with_context("--device " + a.device);
}

// The device of `kind` this process computes on: by design.md, its rank on the machine,
// modulo the devices there.
int my_device(const BackendKind& kind) { return local_rank() % std::max(1, kind.usable_devices(nullptr)); }

// The ranks of `world` on this machine (those that share its host name), in world order.
// Collective over `world`.
std::unique_ptr<Communicator> split_by_machine(Communicator& world) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const uint64_t color = std::hash<std::string>{}(host) & 0x3fffffff;
  return world.split(static_cast<int>(color), world.rank());
}

// Everything before the first step. Every rank runs it and stops at its first error. The
// one collective inside, splitting the world into groups, comes right after the layout,
// which the flags alone decide: every rank reaches it or none does.
Status set_up(const Args& a, Communicator& world, Run& run) {
  Result<ProcessLayout> layout = ProcessLayout::for_rank(world.rank(), world.size(), a.stages, a.tensor_parallel);
  if (!layout) return layout.status();
  run.layout = *layout;
  run.groups = make_process_groups(world, run.layout);
  const bool root = world.rank() == 0;
  run.device = find_backend(a.device);
  PIPESHARD_CHECK(run.device != nullptr, "--device " + a.device + ": the flag takes only the registry's names");
  PIPESHARD_RETURN_IF_ERROR(check_device(a, *run.device));
  if (a.eval_data.empty() != a.eval_labels.empty()) return Status::error("--eval-data and --eval-labels go together");
  if (!a.save.empty()) PIPESHARD_RETURN_IF_ERROR(check_output_file("--save", a.save));
  if (!a.trace.empty()) PIPESHARD_RETURN_IF_ERROR(check_output_file("--trace", a.trace));
  if (!a.checkpoint.empty() && std::filesystem::exists(a.checkpoint) && !std::filesystem::is_directory(a.checkpoint)) {
    return Status::error("--checkpoint '" + a.checkpoint + "' is a file, not a folder");
  }
  if (!a.plot.empty() && root) {  // a plot that cannot be drawn is a bad flag
    if (Status s = check_picture_output(a.plot); !s) return Status::error("--plot: " + s.message());
  }
  Result<TrainConfig> config = make_config(a);
  if (!config) return config.status();
  run.config = *config;
  if (!(a.comm_timeout >= 0) || a.comm_timeout > 1e7) return Status::error("--comm-timeout must be 0 or a number of seconds");
  Result<InjectedFaults> faults = faults_from_environment();
  if (!faults) return faults.status();
  run.checkpoint_crash = faults->checkpoint;
  set_training_fault(*faults, world.rank());
  Result<ImportedModel> model = import_onnx_file(a.model);
  if (!model) return model.status();
  run.model = std::move(*model);
  Result<Dataset> data = load_dataset(a.data, a.labels, run.model->graph, run.config.loss);
  if (!data) return data.status();
  run.data = std::move(*data);
  if (!a.eval_data.empty()) {
    Result<Dataset> e = load_dataset(a.eval_data, a.eval_labels, run.model->graph, run.config.loss);
    if (!e) return e.status();
    run.eval = std::move(*e);
  }
  if (run.data->samples < run.config.batch_size) {
    return Status::error(a.data + ": " + std::to_string(run.data->samples) + " samples, fewer than one batch of " +
                         std::to_string(run.config.batch_size));
  }
  const int64_t batches_per_epoch = run.data->samples / run.config.batch_size;
  run.steps_per_epoch = std::max<int64_t>(1, batches_per_epoch / run.config.grad_accum);
  run.config.total_steps = a.steps > 0 ? a.steps : std::max<int64_t>(a.epochs, 1) * run.steps_per_epoch;
  return Status::ok();
}

// --gpu-comm nccl: NCCL refuses two ranks of one communicator on one GPU, so every process
// needs a GPU of its own, and the NCCL plugin must load. Collective over `world`, and the
// verdict is the same on every rank (sums over the world): NCCL's set-up waits for every
// rank of a group, so if one rank went on without the others it would hang.
Status check_gpu_comm(const Args& a, Communicator& world, const Run& run) {
  if (a.gpu_comm != "nccl" || world.size() == 1) return Status::ok();
  std::unique_ptr<Communicator> machine = split_by_machine(world);
  const int gpus = run.device->usable_devices(nullptr);
  const bool leader = machine->rank() == 0;  // counts its machine once
  const bool crowded = machine->size() > gpus;
  const double crowded_machines = world.all_reduce_sum(leader && crowded ? 1.0 : 0.0);
  const double crowded_processes = world.all_reduce_sum(leader && crowded ? machine->size() : 0.0);
  const double crowded_gpus = world.all_reduce_sum(leader && crowded ? gpus : 0.0);
  std::string why;
  if (!gpu_nccl_available(&why)) return Status::error("--gpu-comm nccl: " + why);
  if (crowded_machines == 0) return Status::ok();
  const int machines = static_cast<int>(crowded_machines), gpu_count = static_cast<int>(crowded_gpus);
  return Status::error(fmt::format(
      "--gpu-comm nccl needs a GPU for each process (NCCL refuses two ranks on one GPU), but {} machine{} run{} {} "
      "processes on {} GPU{}: use --gpu-comm staged (the default), which lets processes share a GPU",
      machines, machines == 1 ? "" : "s", machines == 1 ? "s" : "", static_cast<int>(crowded_processes), gpu_count,
      gpu_count == 1 ? "" : "s"));
}

// Before anything big is allocated (the backend exists, holding next to nothing, and
// says which activations it keeps): the ranks on this machine together must fit in the
// memory it has left (its MemAvailable, or its cgroup's limit less usage when lower), by
// the partitioner's estimate of each rank's parameters, gradients, optimizer state and
// activations in flight. Collective over `world`: the ranks of one machine add up their
// needs (a machine is the ranks that share a host name).
Status check_memory(Communicator& world, const Run& run) {
  const std::vector<int64_t> per_stage =
      Trainer::memory_per_stage(run.model->graph, run.config, run.layout, *run.backend);
  const int64_t mine = per_stage.empty() ? 0 : per_stage[run.layout.stage];
  std::unique_ptr<Communicator> machine = split_by_machine(world);
  const BackendKind& device = *run.device;
  if (device.memory == BackendMemory::kDevice) {  // the processes that share this one's device add up their needs
    const int gpu = my_device(device);
    std::unique_ptr<Communicator> sharing = machine->split(gpu, machine->rank());
    const double on_gpu = sharing->all_reduce_sum(static_cast<double>(mine));
    int64_t free = 0, total = 0;
    if (device.device_memory(gpu, &free, &total) && on_gpu > static_cast<double>(free)) {
      const int ranks = sharing->size();
      return Status::error(fmt::format(
          "training needs about {} on {} {} ({}; the partitioner's estimate of parameters, gradients, optimizer "
          "state and activations in flight) but it has {} free of {}: use more {}s (--stages, --tensor-parallel), "
          "a smaller --batch-size or more --micro-batches",
          bytes_text(static_cast<int64_t>(on_gpu)), device.device_noun, gpu,
          ranks == 1 ? "one process" : fmt::format("{} processes, {} for this one", ranks, bytes_text(mine)),
          bytes_text(free), bytes_text(total), device.device_noun));
    }
    return Status::ok();
  }
  const double here = machine->all_reduce_sum(static_cast<double>(mine));
  const HostMemory memory = read_host_memory();
  if (memory.available < 0 || here <= static_cast<double>(memory.available)) return Status::ok();
  const int ranks = machine->size();
  std::string where = memory.cgroup_room >= 0 && memory.cgroup_room == memory.available
                          ? "its cgroup " + memory.cgroup_path + " has room for"
                          : "it has";
  return Status::error(fmt::format(
      "training needs about {} on this machine ({}; the partitioner's estimate of parameters, gradients, optimizer "
      "state and activations in flight) but {} {}: spread it over more machines (--stages, --tensor-parallel), a "
      "smaller --batch-size or more --micro-batches",
      bytes_text(static_cast<int64_t>(here)),
      ranks == 1 ? "one process" : fmt::format("{} processes, {} for this one", ranks, bytes_text(mine)), where,
      bytes_text(memory.available)));
}

Status create_backend(const Args& a, Run& run) {
  Result<std::unique_ptr<Backend>> backend =
      make_backend(a.device, {.device = my_device(*run.device), .precision = precision_of(a)});
  if (!backend) return backend.status().with_context("--device " + a.device);
  run.backend = std::move(*backend);
  return Status::ok();
}

// The groups over the backend's memory (Parallel::device_groups). Collective over `world`
// with --gpu-comm nccl, where every rank must get here (after check_gpu_comm and
// create_backend succeeded everywhere); NCCL failures inside end the job.
void make_device_groups(const Args& a, Communicator& world, Run& run) {
  // Several GPU processes exchange their buffers through host memory over MPI (staged
  // groups, comm/comm_staged.h): any number of processes per GPU, MPI's ordering,
  // results bitwise those of the CPU layout's arithmetic. PIPESHARD_STAGE_COMM=1 stages
  // a CPU run the same way, so the tests check the staging without a GPU.
  const char* stage_env = std::getenv("PIPESHARD_STAGE_COMM");
  const bool device_memory = run.device->memory == BackendMemory::kDevice;
  if (world.size() == 1 || !(device_memory || (stage_env != nullptr && std::string(stage_env) == "1"))) return;
  run.device_comm = a.gpu_comm == "nccl" ? DeviceComm::kNccl : DeviceComm::kStaged;
  run.device_groups = make_staged_groups(run.groups, *run.backend);
  if (run.device_comm != DeviceComm::kNccl) return;
  // --gpu-comm nccl: gradient all-reduces (data) and the tensor-parallel all-reduces and
  // gathers over NCCL, in the GPU's memory, after the backend's queued work (its stream).
  // Every rank makes the data group, then the tensor group; groups of one stay staged (the
  // trainer does not use them).
  //
  // The pipeline group stays staged. NCCL runs one communicator's operations one after
  // another on the GPU, in the order they were issued (comm/nccl/comm_nccl.h). The 1F1B
  // schedules post a send_async of activations and then block on receiving gradients,
  // while the neighbouring stage does the mirror image: over NCCL each send would sit
  // behind its rank's receive, and once a message exceeds NCCL's buffers both ranks wait
  // forever. MPI moves both sends along; NCCL would need the exchange issued in matching
  // order, or one communicator per direction.
  if (run.groups.data->size() > 1) {
    run.device_groups.data = make_gpu_nccl_communicator(*run.groups.data, my_device(*run.device), *run.backend);
  }
  if (run.groups.tensor->size() > 1) {
    run.device_groups.tensor = make_gpu_nccl_communicator(*run.groups.tensor, my_device(*run.device), *run.backend);
  }
}

// The trainer, which allocates the parameters, gradients, optimizer state and
// activations; then --resume, and the files the run writes as it goes.
Status create_trainer(const Args& a, Communicator& world, Run& run) {
  const Parallel parallel{&world, &run.groups, &*run.model,
                          run.device_comm != DeviceComm::kHost ? &run.device_groups : nullptr};
  Result<std::unique_ptr<Trainer>> trainer = Trainer::create(run.model->graph, *run.data, *run.backend, run.config, parallel);
  if (!trainer) return trainer.status();
  run.trainer = std::move(*trainer);
  if (!a.resume.empty()) PIPESHARD_RETURN_IF_ERROR(run.trainer->load_checkpoint(a.resume));
  const bool root = world.rank() == 0;
  if (!a.metrics.empty() && root) {
    run.metrics.open(a.metrics, std::ios::trunc);
    if (!run.metrics) return Status::error("cannot write metrics file '" + a.metrics + "'");
  }
  if (!a.tensorboard.empty()) {  // rank 0 writes, every rank times its stage
    Result<std::unique_ptr<TrainingBoard>> b = TrainingBoard::create(a.tensorboard, root);
    if (!b) return b.status();
    run.board = std::move(*b);
  }
  return Status::ok();
}

// Every rank reports how its set-up went, and rank 0 prints each distinct failure once —
// naming the ranks when not all of them hit it — instead of one copy per process.
// Collective; true when every rank succeeded.
bool agree_on_set_up(Communicator& world, const Status& mine) {
  const std::vector<std::string> all = world.gather_text(mine.is_ok() ? std::string() : mine.message(), 0);
  if (world.all_reduce_sum(mine.is_ok() ? 0.0 : 1.0) == 0.0) return true;
  std::vector<std::pair<std::string, std::vector<int>>> distinct;  // message, ranks, in rank order
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    auto it = std::find_if(distinct.begin(), distinct.end(), [&](const auto& d) { return d.first == all[r]; });
    if (it == distinct.end()) it = distinct.insert(distinct.end(), {all[r], {}});
    it->second.push_back(static_cast<int>(r));
  }
  for (const auto& [message, ranks] : distinct) {
    if (static_cast<int>(ranks.size()) == world.size()) {
      fail(message);
      continue;
    }
    std::string who = ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size(); ++i) who += (i ? ", " : "") + std::to_string(ranks[i]);
    fail(who + ": " + message);
  }
  // The other ranks exit once rank 0 has printed: mpirun ends the whole job at the first
  // non-zero exit, which could otherwise cut rank 0 off before its line is out.
  world.barrier();
  return false;
}

// While armed, a rank left waiting on a lost one ends the job.
void arm_watchdog(const Args& a, Communicator& world, const ProcessLayout& l) {
  if (world.size() == 1) return;
  watchdog_arm(a.comm_timeout, "train",
               fmt::format("rank {} (stage {}, replica {}, shard {})", world.rank(), l.stage, l.replica, l.shard));
}

}  // namespace

Result<std::unique_ptr<Backend>> make_backend_like_this_one(const Args& a, const Run& run) {
  return make_backend(a.device, {.device = my_device(*run.device), .precision = precision_of(a)});
}

// A rank that leaves with an error (or a signal, or a failed equivalence check) does not
// shut its NCCL communicators down in order: ncclCommDestroy waits for the other ranks of
// the machine, which may still be training or waiting on this one. The process's exit frees
// the GPU's resources, and mpirun ends the job, as for MPI (comm.h: no MPI_Finalize then).
void abandon_nccl(Run& run) {
  if (run.device_comm != DeviceComm::kNccl) return;
  (void)run.device_groups.data.release();
  (void)run.device_groups.tensor.release();
}

bool set_up_run(const Args& a, const Status& parsed, Communicator& world, Run& run) {
  if (!agree_on_set_up(world, parsed ? set_up(a, world, run) : parsed)) return false;
  if (!agree_on_set_up(world, check_gpu_comm(a, world, run))) return false;
  if (!agree_on_set_up(world, create_backend(a, run))) return false;
  if (!agree_on_set_up(world, check_memory(world, run))) return false;
  // Every rank is here: NCCL's set-up waits on the other ranks of each group, watched as
  // training is. Not create_trainer, where --resume may keep one rank reading for long.
  arm_watchdog(a, world, run.layout);
  make_device_groups(a, world, run);
  watchdog_disarm();
  if (!agree_on_set_up(world, create_trainer(a, world, run))) return false;
  arm_watchdog(a, world, run.layout);  // from here on, for good
  return true;
}

// How the processes exchange the tensors in the backend's memory, said once by rank 0
// before the first step (--check-equivalence included: the tests read it).
void say_how_tensors_travel(const Run& run) {
  const ProcessLayout& layout = run.layout;
  if (run.device_comm == DeviceComm::kStaged) {
    fmt::print(stderr, "note: the {} processes exchange tensors through host memory over MPI (staged: {})\n",
               layout.world_size(),
               run.device->memory == BackendMemory::kDevice
                   ? fmt::format("any number of processes per {0}; --gpu-comm nccl for one {0} per process",
                                 run.device->device_noun)
                   : "PIPESHARD_STAGE_COMM=1");
  } else if (run.device_comm == DeviceComm::kNccl) {
    const bool d = layout.replicas > 1, t = layout.shards > 1;
    const std::string staged = "pipeline stages exchange their tensors through host memory over MPI (staged)";
    if (!d && !t) {
      fmt::print(stderr, "note: --gpu-comm nccl has no data-parallel or tensor-parallel group here; the {} {}\n",
                 layout.world_size(), staged);
      return;
    }
    fmt::print(stderr, "note: the {} processes exchange tensors over NCCL in their {} groups (--gpu-comm nccl, not "
               "yet verified on a multi-GPU machine){}\n", layout.world_size(),
               d && t ? "data-parallel and tensor-parallel" : d ? "data-parallel" : "tensor-parallel",
               layout.stages > 1 ? "; " + staged : "");
  }
}

}  // namespace pipeshard::train_cli
