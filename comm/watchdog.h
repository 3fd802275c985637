// The communication watchdog: a rank that waits too long on other ranks ends itself,
// saying what it waited for, instead of hanging.
//
// mpirun ends the whole job when a rank dies (crash, SIGKILL, exit without finalising),
// so the waits this catches are the ones nothing else ends: a rank stuck in a loop or a
// deadlock, mismatched schedules, a network that drops its packets (a link that goes
// down leaves TCP connections open for many minutes). Every blocking wait of the MPI
// communicator (comm/comm_mpi.cc) registers itself here; a thread wakes a few times a
// second, and when the current wait is older than the limit it prints one line —
//
//   train: rank 2 (stage 1, replica 0, shard 0), step 12, backward of micro-batch 3: a
//   receive from rank 0 has not completed after 60 s; rank 0 has failed, is stuck, or
//   cannot be reached (--comm-timeout)
//
// — and ends the process with status 1, without MPI_Finalize, so mpirun ends the rest.
//
// Only one thread talks to MPI (MPI_THREAD_FUNNELED), so there is one wait at a time. A
// wait costs two clock reads and a few relaxed atomic stores; nothing in the hot path
// allocates.
#ifndef PIPESHARD_COMM_WATCHDOG_H_
#define PIPESHARD_COMM_WATCHDOG_H_

#include <cstdint>
#include <string>

namespace pipeshard {

// Arms the watchdog: from now on a wait longer than `seconds` ends the process. `who`
// names this rank in the message ("rank 2 (stage 1, replica 0, shard 0)"), `tool` starts
// it ("train"), and `limit_hint`, when given, ends it in parentheses: how the limit is set
// ("--comm-timeout sets the limit"; the tools know their flags, the watchdog does not).
// seconds ≤ 0 disarms it. Starts the thread on first use.
void watchdog_arm(double seconds, const std::string& tool, const std::string& who, const std::string& limit_hint = "");
void watchdog_disarm();

// What the rank is doing, for the message: a step (≥ 1, 0: none), a phase ("forward",
// "backward", "gradient all-reduce", ...; a string literal) and a micro-batch (-1: none).
void watchdog_activity(int64_t step, const char* phase, int micro_batch = -1);

// One blocking wait on other ranks, from construction to destruction. `operation` is a
// string literal ("all-reduce", "receive", ...); `ranks` names the world ranks waited on
// ("rank 3", "ranks 0, 2") and must outlive the wait.
class WatchdogWait {
 public:
  WatchdogWait(const char* operation, const std::string* ranks);
  ~WatchdogWait();
  WatchdogWait(const WatchdogWait&) = delete;
  WatchdogWait& operator=(const WatchdogWait&) = delete;
};

// Work that keeps some ranks waiting on one rank for long, by design: evaluation on rank
// 0, writing a checkpoint or the trained model. Waits inside get ten times the limit, so
// a lost rank is still caught, later.
class WatchdogSlowPhase {
 public:
  explicit WatchdogSlowPhase(const char* phase);
  ~WatchdogSlowPhase();
  WatchdogSlowPhase(const WatchdogSlowPhase&) = delete;
  WatchdogSlowPhase& operator=(const WatchdogSlowPhase&) = delete;

 private:
  const char* previous_phase_;
};

}  // namespace pipeshard

#endif  // PIPESHARD_COMM_WATCHDOG_H_
