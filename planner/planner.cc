#include "planner/planner.h"

#include <algorithm>
#include <cmath>
#include <map>

#include <fmt/core.h>

#include "common/host_memory.h"
#include "partitioner/plan_table.h"

namespace pipeshard {
namespace {

double samples_per_s(const LayoutPlan& plan, const PlannedLayout& p) {
  return p.prediction.step_us > 0 ? static_cast<double>(plan.options.batch_size) / p.prediction.step_us * 1e6 : 0;
}

nlohmann::json layout_json(const Layout& l) {
  nlohmann::json j = {{"replicas", l.replicas},
                      {"stages", l.stages},
                      {"tensor_parallel", l.shards},
                      {"micro_batches", l.micro_batches},
                      {"schedule", l.schedule},
                      {"virtual_stages", l.virtual_stages},
                      {"keep_activations", l.keep_activations},
                      {"zero", l.zero}};
  j["text"] = l.text();
  if (!l.schedule.empty()) j["train_flags"] = layout_train_flags(l);
  return j;
}

}  // namespace

std::vector<std::pair<std::string, int>> LayoutPlan::rejection_reasons() const {
  std::map<std::string, int> count;
  std::vector<std::string> order;
  for (const RejectedLayout& r : rejected) {
    if (r.for_memory) continue;
    if (count[r.reason]++ == 0) order.push_back(r.reason);
  }
  std::vector<std::pair<std::string, int>> out;
  for (const std::string& reason : order) out.emplace_back(reason, count[reason]);
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  return out;
}

LayoutPlan plan_layouts(const Graph& graph, const LayoutSearchOptions& options, const MachineProfile& profile) {
  LayoutSearch search = search_layouts(graph, options);
  LayoutPlan plan;
  plan.options = options;
  plan.profile = profile;
  plan.rejected = std::move(search.rejected);
  plan.rejected_for_memory = search.rejected_for_memory;
  for (LayoutFit& fit : search.accepted) {
    LayoutPrediction prediction = predict_layout(graph, fit.plan, fit.layout, profile);
    plan.ranked.push_back({std::move(fit), std::move(prediction)});
  }
  std::stable_sort(plan.ranked.begin(), plan.ranked.end(), [](const PlannedLayout& a, const PlannedLayout& b) {
    return a.prediction.step_us < b.prediction.step_us;
  });
  return plan;
}

std::string layout_train_flags(const Layout& l) {
  std::string flags;
  auto add = [&](const std::string& f) { flags += (flags.empty() ? "" : " ") + f; };
  if (l.stages > 1) add("--stages " + std::to_string(l.stages));
  if (l.shards > 1) add("--tensor-parallel " + std::to_string(l.shards));
  if (l.micro_batches > 1) add("--micro-batches " + std::to_string(l.micro_batches));
  if (l.stages > 1 && l.schedule != "1f1b") add("--schedule " + l.schedule);
  if (l.virtual_stages > 0) add("--virtual-stages " + std::to_string(l.virtual_stages));
  if (l.keep_activations) add("--keep-activations");
  if (l.zero > 0) add("--zero " + std::to_string(l.zero));
  return flags.empty() ? "(none)" : flags;
}

std::string layout_plan_text(const LayoutPlan& plan, const std::string& model, size_t top) {
  const LayoutSearchOptions& o = plan.options;
  std::string t = fmt::format("layouts for {} on {} rank{}, {} samples per step", model, o.ranks,
                              o.ranks == 1 ? "" : "s", o.batch_size);
  t += o.memory_per_rank > 0 ? ", " + bytes_text(o.memory_per_rank) + " per rank" : ", memory unlimited";
  t += "; profile: " + (plan.profile.machine.empty() ? std::string("(unnamed)") : plan.profile.machine) + "\n";
  if (plan.ranked.empty()) {
    int64_t least = 0;
    for (const RejectedLayout& r : plan.rejected) {
      if (r.for_memory && (least == 0 || r.peak_bytes < least)) least = r.peak_bytes;
    }
    t += least > 0 ? "no layout fits: the least memory any needs is " + bytes_text(least) + " per rank\n"
                   : "no layout can run (reasons below)\n";
  } else {
    const size_t shown = std::min(top, plan.ranked.size());
    std::vector<std::string> names;
    size_t width = 6;
    for (size_t i = 0; i < shown; ++i) {
      names.push_back(plan.ranked[i].fit.layout.text());
      width = std::max(width, names.back().size());
    }
    t += fmt::format("{:>3}  {:<{}}  {:>9}  {:>10}  {:>11}  {:<15}  {}\n", "#", "layout", width, "ms/step", "samples/s",
                     "memory/rank", "bottleneck", "train flags");
    for (size_t i = 0; i < shown; ++i) {
      const PlannedLayout& p = plan.ranked[i];
      t += fmt::format("{:>3}  {:<{}}  {:>9.3f}  {:>10}  {:>11}  {:<15}  {}\n", i + 1, names[i], width,
                       p.prediction.step_us / 1e3, with_commas(std::llround(samples_per_s(plan, p))),
                       bytes_text(p.fit.peak_bytes), p.prediction.bottleneck(), layout_train_flags(p.fit.layout));
    }
    if (shown < plan.ranked.size())
      t += fmt::format("  ... and {} more that fit (--top, --json)\n", plan.ranked.size() - shown);
  }
  t += fmt::format("{} layout{} considered: {} fit", plan.ranked.size() + plan.rejected.size(),
                   plan.ranked.size() + plan.rejected.size() == 1 ? "" : "s", plan.ranked.size());
  if (plan.rejected_for_memory > 0) t += fmt::format(", {} need more memory than a rank has", plan.rejected_for_memory);
  const auto reasons = plan.rejection_reasons();
  const int other = static_cast<int>(plan.rejected.size()) - plan.rejected_for_memory;
  if (other > 0) t += fmt::format(", {} cannot run", other);
  t += "\n";
  for (size_t i = 0; i < reasons.size() && i < 5; ++i) {
    t += fmt::format("  {} × {}\n", reasons[i].second, reasons[i].first);
  }
  if (reasons.size() > 5) t += fmt::format("  ... and {} other reasons (--json)\n", reasons.size() - 5);
  return t;
}

nlohmann::json layout_plan_json(const LayoutPlan& plan, const std::string& model) {
  const LayoutSearchOptions& o = plan.options;
  nlohmann::json j;
  j["model"] = model;
  j["ranks"] = o.ranks;
  j["batch_size"] = o.batch_size;
  j["memory_per_rank"] = o.memory_per_rank;
  j["optimizer_slots"] = o.optimizer_slots;
  j["bucket_bytes"] = o.bucket_bytes;
  j["profile_machine"] = plan.profile.machine;
  nlohmann::json accepted = nlohmann::json::array();
  for (const PlannedLayout& p : plan.ranked) {
    const LayoutPrediction& pr = p.prediction;
    nlohmann::json e = layout_json(p.fit.layout);
    e["predicted"] = {{"step_ms", pr.step_us / 1e3},
                      {"samples_per_s", samples_per_s(plan, p)},
                      {"compute_ms", pr.compute_us / 1e3},
                      {"bubble_ms", pr.bubble_us / 1e3},
                      {"tensor_parallel_ms", pr.tensor_parallel_us / 1e3},
                      {"data_parallel_ms", pr.data_parallel_us / 1e3},
                      {"optimizer_ms", pr.optimizer_us / 1e3},
                      {"overhead_ms", pr.overhead_us / 1e3},
                      {"critical_stage", pr.critical_stage},
                      {"bottleneck", pr.bottleneck()}};
    e["memory_per_stage"] = p.fit.bytes_per_stage;
    e["peak_bytes"] = p.fit.peak_bytes;
    accepted.push_back(std::move(e));
  }
  j["layouts"] = std::move(accepted);
  nlohmann::json rejected = nlohmann::json::array();
  for (const RejectedLayout& r : plan.rejected) {
    nlohmann::json e = layout_json(r.layout);
    e["reason"] = r.reason;
    e["for_memory"] = r.for_memory;
    if (r.for_memory) e["peak_bytes"] = r.peak_bytes;
    rejected.push_back(std::move(e));
  }
  j["rejected"] = std::move(rejected);
  return j;
}

}  // namespace pipeshard
