#!/usr/bin/env bash
# Installs what pipeshard needs to build and test on Debian 12: Debian packages through
# apt, and onnxruntime-node (the tests' independent ONNX runtime) through npm.
# Idempotent: quiet and quick when everything is already there. Run as root (or with sudo).
# The CUDA toolkit is optional and not installed here: where /usr/local/cuda exists,
# CMake builds the CUDA sources too.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  cmake g++ make                                   # toolchain
  libonnx-dev libprotobuf-dev protobuf-compiler    # ONNX model files
  libopenmpi-dev openmpi-bin libopenblas-dev       # processes and BLAS (comm/, backend/cpu/)
  libcli11-dev nlohmann-json3-dev libfmt-dev       # command line, plan.json, output
  libgtest-dev libgmock-dev libonnx-testdata      # tests (ONNX's own backend node tests)
  python3-matplotlib                               # pictures: partition --chart, train --plot
  python3-torch python3-onnx                       # the README's own-model recipe, run by a test
  clang-14 libclang-rt-14-dev libomp-14-dev        # fuzz targets (libFuzzer, sanitizers): scripts/fuzz_replay.sh
  clang-format-14                                  # the house format (.clang-format): scripts/format.sh
  python3-dev pybind11-dev python3-numpy           # the Python package (python/): import pipeshard
  python3-pytest                                   # its tests (tests/python/)
  python3-venv python3-pip                         # `pip install .` into a venv (setup.py), offline:
  python3-setuptools python3-wheel                 # pip builds with these instead of downloading them
  python3-tqdm                                     # pipeshard.train's progress bar (its tests draw one)
)
# Node.js and npm run onnxruntime-node in the tests; a machine may already have them
# from elsewhere (NodeSource bundles npm), and Debian's npm would conflict with that.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  packages+=(nodejs npm)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "install-deps: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

node_major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$node_major" -lt 18 ]; then
  echo "install-deps: Node.js $node_major is too old for onnxruntime-node; need 18 or newer" >&2
  exit 1
fi
# onnxruntime-node's install script would fetch CUDA binaries from elsewhere; the CPU
# binaries it needs ship inside the npm package, so skip that step.
if [ ! -f tests/ort/node_modules/onnxruntime-node/package.json ] ||
   [ tests/ort/package-lock.json -nt tests/ort/node_modules/.package-lock.json ]; then
  echo "install-deps: installing onnxruntime-node into tests/ort"
  ONNXRUNTIME_NODE_INSTALL=skip npm ci --prefix tests/ort --no-audit --no-fund --loglevel=error
fi
