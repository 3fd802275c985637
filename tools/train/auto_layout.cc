#include "tools/train/auto_layout.h"

#include <fmt/core.h>

#include "backend/backend.h"
#include "common/host_memory.h"
#include "importer/onnx_importer.h"
#include "planner/measure.h"
#include "planner/planner.h"
#include "planner/profile.h"

namespace pipeshard::train_cli {

Result<ChosenLayout> choose_layout(Args& a, Communicator& world, std::optional<ImportedModel>& model, bool say) {
  const bool speaks = world.rank() == 0 && say;
  if (!model) {
    Result<ImportedModel> imported = import_onnx_file(a.model);
    if (!imported) return imported.status();
    model = std::move(*imported);
  }
  const ImportedModel* m = &*model;
  LayoutSearchOptions o;
  o.ranks = world.size();
  o.batch_size = a.batch_size;
  const bool sgd = a.optimizer == "sgd";
  o.optimizer_slots = !sgd ? 2 : a.momentum != 0 ? 1 : 0;
  o.bucket_bytes = static_cast<int64_t>(a.bucket_mb * (1 << 20));
  o.balance = a.balance == "flops"    ? BalanceBy::kFlops
              : a.balance == "memory" ? BalanceBy::kMemory
                                      : BalanceBy::kParams;
  MachineProfile profile;
  if (!a.profile.empty()) {
    Result<MachineProfile> read = read_profile_file(a.profile);
    if (!read) return Status::error("--profile: " + read.status().message());
    profile = std::move(*read);
  } else if (a.device != "cpu") {
    return Status::error("--layout auto on --device " + a.device +
                         " needs --profile: the profile tool measures the CPU backend only so far");
  } else {
    if (speaks) fmt::print(stderr, "layout auto: measuring this machine on {} process(es) first\n", world.size());
    MeasureOptions mo = model_measure_options(m->graph, world.size(), a.batch_size, o.max_micro_batches);
    mo.machine = "this machine, measured by train --layout auto";
    std::unique_ptr<Backend> backend = make_cpu_backend();
    profile = measure_profile(*backend, world, mo);
  }
  if (a.device == "cpu") {
    // Every process shares this host's memory (rank 0's figure, so that all decide alike).
    int64_t available = read_host_memory().available;
    world.broadcast_bytes(&available, sizeof available, 0);
    if (available > 0) o.memory_per_rank = available / world.size();
  }
  const LayoutPlan plan = plan_layouts(m->graph, o, profile);
  if (plan.ranked.empty()) {
    return Status::error("--layout auto: no layout of " + a.model + " runs on " + std::to_string(world.size()) +
                         " processes (partition --plan --ranks " + std::to_string(world.size()) + " says why)");
  }
  const PlannedLayout& best = plan.ranked.front();
  const Layout& l = best.fit.layout;
  a.stages = l.stages;
  a.tensor_parallel = l.shards;
  a.micro_batches = l.micro_batches;
  if (l.stages > 1) {
    a.pipeline_schedule = l.schedule;
    a.pipeline_schedule_given = true;
  }
  a.virtual_stages = l.virtual_stages;
  a.keep_activations = l.keep_activations;
  a.zero = l.zero;
  ChosenLayout chosen{l.text(), layout_train_flags(l), best.prediction.step_us / 1e3,
                      static_cast<int>(plan.ranked.size() + plan.rejected.size()),
                      static_cast<int>(plan.ranked.size())};
  if (speaks) {
    fmt::print(stderr,
               "layout auto: {} (train flags: {}), predicted {:.3f} ms per step, bottleneck {}; the fastest of {} "
               "layouts that fit, of {} (partition --plan lists them)\n",
               chosen.text, chosen.flags, chosen.predicted_ms, best.prediction.bottleneck(), chosen.fit,
               chosen.considered);
  }
  return chosen;
}

}  // namespace pipeshard::train_cli
