// The in-process job's waits, deadlock check and timeout (in_process_job.h).
#include "testing/in_process_job.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "common/check.h"

namespace pipeshard::in_process {
namespace {

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", seconds);
  return text;
}

}  // namespace

Job::Job(int size, const InProcessOptions& options)
    : options_(options), communicators_(static_cast<size_t>(size), 0), waiting_(static_cast<size_t>(size)) {}

void Job::enter(int rank) { ++communicators_.at(static_cast<size_t>(rank)); }

void Job::leave(int rank) {
  --communicators_.at(static_cast<size_t>(rank));
  // The last rank that could have unblocked the others may just have gone.
  check_deadlock();
  changed_.notify_all();
}

void Job::changed() { changed_.notify_all(); }

WaitResult Job::wait(std::unique_lock<std::mutex>& lock, int rank, const std::function<bool()>& ready,
                     const std::function<std::string()>& describe) {
  if (ready()) return WaitResult::kReady;
  if (!failure_.empty()) return WaitResult::kJobFailed;
  Waiter& self = waiting_.at(static_cast<size_t>(rank));
  self = {&ready, &describe};
  check_deadlock();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(options_.timeout);
  WaitResult result = WaitResult::kReady;
  while (!ready()) {
    if (!failure_.empty()) {
      result = WaitResult::kJobFailed;
      break;
    }
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout && !ready() && failure_.empty()) {
      // Not a deadlock (some rank is busy elsewhere), but nothing came for too long.
      fatal(__FILE__, __LINE__,
            "in-process communicator: rank " + std::to_string(rank) + " has waited " +
                seconds_text(options_.timeout.count()) + " in " + describe() +
                "; the ranks it waits for are busy elsewhere or stuck (InProcessOptions::timeout)");
    }
  }
  self = {};
  return result;
}

void Job::check_deadlock() {
  if (!failure_.empty()) return;
  bool anyone_waits = false;
  for (int r = 0; r < size(); ++r) {
    const Waiter& w = waiting_[static_cast<size_t>(r)];
    if (w.ready == nullptr) {
      if (communicators_[static_cast<size_t>(r)] > 0) return;  // this rank can still act
      continue;
    }
    if ((*w.ready)()) return;  // woken, not yet running
    anyone_waits = true;
  }
  if (!anyone_waits) return;
  std::string report = "deadlock in the in-process job: every rank waits and none can go on";
  for (int r = 0; r < size(); ++r) {
    const Waiter& w = waiting_[static_cast<size_t>(r)];
    report += "\n  rank " + std::to_string(r) + (w.ready != nullptr ? " waits in " + (*w.describe)() : " has left");
  }
  failure_ = report;
  changed_.notify_all();
}

}  // namespace pipeshard::in_process
