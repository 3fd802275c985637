#include "common/fault_injection.h"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace pipeshard {
namespace {

constexpr char kVariable[] = "PIPESHARD_FAULT_AT";

struct Armed {
  FaultWhere where = FaultWhere::kNowhere;
  FaultHow how = FaultHow::kKill;
  int64_t step = 0;
  int rank = 0;
};
Armed armed;  // this rank's fault, set once before training

std::vector<std::string> split(const std::string& s, char separator) {
  std::vector<std::string> parts(1);
  for (char c : s) {
    if (c == separator) {
      parts.emplace_back();
    } else {
      parts.back() += c;
    }
  }
  return parts;
}

// A non-negative decimal of at most 18 digits, or -1.
int64_t parse_count(const std::string& s) {
  if (s.empty() || s.size() > 18 || s.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(s);
}

const char* where_name(FaultWhere w) {
  switch (w) {
    case FaultWhere::kForward: return "forward";
    case FaultWhere::kBackward: return "backward";
    case FaultWhere::kAllReduce: return "all-reduce";
    case FaultWhere::kOptimizer: return "optimizer";
    case FaultWhere::kNowhere: break;
  }
  return "?";
}

}  // namespace

Result<InjectedFaults> faults_from_environment() {
  const char* value = std::getenv(kVariable);
  InjectedFaults f;
  if (value == nullptr || *value == 0) return f;
  const std::string v = value;
  const auto bad = [&] {
    return Status::error(std::string(kVariable) + "='" + v +
                         "': expected checkpoint:BYTES, checkpoint:synced, checkpoint:renamed or "
                         "WHERE:STEP:HOW:RANK with WHERE forward, backward, all-reduce or optimizer and HOW kill, "
                         "abort, exit or hang");
  };
  const std::vector<std::string> parts = split(v, ':');
  if (parts.size() == 2 && parts[0] == "checkpoint") {
    if (parts[1] == "synced") {
      f.checkpoint.where = CrashPoint::Where::kBeforeRename;
    } else if (parts[1] == "renamed") {
      f.checkpoint.where = CrashPoint::Where::kAfterRename;
    } else if (const int64_t bytes = parse_count(parts[1]); bytes >= 0) {
      f.checkpoint.where = CrashPoint::Where::kAfterBytes;
      f.checkpoint.bytes = bytes;
    } else {
      return bad();
    }
    return f;
  }
  if (parts.size() != 4) return bad();
  for (FaultWhere w : {FaultWhere::kForward, FaultWhere::kBackward, FaultWhere::kAllReduce, FaultWhere::kOptimizer}) {
    if (parts[0] == where_name(w)) f.where = w;
  }
  const std::string& how = parts[2];
  if (how == "kill") {
    f.how = FaultHow::kKill;
  } else if (how == "abort") {
    f.how = FaultHow::kAbort;
  } else if (how == "exit") {
    f.how = FaultHow::kExit;
  } else if (how == "hang") {
    f.how = FaultHow::kHang;
  } else {
    return bad();
  }
  f.step = parse_count(parts[1]);
  const int64_t rank = parse_count(parts[3]);
  if (f.where == FaultWhere::kNowhere || f.step < 1 || rank < 0 || rank > (1 << 24)) return bad();
  f.rank = static_cast<int>(rank);
  return f;
}

void set_training_fault(const InjectedFaults& faults, int world_rank) {
  armed = Armed{};
  if (faults.where != FaultWhere::kNowhere && faults.rank == world_rank) {
    armed = Armed{faults.where, faults.how, faults.step, world_rank};
  }
}

void fault_point(FaultWhere where, int64_t step) {
  if (armed.where != where || armed.step != step) return;
  static constexpr const char* kHow[] = {"SIGKILL", "abort()", "exit(0)", "hang"};
  std::fprintf(stderr, "train: rank %d: injected fault (%s): %s in %s at step %lld\n", armed.rank, kVariable,
               kHow[static_cast<int>(armed.how)], where_name(where), static_cast<long long>(step));
  std::fflush(stderr);
  switch (armed.how) {
    case FaultHow::kKill: std::raise(SIGKILL); break;
    case FaultHow::kAbort: std::abort();
    case FaultHow::kExit: std::exit(0);
    case FaultHow::kHang: break;
  }
  for (;;) ::pause();  // a signal handler's return lands here again
}

}  // namespace pipeshard
