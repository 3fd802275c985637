// SIGINT and SIGTERM: train finishes its step, writes a checkpoint (with --checkpoint),
// says so in one line and exits 128 + the signal; resuming from that checkpoint continues
// the uninterrupted run exactly. Under mpiexec every rank stops after the same step,
// whether the signal reached all of them (through mpiexec) or one.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/checkpoint_file.h"
#include "tests/test_util.h"

extern char** environ;

namespace pipeshard {
namespace {

using testing::quote;
using testing::read_text;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

using Clock = std::chrono::steady_clock;
constexpr std::chrono::seconds kPatience{60};

// `command` run by the shell in the background (exec'd in place: the pid is the command's),
// its stderr in a file. The destructor kills it if it is still running.
class Background {
 public:
  Background(const std::string& command, const std::string& err) {
    const std::string line = "exec " + command + " 2>" + quote(err);
    const char* argv[] = {"/bin/sh", "-c", line.c_str(), nullptr};
    if (posix_spawn(&pid_, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ) != 0) pid_ = -1;
  }
  ~Background() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  // True once the process has ended (its status is then kept for wait()).
  bool ended() {
    if (pid_ > 0 && ::waitpid(pid_, &status_, WNOHANG) == pid_) pid_ = -1;
    return pid_ <= 0;
  }
  // The exit status, or -1 when it did not exit on its own within kPatience (then it is killed).
  int wait() {
    const auto deadline = Clock::now() + kPatience;
    while (!ended()) {
      if (Clock::now() > deadline) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  }

 private:
  pid_t pid_ = -1;
  int status_ = 0;
};

// Waits until `path` has `lines` complete lines; false if `run` ends first, or after kPatience.
bool wait_for_lines(const std::string& path, int lines, Background& run) {
  for (const auto deadline = Clock::now() + kPatience; Clock::now() < deadline && !run.ended();) {
    const std::string text = read_text(path);
    if (std::count(text.begin(), text.end(), '\n') >= lines) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

std::vector<double> read_losses(const std::string& path) {  // [steps], from step 1 or the resumed step
  std::vector<double> losses;
  std::istringstream in(read_text(path));
  for (std::string line; std::getline(in, line);) losses.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return losses;
}

int64_t last_step(const std::string& metrics) {
  std::istringstream in(read_text(metrics));
  int64_t step = -1;
  for (std::string line; std::getline(in, line);) step = nlohmann::json::parse(line)["step"].get<int64_t>();
  return step;
}

// A process of mpiexec `launcher` that is rank `rank` of its job; -1 if none is found.
pid_t rank_of(pid_t launcher, int rank) {
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_text(e.path() / "stat");
    const size_t close = stat.rfind(')');  // "pid (comm) state ppid ..."
    if (close == std::string::npos || std::atoi(stat.c_str() + close + 4) != launcher) continue;
    std::string env = "\n" + read_text(e.path() / "environ");
    std::replace(env.begin(), env.end(), '\0', '\n');
    if (env.find("\nOMPI_COMM_WORLD_RANK=" + std::to_string(rank) + "\n") != std::string::npos) return std::stoi(name);
  }
  return -1;
}

class TrainSignal : public ::testing::Test {
 protected:
  // `train` on the course model, SGD with momentum and a constant learning rate (so that
  // --steps changes nothing but where the run ends), under `launcher` when it is not empty.
  std::string train(const std::string& flags) const {
    return launcher_ + quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) + " --data " +
           quote(source_path("data/digits_features.npy")) + " --labels " +
           quote(source_path("data/digits_labels.npy")) + " --batch-size 32 --momentum 0.9 --seed 1 " + layout_ + flags;
  }
  // Runs until `lines` steps are in the metrics, then sends `signal` to the process
  // `target` picks (the launched one by default). Returns the exit status.
  int interrupt(const std::string& flags, int signal, const std::function<pid_t(pid_t)>& target = {}) {
    Background run(train("--steps 1000000 --metrics " + quote(dir_ / "interrupted.jsonl") + " " + flags), dir_ / "err");
    if (!wait_for_lines(dir_ / "interrupted.jsonl", 3, run)) return -2;
    const pid_t to = target ? target(run.pid()) : run.pid();
    if (to <= 0) return -3;
    ::kill(to, signal);
    return run.wait();
  }
  // The checkpoint in DIR/ckpt holds the last step of the interrupted run; resuming it
  // for 4 more steps gives the run that was never interrupted.
  void expect_resumes_onto_the_uninterrupted_run() {
    const int64_t stopped = last_step(dir_ / "interrupted.jsonl");
    const Result<Checkpoint> c = decode_checkpoint(read_text(dir_ / "ckpt/checkpoint.pipeshard"));
    ASSERT_TRUE(c.is_ok()) << c.status().message();
    EXPECT_EQ(c->step, stopped);
    const std::string steps = "--steps " + std::to_string(stopped + 4);
    const auto resumed = run_command(train(steps + " --resume " + quote(dir_ / "ckpt") + " --metrics " +
                                           quote(dir_ / "resumed.jsonl") + " --save " + quote(dir_ / "resumed.onnx")));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
    const auto straight = run_command(
        train(steps + " --metrics " + quote(dir_ / "straight.jsonl") + " --save " + quote(dir_ / "straight.onnx")));
    ASSERT_EQ(straight.exit_code, 0) << straight.err;
    std::vector<double> joined = read_losses(dir_ / "interrupted.jsonl");
    for (double loss : read_losses(dir_ / "resumed.jsonl")) joined.push_back(loss);
    EXPECT_EQ(joined, read_losses(dir_ / "straight.jsonl"));
    EXPECT_TRUE(read_text(dir_ / "resumed.onnx") == read_text(dir_ / "straight.onnx")) << "the final weights differ";
  }
  std::string stderr_text() const { return read_text(dir_ / "err"); }

  ScratchDir dir_{"signal"};
  std::string launcher_, layout_;
};

TEST_F(TrainSignal, SigtermStopsAfterAStepWithACheckpointThatResumes) {
  const int status = interrupt("--checkpoint " + quote(dir_ / "ckpt") + " --checkpoint-every 100000", SIGTERM);
  ASSERT_EQ(status, 143) << stderr_text();
  const std::string expected = "stopped by SIGTERM after step " +
                               std::to_string(last_step(dir_ / "interrupted.jsonl")) + "/1000000: checkpoint in " +
                               (dir_ / "ckpt");
  EXPECT_NE(stderr_text().find(expected), std::string::npos) << stderr_text();
  expect_resumes_onto_the_uninterrupted_run();
}

TEST_F(TrainSignal, SigintWithoutACheckpointFolderSavesNothingAndSaysSo) {
  const int status = interrupt("--save " + quote(dir_ / "never.onnx"), SIGINT);
  ASSERT_EQ(status, 130) << stderr_text();
  EXPECT_NE(stderr_text().find("stopped by SIGINT after step " + std::to_string(last_step(dir_ / "interrupted.jsonl")) +
                               "/1000000: nothing saved (no --checkpoint folder given)\n"),
            std::string::npos)
      << stderr_text();
  EXPECT_FALSE(std::filesystem::exists(dir_ / "never.onnx")) << "a stopped run is not a finished one";
}

// Two pipeline stages under mpiexec. Open MPI refuses root without the ALLOW variables;
// its session folder goes under this test's TMPDIR (see trace_test.cc).
class TrainSignalUnderMpi : public TrainSignal {
 protected:
  void SetUp() override {
    launcher_ = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir_.path()) + " " +
                quote(PIPESHARD_MPIEXEC) + " -n 2 --oversubscribe ";
    layout_ = "--stages 2 ";
  }
};

// Open MPI's mpiexec passes SIGTERM on to every rank odls_base_sigkill_timeout seconds
// after it gets it, and SIGKILLs them as long again later: 3 s rather than the default 1
// leave room for a step and a checkpoint on a busy machine.
TEST_F(TrainSignalUnderMpi, SigtermToMpiexecStopsEveryRankAfterTheSameStep) {
  launcher_ = "env OMPI_MCA_odls_base_sigkill_timeout=3 " + launcher_;
  const int status = interrupt("--checkpoint " + quote(dir_ / "ckpt") + " --checkpoint-every 100000", SIGTERM);
  EXPECT_NE(status, 0) << stderr_text();  // Open MPI 4.1's mpiexec exits 1 after passing a signal on
  EXPECT_NE(status, -1) << "the job did not end: " << stderr_text();
  const std::string err = stderr_text();
  const size_t at =
      err.find("stopped by SIGTERM after step " + std::to_string(last_step(dir_ / "interrupted.jsonl")) + "/");
  EXPECT_NE(at, std::string::npos) << err;
  EXPECT_EQ(err.find("stopped by", at + 1), std::string::npos) << "said once, by rank 0: " << err;
  expect_resumes_onto_the_uninterrupted_run();
}

// A signal that reaches one rank only (here the last stage, not rank 0 that writes) stops
// them all after the same step: the ranks add up what they saw at the end of each step.
TEST_F(TrainSignalUnderMpi, SigintToOneRankStopsEveryRankAfterTheSameStep) {
  const int status = interrupt("--checkpoint " + quote(dir_ / "ckpt") + " --checkpoint-every 100000", SIGINT,
                               [](pid_t mpiexec) { return rank_of(mpiexec, 1); });
  ASSERT_EQ(status, 130) << stderr_text();  // mpiexec passes on the status of the ranks
  EXPECT_NE(stderr_text().find("stopped by SIGINT after step " + std::to_string(last_step(dir_ / "interrupted.jsonl"))),
            std::string::npos)
      << stderr_text();
  const Result<Checkpoint> c = decode_checkpoint(read_text(dir_ / "ckpt/checkpoint.pipeshard"));
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->step, last_step(dir_ / "interrupted.jsonl"));
}

}  // namespace
}  // namespace pipeshard
