// Helpers for the malformed-input suites: editing ONNX models from models/, running the
// partition tool on the result, and checking the contract for bad input (exit status 2,
// one "partition: error: " line on stderr naming what is wrong, nothing on stdout, no
// output folder).
#ifndef PIPESHARD_TESTS_TOOLS_MALFORMED_UTIL_H_
#define PIPESHARD_TESTS_TOOLS_MALFORMED_UTIL_H_

#include <gtest/gtest.h>
#include <onnx/onnx_pb.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tests/test_util.h"

namespace pipeshard::testing {

// simple.onnx: Gemm /0/Gemm [256,100] -> Relu /1/Relu -> Gemm /2/Gemm [128,256] ->
// Relu /3/Relu -> Gemm /4/Gemm [10,128], input "input" [batch,100], output "output" [batch,10].
inline constexpr const char* kSimple = "models/simple.onnx";

// A run of partition that hangs is killed and shows up as exit status 124.
inline constexpr int kTimeoutSeconds = 30;

// ---- Building models ------------------------------------------------------------------------

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

inline onnx::ModelProto load_model(const std::string& rel) {
  onnx::ModelProto m;
  const std::string bytes = read_text(source_path(rel));
  EXPECT_TRUE(!bytes.empty() && m.ParseFromString(bytes)) << "cannot read " << rel;
  return m;
}

inline onnx::NodeProto& node_named(onnx::ModelProto& m, const std::string& name) {
  for (auto& n : *m.mutable_graph()->mutable_node()) {
    if (n.name() == name) return n;
  }
  ADD_FAILURE() << "no node named " << name;
  return *m.mutable_graph()->add_node();
}

inline onnx::TensorProto& initializer_named(onnx::ModelProto& m, const std::string& name) {
  for (auto& t : *m.mutable_graph()->mutable_initializer()) {
    if (t.name() == name) return t;
  }
  ADD_FAILURE() << "no initializer named " << name;
  return *m.mutable_graph()->add_initializer();
}

inline void remove_initializer(onnx::ModelProto& m, const std::string& name) {
  auto* inits = m.mutable_graph()->mutable_initializer();
  for (int i = 0; i < inits->size(); ++i) {
    if (inits->Get(i).name() == name) {
      inits->DeleteSubrange(i, 1);
      return;
    }
  }
  ADD_FAILURE() << "no initializer named " << name;
}

// Replaces `t`'s contents by float32 data of `dims`, every element 0.01.
inline void set_float_tensor(onnx::TensorProto& t, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  t.clear_dims();
  for (int64_t d : dims) {
    t.add_dims(d);
    n *= d;
  }
  t.set_data_type(onnx::TensorProto::FLOAT);
  const std::vector<float> data(static_cast<size_t>(n), 0.01f);
  t.set_raw_data(std::string(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(float)));
}

// Sets element `index` (flat, row-major) of a float32 raw_data tensor to `value`.
inline void set_float_element(onnx::TensorProto& t, size_t index, float value) {
  ASSERT_EQ(t.data_type(), onnx::TensorProto::FLOAT) << t.name();
  ASSERT_LT(index * sizeof(float), t.raw_data().size()) << t.name() << " holds no element " << index;
  std::memcpy(t.mutable_raw_data()->data() + index * sizeof(float), &value, sizeof(float));
}

// Re-encodes a float32 raw_data tensor as float64.
inline void convert_to_double(onnx::TensorProto& t) {
  const std::string& raw = t.raw_data();
  std::vector<double> data(raw.size() / sizeof(float));
  for (size_t i = 0; i < data.size(); ++i) {
    float f;
    std::memcpy(&f, raw.data() + i * sizeof(float), sizeof(float));
    data[i] = f;
  }
  t.set_data_type(onnx::TensorProto::DOUBLE);
  t.set_raw_data(std::string(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(double)));
}

// Sets the float32 value of Constant node `name` (a one-element tensor).
inline void set_constant_scalar(onnx::ModelProto& m, const std::string& name, float value) {
  onnx::NodeProto& n = node_named(m, name);
  ASSERT_EQ(n.op_type(), "Constant");
  for (auto& a : *n.mutable_attribute()) {
    if (a.name() == "value") {
      a.mutable_t()->clear_float_data();
      a.mutable_t()->set_raw_data(std::string(reinterpret_cast<const char*>(&value), sizeof(float)));
      return;
    }
  }
  ADD_FAILURE() << name << " has no value attribute";
}

// What torch.onnx.export (opset 14) writes for a Conv1d model on input [batch, 16]:
//   x.unsqueeze(1) -> nn.Conv1d(1, 4, 3) -> flatten(1) -> nn.Linear(56, 10)
// as the nodes /Constant, /Unsqueeze, /conv/Conv, /Flatten, /fc/Gemm (weights 0.01).
inline onnx::ModelProto conv1d_model() {
  onnx::ModelProto m;
  m.set_ir_version(8);
  m.set_producer_name("pytorch");
  m.add_opset_import()->set_version(14);
  onnx::GraphProto& g = *m.mutable_graph();
  g.set_name("main_graph");
  const auto value = [](onnx::ValueInfoProto* vi, const std::string& name, int64_t width) {
    vi->set_name(name);
    auto* tt = vi->mutable_type()->mutable_tensor_type();
    tt->set_elem_type(onnx::TensorProto::FLOAT);
    tt->mutable_shape()->add_dim()->set_dim_param("batch");
    tt->mutable_shape()->add_dim()->set_dim_value(width);
  };
  value(g.add_input(), "input", 16);
  value(g.add_output(), "output", 10);
  const auto node = [&g](const std::string& op, const std::string& name, const std::vector<std::string>& inputs,
                         const std::string& output) {
    onnx::NodeProto* n = g.add_node();
    n->set_op_type(op);
    n->set_name(name);
    for (const std::string& i : inputs) n->add_input(i);
    n->add_output(output);
    return n;
  };
  const auto ints = [](onnx::NodeProto* n, const std::string& name, const std::vector<int64_t>& values) {
    onnx::AttributeProto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::INTS);
    for (int64_t v : values) a->add_ints(v);
  };
  onnx::NodeProto* axes = node("Constant", "/Constant", {}, "/Constant_output_0");
  onnx::AttributeProto* a = axes->add_attribute();
  a->set_name("value");
  a->set_type(onnx::AttributeProto::TENSOR);
  a->mutable_t()->set_data_type(onnx::TensorProto::INT64);
  a->mutable_t()->add_dims(1);
  a->mutable_t()->add_int64_data(1);
  node("Unsqueeze", "/Unsqueeze", {"input", "/Constant_output_0"}, "/Unsqueeze_output_0");
  onnx::NodeProto* conv =
      node("Conv", "/conv/Conv", {"/Unsqueeze_output_0", "conv.weight", "conv.bias"}, "/conv/Conv_output_0");
  ints(conv, "dilations", {1});
  ints(conv, "kernel_shape", {3});
  ints(conv, "pads", {0, 0});
  ints(conv, "strides", {1});
  node("Flatten", "/Flatten", {"/conv/Conv_output_0"}, "/Flatten_output_0");
  onnx::NodeProto* fc = node("Gemm", "/fc/Gemm", {"/Flatten_output_0", "fc.weight", "fc.bias"}, "output");
  onnx::AttributeProto* trans_b = fc->add_attribute();
  trans_b->set_name("transB");
  trans_b->set_type(onnx::AttributeProto::INT);
  trans_b->set_i(1);
  for (const auto& [name, dims] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"conv.weight", {4, 1, 3}}, {"conv.bias", {4}}, {"fc.weight", {10, 56}}, {"fc.bias", {10}}}) {
    onnx::TensorProto* t = g.add_initializer();
    t->set_name(name);
    set_float_tensor(*t, dims);
  }
  return m;
}

inline onnx::TensorShapeProto* graph_output_shape(onnx::ModelProto& m) {
  return m.mutable_graph()->mutable_output(0)->mutable_type()->mutable_tensor_type()->mutable_shape();
}

inline onnx::TensorShapeProto* graph_input_shape(onnx::ModelProto& m) {
  return m.mutable_graph()->mutable_input(0)->mutable_type()->mutable_tensor_type()->mutable_shape();
}

// ---- Running partition and checking the refusal ---------------------------------------------

inline CommandResult run_partition(const std::string& model, const std::string& out_dir,
                                   const std::string& args = "--stages 2") {
  std::string command = "timeout " + std::to_string(kTimeoutSeconds) + " " + quote(tool_path("partition"));
  // Appends, not `" " + quote(...)`: GCC 12 warns falsely (-Wrestrict, bug 105329) on the latter.
  if (!model.empty()) command.append(" ").append(quote(model));
  if (!args.empty()) command.append(" ").append(args);
  if (!out_dir.empty()) command.append(" --out ").append(quote(out_dir));
  return run_command(command);
}

inline std::string describe(const CommandResult& r) {
  return "exit status " + std::to_string(r.exit_code) + ", stderr [" + r.err + "], stdout [" + r.out.substr(0, 400) +
         "]";
}

// The whole contract for bad input. `out_dir` must not exist afterwards (pass "" when the
// case checks its output folder itself); every fragment must appear in the message.
inline ::testing::AssertionResult refused(const CommandResult& r, const std::string& out_dir,
                                          const std::vector<std::string>& fragments) {
  const std::string prefix = "partition: error: ";
  if (r.exit_code != 2) return ::testing::AssertionFailure() << "want exit status 2; got " << describe(r);
  if (r.err.empty() || r.err.back() != '\n' || r.err.find('\n') != r.err.size() - 1) {
    return ::testing::AssertionFailure() << "want exactly one line on stderr; got " << describe(r);
  }
  if (r.err.rfind(prefix, 0) != 0) {
    return ::testing::AssertionFailure() << "want stderr to start with '" << prefix << "'; got " << describe(r);
  }
  for (const auto& f : fragments) {
    if (r.err.find(f) == std::string::npos) {
      return ::testing::AssertionFailure() << "want '" << f << "' in the message; got " << describe(r);
    }
  }
  if (!r.out.empty()) return ::testing::AssertionFailure() << "want empty stdout; got " << describe(r);
  if (!out_dir.empty() && std::filesystem::exists(out_dir)) {
    return ::testing::AssertionFailure() << "want no output folder, but " << out_dir << " was created; " << describe(r);
  }
  return ::testing::AssertionSuccess();
}

// For input the tool may accept: exit status 0 with nothing on stderr, or a refusal.
inline ::testing::AssertionResult succeeded_or_refused(const CommandResult& r, const std::string& out_dir) {
  if (r.exit_code == 0 && r.err.empty()) return ::testing::AssertionSuccess();
  return refused(r, out_dir, {});
}

// A scratch folder with model.onnx (whatever the case writes) and out/ (must not appear).
class Malformed : public ::testing::Test {
 protected:
  std::string model_path() const { return dir_ / "model.onnx"; }
  std::string out_dir() const { return dir_ / "out"; }

  CommandResult partition_bytes(const std::string& bytes, const std::string& args = "--stages 2") {
    write_bytes(model_path(), bytes);
    return run_partition(model_path(), out_dir(), args);
  }
  CommandResult partition_model(const onnx::ModelProto& m, const std::string& args = "--stages 2") {
    return partition_bytes(m.SerializeAsString(), args);
  }
  // Loads `rel`, lets `edit` break it, and runs partition on the result.
  CommandResult partition_edited(const std::string& rel, const std::function<void(onnx::ModelProto&)>& edit) {
    onnx::ModelProto m = load_model(rel);
    edit(m);
    return partition_model(m);
  }

  ScratchDir dir_{"malformed"};
};

}  // namespace pipeshard::testing

#endif  // PIPESHARD_TESTS_TOOLS_MALFORMED_UTIL_H_
