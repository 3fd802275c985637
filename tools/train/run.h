// What train's set-up makes for the training loop (Run), and how train reports bad input.
#ifndef PIPESHARD_TOOLS_TRAIN_RUN_H_
#define PIPESHARD_TOOLS_TRAIN_RUN_H_

#include <unistd.h>

#include <cstdint>
#include <fstream>
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

inline bool stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

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
  CrashPoint checkpoint_crash;  // PIPESHARD_FAULT_AT: crash tests only (common/fault_injection.h)
};

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_RUN_H_
