// common/check.h: the one report of a fatal error, and the job abort hook that ends every
// rank of an MPI job (comm/comm_mpi.cc installs it; here a stand-in that exits).
#include "common/check.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace pipeshard {
namespace {

int calls = 0;

// A library call that fails with its argument as the error code, counting its calls.
int library_call(int code) {
  ++calls;
  return code;
}
bool is_zero(int code) { return code == 0; }
std::string error_text(int code) { return "error " + std::to_string(code); }

void exit_with_status_3() {
  std::fprintf(stderr, "the job abort hook ran\n");
  std::exit(3);
}

TEST(CheckTest, PassingChecksAndCallsDoNothing) {
  calls = 0;
  PIPESHARD_CHECK(calls == 0, "never built: " + std::to_string(calls));
  PIPESHARD_CHECKED_CALL("LIB", library_call(0), "library_call(0)", is_zero, error_text);
  EXPECT_EQ(calls, 1);  // evaluated once
}

TEST(CheckDeathTest, AFailedCheckNamesTheSiteTheConditionAndTheDetail) {
  EXPECT_DEATH(PIPESHARD_CHECK(1 + 1 == 3, "detail " + std::to_string(42)),
               "pipeshard: internal error at [^\n]*check_test.cc:[0-9]+: check '1 \\+ 1 == 3' failed: detail 42\n");
  EXPECT_DEATH(PIPESHARD_CHECK(false),
               "pipeshard: internal error at [^\n]*check_test.cc:[0-9]+: check 'false' failed\n");
  EXPECT_DEATH(fatal("here.cc", 7, "what went wrong"), "^pipeshard: internal error at here.cc:7: what went wrong\n");
}

TEST(CheckDeathTest, AFailedCallNamesTheLibraryTheCallAndItsError) {
  EXPECT_DEATH(PIPESHARD_CHECKED_CALL("LIB", library_call(7), "library_call(7)", is_zero, error_text),
               "pipeshard: LIB error at [^\n]*check_test.cc:[0-9]+ in library_call\\(7\\): error 7\n");
}

TEST(CheckDeathTest, AFailedCallCanFailItsOwnWay) {
  auto fail = [](const char* kind, std::string_view call, std::string_view error, const char*, int) {
    std::fprintf(stderr, "%s: %s gave %s\n", kind, std::string(call).c_str(), std::string(error).c_str());
    std::exit(4);
  };
  EXPECT_EXIT(PIPESHARD_CHECKED_CALL_OR("LIB", library_call(5), "library_call(5)", is_zero, error_text, fail),
              ::testing::ExitedWithCode(4), "LIB: library_call\\(5\\) gave error 5");
}

// The report comes first, then the hook, which ends the job (here: exits with 3).
TEST(CheckDeathTest, TheJobAbortHookRunsAfterTheReport) {
  EXPECT_EXIT(
      {
        set_job_abort_hook(exit_with_status_3);
        PIPESHARD_CHECK(false, "on one rank");
      },
      ::testing::ExitedWithCode(3), "check 'false' failed: on one rank\nthe job abort hook ran\n");
  // A hook that cannot end the job returns, and the process aborts alone.
  EXPECT_DEATH(
      {
        set_job_abort_hook([] { std::fprintf(stderr, "not on this thread\n"); });
        fatal("x.cc", 1, "y");
      },
      "y\nnot on this thread\n");
  EXPECT_EQ(set_job_abort_hook(nullptr), nullptr);  // the death tests' hooks stayed in their children
}

}  // namespace
}  // namespace pipeshard
