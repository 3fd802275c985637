#include "observe/trace.h"

#include <nlohmann/json.hpp>

namespace pipeshard {

void Tracer::start(bool record) {
  t0_ = std::chrono::steady_clock::now();
  record_ = record;
  events_.clear();
  dropped_ = 0;
  busy_us_ = schedule_us_ = 0;
}

double Tracer::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0_).count();
}

void Tracer::add(const char* name, const char* category, double begin_us, int64_t step, int micro_batch, int chunk) {
  if (!record_) return;
  if (events_.size() >= kMaxEvents) {
    ++dropped_;
    return;
  }
  events_.push_back(Event{name, category, begin_us, now_us() - begin_us, step, micro_batch, chunk});
}

std::string Tracer::events_json(int pid, const std::string& label, size_t max_bytes) const {
  std::string out =
      nlohmann::json{{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", label}}}}.dump();
  // ',' appended apart: "," + a temporary string trips GCC 12's -Wrestrict (a false alarm).
  out += ',';
  out +=
      nlohmann::json{{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"args", {{"sort_index", pid}}}}.dump();
  size_t left_out = dropped_;
  for (const Event& e : events_) {
    if (out.size() >= max_bytes) {
      ++left_out;
      continue;
    }
    nlohmann::json j{
        {"name", e.name},       {"cat", e.category},         {"ph", "X"}, {"pid", pid}, {"tid", 0}, {"ts", e.begin_us},
        {"dur", e.duration_us}, {"args", {{"step", e.step}}}};
    if (e.micro_batch >= 0) j["args"]["micro_batch"] = e.micro_batch;
    if (e.chunk >= 0) j["args"]["chunk"] = e.chunk;
    out += ',';
    out += j.dump();
  }
  if (left_out > 0) {
    out += ',';
    out +=
        nlohmann::json{{"name", "events left out"}, {"ph", "M"}, {"pid", pid}, {"args", {{"events", left_out}}}}.dump();
  }
  return out;
}

std::string chrome_trace_json(const std::vector<std::string>& rank_events) {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  for (const std::string& events : rank_events) {
    if (events.empty()) continue;
    if (!first) out += ",\n";
    out += events;
    first = false;
  }
  return out + "]}\n";
}

}  // namespace pipeshard
