#include "tools/train/stop_signal.h"

namespace pipeshard {
namespace {

// A handler can only set a flag: one per signal, as a process can receive both.
volatile std::sig_atomic_t got_sigint = 0, got_sigterm = 0;

void record(int signal) { (signal == SIGINT ? got_sigint : got_sigterm) = 1; }

}  // namespace

StopSignals::StopSignals() {
  struct sigaction action {};
  action.sa_handler = record;
  sigemptyset(&action.sa_mask);
  // SA_RESTART: a signal never fails a read, write or MPI progress call half-way.
  action.sa_flags = SA_RESTART | SA_RESETHAND;
  sigaction(SIGINT, &action, &old_int_);
  sigaction(SIGTERM, &action, &old_term_);
}

StopSignals::~StopSignals() {
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
}

int StopSignals::agreed(Communicator& world, bool& flag) const {
  // [SIGINT, SIGTERM, flag]
  double seen[3] = {static_cast<double>(got_sigint), static_cast<double>(got_sigterm), flag ? 1.0 : 0.0};
  if (world.size() > 1) world.all_reduce_sum(seen, 3);
  flag = seen[2] > 0;
  return seen[1] > 0 ? SIGTERM : seen[0] > 0 ? SIGINT : 0;
}

}  // namespace pipeshard
