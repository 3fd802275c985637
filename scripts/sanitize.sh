#!/usr/bin/env bash
# The whole ctest suite (labels cpu and mpi; the tree builds no CUDA, so no gpu tests) under
# AddressSanitizer + UndefinedBehaviorSanitizer, in build-asan/ (CMake option
# PIPESHARD_SANITIZE: every target instrumented, with clang). The tests start train,
# partition and mpiexec ranks from build-asan/bin, which inherit the options below, so
# child processes are checked too.
#
# Any report fails the script: a report stops its process (halt_on_error, no recovery
# compiled in) with exit status 86, and it is written to build-asan/sanitizer-reports/
# rather than to stderr. A file there fails the run even when the test passed, as a test
# that expects a tool to fail, or that reads only its exit status, could otherwise pass
# over a report in a child. LeakSanitizer suppressions (scripts/lsan.supp) cover only
# third-party leaks, each with the reason it is not ours. Arguments go to ctest
# (bash scripts/sanitize.sh -R NAME runs only the matching tests).
#
# Wall time on two cores shared with another build: 16-18 minutes, 7-8 of them the build
# (CI allows 90; the ordinary suite takes about 4). Every MPI process costs some 6 s more here
# than in the ordinary build (LeakSanitizer's slow unwinding of Open MPI's start-up allocations,
# which the suppressions need), so the golden layouts train five cases here, not all
# (tests/CMakeLists.txt, golden_sanitize_cases), and only the MPI tests in mpi_leak_checked_tests
# check leaks (the others append detect_leaks=0:fast_unwind_on_malloc=1 to ASAN_OPTIONS); on a slow
# day the whole CI took 78 minutes before those two cuts.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
start=$SECONDS
build=build-asan
reports=$PWD/$build/sanitizer-reports

# Clang, as for scripts/fuzz_replay.sh (CMakeLists.txt says why not GCC). Missing clang
# fails the job rather than skipping it: scripts/install-deps.sh installs clang-14.
cxx=""
for candidate in clang++-14 clang++; do
  if command -v "$candidate" >/dev/null 2>&1; then cxx=$candidate; break; fi
done
if [ -z "$cxx" ]; then
  echo "sanitize: no clang++ (scripts/install-deps.sh installs clang-14)" >&2
  exit 1
fi

# Debug supplies -g and no -O of its own; PIPESHARD_SANITIZE adds -O1.
mkdir -p $build
if ! { cmake -S . -B $build -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Debug -DPIPESHARD_SANITIZE=ON &&
       cmake --build $build -j"$(nproc)"; } >$build/build.log 2>&1; then
  echo "sanitize: the build failed; the end of $build/build.log:" >&2
  tail -n 40 $build/build.log >&2
  exit 1
fi
built=$SECONDS

rm -rf "$reports"
mkdir -p "$reports"
common="halt_on_error=1:exitcode=86:log_path=$reports/report:print_stacktrace=1"
export ASAN_OPTIONS="$common:detect_leaks=1:check_initialization_order=1:strict_init_order=1:detect_stack_use_after_return=1:fast_unwind_on_malloc=0:intercept_tls_get_addr=0"
export UBSAN_OPTIONS="$common"
# intercept_tls_get_addr=0: with it, LeakSanitizer's stop-the-world tracer crashed at exit
# ("Tracer caught signal 11" while reading the main thread's dynamic TLS, the blocks
# __tls_get_addr hands out for dlopen'd libraries such as Open MPI's components) on rank 0
# of every 8-process train_staged_comm_d2_p2_t2 run, and now and then elsewhere; without it
# the crash is gone. LSan then does not scan those dynamic TLS blocks, so memory only they
# point to would be reported as a leak: the option can add reports, never hide one.
# fast_unwind_on_malloc=0: Open MPI's libraries are built without frame pointers, so the
# fast unwinder stops at their first frame (often inside a component that MPI_Finalize has
# unloaded) and the suppressions would find no frame to match; the slow unwinder gives
# whole stacks, at some cost in run time (mostly the MPI tests). print_suppressions=0: otherwise
# every MPI process prints LSan's "Suppressions used" table at exit, which lands in the
# reports folder as a report (and, without log_path, in the stderr that tests compare).
export LSAN_OPTIONS="suppressions=$PWD/scripts/lsan.supp:print_suppressions=0"

# LeakSanitizer's own stop-the-world tracer sometimes crashes at a process's exit on a loaded
# machine ("Tracer caught signal 11", then "LeakSanitizer has encountered a fatal error"; a
# known intermittent bug of the runtime, google/sanitizers#1353, seen here once in comm_mpi_np6
# with five of its six ranks at the same moment). That is no finding about our code, but it
# fails the test. So when every report is such a crash, the failed tests run once more with a
# fresh reports folder, and their second result counts; any other report fails at once.
tracer_crash_only() {  # tracer_crash_only FILES...: every file is a tracer crash and nothing else
  local f
  for f in "$@"; do
    grep -q "LeakSanitizer has encountered a fatal error" "$f" || return 1
    grep -qE "ERROR: [A-Za-z]+Sanitizer|runtime error|SUMMARY:" "$f" && return 1
  done
  return 0
}

status=0
ctest --test-dir $build --output-on-failure -j"$(nproc)" "$@" >$build/ctest.log 2>&1 || status=1
grep -h "tests passed" $build/ctest.log || true
mapfile -t found < <(find "$reports" -type f | sort)
if [ ${#found[@]} -gt 0 ] && tracer_crash_only "${found[@]}"; then
  echo "sanitize: ${#found[@]} report(s), all LeakSanitizer's tracer crashing at exit (not a finding):" \
    "$(cut -d: -f2 $build/Testing/Temporary/LastTestsFailed.log 2>/dev/null | tr '\n' ' ')"
  rm -rf "$reports.tracer-crash"
  mv "$reports" "$reports.tracer-crash"
  mkdir -p "$reports"
  if [ $status -ne 0 ]; then
    echo "sanitize: running the failed tests once more"
    status=0
    ctest --test-dir $build --output-on-failure --rerun-failed >$build/ctest-rerun.log 2>&1 || status=1
    grep -h "tests passed" $build/ctest-rerun.log || true
    [ $status -ne 0 ] && cp $build/ctest-rerun.log $build/ctest.log
  fi
  mapfile -t found < <(find "$reports" -type f | sort)
fi
if [ $status -ne 0 ]; then
  echo "sanitize: tests failed; $build/ctest.log says which:" >&2
  sed -n '/tests failed out of/,$p' $build/ctest.log >&2
fi

if [ ${#found[@]} -gt 0 ]; then
  echo "sanitize: ${#found[@]} sanitizer report(s) in $reports; the first:" >&2
  head -n 60 "${found[0]}" >&2
  status=1
fi
echo "sanitize: $((SECONDS - start)) s ($((built - start)) s build), ${#found[@]} reports"
exit $status
