// Writing a trained model back as ONNX: the file as it was imported, with every
// initializer that a Graph parameter came from holding the parameter's current values,
// under the same name, dims and layout. PyTorch users' tools and onnxruntime load it
// as they loaded the original.
#ifndef PIPESHARD_IMPORTER_ONNX_WRITER_H_
#define PIPESHARD_IMPORTER_ONNX_WRITER_H_

#include <string>

#include "common/status.h"
#include "importer/graph.h"
#include "importer/onnx_importer.h"

namespace pipeshard {

// Writes `model`'s source with the values of `trained` (a Graph with model.graph's
// parameters, e.g. after training) to `path`, atomically. Weights that were in external
// data files are written inline. A parameter that was an Identity of another tensor
// (BatchNorm statistics that the exporter folded into the weight) becomes an
// initializer of its own, replacing that Identity.
Status write_trained_model(const ImportedModel& model, const Graph& trained, const std::string& path);

}  // namespace pipeshard

#endif  // PIPESHARD_IMPORTER_ONNX_WRITER_H_
