#include "planner/cost_model.h"

#include <algorithm>
#include <utility>

#include "schedule/registry.h"
#include "schedule/schedule.h"

namespace pipeshard {
namespace {

constexpr double kFloat = 4;  // bytes per element: everything is priced in fp32

// How many times an op's elementwise passes touch its output's size in bytes, forward
// and backward (reads and writes together): y = f(x) reads x and writes y (2), its
// backward reads dy and x and adds into dx (4). Normalisations make a few passes more.
struct Passes {
  double forward = 0, backward = 0;
};

Passes elementwise_passes(const Node& n) {
  switch (n.kind) {
    case OpKind::kActivation: return {2, 4};
    case OpKind::kAdd: return {3, 4};
    case OpKind::kSoftmax:
    case OpKind::kLogSoftmax: return {4, 5};
    case OpKind::kLayerNorm:
    case OpKind::kBatchNorm: return {5, 8};
    case OpKind::kDropout: return {3, 3};
    default: return {0, 0};  // Reshape aliases; Linear and the collectives are priced apart
  }
}

// What one micro-batch's passes of one piece cost, the tensor-parallel share apart.
struct PieceCost {
  double forward = 0, input = 0, weight = 0;  // µs, collectives included
  double collectives = 0;                     // µs of the three above spent in tensor-parallel collectives
};

class PieceCoster {
 public:
  // Every op's figure times `scale`.
  PieceCoster(const Graph& g, const Plan& plan, const MachineProfile& profile, double scale)
      : g_(g), profile_(profile), shards_(plan.options.tensor_parallel), rows_(micro_batch_size(plan.options)),
        scale_(scale), fused_(fused_activations(g)),
        recomputed_(plan.options.recompute_activations ? recomputable_values(g, plan.options.kept_when_fused)
                                                       : std::vector<bool>(g.values.size(), false)),
        needs_grad_(g.values.size(), false) {
    // A value needs a gradient when a parameter lies upstream of it (the model's inputs do not).
    for (const Node& n : g.nodes) {
      bool upstream = !g.node_params(n).empty();
      for (int in : n.inputs) upstream = upstream || needs_grad_[in];
      for (int out : n.outputs) needs_grad_[out] = upstream;
    }
  }

  PieceCost cost(const StagePlan& piece) const {
    PieceCost c;
    for (size_t k = 0; k < piece.nodes.size(); ++k) {
      const ShardRole role = piece.roles.empty() ? ShardRole::kReplicated : piece.roles[k];
      add_node(g_.nodes[piece.nodes[k]], static_cast<size_t>(piece.nodes[k]), role, c);
    }
    return c;
  }

  double rows() const { return static_cast<double>(rows_); }
  double scale() const { return scale_; }

 private:
  void add_node(const Node& n, size_t id, ShardRole role, PieceCost& c) const {
    const double overhead = profile_.op_overhead_us, scale = scale_;
    if (n.kind == OpKind::kLinear) {
      int64_t in = n.in_features, out = n.out_features;
      if (role == ShardRole::kColumn || role == ShardRole::kColumnGather) out /= shards_;
      if (role == ShardRole::kRow) in /= shards_;
      const bool dx = needs_grad_[n.inputs[0]];
      c.forward += scale * (profile_.linear_forward_us(rows_, in, out) + overhead);
      // The backward call (dx and dW in one where B is whole) pays the overhead once.
      c.input += scale * ((dx ? profile_.linear_input_grad_us(rows_, in, out) : 0) + overhead);
      c.weight += scale * profile_.linear_weight_grad_us(rows_, in, out);
      const double in_bytes = kFloat * static_cast<double>(rows_ * n.in_features);
      const double out_bytes = kFloat * static_cast<double>(rows_ * n.out_features);
      double forward_comm = 0, backward_comm = 0;
      if (role == ShardRole::kRow) forward_comm = profile_.all_reduce_us(out_bytes, shards_);
      if (role == ShardRole::kColumnGather) forward_comm = profile_.reduce_scatter_us(out_bytes, shards_);
      if ((role == ShardRole::kColumn || role == ShardRole::kColumnGather) && dx) {
        backward_comm = profile_.all_reduce_us(in_bytes, shards_);
      }
      c.forward += forward_comm;
      c.input += backward_comm;
      c.collectives += forward_comm + backward_comm;
      return;
    }
    const Passes passes = elementwise_passes(n);
    if (passes.forward == 0) return;
    int64_t width = g_.values[n.outputs[0]].shape.per_sample_elements();
    if (role == ShardRole::kShardLocal) width /= shards_;
    const double bytes = kFloat * static_cast<double>(rows_ * width);
    const double rate = profile_.elementwise_bytes_per_s / 1e6;  // bytes per µs
    // A fused activation runs in its Linear's epilogue: no call of its own in forward.
    c.forward += scale * (passes.forward * bytes / rate + (fused_[id] ? 0 : overhead));
    c.input += scale * (passes.backward * bytes / rate + overhead);
    if (recomputed_[n.outputs[0]]) c.input += scale * (passes.forward * bytes / rate + overhead);
  }

  const Graph& g_;
  const MachineProfile& profile_;
  int shards_;
  int64_t rows_;
  double scale_;
  std::vector<bool> fused_, recomputed_, needs_grad_;
};

// The loss on the last piece's output: a few passes over the logits, forward and back,
// its figure times `scale`.
double loss_us(const Graph& g, const MachineProfile& profile, double rows, double scale) {
  double elements = 0;
  for (int y : g.outputs) elements += rows * static_cast<double>(g.values[y].shape.per_sample_elements());
  return scale * (6 * kFloat * elements / (profile.elementwise_bytes_per_s / 1e6) + 2 * profile.op_overhead_us);
}

// Trainable parameter elements one rank of each stage holds: a sharded Linear's 1/T.
std::vector<double> parameters_per_rank(const Graph& g, const Plan& plan) {
  std::vector<double> params(static_cast<size_t>(plan.options.stages), 0.0);
  const int t = plan.options.tensor_parallel;
  for (const StagePlan& piece : plan.stages) {
    for (size_t k = 0; k < piece.nodes.size(); ++k) {
      const Node& n = g.nodes[piece.nodes[k]];
      const ShardRole role = piece.roles.empty() ? ShardRole::kReplicated : piece.roles[k];
      double count = static_cast<double>(g.node_parameter_count(n));
      if (role == ShardRole::kColumn || role == ShardRole::kColumnGather) {
        count /= t;  // weight and bias both split by output
      } else if (role == ShardRole::kRow) {
        count = static_cast<double>(n.in_features / t * n.out_features) + (n.bias >= 0 ? n.out_features : 0);
      }
      params[piece.holder] += count;
    }
  }
  return params;
}

}  // namespace

std::string LayoutPrediction::bottleneck() const {
  const std::pair<double, const char*> parts[] = {
      {compute_us, "compute"},          {bubble_us, "bubble"},       {tensor_parallel_us, "tensor-parallel"},
      {data_parallel_us, "all-reduce"}, {optimizer_us, "optimizer"}, {overhead_us, "overhead"}};
  return std::max_element(std::begin(parts), std::end(parts))->second;
}

namespace {

// One layout's step, every op at its figure in `profile` times `speed` (and its compute
// scale).
LayoutPrediction predict_with(const Graph& g, const Plan& plan, const Layout& layout, const MachineProfile& profile,
                              double speed) {
  const PartitionOptions& o = plan.options;
  const int stages = o.stages, m = micro_batch_count(o), d = layout.replicas;
  const PieceCoster coster(g, plan, profile,
                           speed * profile.compute_scale_at(static_cast<double>(micro_batch_size(o))));
  LayoutPrediction out;
  std::vector<double> collectives(static_cast<size_t>(stages), 0.0);  // per micro-batch, summed over its pieces
  double largest_cut = 0;
  for (size_t c = 0; c < plan.stages.size(); ++c) {
    const StagePlan& piece = plan.stages[c];
    PieceCost pc = coster.cost(piece);
    if (c + 1 == plan.stages.size()) {
      const double loss = loss_us(g, profile, coster.rows(), coster.scale());
      pc.forward += loss / 2, pc.input += loss / 2;
    } else {
      largest_cut = std::max(largest_cut, static_cast<double>(piece.activation_bytes_out) * coster.rows());
    }
    // The runner's fixed cost of a micro-batch's passes, half in each direction.
    pc.forward += profile.micro_batch_overhead_us / 2, pc.input += profile.micro_batch_overhead_us / 2;
    out.costs.forward.push_back(pc.forward);
    out.costs.backward_input.push_back(pc.input);
    out.costs.backward_weight.push_back(pc.weight);
    collectives[piece.holder] += pc.collectives;
  }
  out.costs.transfer = stages > 1 ? profile.send_us(largest_cut) : 0;
  const PipelineSchedule schedule = make_pipeline_schedule(o.schedule, stages, m, {}, o.virtual_stages);
  const SchedulePrediction sp = predict_schedule(schedule, out.costs);
  double busy = 0, span = 0;
  for (int s = 0; s < stages; ++s) busy += sp.busy[s], span = std::max(span, sp.end[s]);
  out.busy_share = span > 0 ? busy / (stages * span) : 1;

  // After the schedule: each stage's gradient reduction and optimizer step.
  const std::vector<double> params = parameters_per_rank(g, plan);
  const int zero = d > 1 ? layout.zero : 0;
  // ZeRO-2 reduces every micro-batch's gradients in windows, except where train runs it as
  // stage 1: under a split backward or several chunks per stage.
  const bool windows = zero == 2 && schedule.backward_whole_in_one_chunk();
  double finish = -1;
  for (int s = 0; s < stages; ++s) {
    const double bytes = kFloat * params[s];
    // The backward passes of the stage's last micro-batch, which the reduction overlaps.
    double last_backward = 0, all_backward = 0;
    for (size_t c = 0; c < plan.stages.size(); ++c) {
      if (plan.stages[c].holder != s) continue;
      last_backward += out.costs.backward_input[c] + out.costs.backward_weight[c];
    }
    all_backward = last_backward * m;
    const double bucket = std::min(bytes, static_cast<double>(o.bucket_bytes));
    double exposed = 0;
    if (d > 1) {
      if (zero == 0) {
        exposed = std::max(profile.all_reduce_us(bucket, d), profile.all_reduce_us(bytes, d) - last_backward);
      } else {
        const double passes = windows ? m : 1;
        const double window = windows ? all_backward : last_backward;
        exposed =
            std::max(profile.reduce_scatter_us(bucket, d), passes * profile.reduce_scatter_us(bytes, d) - window) +
            profile.reduce_scatter_us(bytes, d);  // the all-gather of the updated slices
      }
    }
    const double optimizer =
        speed * profile.compute_scale * (zero > 0 ? params[s] / d : params[s]) / profile.optimizer_params_per_s * 1e6;
    const double stage_finish = sp.end[s] + exposed + optimizer;
    if (stage_finish > finish) {
      finish = stage_finish;
      out.critical_stage = s;
      out.data_parallel_us = exposed;
      out.optimizer_us = optimizer;
      out.tensor_parallel_us = collectives[s] * m;
      out.compute_us = sp.busy[s] - out.tensor_parallel_us;
      out.bubble_us = sp.end[s] - sp.busy[s];
    }
  }
  out.overhead_us = profile.step_overhead_us;
  out.step_us = finish + out.overhead_us;
  return out;
}

}  // namespace

LayoutPrediction predict_layout(const Graph& g, const Plan& plan, const Layout& layout, const MachineProfile& profile) {
  const LayoutPrediction all_busy = predict_with(g, plan, layout, profile, 1);
  const double s = profile.all_busy_slowdown;
  if (s <= 1) return all_busy;
  // The op figures are times with every rank computing. Where the schedule leaves ranks
  // idle (a pipeline's bubble), the others share the cores with fewer: while a rank computes,
  // a share u of the others do too (u the share of the schedule the ranks compute), and its
  // ops take busy_slowdown(u) / s of their figures.
  return predict_with(g, plan, layout, profile, profile.busy_slowdown(all_busy.busy_share) / s);
}

}  // namespace pipeshard
