// train --check-equivalence under mpiexec: what it allows (float rounding, and Adam's step
// bound for tensors whose gradient is rounding noise), what it still refuses, and how it
// says which tensor differs (exit status 0 or 1).
#include <regex>
#include <string>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::quote;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

// batchnorm_train.onnx (Linear 16→32 with bias '0.bias', BatchNorm '1', ReLU, Linear '3')
// under two data-parallel replicas with AdamW for 4 steps, plus `flags`.
testing::CommandResult check_batchnorm_adamw(const ScratchDir& dir, const std::string& flags) {
  // Open MPI refuses root without these; its session folder goes under this test's own
  // TMPDIR (concurrent mpiexec runs can collide in a shared one).
  const std::string env = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir.path()) + " ";
  return run_command(env + "timeout 120 " + quote(PIPESHARD_MPIEXEC) + " -n 2 --oversubscribe " +
                     quote(tool_path("train")) + " " + quote(source_path("models/batchnorm_train.onnx")) + " --data " +
                     quote(source_path("tests/golden/gelu_layernorm/x.npy")) + " --labels " +
                     quote(source_path("tests/golden/gelu_layernorm/y.npy")) +
                     " --batch-size 32 --optimizer adamw --check-equivalence 4 " + flags);
}

// The bias before BatchNorm has a gradient of exactly 0, computed as ~1e-8: AdamW turns
// that noise into steps of up to lr, in directions that differ between the layout and one
// process. With --sync-batchnorm the run is the one-process training, and the check says
// so, naming the bias and the running mean it feeds as held to AdamW's step bound.
TEST(CheckEquivalence, AdamWithABiasBeforeBatchNormIsEquivalent) {
  ScratchDir dir("equivalence-sync");
  const auto r = check_batchnorm_adamw(dir, "--sync-batchnorm");
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("equivalent: the layout computes the one-process training"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("gradients at float-rounding level (at most 1e-05 of the model's largest in every step): "
                       "'0.bias' (gradient up to "),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("the running means they feed ('1.running_mean')"), std::string::npos) << r.out;
  // The allowance is twice AdamW's step bound over 4 steps at lr 0.001: about 8e-3.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("step bound over the run, ([0-9.e+-]+) \\(largest difference ")))
      << r.out;
  EXPECT_NEAR(std::stod(m[1]), 8.0e-3, 0.1e-3);
}

// Without --sync-batchnorm each replica normalises its own half of the batch: a different
// training, which the allowance for the noisy bias must not excuse. The check fails with
// exit status 1 and names the step whose loss differs and the tensor that differs most.
TEST(CheckEquivalence, AGenuinelyDifferentRunFailsNamingTheTensor) {
  ScratchDir dir("equivalence-nosync");
  const auto r = check_batchnorm_adamw(dir, "");
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m,
                                std::regex("NOT equivalent beyond float rounding \\(1e-05\\): the loss of step [1-4] "
                                           "differs by [0-9.e+-]+ \\(relative\\); '([^']+)' differs by ([0-9.e+-]+) "
                                           "\\(([0-9.e+-]+) allowed")))
      << r.out;
  EXPECT_GT(std::stod(m[2]), std::stod(m[3])) << "the named tensor differs by more than it may";
  EXPECT_EQ(r.out.find("equivalent: the layout"), std::string::npos) << r.out;
  // Which train says before it starts.
  EXPECT_NE(r.err.find("note: BatchNorm statistics are per replica: "), std::string::npos) << r.err;
}

}  // namespace
}  // namespace pipeshard
