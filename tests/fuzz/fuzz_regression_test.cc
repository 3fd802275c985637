// Replays the fuzz targets' inputs through the code they drive (fuzz/fuzz_inputs.h), in
// every build: fuzz/regressions/<target>/ holds each input a fuzzer found to crash, hang,
// leak or exhaust memory (minimised, named after the bug; fuzz/README.md lists them), and
// fuzz/corpus/<target>/ the seeds and what fuzzing added to them. Every input must come back
// with a Status, and a refusal must name the file ("fuzz.onnx: ...", "fuzz.npy: ..." or
// "fuzz.pipeshard: ...").
// Under the sanitizers (the fuzz build) scripts/fuzz_replay.sh replays the same inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "fuzz/fuzz_inputs.h"
#include "tests/test_util.h"

namespace pipeshard::testing {
namespace {

namespace fs = std::filesystem;

// The files in `rel` (under the source tree), sorted; README files are not inputs. A
// missing folder is a failure (git keeps no empty folders: each holds a README.md).
std::vector<std::string> inputs_in(const std::string& rel) {
  std::vector<std::string> files;
  EXPECT_TRUE(fs::is_directory(source_path(rel))) << rel;
  if (!fs::is_directory(source_path(rel))) return files;
  for (const auto& e : fs::directory_iterator(source_path(rel))) {
    if (e.is_regular_file() && e.path().filename() != "README.md") files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Refusals must name the file, as the tools print them.
::testing::AssertionResult names_the_file(const Status& s, const std::string& label) {
  if (s.is_ok() || s.message().rfind(label + ": ", 0) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "the refusal does not start with '" << label << ": ': " << s.message();
}

Status replay_onnx(const std::string& path) { return fuzz::run_onnx_input(read_text(path), source_path("models")); }

Status replay_npy(const std::string& path) { return fuzz::run_npy_input(read_text(path)); }

Status replay_checkpoint(const std::string& path) { return fuzz::run_checkpoint_input(read_text(path)); }

TEST(FuzzRegression, OnnxFindings) {
  const std::vector<std::string> files = inputs_in("fuzz/regressions/onnx");
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    EXPECT_TRUE(names_the_file(replay_onnx(path), "fuzz.onnx"));
  }
}

TEST(FuzzRegression, NpyFindings) {
  const std::vector<std::string> files = inputs_in("fuzz/regressions/npy");
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    EXPECT_TRUE(names_the_file(replay_npy(path), "fuzz.npy"));
  }
}

TEST(FuzzRegression, CheckpointFindings) {
  const std::vector<std::string> files = inputs_in("fuzz/regressions/checkpoint");
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    EXPECT_TRUE(names_the_file(replay_checkpoint(path), "fuzz.pipeshard"));
  }
}

// The corpus holds the bundled models under their own names, which must import, and inputs
// libFuzzer found (named by their SHA-1), which need only come back.
TEST(FuzzRegression, OnnxCorpus) {
  const std::vector<std::string> files = inputs_in("fuzz/corpus/onnx");
  EXPECT_FALSE(files.empty());
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    const Status s = replay_onnx(path);
    if (fs::path(path).extension() == ".onnx") {
      EXPECT_TRUE(s.is_ok()) << s.message();
    } else {
      EXPECT_TRUE(names_the_file(s, "fuzz.onnx"));
    }
  }
}

TEST(FuzzRegression, NpyCorpus) {
  const std::vector<std::string> files = inputs_in("fuzz/corpus/npy");
  EXPECT_FALSE(files.empty());
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    EXPECT_TRUE(names_the_file(replay_npy(path), "fuzz.npy"));
  }
}

// The checkpoint corpus holds what make_checkpoint_seeds wrote: checkpoints the trainers
// saved (*.pipeshard), which some trainer must take, and damaged copies (*.damaged); and
// inputs libFuzzer found (named by their SHA-1). Those need only come back.
TEST(FuzzRegression, CheckpointCorpus) {
  const std::vector<std::string> files = inputs_in("fuzz/corpus/checkpoint");
  EXPECT_FALSE(files.empty());
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    const Status s = replay_checkpoint(path);
    if (fs::path(path).extension() == ".pipeshard") {
      EXPECT_TRUE(s.is_ok()) << s.message();
    } else {
      EXPECT_TRUE(names_the_file(s, "fuzz.pipeshard"));
    }
  }
}

}  // namespace
}  // namespace pipeshard::testing
