// The end of a finished run (tools/train/report.h).
#include "tools/train/report.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <fmt/format.h>

#include "comm/watchdog.h"
#include "common/host_memory.h"
#include "importer/onnx_writer.h"
#include "tools/plot/plot.h"

namespace pipeshard::train_cli {
namespace {

// "peak …: …" from every process's peak of backend memory (decimal byte counts) and
// what rank 0's holds.
std::string peak_memory_line(const std::vector<std::string>& peaks, const BackendKind& device,
                             const Trainer::Memory& mine) {
  const std::string where = std::string(device.memory_noun) + " held by the backend";
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

// Rank 0's lines about the run: how long, what it skipped, the CUDA graph's recordings
// and the peak memory line (from `peaks`, every process's).
void say_how_it_went(const Run& run, const LoopOutcome& loop, const std::vector<std::string>& peaks) {
  const TrainConfig& config = run.config;
  const Trainer& trainer = *run.trainer;
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - loop.started).count();
  std::vector<std::string> skips;
  if (loop.skipped > 0) skips.push_back(fmt::format("{} skipped: loss or gradients not finite", loop.skipped));
  if (loop.overflowed > 0) {
    skips.push_back(fmt::format("{} skipped: gradients overflowed under the loss scale, now {:g}", loop.overflowed,
                                trainer.loss_scale()));
  }
  fmt::print(stderr, "done: {} steps{} in {:.2f} s\n", config.total_steps,
             skips.empty() ? "" : " (" + fmt::format("{}", fmt::join(skips, "; ")) + ")", total);
  if (config.cuda_graph) {
    fmt::print(stderr, "cuda graph: after this process's first step, forward and backward ran from {} recordings\n",
               trainer.recordings());
  }
  fmt::print(stderr, "{}\n", peak_memory_line(peaks, *run.device, trainer.memory()));
  if (run.predicted_step_ms > 0 && loop.step_seconds.size() > 1) {
    // The first step warms up (first touches, the BLAS's buffers): the median of the rest.
    std::vector<double> times(loop.step_seconds.begin() + 1, loop.step_seconds.end());
    std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
    const double measured = times[times.size() / 2] * 1e3;
    fmt::print(stderr,
               "layout auto: measured {:.3f} ms per step (median after the first), predicted {:.3f} ({:+.0f}%)\n",
               measured, run.predicted_step_ms, (run.predicted_step_ms / measured - 1) * 100);
  }
}

// "stage 0: F 0.41, I 0.38, W 0.35 ms; stage 1: ...; transfer 0.02 ms": the costs the
// bubble was predicted from, per stage (per chunk when stages hold several).
std::string pass_costs_text(const PassCosts& c, int stages) {
  const int chunks = static_cast<int>(c.forward.size());
  std::string text;
  for (int i = 0; i < chunks; ++i) {
    text +=
        fmt::format("{}{} {}: F {:.3g}", i ? "; " : "", chunks == stages ? "stage" : "chunk", i, c.forward[i] / 1e3);
    if (c.backward_weight[i] > 0) {
      text += fmt::format(", I {:.3g}, W {:.3g} ms", c.backward_input[i] / 1e3, c.backward_weight[i] / 1e3);
    } else {
      text += fmt::format(", B {:.3g} ms", c.backward_input[i] / 1e3);
    }
  }
  return text + fmt::format("; transfer {:.3g} ms", c.transfer / 1e3);
}

// The pipeline bubble, measured, predicted from the measured passes and in theory: said
// by rank 0 and put on --tensorboard.
Status report_bubble(const Run& run, bool log) {
  const Trainer::Bubble b = run.trainer->pipeline_bubble();
  const int chunks = run.trainer->schedule().chunks() / run.layout.stages;  // per stage
  if (log) {
    fmt::print(stderr,
               "pipeline bubble: stages idle {:.1f}% of the schedule's time (measured, transfers included), "
               "{:.1f}% predicted from the passes' mean times; theory {} = {:.1f}% for P={}, M={}{}\n"
               "pipeline passes (mean per micro-batch): {}\n",
               100 * b.measured, 100 * b.predicted, b.formula, 100 * b.theoretical, run.layout.stages,
               run.config.micro_batches, chunks > 1 ? fmt::format(", v={}", chunks) : "",
               pass_costs_text(b.costs, run.layout.stages));
  }
  if (run.board) return run.board->add_bubble(run.config.total_steps, b);
  return Status::ok();
}

}  // namespace

int report_finished_run(const Args& a, Run& run, Communicator& world, const LoopOutcome& loop) {
  const bool root = world.rank() == 0;
  const bool log = root && run.log;  // the Python module may ask for silence
  // What goes wrong is said once, by rank 0. In a collective part every rank stops with
  // status 2; where rank 0 works alone, it alone does.
  const auto fail_here = [&run](const std::string& message) {
    run.say_bad_input(message);
    return kExitBadInput;
  };
  const auto stop = [root, &fail_here](const std::string& message) {
    return root ? fail_here(message) : kExitBadInput;
  };
  Trainer& trainer = *run.trainer;
  // Every process's peak of backend memory, to rank 0 (collective).
  const std::vector<std::string> peaks = world.gather_text(std::to_string(run.backend->memory_use().peak), 0);
  if (log) say_how_it_went(run, loop, peaks);
  const WatchdogSlowPhase slow("writing results");  // rank 0 writes, the others wait
  // The trained model first: what follows only describes the run.
  if (!a.save.empty()) {
    Graph trained = run.model->graph;      // host copy for the saved model
    trainer.download_parameters(trained);  // gathers every stage and shard on rank 0
    const Status s = root ? write_trained_model(*run.model, trained, a.save) : Status::ok();
    // Rank 0 wrote alone; the others learn how it went before the collectives below.
    const bool failed = world.size() > 1 ? world.all_reduce_sum(s ? 0.0 : 1.0) > 0 : !s;
    if (failed) return stop(s.message());
    if (log) fmt::print(stderr, "wrote {}\n", a.save);
  }
  if (run.layout.stages > 1) {
    if (Status s = report_bubble(run, log); !s) return stop(s.message());
  }
  if (!a.trace.empty()) {
    if (Status s = trainer.write_trace(a.trace); !s) return stop(s.message());
    if (log) fmt::print(stderr, "wrote {} (open it in https://ui.perfetto.dev or chrome://tracing)\n", a.trace);
  }
  if (loop.curves) {
    if (Status s = draw_picture(loop.curves->data(), a.plot); !s) return fail_here("--plot: " + s.message());
    if (log) fmt::print(stderr, "wrote {}\n", a.plot);
  }
  return 0;
}

}  // namespace pipeshard::train_cli
