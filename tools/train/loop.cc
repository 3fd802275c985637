// train's step loop (tools/train/loop.h).
#include "tools/train/loop.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "comm/watchdog.h"
#include "program/optimizer.h"
#include "tools/train/stop_signal.h"

namespace pipeshard::train_cli {
namespace {

constexpr int64_t kSkipsToReport = 10;  // skipped steps said one by one; the rest only counted

// Taken as the process starts (static initialisation, after the dynamic loader): the zero
// of the metrics' elapsed_s.
const std::chrono::steady_clock::time_point process_start = std::chrono::steady_clock::now();

// "step 7: the gradient of 'fc2.weight' (node 'fc2') became inf or NaN first, in backward
// order (loss 2.31)", or "step 7: the loss became nan (...)".
std::string non_finite_message(const StepResult& r) {
  const std::string first = r.first_non_finite.empty() ? "" : "the gradient of " + r.first_non_finite;
  if (!std::isfinite(r.loss)) {
    return fmt::format(
        "step {}: the loss became {}{}", r.step, std::isnan(r.loss) ? std::fabs(r.loss) : r.loss,  // nan, never -nan
        first.empty() ? "" : " (first non-finite gradient in backward order: " + r.first_non_finite + ")");
  }
  return fmt::format("step {}: {} became inf or NaN, the first in backward order (loss {:.4g})", r.step, first, r.loss);
}

const char* signal_name(int signal) { return signal == SIGINT ? "SIGINT" : "SIGTERM"; }

// The end of a run that SIGINT or SIGTERM (`signal`), or the caller's Run::on_step
// (`signal` 0), stopped after `step`: a checkpoint, unless this step has just written one,
// then every rank waits until it is on disk (a rank that exits first makes mpirun end the
// job, rank 0 included). Returns 128 + the signal, as a shell reports a process the signal
// ended (130 for SIGINT, 143 for SIGTERM), or kExitStoppedByCaller. Rank 0 says where it
// stopped, unless the caller asked for silence (Run::log) and stopped it itself.
int stop_early(int signal, int64_t step, int64_t total_steps, bool checkpointed, const Args& a, Run& run,
               Communicator& world) {
  const bool root = world.rank() == 0;
  const WatchdogSlowPhase slow(signal != 0 ? "checkpoint after a signal" : "checkpoint after the caller stopped");
  if (!a.checkpoint.empty() && !checkpointed) {
    // Rank 0 writes; a failure is its alone, and the others wait here for it either way.
    if (Status s = run.trainer->save_checkpoint(a.checkpoint, run.checkpoint_crash); !s) {
      run.say_bad_input(s.message());
      world.barrier();
      return kExitBadInput;
    }
  }
  if (root && (signal != 0 || run.log)) {
    const std::string where =
        a.checkpoint.empty() ? "nothing saved (no --checkpoint folder given)"
                             : fmt::format("checkpoint in {} (continue with --resume {})", a.checkpoint, a.checkpoint);
    fmt::print(stderr, "{}stopped by {} after step {}/{}: {}\n", stderr_is_terminal() ? "\r\x1b[K" : "",
               signal != 0 ? signal_name(signal) : "the caller", step, total_steps, where);
  }
  world.barrier();
  return signal != 0 ? 128 + signal : kExitStoppedByCaller;
}

// "training MODEL (N parameters) on S samples: …".
void say_what_trains(const Args& a, const Run& run) {
  const ProcessLayout& layout = run.layout;
  const TrainConfig& config = run.config;
  std::string how;
  if (layout.replicas > 1) how += fmt::format(", {} data-parallel replicas", layout.replicas);
  if (layout.stages > 1) {
    const int chunks = run.trainer ? run.trainer->schedule().chunks() / layout.stages : 1;
    how += fmt::format(", {} pipeline stages ({}{}, {} micro-batch{})", layout.stages, a.pipeline_schedule,
                       chunks > 1 ? fmt::format(", {} chunks each", chunks) : "", config.micro_batches,
                       config.micro_batches == 1 ? "" : "es");
  }
  if (layout.shards > 1) how += fmt::format(", {} tensor-parallel shards", layout.shards);
  fmt::print(stderr, "training {} ({} parameters) on {} samples: {} step{} of {} samples, {}{}\n", a.model,
             run.model->graph.total_parameter_count(), run.data->samples, config.total_steps,
             config.total_steps == 1 ? "" : "s", config.batch_size * config.grad_accum, a.optimizer, how);
}

// The loop, one step at a time. During training every rank sees the same loss and the
// same collective results; what goes wrong is said once, by rank 0, and every rank stops
// with status 2.
class StepLoop {
 public:
  StepLoop(const Args& a, Run& run, Communicator& world)
      : a_(a), run_(run), world_(world), trainer_(*run.trainer), config_(run.config), root_(world.rank() == 0),
        live_(root_ && run.log && stderr_is_terminal()), log_(root_ && run.log),
        log_every_(std::max<int64_t>(1, config_.total_steps / 20)),
        checkpoint_every_(a.checkpoint_every > 0 ? a.checkpoint_every : run.steps_per_epoch) {}

  LoopOutcome run() {
    trainer_.start_trace(!a_.trace.empty());
    if (log_) say_what_trains(a_, run_);
    if (!a_.plot.empty() && root_) {  // --plot: rank 0 collects and draws
      const ProcessLayout& l = run_.layout;
      out_.curves.emplace(TrainingRun{.model = a_.model,
                                      .optimizer = a_.optimizer,
                                      .loss = a_.loss,
                                      .batch_size = config_.batch_size * config_.grad_accum,
                                      .steps_per_epoch = run_.steps_per_epoch,
                                      .replicas = l.replicas,
                                      .stages = l.stages,
                                      .shards = l.shards,
                                      .schedule = a_.pipeline_schedule,
                                      .micro_batches = config_.micro_batches});
    }
    std::optional<StopSignals> signals(std::in_place);  // SIGINT and SIGTERM end the loop after a step
    out_.started = last_ = std::chrono::steady_clock::now();
    while (trainer_.steps_done() < config_.total_steps && !out_.exit) out_.exit = step(*signals);
    // A TensorBoard row of the last step that rank 0 could not write: no step after it tells the others.
    if (!out_.exit && world_.size() > 1 && world_.all_reduce_sum(write_error_.empty() ? 0.0 : 1.0) > 0) {
      out_.exit = stop_for_write_error();
    }
    signals.reset();  // from here on, a signal ends the process at once
    if (live_ && !out_.exit) fmt::print(stderr, "\n");
    return std::move(out_);
  }

 private:
  int stop(const std::string& message) const {
    if (root_) run_.say_bad_input(message);
    return kExitBadInput;
  }

  // One step and all that follows it; the exit status when the run ends here.
  std::optional<int> step(const StopSignals& signals) {
    StepResult r = trainer_.step();
    // A skipped step used no learning rate, and the trainer leaves it 0; the metrics, the
    // progress line and TensorBoard show the schedule's for it, as for the steps around it.
    if (r.non_finite || r.scale_overflow) {
      r.lr = config_.optimizer.lr * lr_factor(config_.schedule, r.step, config_.warmup_steps, config_.total_steps);
    }
    // One all-reduce per step agrees on signals and on gradients that went bad.
    watchdog_activity(r.step, "end of step");
    bool bad_gradients = !r.gradients_finite;   // --on-nonfinite stop: the optimizer's check
    bool bad_data = !r.bad_data.empty();        // a row of data too big to check at load
    bool caller_stop = caller_stop_;            // the previous step's on_step asked to stop
    bool write_failed = !write_error_.empty();  // rank 0 could not write a TensorBoard row
    const int signal = signals.agreed(world_, {&bad_gradients, &bad_data, &caller_stop, &write_failed});
    if (write_failed) return stop_for_write_error();
    if (bad_data) return stop_for_bad_data(r.bad_data, r.step);
    if (bad_gradients) {  // before anything could save the weights this step spoiled
      const std::string first = trainer_.first_non_finite_gradient();
      stop(
          fmt::format("step {}: the gradient of {} became inf or NaN, the first in backward order (loss {:.4g}); "
                      "stopped before saving anything of this step. Lower --lr, clip with --clip-grad-norm, or go on "
                      "past such steps with --on-nonfinite skip",
                      r.step, first, r.loss));
      world_.barrier();
      return kExitBadInput;
    }
    const auto now = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(now - last_).count();
    last_ = now;
    out_.step_seconds.push_back(seconds);
    const double samples_per_s = config_.batch_size * config_.grad_accum / std::max(seconds, 1e-9);
    if (std::optional<int> exit = skip_if_non_finite(r)) return exit;
    say_overflow(r);
    write_metrics(r, samples_per_s);
    if (run_.on_step && root_) {
      const bool go_on = run_.on_step({.step = r.step,
                                       .epoch = r.epoch,
                                       .total_steps = config_.total_steps,
                                       .loss = r.loss,
                                       .lr = r.lr,
                                       .samples_per_s = samples_per_s,
                                       .skipped = r.non_finite || r.scale_overflow});
      if (!go_on) {
        caller_stop_ = true;
        // Alone it stops after this step; otherwise after the next, whose all-reduce tells the others.
        if (world_.size() == 1) caller_stop = true;
      }
    }
    if (run_.board) {
      if (Status s = run_.board->add_step(trainer_, r, samples_per_s); !s) {
        if (std::optional<int> exit = note_write_error(s)) return exit;
      }
    }
    add_to_epoch(r);
    say_progress(r, samples_per_s);
    if (std::optional<int> exit = evaluate_at_epoch_end(r)) return exit;
    const bool checkpointed =
        !a_.checkpoint.empty() && (r.step % checkpoint_every_ == 0 || r.step == config_.total_steps);
    if (checkpointed) {
      const WatchdogSlowPhase slow("checkpoint");
      // Every rank is here, and only rank 0 writes: they agree on how it went at once.
      const Status s = trainer_.save_checkpoint(a_.checkpoint, run_.checkpoint_crash);
      if (!s) write_error_ = s.message();
      const bool failed = world_.size() > 1 ? world_.all_reduce_sum(s ? 0.0 : 1.0) > 0 : !s;
      if (failed) return stop_for_write_error();
    }
    if (signal != 0 || caller_stop) {
      return stop_early(signal, r.step, config_.total_steps, checkpointed, a_, run_, world_);
    }
    return std::nullopt;
  }

  // A file only rank 0 writes (TensorBoard's) could not be written: alone, the run stops
  // now; under MPI rank 0 keeps the message and the next step's all-reduce (or the one
  // after the last step) stops every rank, where a return of rank 0's alone would leave
  // the others waiting on it.
  std::optional<int> note_write_error(const Status& s) {
    if (write_error_.empty()) write_error_ = s.message();
    if (world_.size() == 1) return stop_for_write_error();
    return std::nullopt;
  }
  int stop_for_write_error() {
    stop(write_error_);  // rank 0's
    world_.barrier();
    return kExitBadInput;
  }

  // A batch read a bad row (data checked as it is read, kCheckAtLoadBytes): rank 0 says
  // the first rank's message, and every rank stops before anything of this step is kept.
  int stop_for_bad_data(const std::string& mine, int64_t step) {
    const std::vector<std::string> all = world_.size() > 1 ? world_.gather_text(mine, 0) : std::vector{mine};
    const auto first = std::find_if(all.begin(), all.end(), [](const std::string& m) { return !m.empty(); });
    stop(fmt::format("step {}: {}; stopped before saving anything of this step", step,
                     first == all.end() ? mine : *first));
    world_.barrier();
    return kExitBadInput;
  }

  // A step whose loss or gradients were not finite: every rank knows, and all stop here or
  // skip it, after rank 0 has said why.
  std::optional<int> skip_if_non_finite(const StepResult& r) {
    if (!r.non_finite) return std::nullopt;
    const std::string what = non_finite_message(r);
    if (config_.on_nonfinite == NonFinite::kStop) {
      stop(what +
           "; nothing of this step was applied. Lower --lr, clip with --clip-grad-norm, or go on past such "
           "steps with --on-nonfinite skip");
      world_.barrier();
      return kExitBadInput;
    }
    if (log_ && ++out_.skipped <= kSkipsToReport) {
      fmt::print(stderr, "{}{}; step skipped{}\n", live_ ? "\r\x1b[K" : "", what,
                 out_.skipped == kSkipsToReport ? " (further skips are only counted)" : "");
    }
    return std::nullopt;
  }

  // --loss-scale dynamic skipped the step: a gradient overflowed under the scale.
  void say_overflow(const StepResult& r) {
    if (r.scale_overflow && log_ && ++out_.overflowed <= kSkipsToReport) {
      fmt::print(stderr,
                 "{}step {}: a gradient overflowed under loss scale {:g}; step skipped, the scale halves to {:g}{}\n",
                 live_ ? "\r\x1b[K" : "", r.step, r.loss_scale, trainer_.loss_scale(),
                 out_.overflowed == kSkipsToReport ? " (further overflows are only counted)" : "");
    } else if (r.scale_overflow) {
      ++out_.overflowed;
    }
  }

  void write_metrics(const StepResult& r, double samples_per_s) {
    if (!run_.metrics.is_open()) return;
    nlohmann::json row{
        {"step", r.step},
        {"epoch", r.epoch},
        {"loss", r.loss},
        {"lr", r.lr},
        {"samples_per_s", samples_per_s},
        {"elapsed_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - process_start).count()}};
    if (r.non_finite || r.scale_overflow) row["skipped"] = true;
    if (r.loss_scale > 0) row["loss_scale"] = r.loss_scale;
    row["backend_peak_bytes"] = run_.backend->memory_use().peak;  // this process's (rank 0's)
    run_.metrics << row.dump() << "\n" << std::flush;
  }

  void add_to_epoch(const StepResult& r) {
    if (r.epoch != current_epoch_) {
      current_epoch_ = r.epoch;
      epoch_loss_ = 0;
      epoch_steps_ = 0;
    }
    if (std::isfinite(r.loss)) {  // a skipped step's NaN would poison the epoch's mean and the plot
      epoch_loss_ += r.loss;
      if (out_.curves) out_.curves->add_step(r.step, r.loss);
      ++epoch_steps_;
    }
  }

  void say_progress(const StepResult& r, double samples_per_s) const {
    const std::string line = fmt::format("step {}/{}  epoch {}  loss {:.4f}  lr {:.3g}  {:.0f} samples/s", r.step,
                                         config_.total_steps, r.epoch, r.loss, r.lr, samples_per_s);
    if (live_) {
      fmt::print(stderr, "\r{}\x1b[K", line);
    } else if (log_ && (r.step % log_every_ == 0 || r.step == config_.total_steps)) {
      fmt::print(stderr, "{}\n", line);
    }
  }

  // --eval-data after the last step of each epoch. Every rank takes part; rank 0 reports.
  std::optional<int> evaluate_at_epoch_end(const StepResult& r) {
    if (r.step % run_.steps_per_epoch != 0 || !run_.eval) return std::nullopt;
    const WatchdogSlowPhase slow("evaluation");
    EvalResult e = trainer_.evaluate(*run_.eval);
    // Evaluation data too big to check at load is checked as rank 0 reads it.
    if (!run_.eval->features.checked() || !run_.eval->targets.checked()) {
      bool bad = !e.bad_data.empty();
      if (world_.size() > 1) bad = world_.all_reduce_sum(bad ? 1.0 : 0.0) > 0;
      if (bad) {
        stop("evaluation after step " + std::to_string(r.step) + ": " + e.bad_data);
        world_.barrier();
        return kExitBadInput;
      }
    }
    if (log_) {
      fmt::print(stderr, "{}epoch {}: train loss {:.4f}  eval loss {:.4f}{}\n", live_ ? "\r\x1b[K" : "", r.epoch,
                 epoch_loss_ / epoch_steps_, e.loss,
                 e.accuracy >= 0 ? fmt::format("  eval accuracy {:.1f}%", 100 * e.accuracy) : "");
    }
    if (run_.board) {
      if (Status s = run_.board->add_eval(r.step, e); !s) {
        if (std::optional<int> exit = note_write_error(s)) return exit;
      }
    }
    if (out_.curves) out_.curves->add_eval(r.epoch, r.step, e.loss, e.accuracy);
    if (run_.on_eval && root_) {
      run_.on_eval({.epoch = r.epoch,
                    .step = r.step,
                    .train_loss = epoch_loss_ / epoch_steps_,
                    .loss = e.loss,
                    .accuracy = e.accuracy});
    }
    return std::nullopt;
  }

  const Args& a_;
  Run& run_;
  Communicator& world_;
  Trainer& trainer_;
  const TrainConfig& config_;
  const bool root_;  // writes metrics, checkpoints and the log
  const bool live_;  // a progress line on a terminal, rewritten each step
  const bool log_;
  const int64_t log_every_, checkpoint_every_;
  std::chrono::steady_clock::time_point last_;  // the end of the previous step
  double epoch_loss_ = 0;
  int64_t epoch_steps_ = 0, current_epoch_ = 0;
  bool caller_stop_ = false;  // on rank 0: on_step asked to stop
  std::string write_error_;   // on rank 0: a file it alone writes could not be written
  LoopOutcome out_;
};

}  // namespace

LoopOutcome run_steps(const Args& a, Run& run, Communicator& world) { return StepLoop(a, run, world).run(); }

}  // namespace pipeshard::train_cli
