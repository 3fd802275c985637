// train: train an ONNX MLP on NumPy data, in one process or across `mpirun -np N`
// processes (data, pipeline and tensor parallel), exactly as PyTorch would in one, and
// write the trained model back as ONNX. Bad arguments and bad files: one line on
// stderr, exit status 2, nothing written.
#include <memory>
#include <optional>

#include "backend/backend.h"
#include "comm/comm.h"
#include "common/cli.h"
#include "tools/train/args.h"
#include "tools/train/auto_layout.h"
#include "tools/train/check_equivalence.h"
#include "tools/train/loop.h"
#include "tools/train/report.h"
#include "tools/train/run.h"
#include "tools/train/setup.h"

namespace {

using namespace pipeshard;
using namespace pipeshard::train_cli;

// The whole run, on `world`, into `run` (which main keeps, to decide how it ends). Returns
// the exit status.
int run_training(Communicator& world, Run& run, int argc, char** argv) {
  const bool root = world.rank() == 0;
  Args a;
  std::optional<int> answered;  // --help
  Status parsed = parse_command_line(argc, argv, root, a, answered);
  if (answered) return *answered;
  if (parsed && a.layout == "auto") {  // collective, and every rank decides alike
    Result<ChosenLayout> chosen = choose_layout(a, world, run.model);
    if (chosen) run.predicted_step_ms = chosen->predicted_ms;
    parsed = chosen.status();
  }
  if (!set_up_run(a, parsed, world, run)) return kExitBadInput;
  // What only a neighbour can tell: the rank that finds a mismatch says so, and its exit
  // ends the job.
  if (Status s = run.trainer->check_links(); !s) return fail(s.message());
  if (root) {
    say_how_tensors_travel(run);
    say_how_batchnorm_normalises(run);
    say_how_zero_shards(run);
  }
  if (a.check_equivalence > 0) {
    const auto same_kind = [&a, &run]() -> std::unique_ptr<Backend> {
      Result<std::unique_ptr<Backend>> backend = make_backend_like_this_one(a, run);
      PIPESHARD_CHECK(backend.is_ok(), backend.status().message());  // this process made one already
      return std::move(*backend);
    };
    return check_equivalence(run.model->graph, *run.data, run.config, *run.trainer, a.check_equivalence, world,
                             same_kind);
  }
  const LoopOutcome loop = run_steps(a, run, world);
  if (loop.exit) return *loop.exit;
  return report_finished_run(a, run, world, loop);
}

}  // namespace

int main(int argc, char** argv) {
  // Ranks: one process, or mpirun -np N with N = stages × replicas × shards. The world
  // comes first so that errors, --help included, are printed once, by rank 0; the run
  // after it, so that the run's groups are destroyed before the world.
  std::unique_ptr<Communicator> world = make_world_communicator();
  Run run;
  const int status = run_training(*world, run, argc, argv);
  if (status != 0) run.device_groups.abandon();  // NCCL's, which must not be shut down in order now
  return status;
}
