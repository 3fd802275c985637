#include "partitioner/layout_search.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "common/host_memory.h"
#include "schedule/registry.h"
#include "schedule/schedule.h"

namespace pipeshard {
namespace {

std::string samples_text(int64_t n) { return std::to_string(n) + (n == 1 ? " sample" : " samples"); }

// Refusals of train that make_plan() does not make, duplicated here because the
// partitioner sits below runtime/: runtime/train_config.cc's check_batchnorm() (its
// micro-batch rule; the statistics-per-channel rule depends on --sync-batchnorm, which a
// layout does not choose) and runtime/rank_model.cc's place_parameters().
Status check_batchnorm_micro_batches(const Graph& g, int micro_batches) {
  if (micro_batches <= 1) return Status::ok();
  for (const Node& n : g.nodes) {
    if (n.kind == OpKind::kBatchNorm) {
      return Status::error("node '" + n.name + "' (BatchNorm) would normalise each of the " +
                           std::to_string(micro_batches) + " micro-batches alone, unlike one process");
    }
  }
  return Status::ok();
}

Status check_no_shared_parameters(const Graph& g, const Plan& plan) {
  const bool chunked = plan.chunks_per_stage > 1;
  std::map<int, int> piece_of;  // [param] the first piece using it
  for (const StagePlan& s : plan.stages) {
    for (int n : s.nodes) {
      for (int p : g.node_params(g.nodes[n])) {
        const auto [it, added] = piece_of.emplace(p, s.stage);
        if (!added && it->second != s.stage) {
          return Status::error("parameter '" + g.params[p].name + "' is used by " + (chunked ? "chunks " : "stages ") +
                               std::to_string(it->second) + " and " + std::to_string(s.stage) +
                               "; weights shared across pipeline stages cannot be trained");
        }
      }
    }
  }
  return Status::ok();
}

// Whether train runs `--zero 2` as stage 1 under this schedule: it splits backward into I
// and W passes, or places several model chunks on a stage (runtime/trainer.cc). Such a
// layout is the ZeRO-1 one, listed once. False where the counts are refused: the plan
// says why.
bool zero2_runs_as_zero1(const std::string& name, int stages, int micro_batches, int virtual_stages) {
  if (!check_schedule_counts(name, stages, micro_batches, virtual_stages)) return false;
  return !make_pipeline_schedule(name, stages, micro_batches, {}, virtual_stages).backward_whole_in_one_chunk();
}

// Whether --keep-activations changes anything: some value would be recomputed otherwise.
bool recomputes_anything(const Graph& g, const LayoutSearchOptions& options) {
  const std::vector<bool> r = recomputable_values(g, options.kept_when_fused);
  return std::find(r.begin(), r.end(), true) != r.end();
}

// ZeRO-2 keeps a replica's slice of the gradients and two windows of buckets instead of the
// whole gradient buffer, but where those hold no less (a few large buckets: one for a
// small model under the default --bucket-mb) train runs it as stage 1
// (runtime/gradient_sync.h), and the memory estimate is ZeRO-1's. Such a layout is the
// ZeRO-1 one, listed once: drops the ZeRO-2 entry just judged (the last of its list) when
// the ZeRO-1 entry judged just before it has the same estimate on every stage. The flags
// say which list each went into.
void drop_zero2_as_zero1(LayoutSearch& out, bool one_accepted, bool two_accepted) {
  auto bytes = [&](bool accepted, size_t from_end) -> const std::vector<int64_t>* {
    if (accepted) return &out.accepted[out.accepted.size() - 1 - from_end].bytes_per_stage;
    const RejectedLayout& r = out.rejected[out.rejected.size() - 1 - from_end];
    return r.for_memory ? &r.bytes_per_stage : nullptr;  // other rejections carry no estimate
  };
  const std::vector<int64_t>* two = bytes(two_accepted, 0);
  const std::vector<int64_t>* one = bytes(one_accepted, one_accepted == two_accepted ? 1 : 0);
  if (two == nullptr || one == nullptr || *two != *one) return;
  if (two_accepted) {
    out.accepted.pop_back();
  } else {
    out.rejected.pop_back();
    --out.rejected_for_memory;
  }
}

// Accepts or rejects one layout of the space into `out`.
void judge(const Graph& g, const Layout& layout, const LayoutSearchOptions& options, LayoutSearch& out) {
  auto reject = [&](std::string reason) { out.rejected.push_back({layout, std::move(reason), false, {}, 0}); };
  const int64_t local = options.batch_size / layout.replicas;
  if (layout.micro_batches < 1 || local % layout.micro_batches != 0) {
    return reject(std::to_string(layout.micro_batches) + " micro-batches do not divide the " + samples_text(local) +
                  " each replica gets per step");
  }
  if (Status s = check_batchnorm_micro_batches(g, layout.micro_batches); !s) return reject(s.message());
  Result<Plan> plan = make_plan(g, "", layout_partition_options(layout, options));
  if (!plan) return reject(plan.status().message());
  if (Status s = check_no_shared_parameters(g, *plan); !s) return reject(s.message());
  std::vector<int64_t> bytes = memory_per_stage(*plan);
  const auto peak = std::max_element(bytes.begin(), bytes.end());
  const int64_t peak_bytes = peak == bytes.end() ? 0 : *peak;
  if (options.memory_per_rank > 0 && peak_bytes > options.memory_per_rank) {
    const std::string reason = "needs about " + bytes_text(peak_bytes) + " on each rank of stage " +
                               std::to_string(peak - bytes.begin()) + ", over the " +
                               bytes_text(options.memory_per_rank) + " of a rank";
    out.rejected.push_back({layout, reason, true, std::move(bytes), peak_bytes});
    ++out.rejected_for_memory;
    return;
  }
  out.accepted.push_back({layout, std::move(*plan), std::move(bytes), peak_bytes});
}

}  // namespace

std::string Layout::text() const {
  std::string t = "D=" + std::to_string(replicas) + " P=" + std::to_string(stages) + " T=" + std::to_string(shards);
  if (schedule.empty()) return t;
  t += " M=" + std::to_string(micro_batches) + " " + schedule;
  if (virtual_stages > 0) t += " v=" + std::to_string(virtual_stages);
  if (keep_activations) t += " keep-activations";
  return t + " zero " + std::to_string(zero);
}

bool operator==(const Layout& a, const Layout& b) {
  return std::tie(a.replicas, a.stages, a.shards, a.schedule, a.virtual_stages, a.micro_batches, a.keep_activations,
                  a.zero) == std::tie(b.replicas, b.stages, b.shards, b.schedule, b.virtual_stages, b.micro_batches,
                                      b.keep_activations, b.zero);
}

// Schedules compare by their place in the registry, as search_layouts() walks them.
bool operator<(const Layout& a, const Layout& b) {
  const std::vector<std::string> names = schedule_names();
  auto rank = [&](const std::string& s) { return std::find(names.begin(), names.end(), s) - names.begin(); };
  const auto ra = rank(a.schedule), rb = rank(b.schedule);
  return std::tie(a.replicas, a.stages, a.shards, ra, a.virtual_stages, a.micro_batches, a.keep_activations, a.zero) <
         std::tie(b.replicas, b.stages, b.shards, rb, b.virtual_stages, b.micro_batches, b.keep_activations, b.zero);
}

std::vector<int> divisors(int64_t n, int64_t cap) {
  std::vector<int> out;
  for (int64_t d = 1; d <= std::min(n, cap); ++d) {
    if (n % d == 0) out.push_back(static_cast<int>(d));
  }
  return out;
}

PartitionOptions layout_partition_options(const Layout& layout, const LayoutSearchOptions& options) {
  PartitionOptions o;
  o.kept_when_fused = options.kept_when_fused;
  o.balance = options.balance;
  o.batch_size = options.batch_size / layout.replicas;
  o.micro_batches = layout.micro_batches;
  o.schedule = layout.schedule;
  o.virtual_stages = layout.virtual_stages;
  o.recompute_activations = !layout.keep_activations;
  o.optimizer_slots = options.optimizer_slots;
  o.stages = layout.stages;
  o.tensor_parallel = layout.shards;
  if (layout.zero >= 1) o.zero_replicas = layout.replicas;
  o.zero_stage = layout.zero;
  o.bucket_bytes = options.bucket_bytes;
  return o;
}

LayoutSearch search_layouts(const Graph& graph, const LayoutSearchOptions& options) {
  LayoutSearch out;
  const int n = options.ranks;
  const bool recomputes = recomputes_anything(graph, options);
  for (int d : divisors(n, n)) {
    for (int p : divisors(n / d, n / d)) {
      Layout layout;
      layout.replicas = d;
      layout.stages = p;
      layout.shards = n / d / p;
      if (options.batch_size < 1 || options.batch_size % d != 0) {
        layout.micro_batches = 0;
        out.rejected.push_back({layout,
                                "a batch of " + samples_text(options.batch_size) + " does not divide among " +
                                    std::to_string(d) + " data-parallel replicas",
                                false,
                                {},
                                0});
        continue;
      }
      const int64_t local = options.batch_size / d;
      const std::vector<int> counts =
          options.micro_batches.empty() ? divisors(local, options.max_micro_batches) : options.micro_batches;
      const std::vector<std::string> schedules =
          p == 1 ? std::vector<std::string>{PartitionOptions{}.schedule} : schedule_names();
      for (const std::string& name : schedules) {
        layout.schedule = name;
        const bool chosen = find_schedule(name)->chunks_per_stage == 0;
        for (int v : chosen ? options.virtual_stages : std::vector<int>{0}) {
          layout.virtual_stages = v;
          for (int m : counts) {
            layout.micro_batches = m;
            const int most_zero = d == 1 ? 0 : zero2_runs_as_zero1(name, p, m, v) ? 1 : 2;
            for (bool keep : {false, true}) {
              if (keep && !recomputes) continue;
              layout.keep_activations = keep;
              bool zero1_accepted = false;
              for (int zero = 0; zero <= most_zero; ++zero) {
                layout.zero = zero;
                const size_t before = out.accepted.size();
                judge(graph, layout, options, out);
                const bool accepted = out.accepted.size() > before;
                if (zero == 2) drop_zero2_as_zero1(out, zero1_accepted, accepted);
                zero1_accepted = accepted;
              }
            }
          }
        }
      }
    }
  }
  return out;
}

}  // namespace pipeshard
