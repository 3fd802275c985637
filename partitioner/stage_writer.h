// Stage files: each pipeline stage (and tensor-parallel shard) as a standalone ONNX
// model that runs anywhere ONNX runs.
//
// A stage file holds the stage's own ONNX nodes, as the exporter wrote them, with the
// Constant/Identity nodes and initializers they use and nothing else. Its inputs and
// outputs are the values crossing its cuts, named as in the full model, so running the
// stages one after another (feeding each the values it names) gives the full model's
// outputs. Sharded files (stage_<i>_tp<j>.onnx) hold rank j's slice of each split
// Linear, under the original initializer names, and mark communication with nodes of
// the "pipeshard" domain: AllReduce (sum over `shards` ranks, after a row-parallel
// Linear) and AllGather (concatenate the last dimension over `shards` ranks).
#ifndef PIPESHARD_PARTITIONER_STAGE_WRITER_H_
#define PIPESHARD_PARTITIONER_STAGE_WRITER_H_

#include <string>

#include "common/atomic_file.h"
#include "common/status.h"
#include "importer/onnx_importer.h"
#include "importer/onnx_writer.h"
#include "partitioner/plan.h"

namespace pipeshard {

// Builds the model of `stage` for tensor-parallel rank `tp_rank` (0 when unsharded).
Result<std::shared_ptr<onnx::ModelProto>> build_stage_model(const ImportedModel& model, const Plan& plan, int stage,
                                                            int tp_rank);

// Writes every stage file named in `plan` and plan.json into `dir`, creating it; a stage
// too large for one protobuf message keeps its weights in `<stage file>.data` beside it
// (serialize_model()). All models are built before the first byte is written, and each
// file is written to a temporary name and renamed, so a failure never leaves a
// half-written file.
Status write_partition(const ImportedModel& model, const Plan& plan, const std::string& dir,
                       int64_t inline_limit = kProtobufLimit);

}  // namespace pipeshard

#endif  // PIPESHARD_PARTITIONER_STAGE_WRITER_H_
