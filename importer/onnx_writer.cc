#include "importer/onnx_writer.h"

#include <algorithm>
#include <filesystem>
#include <unordered_map>

#include <onnx/onnx_pb.h>

#include "common/atomic_file.h"

namespace pipeshard {
namespace {

void set_values(onnx::TensorProto& t, const Parameter& p) {
  t.clear_float_data();
  t.clear_external_data();
  t.set_data_location(onnx::TensorProto::DEFAULT);
  t.set_data_type(onnx::TensorProto::FLOAT);
  t.set_raw_data(std::string(reinterpret_cast<const char*>(p.data.data()), p.data.size() * sizeof(float)));
}

constexpr size_t kExternalMinBytes = 1024, kExternalAlignment = 4096;

}  // namespace

Result<ModelFiles> serialize_model(onnx::ModelProto& model, const std::string& path, int64_t inline_limit) {
  ModelFiles files;
  if (static_cast<int64_t>(model.ByteSizeLong()) > inline_limit) {
    files.data_name = std::filesystem::path(path).filename().string() + ".data";
    for (onnx::TensorProto& t : *model.mutable_graph()->mutable_initializer()) {
      if (t.data_location() == onnx::TensorProto::EXTERNAL || t.raw_data().size() < kExternalMinBytes) continue;
      files.data.resize((files.data.size() + kExternalAlignment - 1) / kExternalAlignment * kExternalAlignment, '\0');
      const size_t offset = files.data.size();
      files.data += t.raw_data();
      t.clear_raw_data();
      t.set_data_location(onnx::TensorProto::EXTERNAL);
      t.clear_external_data();
      const std::pair<const char*, std::string> fields[] = {{"location", files.data_name},
                                                            {"offset", std::to_string(offset)},
                                                            {"length", std::to_string(files.data.size() - offset)}};
      for (const auto& [key, value] : fields) {
        auto* kv = t.add_external_data();
        kv->set_key(key);
        kv->set_value(value);
      }
    }
    if (static_cast<int64_t>(model.ByteSizeLong()) > inline_limit) {
      return Status::error("the model is larger than protobuf's 2 GiB even with its initializers in external data");
    }
  }
  if (!model.SerializeToString(&files.model)) return Status::error("cannot serialise the model");
  return files;
}

Status write_trained_model(const ImportedModel& model, const Graph& trained, const std::string& path,
                           int64_t inline_limit) {
  onnx::ModelProto out = *model.source;
  auto* graph = out.mutable_graph();
  std::unordered_map<std::string, onnx::TensorProto*> initializers;
  for (auto& t : *graph->mutable_initializer()) initializers[t.name()] = &t;
  for (const Parameter& p : trained.params) {
    auto it = initializers.find(p.name);
    if (it != initializers.end()) {
      set_values(*it->second, p);
      continue;
    }
    // A parameter named after an Identity's output: the Identity goes, an initializer
    // of that name takes its place.
    auto& nodes = *graph->mutable_node();
    auto identity = std::find_if(nodes.begin(), nodes.end(), [&](const onnx::NodeProto& n) {
      return n.op_type() == "Identity" && n.output_size() == 1 && n.output(0) == p.name;
    });
    if (identity == nodes.end()) {
      return Status::error("parameter '" + p.name + "' has no initializer or Identity in the source model");
    }
    nodes.erase(identity);
    onnx::TensorProto* t = graph->add_initializer();
    t->set_name(p.name);
    for (int64_t d : p.dims) t->add_dims(d);
    set_values(*t, p);
  }
  Result<ModelFiles> files = serialize_model(out, path, inline_limit);
  if (!files) return files.status().with_context("writing the trained model");
  if (!files->data_name.empty()) {
    const auto data_path = std::filesystem::path(path).parent_path() / files->data_name;
    PIPESHARD_RETURN_IF_ERROR(write_file_atomically(data_path.string(), files->data));
  }
  return write_file_atomically(path, files->model);
}

}  // namespace pipeshard
