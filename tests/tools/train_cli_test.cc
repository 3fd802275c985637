// The train command line: a short real run (metrics, progress, a saved model that
// pipeshard and onnxruntime load), and bad input refused with one line, exit status 2
// and nothing written.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <onnx/onnx_pb.h>
#include <nlohmann/json.hpp>

#include "dataset/npy.h"
#include "importer/onnx_importer.h"
#include "tests/model_builder.h"
#include "tests/test_util.h"
#include "tests/tools/malformed_util.h"

namespace pipeshard {
namespace {

using testing::quote;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

std::string train_command(const std::string& model, const std::string& extra) {
  return quote(tool_path("train")) + " " + quote(source_path("models/" + model)) + " --data " +
         quote(source_path("data/digits_features.npy")) + " --labels " + quote(source_path("data/digits_labels.npy")) +
         " " + extra;
}

TEST(TrainCli, ShortRunWritesMetricsAndALoadableModel) {
  ScratchDir dir("train");
  auto r =
      run_command(train_command("simple_digits.onnx", "--steps 12 --batch-size 64 --lr 0.05 --momentum 0.9 --metrics " +
                                                          quote(dir / "m.jsonl") + " --save " + quote(dir / "t.onnx")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream in(dir / "m.jsonl");
  std::string line;
  int64_t expected = 1;
  double first = 0, last = 0;
  std::vector<int64_t> peaks;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["step"].get<int64_t>(), expected++);
    for (const char* key : {"epoch", "loss", "lr", "samples_per_s", "backend_peak_bytes"}) {
      EXPECT_TRUE(j.contains(key)) << key;
    }
    (expected == 2 ? first : last) = j["loss"].get<double>();
    peaks.push_back(j.value("backend_peak_bytes", int64_t{0}));
  }
  EXPECT_EQ(expected, 13);
  EXPECT_LT(last, first) << "the loss falls";
  // Memory: at least the weights and their gradients (simple_digits: 64-256-128-10), and
  // after the first step no more: every buffer a step needs exists by then.
  ASSERT_FALSE(peaks.empty());
  EXPECT_GE(peaks.front(), 2 * 4 * (64 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10));
  EXPECT_EQ(peaks.back(), peaks.front()) << "backend memory grew after the first step";
  EXPECT_NE(r.err.find("peak memory held by the backend: "), std::string::npos) << r.err;
  for (const char* part : {"(weights 198.5 KiB, gradients 198.5 KiB, optimizer state ", "activation gradients "}) {
    EXPECT_NE(r.err.find(part), std::string::npos) << part << " in\n" << r.err;  // 50,826 weights, SGD
  }
  // The trained file: same initializer names as the input, new values.
  Result<ImportedModel> original = import_onnx_file(source_path("models/simple_digits.onnx"));
  Result<ImportedModel> trained = import_onnx_file(dir / "t.onnx");
  ASSERT_TRUE(trained.is_ok()) << trained.status().message();
  std::set<std::string> a, b;
  for (const auto& t : original->source->graph().initializer()) a.insert(t.name());
  for (const auto& t : trained->source->graph().initializer()) b.insert(t.name());
  EXPECT_EQ(a, b);
  EXPECT_NE(trained->graph.params[0].data, original->graph.params[0].data);
  // onnxruntime runs it.
  auto ort = run_command("node " + quote(source_path("tests/ort/eval.mjs")) + " " + quote(dir / "t.onnx") + " " +
                         quote(source_path("models/reference/simple_digits.input.npy")) + " " + quote(dir / "out.npy"));
  EXPECT_EQ(ort.exit_code, 0) << ort.err;
}

// Six Linear(32) + ReLU layers at batch 64: by default backward recomputes the ReLUs'
// outputs, which then need two shared buffers instead of six; --keep-activations keeps
// them. Both train the same model, bit for bit.
TEST(TrainCli, KeepActivationsHoldsMoreAndChangesNoBit) {
  ScratchDir dir("keep_activations");
  testing::ModelBuilder b(32);
  std::string x = "input";
  for (int i = 0; i < 6; ++i) x = b.relu(b.linear(x, 32, 32));
  b.output(b.linear(x, 32, 10), 10);
  b.save(dir / "relu6.onnx");
  const int64_t samples = 256;
  std::vector<float> features(samples * 32);
  std::vector<int64_t> labels(samples);
  for (int64_t i = 0; i < samples * 32; ++i) features[i] = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f;
  for (int64_t i = 0; i < samples; ++i) labels[i] = (i * 7) % 10;
  ASSERT_TRUE(write_npy(dir / "x.npy", {samples, 32}, features.data()));
  ASSERT_TRUE(write_npy(dir / "y.npy", {samples}, labels.data()));
  std::vector<int64_t> peaks;
  for (const std::string flag : {"", " --keep-activations"}) {
    const std::string name = flag.empty() ? "recomputed" : "kept";
    auto r =
        run_command(quote(tool_path("train")) + " " + quote(dir / "relu6.onnx") + " --data " + quote(dir / "x.npy") +
                    " --labels " + quote(dir / "y.npy") + " --batch-size 64 --steps 3 --optimizer adam --save " +
                    quote(dir / (name + ".onnx")) + " --metrics " + quote(dir / (name + ".jsonl")) + flag);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::ifstream in(dir / (name + ".jsonl"));
    std::string line, last;
    while (std::getline(in, line)) last = line;
    peaks.push_back(nlohmann::json::parse(last)["backend_peak_bytes"].get<int64_t>());
  }
  EXPECT_EQ(testing::read_text(dir / "recomputed.onnx"), testing::read_text(dir / "kept.onnx"));
  EXPECT_EQ(peaks[1] - peaks[0], (6 - 2) * 64 * 32 * 4) << "four ReLU outputs of 64 x 32 floats";
}

TEST(TrainCli, BatchNormStatisticsFoldedIntoWeightsAreSavedSeparately) {
  // batchnorm_default_stats.onnx reads its running statistics through Identity nodes of
  // the scale and bias; after training they differ and must be saved apart.
  ScratchDir dir("bnsave");
  auto r = run_command(quote(tool_path("train")) + " " + quote(source_path("models/batchnorm_default_stats.onnx")) +
                       " --data " + quote(source_path("models/reference/batchnorm_default_stats.input.npy")) +
                       " --labels " + quote(source_path("models/reference/batchnorm_default_stats.output.npy")) +
                       " --loss mse --batch-size 3 --steps 3 --save " + quote(dir / "t.onnx"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  Result<ImportedModel> trained = import_onnx_file(dir / "t.onnx");
  ASSERT_TRUE(trained.is_ok()) << trained.status().message();
  const Graph& g = trained->graph;
  for (const Node& n : g.nodes) {
    if (n.kind != OpKind::kBatchNorm) continue;
    EXPECT_EQ(g.params[n.running_var].name, "1.running_var");
    EXPECT_NE(g.params[n.running_var].data, g.params[n.weight].data) << "statistics and scale trained apart";
  }
}

struct BadRun {
  std::string name;
  std::string args;      // after the model
  std::string fragment;  // expected in the one stderr line
};

class TrainRefuses : public ::testing::TestWithParam<BadRun> {};

TEST_P(TrainRefuses, WithOneLineAndStatus2) {
  ScratchDir dir("bad");
  auto r = run_command(quote(tool_path("train")) + " " + GetParam().args + " --save " + quote(dir / "out.onnx"));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.err.rfind("train: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(GetParam().fragment), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "out.onnx"));
}

const std::string kModel = quote(source_path("models/simple_digits.onnx"));
const std::string kData = " --data " + quote(source_path("data/digits_features.npy"));
const std::string kLabels = " --labels " + quote(source_path("data/digits_labels.npy"));

INSTANTIATE_TEST_SUITE_P(
    Cases, TrainRefuses,
    ::testing::Values(
        BadRun{"MissingModel", "/nonexistent.onnx" + kData + kLabels, "no such file"},
        BadRun{"MissingData", kModel + " --data /nonexistent.npy" + kLabels, "/nonexistent.npy"},
        BadRun{"WrongWidth", quote(source_path("models/simple.onnx")) + kData + kLabels, "takes [N, 100]"},
        BadRun{"LabelsAsFeatures", kModel + " --data " + quote(source_path("data/digits_labels.npy")) + kLabels,
               "int64"},
        BadRun{"MomentumWithAdam", kModel + kData + kLabels + " --optimizer adam --momentum 0.9", "SGD settings"},
        BadRun{"BetasWithSgd", kModel + kData + kLabels + " --betas 0.9,0.99", "Adam/AdamW settings"},
        BadRun{"BadBetas", kModel + kData + kLabels + " --optimizer adam --betas 0.9", "--betas must be two numbers"},
        BadRun{"NegativeLr", kModel + kData + kLabels + " --lr -1", "--lr must be positive"},
        BadRun{"HugeBatch", kModel + kData + kLabels + " --batch-size 5000", "fewer than one batch of 5000"},
        BadRun{"StepsAndEpochs", kModel + kData + kLabels + " --steps 3 --epochs 2", "excludes"},
        BadRun{"UnknownOptimizer", kModel + kData + kLabels + " --optimizer lamb", "lamb"},
        BadRun{"MseWithIntLabels", kModel + kData + kLabels + " --loss mse", "float32"},
        BadRun{"ResumeWithoutCheckpoint", kModel + kData + kLabels + " --resume /nonexistent", "no checkpoint"},
        BadRun{"PipelineWithoutMpirun", kModel + kData + kLabels + " --stages 2",
               "train: error: --stages 2 needs 2 processes (one per pipeline stage and tensor-parallel shard), and "
               "train runs alone: run it as `mpirun -np 2 train …` (or a multiple of 2 processes, for data-parallel "
               "replicas)\n"},
        BadRun{"TensorParallelWithoutMpirun", kModel + kData + kLabels + " --stages 2 --tensor-parallel 2",
               "--stages 2 --tensor-parallel 2 needs 4 processes (one per pipeline stage and tensor-parallel shard), "
               "and train runs alone: run it as `mpirun -np 4 train …`"},
        // Flags that would do nothing are refused, not ignored.
        BadRun{"ScheduleWithoutStages", kModel + kData + kLabels + " --schedule gpipe",
               "--schedule gpipe has no effect with one pipeline stage (every schedule runs forward then backward "
               "there): give --stages P under mpirun, or drop it"},
        BadRun{"BalanceWithoutStages", kModel + kData + kLabels + " --stages 1 --balance flops",
               "--balance flops has no effect with one pipeline stage (there is no cut between stages to balance)"},
        BadRun{"NegativeCheckEquivalence", kModel + kData + kLabels + " --check-equivalence -3",
               "--check-equivalence takes a positive number of steps"},
        BadRun{"NcclOnTheCpu", kModel + kData + kLabels + " --gpu-comm nccl",
               "--gpu-comm nccl needs --device cuda: the CPU backend's tensors travel over MPI"},
        // Files written at the end of a run are checked before it starts.
        BadRun{"TraceIntoMissingFolder", kModel + kData + kLabels + " --trace /nonexistent/trace.json",
               "--trace '/nonexistent/trace.json': no folder"},
        BadRun{"TraceOntoAFolder", kModel + kData + kLabels + " --trace /tmp", "is a folder"}),
    [](const auto& info) { return info.param.name; });

// A model whose weights hold NaN or inf would train NaN losses: refused before the first
// step, naming the tensor and the element, with no metrics, model or checkpoint written.
TEST(TrainCli, NonFiniteWeightsAreRefusedBeforeTraining) {
  ScratchDir dir("nonfinite_weights");
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    onnx::ModelProto m = testing::load_model("models/simple_digits.onnx");
    testing::set_float_element(testing::initializer_named(m, "0.bias"), 17, bad);
    testing::write_bytes(dir / "bad.onnx", m.SerializeAsString());
    auto r = run_command(quote(tool_path("train")) + " " + quote(dir / "bad.onnx") + kData + kLabels +
                         " --steps 2 --metrics " + quote(dir / "m.jsonl") + " --save " + quote(dir / "t.onnx") +
                         " --checkpoint " + quote(dir / "ck"));
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(r.err, "train: error: " + (dir / "bad.onnx") + ": initializer '0.bias' [256] holds " +
                         (std::isnan(bad) ? "NaN" : "inf") +
                         " at flat index 17; a model's weights must be finite numbers\n");
    for (const char* written : {"m.jsonl", "t.onnx", "ck"})
      EXPECT_FALSE(std::filesystem::exists(dir / written)) << written;
  }
}

// --check-equivalence trains K steps to compare and stops: the outputs it would never write
// and --resume (its one-process run starts from the model file) are refused, each named,
// before any work, and nothing is written.
TEST(TrainCli, CheckEquivalenceRefusesFlagsItWouldIgnore) {
  ScratchDir dir("check_ignored");
  const std::string eval = " --eval-labels " + quote(source_path("data/digits_labels.npy"));
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--save", quote(dir / "t.onnx")},      {"--metrics", quote(dir / "m.jsonl")},
      {"--trace", quote(dir / "trace.json")}, {"--checkpoint", quote(dir / "ck")},
      {"--tensorboard", quote(dir / "tb")},   {"--eval-data", quote(source_path("data/digits_features.npy")) + eval}};
  for (const auto& [flag, value] : cases) {
    SCOPED_TRACE(flag);
    auto r = run_command(train_command("simple_digits.onnx", "--check-equivalence 2 " + flag + " " + value));
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(r.err, "train: error: " + flag +
                         " has no effect with --check-equivalence, which trains K steps to compare the layout with one "
                         "process, writes nothing and stops; drop it or --check-equivalence\n");
    EXPECT_EQ(r.out, "");
  }
  auto r = run_command(train_command("simple_digits.onnx", "--check-equivalence 2 --save " + quote(dir / "t.onnx") +
                                                               " --metrics " + quote(dir / "m.jsonl") + " --trace " +
                                                               quote(dir / "trace.json")));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("train: error: --save, --metrics and --trace have no effect with --check-equivalence"),
            std::string::npos)
      << r.err;
  r = run_command(train_command("simple_digits.onnx", "--check-equivalence 2 --resume " + quote(dir / "ck")));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err,
            "train: error: --resume and --check-equivalence go apart: the check's one-process run starts from the "
            "model file's weights, and the layout must start there too\n");
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "something was written";
}

// --sync-batchnorm on a model without BatchNorm changes nothing: the run goes on, and says so once.
TEST(TrainCli, SyncBatchNormWithoutBatchNormSaysItHasNoEffect) {
  auto r = run_command(train_command("simple_digits.onnx", "--steps 1 --sync-batchnorm"));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::string note = "note: --sync-batchnorm has no effect: the model has no BatchNorm\n";
  ASSERT_NE(r.err.find(note), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(note), r.err.rfind(note)) << r.err;
}

// Data parallelism over a model with BatchNorm: each replica normalises its own slice (PyTorch
// DDP's default), which is not the one-process training; train says so, and that
// --sync-batchnorm makes it equal. With --sync-batchnorm it has nothing to say.
TEST(TrainCli, DataParallelBatchNormSaysStatisticsArePerReplica) {
  ScratchDir dir("bn_replicas");
  // Open MPI refuses root without these; its session folder goes under this test's own
  // TMPDIR (concurrent mpiexec runs can collide in a shared one).
  const std::string mpiexec = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir.path()) +
                              " timeout 120 " + quote(PIPESHARD_MPIEXEC) + " -n 2 --oversubscribe ";
  const std::string run = quote(tool_path("train")) + " " + quote(source_path("models/batchnorm_train.onnx")) +
                          " --data " + quote(source_path("tests/golden/gelu_layernorm/x.npy")) + " --labels " +
                          quote(source_path("tests/golden/gelu_layernorm/y.npy")) + " --batch-size 32 --steps 2";
  const std::string note =
      "note: BatchNorm statistics are per replica: each of the 2 data-parallel replicas normalises its own 16 of the "
      "batch's 32 samples (PyTorch DDP's default too), so the run differs from one process; --sync-batchnorm takes "
      "them over the whole batch and makes it equal to one process\n";
  auto r = run_command(mpiexec + run);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  ASSERT_NE(r.err.find(note), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(note), r.err.rfind(note)) << "said once, by rank 0: " << r.err;
  r = run_command(mpiexec + run + " --sync-batchnorm");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err.find("note: BatchNorm"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("--sync-batchnorm"), std::string::npos) << r.err;
  r = run_command(run);  // one process: its statistics are the whole batch's
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err.find("note: BatchNorm"), std::string::npos) << r.err;
}

// "optimizer state 397.1 KiB" (`key` "optimizer state") in the peak memory line: the
// bytes, as bytes_text wrote them.
double peak_line_bytes(const std::string& err, const std::string& key) {
  const size_t line = err.find("held by the backend");  // the peak line, not the ZeRO note before it
  const size_t at = line == std::string::npos ? line : err.find(key + " ", line);
  if (at == std::string::npos) return -1;
  size_t used = 0;
  const double value = std::stod(err.substr(at + key.size() + 1), &used);
  const std::string unit = err.substr(at + key.size() + 1 + used + 1, 3);
  return value * (unit == "KiB" ? 1024.0 : unit == "MiB" ? 1048576.0 : 1.0);
}

// The backend's peak of the run's first step, from its --metrics file.
double first_step_peak(const std::filesystem::path& metrics) {
  std::ifstream in(metrics);
  std::string line;
  std::getline(in, line);
  return nlohmann::json::parse(line)["backend_peak_bytes"].get<double>();
}

// --zero 1: each of the data-parallel replicas holds the optimizer state of its 1/D of the
// parameters, which the peak memory line shows; rank 0 says so once. Over several small
// buckets, with clipping, the trained model is plain data parallelism's bit for bit (a sum
// of two replicas' gradients is the same sum either way). With one replica it says that
// --zero has nothing to shard; a stage past 2 is refused before any work.
TEST(TrainCli, ZeroShardsTheOptimizerStateAcrossReplicas) {
  ScratchDir dir("zero");
  const std::string mpiexec = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir.path()) +
                              " timeout 120 " + quote(PIPESHARD_MPIEXEC) + " -n 2 --oversubscribe ";
  const std::string run = train_command("simple_digits.onnx", "--optimizer adam --batch-size 64 --steps 3");
  const std::string buckets =
      " --bucket-mb 0.01 --clip-grad-norm 0.05";  // a bucket per layer or two; clipping in every step
  const auto plain = run_command(mpiexec + run + buckets + " --metrics " + quote(dir / "plain.jsonl") + " --save " +
                                 quote(dir / "plain.onnx"));
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const auto zero = run_command(mpiexec + run + buckets + " --zero 1 --metrics " + quote(dir / "zero.jsonl") +
                                " --save " + quote(dir / "zero.onnx"));
  ASSERT_EQ(zero.exit_code, 0) << zero.err;
  EXPECT_EQ(testing::read_text(dir / "zero.onnx"), testing::read_text(dir / "plain.onnx"));
  const std::string note =
      "note: ZeRO stage 1: each of the 2 data-parallel replicas holds the optimizer state of 1/2 of the parameters";
  ASSERT_NE(zero.err.find(note), std::string::npos) << zero.err;
  EXPECT_EQ(zero.err.find(note), zero.err.rfind(note)) << "said once, by rank 0: " << zero.err;
  // Adam's two slots of 50,826 parameters: 397.1 KiB on each replica, half of it under ZeRO
  // (the tails of the buckets, under D elements each, are on both).
  const double whole = peak_line_bytes(plain.err, "optimizer state"),
               half = peak_line_bytes(zero.err, "optimizer state");
  EXPECT_NEAR(whole, 50826 * 8, 0.001 * whole) << plain.err;
  EXPECT_NEAR(half, whole / 2, 0.001 * whole) << zero.err;
  // The backend's peak: 16 bytes a parameter (weights, gradients, two slots) become
  // 4 + 4 + 8 / 2: the gradients are reduce-scattered in place.
  EXPECT_NEAR(first_step_peak(dir / "plain.jsonl") - first_step_peak(dir / "zero.jsonl"), 50826 * 4, 1024)
      << plain.err << zero.err;
  const auto alone = run_command(run + " --zero 1");
  EXPECT_EQ(alone.exit_code, 0) << alone.err;
  EXPECT_NE(alone.err.find("note: --zero 1 has nothing to shard with one data-parallel replica"), std::string::npos)
      << alone.err;
  const auto stage3 = run_command(run + " --zero 3 --save " + quote(dir / "never.onnx"));
  EXPECT_EQ(stage3.exit_code, 2);
  EXPECT_NE(stage3.err.find("--zero: the ZeRO stage must be 0, 1 or 2, not 3"), std::string::npos) << stage3.err;
  EXPECT_FALSE(std::filesystem::exists(dir / "never.onnx"));
}

// --zero 2 on an MLP of seven Linears in buckets of one 128 x 128 layer (16,512 floats;
// the first bucket also holds the last layer): the gradients live in two windows, the
// size of the buckets in them, and this replica's 1/D of them, so gradient and optimizer
// bytes per rank go as 1/D (measured by the backend, against the formula), and the model
// is plain data parallelism's bit for bit at D = 2. With accumulation every backward pass
// is reduced, and the run is still the one-process training. Where it cannot save (a
// schedule that splits backward; buckets too few), it runs as stage 1 and says why.
TEST(TrainCli, ZeroTwoShardsTheGradientsToo) {
  ScratchDir dir("zero2");
  testing::ModelBuilder b(64);
  std::string x = b.relu(b.linear("input", 64, 128));
  for (int i = 0; i < 5; ++i) x = b.relu(b.linear(x, 128, 128));
  b.output(b.linear(x, 128, 10), 10);
  b.save(dir / "deep.onnx");
  const int64_t params = 64 * 128 + 128 + 5 * (128 * 128 + 128) + 128 * 10 + 10, layer = 128 * 128 + 128;
  const auto mpiexec = [&](int np) {
    return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir.path()) + " timeout 120 " +
           quote(PIPESHARD_MPIEXEC) + " -n " + std::to_string(np) + " --oversubscribe ";
  };
  const std::string run = quote(tool_path("train")) + " " + quote(dir / "deep.onnx") + " --data " +
                          quote(source_path("data/digits_features.npy")) + " --labels " +
                          quote(source_path("data/digits_labels.npy")) +
                          " --optimizer adamw --batch-size 64 --steps 3 --clip-grad-norm 0.05";
  const std::string layers = " --bucket-mb 0.06298828125";  // 16,512 floats
  const auto train = [&](int np, const std::string& name, const std::string& flags) {
    const auto r = run_command(mpiexec(np) + run + " " + flags + " --metrics " + quote(dir / (name + ".jsonl")) +
                               " --save " + quote(dir / (name + ".onnx")));
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r;
  };
  const auto plain = train(2, "plain", layers);
  const auto zero = train(2, "zero", "--zero 2" + layers);
  EXPECT_TRUE(testing::read_text(dir / "zero.onnx") == testing::read_text(dir / "plain.onnx")) << "the same bits";
  EXPECT_NE(zero.err.find("note: ZeRO stage 2: each of the 2 data-parallel replicas holds the optimizer state and "
                          "reduced gradients of 1/2 of the parameters"),
            std::string::npos)
      << zero.err;
  train(4, "plain4", layers);
  const auto zero4 = train(4, "zero4", "--zero 2" + layers);
  const double grads = peak_line_bytes(plain.err, "gradients"), state = peak_line_bytes(plain.err, "optimizer state");
  EXPECT_NEAR(grads, params * 4, 0.001 * grads) << plain.err;
  EXPECT_NEAR(state, params * 8, 0.001 * state) << plain.err;
  for (const auto& [d, r, name] : {std::tuple{2, zero, ""}, std::tuple{4, zero4, "4"}}) {
    // 1/D of the gradients and of AdamW's two slots (tails under D elements a bucket are on
    // every replica), and the two windows: buckets 0, 2, 4 and 1, 3, 5.
    const double windows = (128 * 10 + 10 + 2.0 * layer) * 4;
    EXPECT_NEAR(peak_line_bytes(r.err, "optimizer state"), state / d, 0.001 * state) << r.err;
    EXPECT_NEAR(peak_line_bytes(r.err, "gradients"), grads / d + windows, 0.001 * grads) << r.err;
    // The backend's peak falls by what the line says, the rest staying the same.
    EXPECT_NEAR(first_step_peak(dir / ("plain" + std::string(name) + ".jsonl")) -
                    first_step_peak(dir / ("zero" + std::string(name) + ".jsonl")),
                grads + state - (grads / d + windows) - state / d, 0.002 * (grads + state))
        << r.err;
  }
  // Accumulation: each of the 2 backward passes is reduced; the same training as one process.
  const auto accum = run_command(mpiexec(2) + run + layers + " --zero 2 --grad-accum 2 --check-equivalence 3");
  EXPECT_EQ(accum.exit_code, 0) << accum.err;
  EXPECT_NE(accum.out.find("equivalent: the layout computes the one-process training"), std::string::npos)
      << accum.out << accum.err;
  EXPECT_NE(accum.err.find("note: ZeRO stage 2 reduces each of the 2 backward passes of a step as it ends"),
            std::string::npos)
      << accum.err;
  const auto split = train(4, "split", "--zero 2 --stages 2 --micro-batches 2 --schedule zb-h1" + layers);
  EXPECT_NE(split.err.find("note: --zero 2 runs as stage 1 here: schedule 'zb-h1' splits backward into I and W passes"),
            std::string::npos)
      << split.err;
  const auto few = train(2, "few", "--zero 2 --bucket-mb 25");
  EXPECT_NE(few.err.find("note: --zero 2 runs as stage 1 here: the gradient buckets are so few and large"),
            std::string::npos)
      << few.err;
  EXPECT_TRUE(testing::read_text(dir / "few.onnx") == testing::read_text(dir / "plain.onnx")) << "the same bits";
}

// A regression model (one output) with integer labels under the default cross-entropy:
// a label outside its one class says what a regression needs, and labels that all fit
// (0) are refused too, since cross-entropy over one output is 0 whatever the weights.
TEST(TrainCli, OneOutputModelWithClassLabelsIsToldToUseMse) {
  ScratchDir dir("regression");
  testing::ModelBuilder b(4);
  b.output(b.linear(b.relu(b.linear("input", 4, 8)), 8, 1), 1);
  b.save(dir / "regressor.onnx");
  const int64_t samples = 64;
  std::vector<float> x(samples * 4), targets(samples);
  std::vector<int64_t> labels(samples, 0);
  for (int64_t i = 0; i < samples * 4; ++i) x[i] = static_cast<float>(i % 7) - 3.0f;
  for (int64_t i = 0; i < samples; ++i) targets[i] = static_cast<float>(i % 5) - 2.0f;
  ASSERT_TRUE(write_npy(dir / "x.npy", {samples, 4}, x.data()));
  ASSERT_TRUE(write_npy(dir / "zeros.npy", {samples}, labels.data()));
  labels[3] = -1;
  ASSERT_TRUE(write_npy(dir / "ints.npy", {samples}, labels.data()));
  ASSERT_TRUE(write_npy(dir / "y.npy", {samples, 1}, targets.data()));
  const auto train = [&](const std::string& labels_file, const std::string& flags) {
    return run_command(quote(tool_path("train")) + " " + quote(dir / "regressor.onnx") + " --data " +
                       quote(dir / "x.npy") + " --labels " + quote(dir / labels_file) + " --steps 2 --save " +
                       quote(dir / "t.onnx") + flags);
  };
  auto r = train("ints.npy", "");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err, "train: error: " + (dir / "ints.npy") +
                       ": label -1 at row 3 is outside the model's 1 class [0, 0]; a model with one output is a "
                       "regression model: train it on float32 targets with the mean-squared-error loss (--loss mse)\n");
  r = train("zeros.npy", "");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err,
            "train: error: --loss: cross-entropy over the model's one output is 0 whatever the weights: a model with "
            "one output is a regression model; train it on float32 targets with the mean-squared-error loss\n");
  EXPECT_FALSE(std::filesystem::exists(dir / "t.onnx"));
  r = train("y.npy", " --loss mse");  // what the messages ask for
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dir / "t.onnx"));
}

// train meets a Conv1d model (as torch.onnx.export writes it) at its convolution.
TEST(TrainCli, Conv1dModelIsRefusedAtTheConvolution) {
  ScratchDir dir("conv1d");
  testing::write_bytes(dir / "conv1d.onnx", testing::conv1d_model().SerializeAsString());
  const int64_t samples = 64;
  std::vector<float> x(samples * 16, 0.5f);
  std::vector<int64_t> y(samples, 1);
  ASSERT_TRUE(write_npy(dir / "x.npy", {samples, 16}, x.data()));
  ASSERT_TRUE(write_npy(dir / "y.npy", {samples}, y.data()));
  auto r = run_command(quote(tool_path("train")) + " " + quote(dir / "conv1d.onnx") + " --data " +
                       quote(dir / "x.npy") + " --labels " + quote(dir / "y.npy") + " --steps 1");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err.rfind("train: error: " + (dir / "conv1d.onnx") +
                            ": node '/conv/Conv' (Conv): a convolution, which pipeshard does not train; ",
                        0),
            0u)
      << r.err;
  EXPECT_EQ(r.err.find("Unsqueeze"), std::string::npos) << r.err;
}

// --save is checked before the first step too: a typo never costs a finished run.
TEST(TrainCli, SaveIntoAMissingFolderIsRefusedBeforeTraining) {
  auto r =
      run_command(quote(tool_path("train")) + " " + kModel + kData + kLabels + " --steps 1 --save /nonexistent/x.onnx");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err, "train: error: --save '/nonexistent/x.onnx': no folder '/nonexistent'\n");
}

// A folder that takes no files (/sys, where even root creates none) is refused for every
// output before the first step, with the file system's reason, and so is partition's --out.
TEST(TrainCli, OutputsIntoAFolderThatTakesNoFilesAreRefusedBeforeTraining) {
  if (std::ofstream("/sys/.pipeshard-probe")) GTEST_SKIP() << "/sys takes files on this machine";
  const std::vector<std::pair<std::string, std::string>> outputs = {
      {"--save", "/sys/x.onnx"}, {"--trace", "/sys/trace.json"}, {"--checkpoint", "/sys/checkpoints"}};
  for (const auto& [flag, path] : outputs) {
    SCOPED_TRACE(flag);
    auto r =
        run_command(quote(tool_path("train")) + " " + kModel + kData + kLabels + " --steps 1 " + flag + " " + path);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(r.err.rfind("train: error: " + flag, 0), 0u) << r.err;
    EXPECT_NE(r.err.find("cannot create files in '/sys' ("), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.out.find("step 1"), std::string::npos) << r.out;
  }
  auto r = run_command(quote(tool_path("partition")) + " " + quote(source_path("models/simple.onnx")) +
                       " --stages 2 --out /sys/stages");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err.rfind("partition: error: --out: output folder '/sys/stages' cannot be used: cannot create files in "
                        "'/sys' (",
                        0),
            0u)
      << r.err;
}

// --device cuda on a machine without a usable GPU (here cudaGetDeviceCount fails with
// error 35, not 0) or from a build without the CUDA backend is one line naming why,
// status 2, and no file written; on a machine with a GPU the same command trains, and
// the test says it skipped.
TEST(TrainCli, DeviceCudaWithoutAUsableGpuIsOneClearError) {
  ScratchDir dir("train_cli_no_gpu");
  const std::string saved = dir / "trained.onnx";
  auto r = run_command(train_command("simple_digits.onnx", "--device cuda --steps 1 --save " + quote(saved)));
  if (r.exit_code == 0) GTEST_SKIP() << "this machine has a usable GPU: train --device cuda trained";
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err.rfind("train: error: --device cuda: no usable GPU (", 0), 0u) << r.err;
  // Why: the driver's answer where the build has the CUDA backend, else that it has none
  // (a build without the toolkit, such as the sanitizer's).
  EXPECT_TRUE(r.err.find("(cudaGetDeviceCount: error ") != std::string::npos ||
              r.err.find("(this build has no CUDA backend") != std::string::npos)
      << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_FALSE(std::filesystem::exists(saved));
}

// A damaged checkpoint is refused by --resume before any training, with one line naming
// the damaged part (checkpoint_file_test covers every part).
TEST(TrainCli, ResumeRefusesADamagedCheckpoint) {
  ScratchDir dir("damaged");
  auto first = run_command(train_command("simple_digits.onnx", "--steps 2 --checkpoint " + quote(dir / "ck")));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  const std::string file = dir / "ck/checkpoint.pipeshard";
  std::string bytes = testing::read_text(file);
  bytes[bytes.size() - 5] ^= 0x10;  // in the last tensor
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  auto r = run_command(train_command("simple_digits.onnx",
                                     "--steps 4 --resume " + quote(dir / "ck") + " --save " + quote(dir / "out.onnx")));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_EQ(r.err, "train: error: " + file + ": corrupt checkpoint: tensor '4.bias' (value) fails its CRC-32C check\n");
  EXPECT_FALSE(std::filesystem::exists(dir / "out.onnx"));
}

TEST(TrainCli, HelpExitsZero) {
  auto r = run_command(quote(tool_path("train")) + " --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("--grad-accum"), std::string::npos);
  EXPECT_NE(r.out.find("--gpu-comm"), std::string::npos);
}

}  // namespace
}  // namespace pipeshard
