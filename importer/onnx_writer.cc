#include "importer/onnx_writer.h"

#include <algorithm>
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

}  // namespace

Status write_trained_model(const ImportedModel& model, const Graph& trained, const std::string& path) {
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
  std::string bytes;
  if (!out.SerializeToString(&bytes)) return Status::error("cannot serialise the trained model");
  return write_file_atomically(path, bytes);
}

}  // namespace pipeshard
