// pipeshard.train and pipeshard.check_equivalence: train's own set-up, step loop and
// report (tools/train/, the library the tool runs) on NumPy arrays read in place, in one
// process or, under mpirun, in every process of the job. The keyword arguments arrive as
// train's flags (pipeshard/__init__.py turns them into flags), so that the defaults, the
// checks and their messages are the tool's.
#include <csignal>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <CLI/CLI.hpp>

#include "comm/comm.h"
#include "comm/watchdog.h"
#include "dataset/npy.h"
#include "python/model.h"
#include "tools/train/args.h"
#include "tools/train/auto_layout.h"
#include "tools/train/check_equivalence.h"
#include "tools/train/loop.h"
#include "tools/train/report.h"
#include "tools/train/run.h"
#include "tools/train/setup.h"

namespace py = pybind11;

namespace pipeshard::python {
namespace {

using train_cli::EvalRow;
using train_cli::StepRow;

// The NpyType of a NumPy dtype in this machine's (little-endian) byte order, if any.
std::optional<NpyType> npy_type_of(const py::dtype& d) {
  if (d.equal(py::dtype::of<float>())) return NpyType::kFloat32;
  if (d.equal(py::dtype::of<int64_t>())) return NpyType::kInt64;
  if (d.equal(py::dtype::of<int32_t>())) return NpyType::kInt32;
  return std::nullopt;
}

// A view of `array`'s elements where they lie, which keeps the array alive. TypeError for
// what cannot be read in place: not an ndarray, a dtype other than float32, int64 or int32,
// or a layout other than C-contiguous. `name` names it in messages.
NpyView view_of(const py::handle& object, const std::string& name) {
  if (!py::isinstance<py::array>(object)) {
    throw py::type_error(name + " must be a numpy array, not " +
                         std::string(py::str(py::type::of(object).attr("__name__"))));
  }
  py::array array = py::reinterpret_borrow<py::array>(object);
  const std::optional<NpyType> type = npy_type_of(array.dtype());
  if (!type) {
    throw py::type_error(name + ": holds " + std::string(py::str(array.dtype())) +
                         " data; pipeshard reads float32 features and int64/int32 labels or float32 targets");
  }
  if (!(array.flags() & py::array::c_style)) {
    throw py::type_error(
        name + " is not C-contiguous, and pipeshard reads arrays in place: pass np.ascontiguousarray(" + name + ")");
  }
  NpyView v;
  v.path = name;
  v.type = *type;
  v.shape.assign(array.shape(), array.shape() + array.ndim());
  v.data = static_cast<const uint8_t*>(array.data());
  // The view holds a reference to the array. Its last copy must go while the GIL is held
  // (run_call sees to it).
  auto* held = new py::object(array);
  v.owner = std::shared_ptr<const void>(held, [](const void* p) { delete static_cast<const py::object*>(p); });
  return v;
}

struct TrainResult {
  std::shared_ptr<Model> model;
  std::vector<StepRow> history;
  std::vector<EvalRow> evals;
  std::optional<std::string> layout;        // layout="auto": the planner's choice (Layout::text())
  std::optional<double> predicted_step_ms;  // and its predicted step time
};

// What a call asks of the library.
struct Call {
  std::shared_ptr<Model> model;
  py::handle x, y;
  py::object eval_x, eval_y;       // None: no evaluation
  std::vector<std::string> flags;  // train's, from the keywords
  bool verbose = false;            // train's lines on stderr
  py::object callback;             // None, or called with each Step on rank 0
  bool check_equivalence = false;  // --check-equivalence is among the flags: check instead of train
};

// How it went, on this rank.
struct Outcome {
  int exit = 0;
  std::string message;  // bad input, as train would say it (rank 0's, on every rank)
  TrainResult result;   // exit 0: the history, evaluations and trained model, on every rank
  std::optional<py::error_already_set> callback_error;  // what the callback raised, on rank 0
};

// train's argv: the model, the arrays' names where the files would be, then the flags.
std::vector<std::string> command_line(const Call& c) {
  std::vector<std::string> words = {"train", c.model->imported.path, "--data", "X", "--labels", "y"};
  if (!c.eval_x.is_none()) words.insert(words.end(), {"--eval-data", "eval X", "--eval-labels", "eval y"});
  words.insert(words.end(), c.flags.begin(), c.flags.end());
  return words;
}

// `text` on every rank as it is on `root`'s (collective).
void broadcast_text(Communicator& world, std::string& text, int root) {
  int64_t size = static_cast<int64_t>(text.size());
  world.broadcast_bytes(&size, sizeof size, root);
  text.resize(static_cast<size_t>(size));
  if (size > 0) world.broadcast_bytes(text.data(), size, root);
}

// Rank 0's rows on every rank (collective). Each row is a few numbers; a vector of them
// travels as bytes.
template <typename Row>
void broadcast_rows(Communicator& world, std::vector<Row>& rows) {
  static_assert(std::is_trivially_copyable_v<Row>);
  int64_t count = static_cast<int64_t>(rows.size());
  world.broadcast_bytes(&count, sizeof count, 0);
  rows.resize(static_cast<size_t>(count));
  if (count > 0) world.broadcast_bytes(rows.data(), count * static_cast<int64_t>(sizeof(Row)), 0);
}

// The run, on this rank, with the GIL released: what train's main does, with rank 0's
// findings and results then shared so that every rank returns the same.
void run_call(const Call& c, train_cli::Args a, Status parsed, const train_cli::ArraysInMemory& data,
              const std::optional<train_cli::ArraysInMemory>& eval, Outcome& out) {
  using namespace train_cli;
  // The world outlives the run's groups (tools/train/run.h): MPI's under mpirun.
  std::unique_ptr<Communicator> world = make_world_communicator();
  auto run = std::make_unique<Run>();
  run->say_bad_input = [&out](const std::string& message) {
    if (out.message.empty()) out.message = message;
  };
  run->log = c.verbose;
  run->model = c.model->with_current_weights();
  run->data_arrays = data;
  run->eval_arrays = eval;
  run->on_step = [&c, &out](const StepRow& r) {
    out.result.history.push_back(r);
    if (out.callback_error) return false;  // it raised: called no more while the others learn it
    if (c.callback.is_none()) return true;
    py::gil_scoped_acquire python;
    try {
      c.callback(r);
      return true;
    } catch (py::error_already_set& e) {
      out.callback_error.emplace(std::move(e));
      return false;
    }
  };
  run->on_eval = [&out](const EvalRow& e) { out.result.evals.push_back(e); };
  if (parsed && a.layout == "auto") {  // collective, and every rank decides alike, as in train
    Result<train_cli::ChosenLayout> chosen = train_cli::choose_layout(a, *world, run->model, c.verbose);
    if (chosen) {
      run->predicted_step_ms = chosen->predicted_ms;
      out.result.layout = chosen->text;
      out.result.predicted_step_ms = chosen->predicted_ms;
    }
    parsed = chosen.status();
  }
  // Whether every rank is sure to reach the end together: not when one rank alone found a
  // mismatch with its neighbour, whose exit ends the job under mpirun (as train's does).
  bool together = true;
  if (!set_up_run(a, parsed, *world, *run)) {
    out.exit = kExitBadInput;
  } else if (Status s = run->trainer->check_links(); !s) {
    out.message = s.message();
    out.exit = kExitBadInput;
    together = false;
  } else if (c.check_equivalence) {
    const auto same_kind = [&a, &run]() -> std::unique_ptr<Backend> {
      Result<std::unique_ptr<Backend>> backend = make_backend_like_this_one(a, *run);
      PIPESHARD_CHECK(backend.is_ok(), backend.status().message());  // this process made one already
      return std::move(*backend);
    };
    out.exit = train_cli::check_equivalence(run->model->graph, *run->data, run->config, *run->trainer,
                                            a.check_equivalence, *world, same_kind);
  } else {
    const LoopOutcome loop = run_steps(a, *run, *world);
    out.exit = loop.exit ? *loop.exit : report_finished_run(a, *run, *world, loop);
  }
  // A callback that raised on the last step stopped nothing: the run had ended. It still
  // ends as a stopped one, on every rank.
  if (out.callback_error && out.exit == 0) out.exit = kExitStoppedByCaller;
  if (together && world->size() > 1) {
    // Rank 0's word on how it ended holds for all (a file rank 0 alone failed to write).
    world->broadcast_bytes(&out.exit, sizeof out.exit, 0);
    broadcast_text(*world, out.message, 0);
    broadcast_rows(*world, out.result.history);
    broadcast_rows(*world, out.result.evals);
  }
  if (out.exit == 0 && !c.check_equivalence) {
    Graph trained = run->model->graph;
    run->trainer->download_parameters(trained);  // gathers every stage and shard on rank 0
    if (world->size() > 1) {
      for (Parameter& p : trained.params) world->broadcast(p.data.data(), static_cast<int64_t>(p.data.size()), 0);
    }
    out.result.model = std::make_shared<Model>(Model{c.model->imported, std::move(trained), true});
  }
  watchdog_disarm();                                // Python goes on without waiting on the others
  if (out.exit != 0) run->device_groups.abandon();  // NCCL's, which must not be shut down in order now
  run.reset();
  world.reset();
}

// Runs `c` and turns how it ended into Python's terms: the outcome, or the exception.
Outcome call(const Call& c) {
  using namespace train_cli;
  std::vector<std::string> words = command_line(c);
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  Args a;
  std::optional<int> answered;  // --help: not a keyword here
  const Status parsed = parse_command_line(static_cast<int>(argv.size()), argv.data(), false, a, answered);

  Outcome out;
  // The views hold the Python arrays, which only the GIL may release. These copies go
  // last, when this function returns with the GIL held; whatever copies the run made
  // (the data sets, the trainer's) go before, without it.
  const ArraysInMemory data{view_of(c.x, "X"), view_of(c.y, "y")};
  std::optional<ArraysInMemory> eval;
  if (!c.eval_x.is_none()) eval = ArraysInMemory{view_of(c.eval_x, "eval X"), view_of(c.eval_y, "eval y")};
  {
    py::gil_scoped_release free_python;
    run_call(c, a, parsed, data, eval, out);
  }
  if (out.callback_error) throw std::move(*out.callback_error);  // re-raised as it was
  if (out.exit == kExitStoppedByCaller) {
    const int64_t step = out.result.history.empty() ? 0 : out.result.history.back().step;
    throw std::runtime_error("training stopped after step " + std::to_string(step) +
                             ": rank 0's callback raised an exception");
  }
  if (out.exit == 128 + SIGINT) {
    PyErr_SetNone(PyExc_KeyboardInterrupt);
    throw py::error_already_set();
  }
  if (out.exit == 128 + SIGTERM) {  // ends the interpreter with the status a shell expects
    PyErr_SetObject(PyExc_SystemExit, py::int_(out.exit).ptr());
    throw py::error_already_set();
  }
  if (out.exit != 0 && !(c.check_equivalence && out.exit == 1)) {
    raise_value_error(out.message.empty() ? "training stopped (exit status " + std::to_string(out.exit) + ")"
                                          : out.message);
  }
  return out;
}

TrainResult train(const std::shared_ptr<Model>& model, const py::handle& x, const py::handle& y,
                  const py::object& eval_x, const py::object& eval_y, const std::vector<std::string>& flags,
                  bool verbose, const py::object& callback) {
  return call({model, x, y, eval_x, eval_y, flags, verbose, callback, false}).result;
}

// True when the layout's run equals one process's over the flags' --check-equivalence steps.
bool check_equivalence(const std::shared_ptr<Model>& model, const py::handle& x, const py::handle& y,
                       const std::vector<std::string>& flags) {
  return call({model, x, y, py::none(), py::none(), flags, true, py::none(), true}).exit == 0;
}

// train's flags as its --help lists them: [(flag, help text)], for the docstring of
// pipeshard.train and the test that every flag has a keyword.
std::vector<std::pair<std::string, std::string>> train_flags() {
  CLI::App app;
  train_cli::Args a;
  train_cli::define(app, a);
  std::vector<std::pair<std::string, std::string>> out;
  for (const CLI::Option* o : app.get_options()) {
    if (o->get_lnames().empty()) continue;  // the positional model
    out.emplace_back("--" + o->get_lnames().front(), o->get_description());
  }
  return out;
}

// Where this process sits in the job: (rank, size), (0, 1) without mpirun.
std::pair<int, int> place_in_job() {
  std::unique_ptr<Communicator> world = make_world_communicator();
  return {world->rank(), world->size()};
}

}  // namespace

void define_training(py::module_& m) {
  py::class_<StepRow>(m, "Step", "One optimizer step, as train's --metrics row says it.")
      .def_readonly("step", &StepRow::step, "1-based")
      .def_readonly("epoch", &StepRow::epoch, "1-based")
      .def_readonly("total_steps", &StepRow::total_steps, "the run's last step")
      .def_readonly("loss", &StepRow::loss, "the step's mean loss over its batch (every replica's)")
      .def_readonly("lr", &StepRow::lr, "the learning rate the schedule gave this step")
      .def_readonly("samples_per_s", &StepRow::samples_per_s, "samples over the time since the previous step ended")
      .def_readonly("skipped", &StepRow::skipped, "on_nonfinite='skip' or loss scaling skipped it")
      .def("__repr__", [](const StepRow& r) {
        return "Step(step=" + std::to_string(r.step) + ", epoch=" + std::to_string(r.epoch) +
               ", loss=" + py::repr(py::float_(r.loss)).cast<std::string>() + ")";
      });
  py::class_<EvalRow>(m, "Evaluation", "The evaluation after an epoch's last step.")
      .def_readonly("epoch", &EvalRow::epoch)
      .def_readonly("step", &EvalRow::step)
      .def_readonly("train_loss", &EvalRow::train_loss, "the epoch's mean training loss over its finite steps")
      .def_readonly("loss", &EvalRow::loss)
      .def_readonly("accuracy", &EvalRow::accuracy, "a fraction in [0, 1]; -1 for a regression loss")
      .def("__repr__", [](const EvalRow& e) {
        return "Evaluation(epoch=" + std::to_string(e.epoch) +
               ", loss=" + py::repr(py::float_(e.loss)).cast<std::string>() +
               ", accuracy=" + py::repr(py::float_(e.accuracy)).cast<std::string>() + ")";
      });
  py::class_<TrainResult>(m, "TrainResult", "What pipeshard.train returns, the same on every rank.")
      .def_readonly("model", &TrainResult::model, "the trained model")
      .def_readonly("history", &TrainResult::history, "one Step per optimizer step")
      .def_readonly("eval", &TrainResult::evals, "one Evaluation per epoch, when eval data was given")
      .def_readonly("layout", &TrainResult::layout,
                    "layout='auto': the layout the planner chose, as partition --plan names it; else None")
      .def_readonly("predicted_step_ms", &TrainResult::predicted_step_ms,
                    "layout='auto': the planner's predicted ms per step for it; else None");
  m.def("_train", &train, py::arg("model"), py::arg("X"), py::arg("y"), py::arg("eval_X"), py::arg("eval_y"),
        py::arg("flags"), py::arg("verbose"), py::arg("callback") = py::none());
  m.def("_check_equivalence", &check_equivalence, py::arg("model"), py::arg("X"), py::arg("y"), py::arg("flags"));
  m.def("_place_in_job", &place_in_job);
  m.def("_train_flags", &train_flags);
}

}  // namespace pipeshard::python
