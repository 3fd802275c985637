// Faults on purpose, for the tests that prove no rank hangs when another one fails
// (tests/tools/rank_failure_test.cc) and that checkpoints survive a crash mid-write
// (tests/tools/checkpoint_kill_test.cc). `train` reads them from the environment variable
// PIPESHARD_FAULT_AT; nothing else sets them, and without it every check is one compare.
//
//   PIPESHARD_FAULT_AT=checkpoint:BYTES | checkpoint:synced | checkpoint:renamed
//       SIGKILL inside the first checkpoint write (common/atomic_file.h's CrashPoint).
//   PIPESHARD_FAULT_AT=WHERE:STEP:HOW:RANK
//       world rank RANK fails at optimizer step STEP (1-based), WHERE it is then:
//         forward      before the forward pass of the step's first micro-batch
//         backward     before the backward pass of the step's first micro-batch
//         all-reduce   at the step's first collective after the schedule, where the
//                      other ranks wait inside it (gradients, else the loss)
//         optimizer    before the optimizer step
//       and HOW it fails:
//         kill   SIGKILL, as the kernel's out-of-memory killer would
//         abort  abort(): a crash (SIGABRT)
//         exit   exit(0) without a word: a rank that leaves as if it were done
//         hang   never returns: a rank stuck in a loop or a deadlock
//       Before it fails the rank says so on stderr, so a test can tell the fault from
//       its consequences.
#ifndef PIPESHARD_COMMON_FAULT_INJECTION_H_
#define PIPESHARD_COMMON_FAULT_INJECTION_H_

#include <cstdint>
#include <string>

#include "common/atomic_file.h"
#include "common/status.h"

namespace pipeshard {

enum class FaultWhere { kNowhere, kForward, kBackward, kAllReduce, kOptimizer };
enum class FaultHow { kKill, kAbort, kExit, kHang };

struct InjectedFaults {
  CrashPoint checkpoint;
  FaultWhere where = FaultWhere::kNowhere;
  FaultHow how = FaultHow::kKill;
  int64_t step = 0;
  int rank = 0;
};

// Parses PIPESHARD_FAULT_AT (unset or empty: no fault); a malformed value is an error
// that names the accepted forms.
Result<InjectedFaults> faults_from_environment();

// Makes `faults` the training fault of this process, world rank `world_rank`.
void set_training_fault(const InjectedFaults& faults, int world_rank);

// Fails here if the training fault is set for this rank, `where` and `step`.
void fault_point(FaultWhere where, int64_t step);

}  // namespace pipeshard

#endif  // PIPESHARD_COMMON_FAULT_INJECTION_H_
