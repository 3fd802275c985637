// What train's set-up makes for the training loop (Run), and how train reports bad input.
#ifndef PIPESHARD_TOOLS_TRAIN_RUN_H_
#define PIPESHARD_TOOLS_TRAIN_RUN_H_

#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "backend/backend.h"
#include "backend/registry.h"
#include "comm/comm.h"
#include "comm/device_groups.h"
#include "common/cli.h"
#include "common/fault_injection.h"
#include "dataset/dataset.h"
#include "importer/onnx_importer.h"
#include "runtime/trainer.h"
#include "tools/train/training_board.h"

namespace pipeshard::train_cli {

// "train: error: <message>" on stderr; returns kExitBadInput.
inline int fail(const std::string& message) { return report_bad_input("train", message); }

// The exit status of a run that Run::on_step stopped.
inline constexpr int kExitStoppedByCaller = 3;

inline bool stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

// One step as rank 0 saw it, for Run::on_step (the --metrics row's figures).
struct StepRow {
  int64_t step = 0, epoch = 0;  // 1-based
  int64_t total_steps = 0;      // the run's last step
  double loss = 0, lr = 0;      // lr: the schedule's, also for a skipped step
  double samples_per_s = 0;     // since the previous step's end
  bool skipped = false;         // --on-nonfinite skip or --loss-scale dynamic skipped it
};

// One evaluation, after the last step of an epoch, for Run::on_eval.
struct EvalRow {
  int64_t epoch = 0, step = 0;
  double train_loss = 0;  // the epoch's mean over its finite steps
  double loss = 0;
  double accuracy = -1;  // -1 without classes (a regression loss)
};

// Features and labels (or targets) in memory, read in place (dataset/dataset.h's
// dataset_of_views): the Python module's NumPy arrays.
struct ArraysInMemory {
  NpyView features, labels;
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
  const BackendKind* device = nullptr;  // the --device row of the backend registry
  std::unique_ptr<Backend> backend;
  DeviceGroups device_groups;  // the groups over the backend's memory (comm/device_groups.h)
  std::unique_ptr<Trainer> trainer;
  std::ofstream metrics;
  std::unique_ptr<TrainingBoard> board;
  CrashPoint checkpoint_crash;   // PIPESHARD_FAULT_AT: crash tests only (common/fault_injection.h)
  double predicted_step_ms = 0;  // --layout auto: the planner's prediction for the chosen layout; 0 without

  // Set before set_up_run by a caller that is no command line (the Python module, python/):
  // How rank 0 says bad input: train prints "train: error: <message>" on stderr; the
  // Python module keeps the message to raise it.
  std::function<void(const std::string&)> say_bad_input = [](const std::string& message) { fail(message); };
  // Arrays to train and evaluate on instead of the files of --data/--labels and
  // --eval-data/--eval-labels (which then only name them in messages); a model preset in
  // `model` is trained instead of the file of the model argument.
  std::optional<ArraysInMemory> data_arrays, eval_arrays;
  // Whether rank 0 says on stderr what it trains and how its steps go.
  bool log = true;
  // Called on rank 0: on_step after each step that ends the loop's work on it, on_eval
  // after each evaluation. on_step returns false to stop the run as SIGINT would (a checkpoint when
  // --checkpoint is given, then exit status kExitStoppedByCaller): in one process after
  // this step; under MPI after the next, whose end-of-step all-reduce tells the others.
  std::function<bool(const StepRow&)> on_step;
  std::function<void(const EvalRow&)> on_eval;
};

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_RUN_H_
