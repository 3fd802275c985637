// The layout search: that it lists every layout train can run on N ranks (checked against
// a brute-force enumeration written here), that it refuses only what does not fit or
// cannot run, saying why, and a known case. No timing.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "importer/onnx_importer.h"
#include "partitioner/layout_search.h"
#include "schedule/registry.h"
#include "tests/model_builder.h"

namespace pipeshard {
namespace {

using testing::ModelBuilder;

// `layers` Linear layers of `width` features (input and output too), a ReLU after each
// but the last.
ImportedModel mlp(int layers, int64_t width) {
  ModelBuilder b(width);
  std::string x = "input";
  for (int l = 0; l < layers; ++l) {
    x = b.linear(x, width, width);
    if (l + 1 < layers) x = b.relu(x);
  }
  b.output(x, width);
  auto proto = std::make_shared<onnx::ModelProto>(b.model());
  Result<ImportedModel> m = import_onnx_model(proto, ".", "built");
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  return std::move(m).value();
}

// The space as the header describes it, written out plainly: every D·P·T == N, the whole
// (D, P, T) once where the batch does not divide among D; otherwise every schedule (the
// default alone on one stage) with 2, 3 or 4 chunks per stage where it lets them be
// chosen, every M dividing B/D up to 16, both ways of activations (the models have ReLUs
// to recompute) and every ZeRO stage (0 alone on one replica, 2 not where train runs it
// as 1: under a split backward or several chunks per stage, or where make_plan()'s
// memory estimate is ZeRO-1's on every stage).
std::vector<Layout> brute_force(const Graph& g, int n, int64_t batch) {
  LayoutSearchOptions o;
  o.ranks = n;
  o.batch_size = batch;
  auto estimate = [&](Layout l, int zero) {
    l.zero = zero;
    Result<Plan> plan = make_plan(g, "", layout_partition_options(l, o));
    return plan ? memory_per_stage(*plan) : std::vector<int64_t>{};
  };
  std::vector<Layout> out;
  for (int d = 1; d <= n; ++d) {
    for (int p = 1; p <= n; ++p) {
      for (int t = 1; t <= n; ++t) {
        if (d * p * t != n) continue;
        if (batch % d != 0) {
          out.push_back(Layout{d, p, t, 0, "", 0, false, 0});
          continue;
        }
        std::vector<std::string> schedules = schedule_names();
        if (p == 1) schedules = {"1f1b"};
        for (const std::string& s : schedules) {
          std::vector<int> vs = {0};
          if (find_schedule(s)->chunks_per_stage == 0) vs = {2, 3, 4};
          for (int v : vs) {
            for (int m = 1; m <= 16; ++m) {
              if ((batch / d) % m != 0) continue;
              for (bool keep : {false, true}) {
                for (int zero = 0; zero <= 2; ++zero) {
                  if (d == 1 && zero > 0) continue;
                  // ZeRO-2 runs as ZeRO-1 under a split backward (the zero-bubble
                  // schedules) or several chunks per stage: listed once, as ZeRO-1.
                  const bool as_zero1 = s == "zb-h1" || s == "zb-v" || find_schedule(s)->chunks_per_stage != 1;
                  if (zero == 2 && as_zero1 && check_schedule_counts(s, p, m, v)) continue;
                  const Layout l{d, p, t, m, s, v, keep, zero};
                  if (zero == 2 && !estimate(l, 2).empty() && estimate(l, 2) == estimate(l, 1)) continue;
                  out.push_back(l);
                }
              }
            }
          }
        }
      }
    }
  }
  return out;
}

std::vector<Layout> all_layouts(const LayoutSearch& r) {
  std::vector<Layout> out;
  for (const LayoutFit& f : r.accepted) out.push_back(f.layout);
  for (const RejectedLayout& x : r.rejected) out.push_back(x.layout);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> texts(std::vector<Layout> layouts) {
  std::sort(layouts.begin(), layouts.end());
  std::vector<std::string> out;
  for (const Layout& l : layouts) out.push_back(l.text());
  return out;
}

struct Case {
  const char* name;
  int layers;
  int64_t width;
};
constexpr Case kModels[] = {{"6x64", 6, 64}, {"6x66", 6, 66}, {"3x64", 3, 64}};
constexpr int kRanks[] = {1, 2, 4, 6};
constexpr int64_t kBatch = 16;  // 3 and 6 replicas cannot share it

TEST(LayoutSearch, EnumerationIsCompleteAndListsEachLayoutOnce) {
  for (const Case& c : kModels) {
    ImportedModel m = mlp(c.layers, c.width);
    for (int n : kRanks) {
      SCOPED_TRACE(std::string(c.name) + " on " + std::to_string(n) + " ranks");
      LayoutSearchOptions o;
      o.ranks = n;
      o.batch_size = kBatch;
      const LayoutSearch r = search_layouts(m.graph, o);
      const std::vector<Layout> got = all_layouts(r);
      const std::vector<Layout> want = brute_force(m.graph, n, kBatch);
      EXPECT_EQ(texts(got), texts(want));
      EXPECT_EQ(std::adjacent_find(got.begin(), got.end()), got.end()) << "a layout listed twice";
      EXPECT_EQ(r.rejected_for_memory, 0) << "no memory limit";
      for (const Layout& l : got) EXPECT_EQ(l.ranks(), n) << l.text();
      std::printf("%s, N=%d: %zu layouts, %zu accepted, %zu rejected\n", c.name, n, r.size(), r.accepted.size(),
                  r.rejected.size());
    }
  }
}

TEST(LayoutSearch, ListsInEnumerationOrder) {
  ImportedModel m = mlp(6, 64);
  LayoutSearchOptions o;
  o.ranks = 4;
  o.batch_size = kBatch;
  const LayoutSearch r = search_layouts(m.graph, o);
  auto sorted = [](const auto& v) {
    return std::is_sorted(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.layout < b.layout; });
  };
  EXPECT_TRUE(sorted(r.accepted));
  EXPECT_TRUE(sorted(r.rejected));
}

// Which of the known causes a reason names.
bool names_a_cause(const std::string& reason) {
  for (const char* cause : {"do not divide into",           // a width T does not divide
                            "non-empty stages from",        // more stages than layers
                            "chunks (",                     // more chunks than layers
                            "does not divide among",        // the batch among D replicas
                            "micro-batches do not divide",  // M and the replica's batch
                            "micro-batch"}) {               // the schedule's counts
    if (reason.find(cause) != std::string::npos) return true;
  }
  return false;
}

TEST(LayoutSearch, RefusesNothingThatFits) {
  for (const Case& c : kModels) {
    ImportedModel m = mlp(c.layers, c.width);
    for (int n : kRanks) {
      SCOPED_TRACE(std::string(c.name) + " on " + std::to_string(n) + " ranks");
      LayoutSearchOptions o;
      o.ranks = n;
      o.batch_size = kBatch;
      // A budget between the smallest and the largest peak, so both sides have layouts.
      const LayoutSearch unlimited = search_layouts(m.graph, o);
      ASSERT_FALSE(unlimited.accepted.empty());
      std::vector<int64_t> peaks;
      for (const LayoutFit& f : unlimited.accepted) peaks.push_back(f.peak_bytes);
      std::sort(peaks.begin(), peaks.end());
      o.memory_per_rank = peaks[peaks.size() / 2];
      const LayoutSearch r = search_layouts(m.graph, o);
      EXPECT_EQ(r.size(), unlimited.size());
      EXPECT_EQ(r.accepted.size() + r.rejected_for_memory, unlimited.accepted.size());
      if (peaks.front() < peaks.back()) {
        EXPECT_GT(r.rejected_for_memory, 0);
      }

      for (const LayoutFit& f : r.accepted) {
        EXPECT_LE(f.peak_bytes, o.memory_per_rank) << f.layout.text();
        ASSERT_EQ(f.bytes_per_stage.size(), static_cast<size_t>(f.layout.stages)) << f.layout.text();
        EXPECT_EQ(f.peak_bytes, *std::max_element(f.bytes_per_stage.begin(), f.bytes_per_stage.end()));
        // The estimate is make_plan()'s with the options train would use.
        Result<Plan> plan = make_plan(m.graph, "", layout_partition_options(f.layout, o));
        ASSERT_TRUE(plan.is_ok()) << f.layout.text();
        EXPECT_EQ(memory_per_stage(*plan), f.bytes_per_stage) << f.layout.text();
      }
      int for_memory = 0;
      for (const RejectedLayout& x : r.rejected) {
        if (x.for_memory) {
          ++for_memory;
          EXPECT_GT(x.peak_bytes, o.memory_per_rank) << x.layout.text();
          EXPECT_NE(x.reason.find("over the"), std::string::npos) << x.reason;
          continue;
        }
        EXPECT_TRUE(names_a_cause(x.reason)) << x.layout.text() << ": " << x.reason;
        // Only what make_plan() refuses, or a batch that does not divide.
        if (kBatch % x.layout.replicas != 0) {
          EXPECT_TRUE(x.layout.schedule.empty()) << x.layout.text();
          continue;
        }
        Result<Plan> plan = make_plan(m.graph, "", layout_partition_options(x.layout, o));
        ASSERT_FALSE(plan.is_ok()) << x.layout.text() << " was refused: " << x.reason;
        EXPECT_EQ(plan.status().message(), x.reason) << x.layout.text();
      }
      EXPECT_EQ(for_memory, r.rejected_for_memory);
    }
  }
}

TEST(LayoutSearch, ReasonsNameTheCause) {
  LayoutSearchOptions o;
  o.ranks = 4;
  o.batch_size = 12;  // 1, 2, 3, 4, 6, 12 micro-batches on one replica; 4 replicas get 3 samples
  auto reason_of = [](const LayoutSearch& r, const std::string& text) -> std::string {
    for (const RejectedLayout& x : r.rejected) {
      if (x.layout.text() == text) return x.reason;
    }
    for (const LayoutFit& f : r.accepted) {
      if (f.layout.text() == text) return "accepted";
    }
    return "not listed";
  };
  const LayoutSearch wide = search_layouts(mlp(6, 66).graph, o);
  EXPECT_NE(reason_of(wide, "D=1 P=1 T=4 M=1 1f1b zero 0").find("do not divide into 4"), std::string::npos);
  EXPECT_EQ(reason_of(wide, "D=2 P=1 T=2 M=1 1f1b zero 1"), "accepted");
  EXPECT_NE(reason_of(wide, "D=1 P=4 T=1 M=4 interleaved v=2 zero 0").find("cannot cut 8 chunks"), std::string::npos);

  const LayoutSearch shallow = search_layouts(mlp(3, 64).graph, o);
  EXPECT_EQ(reason_of(shallow, "D=1 P=4 T=1 M=4 1f1b zero 0"), "cannot make 4 non-empty stages from 3 layers");

  o.batch_size = 6;  // 4 replicas cannot share it
  const LayoutSearch odd = search_layouts(mlp(6, 64).graph, o);
  EXPECT_EQ(reason_of(odd, "D=4 P=1 T=1"), "a batch of 6 samples does not divide among 4 data-parallel replicas");

  o.batch_size = 12;
  o.micro_batches = {5};  // chosen by hand: does not divide 12
  const LayoutSearch five = search_layouts(mlp(6, 64).graph, o);
  EXPECT_EQ(reason_of(five, "D=1 P=2 T=2 M=5 gpipe zero 0"),
            "5 micro-batches do not divide the 12 samples each replica gets per step");
}

// train refuses a weight that two stages use (runtime/rank_model.cc); make_plan() cuts it.
TEST(LayoutSearch, RefusesAWeightSharedAcrossStages) {
  ModelBuilder b(64);
  std::string x = "input";
  for (int l = 0; l < 4; ++l) x = b.relu(b.linear(x, 64, 64));
  b.output(x, 64);
  onnx::NodeProto* last = b.model().mutable_graph()->mutable_node(6);  // fc3
  ASSERT_EQ(last->name(), "fc3");
  last->set_input(1, "fc0.weight");
  auto proto = std::make_shared<onnx::ModelProto>(b.model());
  Result<ImportedModel> m = import_onnx_model(proto, ".", "built");
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  LayoutSearchOptions o;
  o.ranks = 2;
  o.batch_size = 4;
  const LayoutSearch r = search_layouts(m->graph, o);
  int shared = 0, one_stage = 0;
  for (const RejectedLayout& x : r.rejected) {
    if (x.reason.find("parameter 'fc0.weight' is used by stages 0 and 1") != std::string::npos) ++shared;
  }
  for (const LayoutFit& f : r.accepted) {
    EXPECT_EQ(f.layout.stages, 1) << f.layout.text();
    one_stage += f.layout.stages == 1;
  }
  EXPECT_GT(shared, 0);
  EXPECT_GT(one_stage, 0);
}

TEST(LayoutSearch, DataParallelOnFourRanksWithEveryZeroStage) {
  ImportedModel m = mlp(8, 64);
  LayoutSearchOptions o;
  o.ranks = 4;
  o.batch_size = 32;
  o.bucket_bytes = 16 << 10;  // one layer's weight gradient: stage 2's windows hold two, not all eight
  const LayoutSearch r = search_layouts(m.graph, o);
  int64_t peak[3] = {-1, -1, -1}, kept = -1;
  for (const LayoutFit& f : r.accepted) {
    const Layout& l = f.layout;
    if (l.replicas == 4 && l.stages == 1 && l.shards == 1 && l.micro_batches == 1) {
      EXPECT_EQ(l.schedule, "1f1b");
      if (!l.keep_activations) peak[l.zero] = f.peak_bytes;
      if (l.keep_activations && l.zero == 0) kept = f.peak_bytes;
    }
  }
  ASSERT_GT(peak[0], 0);
  ASSERT_GT(peak[1], 0);
  ASSERT_GT(peak[2], 0);
  EXPECT_LT(peak[1], peak[0]);
  EXPECT_LT(peak[2], peak[1]);
  EXPECT_GT(kept, peak[0]) << "keeping the ReLUs' outputs costs memory";
  // The pure pipeline and the pure tensor-parallel layout fit too.
  bool pipeline = false, tensor = false;
  for (const LayoutFit& f : r.accepted) {
    pipeline = pipeline || (f.layout.stages == 4 && f.layout.replicas == 1);
    tensor = tensor || (f.layout.shards == 4 && f.layout.replicas == 1);
  }
  EXPECT_TRUE(pipeline);
  EXPECT_TRUE(tensor);
}

TEST(LayoutSearch, ZeroTwoIsListedOnlyWhereItSavesMemory) {
  ImportedModel m = mlp(8, 64);
  LayoutSearchOptions o;
  o.ranks = 4;
  o.batch_size = 32;
  // One bucket of 25 MiB holds every gradient: the windows would hold the whole buffer, so
  // train runs --zero 2 as stage 1 and the search lists it once, as ZeRO-1.
  const LayoutSearch big = search_layouts(m.graph, o);
  o.bucket_bytes = 16 << 10;
  const LayoutSearch small = search_layouts(m.graph, o);
  auto zero2 = [](const LayoutSearch& r) {
    int n = 0;
    for (const LayoutFit& f : r.accepted) n += f.layout.zero == 2;
    return n;
  };
  EXPECT_EQ(zero2(big), 0);
  EXPECT_GT(zero2(small), 0);
  EXPECT_EQ(big.accepted.size() + static_cast<size_t>(zero2(small)), small.accepted.size());
  EXPECT_EQ(big.rejected.size(), small.rejected.size());
}

}  // namespace
}  // namespace pipeshard
