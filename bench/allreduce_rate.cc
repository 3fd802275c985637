// bench_allreduce: bus bandwidth of the communicator's all-reduce, and of the reduce-scatter and
// all-gather that ZeRO splits it into.
//
// Under mpirun -np N, times these ways of moving a float32 buffer of `bytes` over the ranks
// (comm/comm.h; "raw" ways call MPI on MPI_COMM_WORLD directly, to show what the wrapper costs):
//   all_reduce                 Communicator::all_reduce(data, n, kSum)            in place
//   async+wait                 Communicator::all_reduce_async(...)->wait()
//   MPI_Allreduce              raw MPI_Allreduce(MPI_IN_PLACE, ...)
//   rs+ag                      Communicator::reduce_scatter, then all_gather, both in place in data
//                              (this rank's block of data becomes its sum, then is gathered): an
//                              all-reduce in ZeRO's two steps, copying no more than all_reduce does
//   rs+ag_async                the same with reduce_scatter_async(...)->wait(), all_gather_async(...)->wait()
//   MPI_RSB+Allgather          raw MPI_Reduce_scatter_block(data → block), then MPI_Allgather(block → data)
//   reduce_scatter             Communicator::reduce_scatter alone, in place
//   MPI_Reduce_scatter_block   raw, alone (data → block: MPI's in place has another layout)
//   all_gather                 Communicator::all_gather alone, in place (as ZeRO gathers its weights)
//   MPI_Allgather              raw, alone, MPI_IN_PLACE
// where data holds the whole buffer and block holds 1/N of it. The reduce-scatter and all-gather ways
// move the first N·⌊floats/N⌋ floats.
// For buffers from min_bytes to max_bytes, doubling, `repetitions` times: one untimed call, a
// barrier, then `iters` back-to-back calls; a repetition's time is the slowest rank's elapsed time /
// iters (a collective is done when every rank is). The ways alternate within a repetition, in an
// order shuffled anew for each (the same on every rank), so that a burst of outside load hits all
// of them alike and no way always follows the same other one; the untimed call keeps what the
// previous way left behind (caches, skew between ranks) out of the time. Printed
// per size and way (the nccl-tests conventions, doc/PERFORMANCE.md there):
//   time  = median over repetitions (µs)
//   algbw = bytes / time                     (GB/s, 1e9 bytes; the whole buffer's bytes, moved ones)
//   busbw = algbw · 2(n−1)/n  for an all-reduce, and for a reduce-scatter followed by an all-gather
//           algbw · (n−1)/n   for a reduce-scatter or an all-gather alone
// (what each rank's link carries per unit time in a ring, comparable across rank counts) and a
// correctness column: before timing, each way moves rank-dependent integers once and every element
// is compared with the exact result (ok / WRONG). Timing runs on zeros, so that repeated in-place
// sums cannot overflow.
//
// Usage: mpirun -np N bench_allreduce [--ways=WAY,WAY,...] [min_bytes max_bytes] [repetitions]
//        (default: every way, 4096 67108864 10). Exit status 1 when a check fails, 2 on bad arguments.
// Without mpirun it runs as a group of one (the communicator copies; MPI is not used).
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace {

using pipeshard::Communicator;
using pipeshard::ReduceOp;

// data: the whole buffer, floats = N·block of it used by the split ways; block: one rank's 1/N.
struct Buffers {
  std::vector<float> data;   // [floats]
  std::vector<float> block;  // [floats / N]
  int64_t block_n() const { return static_cast<int64_t>(block.size()); }
};

// What a way computes, which decides its check and its bus factor.
enum class Result {
  kAllReduce,      // data = Σ over ranks of data (the split ways: its first N·block floats)
  kReduceScatter,  // block, or block `rank` of data in place, = Σ over ranks of block `rank` of data
  kAllGather,      // data = every rank's block, in rank order
};
// Where a reduce-scatter leaves its result.
enum class Placement { kBlock, kInPlace };

struct Way {
  const char* name;
  Result result;
  bool split;  // moves N·block floats rather than the whole buffer
  std::function<void(Communicator&, Buffers&)> run;
  Placement placement = Placement::kBlock;
};

void copy_floats(const float* from, float* to, int64_t n) { std::memcpy(to, from, sizeof(float) * n); }

// In a group of one the raw ways have no MPI to call: the result is a copy, or the data itself.
const std::vector<Way>& all_ways() {
  static const std::vector<Way> ways = {
      {"all_reduce", Result::kAllReduce, false,
       [](Communicator& c, Buffers& b) {
         c.all_reduce(b.data.data(), static_cast<int64_t>(b.data.size()), ReduceOp::kSum);
       }},
      {"async+wait", Result::kAllReduce, false,
       [](Communicator& c, Buffers& b) {
         c.all_reduce_async(b.data.data(), static_cast<int64_t>(b.data.size()), ReduceOp::kSum)->wait();
       }},
      {"MPI_Allreduce", Result::kAllReduce, false,
       [](Communicator& c, Buffers& b) {
         if (c.size() == 1) return;
         MPI_Allreduce(MPI_IN_PLACE, b.data.data(), static_cast<int>(b.data.size()), MPI_FLOAT, MPI_SUM,
                       MPI_COMM_WORLD);
       }},
      {"rs+ag", Result::kAllReduce, true,
       [](Communicator& c, Buffers& b) {
         float* mine = b.data.data() + c.rank() * b.block_n();
         c.reduce_scatter(b.data.data(), mine, b.block_n(), ReduceOp::kSum);
         c.all_gather(mine, b.data.data(), b.block_n());
       }},
      {"rs+ag_async", Result::kAllReduce, true,
       [](Communicator& c, Buffers& b) {
         float* mine = b.data.data() + c.rank() * b.block_n();
         c.reduce_scatter_async(b.data.data(), mine, b.block_n(), ReduceOp::kSum)->wait();
         c.all_gather_async(mine, b.data.data(), b.block_n())->wait();
       }},
      {"MPI_RSB+Allgather", Result::kAllReduce, true,
       [](Communicator& c, Buffers& b) {
         const int n = static_cast<int>(b.block_n());
         if (c.size() == 1) return;
         MPI_Reduce_scatter_block(b.data.data(), b.block.data(), n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
         MPI_Allgather(b.block.data(), n, MPI_FLOAT, b.data.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
       }},
      {"reduce_scatter", Result::kReduceScatter, true,
       [](Communicator& c, Buffers& b) {
         c.reduce_scatter(b.data.data(), b.data.data() + c.rank() * b.block_n(), b.block_n(), ReduceOp::kSum);
       },
       Placement::kInPlace},
      {"MPI_Reduce_scatter_block", Result::kReduceScatter, true,
       [](Communicator& c, Buffers& b) {
         if (c.size() == 1) return copy_floats(b.data.data(), b.block.data(), b.block_n());
         MPI_Reduce_scatter_block(b.data.data(), b.block.data(), static_cast<int>(b.block_n()), MPI_FLOAT, MPI_SUM,
                                  MPI_COMM_WORLD);
       }},
      {"all_gather", Result::kAllGather, true,
       [](Communicator& c, Buffers& b) {
         c.all_gather(b.data.data() + c.rank() * b.block_n(), b.data.data(), b.block_n());
       }},
      {"MPI_Allgather", Result::kAllGather, true,
       [](Communicator& c, Buffers& b) {
         const int n = static_cast<int>(b.block_n());
         if (c.size() == 1) return;  // in place: the block is where it belongs
         MPI_Allgather(MPI_IN_PLACE, n, MPI_FLOAT, b.data.data(), n, MPI_FLOAT, MPI_COMM_WORLD);
       }},
  };
  return ways;
}

// 2(n−1)/n for an all-reduce's traffic, (n−1)/n for half of it.
double bus_factor(Result result, int ranks) {
  const double half = static_cast<double>(ranks - 1) / ranks;
  return result == Result::kAllReduce ? 2 * half : half;
}

// Rank r contributes (r + 1) · (i mod 8 + 1) at element i of the whole buffer; the sum over n ranks
// is n(n+1)/2 · (i mod 8 + 1), exact in float for any rank count a machine runs.
float contribution(int rank, int64_t i) { return static_cast<float>((rank + 1) * (i % 8 + 1)); }

bool check(Communicator& comm, const Way& way, Buffers& b) {
  const int rank = comm.rank();
  const int64_t n = static_cast<int64_t>(b.data.size()), block = b.block_n();
  const int64_t moved = way.split ? block * comm.size() : n;
  const float ranks_sum = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
  for (int64_t i = 0; i < n; ++i) b.data[i] = contribution(rank, i);
  for (int64_t j = 0; j < block; ++j) b.block[j] = contribution(rank, rank * block + j);
  way.run(comm, b);
  bool ok = true;
  switch (way.result) {
    case Result::kAllReduce:
      for (int64_t i = 0; i < moved && ok; ++i) ok = b.data[i] == ranks_sum * (i % 8 + 1);
      break;
    case Result::kReduceScatter: {
      const float* mine = way.placement == Placement::kInPlace ? b.data.data() + rank * block : b.block.data();
      for (int64_t j = 0; j < block && ok; ++j) ok = mine[j] == ranks_sum * ((rank * block + j) % 8 + 1);
      break;
    }
    case Result::kAllGather:
      for (int64_t i = 0; i < moved && ok; ++i) ok = b.data[i] == contribution(static_cast<int>(i / block), i);
      break;
  }
  return comm.all_reduce_sum(ok ? 0.0 : 1.0) == 0.0;  // every rank agrees on the verdict
}

// Seconds per call of the slowest rank, over `iters` back-to-back calls after an untimed one.
double time_calls(Communicator& comm, const Way& way, Buffers& b, int iters) {
  way.run(comm, b);
  comm.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) way.run(comm, b);
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

// The ways named in "a,b,c", in the order of all_ways(); empty when a name is unknown.
std::vector<const Way*> select_ways(const std::string& list) {
  std::vector<std::string> names;
  for (size_t start = 0; start <= list.size();) {
    const size_t comma = std::min(list.find(',', start), list.size());
    names.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  std::vector<const Way*> chosen;
  for (const std::string& name : names) {
    const auto it = std::find_if(all_ways().begin(), all_ways().end(), [&](const Way& w) { return w.name == name; });
    if (it == all_ways().end()) {
      std::fprintf(stderr, "bench_allreduce: unknown way '%s'\n", name.c_str());
      return {};
    }
  }
  for (const Way& way : all_ways()) {
    if (std::find(names.begin(), names.end(), way.name) != names.end()) chosen.push_back(&way);
  }
  return chosen;
}

int usage() {
  std::string names;
  for (const Way& way : all_ways()) names += std::string(names.empty() ? "" : ",") + way.name;
  std::fprintf(stderr,
               "usage: mpirun -np N bench_allreduce [--ways=WAY,...] [min_bytes max_bytes] [repetitions]\n"
               "  (bytes: multiples of 4, min <= max < 8 GiB; default 4096 67108864 10)\n"
               "  ways (default all): %s\n",
               names.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<const Way*> ways;
  for (const Way& way : all_ways()) ways.push_back(&way);
  std::vector<const char*> args;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--ways=", 7) == 0) {
      ways = select_ways(argv[i] + 7);
      if (ways.empty()) return usage();
    } else {
      args.push_back(argv[i]);
    }
  }
  const size_t positional = args.size();
  const int64_t min_bytes = positional >= 2 ? std::atoll(args[0]) : 4096;
  const int64_t max_bytes = positional >= 2 ? std::atoll(args[1]) : int64_t{64} << 20;
  const int repetitions = positional == 1 ? std::atoi(args[0]) : positional >= 3 ? std::atoi(args[2]) : 10;
  if (min_bytes < 4 || min_bytes % 4 != 0 || max_bytes < min_bytes || max_bytes / 4 > INT32_MAX || repetitions < 1 ||
      positional > 3) {
    return usage();
  }
  std::unique_ptr<Communicator> comm = pipeshard::make_world_communicator();
  const int ranks = comm->size();
  if (comm->rank() == 0) {
    std::printf(
        "all-reduce, reduce-scatter and all-gather rate, %d ranks, float32; time = median over %d repetitions of the "
        "slowest rank's time for `iters` back-to-back calls / iters\n",
        ranks, repetitions);
    std::printf(
        "algbw = bytes moved / time (GB/s = 1e9 B/s); busbw = algbw * 2(n-1)/n = algbw * %.3f for an all-reduce or a "
        "reduce-scatter + all-gather, algbw * (n-1)/n = algbw * %.3f for either alone\n",
        bus_factor(Result::kAllReduce, ranks), bus_factor(Result::kReduceScatter, ranks));
    std::printf("%12s %10s %6s %-24s %12s %12s %12s %6s\n", "bytes", "floats", "iters", "way", "time_us", "algbw_GB/s",
                "busbw_GB/s", "check");
  }
  bool all_ok = true;
  const size_t way_count = ways.size();
  for (int64_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    const int64_t floats = bytes / 4;
    Buffers buffers{std::vector<float>(static_cast<size_t>(floats)),
                    std::vector<float>(static_cast<size_t>(floats / ranks))};
    std::vector<bool> ok(way_count);
    for (size_t w = 0; w < way_count; ++w) ok[w] = check(*comm, *ways[w], buffers);
    const int iters = iterations_for(bytes);
    std::fill(buffers.data.begin(), buffers.data.end(), 0.0f);
    std::fill(buffers.block.begin(), buffers.block.end(), 0.0f);
    for (const Way* way : ways) way->run(*comm, buffers);  // warm-up
    std::vector<std::vector<double>> seconds(way_count);
    std::vector<size_t> order(way_count);
    std::iota(order.begin(), order.end(), size_t{0});
    std::mt19937 shuffler(static_cast<uint32_t>(bytes));  // the same sequence on every rank
    for (int r = 0; r < repetitions; ++r) {
      std::shuffle(order.begin(), order.end(), shuffler);
      for (size_t w : order) seconds[w].push_back(time_calls(*comm, *ways[w], buffers, iters));
    }
    for (size_t w = 0; w < way_count; ++w) {
      all_ok = all_ok && ok[w];
      if (comm->rank() != 0) continue;
      const Way& way = *ways[w];
      const int64_t moved = way.split ? buffers.block_n() * ranks * 4 : bytes;
      const double t = median(seconds[w]), algbw = static_cast<double>(moved) / t / 1e9;
      std::printf("%12lld %10lld %6d %-24s %12.2f %12.3f %12.3f %6s\n", static_cast<long long>(bytes),
                  static_cast<long long>(floats), iters, way.name, t * 1e6, algbw,
                  algbw * bus_factor(way.result, ranks), ok[w] ? "ok" : "WRONG");
    }
    if (comm->rank() == 0) std::fflush(stdout);
  }
  return all_ok ? 0 : 1;
}
