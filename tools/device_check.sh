#!/usr/bin/env bash
# tools/device_check.sh: pipeshard's GPU check in one command. On a machine with an NVIDIA GPU it
# gets the build ready, runs the GPU tests (ctest label "gpu"), every parallel layout with its
# processes sharing the GPU (tools/device_multirank.sh, under a carried Open MPI) and the GPU
# benchmarks against PyTorch on the same GPU (bench/gpu_vs_pytorch.py), and writes the results
# to $OUT. It never
# hangs (every step has a timeout, the whole run a budget of DEVICE_CHECK_BUDGET_S = 320 s, so
# that one 15-minute lease runs it twice) and prints its progress.
#
# HOW TO RUN (for the next engineer)
#   1. Here, on the Debian machine with the CUDA toolkit (/usr/local/cuda), in the checkout that the
#      device tool sends (the session's own checkout: the tool sends that one even when you call it
#      from another worktree), build and pack what the GPU machine needs:
#          bash tools/device_check.sh --prepare
#      It builds build-device/ (Release, CUDA architecture 90, only train, partition,
#      bench_gemm_cuda, bench_kernels_cudnn and the GPU test executables), copies the non-CUDA shared libraries they
#      load (libonnx, protobuf, OpenBLAS with libgfortran, Open MPI, fmt, ...) into it, adds Open
#      MPI's launcher and runtime (tools/openmpi_bundle.sh: the GPU machine has no mpirun), and packs
#      it all into build-device/carry/device_bundle.tar.xz, printing the sizes
#      against the 64 MiB the tool carries. Measured 2026-11-29: binaries 3.0 MiB and libraries
#      47.5 MiB raw (OpenBLAS 34.9 of it), 8.4 MiB packed; with the 7.3 MiB tree, 15.7 MiB. The
#      libraries need glibc >= 2.36 there (Debian 12's libevent_core; Ubuntu 24.04 has 2.39); an
#      older libstdc++ there is replaced by the carried one (build-device/devlib-compat).
#      CUDA, cuBLAS, cuDNN and NCCL libraries are not carried: the GPU machine's own are used.
#   2. Then one call of the device tool:
#          run  command:   bash tools/device_check.sh
#               carry:     ["build-device/carry"]
#               timeout_s: 360
#      (no PyTorch wheels to carry: the GPU image's python3 has torch, numpy and onnx.) The results
#      come back in $OUT: device_check.md (read this), device_check.json, device_check.log,
#      env.txt, build.log, tests.log, bench.log and logs.tar.gz (8 files, the tool's limit).
#      Give the machine back (give_back) unless you rerun at once.
#   Dry run anywhere (no GPU needed; skips the GPU parts, says so, exits 0):
#          OUT=/tmp/dc_out bash tools/device_check.sh
#
# What the GPU machine is known to have (/work/.library/device/KINDS.md, H200.md; seen 2026-10/11):
# x86-64, one H200, 16 cores, 128 GiB; an image with nvcc 13.0 (matching driver 580), CMake and
# ninja, cuda-gdb, ncu, compute-sanitizer; python3 = /opt/torch/.venv/bin/python3 (3.12) with torch
# 2.11+cu130, numpy, onnx 1.23, nvidia-ml-py and the CUDA 13 pip libraries (cuBLAS, NCCL); no
# network, no apt. It does not list our C++ dependencies (libonnx-dev, protobuf, OpenBLAS, Open MPI,
# fmt, GoogleTest, CLI11, nlohmann-json), nor g++, mpirun or the OS release: this script probes them
# and writes what it finds to env.txt. Hence the plan: build here (same x86-64, same CUDA 13.0) and
# carry binaries plus the non-CUDA libraries; building there needs those libraries' headers and
# CMake files as well, so it is only the fallback when no bundle was carried (--build-there forces
# it), and it fails at configure time, saying which package is missing, on an image without them.
#
# What the benchmarks race (bench/gpu_vs_pytorch.py's docstring has the formulas): the GEMM at 8192³
# in fp32, tf32 and bf16; the large MLP (8 × Linear(8192) + GELU, batch 8192, AdamW) in fp32, tf32
# and bf16 (ours `--precision bf16`, PyTorch under torch.autocast(bfloat16), fp32 master weights on
# both sides; step-1 losses within 1e-2 relative); the small MLP in fp32 and tf32; last, our
# softmax and BatchNorm kernels against cuDNN's (bench_kernels_cudnn, ~10 s). Their time is
# estimated beside STEPS in that script (~140 s of the ~200 s the budget leaves them; a run that
# would not fit is reported "not run: out of time budget", which does not fail the check).
#
# Results layout ($OUT/device_check.md): the machine (GPU, driver, CUDA versions, OS, glibc), how
# the build was made ready (carried bundle / built there / none, and why), the GPU tests (passed,
# failed with names and first messages, skipped with reasons), the benchmark tables (ours, PyTorch,
# ratios; bench/gpu_vs_pytorch.py says how each figure is computed), then the time of each phase.
# Without a usable GPU the tests still run (they skip, saying so) and a CPU smoke of the benchmark
# runner checks its plumbing (model generation, our train, the PyTorch side, the loss agreement).
#
# Exit status: 0 when the check ran (parts may be skipped: the results say why); 1 when a GPU test
# failed, a benchmark run failed or a correctness check said WRONG (in a dry run: when the plumbing
# smoke did); 2 on a bad argument or when --prepare fails.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
BUILD=build-device                       # relative to ROOT, ignored by .gitignore (build*/)
BUNDLE_DIR=$BUILD/carry
BUNDLE=$BUNDLE_DIR/device_bundle.tar.xz
MANIFEST=$BUILD/device_manifest.json
BUDGET_S=${DEVICE_CHECK_BUDGET_S:-320}
CARRY_LIMIT_MIB=64
START=$(date +%s)

MODE=device
FORCE_BUILD_THERE=0
for arg in "$@"; do
  case $arg in
    --prepare) MODE=prepare ;;
    --build-there) FORCE_BUILD_THERE=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "device_check: unknown argument '$arg' (--prepare, --build-there, --help)" >&2; exit 2 ;;
  esac
done

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
LOG=/dev/null
say() { printf '[device_check +%3ss] %s\n' "$(elapsed)" "$*" | tee -a "$LOG"; }
# Seconds for a step: what it wants, or what the budget leaves less `reserve`; 0 when none is left.
step_timeout() {
  local want=$1 reserve=${2:-30} l
  l=$(( $(left) - reserve ))
  (( l < 5 )) && { echo 0; return; }
  (( want < l )) && echo "$want" || echo "$l"
}
# run_logged SECONDS LOGFILE CMD...: runs CMD under timeout, output appended to LOGFILE; returns
# its status (124 on timeout).
run_logged() {
  local t=$1 log=$2
  shift 2
  echo "===== $(date -u +%H:%M:%S) (timeout ${t}s): $*" >>"$log"
  timeout -k 5 "$t" "$@" >>"$log" 2>&1
  local rc=$?
  echo "===== exit status $rc" >>"$log"
  return $rc
}

# A python3 that imports torch, numpy and onnx (the benchmark's PyTorch side); PY_ANY: any python3.
find_pythons() {
  PY_TORCH= PY_ANY= TORCH_NOTE=
  local py
  for py in python3 /opt/torch/.venv/bin/python3 /usr/bin/python3 python; do
    command -v "$py" >/dev/null 2>&1 || continue
    [ -z "$PY_ANY" ] && PY_ANY=$(command -v "$py")
    if timeout 90 "$py" -c 'import torch, numpy, onnx' >/dev/null 2>&1; then
      PY_TORCH=$(command -v "$py")
      return
    fi
  done
  TORCH_NOTE="no python3 here imports torch, numpy and onnx (tried python3, /opt/torch/.venv/bin/python3, /usr/bin/python3)"
}

# ---------------------------------------------------------------------------------------- build
# GPU test targets: executables named cuda_*_test, those tests/CMakeLists.txt registers with
# gtest_discover_tests(... LABELS gpu), and the executables of its add_test entries labelled
# gpu (the CPU suites again on the CUDA backend, backend_test_on_cuda and the like, which run
# bin/backend_test with PIPESHARD_TEST_BACKEND=cuda: the manifest keeps that environment).
gpu_test_targets() {
  { cmake --build "$BUILD" --target help 2>/dev/null | grep -oE '\bcuda_[A-Za-z0-9_]*_test\b'
    # ctest does not list the command of a test whose executable is not built yet, so these
    # come from the CTestTestfile.cmake files CMake wrote: add_test lines whose test has the
    # label gpu and whose command is one of our binaries.
    find "$BUILD" -name CTestTestfile.cmake -print0 2>/dev/null | xargs -0 -r cat | "${PY_ANY:-python3}" -c '
import os, re, sys
bindir = os.path.abspath(sys.argv[1])
text = sys.stdin.read()
gpu = set(re.findall(r"set_tests_properties\(\[=\[([^\]]+)\]=\] PROPERTIES[^\n]*LABELS \"gpu\"", text))
for name, exe in re.findall(r"add_test\(\[=\[([^\]]+)\]=\] \"([^\"]+)\"", text):
    if name in gpu and os.path.dirname(os.path.abspath(exe)) == bindir:
        print(os.path.basename(exe))' "$BUILD/bin"
    tr '\n' ' ' <tests/CMakeLists.txt | grep -oE 'gtest_discover_tests\( *[A-Za-z0-9_]+[^)]*LABELS +gpu' |
      sed -E 's/gtest_discover_tests\( *([A-Za-z0-9_]+).*/\1/' |
      grep -v '_$'  # a name built from a variable (cuda_${name}): the target list above has it
  } | sort -u
}

# build_tree CONFIGURE_TIMEOUT BUILD_TIMEOUT JOBS BUILDLOG: configures and builds the targets the
# check needs, keeping going past failures; writes $MANIFEST. Status 0 when train was built.
build_tree() {
  local tc=$1 tb=$2 jobs=$3 blog=$4 gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  [ -f "$BUILD/CMakeCache.txt" ] && gen=()  # keep the generator the tree was made with
  if ! run_logged "$tc" "$blog" cmake -S . -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES=90; then
    BUILD_WHY="configure failed: $(grep -m1 -E 'Could NOT find|CMake Error|not found' "$blog" | head -c 300)"
    return 1
  fi
  grep -q 'PIPESHARD_HAVE_CUDA:INTERNAL=ON\|pipeshard: CUDA' "$blog" "$BUILD/CMakeCache.txt" 2>/dev/null ||
    say "warning: CMake found no CUDA toolkit: the build is CPU-only and the GPU parts cannot run"
  local targets=(train partition bench_gemm_cuda $(gpu_test_targets))
  # bench_kernels_cudnn exists only where CMake found cuDNN; naming a missing target stops ninja.
  grep -q '/bench_kernels_cudnn\.dir$' "$BUILD/CMakeFiles/TargetDirectories.txt" 2>/dev/null &&
    targets+=(bench_kernels_cudnn)
  local keep_going=(-k 0)
  grep -q 'CMAKE_MAKE_PROGRAM.*make' "$BUILD/CMakeCache.txt" && keep_going=(-k)
  say "building ${targets[*]} with $jobs jobs (log: build.log)"
  run_logged "$tb" "$blog" cmake --build "$BUILD" -j "$jobs" --target "${targets[@]}" -- "${keep_going[@]}"
  [ -x "$BUILD/bin/train" ] || { BUILD_WHY="build failed: $(grep -m1 -E 'error|FAILED' "$blog" | head -c 300)"; return 1; }
  write_manifest "$blog" "${targets[@]}"
}

# The manifest: where the tree was built (the binaries hold those paths), what was built and what
# failed, the GPU tests per executable (from ctest -L gpu), and the versions used.
write_manifest() {
  local blog=$1
  shift
  local tests_json=/dev/null
  if command -v ctest >/dev/null; then
    tests_json=$(mktemp)
    (cd "$BUILD" && timeout 60 ctest -L gpu --show-only=json-v1 >"$tests_json" 2>/dev/null) || true
  fi
  DC_TARGETS="$*" DC_BLOG="$blog" DC_TESTS_JSON="$tests_json" DC_ROOT="$ROOT" DC_BUILD="$BUILD" \
  DC_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)" DC_DIRTY="$(git status --porcelain 2>/dev/null | grep -c '^ M\|^M')" \
  DC_NVCC="$( (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>/dev/null | tail -1)" \
  DC_CXX="$(grep -m1 'CMAKE_CXX_COMPILER:' "$BUILD/CMakeCache.txt" | cut -d= -f2)" \
  "${PY_ANY:-python3}" - "$MANIFEST" <<'EOF'
import json, os, re, sys
bindir = os.path.join(os.environ["DC_BUILD"], "bin")
targets = os.environ["DC_TARGETS"].split()
log = open(os.environ["DC_BLOG"], errors="replace").read()
built, failed = [], {}
for t in targets:
    if os.access(os.path.join(bindir, t), os.X_OK):
        built.append(t)
    else:
        m = re.search(r"FAILED: [^\n]*\b%s\b[^\n]*\n(.*?)(?=\n\[|\nninja|\Z)" % re.escape(t), log, re.S)
        first = ""
        if m:
            errs = [l for l in m.group(1).splitlines() if "error" in l or "undefined reference" in l]
            first = errs[0].strip() if errs else m.group(1).strip().splitlines()[-1]
            n_undef = len(re.findall(r"undefined reference", m.group(1)))
            if n_undef:
                first = f"link failed: {n_undef} undefined references, the first: {first[:200]}"
        failed[t] = first[:400] or "not built"
# Runs: an executable, run whole, under the environment its ctest entry sets. A run is named
# after its executable, or after its ctest test when that sets an environment (the CPU suites
# again on the CUDA backend: backend_test_on_cuda runs bin/backend_test with
# PIPESHARD_TEST_BACKEND=cuda).
gpu_tests, gpu_runs = {}, {}
try:
    doc = json.load(open(os.environ["DC_TESTS_JSON"]))
    for t in doc.get("tests", []):
        cmd = t.get("command") or []
        # Only tests that run one of our binaries directly: a test launched through another
        # program (cuda_nccl_comm_np1 through mpiexec) would be run as bin/mpiexec, which is
        # not there; its executable is run directly below, as one ctest did not list.
        if not (cmd and os.access(os.path.join(bindir, os.path.basename(cmd[0])), os.X_OK)):
            continue
        exe = os.path.basename(cmd[0])
        env = []
        for p in t.get("properties", []):
            if p.get("name") == "ENVIRONMENT":
                env = p.get("value") or []
                env = [env] if isinstance(env, str) else env
        run = t["name"] if env else exe
        gpu_runs[run] = {"exe": exe, "env": env}
        gpu_tests.setdefault(run, []).append(t["name"])
except (OSError, ValueError):
    pass
for t in built:  # a GPU test executable that ctest did not list still runs
    if t.startswith("cuda_") and t.endswith("_test"):
        gpu_tests.setdefault(t, [])
        gpu_runs.setdefault(t, {"exe": t, "env": []})
manifest = {"source_dir": os.environ["DC_ROOT"], "build_dir": os.path.join(os.environ["DC_ROOT"], os.environ["DC_BUILD"]),
            "commit": os.environ["DC_COMMIT"], "modified_tracked_files": int(os.environ["DC_DIRTY"] or 0),
            "built": built, "failed": failed, "gpu_tests": gpu_tests, "gpu_runs": gpu_runs, "nvcc": os.environ["DC_NVCC"],
            "cxx": os.environ["DC_CXX"], "uname": " ".join(os.uname())}
json.dump(manifest, open(sys.argv[1], "w"), indent=1)
EOF
}

# Non-CUDA shared libraries the built binaries load, copied (links followed) into $BUILD/devlib;
# libstdc++ and libgcc_s into $BUILD/devlib-compat (used on the GPU machine only if its own are
# older than ours). Never carried: glibc (libc, libm, ld-linux, ...) and the CUDA libraries.
collect_libraries() {
  rm -rf "$BUILD/devlib" "$BUILD/devlib-compat"
  mkdir -p "$BUILD/devlib" "$BUILD/devlib-compat"
  local f name path
  for f in "$BUILD"/bin/*; do
    [ -x "$f" ] && head -c 4 "$f" | grep -q ELF || continue
    ldd "$f" 2>/dev/null | awk '/=> \//{print $1, $3}'
  done | sort -u | while read -r name path; do
    case $name in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libresolv.so*|ld-linux*|libutil.so*) ;;
      libcuda.so*|libcudart.so*|libcublas*|libcudnn*|libnccl*|libnvrtc*|libnvJitLink*|libcusparse*|libcufft*|libcurand*|libcusolver*|libnvidia*) ;;
      libstdc++.so*|libgcc_s.so*) cp -L "$path" "$BUILD/devlib-compat/$name" ;;
      *) cp -L "$path" "$BUILD/devlib/$name" ;;
    esac
  done
}

max_symbol_version() {  # max_symbol_version PREFIX FILES...: e.g. GLIBC_2.34
  local prefix=$1
  shift
  command -v objdump >/dev/null || { echo "?"; return; }
  for f in "$@"; do objdump -T "$f" 2>/dev/null; done | grep -oE "\b${prefix}_[0-9.]+\b" | sort -uV | tail -1
}

prepare() {
  LOG=/dev/null
  local blog=$BUILD/prepare_build.log
  mkdir -p "$BUILD"
  : >"$blog"
  find_pythons
  command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] ||
    { echo "device_check --prepare: no nvcc here (/usr/local/cuda/bin/nvcc): the GPU code cannot be built" >&2; exit 2; }
  say "configuring and building $BUILD (log: $blog)"
  if ! build_tree 900 3600 "$(nproc)" "$blog"; then
    echo "device_check --prepare: $BUILD_WHY" >&2
    exit 2
  fi
  collect_libraries
  # Open MPI's launcher and runtime, relocatable: the GPU machine has no mpirun, and several
  # processes on its GPU need one (tools/device_multirank.sh).
  say "packing Open MPI (tools/openmpi_bundle.sh)"
  bash tools/openmpi_bundle.sh "$BUILD/openmpi" || { echo "device_check --prepare: the Open MPI bundle failed" >&2; exit 2; }
  "${PY_ANY:-python3}" - "$MANIFEST" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
print(f"built: {', '.join(m['built'])}")
for t, why in m["failed"].items():
    print(f"NOT built: {t}: {why}")
print("GPU tests per executable: " + (", ".join(f"{k} ({len(v)})" for k, v in m["gpu_tests"].items()) or "none built"))
EOF
  local bins=("$BUILD"/bin/*) libs=("$BUILD"/devlib/* "$BUILD"/devlib-compat/*)
  say "needs on the GPU machine: glibc >= $(max_symbol_version GLIBC "${bins[@]}" "$BUILD"/devlib/*), libstdc++ with $(max_symbol_version GLIBCXX "${bins[@]}" "$BUILD"/devlib/*) (else devlib-compat is used)"
  mkdir -p "$BUNDLE_DIR"
  rm -f "$BUNDLE"
  say "packing $BUNDLE (xz)"
  tar -C "$BUILD" -cJf "$BUNDLE" bin devlib devlib-compat openmpi device_manifest.json || { echo "device_check: tar failed" >&2; exit 2; }
  local tree_bytes bundle_bytes
  tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
  bundle_bytes=$(stat -c %s "$BUNDLE")
  echo
  echo "sizes (MiB): binaries $(du -cb "${bins[@]}" | tail -1 | awk '{printf "%.1f", $1/1048576}')," \
       "libraries $(du -cb "${libs[@]}" | tail -1 | awk '{printf "%.1f", $1/1048576}') raw"
  du -b "$BUILD"/devlib/* "$BUILD"/devlib-compat/* | sort -n | awk '{printf "  %8.2f  %s\n", $1/1048576, $2}'
  awk -v t="$tree_bytes" -v b="$bundle_bytes" -v lim="$CARRY_LIMIT_MIB" 'BEGIN {
    printf "bundle %.1f MiB + working tree %.1f MiB = %.1f MiB of the %d MiB the device tool carries\n",
      b/1048576, t/1048576, (b+t)/1048576, lim; exit ((b+t)/1048576 > lim) }' ||
    { echo "device_check: over the carry limit" >&2; exit 2; }
  echo
  echo "Now call the device tool: run(command=\"bash tools/device_check.sh\", carry=[\"$BUNDLE_DIR\"], timeout_s=360)"
}

if [ "$MODE" = prepare ]; then
  prepare
  exit 0
fi

# ======================================================================================= device
if [ -z "${OUT:-}" ]; then
  OUT=$ROOT/device_check_out
  echo "device_check: OUT is not set; writing to $OUT"
fi
mkdir -p "$OUT" || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/device_check.XXXXXX")
mkdir -p "$WORK/tests" "$WORK/bench" "$WORK/multirank"
LOG=$WORK/device_check.log
: >"$LOG"
BLOG=$WORK/build.log TLOG=$WORK/tests.log ENVF=$WORK/env.txt
: >"$BLOG"
: >"$TLOG"
STATE=$WORK/state.env  # facts for the report, KEY=value lines
: >"$STATE"
fact() { printf '%s=%s\n' "$1" "$(printf '%s' "$2" | tr '\n' ' ' | head -c 2000)" >>"$STATE"; }
phase_start=$(elapsed)
phase_done() { fact "PHASE_$1" "$(( $(elapsed) - phase_start ))"; phase_start=$(elapsed); }

say "pipeshard device check in $ROOT; results to $OUT; budget ${BUDGET_S}s"

# ---- 1. the machine ---------------------------------------------------------------------------
probe() {  # probe TITLE CMD...: one section of env.txt
  local title=$1
  shift
  { echo "## $title: $*"; timeout -k 2 20 "$@" 2>&1 | head -200; echo "(exit status ${PIPESTATUS[0]})"; echo; } >>"$ENVF"
}
{
  echo "# device_check env, $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo
} >"$ENVF"
probe "kernel" uname -a
probe "OS" cat /etc/os-release
probe "glibc" ldd --version
probe "CPU and memory" sh -c 'nproc; grep -m1 "model name" /proc/cpuinfo; grep -E "MemTotal|MemAvailable" /proc/meminfo; df -h /tmp .'
# The driver's tools may sit off the PATH (the lent machines mount the driver at /usr/local/nvidia):
# without nvidia-smi the whole check would take the machine for one without a GPU.
if ! command -v nvidia-smi >/dev/null && [ -x /usr/local/nvidia/bin/nvidia-smi ]; then
  export PATH=$PATH:/usr/local/nvidia/bin
fi
probe "nvidia-smi" nvidia-smi
probe "nvidia-smi query" nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
probe "nvcc" sh -c 'command -v nvcc || ls /usr/local/cuda/bin/nvcc; (nvcc --version || /usr/local/cuda/bin/nvcc --version)'
probe "tools" sh -c 'for t in cmake ctest ninja g++ c++ gcc clang++ mpirun mpiexec git xz objdump python3; do printf "%-8s %s\n" $t "$(command -v $t || echo MISSING)"; done; cmake --version | head -1; g++ --version | head -1'
probe "CUDA libraries in the loader cache" sh -c 'ldconfig -p | grep -E "libcuda\.|libcudart|libcublas|libnccl" || echo none'
probe "CUDA folders" sh -c 'ls -d /usr/local/cuda* /usr/local/nvidia 2>&1; ls /usr/local/cuda/lib64 2>/dev/null | grep -E "cudart|cublas|nccl" | head'

GPU_OK=0
GPU_WHY=
if ! command -v nvidia-smi >/dev/null; then
  GPU_WHY="nvidia-smi not found"
elif ! SMI_L=$(timeout 20 nvidia-smi -L 2>&1) || ! grep -q '^GPU 0' <<<"$SMI_L"; then
  GPU_WHY="nvidia-smi -L lists no GPU: $(head -c 200 <<<"$SMI_L")"
else
  GPU_OK=1
  fact GPU_NAME "$(timeout 20 nvidia-smi --query-gpu=name --format=csv,noheader -i 0)"
  fact GPU_MEMORY "$(timeout 20 nvidia-smi --query-gpu=memory.total --format=csv,noheader -i 0)"
  fact GPU_DRIVER "$(timeout 20 nvidia-smi --query-gpu=driver_version --format=csv,noheader -i 0)"
  fact GPU_CUDA_DRIVER "$(timeout 20 nvidia-smi | grep -oE 'CUDA Version: [0-9.]+' | head -1)"
  fact GPU_COUNT "$(grep -c '^GPU ' <<<"$SMI_L")"
fi
fact GPU_OK "$GPU_OK"
fact GPU_WHY "$GPU_WHY"
fact NVCC "$( (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>/dev/null | tail -1)"
fact OS "$(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-unknown}")"
fact GLIBC "$(ldd --version 2>/dev/null | head -1)"
fact HOST "$(uname -m), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
find_pythons
fact PY_TORCH "$PY_TORCH"
fact PY_ANY "$PY_ANY"
if [ -n "$PY_TORCH" ]; then
  fact TORCH "$(timeout 60 "$PY_TORCH" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available" if torch.cuda.is_available() else "no GPU")' 2>&1 | tail -1)"
else
  fact TORCH "$TORCH_NOTE"
fi
fact MPIRUN "$(command -v mpirun || echo 'not found')"
if [ "$GPU_OK" = 1 ]; then say "GPU: $(grep -m1 '^GPU 0' <<<"$SMI_L")"; else say "no usable GPU: $GPU_WHY; the GPU parts are skipped"; fi
say "python with torch: ${PY_TORCH:-none} ($(grep '^TORCH=' "$STATE" | cut -d= -f2-))"
phase_done probe

# ---- report (rewritten after every phase, so a run cut short still leaves one) ----------------
write_report() {
  [ -n "$PY_ANY" ] || {
    { echo "# pipeshard device check"; echo; echo "No python3 on this machine: raw facts only."; echo; cat "$STATE"; } >"$OUT/device_check.md"
    return
  }
  DC_STATE="$STATE" DC_WORK="$WORK" DC_OUT="$OUT" DC_MANIFEST="$ROOT/$MANIFEST" DC_FINAL="${1:-0}" \
  timeout 60 "$PY_ANY" tools/device_check_report.py || say "warning: the report writer failed"
}
write_report 0

# ---- 2. the build ----------------------------------------------------------------------------
BUILD_READY=0
BUILD_NOTE=
BUILD_WHY=
if [ "$FORCE_BUILD_THERE" = 0 ] && [ -f "$BUNDLE" ]; then
  say "unpacking the carried bundle $BUNDLE ($(du -h "$BUNDLE" | cut -f1))"
  rm -rf "$BUILD/bin" "$BUILD/devlib" "$BUILD/devlib-compat" "$BUILD/openmpi"
  if command -v xz >/dev/null && run_logged 60 "$BLOG" tar -C "$BUILD" -xJf "$BUNDLE"; then
    :
  elif [ -n "$PY_ANY" ] && run_logged 60 "$BLOG" "$PY_ANY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$BUNDLE" "$BUILD"; then
    :
  else
    BUILD_WHY="could not unpack $BUNDLE (see build.log)"
  fi
  if [ -x "$BUILD/bin/train" ] && [ -f "$MANIFEST" ]; then
    BUILD_READY=1
    BUILD_NOTE="carried: binaries built on the prepare machine (tools/device_check.sh --prepare), unpacked from $BUNDLE"
  fi
elif [ "$FORCE_BUILD_THERE" = 0 ] && [ -x "$BUILD/bin/train" ] && [ -f "$MANIFEST" ]; then
  BUILD_READY=1
  BUILD_NOTE="present: $BUILD/bin (carried unpacked, or built here before)"
fi
if [ "$BUILD_READY" = 0 ]; then
  reason=${BUILD_WHY:-no carried bundle ($BUNDLE)}
  if command -v cmake >/dev/null && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } &&
     { command -v c++ >/dev/null || command -v g++ >/dev/null; }; then
    tc=$(step_timeout 90 200) tb=$(step_timeout 240 150)
    if (( tc > 0 && tb > 0 )); then
      say "$reason: building here (configure ${tc}s, build ${tb}s at most; log: build.log)"
      if build_tree "$tc" "$tb" "$(nproc)" "$BLOG"; then
        BUILD_READY=1
        BUILD_NOTE="built here ($reason)"
      else
        BUILD_NOTE="none: $reason, and building here failed: $BUILD_WHY"
      fi
    else
      BUILD_NOTE="none: $reason, and too little time is left to build here"
    fi
  else
    BUILD_NOTE="none: $reason, and this machine cannot build (cmake: $(command -v cmake || echo missing), nvcc: $(command -v nvcc || echo missing), c++: $(command -v c++ || echo missing))"
  fi
fi
say "build: $BUILD_NOTE"
fact BUILD_NOTE "$BUILD_NOTE"

# The binaries hold the paths of the tree they were built in (tests read data and run train
# through them): where that tree is not here, it becomes a link to this one.
OURS_LD=
if [ "$BUILD_READY" = 1 ]; then
  src=$("${PY_ANY:-python3}" -c 'import json,sys; print(json.load(open(sys.argv[1]))["source_dir"])' "$MANIFEST" 2>/dev/null)
  if [ -n "$src" ] && [ "$src" != "$ROOT" ] && [ ! -e "$src" ]; then
    if mkdir -p "$(dirname "$src")" 2>/dev/null && ln -s "$ROOT" "$src" 2>/dev/null; then
      say "linked $src -> $ROOT (the build tree's own path, which its binaries use)"
    else
      say "warning: cannot link $src -> $ROOT; tests that read files through the build's paths will fail"
    fi
  fi
  # LD_LIBRARY_PATH for our binaries (never for PyTorch): the carried libraries first, then the
  # folders that hold the CUDA libraries they need, from this machine (/usr/local/cuda, the CUDA
  # pip packages beside torch, the driver's folder).
  # DEVICE_CHECK_LIB_DIRS (colon-separated) adds folders to search first.
  IFS=: read -r -a cuda_dirs <<<"${DEVICE_CHECK_LIB_DIRS:-}"
  cuda_dirs+=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda/lib /usr/local/nvidia/lib64 /usr/local/nvidia/lib)
  if [ -n "$PY_TORCH" ]; then
    while IFS= read -r d; do cuda_dirs+=("$d"); done < <(timeout 30 "$PY_TORCH" -c '
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "*", "lib")) + glob.glob(os.path.join(r, "*", "*", "lib"))):
        print(d)
try:
    import torch
    print(os.path.join(os.path.dirname(torch.__file__), "lib"))
except Exception:
    pass' 2>/dev/null)
  fi
  OURS_LD=$ROOT/$BUILD/devlib
  missing_libs() {  # sonames our binaries cannot load with LD_LIBRARY_PATH=$OURS_LD ("all": cuDNN's bench too)
    for f in "$BUILD"/bin/*; do
      [ -x "$f" ] && head -c 4 "$f" | grep -q ELF || continue
      # The cuDNN race is optional: its libraries are looked for, but without cuDNN here it
      # reports "not run" (gpu_vs_pytorch.py) instead of failing the loader check.
      [ "${1:-}" != all ] && [ "$(basename "$f")" = bench_kernels_cudnn ] && continue
      LD_LIBRARY_PATH=$OURS_LD timeout 20 ldd "$f" 2>&1
    done | awk '/=> not found/ {print $1}' | sort -u
  }
  for lib in $(missing_libs all); do
    for d in "${cuda_dirs[@]}"; do
      if [ -e "$d/$lib" ]; then
        case ":$OURS_LD:" in *":$d:"*) ;; *) OURS_LD=$OURS_LD:$d ;; esac
        echo "found $lib in $d" >>"$BLOG"
        break
      fi
    done
  done
  version_errors=$(for f in "$BUILD"/bin/*; do [ -x "$f" ] && head -c 4 "$f" | grep -q ELF && LD_LIBRARY_PATH=$OURS_LD timeout 20 ldd "$f" 2>&1; done | grep -oE "version \`[A-Z]+_[0-9.]+' not found" | sort -u | tr '\n' ' ')
  if grep -qE 'GLIBCXX|CXXABI|GCC_' <<<"$version_errors"; then
    OURS_LD=$ROOT/$BUILD/devlib-compat:$OURS_LD
    say "this machine's libstdc++ is older than the build's ($version_errors): using the carried one"
    version_errors=$(for f in "$BUILD"/bin/*; do [ -x "$f" ] && head -c 4 "$f" | grep -q ELF && LD_LIBRARY_PATH=$OURS_LD timeout 20 ldd "$f" 2>&1; done | grep -oE "version \`[A-Z]+_[0-9.]+' not found" | sort -u | tr '\n' ' ')
  fi
  still=$(missing_libs | tr '\n' ' ')
  { echo "LD_LIBRARY_PATH for our binaries: $OURS_LD"; for f in "$BUILD"/bin/*; do [ -x "$f" ] && head -c 4 "$f" | grep -q ELF && { echo "## ldd $f"; LD_LIBRARY_PATH=$OURS_LD timeout 20 ldd "$f" 2>&1; }; done; } >>"$BLOG"
  if [ -n "$still$version_errors" ]; then
    LOADER_NOTE="cannot load: ${still:+missing $still}${version_errors:+ $version_errors}(this machine: $(ldd --version 2>/dev/null | head -1))"
  elif LD_LIBRARY_PATH=$OURS_LD timeout 20 "$BUILD/bin/train" --help >/dev/null 2>>"$BLOG"; then
    LOADER_NOTE="ok: every binary loads; LD_LIBRARY_PATH for ours = $OURS_LD"
  else
    LOADER_NOTE="train --help failed (see build.log)"
  fi
  say "loader: $LOADER_NOTE"
  fact LOADER_NOTE "$LOADER_NOTE"
fi
phase_done build
write_report 0

# ---- 3. GPU tests -----------------------------------------------------------------------------
TEST_EXES=()
TESTS_FAILED=0
if [ "$BUILD_READY" = 1 ]; then
  mapfile -t TEST_EXES < <("${PY_ANY:-python3}" -c 'import json,sys; [print(t) for t in json.load(open(sys.argv[1]))["gpu_tests"] if t]' "$MANIFEST" 2>/dev/null)
  [ "$GPU_OK" = 1 ] || fact TESTS_NOTE "No usable GPU here: the GPU tests run all the same and skip, saying so (this checks the plumbing)."
  for exe in "${TEST_EXES[@]}"; do  # each a run of the manifest: an executable and its environment
    t=$(step_timeout 120 170)  # leave the benchmarks (the targets) their ~150 s
    if (( t == 0 )); then say "tests: out of time before $exe"; fact "TEST_RC_$exe" "not run: out of time"; continue; fi
    mapfile -t run_env < <("${PY_ANY:-python3}" -c 'import json,sys; r=json.load(open(sys.argv[1])).get("gpu_runs",{}).get(sys.argv[2],{}); print(r.get("exe", sys.argv[2])); [print(e) for e in r.get("env", [])]' "$MANIFEST" "$exe" 2>/dev/null)
    bin_name=${run_env[0]:-$exe}
    say "tests: $exe (bin/$bin_name${run_env[1]:+ with ${run_env[*]:1}}; timeout ${t}s)"
    (
      cd "$ROOT/$BUILD" || exit 2
      for setting in "${run_env[@]:1}"; do export "${setting?}"; done
      LD_LIBRARY_PATH=$OURS_LD run_logged "$t" "$WORK/tests/$exe.out" "bin/$bin_name" --gtest_output="json:$WORK/tests/$exe.json"
    )
    rc=$?
    cat "$WORK/tests/$exe.out" >>"$TLOG"
    fact "TEST_RC_$exe" "$rc"
    if (( rc != 0 )); then TESTS_FAILED=1; say "  $exe: exit status $rc (see tests.log)"; fi
  done
  (( ${#TEST_EXES[@]} == 0 )) && fact TESTS_NOTE "No GPU test executable was built (see the targets not built above)."
else
  fact TESTS_NOTE "Not run: no build ($BUILD_NOTE)."
fi
fact TEST_EXES "$(printf '%s\n' "${TEST_EXES[@]}" | "${PY_ANY:-python3}" -c 'import json,sys; print(json.dumps([l.strip() for l in sys.stdin if l.strip()]))' 2>/dev/null)"
phase_done tests
write_report 0

# ---- 3b. several processes on the GPU ---------------------------------------------------------
# tools/device_multirank.sh under the carried Open MPI (or this machine's mpirun): every layout
# with its processes sharing the GPU, each checked against one CPU process. Before the
# benchmarks, with at most 75 s, so that the benchmarks keep their share of the budget. Without a
# GPU it runs on the CPU backend instead, which checks the plumbing (the bundle's mpirun).
MULTIRANK_FAILED=0
if [ "$BUILD_READY" = 1 ]; then
  mpi_env=
  if [ -f "$BUILD/openmpi/openmpi-env.sh" ]; then mpi_env=$ROOT/$BUILD/openmpi/openmpi-env.sh; fi
  t=$(step_timeout 75 200)
  if [ -z "$mpi_env" ] && ! command -v mpirun >/dev/null; then
    fact MULTIRANK_NOTE "Not run: no mpirun here and no Open MPI bundle was carried ($BUILD/openmpi)."
  elif (( t < 25 )); then
    fact MULTIRANK_NOTE "Not run: out of time."
  else
    device=cuda
    if [ "$GPU_OK" = 1 ]; then
      fact MULTIRANK_NOTE "train --device cuda under mpirun (${mpi_env:+the carried Open MPI, }$(if [ -n "$mpi_env" ]; then echo "$BUILD/openmpi"; else command -v mpirun; fi)), all processes on this machine's $(grep '^GPU_COUNT=' "$STATE" | cut -d= -f2) GPU(s), exchanging through host memory (staged); each layout against one process on the same GPU in the same precision with --check-equivalence 4 (bound 1e-5, or the row's own for bf16/fp16); the one-process row shows whether the GPU repeats itself."
    else
      device=cpu
      fact MULTIRANK_NOTE "No usable GPU: the same layouts on the CPU backend, staged, as a plumbing check of the carried mpirun (not a GPU result)."
    fi
    say "several processes: tools/device_multirank.sh on $device (timeout ${t}s)"
    (
      [ -n "$mpi_env" ] && . "$mpi_env"
      export DEVICE_MULTIRANK_DEVICE=$device
      run_logged $(( t + 10 )) "$WORK/multirank/runner.log" \
        bash tools/device_multirank.sh "$ROOT/$BUILD/bin" "$WORK/multirank/results.md" "$t" "$OURS_LD"
    )
    rc=$?
    (( rc != 0 )) && { MULTIRANK_FAILED=1; say "several processes: exit status $rc (see multirank logs in logs.tar.gz)"; }
  fi
fi
phase_done multirank
write_report 0

# ---- 4. benchmarks ----------------------------------------------------------------------------
BENCH_WRONG=0 BENCH_FAILED=0 BENCH_CHECKED=0
if [ -z "$PY_TORCH" ] && [ -z "$PY_ANY" ]; then
  fact BENCH_NOTE "Not run: no python3 on this machine."
else
  py=${PY_TORCH:-$PY_ANY}
  [ -z "$PY_TORCH" ] && fact BENCH_NOTE "PyTorch is absent here ($TORCH_NOTE): only our side runs; its columns say so."
  if [ "$GPU_OK" = 1 ]; then
    t=$(step_timeout 260 25)
    # The runner stops starting runs 30 s before its timeout: room for the run in flight to
    # be cut to the budget, and for the report to be written.
    args=(--budget-s $(( t > 40 ? t - 30 : t )))
  else
    t=$(step_timeout 90 25)
    args=(--smoke-cpu --budget-s $(( t > 30 ? t - 20 : t )))
    fact BENCH_NOTE "No usable GPU: the GPU benchmarks did not run. Below is the CPU smoke of bench/gpu_vs_pytorch.py (tiny models, ours on the CPU backend, PyTorch on the CPU): it checks the plumbing — model generation, train, the PyTorch side, the step-1 loss agreement — and its figures are not benchmarks.${PY_TORCH:+}"
  fi
  if (( t > 0 )); then
    say "benchmarks: $py bench/gpu_vs_pytorch.py ${args[*]} (timeout ${t}s)"
    PYTHONUNBUFFERED=1 run_logged "$t" "$WORK/bench/runner.log" "$py" bench/gpu_vs_pytorch.py --bin-dir "$ROOT/$BUILD/bin" \
      --out "$WORK/bench" --ours-ld-path "$OURS_LD" "${args[@]}"
    rc=$?
    (( rc != 0 )) && say "benchmarks: exit status $rc (see bench.log)"
    grep -q 'WRONG' "$WORK/bench/bench.md" 2>/dev/null && BENCH_WRONG=1
    # Runs that failed (ours or PyTorch), and whether any loss agreement was checked at all.
    BENCH_FAILED=$(grep -o 'failed (' "$WORK/bench/bench.md" 2>/dev/null | wc -l)
    BENCH_CHECKED=$(grep -c '(ok, tolerance' "$WORK/bench/bench.md" 2>/dev/null)
    (( rc != 0 )) && (( BENCH_FAILED == 0 )) && BENCH_FAILED=1
  else
    fact BENCH_NOTE "Not run: out of time."
  fi
fi
phase_done bench

# ---- 5. results -------------------------------------------------------------------------------
# What did not run on a machine with a GPU (out of time, no PyTorch, a generation that
# failed): "ok" is for a check where everything ran.
INCOMPLETE=()
n=$(grep -c '^TEST_RC_[^=]*=not run' "$STATE" 2>/dev/null)
(( n > 0 )) && INCOMPLETE+=("$n GPU test executables not run")
grep -q '^MULTIRANK_NOTE=Not run' "$STATE" 2>/dev/null && INCOMPLETE+=("the several-process layouts not run")
n=$(grep -c '| not run' "$WORK/multirank/results.md" 2>/dev/null)
(( n > 0 )) && INCOMPLETE+=("$n several-process layouts not run")
grep -q '^BENCH_NOTE=Not run' "$STATE" 2>/dev/null && INCOMPLETE+=("the benchmarks not run")
n=$(grep -oE 'not run|generation failed' "$WORK/bench/bench.md" 2>/dev/null | wc -l)
(( n > 0 )) && INCOMPLETE+=("$n benchmark entries not run or not generated (see the tables)")
(( BENCH_CHECKED == 0 )) && INCOMPLETE+=("no benchmark loss agreement checked")
FAILED=0
if (( TESTS_FAILED || BENCH_WRONG || BENCH_FAILED || MULTIRANK_FAILED )); then
  FAILED=1
  VERDICT="FAILED:$( ((TESTS_FAILED)) && echo ' GPU tests failed;')$( ((MULTIRANK_FAILED)) && echo ' a several-process layout failed or was not equivalent;')$( ((BENCH_WRONG)) && echo ' a benchmark correctness check said WRONG;')$( ((BENCH_FAILED)) && echo " $BENCH_FAILED benchmark runs failed (see bench.log);")"
  VERDICT=${VERDICT%;}
  [ "$GPU_OK" = 0 ] && VERDICT="dry run (no usable GPU: $GPU_WHY), plumbing $VERDICT"
elif [ "$GPU_OK" = 1 ] && [ "$BUILD_READY" = 1 ] && (( ${#INCOMPLETE[@]} > 0 )); then
  VERDICT="incomplete: nothing failed, but $(IFS=';'; echo "${INCOMPLETE[*]}" | sed 's/;/; /g')"
elif [ "$GPU_OK" = 1 ] && [ "$BUILD_READY" = 1 ]; then
  VERDICT="ok: GPU tests passed (or skipped), the several-process layouts were equivalent, every benchmark ran, correctness checks ok"
elif [ "$GPU_OK" = 0 ] && (( BENCH_CHECKED > 0 )); then
  VERDICT="dry run: no usable GPU ($GPU_WHY); GPU parts skipped; plumbing ok (bundle unpacked, binaries load, GPU tests run where built, the CPU smoke's losses agree with PyTorch)"
elif [ "$GPU_OK" = 0 ]; then
  VERDICT="dry run: no usable GPU ($GPU_WHY); GPU parts skipped; the plumbing smoke checked nothing (no build or no PyTorch)"
else
  VERDICT="incomplete: no build ($BUILD_NOTE)"
fi
fact VERDICT "$VERDICT"
fact TOTAL_S "$(elapsed)"
say "verdict: $VERDICT"
cat "$WORK/bench/runner.log" >"$WORK/bench.log" 2>/dev/null
cat "$WORK/bench/bench.log" >>"$WORK/bench.log" 2>/dev/null
write_report 1
cp "$LOG" "$OUT/device_check.log"
cp "$ENVF" "$OUT/env.txt"
cp "$BLOG" "$OUT/build.log"
cp "$TLOG" "$OUT/tests.log"
cp "$WORK/bench.log" "$OUT/bench.log" 2>/dev/null || : >"$OUT/bench.log"
tar -C "$WORK" -czf "$OUT/logs.tar.gz" tests bench multirank state.env 2>/dev/null
rm -rf "$WORK"
echo
cat "$OUT/device_check.md"
(( FAILED )) && exit 1
exit 0
