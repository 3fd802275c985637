// The Communicator conformance suite (testing/comm_conformance.h) on the communicators that
// run in one process: the group of one, the in-process group (ranks as threads,
// testing/in_process_comm.h) at 1 to 4 ranks, and the staged communicator over it with the
// CPU backend. MPI runs the same suite under mpiexec (tests/comm/comm_mpi_main.cc), NCCL on
// a GPU (tests/cuda/nccl_comm_test.cc).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "comm/comm_staged.h"
#include "testing/comm_conformance.h"
#include "testing/in_process_comm.h"

namespace pipeshard {
namespace {

// ---- The suite on every in-process communicator ------------------------------------------

void run_on_single_process(const ConformanceCase& c) {
  std::unique_ptr<Communicator> world = make_single_process_communicator();
  std::unique_ptr<CommMemory> memory = make_host_comm_memory();
  c.run({*world, *memory, SelfTransfers::kRefused, TagMatching::kPerTag});
}

void run_in_process(int size, const ConformanceCase& c) {
  run_ranks(size, [&](Communicator& world) {
    std::unique_ptr<CommMemory> memory = make_host_comm_memory();
    c.run({world, *memory, SelfTransfers::kSupported, TagMatching::kPerTag});
  });
}

// Each rank stages through a CPU backend of its own, as each GPU process has its own device.
void run_staged_in_process(int size, const ConformanceCase& c) {
  run_ranks(size, [&](Communicator& world) {
    std::unique_ptr<Backend> cpu = make_cpu_backend();
    std::unique_ptr<Communicator> staged = make_staged_communicator(world, *cpu);
    std::unique_ptr<CommMemory> memory = make_backend_comm_memory(*cpu);
    c.run({*staged, *memory, SelfTransfers::kSupported, TagMatching::kPerTag});
  });
}

const bool registered = [] {
  register_comm_conformance_tests("SingleProcessConformance", run_on_single_process);
  for (int size = 1; size <= 4; ++size) {
    register_comm_conformance_tests("InProcess" + std::to_string(size) + "Conformance",
                                    [size](const ConformanceCase& c) { run_in_process(size, c); });
  }
  register_comm_conformance_tests("StagedInProcess3Conformance",
                                  [](const ConformanceCase& c) { run_staged_in_process(3, c); });
  return true;
}();

}  // namespace
}  // namespace pipeshard
