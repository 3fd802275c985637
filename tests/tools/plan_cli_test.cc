// partition --plan and the profile tool from the command line: a profile measured under
// mpiexec and read back by the planner, the plan's --json, layouts read back from it that
// train runs, and bad input refused with one line and exit status 2 before any work. No
// timing is asserted.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <tuple>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::quote;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

std::string partition(const std::string& args) {
  return quote(tool_path("partition")) + " " + quote(source_path("models/simple_digits.onnx")) + " " + args;
}

std::string mpiexec(const ScratchDir& dir, int n) {
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir.path()) + " timeout 120 " +
         quote(PIPESHARD_MPIEXEC) + " -n " + std::to_string(n) + " --oversubscribe ";
}

// The measured profile of two processes feeds the planner, whose layouts train runs: one
// of every (D, P, T, schedule) the plan lists, the planner's first choice among them.
TEST(PlanCli, AMeasuredProfilePlansLayoutsThatTrainRuns) {
  ScratchDir dir("plan");
  const std::string profile = (dir / "profile.json");
  auto r = run_command(mpiexec(dir, 2) + quote(tool_path("profile")) + " " +
                       quote(source_path("models/simple_digits.onnx")) + " --batch-size 64 --seconds 0.002 --out " +
                       quote(profile));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("profile: wrote"), std::string::npos) << r.err;

  r = run_command(partition("--plan --ranks 2 --batch-size 64 --profile " + quote(profile) + " --json"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json plan = nlohmann::json::parse(r.out);
  const auto& layouts = plan["layouts"];
  ASSERT_FALSE(layouts.empty());
  double previous = 0;
  for (const auto& l : layouts) {
    const double ms = l["predicted"]["step_ms"].get<double>();
    EXPECT_GE(ms, previous) << l["text"] << ": fastest first";
    previous = ms;
    EXPECT_GT(l["peak_bytes"].get<int64_t>(), 0) << l["text"];
  }
  EXPECT_NE(plan["profile_machine"].get<std::string>().find("2 processes"), std::string::npos);

  std::set<std::tuple<int, int, int, std::string, int>> tried;
  for (const auto& l : layouts) {
    const auto key = std::make_tuple(l["replicas"].get<int>(), l["stages"].get<int>(), l["tensor_parallel"].get<int>(),
                                     l["schedule"].get<std::string>(), l["virtual_stages"].get<int>());
    if (!tried.insert(key).second) continue;
    std::string flags = l["train_flags"].get<std::string>();
    if (flags == "(none)") flags.clear();
    SCOPED_TRACE(l["text"].get<std::string>());
    auto run = run_command(mpiexec(dir, 2) + quote(tool_path("train")) + " " +
                           quote(source_path("models/simple_digits.onnx")) + " --data " +
                           quote(source_path("data/digits_features.npy")) + " --labels " +
                           quote(source_path("data/digits_labels.npy")) + " --batch-size 64 --steps 2 " + flags);
    EXPECT_EQ(run.exit_code, 0) << run.err;
  }
  EXPECT_GE(tried.size(), 4u) << "D=2, T=2 and P=2 under several schedules";
}

std::string train(const std::string& args) {
  return quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) + " --data " +
         quote(source_path("data/digits_features.npy")) + " --labels " + quote(source_path("data/digits_labels.npy")) +
         " --batch-size 64 " + args;
}

// train --layout auto measures the machine, runs the planner's first choice, and says
// both; with a profile given it measures nothing and chooses what partition --plan ranks
// first.
TEST(PlanCli, TrainLayoutAutoRunsThePlannersFirstChoice) {
  ScratchDir dir("auto");
  auto r = run_command(mpiexec(dir, 2) + train("--steps 3 --optimizer adam --layout auto"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("layout auto: measuring this machine on 2 process(es) first"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("layout auto: D="), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("layout auto: measured "), std::string::npos) << r.err;

  const std::string profile = dir / "hand.json";
  std::ofstream(profile) << R"({"format": "pipeshard-profile", "version": 1, "machine": "hand",
                               "all_reduce": {"latency_us": 1e6, "bytes_per_s": 1e3},
                               "p2p": {"latency_us": 0, "bytes_per_s": 1e12}})";
  const auto plan = run_command(
      partition("--plan --ranks 2 --batch-size 64 --optimizer adam --profile " + quote(profile) + " --json"));
  ASSERT_EQ(plan.exit_code, 0) << plan.err;
  const std::string first = nlohmann::json::parse(plan.out)["layouts"][0]["text"];
  EXPECT_EQ(first.rfind("D=1 P=2 T=1", 0), 0u) << "collectives this slow leave pipelines alone: " << first;
  r = run_command(mpiexec(dir, 2) + train("--steps 2 --optimizer adam --layout auto --profile " + quote(profile)));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err.find("measuring this machine"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("layout auto: " + first + " (train flags"), std::string::npos) << first << "\n" << r.err;
}

TEST(PlanCli, TheTableListsTheBestAndSummarisesTheRest) {
  auto r = run_command(partition("--plan --ranks 4 --batch-size 64 --top 3"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("layouts for "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  1  D="), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  3  D="), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("  4  D="), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("more that fit"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("layouts considered"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cannot cut"), std::string::npos) << "a reason for the refusals: " << r.out;
}

TEST(PlanCli, NothingFitsInTooLittleMemory) {
  auto r = run_command(partition("--plan --ranks 2 --memory-per-rank 1KiB"));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.out.find("no layout fits: the least memory any needs is"), std::string::npos) << r.out;
}

TEST(PlanCli, BadInputIsOneLineAndStatus2) {
  ScratchDir dir("plan_bad");
  const std::string bad_profile = (dir / "bad.json");
  std::ofstream(bad_profile) << R"({"format": "pipeshard-profile", "version": 1, "p2p": {"bytes_per_s": -1}})";
  const std::pair<std::string, std::string> cases[] = {
      {partition("--plan"), "--plan needs --ranks N"},
      {partition("--plan --ranks 2 --stages 2"), "leave out --stages"},
      {partition("--plan --ranks 2 --zero 1"), "leave out --zero"},
      {partition("--ranks 2"), "--ranks is for --plan"},
      {partition("--plan --ranks 0"), "--ranks"},
      {partition("--plan --ranks 2 --memory-per-rank 12parsecs"), "--memory-per-rank: '12parsecs' is not a size"},
      {partition("--plan --ranks 2 --profile " + quote((dir / "missing.json"))), "cannot be read"},
      {partition("--plan --ranks 2 --profile " + quote(bad_profile)), "'p2p.bytes_per_s' must be a positive number"},
      {partition("--plan --ranks 2 --batch-size 0"), "--batch-size"},
      {quote(tool_path("profile")) + " " + quote((dir / "missing.onnx")), "missing.onnx"},
      {quote(tool_path("profile")) + " --out " + quote((dir / "no/such/folder/p.json")), "--out"},
      {quote(tool_path("profile")) + " --seconds 0", "--seconds"},
      {train("--layout auto --stages 2"), "--layout auto chooses --stages itself"},
      {train("--layout auto --zero 1"), "--layout auto chooses --zero itself"},
      {train("--layout manual"), "--layout"},
      {train("--profile " + quote(bad_profile)), "--profile is for --layout auto"},
      {train("--layout auto --profile " + quote(bad_profile)), "'p2p.bytes_per_s' must be a positive number"},
  };
  for (const auto& [command, want] : cases) {
    auto r = run_command(command);
    EXPECT_EQ(r.exit_code, 2) << command << "\n" << r.err;
    EXPECT_NE(r.err.find(want), std::string::npos) << command << "\n" << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << command << "\n" << r.err;
    EXPECT_TRUE(r.out.empty()) << command << "\n" << r.out;
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "no")) << "nothing written";
}

}  // namespace
}  // namespace pipeshard
