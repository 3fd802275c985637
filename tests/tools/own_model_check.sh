#!/usr/bin/env bash
# README.md's "Bring your own PyTorch model", end to end, with the README's commands:
# docs/examples/own_model.py exports its MLP in training mode at batch 1, train trains it at
# batch 32 and saves it, and own_model.py reads the saved file back into PyTorch, whose eval
# loss and accuracy must be the ones train printed for its last epoch. Also: an eval-mode
# export has no Dropout, an older opset's training export (decomposed LayerNorm) trains, and
# float32 targets train with --loss mse. Exit 77 (skipped) where the interpreter
# (PIPESHARD_PYTHON, default /usr/bin/python3) lacks torch or onnx.
#   own_model_check.sh SOURCE_DIR TRAIN SCRATCH
set -euo pipefail
src=$1 train=$2 dir=$3
python=${PIPESHARD_PYTHON:-/usr/bin/python3}
if ! "$python" -c "import torch, onnx" 2>/dev/null; then
  echo "own_model_check: skipped: $python cannot import torch and onnx (Debian: python3-torch python3-onnx)"
  exit 77
fi
rm -rf "$dir"
example="$src/docs/examples/own_model.py"
fail() {
  echo "own_model_check: $*" >&2
  exit 1
}

"$python" "$example" export "$dir" 2>/dev/null
"$train" "$dir/model.onnx" --data "$dir/features.npy" --labels "$dir/labels.npy" \
  --eval-data "$dir/eval_features.npy" --eval-labels "$dir/eval_labels.npy" \
  --optimizer adamw --lr 0.01 --batch-size 32 --epochs 5 --save "$dir/trained.onnx" 2>"$dir/train.log"
ours=$(grep '^epoch 5:' "$dir/train.log") || fail "train printed no 'epoch 5:' line: $(cat "$dir/train.log")"
loaded=$("$python" "$example" load "$dir") || fail "own_model.py load failed"
theirs=$(grep '^PyTorch on the eval set:' <<<"$loaded")
echo "$loaded"
echo "train printed: $ours"
# Both print 4 decimals of nearly the same float32 sum; one unit of the last digit apart at most.
awk -v a="$ours" -v b="$theirs" 'BEGIN {
  if (!match(a, /eval loss [0-9.]+/)) exit 1; la = substr(a, RSTART + 10, RLENGTH - 10)
  if (!match(a, /eval accuracy [0-9.]+/)) exit 1; aa = substr(a, RSTART + 14, RLENGTH - 14)
  if (!match(b, /loss [0-9.]+/)) exit 1; lb = substr(b, RSTART + 5, RLENGTH - 5)
  if (!match(b, /accuracy [0-9.]+/)) exit 1; ab = substr(b, RSTART + 9, RLENGTH - 9)
  d = la - lb; if (d < 0) d = -d
  exit !(d <= 0.00011 && aa == ab)
}' || fail "PyTorch's eval loss and accuracy of the saved model are not train's"

exported=$("$python" "$example" export "$dir/eval_mode" --eval-mode 2>/dev/null)
grep -q 'nodes: Gemm LayerNormalization Relu Gemm$' <<<"$exported" ||
  fail "the eval-mode export is not Gemm LayerNormalization Relu Gemm (Dropout left out): $exported"
exported=$("$python" "$example" export "$dir/opset12" --opset 12 2>/dev/null)
grep -q 'nodes: Gemm ReduceMean .* Dropout Gemm$' <<<"$exported" ||
  fail "the opset-12 export lacks the decomposed LayerNorm or Dropout: $exported"
"$train" "$dir/opset12/model.onnx" --data "$dir/opset12/features.npy" --labels "$dir/opset12/labels.npy" --steps 2 \
  2>/dev/null || fail "train refused the opset-12 export"
"$train" "$dir/model.onnx" --data "$dir/features.npy" --labels "$dir/targets.npy" --loss mse --steps 2 \
  2>/dev/null || fail "train --loss mse refused float32 [N, 4] targets"
echo "own_model_check: PyTorch reads the trained model back with train's eval loss and accuracy"
