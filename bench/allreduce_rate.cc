// bench_allreduce: all-reduce bus bandwidth of the communicator that train averages gradients with.
//
// Under mpirun -np N, times three ways of summing a float32 buffer over the ranks, in place:
//   all_reduce   Communicator::all_reduce(data, n, kSum)          (comm/comm.h; MPI_Allreduce)
//   async+wait   Communicator::all_reduce_async(...)->wait()       (MPI_Iallreduce + MPI_Wait)
//   MPI          MPI_Allreduce(MPI_IN_PLACE, ..., MPI_COMM_WORLD)   (raw, for the wrapper's overhead)
// for buffers from min_bytes to max_bytes, doubling. For each size, `repetitions` times: a barrier,
// then `iters` back-to-back calls; a repetition's time is the slowest rank's elapsed time / iters
// (a collective is done when every rank is). The three ways alternate within a repetition, in an
// order that rotates from one repetition to the next, so that a burst of outside load hits all
// three alike. Printed per size and way (the nccl-tests conventions, doc/PERFORMANCE.md there):
//   time  = median over repetitions (µs)
//   algbw = bytes / time                     (GB/s, 1e9 bytes)
//   busbw = algbw · 2(n−1)/n                  (what each rank's link carries in a ring all-reduce)
// and a correctness column: before timing, each way reduces rank-dependent integers once and
// every element is compared with the exact sum (ok / WRONG). Timing runs on zeros, so that
// repeated in-place sums cannot overflow.
//
// Usage: mpirun -np N bench_allreduce [min_bytes max_bytes] [repetitions]
//        (default 4096 67108864 10). Exit status 1 when a check fails, 2 on bad arguments.
// Without mpirun it runs as a group of one (the communicator copies; MPI is not used).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace {

using pipeshard::Communicator;
using pipeshard::ReduceOp;

enum class Way { kAllReduce, kAsyncWait, kMpi };
constexpr Way kWays[] = {Way::kAllReduce, Way::kAsyncWait, Way::kMpi};
constexpr int kWayCount = 3;

const char* way_name(Way way) {
  switch (way) {
    case Way::kAllReduce: return "all_reduce";
    case Way::kAsyncWait: return "async+wait";
    case Way::kMpi: return "MPI_Allreduce";
  }
  return "?";
}

// data[n] = Σ over ranks, in place, the given way.
void reduce(Communicator& comm, Way way, float* data, int64_t n) {
  switch (way) {
    case Way::kAllReduce: comm.all_reduce(data, n, ReduceOp::kSum); return;
    case Way::kAsyncWait: comm.all_reduce_async(data, n, ReduceOp::kSum)->wait(); return;
    case Way::kMpi:
      if (comm.size() == 1) return;  // no MPI in a group of one: in place, the sum is the data
      MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      return;
  }
}

// Rank r holds (r + 1) · (i mod 8 + 1) at element i; the sum over n ranks is n(n+1)/2 · (i mod 8 + 1),
// exact in float for any rank count a machine runs.
bool check(Communicator& comm, Way way, std::vector<float>& data) {
  const int64_t n = static_cast<int64_t>(data.size());
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>((comm.rank() + 1) * (i % 8 + 1));
  reduce(comm, way, data.data(), n);
  const double ranks = comm.size();
  bool ok = true;
  for (int64_t i = 0; i < n && ok; ++i) ok = data[i] == static_cast<float>(ranks * (ranks + 1) / 2 * (i % 8 + 1));
  return comm.all_reduce_sum(ok ? 0.0 : 1.0) == 0.0;  // every rank agrees on the verdict
}

// Seconds per call of the slowest rank, over `iters` back-to-back calls.
double time_calls(Communicator& comm, Way way, std::vector<float>& data, int iters) {
  comm.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) reduce(comm, way, data.data(), static_cast<int64_t>(data.size()));
  const double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  if (comm.size() == 1) return mine;
  double slowest = mine;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

// Enough calls per repetition that one takes about 20 ms once the buffer is large, and at least 2.
int iterations_for(int64_t bytes) {
  return static_cast<int>(std::clamp<int64_t>((int64_t{128} << 20) / bytes, 2, 200));
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t min_bytes = argc > 2 ? std::atoll(argv[1]) : 4096;
  const int64_t max_bytes = argc > 2 ? std::atoll(argv[2]) : int64_t{64} << 20;
  const int repetitions = argc == 2 ? std::atoi(argv[1]) : argc > 3 ? std::atoi(argv[3]) : 10;
  if (min_bytes < 4 || min_bytes % 4 != 0 || max_bytes < min_bytes || max_bytes / 4 > INT32_MAX || repetitions < 1) {
    std::fprintf(stderr,
                 "usage: mpirun -np N bench_allreduce [min_bytes max_bytes] [repetitions]\n"
                 "  (bytes: multiples of 4, min <= max < 8 GiB; default 4096 67108864 10)\n");
    return 2;
  }
  std::unique_ptr<Communicator> comm = pipeshard::make_world_communicator();
  const int ranks = comm->size();
  const double bus_factor = 2.0 * (ranks - 1) / ranks;
  if (comm->rank() == 0) {
    std::printf(
        "all-reduce rate, %d ranks, float32 sum in place; time = median over %d repetitions of the slowest "
        "rank's time for `iters` back-to-back calls / iters\n",
        ranks, repetitions);
    std::printf("algbw = bytes / time (GB/s = 1e9 B/s); busbw = algbw * 2(n-1)/n = algbw * %.3f\n", bus_factor);
    std::printf("%12s %10s %6s %-14s %12s %12s %12s %6s\n", "bytes", "floats", "iters", "way", "time_us", "algbw_GB/s",
                "busbw_GB/s", "check");
  }
  bool all_ok = true;
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    std::vector<float> data(static_cast<size_t>(bytes / 4));
    bool ok[kWayCount];
    for (int w = 0; w < kWayCount; ++w) ok[w] = check(*comm, kWays[w], data);
    std::fill(data.begin(), data.end(), 0.0f);
    const int iters = iterations_for(bytes);
    for (Way way : kWays) reduce(*comm, way, data.data(), static_cast<int64_t>(data.size()));  // warm-up
    std::vector<double> seconds[kWayCount];
    for (int r = 0; r < repetitions; ++r) {
      for (int k = 0; k < kWayCount; ++k) {
        const int w = (r + k) % kWayCount;  // rotate which way goes first
        seconds[w].push_back(time_calls(*comm, kWays[w], data, iters));
      }
    }
    for (int w = 0; w < kWayCount; ++w) {
      all_ok = all_ok && ok[w];
      if (comm->rank() != 0) continue;
      const double t = median(seconds[w]), algbw = bytes / t / 1e9;
      std::printf("%12lld %10lld %6d %-14s %12.2f %12.3f %12.3f %6s\n", static_cast<long long>(bytes),
                  static_cast<long long>(bytes / 4), iters, way_name(kWays[w]), t * 1e6, algbw, algbw * bus_factor,
                  ok[w] ? "ok" : "WRONG");
    }
    if (comm->rank() == 0) std::fflush(stdout);
  }
  return all_ok ? 0 : 1;
}
