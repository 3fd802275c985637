// Builds small ONNX MLPs in memory for tests that need shapes no exported model has
// (a residual jumping over several stages, 2000 layers). Weights are deterministic
// pseudo-random values.
#ifndef PIPESHARD_TESTS_MODEL_BUILDER_H_
#define PIPESHARD_TESTS_MODEL_BUILDER_H_

#include <cstdint>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <onnx/onnx_pb.h>

namespace pipeshard::testing {

class ModelBuilder {
 public:
  // A model with input "input" of shape [batch, in_features].
  explicit ModelBuilder(int64_t in_features, int64_t opset = 14) : rng_(1234) {
    model_.set_ir_version(7);
    model_.set_producer_name("pipeshard-tests");
    auto* imp = model_.add_opset_import();
    imp->set_version(opset);
    graph()->set_name("built");
    add_value_info(graph()->add_input(), "input", in_features);
  }

  // Gemm(x, W [out,in], b [out]) with transB=1, as torch exports nn.Linear.
  std::string linear(const std::string& x, int64_t in, int64_t out) {
    const std::string name = "fc" + std::to_string(layers_++);
    add_initializer(name + ".weight", {out, in});
    add_initializer(name + ".bias", {out});
    auto* n = add_node("Gemm", name, {x, name + ".weight", name + ".bias"});
    auto* a = n->add_attribute();
    a->set_name("transB");
    a->set_type(onnx::AttributeProto::INT);
    a->set_i(1);
    return n->output(0);
  }
  std::string relu(const std::string& x) { return add_node("Relu", "relu" + std::to_string(nodes_), {x})->output(0); }
  // An operator of one input and no attributes: "Sigmoid", "Tanh", ...
  std::string unary(const std::string& op, const std::string& x) {
    return add_node(op, op + std::to_string(nodes_), {x})->output(0);
  }
  std::string add(const std::string& a, const std::string& b) {
    return add_node("Add", "add" + std::to_string(nodes_), {a, b})->output(0);
  }
  void output(const std::string& value, int64_t width) {
    // Graph outputs are named after the value that is the output.
    add_value_info(graph()->add_output(), value, width);
  }
  onnx::ModelProto& model() { return model_; }

  void save(const std::string& path) {
    std::ofstream out(path, std::ios::binary);
    model_.SerializeToOstream(&out);
  }

 private:
  onnx::GraphProto* graph() { return model_.mutable_graph(); }

  onnx::NodeProto* add_node(const std::string& op, const std::string& name, const std::vector<std::string>& in) {
    auto* n = graph()->add_node();
    n->set_op_type(op);
    n->set_name(name);
    for (const auto& i : in) n->add_input(i);
    n->add_output(name + "_out");
    ++nodes_;
    return n;
  }

  void add_initializer(const std::string& name, const std::vector<int64_t>& dims) {
    auto* t = graph()->add_initializer();
    t->set_name(name);
    t->set_data_type(onnx::TensorProto::FLOAT);
    int64_t n = 1;
    for (int64_t d : dims) {
      t->add_dims(d);
      n *= d;
    }
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    for (int64_t i = 0; i < n; ++i) t->add_float_data(u(rng_));
  }

  static void add_value_info(onnx::ValueInfoProto* vi, const std::string& name, int64_t width) {
    vi->set_name(name);
    auto* tt = vi->mutable_type()->mutable_tensor_type();
    tt->set_elem_type(onnx::TensorProto::FLOAT);
    tt->mutable_shape()->add_dim()->set_dim_param("batch");
    tt->mutable_shape()->add_dim()->set_dim_value(width);
  }

  onnx::ModelProto model_;
  std::mt19937 rng_;
  int layers_ = 0;
  int nodes_ = 0;
};

}  // namespace pipeshard::testing

#endif  // PIPESHARD_TESTS_MODEL_BUILDER_H_
