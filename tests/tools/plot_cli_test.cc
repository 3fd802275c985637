// partition --chart and train --plot: real pictures of the bundled models drawn by
// matplotlib (well-formed SVG holding the title and axis labels, complete PNG), and a
// picture that cannot be drawn refused before any work with one line and exit status 2.
// The pictures need Debian's python3-matplotlib (scripts/install-deps.sh installs it);
// without it these tests skip, saying so.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::quote;
using testing::read_text;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

namespace fs = std::filesystem;

// The tools draw with /usr/bin/python3 unless PIPESHARD_PYTHON says otherwise; the
// tests use that default whatever the caller's environment says.
const char* kDefaultPython = "env -u PIPESHARD_PYTHON ";

bool matplotlib_available() { return run_command("/usr/bin/python3 -c 'import matplotlib'").exit_code == 0; }

#define SKIP_WITHOUT_MATPLOTLIB()                                                                \
  if (!matplotlib_available()) {                                                                 \
    GTEST_SKIP() << "/usr/bin/python3 cannot import matplotlib (install python3-matplotlib, as " \
                    "scripts/install-deps.sh does)";                                             \
  }

// Whether `text` is well-formed XML as far as elements go: every start tag has its end
// tag, properly nested, under one root. Enough to tell a whole SVG from a cut-off one.
::testing::AssertionResult WellFormedXml(const std::string& text) {
  std::vector<std::string> open;
  int roots = 0;
  size_t i = 0;
  while ((i = text.find('<', i)) != std::string::npos) {
    if (text.compare(i, 4, "<!--") == 0) {
      i = text.find("-->", i);
      if (i == std::string::npos) return ::testing::AssertionFailure() << "unterminated comment";
      continue;
    }
    const size_t end = text.find('>', i);
    if (end == std::string::npos) return ::testing::AssertionFailure() << "unterminated tag at " << i;
    const std::string tag = text.substr(i + 1, end - i - 1);
    i = end + 1;
    if (tag.empty() || tag[0] == '?' || tag[0] == '!') continue;  // declaration, DOCTYPE
    if (tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name) {
        return ::testing::AssertionFailure() << "</" << name << "> closes " << (open.empty() ? "nothing" : open.back());
      }
      open.pop_back();
      continue;
    }
    if (open.empty()) ++roots;
    if (tag.back() != '/') open.push_back(tag.substr(0, tag.find_first_of(" \t\n")));
  }
  if (!open.empty()) return ::testing::AssertionFailure() << "<" << open.back() << "> is never closed";
  if (roots != 1) return ::testing::AssertionFailure() << roots << " root elements";
  return ::testing::AssertionSuccess();
}

void ExpectSvgWithTexts(const std::string& path, const std::vector<std::string>& texts) {
  const std::string svg = read_text(path);
  ASSERT_FALSE(svg.empty()) << path;
  EXPECT_TRUE(svg.rfind("<?xml", 0) == 0 || svg.rfind("<svg", 0) == 0) << svg.substr(0, 80);
  EXPECT_NE(svg.find("<svg"), std::string::npos);
  EXPECT_TRUE(WellFormedXml(svg));
  for (const std::string& t : texts) EXPECT_NE(svg.find(">" + t + "<"), std::string::npos) << "no text '" << t << "'";
}

void ExpectPng(const std::string& path) {
  const std::string png = read_text(path);
  ASSERT_GT(png.size(), 1000u) << path;
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(png.substr(png.size() - 8, 4), "IEND") << "complete up to the last chunk";
}

// The folder holds exactly `names`: no temporary file left behind.
void ExpectOnlyFiles(const ScratchDir& dir, std::vector<std::string> names) {
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(dir.path())) found.push_back(e.path().filename().string());
  std::sort(found.begin(), found.end());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(found, names);
}

std::string partition_command(const std::string& model, const std::string& flags) {
  return kDefaultPython + quote(tool_path("partition")) + " " + quote(source_path("models/" + model)) + " " + flags;
}

// The digits model on the training split, evaluated on the test split after each epoch.
std::string digits_flags() {
  return quote(source_path("models/simple_digits.onnx")) + " --data " +
         quote(source_path("data/digits_train_features.npy")) + " --labels " +
         quote(source_path("data/digits_train_labels.npy")) + " --eval-data " +
         quote(source_path("data/digits_test_features.npy")) + " --eval-labels " +
         quote(source_path("data/digits_test_labels.npy"));
}

TEST(PartitionChart, SvgShowsParametersMemoryAndBalance) {
  SKIP_WITHOUT_MATPLOTLIB();
  ScratchDir out("chart-out"), pictures("chart");
  auto r = run_command(partition_command(
      "simple.onnx", "--stages 2 --out " + quote(out.path()) + " --chart " + quote(pictures / "simple.svg")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("wrote the chart to " + pictures / "simple.svg"), std::string::npos) << r.out;
  ExpectSvgWithTexts(pictures / "simple.svg",
                     {"simple.onnx: 60,042 parameters", "2 pipeline stages, balanced by params", "pipeline stage",
                      "trainable parameters (thousands)", "estimated memory per rank (KiB)", "25,856", "34,186",
                      "balance: largest / mean stage params = 1.139"});
  ExpectOnlyFiles(pictures, {"simple.svg"});
}

TEST(PartitionChart, PngOfATensorParallelLayout) {
  SKIP_WITHOUT_MATPLOTLIB();
  ScratchDir out("chart-out"), pictures("chart");
  auto r = run_command(partition_command(
      "pipeline_parallel.onnx",
      "--stages 2 --tensor-parallel 2 --json --out " + quote(out.path()) + " --chart " + quote(pictures / "pp.png")));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("wrote the chart"), std::string::npos) << "--json keeps stdout JSON";
  ExpectPng(pictures / "pp.png");
  ExpectOnlyFiles(pictures, {"pp.png"});
}

TEST(TrainPlot, SvgShowsLossPerStepAndAccuracyPerEpoch) {
  SKIP_WITHOUT_MATPLOTLIB();
  ScratchDir dir("plot");
  auto r = run_command(kDefaultPython + quote(tool_path("train")) + " " + digits_flags() +
                       " --epochs 3 --batch-size 64 --lr 0.05 --momentum 0.9 --plot " + quote(dir / "run.svg"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // The legend quotes the last epoch's accuracy, which train also printed.
  std::string accuracy;
  const std::regex printed("eval accuracy ([0-9.]+)%");
  for (auto it = std::sregex_iterator(r.err.begin(), r.err.end(), printed); it != std::sregex_iterator(); ++it) {
    accuracy = (*it)[1];
  }
  ASSERT_FALSE(accuracy.empty()) << r.err;
  ExpectSvgWithTexts(dir / "run.svg", {"simple_digits.onnx: training with sgd, batch 64, 1 process", "optimizer step",
                                       "epochs completed", "cross-entropy loss (nats)", "eval accuracy (%)",
                                       "eval accuracy per epoch (last " + accuracy + "%)"});
  EXPECT_NE(r.err.find("wrote " + dir / "run.svg"), std::string::npos) << r.err;
  ExpectOnlyFiles(dir, {"run.svg"});
}

TEST(TrainPlot, PngWithoutEvaluation) {
  SKIP_WITHOUT_MATPLOTLIB();
  ScratchDir dir("plot");
  auto r =
      run_command(kDefaultPython + quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) +
                  " --data " + quote(source_path("data/digits_features.npy")) + " --labels " +
                  quote(source_path("data/digits_labels.npy")) + " --steps 5 --plot " + quote(dir / "run.png"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ExpectPng(dir / "run.png");
}

TEST(TrainPlot, RankZeroDrawsAPipelinedRun) {
  SKIP_WITHOUT_MATPLOTLIB();
  ScratchDir dir("plot-mpi");
  // Open MPI refuses root without these; its session folder goes under this test's own
  // TMPDIR (concurrent mpiexec runs can collide in a shared one).
  const std::string env = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir.path()) + " ";
  auto r = run_command(kDefaultPython + env + quote(PIPESHARD_MPIEXEC) + " -n 2 --oversubscribe " +
                       quote(tool_path("train")) + " " + digits_flags() +
                       " --epochs 2 --batch-size 64 --stages 2 --micro-batches 2 --plot " + quote(dir / "run.svg"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ExpectSvgWithTexts(dir / "run.svg", {"simple_digits.onnx: training with sgd, batch 64",
                                       "2 processes: 2 pipeline stages (1f1b, 2 micro-batches)", "eval accuracy (%)"});
}

// A picture that cannot be drawn is a bad flag: one line, status 2, before any work.
struct BadPicture {
  std::string name;
  std::string env;     // before the command
  std::string target;  // the picture's path, relative to the scratch folder
  std::string fragment;
};

class PicturesRefused : public ::testing::TestWithParam<BadPicture> {};

void ExpectOneLineRefusal(const testing::CommandResult& r, const std::string& prefix, const std::string& fragment) {
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.err.rfind(prefix, 0), 0u) << r.err;
  EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
}

// A Python that runs but has no matplotlib: Debian's, without its site packages.
std::string python_without_matplotlib(const ScratchDir& dir) {
  const std::string path = dir / "python-without-matplotlib";
  std::ofstream(path) << "#!/bin/sh\nexec /usr/bin/python3 -S \"$@\"\n";
  fs::permissions(path, fs::perms::owner_all);
  return path;
}

std::string environment(const BadPicture& c, const ScratchDir& dir) {
  if (c.env == "no-python") return "PIPESHARD_PYTHON=" + quote(dir / "no/python3") + " ";
  if (c.env == "no-matplotlib") return "PIPESHARD_PYTHON=" + quote(python_without_matplotlib(dir)) + " ";
  return kDefaultPython;
}

TEST_P(PicturesRefused, ByPartition) {
  const BadPicture& c = GetParam();
  if (c.env != "no-python") SKIP_WITHOUT_MATPLOTLIB();
  ScratchDir dir("bad-chart");
  std::ofstream(dir / "a-file") << "not a folder";
  auto r =
      run_command(environment(c, dir) + quote(tool_path("partition")) + " " + quote(source_path("models/simple.onnx")) +
                  " --stages 2 --out " + quote(dir / "stages") + " --chart " + quote(dir / c.target));
  ExpectOneLineRefusal(r, "partition: error: --chart: ", c.fragment);
  EXPECT_FALSE(fs::exists(dir / "stages")) << "refused before any work";
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST_P(PicturesRefused, ByTrain) {
  const BadPicture& c = GetParam();
  if (c.env != "no-python") SKIP_WITHOUT_MATPLOTLIB();
  ScratchDir dir("bad-plot");
  std::ofstream(dir / "a-file") << "not a folder";
  auto r = run_command(environment(c, dir) + quote(tool_path("train")) + " " +
                       quote(source_path("models/simple_digits.onnx")) + " --data " +
                       quote(source_path("data/digits_features.npy")) + " --labels " +
                       quote(source_path("data/digits_labels.npy")) + " --steps 2 --metrics " + quote(dir / "m.jsonl") +
                       " --save " + quote(dir / "t.onnx") + " --plot " + quote(dir / c.target));
  ExpectOneLineRefusal(r, "train: error: --plot: ", c.fragment);
  EXPECT_FALSE(fs::exists(dir / "m.jsonl")) << "refused before any work";
  EXPECT_FALSE(fs::exists(dir / "t.onnx"));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PicturesRefused,
    ::testing::Values(BadPicture{"WrongExtension", "", "picture.pdf", "must end in .svg or .png"},
                      BadPicture{"NoExtension", "", "picture", "must end in .svg or .png"},
                      BadPicture{"MissingFolder", "", "missing/picture.svg", "folder '"},
                      BadPicture{"FolderIsAFile", "", "a-file/picture.png", "is not a folder"},
                      BadPicture{"NoInterpreter", "no-python", "picture.svg", "cannot run the plotting interpreter"},
                      BadPicture{"NoMatplotlib", "no-matplotlib", "picture.svg", "cannot import matplotlib"}),
    [](const auto& info) { return info.param.name; });

TEST(TrainPlot, NotWithCheckEquivalence) {
  auto r = run_command(quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) + " --data " +
                       quote(source_path("data/digits_features.npy")) + " --labels " +
                       quote(source_path("data/digits_labels.npy")) + " --check-equivalence 2 --plot x.svg");
  ExpectOneLineRefusal(r, "train: error: ", "--check-equivalence excludes --plot");
}

}  // namespace
}  // namespace pipeshard
