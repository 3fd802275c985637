// Writing a trained model back as ONNX: the file as it was imported, with every
// initializer that a Graph parameter came from holding the parameter's current values,
// under the same name, dims and layout. PyTorch users' tools and onnxruntime load it
// as they loaded the original.
#ifndef PIPESHARD_IMPORTER_ONNX_WRITER_H_
#define PIPESHARD_IMPORTER_ONNX_WRITER_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <onnx/onnx_pb.h>

#include "common/status.h"
#include "importer/onnx_importer.h"
#include "ir/graph.h"

namespace pipeshard {

// Protobuf refuses to write or read a message of 2 GiB or more.
constexpr int64_t kProtobufLimit = (int64_t{1} << 31) - 1;

// A model as the bytes of its files: `model` for the .onnx file and, for a model too large
// for one protobuf message, the pieces of the external-data file `data_name` beside it,
// one after another. `stale`: external-data files beside it that the file being replaced
// named and the new one does not, to remove once the new model is in place.
struct ModelFiles {
  std::string model, data_name;
  std::vector<std::string> data;
  std::set<std::string> stale;
};

// Serialises `model` for the file `path`. A model of up to `inline_limit` bytes is one
// file. A larger one keeps every initializer of 1 KiB or more in `<file name>.data`
// beside it instead (ONNX external data, each tensor at an offset aligned to 4 KiB), as
// torch.onnx.export does; onnxruntime and onnx.load read it from there. When the file
// already at `path` uses that name, the data goes to `<file name>.1.data` (and back the
// next time), so that the old pair stays whole until the new model replaces it: write the
// data, then the model, then remove_stale_data(). `model`'s initializers' bytes are moved
// into the pieces, not copied. Fails only when even that leaves the model over the limit.
Result<ModelFiles> serialize_model(onnx::ModelProto& model, const std::string& path,
                                   int64_t inline_limit = kProtobufLimit);
// Removes `files.stale` from beside `path`, quietly.
void remove_stale_data(const std::string& path, const ModelFiles& files);

// Writes `model`'s source with the values of `trained` (a Graph with model.graph's
// parameters, e.g. after training) to `path`, atomically (with serialize_model()'s
// external data first, when the model needs it). A parameter that was an Identity of
// another tensor (BatchNorm statistics that the exporter folded into the weight) becomes
// an initializer of its own, replacing that Identity.
Status write_trained_model(const ImportedModel& model, const Graph& trained, const std::string& path,
                           int64_t inline_limit = kProtobufLimit);

}  // namespace pipeshard

#endif  // PIPESHARD_IMPORTER_ONNX_WRITER_H_
