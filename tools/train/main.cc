// train: train an ONNX MLP on NumPy data, in one process or across `mpirun -np N`
// processes (data, pipeline and tensor parallel), exactly as PyTorch would in one, and
// write the trained model back as ONNX. Bad arguments and bad files: one line on
// stderr, exit status 2, nothing written.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <functional>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/cli.h"
#include "common/host_memory.h"
#include "backend/backend.h"
#include "comm/comm.h"
#include "comm/comm_staged.h"
#include "dataset/dataset.h"
#include "common/fault_injection.h"
#include "backend/gpu.h"
#include "runtime/trainer.h"
#include "tools/train/training_board.h"
#include "comm/watchdog.h"
#include "importer/onnx_importer.h"
#include "importer/onnx_writer.h"
#include "tools/plot/pictures.h"
#include "tools/train/args.h"
#include "tools/plot/plot.h"
#include "tools/train/stop_signal.h"

namespace {

using namespace pipeshard;
using pipeshard::train_cli::Args;
using pipeshard::train_cli::define;
using pipeshard::train_cli::make_config;
using pipeshard::train_cli::precision_of;

int fail(const std::string& message) { return report_bad_input("train", message); }

bool stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

// --check-equivalence K: the requested layout trains K steps; rank 0 also trains the
// same K steps alone on the whole batch, on a backend like the layout's own (`make_backend`: the
// CPU's, or a second one on its GPU in the same precision, so that the check compares
// layouts, not devices), then prints the largest differences. Every rank returns 0 when
// they agree to float rounding (1e-5 relative), 1 otherwise.
int check_equivalence(const Graph& graph, const Dataset& data, const TrainConfig& config, Trainer& distributed,
                      int64_t steps, Communicator& world, const std::function<std::unique_ptr<Backend>()>& make_backend) {
  std::vector<double> losses;
  for (int64_t s = 0; s < steps; ++s) losses.push_back(distributed.step().loss);
  Graph ours = graph;
  distributed.download_parameters(ours);
  double loss_diff = 0, weight_diff = 0;
  const WatchdogSlowPhase solo("the one-process reference run on rank 0");
  if (world.rank() == 0) {
    std::unique_ptr<Backend> backend = make_backend();
    TrainConfig one = config;  // the whole batch at once, as one process would train it
    one.micro_batches = 1;
    one.sync_batchnorm = false;
    auto alone = Trainer::create(graph, data, *backend, one);
    PIPESHARD_CHECK(alone.is_ok(), alone.status().message());
    for (int64_t s = 0; s < steps; ++s) {
      const double want = (*alone)->step().loss;
      loss_diff = std::max(loss_diff, std::fabs(losses[s] - want) / std::max(std::fabs(want), 1e-12));
    }
    Graph reference = graph;
    (*alone)->download_parameters(reference);
    for (size_t p = 0; p < reference.params.size(); ++p) {
      const auto& want = reference.params[p].data;
      float scale = 1.0f;
      for (float v : want) scale = std::max(scale, std::fabs(v));
      for (size_t i = 0; i < want.size(); ++i) {
        weight_diff = std::max(weight_diff, static_cast<double>(std::fabs(ours.params[p].data[i] - want[i]) / scale));
      }
    }
    fmt::print("check-equivalence: {} steps on {} process{} vs 1: largest loss difference {:.2e} (relative), "
               "largest weight difference {:.2e} (relative to each tensor's largest value)\n",
               steps, world.size(), world.size() == 1 ? "" : "es", loss_diff, weight_diff);
  }
  const bool same = world.all_reduce_sum(loss_diff <= 1e-5 && weight_diff <= 1e-5 ? 0.0 : 1.0) == 0.0;
  if (world.rank() == 0) fmt::print("{}\n", same ? "equivalent: the layout computes the one-process training"
                                                    : "NOT equivalent beyond float rounding (1e-5)");
  return same ? 0 : 1;
}

// "peak …: …" from every process's peak of backend memory (decimal byte counts) and
// what rank 0's holds.
std::string peak_memory_line(const std::vector<std::string>& peaks, const std::string& device,
                             const Trainer::Memory& mine) {
  const char* where = device == "cuda" ? "GPU memory held by the backend" : "memory held by the backend";
  std::vector<int64_t> bytes;
  for (const std::string& p : peaks) bytes.push_back(std::stoll(p));
  const Program::Memory& m = mine.program;
  const int64_t other = mine.peak - m.total() - mine.optimizer;
  const std::string parts =
      fmt::format("weights {}, gradients {}, optimizer state {}, activations {}, activation gradients {}, other {}",
                  bytes_text(m.weights), bytes_text(m.gradients), bytes_text(mine.optimizer), bytes_text(m.activations),
                  bytes_text(m.activation_gradients), bytes_text(std::max<int64_t>(other, 0)));
  if (bytes.size() == 1) return fmt::format("peak {}: {} ({})", where, bytes_text(bytes[0]), parts);
  const auto [lo, hi] = std::minmax_element(bytes.begin(), bytes.end());
  return fmt::format("peak {} per process: {} at most (rank {}), {} at least (rank {}); rank 0: {}", where,
                     bytes_text(*hi), hi - bytes.begin(), bytes_text(*lo), lo - bytes.begin(), parts);
}

// How the tensors in the backend's memory travel between processes.
enum class DeviceComm {
  kHost,    // over `groups`: one process, or the CPU backend's host memory
  kStaged,  // through host memory over MPI (comm/comm_staged.h)
  kNccl,    // data and tensor groups over NCCL, the pipeline group staged (--gpu-comm nccl)
};

// What the set-up makes for the training loop. Members are destroyed in the reverse order
// of their declaration, and that order matters: the trainer first (its requests in flight
// and buffers use the device groups and the backend), then the device groups (an NCCL
// communicator waits for its operations on the GPU, orders them after the backend's stream
// and reports failures through its MPI group), then the backend (its stream and memory),
// and the MPI groups last (`world`, in main, outlives them all).
struct Run {
  ProcessLayout layout;
  ProcessGroups groups;
  TrainConfig config;
  std::optional<ImportedModel> model;
  std::optional<Dataset> data, eval;
  int64_t steps_per_epoch = 1;
  std::unique_ptr<Backend> backend;
  // The groups over the backend's memory when it is not host memory (Parallel::device_groups).
  DeviceComm device_comm = DeviceComm::kHost;
  ProcessGroups device_groups;
  std::unique_ptr<Trainer> trainer;
  std::ofstream metrics;
  std::unique_ptr<TrainingBoard> board;
  CrashPoint checkpoint_crash;  // PIPESHARD_FAULT_AT: crash tests only (common/fault_injection.h)
};

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

// --device and --precision, before anything is loaded.
Status check_device(const Args& a) {
  if (a.device == "cpu") {
    if (a.precision != "fp32") {
      return Status::error("--precision " + a.precision + " needs --device cuda: the CPU backend computes in fp32");
    }
    if (a.cuda_graph) {
      return Status::error("--cuda-graph needs --device cuda: the CPU backend has no kernel launches to save");
    }
    if (a.gpu_comm != "staged") {
      return Status::error("--gpu-comm " + a.gpu_comm + " needs --device cuda: the CPU backend's tensors travel over MPI");
    }
    return Status::ok();
  }
  std::string why;
  if (usable_gpus(&why) == 0) return Status::error("--device cuda: no usable GPU (" + why + ")");
  return Status::ok();
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
  PIPESHARD_RETURN_IF_ERROR(check_device(a));
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
  Result<Dataset> data = load_dataset(a.data, a.labels, run.model->graph, targets_of(run.config.loss));
  if (!data) return data.status();
  run.data = std::move(*data);
  if (!a.eval_data.empty()) {
    Result<Dataset> e = load_dataset(a.eval_data, a.eval_labels, run.model->graph, targets_of(run.config.loss));
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

// The ranks of `world` on this machine (those that share its host name), in world order.
// Collective over `world`.
std::unique_ptr<Communicator> split_by_machine(Communicator& world) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const uint64_t color = std::hash<std::string>{}(host) & 0x3fffffff;
  return world.split(static_cast<int>(color), world.rank());
}

// --gpu-comm nccl: NCCL refuses two ranks of one communicator on one GPU, so every process
// needs a GPU of its own, and the NCCL plugin must load. Collective over `world`, and the
// verdict is the same on every rank (sums over the world): NCCL's set-up waits for every
// rank of a group, so if one rank went on without the others it would hang.
Status check_gpu_comm(const Args& a, Communicator& world) {
  if (a.gpu_comm != "nccl" || world.size() == 1) return Status::ok();
  std::unique_ptr<Communicator> machine = split_by_machine(world);
  const int gpus = usable_gpus(nullptr);
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
Status check_memory(const Args& a, Communicator& world, const Run& run) {
  const std::vector<int64_t> per_stage =
      Trainer::memory_per_stage(run.model->graph, run.config, run.layout, *run.backend);
  const int64_t mine = per_stage.empty() ? 0 : per_stage[run.layout.stage];
  std::unique_ptr<Communicator> machine = split_by_machine(world);
  if (a.device == "cuda") {  // the processes that share this one's GPU add up their needs
    const int gpu = local_rank() % std::max(1, usable_gpus(nullptr));
    std::unique_ptr<Communicator> sharing = machine->split(gpu, machine->rank());
    const double on_gpu = sharing->all_reduce_sum(static_cast<double>(mine));
    int64_t free = 0, total = 0;
    if (gpu_memory(gpu, &free, &total) && on_gpu > static_cast<double>(free)) {
      const int ranks = sharing->size();
      return Status::error(fmt::format(
          "training needs about {} on GPU {} ({}; the partitioner's estimate of parameters, gradients, optimizer "
          "state and activations in flight) but it has {} free of {}: use more GPUs (--stages, --tensor-parallel), "
          "a smaller --batch-size or more --micro-batches",
          bytes_text(static_cast<int64_t>(on_gpu)), gpu,
          ranks == 1 ? "one process" : fmt::format("{} processes, {} for this one", ranks, bytes_text(mine)),
          bytes_text(free), bytes_text(total)));
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

// The GPU this process computes on: by design.md, its rank on the machine.
int my_gpu() { return local_rank() % std::max(1, usable_gpus(nullptr)); }

Status create_backend(const Args& a, Run& run) {
  if (a.device == "cuda") {
    Result<std::unique_ptr<Backend>> gpu = make_gpu_backend(my_gpu(), precision_of(a));
    if (!gpu) return gpu.status();
    run.backend = std::move(*gpu);
  } else {
    run.backend = make_cpu_backend();
  }
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
  if (world.size() == 1 || !(a.device == "cuda" || (stage_env != nullptr && std::string(stage_env) == "1"))) return;
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
    run.device_groups.data = make_gpu_nccl_communicator(*run.groups.data, my_gpu(), *run.backend);
  }
  if (run.groups.tensor->size() > 1) {
    run.device_groups.tensor = make_gpu_nccl_communicator(*run.groups.tensor, my_gpu(), *run.backend);
  }
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

// The trainer, which allocates the parameters, gradients, optimizer state and
// activations; then --resume, and the files the run writes as it goes.
Status create_trainer(const Args& a, Communicator& world, Run& run) {
  const Parallel parallel{&world, &run.groups, &*run.model,
                          run.device_comm != DeviceComm::kHost ? &run.device_groups : nullptr};
  Result<std::unique_ptr<Trainer>> trainer = Trainer::create(run.model->graph, *run.data, *run.backend, run.config, parallel);
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

// "step 7: the gradient of 'fc2.weight' (node 'fc2') became inf or NaN first, in backward
// order (loss 2.31)", or "step 7: the loss became nan (...)".
std::string non_finite_message(const StepResult& r) {
  const std::string first = r.first_non_finite.empty() ? "" : "the gradient of " + r.first_non_finite;
  if (!std::isfinite(r.loss)) {
    return fmt::format("step {}: the loss became {}{}", r.step, r.loss,
                       first.empty() ? "" : " (first non-finite gradient in backward order: " + r.first_non_finite + ")");
  }
  return fmt::format("step {}: {} became inf or NaN, the first in backward order (loss {:.4g})", r.step, first, r.loss);
}

const char* signal_name(int signal) { return signal == SIGINT ? "SIGINT" : "SIGTERM"; }

// The end of a run that SIGINT or SIGTERM stopped after `step`: a checkpoint, unless
// this step has just written one, then every rank waits until it is on disk (a rank that
// exits first makes mpirun end the job, rank 0 included). Returns 128 + the signal, as a
// shell reports a process the signal ended: 130 for SIGINT, 143 for SIGTERM.
int stop_on_signal(int signal, int64_t step, int64_t total_steps, bool checkpointed, const Args& a, Run& run,
                   Communicator& world) {
  const bool root = world.rank() == 0;
  const WatchdogSlowPhase slow("checkpoint after a signal");
  if (!a.checkpoint.empty() && !checkpointed) {
    if (Status s = run.trainer->save_checkpoint(a.checkpoint, run.checkpoint_crash); !s) {
      return root ? fail(s.message()) : kExitBadInput;
    }
  }
  if (root) {
    const std::string where = a.checkpoint.empty()
                                  ? "nothing saved (no --checkpoint folder given)"
                                  : fmt::format("checkpoint in {} (continue with --resume {})", a.checkpoint, a.checkpoint);
    fmt::print(stderr, "{}stopped by {} after step {}/{}: {}\n", stderr_is_terminal() ? "\r\x1b[K" : "",
               signal_name(signal), step, total_steps, where);
  }
  world.barrier();
  return 128 + signal;
}

// How the processes exchange the tensors in the backend's memory, said once by rank 0
// before the first step (--check-equivalence included: the tests read it).
void say_how_tensors_travel(const Args& a, const Run& run) {
  const ProcessLayout& layout = run.layout;
  if (run.device_comm == DeviceComm::kStaged) {
    fmt::print(stderr, "note: the {} processes exchange tensors through host memory over MPI (staged: {})\n",
               layout.world_size(),
               a.device == "cuda" ? "any number of processes per GPU; --gpu-comm nccl for one GPU per process"
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

// The whole run, on `world`, into `run` (which main keeps, to decide how it ends). Returns
// the exit status.
int run_training(Communicator* world, Run& run, int argc, char** argv) {
  const bool root = world->rank() == 0;  // writes metrics, checkpoints, the saved model and the log
  CLI::App app{
      "Train an ONNX multilayer perceptron on NumPy data, step for step as PyTorch would, and write the trained\n"
      "model back as ONNX; under mpirun, across processes (data, pipeline and tensor parallel). Examples:\n"
      "  train models/simple_digits.onnx --data data/digits_features.npy --labels data/digits_labels.npy \\\n"
      "        --optimizer adamw --epochs 5 --save trained.onnx\n"
      "  mpirun -np 4 train models/simple_digits.onnx --data ... --labels ... --stages 2 --micro-batches 4",
      "train"};
  Args a;
  define(app, a);
  Status parsed = Status::ok();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return root ? app.exit(e) : 0;
    parsed = Status::error(std::string(e.what()) + " (see train --help)");
  }
  a.lr_given = app.count("--lr") > 0;
  a.momentum_given = app.count("--momentum") > 0;
  a.eps_given = app.count("--eps") > 0;
  a.weight_decay_given = app.count("--weight-decay") > 0;
  // While armed, a rank left waiting on a lost one ends the job.
  const auto arm_watchdog = [&] {
    if (world->size() == 1) return;
    const ProcessLayout& l = run.layout;
    watchdog_arm(a.comm_timeout, "train",
                 fmt::format("rank {} (stage {}, replica {}, shard {})", world->rank(), l.stage, l.replica, l.shard));
  };
  if (!agree_on_set_up(*world, parsed ? set_up(a, *world, run) : parsed)) return kExitBadInput;
  if (!agree_on_set_up(*world, check_gpu_comm(a, *world))) return kExitBadInput;
  if (!agree_on_set_up(*world, create_backend(a, run))) return kExitBadInput;
  if (!agree_on_set_up(*world, check_memory(a, *world, run))) return kExitBadInput;
  // Every rank is here: NCCL's set-up waits on the other ranks of each group, watched as
  // training is. Not create_trainer, where --resume may keep one rank reading for long.
  arm_watchdog();
  make_device_groups(a, *world, run);
  watchdog_disarm();
  if (!agree_on_set_up(*world, create_trainer(a, *world, run))) return kExitBadInput;
  arm_watchdog();  // from here on, for good
  // What only a neighbour can tell: the rank that finds a mismatch says so, and its exit
  // ends the job.
  if (Status s = run.trainer->check_links(); !s) return fail(s.message());
  const ProcessLayout& layout = run.layout;
  TrainConfig& config = run.config;
  Trainer& trainer = *run.trainer;
  const ImportedModel& model = *run.model;
  if (root) say_how_tensors_travel(a, run);
  if (a.check_equivalence > 0) {
    const auto same_kind = [&a]() -> std::unique_ptr<Backend> {
      if (a.device != "cuda") return make_cpu_backend();
      Result<std::unique_ptr<Backend>> gpu = make_gpu_backend(my_gpu(), precision_of(a));
      PIPESHARD_CHECK(gpu.is_ok(), gpu.status().message());  // this process made one already
      return std::move(*gpu);
    };
    return check_equivalence(model.graph, *run.data, config, trainer, a.check_equivalence, *world, same_kind);
  }
  Graph scratch = model.graph;  // host copy for the saved model
  trainer.start_trace(!a.trace.empty());
  const int64_t steps_per_epoch = run.steps_per_epoch;
  const int64_t checkpoint_every = a.checkpoint_every > 0 ? a.checkpoint_every : steps_per_epoch;
  const bool live = root && stderr_is_terminal();
  const bool log = root;
  const int64_t log_every = std::max<int64_t>(1, config.total_steps / 20);
  if (log) {
    std::string how;
    if (layout.replicas > 1) how += fmt::format(", {} data-parallel replicas", layout.replicas);
    if (layout.stages > 1) {
      how += fmt::format(", {} pipeline stages ({}, {} micro-batches)", layout.stages, a.pipeline_schedule,
                         config.micro_batches);
    }
    if (layout.shards > 1) how += fmt::format(", {} tensor-parallel shards", layout.shards);
    fmt::print(stderr, "training {} ({} parameters) on {} samples: {} steps of {} samples, {}{}\n", a.model,
               model.graph.total_parameter_count(), run.data->samples, config.total_steps,
               config.batch_size * config.grad_accum, a.optimizer, how);
    if (config.sync_batchnorm && layout.replicas == 1) {
      fmt::print(stderr, "note: --sync-batchnorm has nothing to synchronise with one data-parallel replica\n");
    }
  }
  std::optional<TrainingCurves> curves;  // --plot: rank 0 collects and draws
  if (!a.plot.empty() && root) {
    curves.emplace(TrainingRun{.model = a.model, .optimizer = a.optimizer, .loss = a.loss,
                               .batch_size = config.batch_size * config.grad_accum, .steps_per_epoch = steps_per_epoch,
                               .replicas = layout.replicas, .stages = layout.stages, .shards = layout.shards,
                               .schedule = a.pipeline_schedule, .micro_batches = config.micro_batches});
  }
  // During training every rank sees the same loss and the same collective results; what
  // goes wrong is said once, by rank 0, and every rank stops with status 2.
  auto stop = [&](const std::string& message) { return root ? fail(message) : kExitBadInput; };
  double epoch_loss = 0;
  int64_t epoch_steps = 0, current_epoch = 0;
  int64_t skipped = 0;  // --on-nonfinite skip
  int64_t overflowed = 0;  // --loss-scale dynamic: steps skipped for a gradient that overflowed under the scale
  constexpr int64_t kSkipsToReport = 10;
  std::optional<StopSignals> signals(std::in_place);  // SIGINT and SIGTERM end the loop after a step
  const auto started = std::chrono::steady_clock::now();
  auto last = started;
  while (trainer.steps_done() < config.total_steps) {
    StepResult r = trainer.step();
    // One all-reduce per step agrees on signals and on gradients that went bad.
    watchdog_activity(r.step, "end of step");
    bool bad_gradients = !r.gradients_finite;  // --on-nonfinite stop: the optimizer's check
    const int signal = signals->agreed(*world, bad_gradients);
    if (bad_gradients) {  // before anything could save the weights this step spoiled
      const std::string first = trainer.first_non_finite_gradient();
      stop(fmt::format("step {}: the gradient of {} became inf or NaN, the first in backward order (loss {:.4g}); "
                       "stopped before saving anything of this step. Lower --lr, clip with --clip-grad-norm, or go on "
                       "past such steps with --on-nonfinite skip", r.step, first, r.loss));
      world->barrier();
      return kExitBadInput;
    }
    const auto now = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(now - last).count();
    last = now;
    const double samples_per_s = config.batch_size * config.grad_accum / std::max(seconds, 1e-9);
    if (r.non_finite) {  // every rank knows: all stop here or skip, after rank 0 has said why
      const std::string what = non_finite_message(r);
      if (config.on_nonfinite == NonFinite::kStop) {
        stop(what + "; nothing of this step was applied. Lower --lr, clip with --clip-grad-norm, or go on past such "
                    "steps with --on-nonfinite skip");
        world->barrier();
        return kExitBadInput;
      }
      if (log && ++skipped <= kSkipsToReport) {
        fmt::print(stderr, "{}{}; step skipped{}\n", live ? "\r\x1b[K" : "", what,
                   skipped == kSkipsToReport ? " (further skips are only counted)" : "");
      }
    }
    if (r.scale_overflow && log && ++overflowed <= kSkipsToReport) {
      fmt::print(stderr, "{}step {}: a gradient overflowed under loss scale {:g}; step skipped, the scale halves to {:g}{}\n",
                 live ? "\r\x1b[K" : "", r.step, r.loss_scale, trainer.loss_scale(),
                 overflowed == kSkipsToReport ? " (further overflows are only counted)" : "");
    } else if (r.scale_overflow) {
      ++overflowed;
    }
    if (run.metrics.is_open()) {
      nlohmann::json row{{"step", r.step}, {"epoch", r.epoch}, {"loss", r.loss}, {"lr", r.lr}, {"samples_per_s", samples_per_s}};
      if (r.non_finite || r.scale_overflow) row["skipped"] = true;
      if (r.loss_scale > 0) row["loss_scale"] = r.loss_scale;
      row["backend_peak_bytes"] = run.backend->memory_use().peak;  // this process's (rank 0's)
      run.metrics << row.dump() << "\n" << std::flush;
    }
    if (run.board) {
      if (Status s = run.board->add_step(trainer, r, samples_per_s); !s) return stop(s.message());
    }
    if (r.epoch != current_epoch) {
      current_epoch = r.epoch;
      epoch_loss = 0;
      epoch_steps = 0;
    }
    if (std::isfinite(r.loss)) {  // a skipped step's NaN would poison the epoch's mean and the plot
      epoch_loss += r.loss;
      if (curves) curves->add_step(r.step, r.loss);
      ++epoch_steps;
    }
    const std::string line = fmt::format("step {}/{}  epoch {}  loss {:.4f}  lr {:.3g}  {:.0f} samples/s", r.step,
                                         config.total_steps, r.epoch, r.loss, r.lr, samples_per_s);
    if (live) {
      fmt::print(stderr, "\r{}\x1b[K", line);
    } else if (log && (r.step % log_every == 0 || r.step == config.total_steps)) {
      fmt::print(stderr, "{}\n", line);
    }
    const bool epoch_end = r.step % steps_per_epoch == 0;
    if (epoch_end && run.eval) {
      const WatchdogSlowPhase slow("evaluation");
      EvalResult e = trainer.evaluate(*run.eval);  // every rank takes part; rank 0 reports
      if (log) fmt::print(stderr, "{}epoch {}: train loss {:.4f}  eval loss {:.4f}{}\n", live ? "\r\x1b[K" : "", r.epoch,
                 epoch_loss / epoch_steps, e.loss,
                 e.accuracy >= 0 ? fmt::format("  eval accuracy {:.1f}%", 100 * e.accuracy) : "");
      if (run.board) {
        if (Status s = run.board->add_eval(r.step, e); !s) return stop(s.message());
      }
      if (curves) curves->add_eval(r.epoch, r.step, e.loss, e.accuracy);
    }
    const bool checkpointed = !a.checkpoint.empty() && (r.step % checkpoint_every == 0 || r.step == config.total_steps);
    if (checkpointed) {
      const WatchdogSlowPhase slow("checkpoint");
      if (Status s = trainer.save_checkpoint(a.checkpoint, run.checkpoint_crash); !s) return stop(s.message());
    }
    if (signal != 0) {
      return stop_on_signal(signal, r.step, config.total_steps, checkpointed, a, run, *world);
    }
  }
  signals.reset();  // from here on, a signal ends the process at once
  if (live) fmt::print(stderr, "\n");
  // Every process's peak of backend memory, to rank 0 (collective).
  const std::vector<std::string> peaks = world->gather_text(std::to_string(run.backend->memory_use().peak), 0);
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (log) {
    std::vector<std::string> skips;
    if (skipped > 0) skips.push_back(fmt::format("{} skipped: loss or gradients not finite", skipped));
    if (overflowed > 0) {
      skips.push_back(fmt::format("{} skipped: gradients overflowed under the loss scale, now {:g}", overflowed,
                                  trainer.loss_scale()));
    }
    fmt::print(stderr, "done: {} steps{} in {:.2f} s\n", config.total_steps,
               skips.empty() ? "" : " (" + fmt::format("{}", fmt::join(skips, "; ")) + ")", total);
    if (config.cuda_graph) {
      fmt::print(stderr, "cuda graph: after this process's first step, forward and backward ran from {} recordings\n",
                 trainer.recordings());
    }
    fmt::print(stderr, "{}\n", peak_memory_line(peaks, a.device, trainer.memory()));
  }
  const WatchdogSlowPhase slow("writing results");  // rank 0 writes, the others wait
  // The trained model first: what follows only describes the run.
  if (!a.save.empty()) {
    trainer.download_parameters(scratch);  // gathers every stage and shard on rank 0
    if (root) {
      if (Status s = write_trained_model(model, scratch, a.save); !s) return fail(s.message());
      fmt::print(stderr, "wrote {}\n", a.save);
    }
  }
  if (layout.stages > 1) {
    const Trainer::Bubble b = trainer.pipeline_bubble();
    if (log) {
      fmt::print(stderr, "pipeline bubble: stages idle {:.1f}% of the schedule's time (measured, transfers included); "
                 "theory {} = {:.1f}% for P={}, M={}\n", 100 * b.measured, b.formula, 100 * b.theoretical,
                 layout.stages, config.micro_batches);
    }
    if (run.board) {
      if (Status s = run.board->add_bubble(config.total_steps, b); !s) return stop(s.message());
    }
  }
  if (!a.trace.empty()) {
    if (Status s = trainer.write_trace(a.trace); !s) return stop(s.message());
    if (root) fmt::print(stderr, "wrote {} (open it in https://ui.perfetto.dev or chrome://tracing)\n", a.trace);
  }
  if (curves) {
    if (Status s = draw_picture(curves->data(), a.plot); !s) return fail("--plot: " + s.message());
    fmt::print(stderr, "wrote {}\n", a.plot);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Ranks: one process, or mpirun -np N with N = stages × replicas × shards. The world
  // comes first so that errors, --help included, are printed once, by rank 0; the run
  // after it, so that the run's groups are destroyed before the world.
  std::unique_ptr<Communicator> world = make_world_communicator();
  Run run;
  const int status = run_training(world.get(), run, argc, argv);
  if (status != 0) abandon_nccl(run);
  return status;
}
