// SIGINT and SIGTERM while train runs: stop after the current step, at the same step on
// every rank, so that a last checkpoint can be written (tools/train/loop.cc).
//
// The handlers only record the signal. The training loop asks at the end of every step;
// under MPI the ranks add up what each has seen with one all-reduce of two doubles, so
// that a signal that reached only some ranks, or reached them during different steps,
// stops them all after the same step and the checkpoint's collectives match. (Open MPI's
// mpirun turns SIGINT and SIGTERM into SIGTERM for every rank, and SIGKILLs them one
// second later unless odls_base_sigkill_timeout says otherwise; Slurm sends SIGTERM to
// every task and waits KillWait.)
#ifndef PIPESHARD_TOOLS_TRAIN_STOP_SIGNAL_H_
#define PIPESHARD_TOOLS_TRAIN_STOP_SIGNAL_H_

#include <csignal>
#include <initializer_list>

#include "comm/comm.h"

namespace pipeshard {

// Handlers for SIGINT and SIGTERM for as long as it lives; the destructor puts back
// the ones before. A second signal of the same kind takes its default action: the
// process ends at once.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The signal to stop for, or 0 to go on: SIGTERM if any rank has received one, else
  // SIGINT if any has. Collective over `world` when it has more than one rank. The `flags`
  // ride on the same all-reduce: each comes back true when it was true on any rank (the
  // training loop's "a gradient was not finite here", "a batch read bad data here"), which
  // costs no collective of their own.
  int agreed(Communicator& world, std::initializer_list<bool*> flags) const;

 private:
  struct sigaction old_int_ {
  }, old_term_{};
};

}  // namespace pipeshard

#endif  // PIPESHARD_TOOLS_TRAIN_STOP_SIGNAL_H_
