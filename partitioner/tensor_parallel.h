// Megatron-style tensor parallelism inside one pipeline stage.
//
// Consecutive Linear layers are paired: the first is split by output features
// (column-parallel), the elementwise nodes between them (activations, dropout) run on
// the shards locally, and the second is split by input features (row-parallel), with
// one all-reduce after it — one in forward after the pair, one in backward before it.
// A norm needs whole feature vectors, so it ends a chain and runs replicated. A Linear
// without a partner is split by output features and gathered when it has at least
// PartitionOptions::min_shard_parameters parameters, and replicated otherwise. A Linear
// whose weight another node uses too (tied weights) is never split.
#ifndef PIPESHARD_PARTITIONER_TENSOR_PARALLEL_H_
#define PIPESHARD_PARTITIONER_TENSOR_PARALLEL_H_

#include "common/status.h"
#include "ir/graph.h"
#include "partitioner/plan.h"

namespace pipeshard {

// Fills stage.roles ([stage.nodes]). Errors name the layer whose width does not divide
// by options.tensor_parallel.
Status assign_shard_roles(const Graph& graph, const PartitionOptions& options, StagePlan& stage);

// Parameter elements one tensor-parallel rank holds for `stage` (sharded weights split,
// the rest whole).
int64_t sharded_parameter_elements(const Graph& graph, int tensor_parallel, const StagePlan& stage);

}  // namespace pipeshard

#endif  // PIPESHARD_PARTITIONER_TENSOR_PARALLEL_H_
