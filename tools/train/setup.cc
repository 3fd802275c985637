// Everything before train's first step (tools/train/setup.h).
#include "tools/train/setup.h"

#include <algorithm>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "backend/registry.h"
#include "comm/device_groups.h"
#include "comm/watchdog.h"
#include "common/atomic_file.h"
#include "common/host_memory.h"
#include "schedule/action.h"
#include "tools/plot/plot.h"
#include "tools/train/memory_check.h"

namespace pipeshard::train_cli {
namespace {

// A file a flag will write at the end of the run: its folder must exist, take new files
// (the file system says, with its reason: a read-only folder, a read-only mount), and it
// must not be a folder itself. Checked before any work, so a typo or a read-only folder
// never costs a finished run.
Status check_output_file(const std::string& flag, const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(path), folder = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (fs::is_directory(p, ec)) return Status::error(flag + " '" + path + "' is a folder; give a file name");
  if (!fs::is_directory(folder, ec))
    return Status::error(flag + " '" + path + "': no folder '" + folder.string() + "'");
  return check_writable_folder(folder.string()).with_context(flag + " '" + path + "'");
}

// A layout the job's processes do not fit. Alone (no mpirun, or -np 1), the library's
// "mpirun started 1 process, which do not divide…" misleads: say how to launch it.
Status layout_error(const Args& a, int processes, const Status& s) {
  const int64_t per_replica = int64_t{a.stages} * a.tensor_parallel;
  if (processes != 1 || per_replica <= 1) return s;
  std::string flags = a.stages > 1 ? "--stages " + std::to_string(a.stages) : "";
  if (a.tensor_parallel > 1)
    flags += (flags.empty() ? "" : " ") + ("--tensor-parallel " + std::to_string(a.tensor_parallel));
  const std::string n = std::to_string(per_replica);
  return Status::error(flags + " needs " + n + " processes (one per pipeline stage and tensor-parallel shard), and " +
                       "train runs alone: run it as `mpirun -np " + n + " train …` (or a multiple of " + n +
                       " processes, for data-parallel replicas)");
}

// --device, --precision, --cuda-graph and --gpu-comm, before anything is loaded: what
// the registries say the --device row and the --gpu-comm kind do.
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
  const DeviceGroupKind& groups = *find_device_groups(a.gpu_comm);  // the flag takes only the registry's names
  if (!groups.carries_memory(device.memory)) {
    const std::string where =
        backend_names_where([&](const BackendKind& k) { return groups.carries_memory(k.memory); });
    return Status::error("--gpu-comm " + a.gpu_comm + " needs --device " + where + ": " + device.title +
                         "'s tensors travel over MPI");
  }
  return check_usable(device).with_context("--device " + a.device);
}

// The flags that no parser checks, and the files the run will write, before any work.
Status check_flags(const Args& a, bool root, Run& run) {
  run.device = find_backend(a.device);
  PIPESHARD_CHECK(run.device != nullptr, "--device " + a.device + ": the flag takes only the registry's names");
  PIPESHARD_RETURN_IF_ERROR(check_device(a, *run.device));
  if (a.eval_data.empty() != a.eval_labels.empty()) return Status::error("--eval-data and --eval-labels go together");
  if (!a.save.empty()) PIPESHARD_RETURN_IF_ERROR(check_output_file("--save", a.save));
  if (!a.trace.empty()) PIPESHARD_RETURN_IF_ERROR(check_output_file("--trace", a.trace));
  if (!a.checkpoint.empty()) {  // the first checkpoint comes after work: its folder must take files now
    PIPESHARD_RETURN_IF_ERROR(check_creatable_folder(a.checkpoint).with_context("--checkpoint"));
  }
  if (!a.plot.empty() && root) {  // a plot that cannot be drawn is a bad flag
    if (Status s = check_picture_output(a.plot); !s) return Status::error("--plot: " + s.message());
  }
  Result<TrainConfig> config = make_config(a);
  if (!config) return config.status();
  run.config = *config;
  if (!(a.comm_timeout >= 0) || a.comm_timeout > 1e7)
    return Status::error("--comm-timeout must be 0 or a number of seconds");
  return Status::ok();
}

// The injected faults (tests only), the model and the data, and the run's length. A model
// or data set the caller has put in `run` already (the Python module's, from memory) is
// taken as it is; the others are read from the files the flags name.
Status load_inputs(const Args& a, int world_rank, Run& run) {
  Result<InjectedFaults> faults = faults_from_environment();
  if (!faults) return faults.status();
  run.checkpoint_crash = faults->checkpoint;
  set_training_fault(*faults, world_rank);
  if (!run.model) {
    Result<ImportedModel> model = import_onnx_file(a.model);
    if (!model) return model.status();
    run.model = std::move(*model);
  }
  const Targets targets = targets_of(run.config.loss);
  Result<Dataset> data =
      run.data_arrays ? dataset_of_views(run.data_arrays->features, run.data_arrays->labels, run.model->graph, targets)
                      : load_dataset(a.data, a.labels, run.model->graph, targets);
  if (!data) return data.status();
  run.data = std::move(*data);
  if (!a.eval_data.empty()) {
    Result<Dataset> e = run.eval_arrays ? dataset_of_views(run.eval_arrays->features, run.eval_arrays->labels,
                                                           run.model->graph, targets)
                                        : load_dataset(a.eval_data, a.eval_labels, run.model->graph, targets);
    if (!e) return e.status();
    run.eval = std::move(*e);
  }
  // The trainer's own check of the configuration, now that the model and data are known:
  // before anything is allocated, and in the flags' words.
  if (Status s = check_train_config(run.config, run.layout, run.model->graph, run.data->samples); !s) {
    return Status::error(train_cli::flag_message(s));
  }
  const int64_t batches_per_epoch = run.data->samples / run.config.batch_size;
  run.steps_per_epoch = std::max<int64_t>(1, batches_per_epoch / run.config.grad_accum);
  run.config.total_steps = a.steps > 0 ? a.steps : std::max<int64_t>(a.epochs, 1) * run.steps_per_epoch;
  return Status::ok();
}

// Everything before the first step that needs no backend. Every rank runs it and stops at
// its first error. The one collective inside, splitting the world into groups, comes right
// after the layout, which the flags alone decide: every rank reaches it or none does.
Status set_up(const Args& a, Communicator& world, Run& run) {
  Result<ProcessLayout> layout = ProcessLayout::for_rank(world.rank(), world.size(), a.stages, a.tensor_parallel);
  if (!layout) return layout_error(a, world.size(), layout.status());
  run.layout = *layout;
  run.groups = make_process_groups(world, run.layout);
  PIPESHARD_RETURN_IF_ERROR(check_flags(a, world.rank() == 0, run));
  return load_inputs(a, world.rank(), run);
}

// The device groups the run will use can be made here: they load (NCCL's plugin), and
// where they need a device per process, every machine has one for each of its processes.
// Collective over `world`, and the verdict is the same on every rank (sums over the world):
// NCCL's set-up waits for every rank of a group, so if one rank went on without the others
// it would hang.
Status check_device_groups(const Args& a, Communicator& world, const Run& run) {
  const DeviceGroupKind& kind = choose_device_groups(*run.device, world.size(), a.gpu_comm);
  const Crowding crowding = kind.one_process_per_device ? crowded_machines(world, *run.device) : Crowding{};
  if (Status s = kind.available(); !s) return s.with_context("--gpu-comm " + a.gpu_comm);
  if (crowding.machines == 0) return Status::ok();
  const int machines = crowding.machines, devices = crowding.devices;
  const char* noun = run.device->device_noun;
  return Status::error(fmt::format(
      "--gpu-comm {} needs a {} for each process ({}), but {} machine{} run{} {} processes on {} {}{}: use --gpu-comm "
      "staged (the default), which lets processes share a {}",
      kind.name, noun, kind.why_one_process_per_device, machines, machines == 1 ? "" : "s", machines == 1 ? "s" : "",
      crowding.processes, devices, noun, devices == 1 ? "" : "s", noun));
}

Status create_backend(const Args& a, Run& run) {
  Result<std::unique_ptr<Backend>> backend = make_backend_like_this_one(a, run);
  if (!backend) return backend.status().with_context("--device " + a.device);
  run.backend = std::move(*backend);
  return Status::ok();
}

// The trainer, which allocates the parameters, gradients, optimizer state and
// activations; then --resume, and the files the run writes as it goes.
Status create_trainer(const Args& a, Communicator& world, Run& run) {
  const Parallel parallel{&world, &run.groups, &*run.model, run.device_groups.for_trainer()};
  Result<std::unique_ptr<Trainer>> trainer =
      Trainer::create(run.model->graph, *run.data, *run.backend, run.config, parallel);
  if (!trainer) return Status::error(train_cli::flag_message(trainer.status()));
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
bool agree_on_set_up(Communicator& world, const Run& run, const Status& mine) {
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
      run.say_bad_input(message);
      continue;
    }
    std::string who = ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size(); ++i) who += (i ? ", " : "") + std::to_string(ranks[i]);
    run.say_bad_input(who + ": " + message);
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
               fmt::format("rank {} (stage {}, replica {}, shard {})", world.rank(), l.stage, l.replica, l.shard),
               "--comm-timeout sets the limit");
}

}  // namespace

Result<std::unique_ptr<Backend>> make_backend_like_this_one(const Args& a, const Run& run) {
  return make_backend(a.device, {.device = device_of_this_process(*run.device), .precision = precision_of(a)});
}

bool set_up_run(const Args& a, const Status& parsed, Communicator& world, Run& run) {
  if (!agree_on_set_up(world, run, parsed ? set_up(a, world, run) : parsed)) return false;
  if (!agree_on_set_up(world, run, check_device_groups(a, world, run))) return false;
  if (!agree_on_set_up(world, run, create_backend(a, run))) return false;
  if (!agree_on_set_up(world, run, check_memory(world, run))) return false;
  // Every rank is here: NCCL's set-up waits on the other ranks of each group, watched as
  // training is. Not create_trainer, where --resume may keep one rank reading for long.
  arm_watchdog(a, world, run.layout);
  run.device_groups = make_device_groups(choose_device_groups(*run.device, world.size(), a.gpu_comm), run.groups,
                                         *run.backend, device_of_this_process(*run.device));
  watchdog_disarm();
  if (!agree_on_set_up(world, run, create_trainer(a, world, run))) return false;
  arm_watchdog(a, world, run.layout);  // from here on, for good
  return true;
}

// How the processes exchange the tensors in the backend's memory, said once by rank 0
// before the first step (--check-equivalence included: the tests read it).
void say_how_tensors_travel(const Run& run) {
  const ProcessLayout& layout = run.layout;
  const std::string kind = run.device_groups.kind().name;
  if (kind == "staged") {
    fmt::print(stderr, "note: the {} processes exchange tensors through host memory over MPI (staged: {})\n",
               layout.world_size(),
               run.device->memory == BackendMemory::kDevice
                   ? fmt::format("any number of processes per {0}; --gpu-comm nccl for one {0} per process",
                                 run.device->device_noun)
                   : "PIPESHARD_STAGE_COMM=1");
  } else if (kind == "nccl") {
    const bool d = layout.replicas > 1, t = layout.shards > 1;
    const std::string staged = "pipeline stages exchange their tensors through host memory over MPI (staged)";
    if (!d && !t) {
      fmt::print(stderr, "note: --gpu-comm nccl has no data-parallel or tensor-parallel group here; the {} {}\n",
                 layout.world_size(), staged);
      return;
    }
    fmt::print(stderr,
               "note: the {} processes exchange tensors over NCCL in their {} groups (--gpu-comm nccl, not "
               "yet verified on a multi-GPU machine){}\n",
               layout.world_size(),
               d && t ? "data-parallel and tensor-parallel"
               : d    ? "data-parallel"
                      : "tensor-parallel",
               layout.stages > 1 ? "; " + staged : "");
  }
}

void say_how_zero_shards(const Run& run) {
  if (run.config.zero == 0) return;
  const int replicas = run.layout.replicas;
  if (replicas == 1) {
    fmt::print(stderr, "note: --zero {} has nothing to shard with one data-parallel replica\n", run.config.zero);
    return;
  }
  const int stage = run.trainer->zero_stage();
  if (run.config.zero == 2 && stage == 1) {
    const bool chunks = run.trainer->schedule().chunks() > run.layout.stages;
    const bool split = splits_backward(run.trainer->schedule().actions[run.layout.stage]);
    if (chunks || split) {
      fmt::print(stderr,
                 "note: --zero 2 runs as stage 1 here: schedule '{}' {}, so each stage keeps its whole gradient "
                 "buffer until the step's last pass; stage 2 needs every backward pass whole, in one chunk\n",
                 run.config.pipeline_schedule,
                 chunks ? "places several model chunks on a stage" : "splits backward into I and W passes");
    } else {
      fmt::print(stderr,
                 "note: --zero 2 runs as stage 1 here: the gradient buckets are so few and large that their windows "
                 "and the reduced slices would hold as much as the whole gradient buffer; a smaller --bucket-mb "
                 "(now {:g}) lets stage 2 save\n",
                 static_cast<double>(run.config.bucket_bytes) / (1 << 20));
    }
  }
  const Trainer::Memory m = run.trainer->memory();
  if (m.optimizer == 0 && stage < 2) {
    fmt::print(stderr,
               "note: --zero {} saves nothing here: {} without momentum keeps no optimizer state, and the gradients "
               "are reduce-scattered and the weights all-gathered all the same\n",
               run.config.zero, "SGD");
    return;
  }
  fmt::print(stderr,
             "note: ZeRO stage {}: each of the {} data-parallel replicas holds the optimizer state{} of 1/{} of the "
             "parameters (rank 0: optimizer state {}, gradients {})\n",
             stage, replicas, stage == 2 ? " and reduced gradients" : "", replicas, bytes_text(m.optimizer),
             bytes_text(m.program.gradients));
  const int64_t passes = run.config.micro_batches * run.config.grad_accum;
  if (stage == 2 && passes > 1) {
    fmt::print(stderr,
               "note: ZeRO stage 2 reduces each of the {} backward passes of a step as it ends (the gradients never "
               "exist whole), so it sends {} times the gradient traffic of --zero 1\n",
               passes, passes);
  }
}

void say_how_batchnorm_normalises(const Run& run) {
  const Graph& g = run.model->graph;
  const bool batchnorm =
      std::any_of(g.nodes.begin(), g.nodes.end(), [](const Node& n) { return n.kind == OpKind::kBatchNorm; });
  const int replicas = run.layout.replicas;
  if (run.config.sync_batchnorm && !batchnorm) {
    fmt::print(stderr, "note: --sync-batchnorm has no effect: the model has no BatchNorm\n");
  } else if (run.config.sync_batchnorm && replicas == 1) {
    fmt::print(stderr, "note: --sync-batchnorm has nothing to synchronise with one data-parallel replica\n");
  } else if (batchnorm && !run.config.sync_batchnorm && replicas > 1) {
    fmt::print(stderr,
               "note: BatchNorm statistics are per replica: each of the {} data-parallel replicas normalises its own "
               "{} of the batch's {} samples (PyTorch DDP's default too), so the run differs from one process; "
               "--sync-batchnorm takes them over the whole batch and makes it equal to one process\n",
               replicas, run.config.batch_size / replicas, run.config.batch_size);
  }
}

}  // namespace pipeshard::train_cli
