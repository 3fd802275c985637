// A machine profile: what the planner (planner/planner.h) needs to know of the machine a
// layout would run on, as measured by `profile` (planner/measure.h) or written by hand to
// describe a machine that is not here. It is profile.json:
//
//   {
//     "format": "pipeshard-profile", "version": 1,
//     "machine": "free text",  "backend": "cpu",
//     "ranks": 4,                          // processes that ran at once while it was measured
//     "linear": [                          // optional: Linear passes timed by shape
//       {"rows": 16, "in": 512, "out": 512,
//        "forward_us": 41.0, "input_grad_us": 38.5, "weight_grad_us": 40.2}
//     ],
//     "gemm_flops_per_s": 1.0e11,          // 2·rows·in·out per pass over its time, for shapes not listed
//     "elementwise_bytes_per_s": 5.0e9,    // bytes read + written per second by elementwise ops
//     "optimizer_params_per_s": 4.0e8,     // parameters one rank's optimizer (Adam) steps per second
//     "op_overhead_us": 2.0,               // fixed cost of every op the runner calls
//     "step_overhead_us": 100.0,           // fixed cost of a step beyond its ops (loss, bookkeeping)
//     "micro_batch_overhead_us": 20.0,     // fixed cost of each micro-batch's passes beyond their ops
//     "compute_scale": 1.15,               // what the model's ops take in a real step over the sum of their
//                                          // times alone (caches, calls between them); 1 when left out
//     "compute_scale_by_rows": [           // optional: the same by a micro-batch's rows (ascending), read
//       {"rows": 4, "scale": 0.9},         // between them on a log scale and held beyond; the optimizer
//       {"rows": 64, "scale": 1.2}         // keeps compute_scale
//     ],
//     "all_busy_slowdown": 2.0,            // ops with every rank computing over ops on one rank alone
//                                          // (ranks that outnumber the cores share them); 1 when left out
//     "slowdown_by_busy_ranks": [1, 1, 1.5, 2.0],  // optional: the same with 1, 2, … ranks computing
//                                          // (one entry per rank, ending at all_busy_slowdown); left
//                                          // out, it is the straight line from 1 to all_busy_slowdown
//     "p2p":        {"latency_us": 5.0,  "bytes_per_s": 2.0e9},
//     "all_reduce": {"latency_us": 10.0, "bytes_per_s": 1.0e9,   // bus bandwidth, as below
//                    "measured": [{"bytes": 3072, "us": 50}, {"bytes": 6291456, "us": 6223}]}
//   }                                      // "measured" optional, in either link: the points timed
//
// Communication follows the alpha-beta model: a point-to-point message of n bytes takes
// latency + n / bytes_per_s; a collective over g ranks moves bus bytes (nccl-tests'
// busbw): all-reduce 2·(g−1)/g·n, reduce-scatter and all-gather (g−1)/g·n of the whole
// n-byte buffer, and takes latency + bus bytes / bytes_per_s. A group of one takes nothing.
// A link with "measured" points (bus bytes for all_reduce) is read between them instead.
#ifndef PIPESHARD_PLANNER_PROFILE_H_
#define PIPESHARD_PLANNER_PROFILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace pipeshard {

// One Linear's three passes at one shape, measured: forward y = x·Wᵀ + b, the input
// gradient dx = dy·W and the weight gradient dW = dyᵀ·x (with db), in µs.
struct LinearTiming {
  int64_t rows = 0, in = 0, out = 0;
  double forward_us = 0, input_grad_us = 0, weight_grad_us = 0;
};

// latency + bytes / bytes_per_s, or where two or more points were measured, the time read
// linearly between them (the first and last segments extended beyond, never below 0): one
// line cannot price both ends (two cores, 4 ranks: an all-reduce of 3 KiB on the bus takes
// 50 µs and of 6 MiB 6.2 ms; the best line on relative error prices the second at 3.5 ms).
struct LinkCost {
  struct Point {
    double bytes = 0, us = 0;
  };
  double latency_us = 0;
  double bytes_per_s = 0;     // > 0
  std::vector<Point> points;  // bytes ascending
  double time_us(double bytes) const;
};

struct MachineProfile {
  std::string machine;  // free text: host, cores, GPU
  std::string backend = "cpu";
  int ranks = 1;  // processes running at once while it was measured
  std::vector<LinearTiming> linear;
  double gemm_flops_per_s = 1e10;
  double elementwise_bytes_per_s = 5e9;
  double optimizer_params_per_s = 2e8;
  double op_overhead_us = 0;
  double step_overhead_us = 0;
  double micro_batch_overhead_us = 0;
  // Every op's time (Linear passes, elementwise ops, the loss, the optimizer; not the
  // fixed overheads or communication) is multiplied by this: measured, it is a real
  // step of the model over the sum its ops' figures predict (planner/measure.h).
  double compute_scale = 1;
  // compute_scale for the ops of micro-batches of `rows` rows, measured at a few (a step of
  // small micro-batches runs its ops nearer their figures alone than one of large: weights
  // stay in cache between them). Empty: compute_scale at every size.
  struct RowsScale {
    int64_t rows = 0;
    double scale = 1;
  };
  std::vector<RowsScale> compute_scale_by_rows;
  // How much slower an op runs while every rank computes than while one computes alone and
  // the others wait (ranks share cores, caches and memory bandwidth). The op
  // figures above are taken with every rank computing; the cost model speeds them up where
  // the schedule leaves ranks idle.
  double all_busy_slowdown = 1;
  // Entry k − 1: how much slower an op runs with k ranks computing at once than with one
  // alone, for k = 1 … ranks (the first 1, the last all_busy_slowdown). Empty: the straight
  // line between them. Two cores under four ranks: about {1, 1, 1.5, 2}.
  std::vector<double> slowdown_by_busy_ranks;
  LinkCost p2p{5, 1e9, {}};
  LinkCost all_reduce{10, 1e9, {}};

  // A Linear pass of `rows` × `in` → `out` in µs: the measured time at that shape, or
  // 2·rows·in·out flops at the rate of the measured shape nearest in flops (log scale),
  // or at gemm_flops_per_s when none is listed.
  double linear_forward_us(int64_t rows, int64_t in, int64_t out) const;
  double linear_input_grad_us(int64_t rows, int64_t in, int64_t out) const;
  double linear_weight_grad_us(int64_t rows, int64_t in, int64_t out) const;
  // Collectives over `group` ranks of a buffer of `bytes` (see the file comment).
  double all_reduce_us(double bytes, int group) const;
  double reduce_scatter_us(double bytes, int group) const;  // all-gather alike
  double send_us(double bytes) const { return p2p.time_us(bytes); }
  // compute_scale_by_rows at `rows` (linear in log rows between its entries, the end ones
  // beyond), or compute_scale without it.
  double compute_scale_at(double rows) const;
  // How much slower than alone an op runs on a rank while a share `others` (0 … 1) of the
  // other ranks compute too: slowdown_by_busy_ranks at 1 + (ranks − 1)·others busy ranks,
  // read between its entries; without it, 1 + (all_busy_slowdown − 1)·others.
  double busy_slowdown(double others) const;
};

// profile.json's text, and a profile read back from it. The reader refuses what is not a
// profile, names the field at fault ("profile.json: 'p2p.bytes_per_s' must be a positive
// number"), and fills the fields a hand-written profile leaves out with the defaults above.
std::string profile_json_text(const MachineProfile& profile);
Result<MachineProfile> parse_profile_json(const std::string& text, const std::string& label);
Result<MachineProfile> read_profile_file(const std::string& path);

}  // namespace pipeshard

#endif  // PIPESHARD_PLANNER_PROFILE_H_
