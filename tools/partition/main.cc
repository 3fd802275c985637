// partition: cut an ONNX MLP into pipeline stages (and tensor-parallel shards) balanced
// by parameter count, print the per-stage table, and write the stage files and
// plan.json. Bad arguments and bad models: one line on stderr, exit status 2.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "common/atomic_file.h"
#include "common/cli.h"
#include "common/host_memory.h"
#include "importer/onnx_importer.h"
#include "partitioner/plan.h"
#include "partitioner/plan_table.h"
#include "partitioner/stage_writer.h"
#include "planner/planner.h"
#include "planner/profile.h"
#include "schedule/predict.h"
#include "schedule/registry.h"
#include "schedule/schedule.h"
#include "tools/plot/pictures.h"
#include "tools/plot/plot.h"

namespace {

using namespace pipeshard;

int fail(const std::string& message) { return report_bad_input("partition", message); }

// The flags of the PartitionOptions settings (Status::invalid names them).
const FlagNames kFlags = {{"stages", "--stages"},          {"tensor_parallel", "--tensor-parallel"},
                          {"batch_size", "--batch-size"},  {"micro_batches", "--micro-batches"},
                          {"schedule", "--schedule"},      {"virtual_stages", "--virtual-stages"},
                          {"zero_replicas", "--replicas"}, {"zero_stage", "--zero"},
                          {"bucket_bytes", "--bucket-mb"}};

// What the command line said beyond PartitionOptions.
struct Args {
  std::string model, out_dir, balance = "params", schedule = "1f1b", optimizer = "adam", chart;
  bool json = false, show_schedule = false, keep_activations = false;
  int replicas = 1, zero = 0;
  double bucket_mb = 25;
  PartitionOptions o;
  // --plan
  bool plan = false;
  int ranks = 0, max_micro_batches = 16;
  size_t top = 10;
  std::string memory_per_rank, profile;
};

// Declares every flag on `app`, writing into `a`, in the order --help lists them.
void define(CLI::App& app, Args& a) {
  PartitionOptions& o = a.o;
  app.add_option("model", a.model, "ONNX model file (as written by torch.onnx.export)")->required();
  app.add_option("--stages,-s", o.stages, "number of pipeline stages (default 1)");
  app.add_option("--tensor-parallel,-t", o.tensor_parallel, "tensor-parallel shards per stage (default 1)");
  app.add_option("--balance", a.balance, "what to balance: params (default), flops or memory")
      ->check(CLI::IsMember({"params", "flops", "memory"}));
  app.add_option("--out,-o", a.out_dir, "output folder (default: <model name>_stages)");
  app.add_flag("--json", a.json, "print plan.json to stdout instead of the table (files are still written)");
  app.add_option("--chart", a.chart, "draw parameters and memory per stage to this .svg or .png (needs matplotlib)");
  app.add_flag("--show-schedule", a.show_schedule,
               "print the pipeline schedule (--schedule, --micro-batches) as a step x stage grid, checked for "
               "deadlock, as train runs it, and the predicted bubble and step time of every schedule");
  auto* est = "memory estimate";
  app.add_option("--batch-size", o.batch_size, "samples per step per replica (memory estimate; default 32)")
      ->group(est);
  app.add_option("--micro-batches", o.micro_batches, "micro-batches per step (memory estimate; default = stages)")
      ->group(est);
  app.add_option("--schedule", a.schedule,
                 "pipeline schedule: " + schedule_names_text() + " (default 1f1b; memory estimate)")
      ->check(CLI::IsMember(schedule_names()))
      ->group(est);
  app.add_option("--virtual-stages,-v", o.virtual_stages,
                 "model chunks per stage for a schedule that lets them be chosen (interleaved; default 2): the model "
                 "is cut into stages x v chunks, chunk c on stage c mod stages");
  app.add_option("--optimizer", a.optimizer, "sgd (momentum: 1 slot) or adam/adamw (2 slots; default)")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}))
      ->group(est);
  app.add_option("--replicas", a.replicas,
                 "data-parallel replicas of each stage (memory estimate under --zero; default 1)")
      ->check(CLI::Range(1, 1 << 20))
      ->group(est);
  app.add_option("--zero", a.zero,
                 "ZeRO stage, as train --zero: 0 (default), 1 (1/replicas of the optimizer state per rank) or 2 "
                 "(and of the gradients, beside two bucket windows; memory estimate)")
      ->check(CLI::Range(0, 2))
      ->group(est);
  app.add_option("--bucket-mb", a.bucket_mb,
                 "gradient bucket size, as train --bucket-mb (default 25; memory estimate "
                 "under --zero 2)")
      ->check(CLI::PositiveNumber)
      ->group(est);
  app.add_flag("--keep-activations", a.keep_activations,
               "as train --keep-activations: count the activation functions' outputs, which training otherwise "
               "recomputes in backward (memory estimate)")
      ->group(est);
  auto* planner = "layout planner";
  app.add_flag("--plan", a.plan,
               "instead of cutting one layout: rank every layout train can run on --ranks processes (replicas x "
               "stages x shards, micro-batches, schedule, recompute, ZeRO) by predicted step time, with its memory "
               "per rank; --batch-size is then the global batch per step; no files are written")
      ->group(planner);
  app.add_option("--ranks,-n", a.ranks, "with --plan: the processes (mpirun -np N) to plan for")
      ->check(CLI::Range(1, 1 << 16))
      ->group(planner);
  app.add_option("--memory-per-rank", a.memory_per_rank,
                 "with --plan: memory of one rank, such as 16GiB or 80GB (default: unlimited); layouts that need more "
                 "are rejected")
      ->group(planner);
  app.add_option("--profile", a.profile,
                 "with --plan: the machine profile (profile.json, from the profile tool or written by hand; default: a "
                 "nominal machine)")
      ->group(planner);
  app.add_option("--top", a.top, "with --plan: layouts to list (default 10; --json lists all)")
      ->check(CLI::Range(1, 1 << 20))
      ->group(planner);
  app.add_option("--max-micro-batches", a.max_micro_batches,
                 "with --plan: largest micro-batch count to try (default 16; --micro-batches tries that one only)")
      ->check(CLI::Range(1, 1 << 16))
      ->group(planner);
}

// --plan: every layout on --ranks processes, fastest predicted first. Bad flags are
// refused before the model is read. Exit status 1 when no layout fits.
int run_plan(CLI::App& app, const Args& a) {
  for (const char* flag : {"--stages", "--tensor-parallel", "--replicas", "--zero", "--schedule", "--virtual-stages",
                           "--keep-activations", "--out", "--chart", "--show-schedule"}) {
    if (app.count(flag) > 0) {
      return fail(std::string("--plan chooses the layout itself: leave out ") + flag + " (see partition --help)");
    }
  }
  if (a.ranks < 1) return fail("--plan needs --ranks N, the processes to plan for (mpirun -np N)");
  LayoutSearchOptions o;
  o.ranks = a.ranks;
  o.batch_size = a.o.batch_size;
  if (o.batch_size < 1 || o.batch_size > kMaxBatchSize) {
    return fail("--batch-size must be between 1 and " + std::to_string(kMaxBatchSize));
  }
  o.optimizer_slots = a.o.optimizer_slots;
  o.bucket_bytes = a.o.bucket_bytes;
  o.balance = a.o.balance;
  o.max_micro_batches = a.max_micro_batches;
  if (app.count("--micro-batches") > 0) {
    if (a.o.micro_batches < 1) return fail("--micro-batches must be at least 1");
    o.micro_batches = {a.o.micro_batches};
  }
  if (!a.memory_per_rank.empty() && !parse_bytes(a.memory_per_rank, &o.memory_per_rank)) {
    return fail("--memory-per-rank: '" + a.memory_per_rank + "' is not a size such as 16GiB, 80GB or 1073741824");
  }
  MachineProfile profile;
  profile.machine = "nominal (no --profile; run the profile tool to measure this machine)";
  if (!a.profile.empty()) {
    Result<MachineProfile> read = read_profile_file(a.profile);
    if (!read) return fail("--profile: " + read.status().message());
    profile = std::move(*read);
  }
  Result<ImportedModel> m = import_onnx_file(a.model);
  if (!m) return fail(m.status().message());
  const LayoutPlan plan = plan_layouts(m->graph, o, profile);
  if (a.json) {
    fmt::print("{}\n", layout_plan_json(plan, a.model).dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    fmt::print("{}", layout_plan_text(plan, a.model, a.top));
  }
  return plan.ranked.empty() ? 1 : 0;
}

// Each piece's (stage's or chunk's) passes for one micro-batch, from the flops estimate: F its forward
// multiply-adds, and I = W = F, since a Linear's input gradient and its weight gradient
// each take as many multiply-adds as its forward. Transfers free.
PassCosts costs_from_flops(const Plan& plan) {
  const int64_t samples = micro_batch_size(plan.options);
  PassCosts costs;
  for (const StagePlan& s : plan.stages) costs.forward.push_back(static_cast<double>(s.flops_per_sample * samples));
  costs.backward_input = costs.forward;
  costs.backward_weight = costs.forward;
  return costs;
}

// The plan had it been made for schedule `name`: the same options, with the user's
// virtual stages where the schedule lets them be chosen.
Result<Plan> plan_for(const Graph& graph, const Plan& plan, const std::string& name) {
  PartitionOptions o = plan.options;
  o.schedule = name;
  if (find_schedule(name)->chunks_per_stage > 0) o.virtual_stages = 0;
  return make_plan(graph, "", o);
}

// What every registered schedule would take on this model (schedule/predict.h), and the
// memory per rank each would need, so that they can be compared before one is chosen.
// Each is predicted on the plan made for it: a schedule with several chunks per stage
// cuts the model finer.
void print_predictions(const Graph& graph, const Plan& plan, int micro_batches) {
  const PartitionOptions& o = plan.options;
  fmt::print(
      "\npredicted for {} stage{} and {} micro-batch{} (bubble: the stages' mean idle share of their own time, as "
      "train measures it):\n",
      o.stages, o.stages == 1 ? "" : "s", micro_batches, micro_batches == 1 ? "" : "es");
  size_t width = 0;
  for (const std::string& name : schedule_names()) width = std::max(width, name.size());
  for (const std::string& name : schedule_names()) {
    const Result<Plan> other = plan_for(graph, plan, name);
    if (!other) {
      fmt::print("  {:<{}}  not predicted: {}\n", name, width, other.status().message());
      continue;
    }
    const PassCosts costs = costs_from_flops(*other);
    double busiest = 0;  // the most forward work of any stage, its chunks together, for the step
    std::vector<double> stage_forward(static_cast<size_t>(o.stages), 0.0);
    for (size_t c = 0; c < other->stages.size(); ++c) stage_forward[other->stages[c].holder] += costs.forward[c];
    for (double f : stage_forward) busiest = std::max(busiest, 3 * micro_batches * f);
    const SchedulePrediction p = predict_schedule(
        make_pipeline_schedule(name, o.stages, micro_batches, {}, other->options.virtual_stages), costs);
    std::string memory;
    for (int64_t bytes : memory_per_stage(*other)) memory += (memory.empty() ? "" : ", ") + bytes_text(bytes);
    fmt::print("  {:<{}}  bubble {:.4f}  step {} ({:.3f}x the busiest stage's compute)  memory per rank {}\n", name,
               width, p.bubble, with_commas(std::llround(p.step)), busiest > 0 ? p.step / busiest : 1.0, memory);
  }
  std::string forwards;
  for (double f : costs_from_flops(plan).forward)
    forwards += (forwards.empty() ? "" : ", ") + with_commas(std::llround(f));
  const int64_t samples = micro_batch_size(o);
  fmt::print(
      "costs assumed: F per {} from the flops estimate ({} multiply-adds for a micro-batch of {} sample{}; times are "
      "in multiply-adds), I = W = F, transfers free\n",
      plan.chunks_per_stage > 1 ? "chunk" : "stage", forwards, samples, samples == 1 ? "" : "s");
}

// --show-schedule: the schedule as a step × stage grid, what each stage keeps alive, and
// the predicted time of every registered schedule.
void print_schedule(const Graph& graph, const Plan& plan) {
  const PartitionOptions& o = plan.options;
  const int m_batches = micro_batch_count(o);
  const PipelineSchedule sc = make_pipeline_schedule(o.schedule, o.stages, m_batches, {}, o.virtual_stages);
  fmt::print(
      "\n{} schedule, {} stage{}, {} micro-batch{} (F/B: forward/backward of micro-batch k, I/W: its input and "
      "weight halves; sA/rA, sG/rG: send/receive its activation, gradient{}):\n{}",
      sc.name, o.stages, o.stages == 1 ? "" : "s", m_batches, m_batches == 1 ? "" : "es",
      sc.names_chunks() ? "; \"5F3\": model chunk 5's F3" : "", format_pipeline_schedule(sc));
  for (int st = 0; st < o.stages; ++st) {
    const int alive = max_in_flight(sc, st);
    std::string per_chunk;  // with several chunks: each chunk's most, which its slots hold
    for (size_t j = 0; sc.names_chunks() && j < sc.stage_chunks[st].size(); ++j) {
      per_chunk += fmt::format("{}chunk {} {}", j ? ", " : "", sc.chunk_of(st, static_cast<int>(j)),
                               max_in_flight_of_chunk(sc, st, static_cast<int>(j)));
    }
    fmt::print("stage {}: at most {} micro-batch{} alive{}\n", st, alive, alive == 1 ? "" : "es",
               per_chunk.empty() ? "" : " in its chunks together (" + per_chunk + ")");
  }
  print_predictions(graph, plan, m_batches);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Cut an ONNX multilayer perceptron into pipeline stages (and tensor-parallel shards) balanced by\n"
      "parameter count. Prints one row per stage and writes DIR/stage_<i>.onnx (stage_<i>_tp<j>.onnx when\n"
      "sharded; chunk_<c>.onnx when a schedule puts several chunks on each stage) and DIR/plan.json.\n"
      "Example: partition models/simple.onnx --stages 2\n"
      "With --plan, ranks every layout for N processes by predicted step time instead:\n"
      "  partition models/simple_digits.onnx --plan --ranks 4 --batch-size 64 --profile profile.json",
      "partition"};
  Args a;
  define(app, a);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::string what = e.what();
    return fail(what + " (see partition --help)");
  }
  PartitionOptions& o = a.o;
  if (!a.plan) {
    for (const char* flag : {"--ranks", "--memory-per-rank", "--profile", "--top", "--max-micro-batches"}) {
      if (app.count(flag) > 0) return fail(std::string(flag) + " is for --plan (see partition --help)");
    }
  }
  o.balance = a.balance == "flops"    ? BalanceBy::kFlops
              : a.balance == "memory" ? BalanceBy::kMemory
                                      : BalanceBy::kParams;
  o.schedule = a.schedule;
  o.optimizer_slots = a.optimizer == "sgd" ? 1 : 2;
  o.recompute_activations = !a.keep_activations;
  o.zero_replicas = a.zero >= 1 ? a.replicas : 1;
  o.zero_stage = a.zero;
  if (!(a.bucket_mb > 0) || a.bucket_mb > 1e6) return fail("--bucket-mb must be a positive size in MB, at most 1e6");
  o.bucket_bytes = static_cast<int64_t>(a.bucket_mb * (1 << 20));
  if (a.plan) return run_plan(app, a);
  if (a.out_dir.empty()) a.out_dir = std::filesystem::path(a.model).stem().string() + "_stages";
  // Before any work: the folder must take the files (it is created if missing).
  if (Status s = check_creatable_folder(a.out_dir); !s) {
    return fail("--out: output folder '" + a.out_dir + "' cannot be used: " + s.message());
  }
  if (!a.chart.empty()) {  // before any work: a chart that cannot be drawn is a bad flag
    if (Status s = check_picture_output(a.chart); !s) return fail("--chart: " + s.message());
  }

  Result<ImportedModel> m = import_onnx_file(a.model);
  if (!m) return fail(m.status().message());
  Result<Plan> plan = make_plan(m->graph, a.model, o);
  if (!plan && !plan.status().setting().empty()) return fail(flag_message(plan.status(), kFlags));
  if (!plan) return fail(a.model + ": " + plan.status().message());
  if (Status s = write_partition(*m, *plan, a.out_dir); !s) return fail(s.message());
  if (a.json) {
    fmt::print("{}\n", plan_json_text(*plan, m->graph));
  } else {
    fmt::print("{}", plan_table_text(m->graph, *plan, a.out_dir));
  }
  if (!a.chart.empty()) {
    if (Status s = draw_picture(partition_chart_data(*plan), a.chart); !s) return fail("--chart: " + s.message());
    if (!a.json) fmt::print("wrote the chart to {}\n", a.chart);
  }
  if (a.show_schedule && !a.json) print_schedule(m->graph, *plan);
  return 0;
}
