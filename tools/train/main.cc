// train: train an ONNX MLP on NumPy data, in one process or across `mpirun -np N`
// processes (data, pipeline and tensor parallel), exactly as PyTorch would in one, and
// write the trained model back as ONNX. Bad arguments and bad files: one line on
// stderr, exit status 2, nothing written.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "backend/gpu.h"
#include "comm/comm.h"
#include "comm/watchdog.h"
#include "common/host_memory.h"
#include "importer/onnx_writer.h"
#include "runtime/trainer.h"
#include "tools/plot/pictures.h"
#include "tools/plot/plot.h"
#include "tools/train/args.h"
#include "tools/train/check_equivalence.h"
#include "tools/train/loop.h"
#include "tools/train/report.h"
#include "tools/train/run.h"
#include "tools/train/setup.h"
#include "tools/train/stop_signal.h"

namespace {

using namespace pipeshard;
using namespace pipeshard::train_cli;

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
                 "theory (P-1)/(M+P-1) = {:.1f}% for P={}, M={}\n", 100 * b.measured, 100 * b.theoretical,
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
