// pipeshard.train: train's own set-up and step loop (tools/train/, the library the tool
// runs) on NumPy arrays read in place, in one process. The keyword arguments arrive as
// train's flags (pipeshard/__init__.py turns them into flags), so that the defaults, the
// checks and their messages are the tool's.
#include <csignal>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "comm/comm.h"
#include "dataset/npy.h"
#include "python/model.h"
#include "tools/train/args.h"
#include "tools/train/loop.h"
#include "tools/train/run.h"
#include "tools/train/setup.h"

namespace py = pybind11;

namespace pipeshard::python {
namespace {

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
  // (train() sees to it).
  auto* held = new py::object(array);
  v.owner = std::shared_ptr<const void>(held, [](const void* p) { delete static_cast<const py::object*>(p); });
  return v;
}

struct TrainResult {
  std::shared_ptr<Model> model;
  std::vector<train_cli::StepRow> history;
  std::vector<train_cli::EvalRow> evals;
};

// train's argv: the model, the arrays' names where the files would be, then `flags`.
std::vector<std::string> command_line(const Model& m, bool with_eval, const std::vector<std::string>& flags) {
  std::vector<std::string> words = {"train", m.imported.path, "--data", "X", "--labels", "y"};
  if (with_eval) words.insert(words.end(), {"--eval-data", "eval X", "--eval-labels", "eval y"});
  words.insert(words.end(), flags.begin(), flags.end());
  return words;
}

TrainResult train(const std::shared_ptr<Model>& model, const py::handle& x, const py::handle& y,
                  const py::object& eval_x, const py::object& eval_y, const std::vector<std::string>& flags,
                  bool verbose) {
  using namespace train_cli;
  const bool with_eval = !eval_x.is_none();
  std::vector<std::string> words = command_line(*model, with_eval, flags);
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(w.data());
  Args a;
  std::optional<int> answered;  // --help: not a keyword here
  const Status parsed = parse_command_line(static_cast<int>(argv.size()), argv.data(), false, a, answered);

  std::string bad_input;
  TrainResult result;
  // The views hold the Python arrays, which only the GIL may release. These copies go
  // last, when this function returns with the GIL held; whatever copies the run made
  // (the data sets, the trainer's) go before, without it.
  std::optional<ArraysInMemory> data = ArraysInMemory{view_of(x, "X"), view_of(y, "y")}, eval;
  if (with_eval) eval = ArraysInMemory{view_of(eval_x, "eval X"), view_of(eval_y, "eval y")};
  int exit = 0;
  {
    py::gil_scoped_release free_python;
    // The world outlives the run's groups (tools/train/run.h).
    std::unique_ptr<Communicator> world = make_single_process_communicator();
    auto run = std::make_unique<Run>();
    run->say_bad_input = [&bad_input](const std::string& message) {
      if (bad_input.empty()) bad_input = message;
    };
    run->log = verbose;
    run->model = model->with_current_weights();
    run->data_arrays = data;
    run->eval_arrays = eval;
    run->on_step = [&result](const StepRow& r) { result.history.push_back(r); };
    run->on_eval = [&result](const EvalRow& e) { result.evals.push_back(e); };
    if (!set_up_run(a, parsed, *world, *run)) {
      exit = kExitBadInput;
    } else if (Status s = run->trainer->check_links(); !s) {
      bad_input = s.message();
      exit = kExitBadInput;
    } else {
      exit = run_steps(a, *run, *world).exit.value_or(0);
    }
    if (exit == 0) {
      Graph trained = run->model->graph;
      run->trainer->download_parameters(trained);
      result.model = std::make_shared<Model>(Model{model->imported, std::move(trained), true});
    }
    run.reset();
    world.reset();
  }
  if (exit == 128 + SIGINT) {
    PyErr_SetNone(PyExc_KeyboardInterrupt);
    throw py::error_already_set();
  }
  if (exit != 0) {
    raise_value_error(bad_input.empty() ? "training stopped (exit status " + std::to_string(exit) + ")" : bad_input);
  }
  return result;
}

}  // namespace

void define_training(py::module_& m) {
  py::class_<train_cli::StepRow>(m, "Step", "One optimizer step, as train's --metrics row says it.")
      .def_readonly("step", &train_cli::StepRow::step)
      .def_readonly("epoch", &train_cli::StepRow::epoch)
      .def_readonly("loss", &train_cli::StepRow::loss)
      .def_readonly("lr", &train_cli::StepRow::lr)
      .def_readonly("samples_per_s", &train_cli::StepRow::samples_per_s)
      .def_readonly("skipped", &train_cli::StepRow::skipped)
      .def("__repr__", [](const train_cli::StepRow& r) {
        return "Step(step=" + std::to_string(r.step) + ", epoch=" + std::to_string(r.epoch) +
               ", loss=" + py::repr(py::float_(r.loss)).cast<std::string>() + ")";
      });
  py::class_<train_cli::EvalRow>(m, "Evaluation", "The evaluation after an epoch's last step.")
      .def_readonly("epoch", &train_cli::EvalRow::epoch)
      .def_readonly("step", &train_cli::EvalRow::step)
      .def_readonly("train_loss", &train_cli::EvalRow::train_loss)
      .def_readonly("loss", &train_cli::EvalRow::loss)
      .def_readonly("accuracy", &train_cli::EvalRow::accuracy);
  py::class_<TrainResult>(m, "TrainResult", "What pipeshard.train returns.")
      .def_readonly("model", &TrainResult::model, "the trained model")
      .def_readonly("history", &TrainResult::history, "one Step per optimizer step")
      .def_readonly("eval", &TrainResult::evals, "one Evaluation per epoch, when eval data was given");
  m.def("_train", &train, py::arg("model"), py::arg("X"), py::arg("y"), py::arg("eval_X"), py::arg("eval_y"),
        py::arg("flags"), py::arg("verbose"));
}

}  // namespace pipeshard::python
