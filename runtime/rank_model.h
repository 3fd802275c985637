// RankModel: the part of a model that one rank of a P × D × T job trains.
//
// With one stage and one shard that is the whole Graph. Otherwise it is the Graph of
// the rank's stage file — exactly what `partition` writes (partitioner/stage_writer.h):
// the stage's own nodes, its slice of every split Linear under the original initializer
// names, AllReduce/AllGather nodes — imported back, plus what the runtime needs to
// stitch the ranks together:
// - the values crossing the cut before and after the stage (residuals included), in one
//   order both neighbours agree on, with their shapes checked against the Plan;
// - which stage inputs need a gradient (a trainable parameter is upstream of them in
//   the whole model), so the stage sends one back;
// - for every local parameter, the whole-model parameter it is (a slice of), so that
//   checkpoints and saved models are stored whole, by initializer name, and a run can
//   resume under any other layout.
//
// Where the schedule places several model chunks on each stage (interleaved, V), the plan
// cuts the model into stages × v chunks and the rank's Graph is the union of its chunks'
// files, in model order: each chunk's nodes contiguous (node_chunk() says whose), its
// values its own (a value two chunks of the rank share, as a residual or the turn of a V,
// is the output of one and an input of the other, under the same name), the chunk that
// computes the loss first among the outputs. The links are per chunk.
#ifndef PIPESHARD_RUNTIME_RANK_MODEL_H_
#define PIPESHARD_RUNTIME_RANK_MODEL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "common/status.h"
#include "importer/onnx_importer.h"
#include "ir/graph.h"
#include "partitioner/plan.h"

namespace pipeshard {

// A value that crosses a pipeline cut.
struct LinkValue {
  std::string name;         // the value's name in the whole model
  int64_t per_sample = 0;   // float32 elements per sample
  bool needs_grad = false;  // its gradient travels back over the cut
  int local = -1;           // value id in the rank's Graph; -1 when the stage only carries it
};

class RankModel {
 public:
  // The part of `model` that rank `layout` trains. `options` gives the balance and the
  // memory-estimate assumptions of the Plan (stages and shards come from `layout`).
  static Result<RankModel> create(const ImportedModel& model, const ProcessLayout& layout, PartitionOptions options);
  // The whole model, for one stage and one shard (no stage file is cut).
  static RankModel whole(const Graph& graph, const ProcessLayout& layout = {});

  const Graph& graph() const { return whole_ ? *full_ : local_; }
  const Graph& full() const { return *full_; }
  bool is_whole() const { return whole_; }
  const ProcessLayout& layout() const { return layout_; }

  // The model chunks this rank holds, ascending (one: its stage), and for each node of
  // graph() its index j among them (empty with one chunk: all 0).
  int chunks() const { return static_cast<int>(model_chunks_.size()); }
  int model_chunk(int j) const { return model_chunks_[j]; }
  const std::vector<int>& node_chunk() const { return node_chunk_; }
  // Values chunk j receives from the model chunk before it and sends to the one after it,
  // in value-id order of the whole model (empty for the model's first and last chunk).
  const std::vector<LinkValue>& incoming(int j = 0) const { return incoming_[j]; }
  const std::vector<LinkValue>& outgoing(int j = 0) const { return outgoing_[j]; }
  // [graph inputs] whether backward must produce the input's gradient.
  const std::vector<bool>& input_needs_grad() const { return input_needs_grad_; }
  // [graph nodes] the node's index in the whole model (keys dropout masks).
  const std::vector<uint64_t>& model_node_ids() const { return model_node_ids_; }

  // [graph params] the whole-model parameter each local one is, and the axis along which
  // it is split over the shards (-1: held whole).
  int full_param(int local) const { return full_param_[local]; }
  int shard_axis(int local) const { return shard_axis_[local]; }
  // Whole-model parameters held by each pipeline stage (all its chunks), ascending.
  const std::vector<int>& stage_params(int stage) const { return stage_params_[stage]; }

  // This rank's slice of whole-model tensor data for local parameter `local`.
  std::vector<float> slice(int local, const std::vector<float>& whole) const;

  // Collective over `world` (every rank calls it): assembles whole-model tensors on
  // world rank 0 from every rank's local ones. local[q] is local parameter q's data
  // (ignored, and may be empty, for frozen ones when `trainable_only`: optimizer
  // state); on rank 0, whole[p] receives whole-model parameter p when some stage holds
  // it (elsewhere and for parameters no node uses: empty). Shards are joined inside
  // each tensor group, then stage s's first replica and shard sends it to rank 0.
  void gather(const std::vector<std::vector<float>>& local, std::vector<std::vector<float>>& whole, Communicator& world,
              Communicator* tensor, bool trainable_only) const;

 private:
  struct Cut;
  Status place_parameters(const Cut& cut);
  // Appends model chunk c's Graph `part` (its stage file, imported) to the rank's.
  Status add_chunk(const Cut& cut, int c, const Graph& part, const std::string& label);
  Status map_parameters(const Cut& cut, const Graph& part, const std::string& label);
  void name_nodes_and_inputs(const Cut& cut, const Graph& part);
  Result<std::vector<LinkValue>> link(const Cut& cut, int c, const Graph& part, const std::string& label) const;

  const Graph* full_ = nullptr;
  bool whole_ = true;
  ProcessLayout layout_;
  Graph local_;
  std::vector<int> model_chunks_ = {0}, node_chunk_;
  std::vector<std::vector<LinkValue>> incoming_ = {{}}, outgoing_ = {{}};  // [chunks]
  std::vector<bool> input_needs_grad_;
  std::vector<uint64_t> model_node_ids_;
  std::vector<int> full_param_, shard_axis_;
  std::vector<std::vector<int>> stage_params_;
};

}  // namespace pipeshard

#endif  // PIPESHARD_RUNTIME_RANK_MODEL_H_
