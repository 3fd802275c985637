// Fatal errors: the one place where a broken invariant or a failed call into a library
// (MPI, CUDA, cuBLAS, NCCL) is reported and the process, or in an MPI run the whole job,
// is ended (docs/style.md 6). Bad input is not fatal: it is a Status (common/status.h).
//
// A report is one line on stderr,
//
//   pipeshard: internal error at FILE:LINE: check 'COND' failed: DETAIL    (PIPESHARD_CHECK)
//   pipeshard: internal error at FILE:LINE: WHAT                           (fatal)
//   pipeshard: KIND error at FILE:LINE in CALL: ERROR                      (PIPESHARD_CHECKED_CALL)
//
// after which the job abort hook runs, if one is installed, and the process aborts
// (SIGABRT, which core dumps and death tests see). comm/comm_mpi.cc installs a hook that
// calls MPI_Abort on the world once MPI is up, so that a failed check on any rank ends every
// rank instead of leaving them waiting for it; without a hook, or where the hook cannot act
// (a thread that may not call MPI), the process ends alone and mpirun ends the rest.
//
// Header-only, C++17: the CUDA sources (nvcc) and the CUDA and NCCL plugins, which link no
// pipeshard_common, use it too. So the hook is one per executable or shared object: a
// plugin built with hidden symbols has its own, which nobody installs.
#ifndef PIPESHARD_COMMON_CHECK_H_
#define PIPESHARD_COMMON_CHECK_H_

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace pipeshard {

// Ends the whole job after a fatal error was reported, on the thread that failed; returns
// when it cannot (then the process aborts alone).
using JobAbortHook = void (*)();

namespace check_internal {
inline std::atomic<JobAbortHook> job_abort_hook{nullptr};
}  // namespace check_internal

// Installs `hook` (nullptr: none) and returns the one it replaces.
inline JobAbortHook set_job_abort_hook(JobAbortHook hook) { return check_internal::job_abort_hook.exchange(hook); }

// Writes `report` as one line on stderr (stdout flushed first, so that the two keep their
// order in a shared log), runs the job abort hook, and aborts: the one way out of every
// fatal error.
[[noreturn]] inline void end_with_report(const std::string& report) {
  std::fflush(stdout);
  std::fprintf(stderr, "%s\n", report.c_str());
  std::fflush(stderr);
  if (JobAbortHook hook = check_internal::job_abort_hook.load()) hook();
  std::abort();
}

// "pipeshard: internal error at FILE:LINE: WHAT", then end_with_report.
[[noreturn]] inline void fatal(const char* file, int line, std::string_view what) {
  end_with_report("pipeshard: internal error at " + std::string(file) + ":" + std::to_string(line) + ": " +
                  std::string(what));
}

// "pipeshard: KIND error at FILE:LINE in CALL: ERROR", then end_with_report: a call into
// library KIND ("MPI", "CUDA") that failed with ERROR, its text for the call's result.
[[noreturn]] inline void fatal_call(const char* kind, std::string_view call, std::string_view error, const char* file,
                                    int line) {
  end_with_report("pipeshard: " + std::string(kind) + " error at " + std::string(file) + ":" + std::to_string(line) +
                  " in " + std::string(call) + ": " + std::string(error));
}

// What PIPESHARD_CHECK reports: "check 'COND' failed" and ": DETAIL" when there is one.
inline std::string failed_check_text(const char* condition, const std::string& detail) {
  return "check '" + std::string(condition) + "' failed" + (detail.empty() ? "" : ": " + detail);
}

}  // namespace pipeshard

// Ends the job with file:line when an invariant (not user input) is broken. The optional
// detail (anything a std::string is made of) is built only when the check fails.
#define PIPESHARD_CHECK(cond, ...)                                                                             \
  do {                                                                                                         \
    if (!(cond)) {                                                                                             \
      ::pipeshard::fatal(__FILE__, __LINE__, ::pipeshard::failed_check_text(#cond, std::string{__VA_ARGS__})); \
    }                                                                                                          \
  } while (0)

// A call into a library that must succeed. Evaluates `call` once; when ok(result) is false,
// calls on_failure(kind, call_text, to_text(result), __FILE__, __LINE__), which must not
// return. `call_text` is the call as written: the library's own macro passes #call, because
// a macro's arguments are expanded before they reach this one (Open MPI's MPI_FLOAT would
// otherwise show as the cast of a global). `ok` and `to_text` are anything callable on the
// result (functions, lambdas); to_text gives something a std::string_view is made from.
#define PIPESHARD_CHECKED_CALL_OR(kind, call, call_text, ok, to_text, on_failure)    \
  do {                                                                               \
    const auto _pipeshard_result = (call);                                           \
    if (!(ok)(_pipeshard_result)) {                                                  \
      on_failure(kind, call_text, (to_text)(_pipeshard_result), __FILE__, __LINE__); \
    }                                                                                \
  } while (0)

// The usual failure: a fatal "pipeshard: KIND error at FILE:LINE in CALL: ERROR".
#define PIPESHARD_CHECKED_CALL(kind, call, call_text, ok, to_text) \
  PIPESHARD_CHECKED_CALL_OR(kind, call, call_text, ok, to_text, ::pipeshard::fatal_call)

#endif  // PIPESHARD_COMMON_CHECK_H_
