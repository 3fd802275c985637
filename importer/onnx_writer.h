// Writing a trained model back as ONNX: the file as it was imported, with every
// initializer that a Graph parameter came from holding the parameter's current values,
// under the same name, dims and layout. PyTorch users' tools and onnxruntime load it
// as they loaded the original.
#ifndef PIPESHARD_IMPORTER_ONNX_WRITER_H_
#define PIPESHARD_IMPORTER_ONNX_WRITER_H_

#include <cstdint>
#include <string>

#include <onnx/onnx_pb.h>

#include "common/status.h"
#include "importer/graph.h"
#include "importer/onnx_importer.h"

namespace pipeshard {

// Protobuf refuses to write or read a message of 2 GiB or more.
constexpr int64_t kProtobufLimit = (int64_t{1} << 31) - 1;

// A model as the bytes of its files: `model` for the .onnx file and, for a model too large
// for one protobuf message, `data` for the external-data file `data_name` beside it.
struct ModelFiles {
  std::string model, data_name, data;
};

// Serialises `model` for the file `path`. A model of up to `inline_limit` bytes is one
// file. A larger one keeps every initializer of 1 KiB or more in `<file name>.data`
// beside it instead (ONNX external data, each tensor at an offset aligned to 4 KiB), as
// torch.onnx.export does; onnxruntime and onnx.load read it from there. `model`'s
// initializers are moved out in the process. Fails only when even that leaves the model
// over the limit.
Result<ModelFiles> serialize_model(onnx::ModelProto& model, const std::string& path,
                                   int64_t inline_limit = kProtobufLimit);

// Writes `model`'s source with the values of `trained` (a Graph with model.graph's
// parameters, e.g. after training) to `path`, atomically (with serialize_model()'s
// `<path>.data` first, when the model needs one). A parameter that was an Identity of
// another tensor (BatchNorm statistics that the exporter folded into the weight) becomes
// an initializer of its own, replacing that Identity.
Status write_trained_model(const ImportedModel& model, const Graph& trained, const std::string& path,
                           int64_t inline_limit = kProtobufLimit);

}  // namespace pipeshard

#endif  // PIPESHARD_IMPORTER_ONNX_WRITER_H_
