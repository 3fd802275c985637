#include "fuzz/fuzz_inputs.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include <onnx/onnx_pb.h>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "comm/comm.h"
#include "common/crc32c.h"
#include "dataset/dataset.h"
#include "dataset/npy.h"
#include "importer/onnx_importer.h"
#include "partitioner/plan.h"
#include "partitioner/stage_writer.h"
#include "runtime/checkpoint_file.h"
#include "runtime/trainer.h"

namespace pipeshard::fuzz {
namespace {

// Plans the imported model as the partition tool would, and reads every stage model back.
void plan_and_cut(const ImportedModel& model, const std::string& base_dir) {
  struct Layout {
    int stages, tensor_parallel;
    BalanceBy balance;
  };
  for (const Layout& layout :
       {Layout{2, 1, BalanceBy::kParams}, Layout{1, 2, BalanceBy::kFlops}, Layout{2, 2, BalanceBy::kMemory}}) {
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

// The length of the checkpoint trainers' runs: a restored run steps on while it is shorter,
// as train's loop does.
constexpr int64_t kCheckpointTotalSteps = 1000;

// The groups a restored trainer is placed in know their place and carry nothing:
// restoring a checkpoint sends nothing, and a call on them means that assumption broke.
constexpr char kGroups[] = "the checkpoint fuzz harness's groups";

// What checkpoint_trainers() holds on to: the model, its data, and each trainer with
// what it needs.
struct CheckpointRig {
  ImportedModel model;
  Dataset data;
  std::unique_ptr<Backend> backend = make_cpu_backend();
  std::unique_ptr<Communicator> world;
  ProcessGroups groups;
  std::vector<std::unique_ptr<Trainer>> owned;
  std::vector<CheckpointTrainer> trainers;
};

// 8 samples of 16 features (a fixed pattern) with class labels 0..7.
Dataset checkpoint_data(const Graph& g) {
  NpyArray features = zeros<float>("features.npy", NpyType::kFloat32, 8, sample_dims(g.values[g.inputs[0]]));
  std::vector<float> x(features.bytes.size() / sizeof(float));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 17) / 8.0f - 1.0f;
  std::memcpy(features.bytes.data(), x.data(), features.bytes.size());
  NpyArray labels = zeros<int64_t>("labels.npy", NpyType::kInt64, 8, {});
  for (int64_t i = 0; i < 8; ++i) std::memcpy(labels.bytes.data() + i * sizeof(int64_t), &i, sizeof i);
  Result<Dataset> d = make_dataset(features, labels, g, Targets::kClassIndices);
  PIPESHARD_CHECK(d.is_ok(), d.status().message());
  return std::move(*d);
}

std::unique_ptr<CheckpointRig> make_checkpoint_rig() {
  auto rig = std::make_unique<CheckpointRig>();
  Result<ImportedModel> model = import_onnx_file(PIPESHARD_SOURCE_DIR "/models/batchnorm_train.onnx");
  PIPESHARD_CHECK(model.is_ok(), model.status().message());
  rig->model = std::move(*model);
  rig->data = checkpoint_data(rig->model.graph);
  TrainConfig config;
  config.batch_size = 4;
  config.total_steps = kCheckpointTotalSteps;
  auto add = [&](const std::string& name, OptimizerKind kind, float momentum, const Parallel& parallel) {
    TrainConfig c = config;
    c.optimizer.kind = kind;
    c.optimizer.momentum = momentum;
    Result<std::unique_ptr<Trainer>> t = Trainer::create(rig->model.graph, rig->data, *rig->backend, c, parallel);
    PIPESHARD_CHECK(t.is_ok(), name + ": " + t.status().message());
    rig->trainers.push_back({name, t->get(), parallel.groups == nullptr});
    rig->owned.push_back(std::move(*t));
  };
  add("sgd", OptimizerKind::kSgd, 0.0f, {});
  add("sgd_momentum", OptimizerKind::kSgd, 0.9f, {});
  add("adam", OptimizerKind::kAdam, 0.0f, {});
  ProcessLayout& layout = rig->groups.layout;
  layout = {.stages = 2, .replicas = 1, .shards = 2, .stage = 1, .replica = 0, .shard = 1};
  rig->world = make_placeholder_communicator(layout.rank_of(1, 0, 1), layout.world_size(), kGroups);
  rig->groups.data = make_placeholder_communicator(0, 1, kGroups);
  rig->groups.tensor = make_placeholder_communicator(1, 2, kGroups);
  rig->groups.pipeline = make_placeholder_communicator(1, 2, kGroups);
  add("adam_stage1_shard1", OptimizerKind::kAdam, 0.0f, {rig->world.get(), &rig->groups, &rig->model});
  return rig;
}

template <typename T>
T read_raw(std::string_view bytes, size_t at) {
  T value;
  std::memcpy(&value, bytes.data() + at, sizeof value);
  return value;
}

template <typename T>
void write_raw(std::string& bytes, size_t at, T value) {
  std::memcpy(bytes.data() + at, &value, sizeof value);
}

// Sets each tensor's "crc32c" in `header` to that of the data it lists, walking the data
// as decode_checkpoint does from `at`. True when one changed.
bool repair_tensor_checksums(nlohmann::json& header, std::string_view file, size_t at) {
  if (!header.is_object() || !header.contains("tensors") || !header["tensors"].is_array()) return false;
  bool changed = false;
  for (nlohmann::json& t : header["tensors"]) {
    if (!t.is_object() || !t.contains("elements") || !t["elements"].is_number_unsigned()) return changed;
    const uint64_t elements = t["elements"].get<uint64_t>();
    if (elements > (file.size() - at) / sizeof(float)) return changed;
    const uint32_t crc = crc32c(file.substr(at, static_cast<size_t>(elements) * sizeof(float)));
    at += static_cast<size_t>(elements) * sizeof(float);
    if (t.contains("crc32c") && t["crc32c"].is_number_unsigned() && t["crc32c"].get<uint64_t>() != crc) {
      t["crc32c"] = crc;
      changed = true;
    }
  }
  return changed;
}

}  // namespace

std::string with_checksums_repaired(std::string_view file) {
  constexpr size_t kPrefix = 16, kCrc = 4;  // magic and length; the header's CRC-32C
  std::string out(file);
  if (file.size() < kPrefix || file.substr(0, 8) != "PSCKPT02") return out;
  uint64_t length = read_raw<uint64_t>(file, 8);
  const size_t after_prefix = file.size() - kPrefix;
  if (length > after_prefix || after_prefix - length < kCrc) return out;  // no room for the header's CRC
  const size_t data_begin = kPrefix + length + kCrc;
  nlohmann::json header = nlohmann::json::parse(file.substr(kPrefix, length), nullptr, false);
  if (!header.is_discarded() && repair_tensor_checksums(header, file, data_begin)) {
    const std::string head = header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    length = head.size();
    out = std::string(file.substr(0, kPrefix)) + head + std::string(kCrc, '\0') + std::string(file.substr(data_begin));
    write_raw<uint64_t>(out, 8, length);
  }
  write_raw<uint32_t>(out, kPrefix + length, crc32c(std::string_view(out).substr(0, kPrefix + length)));
  return out;
}

const std::vector<CheckpointTrainer>& checkpoint_trainers() {
  static const std::unique_ptr<CheckpointRig> rig = make_checkpoint_rig();
  return rig->trainers;
}

Status run_checkpoint_input(std::string_view bytes) {
  const std::string label = "fuzz.pipeshard";
  const bool repair = !bytes.empty() && (static_cast<unsigned char>(bytes[0]) & 1) != 0;
  if (!bytes.empty()) bytes.remove_prefix(1);
  const std::string repaired = repair ? with_checksums_repaired(bytes) : std::string();
  if (repair) bytes = repaired;
  Result<Checkpoint> decoded = decode_checkpoint(bytes);
  if (!decoded) return decoded.status().with_context(label);
  Status last = Status::ok();
  bool taken = false;
  for (const CheckpointTrainer& t : checkpoint_trainers()) {
    last = t.trainer->load_checkpoint_bytes(bytes, label);
    if (!last.is_ok()) continue;
    taken = true;
    if (t.whole && t.trainer->steps_done() < kCheckpointTotalSteps) (void)t.trainer->step();
  }
  return taken ? Status::ok() : last;
}

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
      (void)make_dataset(*array, labels, g, targets_of(loss));
      const NpyArray features = zeros<float>("features.npy", NpyType::kFloat32, rows, sample_dims(in));
      (void)make_dataset(features, *array, g, targets_of(loss));
    }
  }
  return Status::ok();
}

}  // namespace pipeshard::fuzz
