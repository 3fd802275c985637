// partition's table of a Plan (partitioner/plan_table.h).
#include "partitioner/plan_table.h"

#include <string>
#include <vector>

#include <fmt/core.h>

#include "common/host_memory.h"
#include "schedule/registry.h"

namespace pipeshard {

std::string with_commas(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

namespace {

// "Linear Relu Linear" or, for long stages, "Linear Relu … Linear (40 nodes)".
std::string node_summary(const Graph& g, const StagePlan& s) {
  std::string out;
  const size_t n = s.nodes.size();
  for (size_t i = 0; i < n; ++i) {
    if (n > 6 && i == 3) {
      out += "… ";
      i = n - 2;
    }
    out += op_kind_name(g.nodes[s.nodes[i]]);
    out += ' ';
  }
  if (n > 6) out += fmt::format("({} nodes)", n);
  return out;
}

std::string shard_summary(const StagePlan& s) {
  int counts[5] = {0, 0, 0, 0, 0};
  for (ShardRole r : s.roles) ++counts[static_cast<int>(r)];
  std::string out;
  const ShardRole order[] = {ShardRole::kColumn, ShardRole::kRow, ShardRole::kColumnGather, ShardRole::kShardLocal};
  for (ShardRole r : order) {
    if (counts[static_cast<int>(r)]) out += fmt::format("{}×{} ", counts[static_cast<int>(r)], shard_role_name(r));
  }
  return out.empty() ? "replicated" : out;
}

}  // namespace

std::string plan_table_text(const Graph& g, const Plan& plan, const std::string& dir) {
  std::string out;
  const PartitionOptions& o = plan.options;
  const bool chunked = plan.chunks_per_stage > 1;
  out += fmt::format("{}: {} nodes in {} layers, {} parameters -> {} stage{}{}{} (balanced by {})\n\n", plan.model,
                     g.nodes.size(), plan.layers, with_commas(plan.total_parameters), o.stages,
                     o.stages == 1 ? "" : "s", chunked ? fmt::format(" x {} chunks each", plan.chunks_per_stage) : "",
                     o.tensor_parallel > 1 ? fmt::format(" x {} tensor-parallel shards", o.tensor_parallel) : "",
                     balance_name(o.balance));
  // With several chunks per stage a row is a chunk, and "stage" says which stage runs it.
  const std::string chunk_column = chunked ? fmt::format("{:>5}  ", "chunk") : "";
  out +=
      fmt::format("{}{:>5}  {:>7}  {:>12}  {:>6}  {:>15}  {:>10}  {}\n", chunk_column, "stage", "layers", "parameters",
                  "share", "act. out/sample", "memory", o.tensor_parallel > 1 ? "nodes / sharding" : "nodes");
  for (const StagePlan& s : plan.stages) {
    const std::string layers = s.end_layer - s.first_layer == 1 ? std::to_string(s.first_layer)
                                                                : fmt::format("{}-{}", s.first_layer, s.end_layer - 1);
    const double share = plan.total_parameters ? 100.0 * s.parameters / plan.total_parameters : 0.0;
    out += fmt::format("{}{:>5}  {:>7}  {:>12}  {:>5.1f}%  {:>15}  {:>10}  {}{}\n",
                       chunked ? fmt::format("{:>5}  ", s.stage) : "", s.holder, layers, with_commas(s.parameters),
                       share, bytes_text(s.activation_bytes_out), bytes_text(s.memory_bytes), node_summary(g, s),
                       o.tensor_parallel > 1 ? "/ " + shard_summary(s) : "");
  }
  out += fmt::format("{}{:>5}  {:>7}  {:>12}  {:>5.1f}%\n\n", chunked ? fmt::format("{:>5}  ", "") : "", "total",
                     plan.layers, with_commas(plan.total_parameters), 100.0);
  out +=
      fmt::format("balance: largest / mean {} {} = {:.3f}; activations crossing cuts: {} per sample\n",
                  chunked ? "chunk" : "stage", balance_name(o.balance), plan.balance, bytes_text(plan.crossing_bytes));
  if (chunked) {
    std::string per_stage;
    const std::vector<int64_t> bytes = memory_per_stage(plan);
    for (size_t st = 0; st < bytes.size(); ++st) {
      per_stage += fmt::format("{}stage {} {}", st ? ", " : "", st, bytes_text(bytes[st]));
    }
    out += fmt::format("memory per rank, its chunks together: {}\n", per_stage);
  }
  const int m_batches = micro_batch_count(o);
  out += fmt::format(
      "memory: per rank, fp32 weights + grads + {} optimizer slot{}{}, activations of batch {} in {} "
      "micro-batch{} under {}{}\n",
      o.optimizer_slots, o.optimizer_slots == 1 ? "" : "s",
      o.zero_replicas > 1 ? fmt::format(" under ZeRO stage {} over {} replicas", o.zero_stage, o.zero_replicas) : "",
      o.batch_size, m_batches, m_batches == 1 ? "" : "es", find_schedule(o.schedule)->title,
      o.recompute_activations ? "" : ", activation functions' outputs kept (--keep-activations)");
  if (dir.empty()) return out;
  size_t files = 0;
  for (const StagePlan& s : plan.stages) files += s.files.size();
  out += fmt::format("wrote {} {} file{} and plan.json to {}/\n", files, chunked ? "chunk" : "stage",
                     files == 1 ? "" : "s", dir);
  return out;
}

}  // namespace pipeshard
