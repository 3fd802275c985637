// No rank hangs when another fails: under mpiexec, one rank of a data-, pipeline- or
// tensor-parallel job is made to fail (PIPESHARD_FAULT_AT, common/fault_injection.h)
// at a point of a step — SIGKILL, a crash, an exit(0) from the middle of the run, or a
// hang — and the whole job must end within 30 s, non-zero, with a message that names the
// failed rank. Kills, crashes and exits are mpirun's to notice; a hang is the
// watchdog's (--comm-timeout, comm/watchdog.h).
//
// Each case prints one row of the fault × layout matrix: the time from launch to the
// end of the job, and the line that names the rank.
#include <chrono>
#include <ostream>
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

constexpr double kDeadlineSeconds = 30;

struct Layout {
  const char* name;
  int np;
  const char* flags;
};

struct Fault {
  const char* spec;   // PIPESHARD_FAULT_AT without the rank
  const char* named;  // regex, with R for the failed rank, for the line that names it
};

const Layout kLayouts[] = {
    {"D2", 2, ""},
    {"P2", 2, "--stages 2 --micro-batches 2"},
    {"T2", 2, "--tensor-parallel 2"},
    {"D2xP2", 4, "--stages 2 --micro-batches 2"},
};

const Fault kFaults[] = {
    {"backward:3:kill", "process rank R with PID [0-9]+ on node [^ ]+ exited on signal 9"},
    {"all-reduce:3:kill", "process rank R with PID [0-9]+ on node [^ ]+ exited on signal 9"},
    {"forward:3:abort", "process rank R with PID [0-9]+ on node [^ ]+ exited on signal 6"},
    {"optimizer:3:exit", "process rank R with PID [0-9]+ on\\s+node [^ ]+ exiting improperly"},
    {"all-reduce:3:hang",
     "train: rank [0-9]+ \\([^)]*\\), step 3, [^:]*: the [^\\n]*\\bR\\b[^\\n]* has not completed after [0-9]+ s; "
     "[^\\n]* cannot be reached \\(--comm-timeout sets the limit\\)"},
};

// Names in ctest's listing rather than GoogleTest's bytes.
void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }
void PrintTo(const Fault& f, std::ostream* os) { *os << f.spec; }

std::string replace_rank(std::string pattern, const std::string& rank) {
  for (size_t at; (at = pattern.find('R')) != std::string::npos;) pattern.replace(at, 1, rank);
  return pattern;
}

class RankFailure : public ::testing::TestWithParam<std::tuple<Layout, Fault>> {};

TEST_P(RankFailure, EveryRankEndsWithinThirtySecondsNamingTheFailedRank) {
  const auto& [layout, fault] = GetParam();
  const int victim = layout.np - 1;  // the last stage's last shard: it fails while rank 0 waits on it
  const std::string spec = std::string(fault.spec) + ":" + std::to_string(victim);
  ScratchDir dir("rank_failure");
  // timeout(1) only guards the test itself against the hang it looks for.
  const std::string command =
      "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TMPDIR=" + quote(dir.path()) +
      " PIPESHARD_FAULT_AT=" + spec + " timeout 120 " + quote(PIPESHARD_MPIEXEC) + " -n " + std::to_string(layout.np) +
      " --oversubscribe " + quote(tool_path("train")) + " " + quote(source_path("models/simple_digits.onnx")) +
      " --data " + quote(source_path("data/digits_features.npy")) + " --labels " +
      quote(source_path("data/digits_labels.npy")) + " --batch-size 32 --steps 40 --comm-timeout 5 " + layout.flags;
  const auto start = std::chrono::steady_clock::now();
  const auto r = run_command(command);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_NE(r.exit_code, 124) << "the job hung until timeout(1) ended it:\n" << r.err;
  EXPECT_LT(seconds, kDeadlineSeconds) << r.err;
  EXPECT_NE(r.err.find("train: rank " + std::to_string(victim) + ": injected fault (PIPESHARD_FAULT_AT)"),
            std::string::npos)
      << "the fault never fired:\n"
      << r.err;
  // A hang is seen first by whichever waiting rank runs out of time first, and it names
  // the ranks it waited on: with four ranks that may be a rank that itself waits for the
  // hung one (it says so: "has failed, is stuck or cannot be reached").
  const bool hang = std::string(fault.spec).ends_with(":hang");
  std::smatch named;
  const std::string pattern = replace_rank(fault.named, hang && layout.np > 2 ? "[0-9]+" : std::to_string(victim));
  const bool found = std::regex_search(r.err, named, std::regex(pattern));
  EXPECT_TRUE(found) << "no line names rank " << victim << ":\n" << r.err;
  const std::string line = found ? std::regex_replace(named.str(), std::regex("\\s+"), " ") : "(no message)";
  std::printf("matrix: %-18s x %-5s -> exit %d after %4.1f s: %s\n", fault.spec, layout.name, r.exit_code, seconds,
              line.c_str());
}

std::string case_name(const ::testing::TestParamInfo<RankFailure::ParamType>& info) {
  std::string name = std::string(std::get<0>(info.param).name) + "_" + std::get<1>(info.param).spec;
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Matrix, RankFailure,
                         ::testing::Combine(::testing::ValuesIn(kLayouts), ::testing::ValuesIn(kFaults)), case_name);

}  // namespace
}  // namespace pipeshard
