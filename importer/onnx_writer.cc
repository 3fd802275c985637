#include "importer/onnx_writer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
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
constexpr uintmax_t kLargestModelWithExternalData = uintmax_t{64} << 20;

// The external-data files beside it that the ONNX model at `path` names: none when
// there is no such file, or it is too large to be one that keeps its weights apart, or
// does not parse.
std::set<std::string> external_data_names(const std::filesystem::path& path) {
  std::error_code ec;
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec || size > kLargestModelWithExternalData) return {};
  std::ifstream in(path, std::ios::binary);
  onnx::ModelProto m;
  if (!in || !m.ParseFromIstream(&in)) return {};
  std::set<std::string> names;
  for (const onnx::TensorProto& t : m.graph().initializer()) {
    for (const auto& kv : t.external_data()) {
      if (kv.key() == "location" && kv.value().find('/') == std::string::npos) names.insert(kv.value());
    }
  }
  return names;
}

// `model` with its graph's initializers left out: no copy of the weights.
onnx::ModelProto without_initializers(onnx::ModelProto& model) {
  google::protobuf::RepeatedPtrField<onnx::TensorProto> initializers;
  initializers.Swap(model.mutable_graph()->mutable_initializer());
  onnx::ModelProto copy = model;
  initializers.Swap(model.mutable_graph()->mutable_initializer());
  return copy;
}

}  // namespace

Result<ModelFiles> serialize_model(onnx::ModelProto& model, const std::string& path, int64_t inline_limit) {
  ModelFiles files;
  files.stale = external_data_names(path);
  if (static_cast<int64_t>(model.ByteSizeLong()) > inline_limit) {
    // Never the name the file being replaced uses: until the new model is in place, its
    // data must stay as it was.
    const std::string name = std::filesystem::path(path).filename().string();
    files.data_name = files.stale.count(name + ".data") ? name + ".1.data" : name + ".data";
    size_t size = 0;
    for (onnx::TensorProto& t : *model.mutable_graph()->mutable_initializer()) {
      if (t.data_location() == onnx::TensorProto::EXTERNAL || t.raw_data().size() < kExternalMinBytes) continue;
      const size_t offset = (size + kExternalAlignment - 1) / kExternalAlignment * kExternalAlignment;
      if (offset > size) files.data.emplace_back(offset - size, '\0');
      files.data.emplace_back();
      files.data.back().swap(*t.mutable_raw_data());  // moved, not copied
      size = offset + files.data.back().size();
      t.clear_raw_data();
      t.set_data_location(onnx::TensorProto::EXTERNAL);
      t.clear_external_data();
      const std::pair<const char*, std::string> fields[] = {
          {"location", files.data_name}, {"offset", std::to_string(offset)}, {"length", std::to_string(size - offset)}};
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
  files.stale.erase(files.data_name);
  if (!model.SerializeToString(&files.model)) return Status::error("cannot serialise the model");
  return files;
}

void remove_stale_data(const std::string& path, const ModelFiles& files) {
  std::error_code ec;
  for (const std::string& name : files.stale)
    std::filesystem::remove(std::filesystem::path(path).parent_path() / name, ec);
}

Status write_trained_model(const ImportedModel& model, const Graph& trained, const std::string& path,
                           int64_t inline_limit) {
  // The source without its weights, then its initializers one by one: a parameter's
  // with the trained values, any other as it was. The old weights are never copied.
  onnx::ModelProto out = without_initializers(*model.source);
  auto* graph = out.mutable_graph();
  std::unordered_map<std::string, const Parameter*> params;
  for (const Parameter& p : trained.params) params[p.name] = &p;
  for (const onnx::TensorProto& t : model.source->graph().initializer()) {
    onnx::TensorProto* copy = graph->add_initializer();
    auto it = params.find(t.name());
    if (it == params.end()) {
      *copy = t;
      continue;
    }
    copy->set_name(t.name());
    *copy->mutable_dims() = t.dims();
    copy->set_doc_string(t.doc_string());
    set_values(*copy, *it->second);
    params.erase(it);
  }
  for (const Parameter& p : trained.params) {
    if (!params.count(p.name)) continue;  // written above
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
  PIPESHARD_RETURN_IF_ERROR(write_file_atomically(path, files->model));
  remove_stale_data(path, *files);
  return Status::ok();
}

}  // namespace pipeshard
