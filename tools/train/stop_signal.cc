#include "tools/train/stop_signal.h"

#include <vector>

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

int StopSignals::agreed(Communicator& world, std::initializer_list<bool*> flags) const {
  // [SIGINT, SIGTERM, flags...]
  std::vector<double> seen{static_cast<double>(got_sigint), static_cast<double>(got_sigterm)};
  for (const bool* flag : flags) seen.push_back(*flag ? 1.0 : 0.0);
  if (world.size() > 1) world.all_reduce_sum(seen.data(), static_cast<int64_t>(seen.size()));
  size_t i = 2;
  for (bool* flag : flags) *flag = seen[i++] > 0;
  return seen[1] > 0 ? SIGTERM : seen[0] > 0 ? SIGINT : 0;
}

}  // namespace pipeshard
