#!/usr/bin/env bash
# The main job on the bundled default: install, build, cut the course's SimpleModel
# into 2 pipeline stages (printing the per-stage table), then train the course model
# on the bundled handwritten digits across 2 processes as 2 pipeline stages, showing
# loss and accuracy falling, and prove that layout equal to one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh >/dev/null
echo
build/bin/partition models/simple.onnx --stages 2 --out build/demo/simple_stages
echo
echo "The course's PipelineParallel model, split optimally (the course cut it by hand into 183,040 + 34,186):"
build/bin/partition models/pipeline_parallel.onnx --stages 2 --out build/demo/pipeline_parallel_stages
echo
# Open MPI refuses to run as root unless told that it is meant.
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
mpirun=(mpirun -np 2 --oversubscribe)
echo "Training the course model (Linear(64,256) ReLU Linear(256,128) ReLU Linear(128,10)) on the digits"
echo "across 2 processes as 2 pipeline stages (1F1B, 4 micro-batches); every 6th sample is held out:"
"${mpirun[@]}" build/bin/train models/simple_digits.onnx --stages 2 --micro-batches 4 \
  --data data/digits_train_features.npy --labels data/digits_train_labels.npy \
  --eval-data data/digits_test_features.npy --eval-labels data/digits_test_labels.npy \
  --optimizer adamw --lr 0.003 --batch-size 64 --epochs 5 --seed 1 \
  --metrics build/demo/metrics.jsonl --save build/demo/simple_digits_trained.onnx \
  --trace build/demo/trace.json
echo
echo "The same layout against one process on the same data, step for step:"
"${mpirun[@]}" build/bin/train models/simple_digits.onnx --stages 2 --micro-batches 4 \
  --data data/digits_train_features.npy --labels data/digits_train_labels.npy \
  --optimizer adamw --lr 0.003 --batch-size 64 --seed 1 --check-equivalence 20
