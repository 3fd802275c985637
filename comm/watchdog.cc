#include "comm/watchdog.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

namespace pipeshard {
namespace {

constexpr int kSlowPhaseFactor = 10;
constexpr auto kPollInterval = std::chrono::milliseconds(200);

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Written by the MPI thread, read by the watchdog thread. Never destroyed: the watchdog
// thread may still read it while the process exits.
struct State {
  std::atomic<int64_t> limit_ns{0};         // 0: disarmed
  std::atomic<int64_t> wait_started_ns{0};  // 0: not waiting
  std::atomic<const char*> operation{nullptr};
  std::atomic<const std::string*> ranks{nullptr};
  std::atomic<int64_t> step{0};
  std::atomic<const char*> phase{nullptr};
  std::atomic<int> micro_batch{-1};
  std::atomic<int> slow_phases{0};
  int depth = 0;  // nested waits (the MPI thread's only): the outermost one counts

  std::mutex mutex;  // guards what follows
  std::string tool, who, limit_hint;
  bool thread_started = false;
};

State& state() {
  static State* s = new State;
  return *s;
}

// Ends the process: one line on stderr, status 1, no MPI_Finalize (which would wait for
// the very ranks this one gave up on), so that mpirun ends the rest of the job.
[[noreturn]] void expire(State& s, int64_t waited_ns) {
  std::string tool, who, hint;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    tool = s.tool;
    who = s.who;
    hint = s.limit_hint;
  }
  std::string line = tool + ": " + who;
  if (const int64_t step = s.step.load(); step > 0) line += ", step " + std::to_string(step);
  if (const char* phase = s.phase.load()) {
    line += std::string(", ") + phase;
    if (const int k = s.micro_batch.load(); k >= 0) line += " of micro-batch " + std::to_string(k);
  }
  const char* operation = s.operation.load();
  const std::string* ranks = s.ranks.load();
  const std::string peers = ranks ? *ranks : "other ranks";
  const bool several = peers.rfind("ranks ", 0) == 0;
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.0f", static_cast<double>(waited_ns) / 1e9);
  line += std::string(": ") + (operation ? operation : "a wait on") + " " + peers + " has not completed after " +
          seconds + " s; " + (several ? "one of " + peers + " has" : peers + " has") +
          " failed, is stuck or cannot be reached" + (hint.empty() ? "" : " (" + hint + ")") + "\n";
  // write(2), not stdio: the MPI thread may hold stderr's lock.
  for (size_t done = 0; done < line.size();) {
    const ssize_t n = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::_exit(1);
}

void watch() {
  State& s = state();
  for (;;) {
    std::this_thread::sleep_for(kPollInterval);
    const int64_t limit = s.limit_ns.load(std::memory_order_relaxed);
    const int64_t started = s.wait_started_ns.load(std::memory_order_acquire);
    if (limit <= 0 || started == 0) continue;
    const int64_t allowed = s.slow_phases.load(std::memory_order_relaxed) > 0 ? kSlowPhaseFactor * limit : limit;
    const int64_t waited = now_ns() - started;
    // The same wait still going (not one that ended and another that began meanwhile).
    if (waited > allowed && s.wait_started_ns.load(std::memory_order_acquire) == started) expire(s, waited);
  }
}

}  // namespace

void watchdog_arm(double seconds, const std::string& tool, const std::string& who, const std::string& limit_hint) {
  State& s = state();
  if (!(seconds > 0) || !std::isfinite(seconds)) {
    watchdog_disarm();
    return;
  }
  std::lock_guard<std::mutex> lock(s.mutex);
  s.tool = tool;
  s.who = who;
  s.limit_hint = limit_hint;
  s.limit_ns.store(static_cast<int64_t>(seconds * 1e9), std::memory_order_relaxed);
  if (!s.thread_started) {
    std::thread(watch).detach();  // lives as long as the process
    s.thread_started = true;
  }
}

void watchdog_disarm() { state().limit_ns.store(0, std::memory_order_relaxed); }

void watchdog_activity(int64_t step, const char* phase, int micro_batch) {
  State& s = state();
  s.step.store(step, std::memory_order_relaxed);
  s.phase.store(phase, std::memory_order_relaxed);
  s.micro_batch.store(micro_batch, std::memory_order_relaxed);
}

WatchdogWait::WatchdogWait(const char* operation, const std::string* ranks) {
  State& s = state();
  if (s.depth++ > 0 || s.limit_ns.load(std::memory_order_relaxed) == 0) return;
  s.operation.store(operation, std::memory_order_relaxed);
  s.ranks.store(ranks, std::memory_order_relaxed);
  s.wait_started_ns.store(now_ns(), std::memory_order_release);
}

WatchdogWait::~WatchdogWait() {
  State& s = state();
  if (--s.depth == 0) s.wait_started_ns.store(0, std::memory_order_release);
}

WatchdogSlowPhase::WatchdogSlowPhase(const char* phase) : previous_phase_(state().phase.load()) {
  state().slow_phases.fetch_add(1, std::memory_order_relaxed);
  state().phase.store(phase, std::memory_order_relaxed);
  state().micro_batch.store(-1, std::memory_order_relaxed);
}

WatchdogSlowPhase::~WatchdogSlowPhase() {
  state().phase.store(previous_phase_, std::memory_order_relaxed);
  state().slow_phases.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace pipeshard
