#!/bin/sh
# Trains the same run twice under mpiexec, once with the processes' tensors exchanged
# directly and once staged through the backend's download/upload (PIPESHARD_STAGE_COMM=1,
# comm/comm_staged.h: how GPU processes exchange them), and passes when the two saved
# models are byte for byte the same. Staging copies; it must not change a single bit.
#   staged_comm_check.sh MPIEXEC NP TRAIN OUTPUT_FOLDER TRAIN_ARGUMENTS...
set -eu
mpiexec=$1 np=$2 train=$3 dir=$4
shift 4
rm -rf "$dir"
mkdir -p "$dir"
"$mpiexec" -n "$np" --oversubscribe "$train" "$@" --save "$dir/direct.onnx"
PIPESHARD_STAGE_COMM=1 "$mpiexec" -n "$np" --oversubscribe "$train" "$@" --save "$dir/staged.onnx"
if cmp "$dir/direct.onnx" "$dir/staged.onnx"; then
  echo "staged_comm_check: the staged run saved the same model, byte for byte"
else
  echo "staged_comm_check: the staged run saved a different model" >&2
  exit 1
fi
