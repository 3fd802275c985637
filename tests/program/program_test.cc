// The Program on whole models: forward equals the reference evaluator for every model
// in models/, and the gradient of a real loss with respect to the parameters equals
// finite differences — which exercises the wiring the per-op checks can't: fan-out
// (residual, tied weights), fused Linear+activation, aliased Reshape, NLL after
// LogSoftmax, BatchNorm with batch statistics. And the gradient buffers values share
// change no bit of any gradient, and cost what their plan says.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include <gtest/gtest.h>

#include "comm/comm.h"
#include "importer/onnx_importer.h"
#include "partitioner/plan.h"
#include "partitioner/stage_writer.h"
#include "program/loss.h"
#include "program/program.h"
#include "schedule/registry.h"
#include "testing/recording_backend.h"
#include "testing/reference_forward.h"
#include "tests/model_builder.h"
#include "tests/model_util.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::load_model;
using testing::model_names;
using testing::source_path;

std::vector<float> random_vector(int64_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

class EveryModel : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryModel, EvalForwardEqualsTheReferenceEvaluator) {
  ImportedModel m = load_model(GetParam());
  const Graph& g = m.graph;
  std::unique_ptr<Backend> backend = make_cpu_backend();
  const int64_t batch = 7;
  auto program = Program::create(g, *backend, batch);
  ASSERT_TRUE(program.is_ok()) << program.status().message();
  const int in = g.inputs[0];
  std::vector<float> x = random_vector(batch * g.values[in].shape.per_sample_elements(), 3);
  (*program)->forward({x.data()}, batch, Mode::kEval, 0);
  // The reference uses BatchNorm's batch statistics only where the file says training;
  // the Program in eval mode always uses running statistics.
  Graph eval_graph = g;
  for (Node& n : eval_graph.nodes) n.training = false;
  HostTensor input{g.values[in].shape.dims, x};
  input.dims[0] = batch;
  auto want = run_forward(eval_graph, {{g.values[in].name, input}});
  ASSERT_TRUE(want.is_ok());
  const HostTensor& expected = want->at(g.values[g.outputs[0]].name);
  std::vector<float> got(expected.data.size());
  backend->download(got.data(), (*program)->output(0), static_cast<int64_t>(got.size()));
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], expected.data[i], 1e-5 + 1e-4 * std::fabs(expected.data[i])) << "element " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, EveryModel, ::testing::ValuesIn(model_names()),
                         [](const auto& info) { return info.param; });

// Loss of `batch` samples at the graph's current parameters, in float64 accumulation
// but float32 arithmetic (the backend's). BatchNorm uses batch statistics (train
// mode), Dropout is excluded from these models.
double loss_at(const Graph& g, const std::vector<float>& x, const std::vector<float>& targets, int64_t batch,
               LossKind kind, std::vector<float>* gradient) {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  auto program = Program::create(g, *backend, batch);
  EXPECT_TRUE(program.is_ok());
  Program& p = **program;
  DeviceBuffer t(*backend, static_cast<int64_t>(targets.size()));
  backend->upload(t.data(), targets.data(), static_cast<int64_t>(targets.size()));
  p.zero_gradients();
  p.forward({x.data()}, batch, Mode::kTrain, 0);
  const double loss = apply_loss(p, kind, ends_in_log_softmax(g), t.data(), batch, batch);
  if (gradient) {
    p.backward(batch);
    gradient->resize(static_cast<size_t>(p.trainable_elements()));
    backend->download(gradient->data(), p.gradients(), p.trainable_elements());
  }
  return loss;
}

struct GradCase {
  std::string model;
  LossKind loss;
};

class WholeModelGradient : public ::testing::TestWithParam<GradCase> {};

TEST_P(WholeModelGradient, MatchesFiniteDifferences) {
  ImportedModel m = load_model(GetParam().model);
  Graph g = m.graph;
  const int64_t batch = 6;
  const int in = g.inputs[0], out = g.outputs[0];
  const std::vector<float> x = random_vector(batch * g.values[in].shape.per_sample_elements(), 11);
  const int64_t classes = g.values[out].shape.per_sample_elements();
  std::vector<float> targets;
  if (GetParam().loss == LossKind::kCrossEntropy) {
    for (int64_t i = 0; i < batch; ++i) targets.push_back(static_cast<float>((i * 7 + 3) % classes));
  } else {
    targets = random_vector(batch * classes, 5);
  }
  std::vector<float> analytic;
  loss_at(g, x, targets, batch, GetParam().loss, &analytic);
  // Probe 40 entries spread over every trainable parameter tensor.
  std::unique_ptr<Backend> b = make_cpu_backend();
  auto layout = Program::create(g, *b, batch);
  ASSERT_TRUE(layout.is_ok());
  std::mt19937 rng(7);
  int probes = 0;
  double worst = 0;
  for (size_t p = 0; p < g.params.size(); ++p) {
    if (!g.params[p].trainable) continue;
    for (int k = 0; k < 4; ++k) {
      const int64_t e = std::uniform_int_distribution<int64_t>(0, g.params[p].elements() - 1)(rng);
      const float saved = g.params[p].data[e];
      // Central differences in float32: h trades truncation against rounding. The loss
      // is O(1), so rounding noise is ~1e-7/h = 1e-4; h must stay small enough that the
      // step rarely moves a pre-activation across a ReLU kink (1e-2 did, for 1 probe in ~300).
      const float h = 1e-3f * std::max(1.0f, std::fabs(saved));
      g.params[p].data[e] = saved + h;
      const double up = loss_at(g, x, targets, batch, GetParam().loss, nullptr);
      g.params[p].data[e] = saved - h;
      const double down = loss_at(g, x, targets, batch, GetParam().loss, nullptr);
      g.params[p].data[e] = saved;
      const double numeric = (up - down) / (2.0 * h);
      const double got = analytic[(*layout)->parameter_offset(static_cast<int>(p)) + e];
      const double diff = std::fabs(got - numeric);
      worst = std::max(worst, diff);
      EXPECT_LE(diff, 2e-3 + 2e-2 * std::fabs(numeric))
          << g.params[p].name << "[" << e << "]: analytic " << got << ", numeric " << numeric;
      ++probes;
    }
  }
  EXPECT_GT(probes, 0);
  std::printf("%s: %d probes, worst |analytic - numeric| = %.2e\n", GetParam().model.c_str(), probes, worst);
}

INSTANTIATE_TEST_SUITE_P(
    Models, WholeModelGradient,
    ::testing::Values(GradCase{"simple", LossKind::kCrossEntropy}, GradCase{"residual", LossKind::kCrossEntropy},
                      GradCase{"shared_weight", LossKind::kCrossEntropy}, GradCase{"flatten", LossKind::kCrossEntropy},
                      GradCase{"layernorm_opset18", LossKind::kCrossEntropy},
                      GradCase{"layernorm_decomposed", LossKind::kMse},
                      GradCase{"batchnorm_train", LossKind::kCrossEntropy},
                      GradCase{"batchnorm_default_stats", LossKind::kCrossEntropy},
                      GradCase{"gelu_op20", LossKind::kCrossEntropy}, GradCase{"gelu_tanh", LossKind::kMse},
                      GradCase{"silu", LossKind::kCrossEntropy}, GradCase{"activations", LossKind::kCrossEntropy},
                      GradCase{"linear_matmul_add", LossKind::kCrossEntropy}, GradCase{"linear_nobias", LossKind::kMse},
                      GradCase{"gemm_alpha_beta", LossKind::kCrossEntropy},
                      GradCase{"logsoftmax", LossKind::kCrossEntropy}, GradCase{"softmax", LossKind::kMse}),
    [](const auto& info) { return info.param.model + (info.param.loss == LossKind::kMse ? "_mse" : "_ce"); });

// How two_slot_gradients() runs the backwards: whole (B1 B0), or split into input and
// weight halves right after each other (I1 W1 I0 W0), or with the weight halves deferred
// past the other micro-batch's input half (I1 I0 W1 W0), as zero-bubble schedules do.
enum class Backward { kWhole, kSplit, kSplitDeferred };

// Two micro-batches in flight, the way a 1F1B stage runs them (forward 0, forward 1,
// backward 1, backward 0), from a fresh step and then accumulating; returns the
// parameter gradients, after every input's gradient in both slots when they have one.
std::vector<float> two_slot_gradients(const Graph& g, ProgramOptions options, bool inputs_need_grad,
                                      Backward backward = Backward::kWhole) {
  std::unique_ptr<Backend> backend = make_cpu_backend();
  options.slots = 2;
  options.input_needs_grad.assign(g.inputs.size(), inputs_need_grad);
  auto created = Program::create(g, *backend, 5, options);
  EXPECT_TRUE(created.is_ok()) << created.status().message();
  Program& p = **created;
  const int64_t batch = 5, in = g.values[g.inputs[0]].shape.per_sample_elements();
  const int64_t out = p.output_shape(0).per_sample_elements();
  std::vector<float> result;
  p.zero_gradients();
  for (int step = 0; step < 2; ++step) {
    std::vector<DeviceBuffer> targets;
    for (int slot = 0; slot < 2; ++slot) {
      const std::vector<float> x = random_vector(batch * in, 20 + 2 * step + slot);
      const std::vector<float> t = random_vector(batch * out, 30 + 2 * step + slot);
      targets.emplace_back(*backend, batch * out);
      backend->upload(targets.back().data(), t.data(), batch * out);
      p.select_slot(slot);
      p.forward({x.data()}, batch, Mode::kTrain, 99, slot * batch);
      apply_loss(p, LossKind::kMse, false, targets.back().data(), batch, 2 * batch);
    }
    for (int slot = 1; slot >= 0; --slot) {
      p.select_slot(slot);
      if (backward == Backward::kWhole) p.backward(batch);
      if (backward != Backward::kWhole) p.backward_input(batch);
      if (backward == Backward::kSplit) p.backward_weight(batch);
    }
    for (int slot = 1; slot >= 0 && backward == Backward::kSplitDeferred; --slot) {
      p.select_slot(slot);
      p.backward_weight(batch);
    }
    for (int slot = 0; slot < 2 && inputs_need_grad; ++slot) {
      p.select_slot(slot);
      for (size_t k = 0; k < g.inputs.size(); ++k) {
        std::vector<float> dx(static_cast<size_t>(batch * in));
        backend->download(dx.data(), p.input_gradient(static_cast<int>(k)), batch * in);
        result.insert(result.end(), dx.begin(), dx.end());
      }
    }
  }
  std::vector<float> dw(static_cast<size_t>(p.trainable_elements()));
  backend->download(dw.data(), p.gradients(), p.trainable_elements());
  result.insert(result.end(), dw.begin(), dw.end());
  return result;
}

// Two_slot_gradients() with `plain` (every value in buffers of its own) and `planned`
// options (run as `backward` says), bit for bit, with and without input gradients:
// without, LayerNorm and BatchNorm on the input get no dx, and the input no buffer.
void expect_same_gradients(const Graph& g, const ProgramOptions& plain, const ProgramOptions& planned,
                           Backward backward = Backward::kWhole) {
  for (bool inputs_need_grad : {true, false}) {
    const std::vector<float> own = two_slot_gradients(g, plain, inputs_need_grad);
    const std::vector<float> shared = two_slot_gradients(g, planned, inputs_need_grad, backward);
    ASSERT_EQ(own.size(), shared.size());
    bool nonzero = false;
    for (size_t i = 0; i < own.size(); ++i) {
      nonzero = nonzero || own[i] != 0.0f;
      ASSERT_EQ(std::memcmp(&own[i], &shared[i], sizeof(float)), 0)
          << "element " << i << ": own buffers " << own[i] << ", planned " << shared[i]
          << (inputs_need_grad ? "" : " (no input gradient)");
    }
    EXPECT_TRUE(nonzero) << "the check compares nothing but zeros";
  }
}

ProgramOptions own_buffers() {
  ProgramOptions o;
  o.share_gradient_buffers = false;
  o.recompute_activations = false;
  return o;
}

TEST_P(EveryModel, SharedGradientBuffersChangeNoBit) {
  ImportedModel m = load_model(GetParam());
  ProgramOptions shared = own_buffers();
  shared.share_gradient_buffers = true;
  expect_same_gradients(m.graph, own_buffers(), shared);
}

TEST_P(EveryModel, RecomputedActivationsChangeNoBit) {
  ImportedModel m = load_model(GetParam());
  ProgramOptions recomputed = own_buffers();
  recomputed.recompute_activations = true;
  expect_same_gradients(m.graph, own_buffers(), recomputed);
  expect_same_gradients(m.graph, own_buffers(), ProgramOptions{});  // both, as training runs
}

// Backward as an input half and a weight half, adjacent or with the weight halves
// deferred past the next micro-batch's input half: the same bits as whole backwards, with
// the buffers training uses (shared gradients, recomputed activations, which W recomputes
// again) and with every value in buffers of its own.
TEST_P(EveryModel, SplitBackwardChangesNoBit) {
  ImportedModel m = load_model(GetParam());
  for (Backward backward : {Backward::kSplit, Backward::kSplitDeferred}) {
    SCOPED_TRACE(backward == Backward::kSplit ? "I then W" : "I, I, then W, W");
    ProgramOptions split;
    split.split_backward = true;
    expect_same_gradients(m.graph, own_buffers(), split, backward);
    ProgramOptions own = own_buffers();
    own.split_backward = true;
    expect_same_gradients(m.graph, own_buffers(), own, backward);
  }
}

// Without split_backward a program defers nothing: backward_input() is the whole backward
// and backward_weight() adds nothing, so the halves still give backward()'s bits.
TEST_P(EveryModel, HalvesOfAnUnsplitProgramAreTheWholeBackward) {
  ImportedModel m = load_model(GetParam());
  expect_same_gradients(m.graph, own_buffers(), ProgramOptions{}, Backward::kSplitDeferred);
}

// The cases no exported model has: a recomputed Sigmoid read in backward by two Linears
// and a Tanh (an activation of a recomputed activation, kept itself); a ReLU after an Add
// (not fused) read by a Linear; a Sigmoid whose readers' backwards never read it (an Add),
// so its own backward gets y = null and recomputes what it needs.
TEST(Program, RecomputationAcrossFanOutChainsAndAdds) {
  testing::ModelBuilder b(24);
  const std::string a1 = b.unary("Sigmoid", b.linear("input", 24, 32));
  const std::string t = b.unary("Tanh", a1);
  const std::string h2 = b.linear(a1, 32, 32), h3 = b.linear(a1, 32, 32);
  const std::string r2 = b.relu(b.add(h2, t));
  const std::string h4 = b.linear(r2, 32, 32);
  const std::string s3 = b.unary("Sigmoid", b.add(h4, h3));
  b.output(b.linear(b.add(s3, h4), 32, 10), 10);
  auto proto = std::make_shared<onnx::ModelProto>(b.model());
  Result<ImportedModel> m = import_onnx_model(proto, ".", "built");
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  const Graph& g = m->graph;
  std::unique_ptr<Backend> backend = make_cpu_backend();
  auto p = Program::create(g, *backend, 4);
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  std::vector<bool> recomputed;  // the activations in order: Sigmoid, Tanh, ReLU, Sigmoid
  for (const Node& n : g.nodes) {
    if (n.kind == OpKind::kActivation) recomputed.push_back((*p)->recomputed(n.outputs[0]));
  }
  EXPECT_EQ(recomputed, (std::vector<bool>{true, false, true, true})) << "the Tanh of a recomputed Sigmoid is kept";
  ProgramOptions recomputed_options = own_buffers();
  recomputed_options.recompute_activations = true;
  expect_same_gradients(g, own_buffers(), recomputed_options);
  expect_same_gradients(g, own_buffers(), ProgramOptions{});
}

// A fused activation that the backend cannot recompute bit for bit is kept, and what
// follows it may then be recomputed from it; the other kinds are untouched.
TEST(Program, KeptFusedKindsAreNotRecomputed) {
  testing::ModelBuilder b(8);
  const std::string s = b.unary("Sigmoid", b.linear("input", 8, 16));
  const std::string t = b.unary("Tanh", s);
  b.output(b.linear(b.relu(b.linear(t, 16, 16)), 16, 4), 4);
  auto proto = std::make_shared<onnx::ModelProto>(b.model());
  Result<ImportedModel> m = import_onnx_model(proto, ".", "built");
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  const Graph& g = m->graph;
  auto activations = [&](const std::vector<bool>& recomputed) {  // Sigmoid, Tanh, ReLU
    std::vector<bool> r;
    for (const Node& n : g.nodes) {
      if (n.kind == OpKind::kActivation) r.push_back(recomputed[n.outputs[0]]);
    }
    return r;
  };
  EXPECT_EQ(activations(recomputable_values(g)), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(activations(recomputable_values(g, {ActivationKind::kSigmoid})), (std::vector<bool>{false, true, true}));
  EXPECT_EQ(activations(recomputable_values(g, {ActivationKind::kTanh})), (std::vector<bool>{true, false, true}))
      << "the Tanh is not fused into a Linear: its own pass is recomputed exactly";
}

// The CUDA backend keeps a fused GeluTanh's output below fp32 (its cuBLASLt epilogue is
// not activation_forward's formula). A Program on such a backend keeps it, and holds what
// the memory estimate says when told which kinds the backend keeps (kept_when_fused(), as
// train's memory check does).
TEST(Program, EstimateCountsWhatTheBackendKeeps) {
  ImportedModel m = load_model("gelu_tanh");
  const Graph& g = m.graph;
  int gelu = -1;
  for (const Node& n : g.nodes) {
    if (n.kind == OpKind::kActivation) gelu = n.outputs[0];
  }
  ASSERT_GE(gelu, 0);
  ASSERT_EQ(g.nodes[g.values[gelu].producer].activation, ActivationKind::kGeluTanh);
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  testing::RecordingBackend keeps(*cpu);
  keeps.inexact_epilogues = {ActivationKind::kGeluTanh};
  EXPECT_TRUE(kept_when_fused(*cpu).empty());
  EXPECT_EQ(kept_when_fused(keeps), std::vector<ActivationKind>{ActivationKind::kGeluTanh});
  const int64_t micro = 16, slots = 4;  // GPipe over four micro-batches
  ProgramOptions options;
  options.slots = slots;
  std::vector<int64_t> estimates;
  for (Backend* backend : {static_cast<Backend*>(cpu.get()), static_cast<Backend*>(&keeps)}) {
    auto p = Program::create(g, *backend, micro, options);
    ASSERT_TRUE(p.is_ok()) << p.status().message();
    EXPECT_EQ((*p)->recomputed(gelu), backend == cpu.get());
    PartitionOptions o;
    o.batch_size = slots * micro;
    o.micro_batches = slots;
    o.schedule = "gpipe";
    o.kept_when_fused = kept_when_fused(*backend);
    Result<Plan> plan = make_plan(g, "", o);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    const int64_t held = (*p)->memory().total() + 2 * (*p)->memory().gradients;
    estimates.push_back(plan->stages[0].memory_bytes);
    EXPECT_LE(std::abs(estimates.back() - held), 8) << backend->name();
  }
  EXPECT_EQ(estimates[1] - estimates[0], (slots - 1) * micro * g.values[gelu].shape.per_sample_elements() * 4)
      << "the GeluTanh output in every slot, not in one shared buffer";
}

// Evaluation needs no gradients: a forward-only program computes the same outputs
// without allocating any.
TEST_P(EveryModel, ForwardOnlyProgramHoldsNoGradients) {
  ImportedModel m = load_model(GetParam());
  const Graph& g = m.graph;
  std::unique_ptr<Backend> backend = make_cpu_backend();
  const int64_t batch = 5, in = g.values[g.inputs[0]].shape.per_sample_elements();
  const std::vector<float> x = random_vector(batch * in, 8);
  std::vector<std::vector<float>> outputs;
  std::vector<int64_t> held;
  for (bool forward_only : {false, true}) {
    const int64_t before = backend->memory_use().in_use;
    ProgramOptions options;
    options.forward_only = forward_only;
    auto p = Program::create(g, *backend, batch, options);
    ASSERT_TRUE(p.is_ok()) << p.status().message();
    held.push_back(backend->memory_use().in_use - before);
    (*p)->forward({x.data()}, batch, Mode::kEval, 0);
    const int64_t n = batch * (*p)->output_shape(0).per_sample_elements();
    outputs.emplace_back(static_cast<size_t>(n));
    backend->download(outputs.back().data(), (*p)->output(0), n);
    if (forward_only) {
      EXPECT_EQ((*p)->value_gradient_elements(), 0);
      EXPECT_EQ((*p)->gradients(), nullptr);
    }
  }
  EXPECT_EQ(outputs[0], outputs[1]);
  int64_t trainable = 0;
  for (const Parameter& q : g.params) trainable += q.trainable ? q.elements() : 0;
  EXPECT_LE(held[1], held[0] - 4 * trainable) << "without the parameter gradients at least";
}

// Program::memory() accounts for what the program asked of the backend: the backend's
// count grows by that, plus its rounding (64 bytes a buffer on the CPU).
TEST_P(EveryModel, MemoryAccountsForEveryBuffer) {
  ImportedModel m = load_model(GetParam());
  const Graph& g = m.graph;
  std::unique_ptr<Backend> backend = make_cpu_backend();
  ProgramOptions options;
  options.slots = 2;
  const int64_t before = backend->memory_use().in_use;
  auto p = Program::create(g, *backend, 6, options);
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  const int64_t held = backend->memory_use().in_use - before;
  const Program::Memory mem = (*p)->memory();
  const int64_t buffers = 3 + 4 * static_cast<int64_t>(g.nodes.size()) + 2 * static_cast<int64_t>(g.values.size());
  EXPECT_GE(held, mem.total());
  EXPECT_LE(held, mem.total() + 64 * buffers);
  int64_t params = 0, trainable = 0;
  for (const Parameter& q : g.params) {
    params += q.elements();
    trainable += q.trainable ? q.elements() : 0;
  }
  EXPECT_EQ(mem.weights, 4 * std::max<int64_t>(trainable, 1) + 4 * std::max<int64_t>(params - trainable, 1));
  EXPECT_EQ(mem.gradients, 4 * std::max<int64_t>(trainable, 1));
  EXPECT_EQ(mem.activation_gradients, 4 * (*p)->value_gradient_elements());
  // Every value a node makes but a Reshape, kept values in both slots, recomputed ones in
  // one buffer at least as large as the largest.
  int64_t kept = 0, largest_recomputed = 0;
  for (const Node& n : g.nodes) {
    const int y = n.outputs[0];
    const int64_t elements = g.values[y].shape.per_sample_elements();
    if ((*p)->recomputed(y)) {
      largest_recomputed = std::max(largest_recomputed, elements);
    } else if (n.kind != OpKind::kReshape) {
      kept += elements;
    }
  }
  for (int v : g.inputs) kept += g.values[v].shape.per_sample_elements();
  EXPECT_GE(mem.activations, 4 * 6 * (2 * kept + largest_recomputed));
}

// The partitioner's memory estimate (Adam: two state slots) against what each stage's
// Program holds, plus that optimizer state, in one stage and in two with four
// micro-batches, under 1F1B (stage 0 keeps two in flight) and under ZB-H1 (both keep two,
// and each Linear's output gradient waits for W in every slot), whole and in two
// tensor-parallel shards where the model's widths divide. Exact but for a few bytes (the
// Program's placeholder for absent running statistics) or, where Reshapes and Dropout
// masks make it coarser, a little over: the memory check must not let through what
// cannot fit.
TEST_P(EveryModel, MemoryEstimateMatchesWhatTheProgramsHold) {
  ImportedModel m = load_model(GetParam());
  const int layers = layer_of_nodes(m.graph).back() + 1;
  for (const std::string schedule : {"1f1b", "zb-h1"}) {
    for (int shards = 1; shards <= 2; ++shards) {
      for (int stages = 1; stages <= std::min(2, layers); ++stages) {
        PartitionOptions o;
        o.stages = stages;
        o.tensor_parallel = shards;
        o.batch_size = 64;
        o.micro_batches = 4;
        o.schedule = schedule;
        Result<Plan> plan = make_plan(m.graph, "", o);
        if (shards > 1 && !plan.is_ok()) continue;  // a width that does not divide in two
        ASSERT_TRUE(plan.is_ok()) << plan.status().message();
        for (int k = 0; k < stages; ++k) {
          Result<std::shared_ptr<onnx::ModelProto>> proto = build_stage_model(m, *plan, k, shards - 1);
          ASSERT_TRUE(proto.is_ok()) << proto.status().message();
          Result<ImportedModel> stage = import_onnx_model(*proto, ".", "stage");
          ASSERT_TRUE(stage.is_ok()) << stage.status().message();
          std::unique_ptr<Backend> backend = make_cpu_backend();
          std::unique_ptr<Communicator> tensor = make_placeholder_communicator(0, shards, "a measured program's group");
          ProgramOptions options;
          options.slots = find_schedule(schedule)->in_flight(stages, 4, k, 1);
          options.split_backward = schedule == "zb-h1";
          options.input_needs_grad.assign(stage->graph.inputs.size(), k > 0);
          options.tensor = tensor.get();
          auto p = Program::create(stage->graph, *backend, 64 / 4, options);
          ASSERT_TRUE(p.is_ok()) << p.status().message();
          const int64_t held = (*p)->memory().total() + 2 * (*p)->memory().gradients;
          const int64_t estimate = plan->stages[k].memory_bytes;
          const std::string where = schedule + ", stage " + std::to_string(k) + " of " + std::to_string(stages) + ", " +
                                    std::to_string(shards) + " shard(s)";
          EXPECT_GE(estimate, held - 8) << where;
          EXPECT_LE(estimate, held + held / 10) << where;
        }
      }
    }
  }
}

// A chain of fused Linear+ReLU needs two shared gradient buffers whatever its depth
// (one for each Linear's output, one for each ReLU's), plus the output's own, per slot;
// and two buffers for the ReLUs' outputs, which backward recomputes.
TEST(Program, DeepChainSharesTwoBuffers) {
  testing::ModelBuilder b(48);
  std::string x = "input";
  int64_t width = 48;
  for (int i = 0; i < 12; ++i) {  // widths 64 and 65 in turn
    x = b.relu(b.linear(x, width, 64 + i % 2));
    width = 64 + i % 2;
  }
  x = b.linear(x, width, 10);
  b.output(x, 10);
  auto proto = std::make_shared<onnx::ModelProto>(b.model());
  Result<ImportedModel> m = import_onnx_model(proto, ".", "built");
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  std::unique_ptr<Backend> backend = make_cpu_backend();
  const int64_t batch = 8;
  ProgramOptions options;
  options.slots = 3;
  auto shared = Program::create(m->graph, *backend, batch, options);
  options.share_gradient_buffers = false;
  options.recompute_activations = false;
  auto own = Program::create(m->graph, *backend, batch, options);
  ASSERT_TRUE(shared.is_ok() && own.is_ok());
  EXPECT_EQ((*shared)->value_gradient_elements(), 2 * batch * 65 + 3 * batch * 10);
  // Unshared: every value but the input (which needs no gradient), in every slot.
  int64_t all = 0;
  for (size_t v = 1; v < m->graph.values.size(); ++v) all += 3 * batch * m->graph.values[v].shape.per_sample_elements();
  EXPECT_EQ((*own)->value_gradient_elements(), all);
  EXPECT_EQ((*shared)->input_gradient(0), nullptr) << "nothing back-propagates into the model input";
  // Activations: the input, every Linear's output (the ReLUs' pre-activations) and the
  // model output in each slot; the ReLUs' outputs, recomputed, in two shared one-slot
  // buffers (each ReLU's output and the next one's live at once in the fused forward).
  const int64_t kept = 48 + 6 * 64 + 6 * 65 + 10;
  EXPECT_EQ((*shared)->memory().activations, 4 * batch * (3 * kept + 64 + 65));
  EXPECT_EQ((*own)->memory().activations, 4 * batch * 3 * (kept + 6 * 64 + 6 * 65));
}

TEST(Program, SharedWeightGetsTheSumOfBothUses) {
  ImportedModel m = load_model("shared_weight");
  const Graph& g = m.graph;
  int shared = -1, uses = 0;
  for (const Node& n : g.nodes) {
    if (n.kind != OpKind::kLinear) continue;
    for (const Node& o : g.nodes) {
      if (&o != &n && o.kind == OpKind::kLinear && o.weight == n.weight) shared = n.weight;
    }
  }
  for (const Node& n : g.nodes) uses += n.kind == OpKind::kLinear && n.weight == shared;
  EXPECT_EQ(uses, 2) << "the model reuses one weight in two layers";
  std::unique_ptr<Backend> b = make_cpu_backend();
  auto p = Program::create(g, *b, 4);
  ASSERT_TRUE(p.is_ok());
  // One tensor, one gradient slot: the optimizer updates it once.
  int64_t trainable = 0;
  for (const Parameter& prm : g.params) trainable += prm.trainable ? prm.elements() : 0;
  EXPECT_EQ((*p)->trainable_elements(), trainable);
}

}  // namespace
}  // namespace pipeshard
