// Measuring a machine profile (planner/profile.h) on the machine this runs on, as the
// `profile` tool does under mpirun: every rank times the same work at the same moment, so
// ranks that share cores (or a memory bus) are measured as they will train.
#ifndef PIPESHARD_PLANNER_MEASURE_H_
#define PIPESHARD_PLANNER_MEASURE_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "ir/graph.h"
#include "planner/profile.h"

namespace pipeshard {

// A Linear's shape: rows × in → out.
struct LinearSize {
  int64_t rows = 0, in = 0, out = 0;
  auto operator<=>(const LinearSize&) const = default;
};

// Every Linear shape a layout of `graph` on `ranks` processes with a global batch of
// `batch_size` may run: rows B/D/M for each D dividing N and M dividing B/D up to
// `max_micro_batches`, each Linear whole and with its in or out features split by each T
// dividing N that divides them. Sorted, each once.
std::vector<LinearSize> model_linear_sizes(const Graph& graph, int ranks, int64_t batch_size, int max_micro_batches);
// Every message size, in bytes, a layout of `graph` on `ranks` processes may send or
// all-reduce, and MeasureOptions' four (the only ones with one rank): activations (rows × a Linear's in or out
// features, rows as above) between stages and in tensor-parallel collectives, and gradients
// (the model's, over each P·T it may be split into, at most one bucket of `bucket_bytes`) in
// data-parallel reductions, all-reduce and ZeRO's reduce-scatter alike. An all-reduce size
// is the buffer that, all-reduced over all `ranks`, moves the bus bytes (planner/profile.h)
// the layout's group would, so that the link is read at a measured point rather than
// between two far apart (model A's 2.7 MB of gradients lay between 1 and 8 MiB, where the
// time per byte of two ranks' all-reduce on the 2-core VM changes threefold). Sorted; of
// sizes within 10 % of each other only the smallest.
std::vector<int64_t> model_message_bytes(const Graph& graph, int ranks, int64_t batch_size, int max_micro_batches,
                                         int64_t bucket_bytes);
// The elements of each trainable parameter tensor of `graph`.
std::vector<int64_t> model_parameter_elements(const Graph& graph);

struct MeasureOptions {
  std::vector<LinearSize> linear;    // shapes to time (none: only the GEMM rate at a square shape)
  double seconds_per_figure = 0.02;  // at least this long repeating each figure's work
  // Each figure is the median of this many takes, the takes of every figure in turn (a
  // sweep over all of them, then the next): on a shared machine the speed wanders by ±20 %
  // from one second to the next (a 2-core VM: per-second medians of one GEMM loop 8.6 to
  // 14.2 ms), and a figure taken at one moment carries that moment into the prices of the
  // shapes relative to each other, which is what ranks the layouts.
  int sweeps = 3;
  // Message sizes for point-to-point and all-reduce, in bytes (a model's:
  // model_message_bytes as well).
  std::vector<int64_t> message_bytes = {4 << 10, 64 << 10, 1 << 20, 8 << 20};
  int64_t elementwise_elements = 1 << 20;  // size of the elementwise figure
  // The parameter tensors the optimizer steps, elements each: one Adam sweep over all of
  // them, as a step makes it, gives the optimizer rate. Empty: one tensor of
  // elementwise_elements.
  std::vector<int64_t> parameter_elements;
  // The model to calibrate compute_scale on (planner/profile.h), and the plan's global
  // batch and largest micro-batch count: every rank trains the whole model alone on B/N
  // rows (B when N does not divide it) for a few steps. Null or a batch of 0: scale 1.
  const Graph* model = nullptr;
  int64_t batch_size = 0;
  int max_micro_batches = 16;
  std::string machine;                               // profile.machine
  std::function<void(const std::string&)> progress;  // a line now and then (rank 0), or null
};

// Everything a plan of `graph` on `ranks` processes with a global batch of `batch_size` and
// up to `max_micro_batches` micro-batches needs measured: its Linear shapes, its message
// sizes, its parameter tensors, and the model itself for compute_scale. `graph` must outlive the options.
MeasureOptions model_measure_options(const Graph& graph, int ranks, int64_t batch_size, int max_micro_batches);

// Times `options.linear` (forward, input and weight gradient), the elementwise and Adam
// rates, a call's fixed cost, with a model a step of it (compute_scale), and with several
// ranks point-to-point messages between pairs of ranks (all pairs at once) and
// all-reduces over all of them. Each figure is a block of repeats run on every rank at
// once, over the repeats, averaged over the ranks. Collective over `world`; every rank
// returns the same profile.
MachineProfile measure_profile(Backend& backend, Communicator& world, const MeasureOptions& options);

// latency + bytes / bytes_per_s fitted to (bytes, µs) points by least squares on the
// relative error (each point weighted by 1/µs², so a 4 KiB message's 50 µs is fitted as
// closely as a 6 MiB message's 6 ms); the latency is at least 0 and the rate positive (a
// flat or falling line gives the rate of the largest message alone).
LinkCost fit_link(const std::vector<std::pair<double, double>>& bytes_us);

// Each scale replaced by the least-squares line through all of them in log rows, at its rows
// (clamped to 0.25 … 4): compute_scale_by_rows from three or more steps. One step's figure on
// ranks that share cores moves by 20–30 % from one profile to the next (model A on 4 processes,
// 16 rows: 0.92x, then 1.22x), more than the trend it is there for.
void smooth_in_log_rows(std::vector<MachineProfile::RowsScale>& scales);

// The figures `take` returns (as many each time), taken `sweeps` times (at least once) one
// after the other, each the median of its takes (MeasureOptions::sweeps; with an even count,
// the mean of the middle two). The same on every rank when each take's figures are.
std::vector<double> median_of_sweeps(int sweeps, const std::function<std::vector<double>()>& take);

}  // namespace pipeshard

#endif  // PIPESHARD_PLANNER_MEASURE_H_
