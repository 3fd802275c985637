// train's step loop (tools/train/loop.h).
#include "tools/train/loop.h"

#include <csignal>
#include <cmath>
#include <string>

#include <fmt/core.h>

#include "comm/watchdog.h"

namespace pipeshard::train_cli {
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

namespace {

const char* signal_name(int signal) { return signal == SIGINT ? "SIGINT" : "SIGTERM"; }

}  // namespace

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

}  // namespace pipeshard::train_cli
