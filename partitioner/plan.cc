#include "partitioner/plan.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "ir/buffer_sharing.h"
#include "ir/op_table.h"
#include "partitioner/pipeline_split.h"
#include "partitioner/tensor_parallel.h"
#include "schedule/registry.h"

namespace pipeshard {
namespace {

constexpr int64_t kFloatBytes = 4;

bool starts_layer(const Graph& g, const Node& n) { return !g.node_params(n).empty(); }

// Where each value lives, in layers: produced in layer `made` (-1 for model inputs),
// last needed in layer `last` (`layers` for model outputs, which the loss reads).
struct LiveRange {
  int made = -1;
  int last = -1;
};

std::vector<LiveRange> live_ranges(const Graph& g, const std::vector<int>& layer, int layers) {
  std::vector<LiveRange> r(g.values.size());
  for (size_t v = 0; v < g.values.size(); ++v) {
    const Value& val = g.values[v];
    r[v].made = val.producer < 0 ? -1 : layer[val.producer];
    r[v].last = r[v].made;
    for (int c : val.consumers) r[v].last = std::max(r[v].last, layer[c]);
  }
  for (int v : g.outputs) r[v].last = layers;
  return r;
}

int64_t value_bytes(const Graph& g, int v) { return g.values[v].shape.per_sample_elements() * kFloatBytes; }

// What the memory estimate needs of the schedule, per chunk (a pipeline stage when each
// holds one): the micro-batches it keeps alive at once (its program's slots, as the stage
// runner assigns them), and whether its stage runs backwards as halves (I, W), as the
// trainer decides it: then each Linear keeps its output's gradient per slot from I to W
// (program/program_plan.cc).
struct ChunkSchedule {
  std::vector<int> holder, in_flight;  // [chunks]
  std::vector<bool> split;             // [chunks]
};

ChunkSchedule chunk_schedule(const PartitionOptions& o) {
  const PipelineSchedule sc = make_pipeline_schedule(o.schedule, o.stages, micro_batch_count(o), {}, o.virtual_stages);
  ChunkSchedule c;
  for (int k = 0; k < sc.chunks(); ++k) {
    const PipelineSchedule::Place place = sc.place_of(k);
    c.holder.push_back(place.stage);
    c.in_flight.push_back(max_in_flight_of_chunk(sc, place.stage, place.j));
    c.split.push_back(splits_backward(sc.actions[place.stage]));
  }
  return c;
}

// Into how many parts a node running as `role` splits its output: a column-parallel,
// shard-local or column-gather node makes one shard's features.
int64_t output_parts(ShardRole role, int shards) {
  const bool split = role == ShardRole::kColumn || role == ShardRole::kShardLocal || role == ShardRole::kColumnGather;
  return split ? shards : 1;
}

// Per-layer figures: trainable parameters (each tensor at its first use), all parameter
// elements (running statistics too), flops and activation bytes kept for backward, all
// as if unsharded (the balance's view; a stage's estimate uses its shard roles).
struct LayerFigures {
  std::vector<int64_t> params, all_param_elements, flops, activation_bytes;
};

LayerFigures layer_figures(const Graph& g, const std::vector<int>& layer, int layers,
                           const std::vector<bool>& recomputed) {
  LayerFigures f{std::vector<int64_t>(layers), std::vector<int64_t>(layers), std::vector<int64_t>(layers),
                 std::vector<int64_t>(layers)};
  std::set<int> seen;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const Node& n = g.nodes[i];
    const int l = layer[i];
    for (int p : g.node_params(n)) {
      if (!seen.insert(p).second) continue;
      f.all_param_elements[l] += g.params[p].elements();
      if (g.params[p].trainable) f.params[l] += g.params[p].elements();
    }
    f.flops[l] += g.node_flops_per_sample(n);
    f.activation_bytes[l] += node_kept_bytes(g, n, recomputed, ShardRole::kReplicated, 1);
  }
  return f;
}

// The program of stage `s` as the memory estimate needs it, over the model graph's ids.
// Its steps, as program/program_plan.cc numbers them up to the nodes the stage file adds:
// node m's forward at 2m (the AllReduce or AllGather after a sharded Linear at 2m + 1),
// and backward in reverse from 4 * nodes (backward_step()).
struct StageProgram {
  std::vector<int> owner;         // [values]: whose buffers v shares (a Reshape's input's), or v
  std::vector<int> last_reader;   // [values]: its last reader among the stage's nodes, or -1
  std::vector<int> first_writer;  // [owners]: the last of their and their aliases' producers and readers
  std::vector<bool> needs_grad;   // [values]: a trainable parameter (past the first piece, an input) upstream
  int backward_base = 0;
  int backward_step(int forward_step) const { return backward_base - forward_step; }
};

StageProgram stage_program(const Graph& g, const std::map<std::string, int>& by_name, const StagePlan& s) {
  const size_t nv = g.values.size();
  StageProgram p;
  p.owner.resize(nv);
  for (size_t v = 0; v < nv; ++v) p.owner[v] = static_cast<int>(v);
  p.last_reader.assign(nv, -1);
  p.first_writer.assign(nv, -1);
  p.needs_grad.assign(nv, false);
  p.backward_base = 4 * static_cast<int>(g.nodes.size());
  for (const TensorSpec& t : s.inputs) p.needs_grad[by_name.at(t.name)] = s.stage > 0;
  for (int m : s.nodes) {
    const Node& n = g.nodes[m];
    const int y = n.outputs[0];
    bool upstream = !g.node_params(n).empty();
    for (int in : n.inputs) {
      upstream = upstream || p.needs_grad[in];
      p.last_reader[in] = m;  // nodes ascend
      p.first_writer[p.owner[in]] = std::max(p.first_writer[p.owner[in]], m);
    }
    p.needs_grad[y] = upstream;
    if (output_aliases_input(n.kind)) p.owner[y] = p.owner[n.inputs[0]];
    p.first_writer[p.owner[y]] = std::max(p.first_writer[p.owner[y]], m);
  }
  return p;
}

// Per sample, the buffers that the gradients of stage `s`'s values share inside one
// backward, coloured as the program's plan colours them (plan_gradient_buffers() in
// program/program_plan.cc; share_gradient_buffers()). Such a value is one a stage node
// makes, that needs a gradient, and that has no gradient buffers of its own: not in `own`
// (the stage's outputs and the values they alias), no Reshape output (its input's
// gradient), no Linear's output under a split backward (kept per slot for W); and a
// column-gathered Linear's shard, between the Linear and its AllGather. Each lives from
// its producer to its last reader in the stage (or to a Reshape of it, or that Reshape's
// last reader). With residuals more than two live at once: the gradient of the value a
// branch skips waits while the branch's backward runs.
int64_t shared_gradient_bytes(const Graph& g, const StageProgram& p, bool split, const StagePlan& s, int shards,
                              const std::set<int>& own) {
  std::vector<GradientSpan> spans;
  for (size_t i = 0; i < s.nodes.size(); ++i) {
    const int m = s.nodes[i];
    const Node& n = g.nodes[m];
    const ShardRole role = s.roles[i];
    const bool gathered = role == ShardRole::kColumnGather;
    const int y = n.outputs[0];
    if (gathered && !split) spans.push_back({2 * m, 2 * m + 1, value_bytes(g, y) / shards});
    if (own.count(y) || output_aliases_input(n.kind) || !p.needs_grad[y]) continue;
    if (split && n.kind == OpKind::kLinear && !gathered) continue;
    const int made = gathered ? 2 * m + 1 : 2 * m;
    const int64_t bytes = gathered ? value_bytes(g, y) : value_bytes(g, y) / output_parts(role, shards);
    spans.push_back({made, std::max(made, 2 * p.first_writer[y]), bytes});
  }
  int64_t bytes = 0;
  for (int64_t b : share_gradient_buffers(spans).sizes) bytes += b;
  return bytes;
}

// Per sample, the one-slot buffers that the stage's recomputed values share, coloured as
// the program's plan colours them (plan_recomputed_values() in program/program_plan.cc;
// share_buffers()): each needs its buffer from the node that writes it (its Linear, when
// fused into one that runs in the stage unsharded or column-parallel) to its last reader
// in forward, and from the backward of its last reader whose backward reads it back to its
// producer's backward. Not `own` values: the stage's outputs are kept.
int64_t recomputed_bytes(const Graph& g, const StageProgram& p, const StagePlan& s, int shards,
                         const std::vector<bool>& recomputed, const std::set<int>& own) {
  const std::vector<bool> fused = fused_activations(g);
  std::map<int, ShardRole> role_of;  // [model node]
  for (size_t i = 0; i < s.nodes.size(); ++i) role_of[s.nodes[i]] = s.roles[i];
  std::vector<std::pair<int, BufferLife>> lives;  // (forward step it is written at, its life)
  for (size_t i = 0; i < s.nodes.size(); ++i) {
    const int m = s.nodes[i];
    const Node& n = g.nodes[m];
    const int y = n.outputs[0];
    if (!recomputed[y] || own.count(y)) continue;
    const int linear = g.values[n.inputs[0]].producer;
    const auto linear_role = role_of.find(linear);
    const bool fused_here =
        fused[m] && linear_role != role_of.end() &&
        (linear_role->second == ShardRole::kReplicated || linear_role->second == ShardRole::kColumn);
    const int written = 2 * (fused_here ? linear : m);
    BufferLife life;
    life.spans.emplace_back(written, p.last_reader[y] < 0 ? written : 2 * p.last_reader[y]);
    life.size = value_bytes(g, y) / output_parts(s.roles[i], shards);
    int first_reader = -1;  // in backward order: the highest node
    for (int c : g.values[y].consumers) {
      const bool reads = role_of.count(c) && backward_reads_input(g.nodes[c].kind);
      if (reads && p.needs_grad[g.nodes[c].outputs[0]]) first_reader = std::max(first_reader, c);
    }
    if (first_reader >= 0) life.spans.emplace_back(p.backward_step(2 * first_reader), p.backward_step(2 * m));
    lives.emplace_back(written, std::move(life));
  }
  std::stable_sort(lives.begin(), lives.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<BufferLife> ordered;
  for (auto& [written, life] : lives) ordered.push_back(std::move(life));
  int64_t bytes = 0;
  for (int64_t b : share_buffers(ordered).sizes) bytes += b;
  return bytes;
}

// The gradient buckets train cuts stage `s`'s parameter gradients into
// (runtime/gradient_sync.h: laid out in the order the nodes use them, bucketed from the
// end, each closing once it holds `bucket_bytes`, never splitting a parameter): how many,
// and the two windows ZeRO stage 2 puts them in (bucket i in window i mod 2, each as big as
// its largest bucket; where a parameter is shared, the whole buffer). Sizes scale to a
// shard's when the stage is tensor-parallel (`param_elements` of the whole).
struct ZeroBuckets {
  int64_t count = 0, window_elements = 0;
};

ZeroBuckets zero_buckets(const Graph& g, const PartitionOptions& o, const StagePlan& s, int64_t param_elements) {
  std::vector<int64_t> sizes;
  std::map<int, int> users;
  int64_t whole = 0;  // every parameter the stage's nodes use, as param_elements counts them
  for (int i : s.nodes) {
    for (int q : g.node_params(g.nodes[i])) {
      if (users[q]++ > 0) continue;
      whole += g.params[q].elements();
      if (g.params[q].trainable) sizes.push_back(g.params[q].elements());
    }
  }
  const double scale = whole > 0 ? static_cast<double>(param_elements) / static_cast<double>(whole) : 1.0;
  const int64_t per_bucket = std::max<int64_t>(1, o.bucket_bytes / kFloatBytes);
  int64_t windows[2] = {0, 0}, open = 0;
  ZeroBuckets b;
  for (auto it = sizes.rbegin(); it != sizes.rend(); ++it) {
    open += static_cast<int64_t>(static_cast<double>(*it) * scale);
    if (open >= per_bucket || it + 1 == sizes.rend()) {
      windows[b.count % 2] = std::max(windows[b.count % 2], open);
      ++b.count;
      open = 0;
    }
  }
  b.window_elements = windows[0] + windows[1];
  // A parameter several nodes share can hold its bucket's window across other buckets,
  // which then need more windows (GradientSync's assign_windows()): count the whole buffer.
  for (const auto& [q, n] : users) {
    if (n > 1) b.window_elements = param_elements;
  }
  return b;
}

// Estimate per rank of stage `k`: parameters, their gradients and optimizer state; what
// its nodes keep for backward in every slot in flight (node_kept_bytes()), and with a
// split backward each Linear's output gradient there too; and the working set beside them:
// - the stage's inputs in every slot, and their gradients when an earlier stage made
//   them; its outputs' gradients there too, and recomputed values that leave the stage
//   (kept, since the next stage or the loss reads them);
// - one micro-batch of the buffers that values share, coloured as the program colours
//   them: activation gradients (shared_gradient_bytes()) and recomputed activations
//   (recomputed_bytes()); two of each for an MLP, more with residual branches;
// - one micro-batch of tensor-parallel scratch: an AllGather's whole output, and the
//   input gradient a column-parallel Linear computes in part.
int64_t memory_bytes(const Graph& g, const PartitionOptions& o, int in_flight, bool split, bool one_chunk,
                     const StagePlan& s, int64_t param_elements, const std::vector<bool>& recomputed) {
  std::map<std::string, int> by_name;
  for (size_t v = 0; v < g.values.size(); ++v) by_name[g.values[v].name] = static_cast<int>(v);
  auto bytes = [](const TensorSpec& t) { return t.shape.per_sample_elements() * kFloatBytes; };
  int64_t per_slot = 0;
  std::set<int> outputs;
  for (const TensorSpec& t : s.inputs) per_slot += bytes(t) * (s.stage > 0 ? 2 : 1);
  for (const TensorSpec& t : s.outputs) {
    const int v = by_name.at(t.name);
    outputs.insert(v);
    per_slot += bytes(t) * (recomputed[v] ? 2 : 1);
  }
  for (auto i = s.nodes.rbegin(); i != s.nodes.rend(); ++i) {  // a Reshape's input shares its output's buffers
    const Node& n = g.nodes[*i];
    if (output_aliases_input(n.kind) && outputs.count(n.outputs[0])) outputs.insert(n.inputs[0]);
  }
  const int shards = o.tensor_parallel;
  int64_t scratch = 0;  // per sample, one micro-batch
  for (size_t i = 0; i < s.nodes.size(); ++i) {
    const Node& n = g.nodes[s.nodes[i]];
    const ShardRole role = s.roles[i];
    per_slot += node_kept_bytes(g, n, recomputed, role, shards);
    const int y = n.outputs[0];
    if (role == ShardRole::kColumnGather) scratch += value_bytes(g, y);
    if (role == ShardRole::kColumn || role == ShardRole::kColumnGather) scratch += value_bytes(g, n.inputs[0]);
    // With a split backward a Linear's output gradient waits for W in every slot (a stage
    // output's has its own buffers anyway, above; a gathered Linear's output is its shard).
    const bool own_buffers = outputs.count(y) && role != ShardRole::kColumnGather;
    if (split && n.kind == OpKind::kLinear && !own_buffers) per_slot += value_bytes(g, y) / output_parts(role, shards);
  }
  const StageProgram program = stage_program(g, by_name, s);
  const int64_t shared = shared_gradient_bytes(g, program, split, s, shards, outputs) +
                         recomputed_bytes(g, program, s, shards, recomputed, outputs) + scratch;
  // Weights, gradients and the optimizer's state; under ZeRO a replica's share of the state
  // (runtime/zero_shards.h) and with stage 2, where every backward pass is whole, of the
  // gradients too, beside two windows of buckets (runtime/gradient_sync.h), unless that is
  // no smaller than the whole buffer.
  // Each bucket's tail (under D elements) is on every replica.
  const int64_t d = std::max(o.zero_replicas, 1);
  const ZeroBuckets buckets = d > 1 ? zero_buckets(g, o, s, param_elements) : ZeroBuckets{};
  const int64_t owned = d == 1 ? param_elements : param_elements / d + buckets.count * (d - 1);
  const int64_t state = owned * o.optimizer_slots;
  int64_t gradients = param_elements;
  if (d > 1 && o.zero_stage >= 2 && !split && one_chunk) {
    gradients = std::min(gradients, owned + buckets.window_elements);
  }
  return (param_elements + gradients + state) * kFloatBytes + micro_batch_size(o) * (in_flight * per_slot + shared);
}

PipelineSplitProblem make_problem(const PartitionOptions& o, const ChunkSchedule& chunks, const LayerFigures& f,
                                  std::vector<int64_t> cut_bytes) {
  PipelineSplitProblem p;
  p.stages = static_cast<int>(chunks.holder.size());
  p.cut_bytes = std::move(cut_bytes);
  switch (o.balance) {
    case BalanceBy::kParams: p.unit_cost = f.params; break;
    case BalanceBy::kFlops: p.unit_cost = f.flops; break;
    case BalanceBy::kMemory:
      for (int64_t e : f.all_param_elements) p.unit_cost.push_back(e * kFloatBytes * (2 + o.optimizer_slots));
      p.unit_activation = f.activation_bytes;
      for (int n : chunks.in_flight) p.stage_activation_factor.push_back(n * micro_batch_size(o));
      break;
  }
  return p;
}

TensorSpec spec(const Graph& g, int v) { return TensorSpec{g.values[v].name, g.values[v].shape}; }

void fill_stage_values(const Graph& g, const std::vector<LiveRange>& live, StagePlan& s) {
  std::set<int> in_stage(s.nodes.begin(), s.nodes.end());
  for (size_t v = 0; v < g.values.size(); ++v) {
    const Value& val = g.values[v];
    const bool made_here = val.producer >= 0 && in_stage.count(val.producer);
    const bool made_before = live[v].made < s.first_layer;
    const bool read_here =
        std::any_of(val.consumers.begin(), val.consumers.end(), [&](int c) { return in_stage.count(c) > 0; });
    if (made_before && read_here) s.inputs.push_back(spec(g, static_cast<int>(v)));
    if (made_here && live[v].last >= s.end_layer) s.outputs.push_back(spec(g, static_cast<int>(v)));
    if (made_before && live[v].last >= s.end_layer) s.carried.push_back(spec(g, static_cast<int>(v)));
  }
}

Status check_options(const PartitionOptions& o) {
  if (o.stages < 1)
    return Status::invalid("stages", "a model needs at least 1 pipeline stage, not " + std::to_string(o.stages));
  if (o.tensor_parallel < 1) {
    return Status::invalid("tensor_parallel",
                           "a stage needs at least 1 tensor-parallel shard, not " + std::to_string(o.tensor_parallel));
  }
  if (o.batch_size < 1 || o.batch_size > kMaxBatchSize) {
    return Status::invalid("batch_size", "the batch size must be between 1 and " + std::to_string(kMaxBatchSize) +
                                             ", not " + std::to_string(o.batch_size));
  }
  if (o.micro_batches < 0 || o.micro_batches > o.batch_size) {
    return Status::invalid("micro_batches", "micro-batches must be between 1 and the batch size, " +
                                                std::to_string(o.batch_size) + ", not " +
                                                std::to_string(o.micro_batches));
  }
  if (Status s = check_schedule_counts(o.schedule, o.stages, micro_batch_count(o), o.virtual_stages); !s) {
    return s.setting().empty() ? Status::invalid("schedule", s.message()) : s;
  }
  if (o.zero_replicas < 1) {
    return Status::invalid("zero_replicas",
                           "a stage needs at least 1 data-parallel replica, not " + std::to_string(o.zero_replicas));
  }
  if (o.zero_stage < 0 || o.zero_stage > 2) {
    return Status::invalid("zero_stage", "the ZeRO stage must be 0, 1 or 2, not " + std::to_string(o.zero_stage));
  }
  if (o.bucket_bytes < 0) return Status::invalid("bucket_bytes", "the gradient bucket size must be positive");
  return Status::ok();
}

}  // namespace

std::vector<int64_t> memory_per_stage(const Plan& plan) {
  std::vector<int64_t> bytes(static_cast<size_t>(plan.options.stages), 0);
  for (const StagePlan& s : plan.stages) bytes[s.holder] += s.memory_bytes;
  return bytes;
}

int micro_batch_count(const PartitionOptions& o) { return o.micro_batches > 0 ? o.micro_batches : o.stages; }

int64_t micro_batch_size(const PartitionOptions& o) {
  const int m = micro_batch_count(o);
  return (o.batch_size + m - 1) / m;
}

int64_t node_kept_bytes(const Graph& g, const Node& n, const std::vector<bool>& recomputed, ShardRole role,
                        int shards) {
  const int y = n.outputs[0];
  const int64_t part = output_parts(role, shards);
  int64_t bytes = 0;
  if (!output_aliases_input(n.kind) && !recomputed[y]) bytes += value_bytes(g, y) / part;
  if (role == ShardRole::kColumnGather) bytes += value_bytes(g, y);
  return bytes + saved_bytes_per_sample(g, n, part);
}

std::vector<int> layer_of_nodes(const Graph& g) {
  // A node with parameters opens a new layer; parameter-free nodes join the layer
  // before them (those ahead of the first layer join the first).
  std::vector<int> layer(g.nodes.size(), 0);
  int current = 0;
  bool opened = false;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    if (starts_layer(g, g.nodes[i])) {
      if (opened) ++current;
      opened = true;
    }
    layer[i] = current;
  }
  return layer;
}

Result<Plan> make_plan(const Graph& g, const std::string& model_path, const PartitionOptions& o) {
  PIPESHARD_RETURN_IF_ERROR(check_options(o));
  const std::vector<int> layer = layer_of_nodes(g);
  const int layers = layer.empty() ? 0 : layer.back() + 1;
  const ChunkSchedule chunks = chunk_schedule(o);
  const int pieces = static_cast<int>(chunks.holder.size());
  if (pieces > layers && pieces == o.stages) {
    return Status::error("cannot make " + std::to_string(o.stages) + " non-empty stages from " +
                         std::to_string(layers) + " layers");
  }
  if (pieces > layers) {
    return Status::error("cannot cut " + std::to_string(pieces) + " chunks (" + std::to_string(o.stages) +
                         " stages of " + std::to_string(pieces / o.stages) + " for the " + o.schedule +
                         " schedule) from " + std::to_string(layers) + " layers: use fewer stages" +
                         (find_schedule(o.schedule)->chunks_per_stage == 0 ? " or virtual stages" : ""));
  }
  const std::vector<LiveRange> live = live_ranges(g, layer, layers);
  std::vector<int64_t> cut_bytes(layers + 1, 0);
  for (size_t v = 0; v < g.values.size(); ++v) {
    for (int j = live[v].made + 1; j <= std::min(live[v].last, layers); ++j) {
      if (j >= 0) cut_bytes[j] += value_bytes(g, static_cast<int>(v));
    }
  }
  const std::vector<bool> recomputed =
      o.recompute_activations ? recomputable_values(g, o.kept_when_fused) : std::vector<bool>(g.values.size(), false);
  const LayerFigures fig = layer_figures(g, layer, layers, recomputed);
  const PipelineSplitProblem problem = make_problem(o, chunks, fig, cut_bytes);
  Result<PipelineSplit> split = split_pipeline(problem);
  if (!split) return split.status();

  Plan plan;
  plan.model = model_path;
  plan.options = o;
  plan.total_parameters = g.total_parameter_count();
  plan.layers = layers;
  plan.crossing_bytes = split->crossing_bytes;
  plan.chunks_per_stage = pieces / o.stages;
  const std::string file_prefix = pieces == o.stages ? "stage_" : "chunk_";
  int64_t cost_sum = 0;
  for (int k = 0; k < pieces; ++k) {
    StagePlan s;
    s.stage = k;
    s.holder = chunks.holder[k];
    s.first_layer = split->stage_begin[k];
    s.end_layer = split->stage_begin[k + 1];
    int64_t elements = 0;
    for (int l = s.first_layer; l < s.end_layer; ++l) s.flops_per_sample += fig.flops[l];
    std::set<int> params;  // every one the stage's nodes use: a weight shared with an earlier stage too
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      if (layer[i] < s.first_layer || layer[i] >= s.end_layer) continue;
      s.nodes.push_back(static_cast<int>(i));
      for (int p : g.node_params(g.nodes[i])) params.insert(p);
    }
    for (int p : params) {
      elements += g.params[p].elements();
      if (g.params[p].trainable) s.parameters += g.params[p].elements();
    }
    s.cost = split->stage_cost[k];
    cost_sum += s.cost;
    s.activation_bytes_out = cut_bytes[s.end_layer];
    fill_stage_values(g, live, s);
    s.roles.assign(s.nodes.size(), ShardRole::kReplicated);
    if (o.tensor_parallel > 1) {
      PIPESHARD_RETURN_IF_ERROR(assign_shard_roles(g, o, s));
      elements = sharded_parameter_elements(g, o.tensor_parallel, s);
      for (int t = 0; t < o.tensor_parallel; ++t) {
        s.files.push_back(file_prefix + std::to_string(k) + "_tp" + std::to_string(t) + ".onnx");
      }
    } else {
      s.files.push_back(file_prefix + std::to_string(k) + ".onnx");
    }
    s.memory_bytes =
        memory_bytes(g, o, chunks.in_flight[k], chunks.split[k], pieces == o.stages, s, elements, recomputed);
    plan.stages.push_back(std::move(s));
  }
  const double mean = static_cast<double>(cost_sum) / pieces;
  plan.balance = mean > 0 ? static_cast<double>(split->max_stage_cost) / mean : 1.0;
  return plan;
}

std::string plan_json_text(const Plan& plan, const Graph& graph) {
  return plan_to_json(plan, graph).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

const char* balance_name(BalanceBy b) {
  switch (b) {
    case BalanceBy::kParams: return "params";
    case BalanceBy::kFlops: return "flops";
    case BalanceBy::kMemory: return "memory";
  }
  return "?";
}

const char* shard_role_name(ShardRole r) {
  switch (r) {
    case ShardRole::kReplicated: return "replicated";
    case ShardRole::kColumn: return "column";
    case ShardRole::kShardLocal: return "shard-local";
    case ShardRole::kRow: return "row";
    case ShardRole::kColumnGather: return "column-gather";
  }
  return "?";
}

namespace {

nlohmann::json specs_json(const std::vector<TensorSpec>& specs) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& s : specs) {
    nlohmann::json shape = nlohmann::json::array();
    for (int64_t d : s.shape.dims) {
      if (d == kBatch)
        shape.push_back("batch");
      else
        shape.push_back(d);
    }
    out.push_back({{"name", s.name}, {"shape", shape}, {"dtype", "float32"}});
  }
  return out;
}

}  // namespace

nlohmann::json plan_to_json(const Plan& plan, const Graph& g) {
  const PartitionOptions& o = plan.options;
  nlohmann::json j;
  j["model"] = plan.model;
  j["total_parameters"] = plan.total_parameters;
  j["layers"] = plan.layers;
  j["balance"] = balance_name(o.balance);
  j["balance_ratio"] = plan.balance;
  j["tensor_parallel"] = o.tensor_parallel;
  j["crossing_bytes_per_sample"] = plan.crossing_bytes;
  j["memory_assumptions"] = {{"batch_size", o.batch_size},
                             {"micro_batches", micro_batch_count(o)},
                             {"schedule", o.schedule},
                             {"chunks_per_stage", plan.chunks_per_stage},
                             {"optimizer_slots", o.optimizer_slots},
                             {"zero_stage", o.zero_replicas > 1 ? o.zero_stage : 0},
                             {"zero_replicas", o.zero_replicas}};
  j["stages"] = nlohmann::json::array();
  for (const StagePlan& s : plan.stages) {
    nlohmann::json st;
    st["stage"] = s.stage;
    if (plan.chunks_per_stage > 1) st["held_by_stage"] = s.holder;
    st["layers"] = {s.first_layer, s.end_layer};
    st["parameters"] = s.parameters;
    st["share"] = plan.total_parameters ? static_cast<double>(s.parameters) / plan.total_parameters : 0.0;
    st["cost"] = s.cost;
    st["flops_per_sample"] = s.flops_per_sample;
    st["activation_bytes_per_sample"] = s.activation_bytes_out;
    st["memory_bytes"] = s.memory_bytes;
    nlohmann::json nodes = nlohmann::json::array();
    for (size_t i = 0; i < s.nodes.size(); ++i) {
      const Node& n = g.nodes[s.nodes[i]];
      nlohmann::json nj = {{"name", n.name}, {"kind", op_kind_name(n)}};
      if (o.tensor_parallel > 1) nj["shard"] = shard_role_name(s.roles[i]);
      nodes.push_back(nj);
    }
    st["nodes"] = nodes;
    st["inputs"] = specs_json(s.inputs);
    st["outputs"] = specs_json(s.outputs);
    st["carried"] = specs_json(s.carried);
    st["files"] = s.files;
    j["stages"].push_back(st);
  }
  return j;
}

}  // namespace pipeshard
