// The reference forward pass: a Graph evaluated on the CPU in float32 with plain loops
// (double accumulation in reductions). It is slow and obviously correct; the training
// backends are tested against it, and the partition tests use it to run stage files
// and to simulate tensor-parallel shards.
//
// Semantics are ONNX inference semantics, with two training forms honoured as the file
// states them: BatchNorm with training=true normalises with the batch's statistics
// (population variance), and Dropout is the identity (no random mask here).
#ifndef PIPESHARD_TESTING_REFERENCE_FORWARD_H_
#define PIPESHARD_TESTING_REFERENCE_FORWARD_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "ir/graph.h"

namespace pipeshard {

// A dense float32 tensor in host memory, row-major, dims[0] the batch.
struct HostTensor {
  std::vector<int64_t> dims;
  std::vector<float> data;  // [product(dims)]
};

// Runs one node on its inputs ([node.inputs], in order) and returns its output.
// Communication nodes (kAllReduce, kAllGather) are not computed here: the caller
// combines the shards (see simulate_tensor_parallel in the tests).
HostTensor forward_node(const Graph& graph, const Node& node, const std::vector<const HostTensor*>& inputs);

// Runs the whole graph. `inputs` maps every model input name to a tensor whose dims
// after the batch match the Graph. Returns every value computed, by name (model
// outputs included). Errors: a missing input or a wrong shape.
Result<std::map<std::string, HostTensor>> run_forward(const Graph& graph,
                                                      const std::map<std::string, HostTensor>& inputs);

}  // namespace pipeshard

#endif  // PIPESHARD_TESTING_REFERENCE_FORWARD_H_
