// The training loop: batches in docs/design.md's order, forward, loss, backward,
// gradient accumulation, clipping, learning-rate schedule, optimizer step; evaluation;
// checkpoints that resume onto exactly the same trajectory.
//
// One Trainer runs on every rank of a P × D × T job (docs/design.md, "Processes and
// ranks"): it trains the rank's part of the model (runtime/rank_model.h) with a stage
// runner (runtime/stage_runner.h) that interprets its stage's pipeline schedule over the
// micro-batches of its replica's slice of each batch, reducing gradients over the
// replicas as the schedule says (runtime/gradient_sync.h). The step equals the
// one-process step up to float rounding: gradients are summed over the replicas, partial
// sums over the shards, and the loss and the clipping norm over the stages.
#ifndef PIPESHARD_RUNTIME_TRAINER_H_
#define PIPESHARD_RUNTIME_TRAINER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "common/atomic_file.h"
#include "common/status.h"
#include "dataset/dataset.h"
#include "importer/onnx_importer.h"
#include "observe/trace.h"
#include "program/optimizer.h"
#include "program/program.h"
#include "runtime/checkpoint_file.h"
#include "runtime/gradient_sync.h"
#include "runtime/loss_scaler.h"
#include "runtime/rank_model.h"
#include "runtime/stage_runner.h"
#include "runtime/train_config.h"
#include "schedule/predict.h"
#include "schedule/schedule.h"

namespace pipeshard {

// Where a Trainer sits in a multi-process job. All null: one process.
struct Parallel {
  Communicator* world = nullptr;
  ProcessGroups* groups = nullptr;
  // The file the Graph came from: stage files are cut from it when there are several
  // stages or shards.
  const ImportedModel* model = nullptr;
  // The same groups for buffers in the backend's memory (gradients, activations, BatchNorm
  // statistics) when `groups` work on host memory and the backend's is not: NCCL groups,
  // or staged ones (comm/comm_staged.h), for a GPU backend. Null: `groups` carry them.
  // Host values (the stage-link check, sums of losses and norms, gathers for saving)
  // always travel over `groups`.
  ProcessGroups* device_groups = nullptr;
};

struct StepResult {
  int64_t step = 0;      // 1-based optimizer step
  int64_t epoch = 0;     // 1-based epoch of the step's first batch
  double loss = 0;       // mean over the step's samples, from its forward pass (before the update)
  double lr = 0;         // the learning rate the step used
  double grad_norm = 0;  // global L2 norm of the gradient before clipping (0 when clipping is off)
  // The loss was inf or NaN, or (NonFinite::kSkip) a gradient on any rank: the step left
  // the weights and the optimizer state alone. The same on every rank.
  bool non_finite = false;
  // With non_finite, on world rank 0: first_non_finite_gradient().
  std::string first_non_finite;
  // This rank's gradients were all finite (NonFinite::kStop: checked by the optimizer as it
  // updated; the caller agrees over the ranks, and stops when one says false).
  bool gradients_finite = true;
  // Loss scaling (TrainConfig::loss_scaling): the scale this step's backward used (0 when
  // scaling is off), and whether dynamic scaling skipped the step because a gradient
  // overflowed under it (the scale has halved for the next step). The same on every rank.
  double loss_scale = 0;
  bool scale_overflow = false;
  // The first row this rank's batches read this step that breaks its data's rule (a NaN
  // feature, a label out of range: the message names the file, row and column), for data
  // too big to check whole at load (kCheckAtLoadBytes); empty when all were good. The step
  // ran on what was read; the caller agrees over the ranks and stops.
  std::string bad_data;
};

struct EvalResult {
  double loss = 0;
  double accuracy = -1;  // fraction of correct argmax; -1 for MSE
  int64_t samples = 0;
  std::string bad_data;  // as StepResult::bad_data, for the evaluation data, on rank 0
};

class Trainer {
 public:
  // `graph` holds the initial parameters and must outlive the Trainer; `data` too.
  // With `parallel`, this rank trains its part: its replica's contiguous slice of every
  // global batch of config.batch_size samples, its stage, its shard.
  static Result<std::unique_ptr<Trainer>> create(const Graph& graph, const Dataset& data, Backend& backend,
                                                 const TrainConfig& config, const Parallel& parallel = {});
  ~Trainer();

  // What one rank of each stage will hold while training on `backend` (parameters,
  // gradients, optimizer state, the activations its schedule keeps in flight), in bytes,
  // as the partitioner estimates it (partitioner/plan.h); empty when create() would
  // refuse the configuration anyway. No allocation: for the check before create().
  static std::vector<int64_t> memory_per_stage(const Graph& graph, const TrainConfig& config,
                                               const ProcessLayout& layout, const Backend& backend);

  // Neighbouring pipeline stages check that they agree on what crosses their cut (sizes,
  // which gradients travel back). Collective over the pipeline: call once on every rank
  // after create() succeeded on all of them, before the first step.
  Status check_links() { return runner_->check_links(); }

  // Runs optimizer step steps_done() + 1 (collective: every rank calls it).
  StepResult step();
  // On world rank 0, the parameter whose gradient went inf or NaN first in backward order
  // (the highest stage's latest node), as "'fc2.weight' (node 'fc2', stage 1)"; empty when
  // every gradient is finite, and elsewhere. Collective over the world.
  std::string first_non_finite_gradient();
  // The largest magnitude in each parameter's gradient of the last step, as the optimizer
  // took it (unscaled and clipped), indexed like the whole model's Graph::params (0 for
  // running statistics and parameters no node uses): for checks that judge a run by its
  // gradients (train --check-equivalence). One process only: the trainer of a whole model.
  std::vector<double> gradient_magnitudes() const;
  int64_t steps_done() const { return optimizer_->steps_taken(); }
  // --cuda-graph: the recordings the backend made (0 without it, or on a backend that
  // cannot record).
  int64_t recordings() const { return runner_->recordings(); }
  // What this process's backend memory holds: the training program's buffers, the
  // optimizer state, and the backend's peak (the rest of which is the trainer's own
  // buffers, evaluation, the backend's scratch and rounding: peak − the others).
  struct Memory {
    Program::Memory program;
    int64_t optimizer = 0, peak = 0;
  };
  Memory memory() const;
  // The ZeRO stage this rank runs: 0 (none, or one replica), 1, or 2 (--zero 2 runs as 1
  // where a stage's backward is split into I and W passes or it holds several chunks, and
  // where the windows would be no smaller than the whole gradient buffer). Stages may differ.
  int zero_stage() const { return !zero() ? 0 : sync_->windows() ? 2 : 1; }
  // The loss scale the next step will use (1 when scaling is off).
  double loss_scale() const { return scaler_.scale(); }
  int64_t batches_per_epoch() const { return order_.batches_per_epoch(); }
  const PipelineSchedule& schedule() const { return schedule_; }

  // Loss (and accuracy for cross-entropy) over all of `data`, in eval mode. Collective;
  // the result is on world rank 0 (elsewhere samples == 0).
  EvalResult evaluate(const Dataset& data);

  // Copies the trained parameters and running statistics into `graph.params` (the whole
  // model's). Collective; `graph` is filled on world rank 0.
  void download_parameters(Graph& graph);

  // Starts the clock of the timeline (after a barrier, so that all ranks share it) and,
  // when `record`, keeps events for write_trace(). Collective.
  void start_trace(bool record);
  // Writes every rank's events as one Chrome trace (open in Perfetto or
  // chrome://tracing) to `path` on rank 0. Collective.
  Status write_trace(const std::string& path);
  // The pipeline bubble: the fraction of the schedule's time stages spent not
  // computing, measured (mean over ranks); predicted (schedule/predict.h) from what each
  // stage's passes took on average since start_trace() (mean over its ranks) and the
  // quickest receive as the transfer time, which `costs` holds; and in theory, by the
  // schedule's formula (schedule/registry.h; `formula` is its text, "(P-1)/(M+P-1)").
  // Collective; meaningful with more than one stage.
  struct Bubble {
    double measured = 0, predicted = 0, theoretical = 0;
    PassCosts costs;  // µs per micro-batch and model chunk
    std::string formula;
  };
  Bubble pipeline_bubble();
  // Forward plus backward time ("compute") and the time of the whole schedule, in µs
  // since start_trace(), per pipeline stage, each the mean over the stage's ranks (its
  // replicas and shards): their difference is the time the stage waited (the bubble,
  // plus transfers). Collective: one all-reduce of 2·P doubles; the result is on every rank.
  struct StageTimes {
    std::vector<double> compute_us, schedule_us;  // [stages]
  };
  StageTimes stage_times();

  // Writes DIR/checkpoint.pipeshard atomically (runtime/checkpoint_file.h): whole-model
  // parameters and running statistics by initializer name, optimizer state likewise,
  // the step count, with a CRC-32C on every tensor and on the header; nothing in it
  // depends on the layout. Collective; rank 0 writes. A crash at any point of the write
  // leaves the previous checkpoint intact. `crash` is for crash tests only.
  Status save_checkpoint(const std::string& dir, const CrashPoint& crash = {});
  // Restores a checkpoint written for the same model and optimizer under any layout;
  // the run then continues exactly as if it had never stopped. Every rank reads it. A
  // file that fails a checksum, is cut short or does not fit this model and optimizer
  // is refused with a message naming the part at fault, and changes nothing.
  Status load_checkpoint(const std::string& dir);
  // The same for a checkpoint file's `bytes` already in memory; messages begin with
  // "`label`: " where load_checkpoint names the file's path.
  Status load_checkpoint_bytes(std::string_view bytes, const std::string& label);

 private:
  Trainer(const Dataset& data, Backend& backend, const TrainConfig& config, RankModel rank);
  Status build(const TrainConfig& config, Communicator* device_replicas, Communicator* device_tensor,
               Communicator* device_pipeline);
  Status restore(const Checkpoint& checkpoint);
  // This rank's slice of global batch `batch_index`, read into the runner's inputs.
  StageRunner::MicroStep micro_step(int64_t step, int64_t micro, int64_t batch_index);
  const float* batch_rows(const std::vector<int64_t>& rows);
  void note_data_error(Status s);  // keeps the step's first
  // The last stage's loss of micro-batch k, its output gradient written and scaled.
  double micro_batch_loss(int micro_batch);
  // Inf or NaN in the step (StepResult::non_finite, scale_overflow): whether the update
  // is skipped.
  bool skip_non_finite(StepResult& r);
  Program& eval_program(const Graph& graph);
  // This rank holds the model's first chunk (it reads the features), its last (it computes
  // the loss and reads the targets).
  bool reads_data() const { return schedule_.place_of(0).stage == rank_.layout().stage; }
  bool computes_loss() const { return schedule_.place_of(schedule_.chunks() - 1).stage == rank_.layout().stage; }
  double clip_gradients();
  // Each chunk's mean pass costs and the transfer time, as pipeline_bubble() predicts
  // from them. Collective over the world.
  PassCosts measured_pass_costs();
  // Whether any rank holds an inf or NaN gradient. Collective over the world.
  bool gradients_non_finite_anywhere();
  // ZeRO's slices of this replica (runtime/zero_shards.h), null without ZeRO.
  const ZeroShards* zero() const { return sync_ ? sync_->zero() : nullptr; }
  // The gradients the optimizer reads: the whole buffer, or under ZeRO this replica's
  // reduced slices and the tails.
  const std::vector<Optimizer::Span>& gradient_spans() const { return spans_; }
  template <typename Fn>
  void for_each_gradient_piece(int64_t at, int64_t elements, Fn fn);
  // Host copies of this rank's parameters (values) or of optimizer slot s.
  std::vector<std::vector<float>> local_values() const;
  std::vector<std::vector<float>> local_slot(int s) const;

  const Dataset& data_;
  Backend& backend_;
  TrainConfig config_;
  RankModel rank_;
  Communicator* world_ = nullptr;
  Communicator* replicas_ = nullptr;  // data-parallel group (null: one replica)
  Communicator* tensor_ = nullptr;    // tensor-parallel group (null: one shard)
  Communicator* pipeline_ = nullptr;  // the stages (null: one stage)
  bool log_probs_ = false;
  bool warmed_up_ = false;  // this process has run a step (eagerly)
  LossScaler scaler_;
  BatchOrder order_;
  int64_t local_batch_ = 0;  // samples of each micro-step on this replica
  int64_t micro_ = 0;        // samples of each pipeline micro-batch
  PipelineSchedule schedule_;
  std::unique_ptr<Program> program_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<GradientSync> sync_;  // with replicas
  std::vector<Optimizer::Span> spans_;  // gradient_spans()
  Tracer tracer_;
  std::unique_ptr<StageRunner> runner_;
  DeviceBuffer targets_;              // [local_batch * targets_per_sample]
  std::vector<float> host_features_;  // [local_batch * features_per_sample]: a gathered batch
  std::vector<float> host_targets_;   // [local_batch * targets_per_sample]
  Status data_error_;                 // the first bad row read this step
  // Evaluation on rank 0, forward-only, in chunks of the whole batch: of a cut model, the
  // whole model assembled in eval_graph_; of a whole one trained in micro-batches, the
  // same graph as the training program (which holds only one micro-batch).
  std::unique_ptr<Graph> eval_graph_;
  std::unique_ptr<Program> eval_program_;
};

}  // namespace pipeshard

#endif  // PIPESHARD_RUNTIME_TRAINER_H_
