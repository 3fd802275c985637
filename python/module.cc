// The Python module _pipeshard (python/pipeshard/__init__.py re-exports it): load, the
// Model, its partition Plan. Thin: each call is one of the libraries' the partition tool
// makes, with the same messages.
#include <stdlib.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "common/atomic_file.h"
#include "common/cli.h"
#include "common/host_memory.h"
#include "importer/onnx_importer.h"
#include "importer/onnx_writer.h"
#include "partitioner/plan.h"
#include "partitioner/plan_table.h"
#include "partitioner/stage_writer.h"
#include "planner/planner.h"
#include "planner/profile.h"
#include "python/model.h"
#include "schedule/registry.h"

namespace py = pybind11;

namespace pipeshard::python {
namespace {

template <typename T>
T value_or_raise(Result<T> r) {
  if (!r) raise_value_error(r.status().message());
  return std::move(*r);
}

// `label` names a model given as bytes in messages and Model.path (default "<bytes>";
// pipeshard.load passes "<ModelProto>", pipeshard.from_torch "<torch Sequential>" for an
// nn.Sequential). A file is named by its path.
std::shared_ptr<Model> load(const py::object& source, const std::optional<std::string>& label) {
  ImportedModel imported;
  if (py::isinstance<py::bytes>(source)) {
    const std::string bytes = source.cast<std::string>();
    imported = value_or_raise(import_onnx_bytes(bytes, ".", label.value_or("<bytes>")));
  } else if (py::isinstance<py::str>(source) || py::hasattr(source, "__fspath__")) {
    if (label) throw py::type_error("pipeshard.load: label names bytes; a file is named by its path");
    const std::string path = py::str(py::module_::import("os").attr("fspath")(source));
    imported = value_or_raise(import_onnx_file(path));
  } else {
    throw py::type_error(
        "pipeshard.load takes a path (str or os.PathLike), the bytes of an .onnx file or an onnx.ModelProto, not " +
        std::string(py::str(py::type::of(source).attr("__name__"))));
  }
  Graph graph = imported.graph;
  return std::make_shared<Model>(Model{std::move(imported), std::move(graph)});
}

// A partition of a model, with the model it cuts (for the table, plan.json and the files).
struct PlanHandle {
  std::shared_ptr<const Model> model;
  Plan plan;
};

// The keyword each PartitionOptions setting is given by (a library error names it).
const FlagNames kPartitionKeywords = {{"stages", "stages"},          {"tensor_parallel", "tensor_parallel"},
                                      {"batch_size", "batch_size"},  {"micro_batches", "micro_batches"},
                                      {"schedule", "schedule"},      {"virtual_stages", "virtual_stages"},
                                      {"zero_replicas", "replicas"}, {"zero_stage", "zero"},
                                      {"bucket_bytes", "bucket_mb"}};

// As partition --balance and --optimizer take them.
BalanceBy balance_of(const std::string& name) {
  for (BalanceBy b : {BalanceBy::kParams, BalanceBy::kFlops, BalanceBy::kMemory}) {
    if (name == balance_name(b)) return b;
  }
  raise_value_error("balance must be params, flops or memory, not '" + name + "'");
}

int optimizer_slots_of(const std::string& name) {
  if (name == "sgd") return 1;
  if (name == "adam" || name == "adamw") return 2;
  raise_value_error("optimizer must be sgd, adam or adamw, not '" + name + "'");
}

// As partition --bucket-mb takes it: MB to bytes.
int64_t bucket_bytes_of(double bucket_mb) {
  if (!(bucket_mb > 0) || bucket_mb > 1e6) raise_value_error("bucket_mb must be a positive size in MB, at most 1e6");
  return static_cast<int64_t>(bucket_mb * (1 << 20));
}

PlanHandle partition(const std::shared_ptr<Model>& model, int stages, int tensor_parallel, const std::string& balance,
                     int64_t batch_size, std::optional<int> micro_batches, const std::string& schedule,
                     int virtual_stages, const std::string& optimizer, bool keep_activations, int replicas, int zero,
                     double bucket_mb) {
  PartitionOptions o;
  o.stages = stages;
  o.tensor_parallel = tensor_parallel;
  o.balance = balance_of(balance);
  o.batch_size = batch_size;
  o.micro_batches = micro_batches.value_or(0);
  if (!find_schedule(schedule))
    raise_value_error("schedule must be one of " + schedule_names_text() + ", not '" + schedule + "'");
  o.schedule = schedule;
  o.virtual_stages = virtual_stages;
  o.optimizer_slots = optimizer_slots_of(optimizer);
  o.recompute_activations = !keep_activations;
  if (replicas < 1)
    raise_value_error("replicas: a stage needs at least 1 data-parallel replica, not " + std::to_string(replicas));
  o.zero_replicas = zero >= 1 ? replicas : 1;
  o.zero_stage = zero;
  o.bucket_bytes = bucket_bytes_of(bucket_mb);
  Result<Plan> plan = make_plan(model->graph, model->imported.path, o);
  if (!plan && !plan.status().setting().empty()) raise_value_error(flag_message(plan.status(), kPartitionKeywords));
  if (!plan) raise_value_error(model->imported.path + ": " + plan.status().message());
  return PlanHandle{model, std::move(*plan)};
}

// Every layout of the model on `ranks` processes, fastest predicted first, as partition
// --plan --json gives it (a dict, through Python's json). ValueError: bad options or profile.
py::object plan_layouts_dict(const std::shared_ptr<Model>& model, int ranks, int64_t batch_size,
                             const std::string& optimizer, const std::string& balance, double bucket_mb,
                             const py::object& memory_per_rank, const py::object& profile, int max_micro_batches) {
  LayoutSearchOptions o;
  if (ranks < 1) raise_value_error("ranks must be at least 1, the processes to plan for (mpirun -np N)");
  o.ranks = ranks;
  if (batch_size < 1 || batch_size > kMaxBatchSize)
    raise_value_error("batch_size must be between 1 and " + std::to_string(kMaxBatchSize));
  o.batch_size = batch_size;
  o.optimizer_slots = optimizer_slots_of(optimizer);
  o.balance = balance_of(balance);
  o.bucket_bytes = bucket_bytes_of(bucket_mb);
  if (max_micro_batches < 1) raise_value_error("max_micro_batches must be at least 1");
  o.max_micro_batches = max_micro_batches;
  if (!memory_per_rank.is_none()) {  // bytes, or a size as partition --memory-per-rank takes it
    const std::string text = py::str(memory_per_rank);
    const bool number = py::isinstance<py::int_>(memory_per_rank) && !py::isinstance<py::bool_>(memory_per_rank);
    if (!(number || py::isinstance<py::str>(memory_per_rank)) || !parse_bytes(text, &o.memory_per_rank))
      raise_value_error("memory_per_rank: '" + text + "' is not a size such as 16 << 30, '16GiB' or '80GB'");
  }
  MachineProfile machine;
  machine.machine = "nominal (no profile; the profile tool measures this machine)";
  if (!profile.is_none()) {
    Result<MachineProfile> read =
        read_profile_file(py::module_::import("os").attr("fspath")(profile).cast<std::string>());
    if (!read) raise_value_error("profile: " + read.status().message());
    machine = std::move(*read);
  }
  const LayoutPlan plan = plan_layouts(model->graph, o, machine);
  const std::string text =
      layout_plan_json(plan, model->imported.path).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return py::module_::import("json").attr("loads")(text);
}

py::dict stage_dict(const Graph& g, const StagePlan& s) {
  std::vector<std::string> nodes, ops;
  for (int n : s.nodes) {
    nodes.push_back(g.nodes[n].name);
    ops.push_back(op_kind_name(g.nodes[n]));
  }
  py::dict d;
  d["stage"] = s.stage;
  d["holder"] = s.holder;
  d["layers"] = py::make_tuple(s.first_layer, s.end_layer);
  d["parameters"] = s.parameters;
  d["memory_bytes"] = s.memory_bytes;
  d["flops_per_sample"] = s.flops_per_sample;
  d["activation_bytes_out"] = s.activation_bytes_out;
  d["nodes"] = nodes;
  d["ops"] = ops;
  d["files"] = s.files;
  return d;
}

// The stage files of `plan` into `folder`. The stage writer cuts the file's source
// (ImportedModel::source), so trained weights first go into a file of their own, in a
// temporary folder, which is imported again: the same graph, so the same plan.
Status write_stages(const Model& m, const Plan& plan, const std::string& folder) {
  if (!m.trained) return write_partition(m.imported, plan, folder);
  std::string scratch = (std::filesystem::temp_directory_path() / "pipeshard_trained_XXXXXX").string();
  if (::mkdtemp(scratch.data()) == nullptr) {
    return Status::error("cannot make a temporary folder in " + std::filesystem::temp_directory_path().string());
  }
  const std::string path = scratch + "/trained.onnx";
  Status s = write_trained_model(m.imported, m.graph, path);
  if (s) {
    Result<ImportedModel> trained = import_onnx_file(path);
    s = trained ? write_partition(*trained, plan, folder) : trained.status();
  }
  std::error_code ignored;
  std::filesystem::remove_all(scratch, ignored);
  return s;
}

void save(const Model& m, const std::string& path) {
  if (Status s = write_trained_model(m.imported, m.graph, path); !s) raise_value_error(s.message());
}

// {initializer name: float32 array}, copies of the current weights.
py::dict weights(const Model& m) {
  py::dict out;
  for (const Parameter& p : m.graph.params) {
    py::array_t<float> a(p.dims);
    std::copy(p.data.begin(), p.data.end(), a.mutable_data());
    out[py::str(p.name)] = a;
  }
  return out;
}

}  // namespace
}  // namespace pipeshard::python

PYBIND11_MODULE(_pipeshard, m) {
  using namespace pipeshard;
  using namespace pipeshard::python;
  m.doc() = "pipeshard's libraries from Python: load, partition and train ONNX MLPs (see pipeshard/__init__.py)";

  py::class_<Model, std::shared_ptr<Model>>(m, "Model", "An imported ONNX MLP with its current weights.")
      .def_property_readonly(
          "path", [](const Model& x) { return x.imported.path; }, "the path (or label) it was loaded from")
      .def_property_readonly(
          "layers", [](const Model& x) { return layer_of_nodes(x.graph).back() + 1; },
          "layers as partition counts them: a node with parameters starts one")
      .def_property_readonly(
          "parameter_count", [](const Model& x) { return x.graph.total_parameter_count(); },
          "trainable parameter elements, shared ones counted once")
      .def_property_readonly("nodes", [](const Model& x) { return x.graph.nodes.size(); })
      .def("save", &save, py::arg("path"), "Writes the model with its current weights to an .onnx file.")
      .def("weights", &weights, "The current weights: {initializer name: float32 numpy array} (copies).")
      .def("partition", &partition, py::arg("stages") = 1, py::arg("tensor_parallel") = 1,
           py::arg("balance") = "params", py::arg("batch_size") = 32, py::arg("micro_batches") = py::none(),
           py::arg("schedule") = "1f1b", py::arg("virtual_stages") = 0, py::arg("optimizer") = "adam",
           py::arg("keep_activations") = false, py::arg("replicas") = 1, py::arg("zero") = 0,
           py::arg("bucket_mb") = 25.0,
           "Cuts the model as `partition` does (its flags by the same names); a Plan. ValueError: bad options.")
      .def("plan_layouts", &plan_layouts_dict, py::arg("ranks"), py::arg("batch_size") = 32,
           py::arg("optimizer") = "adam", py::arg("balance") = "params", py::arg("bucket_mb") = 25.0,
           py::arg("memory_per_rank") = py::none(), py::arg("profile") = py::none(), py::arg("max_micro_batches") = 16,
           "Every layout (data x pipeline x tensor parallel, micro-batches, schedule, recomputation, ZeRO) on "
           "`ranks` processes, as `partition --plan --ranks N --json` gives it: a dict whose 'layouts' are the "
           "accepted ones, fastest predicted first, each with its 'train_flags' and 'predicted' step. profile: a "
           "profile.json (the profile tool's, or written by hand; default a nominal machine). ValueError: bad "
           "options or profile.")
      .def("__repr__", [](const Model& x) {
        return "<pipeshard.Model " + x.imported.path + ": " + std::to_string(x.graph.total_parameter_count()) +
               " parameters>";
      });

  py::class_<PlanHandle>(m, "Plan", "How a model is cut into pipeline stages and tensor-parallel shards.")
      .def_property_readonly(
          "stages",
          [](const PlanHandle& p) {
            py::list out;
            for (const StagePlan& s : p.plan.stages) out.append(stage_dict(p.model->graph, s));
            return out;
          },
          "one dict per piece (stage, or chunk): parameters, memory_bytes, nodes, ops, files, ...")
      .def_property_readonly("total_parameters", [](const PlanHandle& p) { return p.plan.total_parameters; })
      .def_property_readonly(
          "balance", [](const PlanHandle& p) { return p.plan.balance; }, "largest / mean stage cost")
      .def_property_readonly("crossing_bytes", [](const PlanHandle& p) { return p.plan.crossing_bytes; })
      .def("memory_per_stage", [](const PlanHandle& p) { return memory_per_stage(p.plan); })
      .def(
          "table",
          [](const PlanHandle& p, std::optional<std::string> folder) {
            return plan_table_text(p.model->graph, p.plan, folder.value_or(""));
          },
          py::arg("folder") = py::none(),
          "What partition prints; its last line, which says where the files went, only when `folder` "
          "(where write() put them) is given.")
      .def(
          "to_json", [](const PlanHandle& p) { return plan_json_text(p.plan, p.model->graph); },
          "plan.json's text, as partition --json prints it")
      .def(
          "write",
          [](const PlanHandle& p, const std::string& folder) {
            if (Status s = check_creatable_folder(folder); !s) {
              std::string message = "output folder '";
              message += folder;
              message += "' cannot be used: ";
              raise_value_error(message + s.message());
            }
            if (Status s = write_stages(*p.model, p.plan, folder); !s) raise_value_error(s.message());
          },
          py::arg("folder"), "Writes the stage files and plan.json into `folder` (created if missing).");

  m.def("load", &load, py::arg("source"), py::arg("label") = py::none(),
        "Imports an ONNX MLP from a path or the file's bytes (named `label` in messages, default \"<bytes>\"). "
        "ValueError: a file pipeshard cannot train. pipeshard.load (pipeshard/_load.py) also takes a ModelProto.");
  define_training(m);
}
