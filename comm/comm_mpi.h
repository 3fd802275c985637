// The MPI communicator's one knob, for tests: how many floats go into one MPI call.
//
// MPI counts are `int`, so buffers longer than INT_MAX floats travel in pieces. Tests
// lower the piece size to exercise that path with small buffers; everything else uses
// make_world_communicator() (comm.h).
#ifndef PIPESHARD_COMM_COMM_MPI_H_
#define PIPESHARD_COMM_COMM_MPI_H_

#include <climits>
#include <cstdint>
#include <memory>

#include "comm/comm.h"

namespace pipeshard {

inline constexpr int64_t kMaxMpiCount = INT_MAX;

// MPI_COMM_WORLD (initialising MPI as make_world_communicator does) with at most
// `max_elements_per_call` floats per MPI call, 1 ≤ max_elements_per_call ≤ kMaxMpiCount.
// Groups split from it inherit the limit. Only for processes started by an MPI launcher.
std::unique_ptr<Communicator> make_mpi_world_communicator(int64_t max_elements_per_call);

}  // namespace pipeshard

#endif  // PIPESHARD_COMM_COMM_MPI_H_
