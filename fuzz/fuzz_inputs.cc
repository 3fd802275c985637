#include "fuzz/fuzz_inputs.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <onnx/onnx_pb.h>

#include "executor/dataset.h"
#include "executor/npy.h"
#include "importer/onnx_importer.h"
#include "partitioner/plan.h"
#include "partitioner/stage_writer.h"

namespace pipeshard::fuzz {
namespace {

// Plans the imported model as the partition tool would, and reads every stage model back.
void plan_and_cut(const ImportedModel& model, const std::string& base_dir) {
  struct Layout {
    int stages, tensor_parallel;
    BalanceBy balance;
  };
  for (const Layout& layout : {Layout{2, 1, BalanceBy::kParams}, Layout{1, 2, BalanceBy::kFlops},
                               Layout{2, 2, BalanceBy::kMemory}}) {
    PartitionOptions options;
    options.stages = layout.stages;
    options.tensor_parallel = layout.tensor_parallel;
    options.balance = layout.balance;
    Result<Plan> plan = make_plan(model.graph, "fuzz.onnx", options);
    if (!plan) continue;
    (void)plan_json_text(*plan, model.graph);
    for (const StagePlan& stage : plan->stages) {
      for (int rank = 0; rank < layout.tensor_parallel; ++rank) {
        Result<std::shared_ptr<onnx::ModelProto>> cut = build_stage_model(model, *plan, stage.stage, rank);
        if (!cut) continue;
        (void)import_onnx_model(*cut, base_dir, "fuzz stage");
      }
    }
  }
}

// A model that load_dataset can check data against: one input, one output, no nodes
// (the checks read only their shapes).
Graph model_with_shapes(std::vector<int64_t> input_dims, std::vector<int64_t> output_dims) {
  Graph g;
  input_dims.insert(input_dims.begin(), kBatch);
  output_dims.insert(output_dims.begin(), kBatch);
  g.values.push_back(Value{"x", Shape{input_dims}, -1, {}});
  g.values.push_back(Value{"y", Shape{output_dims}, -1, {}});
  g.inputs = {0};
  g.outputs = {1};
  return g;
}

// A zero-filled array of `rows` samples of `sample_dims`.
template <typename T>
NpyArray zeros(const std::string& path, NpyType type, int64_t rows, const std::vector<int64_t>& sample_dims) {
  NpyArray a;
  a.path = path;
  a.type = type;
  a.shape = {rows};
  a.shape.insert(a.shape.end(), sample_dims.begin(), sample_dims.end());
  a.bytes.assign(static_cast<size_t>(a.elements()) * sizeof(T), 0);
  return a;
}

std::vector<int64_t> sample_dims(const Value& v) { return {v.shape.dims.begin() + 1, v.shape.dims.end()}; }

}  // namespace

Status run_onnx_input(std::string_view bytes, const std::string& base_dir) {
  Result<ImportedModel> model = import_onnx_bytes(bytes, base_dir, "fuzz.onnx");
  if (!model) return model.status();
  plan_and_cut(*model, base_dir);
  return Status::ok();
}

Status run_npy_input(std::string_view bytes) {
  Result<NpyArray> array = parse_npy(bytes, "fuzz.npy");
  if (!array) return array.status();
  if (array->type == NpyType::kFloat32) {
    (void)array->as_float();
  } else {
    (void)array->as_int64();
  }
  static const Graph models[] = {model_with_shapes({4}, {3}), model_with_shapes({2, 2}, {2, 2})};
  // The other side gets as many rows as this array, within reason: a header may claim
  // 2^40 rows of zero-sized samples, and this harness must not be what runs out of memory.
  const int64_t rows = std::min<int64_t>(array->shape.empty() ? 1 : array->shape[0], 4096);
  for (const Graph& g : models) {
    const Value& in = g.values[g.inputs[0]];
    const Value& out = g.values[g.outputs[0]];
    for (LossKind loss : {LossKind::kCrossEntropy, LossKind::kMse}) {
      const NpyArray labels = loss == LossKind::kCrossEntropy
                                  ? zeros<int64_t>("labels.npy", NpyType::kInt64, rows, {})
                                  : zeros<float>("labels.npy", NpyType::kFloat32, rows, sample_dims(out));
      (void)make_dataset(*array, labels, g, loss);
      const NpyArray features = zeros<float>("features.npy", NpyType::kFloat32, rows, sample_dims(in));
      (void)make_dataset(features, *array, g, loss);
    }
  }
  return Status::ok();
}

}  // namespace pipeshard::fuzz
