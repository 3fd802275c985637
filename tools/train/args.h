// The flags of `train`: what they are (define: names, help, checks), and what they ask for
// (make_config: the TrainConfig, refusing combinations that make no sense, each with one
// line). tools/train/setup.h checks the rest.
#ifndef PIPESHARD_TOOLS_TRAIN_ARGS_H_
#define PIPESHARD_TOOLS_TRAIN_ARGS_H_

#include <cstdint>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "backend/backend.h"
#include "common/status.h"
#include "runtime/trainer.h"

namespace pipeshard::train_cli {

// What the command line said; *_given: the flag appeared (its default depends on others).
struct Args {
  std::string model, data, labels, eval_data, eval_labels, metrics, save, checkpoint, resume, trace;
  std::string loss = "cross-entropy", optimizer = "sgd", schedule = "constant", betas, device = "cpu";
  std::string pipeline_schedule = "1f1b", balance = "params", on_nonfinite = "stop", precision = "fp32";
  std::string gpu_comm = "staged";  // --gpu-comm staged|nccl
  std::string tensorboard;          // --tensorboard DIR
  std::string loss_scale;           // --loss-scale: "" (by precision), none, dynamic or a power of two
  int micro_batches = 1;
  int virtual_stages = 0;  // --virtual-stages: 0, the schedule's own
  bool sync_batchnorm = false;
  int zero = 0;                   // --zero: the ZeRO stage
  bool cuda_graph = false;        // --cuda-graph
  bool keep_activations = false;  // --keep-activations
  double bucket_mb = 25;
  double comm_timeout = 60;
  double lr = 0, momentum = 0, eps = 0, weight_decay = 0, clip = 0;
  bool lr_given = false, momentum_given = false, eps_given = false, weight_decay_given = false;
  bool pipeline_schedule_given = false, balance_given = false;  // --schedule, --balance
  bool nesterov = false, no_shuffle = false;
  int64_t batch_size = 32, steps = 0, epochs = 0, grad_accum = 1, warmup = 0, checkpoint_every = 0;
  int64_t check_equivalence = 0;
  uint64_t seed = 0;
  std::string plot;  // --plot FILE.svg|png
  int stages = 1, tensor_parallel = 1;
  std::string layout;   // --layout auto: the planner chooses the layout flags (tools/train/auto_layout.h)
  std::string profile;  // --profile: the machine profile it plans with
};

// Declares every flag on `app`, writing into `a`.
void define(CLI::App& app, Args& a);

// The command line, into `a`: OK, or the parse error as one line ending "(see train
// --help)". --help is answered at once: printed when `prints` (rank 0, so that it appears
// once), with the exit status it ends the process with in `answered`.
Status parse_command_line(int argc, char** argv, bool prints, Args& a, std::optional<int>& answered);

// Turns the flags into a TrainConfig, refusing flags the chosen optimizer has no use for,
// and flags that would do nothing in this run: outputs and --resume with
// --check-equivalence, --schedule and --balance with one pipeline stage.
Result<TrainConfig> make_config(const Args& a);

// A library error in train's words: the flag of the TrainConfig setting it is about
// (Status::invalid) first.
std::string flag_message(const Status& s);

// --precision as the backend's enum.
Precision precision_of(const Args& a);

}  // namespace pipeshard::train_cli

#endif  // PIPESHARD_TOOLS_TRAIN_ARGS_H_
