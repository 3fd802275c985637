// The registry of pipeline schedules: one row per schedule, holding everything the rest
// of pipeshard needs to know about it — its name as --schedule spells it, its builder,
// how many micro-batches each stage keeps alive (what the memory estimate multiplies
// activations by), its theoretical bubble — so that `train`, `partition`, the planner and
// the pictures never branch on a schedule's name (docs/style.md 13). Built in: "gpipe",
// "1f1b" and "zb-h1". A test or a later feature adds a row with ScheduleRegistration and nothing
// else: the stage runner runs any schedule that check_pipeline_schedule() accepts.
#ifndef PIPESHARD_SCHEDULE_REGISTRY_H_
#define PIPESHARD_SCHEDULE_REGISTRY_H_

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "schedule/schedule.h"

namespace pipeshard {

struct ScheduleInfo {
  std::string name;     // as --schedule spells it: "gpipe", "1f1b"
  std::string title;    // as tables and pictures print it: "GPipe", "1F1B"
  std::string summary;  // one line on what it does, for --help and --show-schedule
  // Model chunks each stage holds (v): the model is cut into P·v chunks.
  int chunks_per_stage = 1;
  // [P·v] the stage holding each chunk; null: chunk c on stage c mod P (round robin).
  std::function<std::vector<int>(int stages)> placement;
  // The compute actions (F, B, I, W) of every stage for P stages and M micro-batches.
  std::function<ComputeOrder(int stages, int micro_batches)> build;
  // Most micro-batches stage s keeps alive at once, as max_in_flight() counts it on the
  // built schedule (tests check the two agree).
  std::function<int(int stages, int micro_batches, int stage)> in_flight;
  // The fraction of the schedule's time stages idle when the forward, the input half and
  // the weight half take the same time (a whole B twice as long) and transfers none, and
  // that formula as text for the reports: "(P-1)/(M+P-1)".
  std::function<double(int stages, int micro_batches)> bubble;
  std::string bubble_formula;
};

// The chunks per stage (v) the row runs: its fixed count, or for a row whose count the user
// chooses (chunks_per_stage 0) `virtual_stages`, 2 when that is 0.
int chunks_per_stage_of(const ScheduleInfo& info, int virtual_stages);

// The row named `name`, or null.
const ScheduleInfo* find_schedule(std::string_view name);
// Every registered name, built-in ones first: "gpipe", "1f1b", ...
std::vector<std::string> schedule_names();
// The same as one line: "gpipe, 1f1b, zb-h1".
std::string schedule_names_text();
// OK when `name` is registered; otherwise "no pipeline schedule 'x' (there are gpipe, 1f1b, zb-h1)".
Status check_schedule_name(std::string_view name);

// Adds a row for the life of this object. Its name must be new (a bug otherwise). The
// registry is read without locks: register before any thread uses it.
class ScheduleRegistration {
 public:
  explicit ScheduleRegistration(ScheduleInfo info);
  ~ScheduleRegistration();
  ScheduleRegistration(const ScheduleRegistration&) = delete;
  ScheduleRegistration& operator=(const ScheduleRegistration&) = delete;

 private:
  std::string name_;
};

}  // namespace pipeshard

#endif  // PIPESHARD_SCHEDULE_REGISTRY_H_
