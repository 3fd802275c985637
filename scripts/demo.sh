#!/usr/bin/env bash
# The main job on the bundled default: install, build, cut the course's SimpleModel
# into 2 pipeline stages (printing the per-stage table), then train the course model
# on the bundled handwritten digits and show loss and accuracy falling.
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
echo "Training the course model (Linear(64,256) ReLU Linear(256,128) ReLU Linear(128,10)) on the digits;"
echo "every 6th sample is held out for evaluation:"
build/bin/train models/simple_digits.onnx \
  --data data/digits_train_features.npy --labels data/digits_train_labels.npy \
  --eval-data data/digits_test_features.npy --eval-labels data/digits_test_labels.npy \
  --optimizer adamw --lr 0.003 --batch-size 64 --epochs 5 --seed 1 \
  --metrics build/demo/metrics.jsonl --save build/demo/simple_digits_trained.onnx
