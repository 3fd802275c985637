#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang into build-fuzz/ and runs every seed and
# every saved finding through them once, under AddressSanitizer and UBSan: a crash, a
# leak, a hang past 10 s or an allocation past the limits fails the script, and so does a
# replay past 2 minutes. This is no fuzzing (README.md, "Fuzzing", says how to fuzz); it
# takes about 3.5 minutes on two shared cores, mostly the build (fuzz_checkpoint compiles
# the trainer under the sanitizers too). Without clang it says so and succeeds, as the
# GoogleTest replay (fuzz_regression_test) already ran the same inputs in the ordinary build.
set -euo pipefail
cd "$(dirname "$0")/.."

cxx=""
for candidate in clang++-14 clang++; do
  if command -v "$candidate" >/dev/null 2>&1; then cxx=$candidate; break; fi
done
if [ -z "$cxx" ]; then
  echo "fuzz replay: skipped, no clang++ (scripts/install-deps.sh installs clang-14)"
  exit 0
fi

start=$SECONDS
mkdir -p build-fuzz
if ! { cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER="$cxx" -DPIPESHARD_FUZZ=ON -DBUILD_TESTING=OFF &&
       cmake --build build-fuzz --target fuzz_targets -j"$(nproc)"; } >build-fuzz/build.log 2>&1; then
  echo "fuzz replay: building the fuzz targets failed; the end of build-fuzz/build.log:" >&2
  tail -n 40 build-fuzz/build.log >&2
  exit 1
fi

# Files, not folders, on the command line: libFuzzer then runs each input once and never
# writes into the checked-in corpus.
status=0
for target in onnx npy checkpoint; do
  log=build-fuzz/replay_$target.log
  mapfile -d '' inputs < <(find fuzz/corpus/$target fuzz/regressions/$target -type f ! -name README.md -print0 | sort -z)
  if ! timeout 120 build-fuzz/bin/fuzz_$target -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
      "${inputs[@]}" >"$log" 2>&1; then
    echo "fuzz replay: fuzz_$target failed on an input; the end of $log:" >&2
    tail -n 40 "$log" >&2
    status=1
  else
    echo "fuzz replay: fuzz_$target ran ${#inputs[@]} inputs cleanly"
  fi
done
echo "fuzz replay: $((SECONDS - start)) s, build included"
exit $status
