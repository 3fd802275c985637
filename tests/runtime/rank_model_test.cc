// RankModel: the part of the model one rank trains, cut from the stage file the
// partitioner writes, with the values crossing its cuts and the map back to whole
// parameters.
#include "runtime/rank_model.h"

#include <gtest/gtest.h>

#include "importer/onnx_importer.h"
#include "tests/model_builder.h"
#include "tests/model_util.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::load_model;

RankModel rank_of(const ImportedModel& m, int rank, int world, int stages, int shards) {
  Result<ProcessLayout> layout = ProcessLayout::for_rank(rank, world, stages, shards);
  EXPECT_TRUE(layout.is_ok());
  Result<RankModel> r = RankModel::create(m, *layout, PartitionOptions{});
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  return std::move(*r);
}

std::vector<std::string> names(const std::vector<LinkValue>& links) {
  std::vector<std::string> out;
  for (const LinkValue& l : links) out.push_back(l.name);
  return out;
}

TEST(RankModel, ResidualInputIsCarriedAcrossTheFirstCut) {
  const ImportedModel m = load_model("residual");  // x -> Linear Relu | Linear Add(x) | Linear
  const RankModel s0 = rank_of(m, 0, 3, 3, 1), s1 = rank_of(m, 1, 3, 3, 1), s2 = rank_of(m, 2, 3, 3, 1);
  EXPECT_TRUE(s0.incoming().empty());
  const std::vector<std::string> cut0 = {"input", "/Relu_output_0"};
  EXPECT_EQ(names(s0.outgoing()), cut0);
  EXPECT_EQ(names(s1.incoming()), cut0);
  EXPECT_EQ(names(s1.outgoing()), std::vector<std::string>{"/Add_output_0"});
  EXPECT_EQ(names(s2.incoming()), std::vector<std::string>{"/Add_output_0"});
  EXPECT_TRUE(s2.outgoing().empty());
  // The model input needs no gradient; the hidden activation does. Stage 0 reads the input
  // itself and passes it on; stage 1 reads both.
  EXPECT_FALSE(s0.outgoing()[0].needs_grad);
  EXPECT_TRUE(s0.outgoing()[1].needs_grad);
  EXPECT_EQ(s0.outgoing()[0].per_sample, 64);
  EXPECT_EQ(s0.outgoing()[1].per_sample, 128);
  for (const LinkValue& l : s1.incoming()) EXPECT_GE(l.local, 0) << l.name;
  ASSERT_EQ(s1.input_needs_grad().size(), s1.graph().inputs.size());
  for (size_t k = 0; k < s1.graph().inputs.size(); ++k) {
    const std::string& name = s1.graph().values[s1.graph().inputs[k]].name;
    EXPECT_EQ(s1.input_needs_grad()[k], name == "/Relu_output_0") << name;
  }
  // Each stage holds its own parameters, and only those.
  for (int s = 0; s < 3; ++s) EXPECT_EQ(s0.stage_params(s).size(), 2u) << "stage " << s;
}

TEST(RankModel, ShardsSliceAndNameTheWholeParameters) {
  const ImportedModel m = load_model("simple_digits");  // Linear(64,256) Relu Linear(256,128) Relu Linear(128,10)
  for (int t = 0; t < 2; ++t) {
    SCOPED_TRACE("shard " + std::to_string(t));
    const RankModel r = rank_of(m, t, 2, 1, 2);
    const Graph& g = r.graph();
    int column = 0, row = 0, whole = 0;
    for (size_t q = 0; q < g.params.size(); ++q) {
      const Parameter& full = m.graph.params[r.full_param(static_cast<int>(q))];
      EXPECT_EQ(full.name, g.params[q].name);
      const int axis = r.shard_axis(static_cast<int>(q));
      if (axis < 0) {
        ++whole;
        EXPECT_EQ(g.params[q].dims, full.dims);
      } else {
        (axis == 0 ? column : row) += 1;
        EXPECT_EQ(g.params[q].dims[axis] * 2, full.dims[axis]);
      }
      // Slicing the whole tensor gives exactly what the stage file holds.
      EXPECT_EQ(r.slice(static_cast<int>(q), full.data), g.params[q].data) << g.params[q].name;
    }
    // The first pair: weight and bias of the column Linear split by output rows, the row
    // Linear's weight by input columns; its bias and the last Linear whole.
    EXPECT_EQ(column, 2);
    EXPECT_EQ(row, 1);
    EXPECT_EQ(whole, 3);
  }
}

// Dropout masks are keyed by the node's index in the whole model; ONNX does not make node
// names unique, so a stage finds its nodes by the values they produce.
TEST(RankModel, NodesAreTheWholeModelsEvenWithRepeatedNames) {
  testing::ModelBuilder b(64);
  auto dropout = [&](const std::string& x, const std::string& out) {
    auto* n = b.model().mutable_graph()->add_node();
    n->set_op_type("Dropout");
    n->set_name("drop");  // the same name three times
    n->add_input(x);
    n->add_output(out);
    return out;
  };
  std::string h = dropout(b.relu(b.linear("input", 64, 32)), "d1");
  h = dropout(b.relu(b.linear(h, 32, 32)), "d2");
  h = dropout(b.relu(b.linear(h, 32, 32)), "d3");
  b.output(b.linear(h, 32, 10), 10);
  Result<ImportedModel> m = import_onnx_model(std::make_shared<onnx::ModelProto>(b.model()), ".", "built");
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  int dropouts = 0;
  for (int rank = 0; rank < 2; ++rank) {
    const RankModel r = rank_of(*m, rank, 2, 2, 1);
    const Graph& g = r.graph();
    for (size_t i = 0; i < g.nodes.size(); ++i) {
      if (g.nodes[i].kind != OpKind::kDropout) continue;
      ++dropouts;
      const uint64_t whole = r.model_node_ids()[i];
      ASSERT_LT(whole, m->graph.nodes.size());
      EXPECT_EQ(m->graph.values[m->graph.nodes[whole].outputs[0]].name, g.values[g.nodes[i].outputs[0]].name);
    }
  }
  EXPECT_EQ(dropouts, 3);
}

TEST(RankModel, OneStageOneShardIsTheWholeModel) {
  const ImportedModel m = load_model("simple_digits");
  const RankModel r = RankModel::whole(m.graph);
  EXPECT_TRUE(r.is_whole());
  EXPECT_EQ(&r.graph(), &m.graph);
  EXPECT_EQ(r.stage_params(0).size(), m.graph.params.size());
  for (size_t q = 0; q < m.graph.params.size(); ++q) EXPECT_EQ(r.shard_axis(static_cast<int>(q)), -1);
}

TEST(RankModel, WeightsSharedAcrossStagesAreRefused) {
  const ImportedModel m = load_model("shared_weight");
  Result<ProcessLayout> layout = ProcessLayout::for_rank(0, 2, 2, 1);
  ASSERT_TRUE(layout.is_ok());
  Result<RankModel> r = RankModel::create(m, *layout, PartitionOptions{});
  if (r.is_ok()) GTEST_SKIP() << "the optimal cut keeps the shared weight in one stage";
  EXPECT_NE(r.status().message().find("weights shared across pipeline stages"), std::string::npos)
      << r.status().message();
}

}  // namespace
}  // namespace pipeshard
