#!/usr/bin/env bash
# The main job on the bundled default: install, build, then cut the course's
# SimpleModel into 2 pipeline stages and print the per-stage table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh >/dev/null
echo
build/bin/partition models/simple.onnx --stages 2 --out build/demo/simple_stages
echo
echo "The course's PipelineParallel model, split optimally (the course cut it by hand into 183,040 + 34,186):"
build/bin/partition models/pipeline_parallel.onnx --stages 2 --out build/demo/pipeline_parallel_stages
