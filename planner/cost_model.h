// The predicted step time of one layout on one machine profile.
//
// predict_layout() prices every pass of every model chunk from the profile, as the stage
// runner runs it (runtime/stage_runner.cc, program/program.cc):
// - forward F of a chunk for one micro-batch of r = B/D/M rows: each Linear's GEMM at its
//   shard's shape (r × in → out, in or out divided by T as its tensor-parallel role says),
//   the elementwise ops by the bytes they read and write, a fixed overhead per op and half
//   the fixed cost of a micro-batch's passes (the other half in I), and the
//   tensor-parallel all-reduce (row-parallel) or all-gather (column-gather) of its output;
// - input-gradient half I: each Linear's dx product (not for the model's input), the
//   elementwise backwards, the activations recomputed (unless --keep-activations), and the
//   all-reduce of a column-parallel Linear's partial dx; weight half W: the dW products.
//   A whole B costs I + W;
// - a transfer between stages: one point-to-point message of the activation that crosses
//   the cut (the largest cut's).
// The pipeline schedule then runs on those costs (schedule/predict.h), which gives each
// stage's schedule time: its compute plus its waits. After it, each stage:
// - reduces its gradients over the D replicas: launched bucket by bucket as backward
//   makes them final (runtime/gradient_sync.h), so only what outlasts the stage's last
//   backward pass is exposed, and at least the last bucket's reduction. ZeRO reduce-
//   scatters instead (half the bytes on the wire) and all-gathers the updated slices
//   after the optimizer (exposed); ZeRO-2's windows reduce every micro-batch's gradients,
//   overlapped with the whole of backward;
// - steps its optimizer over its parameters (1/D of them under ZeRO).
// The step ends when the slowest stage has, plus a fixed overhead per step.
// Every op's time (not the fixed overheads, not communication) is the profile's figure
// times its compute_scale: what the ops take in a real step over what they take alone
// (compute_scale_at the layout's micro-batch rows; the optimizer's, compute_scale).
// Where ranks share cores (all_busy_slowdown s > 1: figures taken with every rank
// computing), a layout whose schedule keeps the ranks computing a share u of the time
// runs its ops at busy_slowdown(u) / s of the figures (planner/profile.h: the measured
// slowdown with 1 + (N − 1)·u ranks computing, or 1 + (s − 1)·u): the step is priced once
// at the figures to find u, then again with them so scaled.
#ifndef PIPESHARD_PLANNER_COST_MODEL_H_
#define PIPESHARD_PLANNER_COST_MODEL_H_

#include <string>
#include <vector>

#include "ir/graph.h"
#include "partitioner/layout_search.h"
#include "partitioner/plan.h"
#include "planner/profile.h"
#include "schedule/predict.h"

namespace pipeshard {

// Where a step's time goes on the stage that finishes last, in µs. compute + bubble +
// tensor_parallel + data_parallel + optimizer + overhead == step.
struct LayoutPrediction {
  double step_us = 0;
  double compute_us = 0;          // its F, I, W work (tensor-parallel collectives excluded)
  double bubble_us = 0;           // its schedule time beyond its passes: waits for other stages and transfers
  double tensor_parallel_us = 0;  // its tensor-parallel collectives inside the passes
  double data_parallel_us = 0;    // exposed gradient reduction, and ZeRO's all-gather
  double optimizer_us = 0;
  double overhead_us = 0;  // the profile's fixed cost per step
  int critical_stage = 0;  // the stage that finishes last
  double busy_share = 1;   // the share of the schedule the ranks spend in their passes, over the stages
  PassCosts costs;         // per micro-batch and model chunk, µs (TP collectives included)
  // The largest share of the step: "compute", "bubble", "tensor-parallel",
  // "all-reduce" (data-parallel), "optimizer" or "overhead".
  std::string bottleneck() const;
};

// `plan` must be make_plan(graph, …, layout_partition_options(layout, …)): the cut the
// layout trains with.
LayoutPrediction predict_layout(const Graph& graph, const Plan& plan, const Layout& layout,
                                const MachineProfile& profile);

}  // namespace pipeshard

#endif  // PIPESHARD_PLANNER_COST_MODEL_H_
