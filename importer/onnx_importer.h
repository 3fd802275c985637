// Reads an ONNX model file into a Graph (ir/graph.h).
//
// Accepts what torch.onnx.export produces for multilayer perceptrons, opsets 7 to 20:
// Linear as Gemm (any transB, alpha, beta), as MatMul(+Add) with a pre-transposed
// weight or a Transpose of it; Relu, LeakyRelu, Sigmoid, Tanh, GELU (the Erf pattern,
// the tanh pattern, the opset-20 Gelu op), SiLU (x*Sigmoid(x)), Softmax, LogSoftmax,
// LayerNorm (the decomposed ReduceMean pattern and LayerNormalization),
// BatchNormalization (inference and training_mode=1), Dropout, Flatten, Reshape,
// Identity, Constant, and residual Add. Sharded stage files written by pipeshard may
// also hold the "pipeshard" domain's AllReduce and AllGather.
//
// Everything else, and every malformed file, is refused with a Status whose message
// names the file and, where there is one, the node, its op type and the reason; so is a
// weight (an initializer a layer uses) that is inf or NaN, by its name and flat index.
#ifndef PIPESHARD_IMPORTER_ONNX_IMPORTER_H_
#define PIPESHARD_IMPORTER_ONNX_IMPORTER_H_

#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"
#include "ir/graph.h"

namespace onnx {
class ModelProto;
}

namespace pipeshard {

// Opsets of the default ONNX domain that the importer knows.
inline constexpr int64_t kMinOpset = 7;
inline constexpr int64_t kMaxOpset = 20;
// kMaxTensorElements, the largest tensor or sample the importer accepts: ir/graph.h.

struct ImportedModel {
  Graph graph;
  // The file as parsed, with every initializer's external data loaded inline, so
  // stage files can be cut from it. Owned here.
  std::shared_ptr<onnx::ModelProto> source;
  std::string path;  // as given by the caller
};

// Reads and imports `path`. External data files are resolved relative to the model's
// folder; locations outside it (absolute, "..", or a symlink leading out) are refused.
Result<ImportedModel> import_onnx_file(const std::string& path);

// Parses `bytes` (a whole .onnx file, borrowed for the call) as an ONNX ModelProto and
// imports it; what protobuf refuses is refused as "not a valid ONNX file". `base_dir` is
// where external data is looked up; `label` names the model in messages.
Result<ImportedModel> import_onnx_bytes(std::string_view bytes, const std::string& base_dir, const std::string& label);

// Imports an already parsed model. `base_dir` is where external data is looked up.
// `label` names the model in messages.
Result<ImportedModel> import_onnx_model(std::shared_ptr<onnx::ModelProto> model, const std::string& base_dir,
                                        const std::string& label);

}  // namespace pipeshard

#endif  // PIPESHARD_IMPORTER_ONNX_IMPORTER_H_
