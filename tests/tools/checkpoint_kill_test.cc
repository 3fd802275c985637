// Crash safety of checkpoints: `train --checkpoint-every 1` is killed with SIGKILL at
// points all through a checkpoint write (PIPESHARD_FAULT_AT, common/atomic_file.h's
// CrashPoint): after k bytes of the temporary file for many k, after its fsync before the
// rename, and after the rename. After each kill the folder must hold a checkpoint that
// loads (the previous one, or the new one once renamed), and resuming from it each time
// must give the uninterrupted run: the same loss at every step and the same final weights.
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/checkpoint_file.h"
#include "tests/test_util.h"

namespace pipeshard {
namespace {

using testing::quote;
using testing::read_text;
using testing::run_command;
using testing::ScratchDir;
using testing::source_path;
using testing::tool_path;

constexpr int kSteps = 8;

// Adam (optimizer state in the checkpoint), shuffled batches and a cosine schedule over
// kSteps: a resume that lost or repeated anything would show in the losses.
std::string train_command(const std::string& extra) {
  return quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) + " --data " +
         quote(source_path("data/digits_features.npy")) + " --labels " + quote(source_path("data/digits_labels.npy")) +
         " --batch-size 64 --optimizer adam --lr-schedule cosine --seed 3 --steps " + std::to_string(kSteps) + " " +
         extra;
}

// step -> loss, from a --metrics file.
std::map<int64_t, double> read_losses(const std::string& path) {
  std::map<int64_t, double> losses;
  std::istringstream in(read_text(path));
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    losses[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return losses;
}

// The step of the checkpoint in `dir`, after checking every checksum; -1 if it does not load.
int64_t checkpoint_step(const std::string& dir) {
  const Result<Checkpoint> c = decode_checkpoint(read_text(dir + "/checkpoint.pipeshard"));
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  return c.is_ok() ? c->step : -1;
}

// Through the shell, a process killed by a signal exits with 128 + the signal, or is
// reported as not having exited when the shell executed it in place.
bool killed(const testing::CommandResult& r) { return r.exit_code == -1 || r.exit_code == 128 + 9; }

TEST(CheckpointKill, EveryCrashDuringAWriteLeavesACheckpointThatResumesTheSameRun) {
  ScratchDir dir("kill");
  const std::string ckpt = dir / "ckpt";
  const auto straight = run_command(
      train_command("--metrics " + quote(dir / "straight.jsonl") + " --save " + quote(dir / "straight.onnx")));
  ASSERT_EQ(straight.exit_code, 0) << straight.err;
  const std::map<int64_t, double> want = read_losses(dir / "straight.jsonl");
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));

  const std::string checkpointing = "--checkpoint " + quote(ckpt) + " --checkpoint-every 1 ";
  int run = 0;
  struct Outcome {
    testing::CommandResult command;
    std::map<int64_t, double> losses;  // of the steps it trained
  };
  // Runs train with PIPESHARD_FAULT_AT=`fault` (none: ""), resuming unless it is the
  // first run; checks the losses of the steps it trained against the uninterrupted run.
  auto run_train = [&](const std::string& fault, const std::string& extra) {
    const std::string metrics = dir / ("run" + std::to_string(run) + ".jsonl");
    const std::string env = fault.empty() ? "" : "PIPESHARD_FAULT_AT=" + fault + " ";
    Outcome o;
    o.command = run_command(env + train_command(checkpointing + (run > 0 ? "--resume " + quote(ckpt) + " " : "") +
                                                "--metrics " + quote(metrics) + " " + extra));
    ++run;
    o.losses = read_losses(metrics);
    for (const auto& [step, loss] : o.losses) EXPECT_EQ(loss, want.at(step)) << "run " << run << ", step " << step;
    return o;
  };

  // The first run dies right after renaming its first checkpoint into place.
  ASSERT_TRUE(killed(run_train("checkpoint:renamed", "").command));
  ASSERT_EQ(checkpoint_step(ckpt), 1);
  const int64_t file_size = static_cast<int64_t>(std::filesystem::file_size(ckpt + "/checkpoint.pipeshard"));
  // Then one run per crash point, each resuming from what the previous one left: every
  // point before the rename keeps the previous checkpoint, the rename brings the new one.
  std::vector<std::string> faults;
  for (int64_t bytes :
       {int64_t{0}, int64_t{1}, int64_t{8}, int64_t{16}, int64_t{300}, file_size / 2, file_size - 1, file_size}) {
    faults.push_back("checkpoint:" + std::to_string(bytes));
  }
  faults.insert(faults.end(), {"checkpoint:synced", "checkpoint:renamed", "checkpoint:1000", "checkpoint:synced",
                               "checkpoint:renamed"});
  for (const std::string& fault : faults) {
    SCOPED_TRACE(fault);
    const int64_t before = checkpoint_step(ckpt);
    const Outcome o = run_train(fault, "");
    ASSERT_TRUE(killed(o.command)) << "exit status " << o.command.exit_code << "\n" << o.command.err;
    // It trained one step, and died writing its checkpoint.
    EXPECT_EQ(o.losses.size(), 1u);
    EXPECT_EQ(o.losses.begin()->first, before + 1);
    EXPECT_EQ(checkpoint_step(ckpt), fault == "checkpoint:renamed" ? before + 1 : before);
  }
  // The last run goes to the end undisturbed.
  const int64_t resumed_at = checkpoint_step(ckpt);
  EXPECT_EQ(resumed_at, 3) << "three renames";
  const Outcome last = run_train("", "--save " + quote(dir / "resumed.onnx"));
  ASSERT_EQ(last.command.exit_code, 0) << last.command.err;
  EXPECT_EQ(last.losses.size(), static_cast<size_t>(kSteps - resumed_at));
  EXPECT_EQ(checkpoint_step(ckpt), kSteps);
  EXPECT_TRUE(read_text(dir / "resumed.onnx") == read_text(dir / "straight.onnx")) << "the final weights differ";
  // The temporary files the kills left are cleaned up by the next write.
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(ckpt)) files.push_back(e.path().filename().string());
  EXPECT_EQ(files, std::vector<std::string>{"checkpoint.pipeshard"});
}

TEST(CheckpointKill, AnUnknownFaultIsABadArgument) {
  const auto r = run_command("PIPESHARD_FAULT_AT=checkpoint:soon " + train_command(""));
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_EQ(r.err,
            "train: error: PIPESHARD_FAULT_AT='checkpoint:soon': expected checkpoint:BYTES, checkpoint:synced, "
            "checkpoint:renamed or WHERE:STEP:HOW:RANK with WHERE forward, backward, all-reduce or optimizer and "
            "HOW kill, abort, exit or hang\n");
  for (const char* bad : {"backward:0:kill:1", "backward:3:explode:1", "sideways:3:kill:1", "backward:3:kill"}) {
    const auto s = run_command(std::string("PIPESHARD_FAULT_AT=") + bad + " " + train_command(""));
    EXPECT_EQ(s.exit_code, 2) << bad << ": " << s.err;
  }
}

}  // namespace
}  // namespace pipeshard
