// StageRunner: runs one pipeline stage's list of actions (schedule/schedule.h) on the
// stage's Program and the pipeline group, for one replica batch — any schedule the
// checker accepts, not only the built-in ones. It owns what the actions need between
// them:
// - the model chunks the stage holds (one, or several under interleaved and V schedules),
//   each a part of the one program (Program::select_chunk());
// - micro-batch slots, per chunk: each micro-batch takes a free slot of the chunk at its
//   first action there and gives it back after its last backward pass (B, or W after I),
//   a deterministic assignment read off the schedule once, so slots follow any order of
//   backwards;
// - each chunk's links: the values crossing its cuts (runtime/rank_model.h) are received
//   into and sent from the program's buffers, or buffers of the runner's own for values
//   the chunk only carries to a later one; sends complete in the background and a slot is
//   reused only after the sends reading it are done. Neighbouring chunks on the stage (the
//   turn of a V) hand over by a copy on the device instead: the later chunk's forward
//   copies the earlier one's outputs in, and its backward copies the input gradient back;
// - the data-parallel gradient reduction's timing (runtime/gradient_sync.h): buckets fire
//   during each chunk's last gradient pass of the step and the rest at the stage's last R;
// - --cuda-graph's recordings of forward and backward passes, halves included (Backend::record).
// The trainer around it computes the loss, scales, clips and updates.
#ifndef PIPESHARD_RUNTIME_STAGE_RUNNER_H_
#define PIPESHARD_RUNTIME_STAGE_RUNNER_H_

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "common/status.h"
#include "observe/trace.h"
#include "program/program.h"
#include "runtime/gradient_sync.h"
#include "runtime/rank_model.h"
#include "schedule/schedule.h"

namespace pipeshard {

class StageRunner {
 public:
  // One replica batch through the schedule: a micro-step of gradient accumulation.
  struct MicroStep {
    int64_t step = 0;                 // the 1-based optimizer step (trace, watchdog, fault points)
    int64_t index = 0;                // the micro-step within the step: recordings differ between them
    bool last = true;                 // the step's last micro-step: its backwards complete the gradients
    uint64_t seed = 0;                // Dropout masks of this batch
    int64_t first_sample = 0;         // where this replica's slice starts in the global batch
    const float* features = nullptr;  // the first stage's input: [micro-batches × rows, features] in host memory
    bool replay = false;              // --cuda-graph: forward and backward run from recordings
  };
  // Last stage, after F(k): the loss of micro-batch k (its share of the global mean),
  // with the output gradient written (and scaled) for backward.
  using LossFn = std::function<double(int micro_batch)>;

  // `program` has the slots slots_needed() says; `pipeline` carries buffers in the
  // backend's memory between stages (null: one stage); `sync` reduces gradients over the
  // replicas (null: one replica). All must outlive the runner. `schedule` must pass
  // check_pipeline_schedule(); the runner runs stage `rank.layout().stage`'s list.
  StageRunner(const RankModel& rank, Program& program, Backend& backend, Communicator* pipeline, GradientSync* sync,
              const PipelineSchedule& schedule, int64_t micro_rows, int64_t features_per_sample, Tracer& tracer);

  // Micro-batch slots the stage's chunk j needs for `schedule`: the most micro-batches the
  // runner keeps alive there at once (schedule/schedule.h's max_in_flight_of_chunk()).
  static int slots_needed(const PipelineSchedule& schedule, int stage, int j);

  // Neighbouring stages agree on what crosses their cut (sizes, which gradients travel
  // back) before any training. Collective over the pipeline: every rank calls it once.
  Status check_links();

  // Runs this stage's actions for one micro-step; returns the loss it computed (the last
  // stage's; 0 elsewhere).
  double run(const MicroStep& micro_step, const LossFn& loss);

  // --cuda-graph: the recordings made (0 without it, or on a backend that cannot record),
  // and forgetting them (evaluation may move scratch buffers they point into).
  int64_t recordings() const;
  void clear_recordings() { recorded_.clear(); }
  // Forward and backward wait for the backend's queued work, so that the trace and the
  // pipeline bubble time the work itself (start_trace(): only where the figures are shown).
  void set_time_device_work(bool on) { time_device_work_ = on; }

  // How long this stage's actions took, by chunk and kind (R aside), since
  // reset_pass_times(), summed in µs with their counts: what the predicted bubble is
  // computed from (Trainer::pipeline_bubble).
  struct PassTimes {
    std::vector<std::array<double, kActionKindCount>> us, count;  // [chunks of the stage][kind]
    double fastest_receive_us = 0;  // the quickest receive: a message already there, its copy alone; 0 if none
    double mean_us(int j, ActionKind kind) const {
      const int i = static_cast<int>(kind);
      return count[j][i] > 0 ? us[j][i] / count[j][i] : 0.0;
    }
  };
  const PassTimes& pass_times() const { return pass_times_; }
  void reset_pass_times();

 private:
  struct Carried {             // a value a chunk passes on without reading it
    DeviceBuffer value, grad;  // [slots][micro-batch rows, per_sample]
  };
  struct Chunk {                     // one model chunk of the stage
    bool first = true, last = true;  // of the model: it reads the data, it computes the loss
    bool after_local = false;        // the chunk before it is on this stage too (j − 1)
    bool before_local = false;       // the chunk after it is (j + 1)
    int slots = 1;
    std::vector<int> slot_of;       // [micro-batches]
    int last_gradient_action = -1;  // index of the action that completes its gradients of the step
    std::map<std::string, Carried> carried;
    std::vector<std::vector<std::unique_ptr<Request>>> sends;  // [slots]: sends reading the slot
  };
  void run_action(size_t index, const Action& a, const MicroStep& ms, const LossFn& loss, double& total);
  void forward(const Action& a, const MicroStep& ms);
  void backward(size_t index, const Action& a, const MicroStep& ms);
  void add_carried_gradients(int j);
  // The turn of a V: chunk j takes in the outputs of chunk j − 1 on this stage (before
  // its forward of micro-batch k), or gives its input gradients back to it (after its
  // backward).
  void take_from_previous(int j, int k);
  void give_to_previous(int j, int k);
  const LinkValue& previous_output(int j, const LinkValue& in) const;
  // Selects chunk j and the slot of micro-batch k in the program.
  void select(int j, int k);
  void replay_or_record(ActionKind kind, const MicroStep& ms, int micro_batch, const std::function<void()>& work);
  void wait_slot(int j, int slot);
  // Where link value `l` of chunk j lives in the selected slot: the program's buffer or a
  // carried one.
  float* link_value(int j, const LinkValue& l);
  // `received`: the gradient arriving from the next chunk (for values this chunk reads
  // and passes on, it is staged apart and added after backward); otherwise the gradient
  // this chunk sends back.
  float* link_gradient(int j, const LinkValue& l, bool received);
  int peer(int j, int offset) const;  // the stage holding the chunk `offset` away from this stage's chunk j

  const RankModel& rank_;
  Program& program_;
  Backend& backend_;
  Communicator* pipeline_;
  GradientSync* sync_;
  const PipelineSchedule& schedule_;
  const int stage_;
  const int64_t micro_, features_per_sample_;
  Tracer& tracer_;
  std::vector<Chunk> chunks_;  // [chunks of the stage]
  int last_reduce_ = -1;       // index of the stage's last R: where the rest of the reduction runs
  // --cuda-graph's recordings, by (action kind, micro-step, micro-batch); a null one: the
  // backend cannot record, and the work runs eagerly.
  std::map<std::tuple<ActionKind, int64_t, int>, std::unique_ptr<RecordedWork>> recorded_;
  bool time_device_work_ = false;
  double reduce_us_ = 0;  // time spent at R in this run: not the schedule's own
  PassTimes pass_times_;
};

}  // namespace pipeshard

#endif  // PIPESHARD_RUNTIME_STAGE_RUNNER_H_
