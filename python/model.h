// The Python module's model: what `pipeshard.load` returns and `pipeshard.train` trains
// and gives back (result.model). Bindings only; the work is the libraries'.
#ifndef PIPESHARD_PYTHON_MODEL_H_
#define PIPESHARD_PYTHON_MODEL_H_

#include <memory>
#include <string>

#include <pybind11/pybind11.h>

#include "importer/onnx_importer.h"
#include "ir/graph.h"

namespace pipeshard::python {

// A model as imported, with its current weights: the file's (load) or trained ones
// (train). Immutable once made, so that Python objects can share it.
struct Model {
  ImportedModel imported;  // as read: the file's structure and weights, what save() writes back into
  Graph graph;             // imported.graph with the current weights
  bool trained = false;    // graph's weights are not the file's

  // The model to train: the imported one with the current weights.
  ImportedModel with_current_weights() const {
    ImportedModel m = imported;
    m.graph = graph;
    return m;
  }
};

// Raises ValueError carrying `message` (a library's or the CLI's one-line message).
[[noreturn]] inline void raise_value_error(const std::string& message) { throw pybind11::value_error(message); }

// pipeshard.train and the classes it returns, on `m`.
void define_training(pybind11::module_& m);

}  // namespace pipeshard::python

#endif  // PIPESHARD_PYTHON_MODEL_H_
