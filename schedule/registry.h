// The registry of pipeline schedules: one row per schedule, holding everything the rest
// of pipeshard needs to know about it — its name as --schedule spells it, its builder,
// how many micro-batches each stage keeps alive (what the memory estimate multiplies
// activations by), its theoretical bubble — so that `train`, `partition`, the planner and
// the pictures never branch on a schedule's name (docs/style.md 13). Built in: "gpipe",
// "1f1b" and "zb-h1" (one chunk per stage), "interleaved" (v) and "zb-v" (2). A test or a
// later feature adds a row with ScheduleRegistration and nothing else: the stage
// runner runs any schedule of one chunk per stage that check_pipeline_schedule() accepts
// (several chunks per stage are the schedule side's so far: built, checked, predicted).
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
  // Model chunks each stage holds (v): the model is cut into P·v chunks. 0: as many as the
  // user chooses, at least 2 (--virtual-stages; 2 when not chosen). chunks_per_stage_of()
  // gives the count a row runs with. Every function below takes that v: the rows of one
  // chunk per stage ignore it (it is 1 for them).
  int chunks_per_stage = 1;
  // [P·v] the stage holding each chunk; null: chunk c on stage c mod P (round robin).
  std::function<std::vector<int>(int stages, int v)> placement;
  // The compute actions (F, B, I, W) of every stage for P stages, M micro-batches and v
  // chunks per stage.
  std::function<ComputeOrder(int stages, int micro_batches, int v)> build;
  // Most micro-batches stage s keeps alive at once, summed over its chunks, as
  // max_in_flight() counts it on the built schedule (tests check the two agree). With
  // several chunks per stage each counts once per chunk, though a chunk holds 1/v of the
  // stage's layers.
  std::function<int(int stages, int micro_batches, int stage, int v)> in_flight;
  // The fraction of the schedule's time stages idle when the forward, the input half and
  // the weight half of every chunk take the same time (a whole B twice as long) and
  // transfers none, and that formula as text for the reports: "(P-1)/(M+P-1)".
  std::function<double(int stages, int micro_batches, int v)> bubble;
  std::string bubble_formula;
  // Why the row cannot run P stages, M micro-batches and v chunks per stage, as one
  // sentence (a Status::invalid of the count at fault: "micro_batches"); null: it runs any.
  std::function<Status(int stages, int micro_batches, int v)> accepts;
};

// The chunks per stage `info` runs with when the user asked for `virtual_stages` (0: did
// not ask): the row's own count when it fixes one; otherwise `virtual_stages` when it is
// at least 1, else 2. check_schedule_counts() says whether the row can run it.
int chunks_per_stage_of(const ScheduleInfo& info, int virtual_stages);

// The row named `name`, or null.
const ScheduleInfo* find_schedule(std::string_view name);
// Every registered name, built-in ones first: "gpipe", "1f1b", ...
std::vector<std::string> schedule_names();
// The same as one line: "gpipe, 1f1b, zb-h1, interleaved, zb-v".
std::string schedule_names_text();
// OK when `name` is registered; otherwise "no pipeline schedule 'x' (there are gpipe, 1f1b, ...)".
Status check_schedule_name(std::string_view name);
// OK when schedule `name` can run `stages` and `micro_batches` with `virtual_stages`
// chunks per stage (0: the row's default), so make_pipeline_schedule() will build it.
// Otherwise one sentence on what is wrong: an unknown name (check_schedule_name()'s
// message); a count below 1 (Status::invalid of "stages" or "micro_batches"); a count of
// chunks per stage for a row that fixes another ("schedule 'zb-v' holds 2 chunks per stage;
// a chosen count (3) does not apply") or one below 2 for a row that lets the user choose
// (both Status::invalid of "virtual_stages", which a tool names as its flag); or what the
// row's `accepts` refuses.
Status check_schedule_counts(std::string_view name, int stages, int micro_batches, int virtual_stages);

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
