// The Communicator conformance suite: what comm/comm.h promises, checked the same way on
// every implementation (the group of one, the in-process group, MPI, the staged
// communicator, NCCL). Each case is a function of the communicator under test that runs
// on every rank of it and checks with GoogleTest assertions; every value is a small
// integer or a dyadic fraction, so sums are exact in any order and a wrong order, a
// missing contribution or a mixed-up message shows as a plain inequality.
//
// The cases call the same operations in the same order on every rank, so they run under
// mpiexec as they run on threads (testing/in_process_comm.h's run_ranks); an ASSERT_ that
// fails on one rank only can leave the others waiting (the in-process group reports that,
// MPI runs into the test's timeout). Float buffers live in the communicator's own memory
// (CommMemory): host memory for MPI and the in-process group, a backend's memory for the
// staged communicator, the GPU for NCCL.
//
// The barrier case compares steady_clock readings across ranks, so all ranks must run on
// one machine (threads, or processes of one host: CLOCK_MONOTONIC is system-wide).
#ifndef PIPESHARD_TESTING_COMM_CONFORMANCE_H_
#define PIPESHARD_TESTING_COMM_CONFORMANCE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"

namespace pipeshard {

// The memory a communicator's float buffers (and the doubles of all_reduce_sum(double*, n))
// live in, and how the suite reaches it from the host.
class CommMemory {
 public:
  virtual ~CommMemory() = default;
  // n ≥ 1 floats, aligned for doubles; the suite frees what it allocates.
  virtual float* allocate(int64_t n) = 0;
  virtual void deallocate(float* p) = 0;
  // Copies n floats host → memory and memory → host; both complete before they return.
  virtual void upload(float* dst, const float* host, int64_t n) = 0;
  virtual void download(float* host, const float* src, int64_t n) = 0;
};

// Plain host memory.
std::unique_ptr<CommMemory> make_host_comm_memory();
// `backend`'s memory, through its allocate/deallocate/upload/download; the backend must
// outlive it.
std::unique_ptr<CommMemory> make_backend_comm_memory(Backend& backend);

// Whether point-to-point works in a group of one (the single-process communicator refuses it).
enum class SelfTransfers { kSupported, kRefused };
// Whether receives match sends by tag (MPI, in-process) or only by issue order (NCCL has no
// tags; comm.h lets schedules rely on issue order only).
enum class TagMatching { kPerTag, kIssueOrderOnly };
// The order in which a reduce-scatter sums each element: rank order, ((x0 + x1) + x2) + …
// (MPI, the in-process group, the staged communicator over them), or one of the
// communicator's own (NCCL's ring). Either way it never depends on timing (comm.h).
enum class ReduceScatterOrder { kRankOrder, kCommunicatorsOwn };

// One rank's view of the communicator under test.
struct CommUnderTest {
  Communicator& world;
  CommMemory& memory;
  SelfTransfers self_transfers = SelfTransfers::kSupported;
  TagMatching tags = TagMatching::kPerTag;
  ReduceScatterOrder reduce_scatter_order = ReduceScatterOrder::kRankOrder;
};

// One case of the suite: a GoogleTest name and the function every rank runs.
struct ConformanceCase {
  const char* name;
  void (*run)(const CommUnderTest& comm);
};

// Every case, in a fixed order (the same on every rank).
const std::vector<ConformanceCase>& comm_conformance_cases();

// Registers one GoogleTest test per case, named `suite`.<case name>, whose body calls
// run_case(case): it sets up the communicator under test (on one rank, or on the threads of
// an in-process job) and calls case.run. Call before RUN_ALL_TESTS, in the same order on
// every rank of an MPI job.
void register_comm_conformance_tests(const std::string& suite,
                                     const std::function<void(const ConformanceCase&)>& run_case);

}  // namespace pipeshard

#endif  // PIPESHARD_TESTING_COMM_CONFORMANCE_H_
