// Tracer: what one rank did when, for `train --trace` (one Chrome-trace/Perfetto
// timeline of every rank) and for the measured pipeline bubble.
//
// Times are microseconds since start(), which every rank calls right after the same
// barrier, so the ranks of one host share a time axis (across hosts it is off by the
// barrier's latency). Busy time (forward and backward) and schedule time are always
// summed; events are kept only when recording, and at most kMaxEvents of them.
#ifndef PIPESHARD_OBSERVE_TRACE_H_
#define PIPESHARD_OBSERVE_TRACE_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace pipeshard {

class Tracer {
 public:
  static constexpr size_t kMaxEvents = 1 << 20;

  void start(bool record);
  double now_us() const;
  // An event from `begin_us` to now. `micro_batch` < 0: not about one micro-batch;
  // `chunk` ≥ 0: the model chunk it is about, on a stage that holds several.
  void add(const char* name, const char* category, double begin_us, int64_t step, int micro_batch, int chunk = -1);

  // Forward/backward time, and the time the schedules took: their difference is the
  // time this stage waited (the bubble, plus transfers).
  void add_busy(double us) { busy_us_ += us; }
  void add_schedule(double us) { schedule_us_ += us; }
  double busy_us() const { return busy_us_; }
  double schedule_us() const { return schedule_us_; }

  // This rank's events as Chrome trace event objects, comma-separated (no brackets),
  // with `pid` = rank and a process name event carrying `label`; at most about
  // `max_bytes` of them (the first events; a last metadata event counts what was left out).
  std::string events_json(int pid, const std::string& label, size_t max_bytes) const;
  bool recording() const { return record_; }
  size_t dropped() const { return dropped_; }

 private:
  struct Event {
    const char* name;
    const char* category;
    double begin_us, duration_us;
    int64_t step;
    int micro_batch, chunk;
  };
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  bool record_ = false;
  std::vector<Event> events_;
  size_t dropped_ = 0;
  double busy_us_ = 0, schedule_us_ = 0;
};

// The whole trace file: {"traceEvents": [...every rank's events...], ...}.
std::string chrome_trace_json(const std::vector<std::string>& rank_events);

}  // namespace pipeshard

#endif  // PIPESHARD_OBSERVE_TRACE_H_
