#!/usr/bin/env bash
# tools/device_multirank.sh: several processes of `train --device cuda` on one machine's GPUs
# (several per GPU when there are more processes than GPUs; their tensors travel staged
# through host memory over MPI, comm/comm_staged.h), each layout checked against one
# process with --check-equivalence (on the GPU too, in the same precision: train compares
# layouts, not devices; the CUDA Backend suites compare the GPU with the CPU).
# tools/device_check.sh runs it after the GPU tests, under the Open MPI it carries
# (tools/openmpi_bundle.sh), because the GPU machine has no mpirun; it also runs by hand
# wherever mpirun and a GPU are:
#     tools/device_multirank.sh BIN_DIR RESULTS_MD SECONDS [LD_LIBRARY_PATH]
# BIN_DIR holds train; RESULTS_MD receives a Markdown table; SECONDS bounds the whole (each
# run gets at most 60 s, and none starts with under 20 s left). The one-process run comes
# first: against a second one-process run it shows whether the GPU repeats itself.
# DEVICE_MULTIRANK_DEVICE=cpu runs the same on the CPU (a plumbing check without a GPU).
# Exit status: 0 when every layout that ran was equivalent, 1 otherwise, 2 on bad arguments.
set -uo pipefail

[ $# -ge 3 ] || { echo "usage: $0 BIN_DIR RESULTS_MD SECONDS [LD_LIBRARY_PATH]" >&2; exit 2; }
bin=$1 results=$2 budget=$3 ld=${4:-${LD_LIBRARY_PATH:-}}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
start=$SECONDS
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_base_warn_component_unused=0
export PIPESHARD_STAGE_COMM=1  # GPU processes stage anyway; on the CPU this makes them too

digits=(--data "$root/data/digits_features.npy" --labels "$root/data/digits_labels.npy")
small=(--data "$root/tests/golden/gelu_layernorm/x.npy" --labels "$root/tests/golden/gelu_layernorm/y.npy")
# name | processes | model | data | flags | bound (empty: --check-equivalence's own 1e-5 verdict;
# else the largest loss and weight differences allowed: the reference trains in the same
# 16-bit precision, but a layout may round differently summed values (a tensor-parallel
# half of a GEMM's inner dimension, a micro-batch); bf16 keeps 8 significant bits, fp16 11)
layouts=(
  "one process|1|simple_digits|digits|--momentum 0.9"
  "D=2|2|simple_digits|digits|--momentum 0.9"
  "P=2, 1F1B, M=4|2|simple_digits|digits|--momentum 0.9 --stages 2 --micro-batches 4"
  "P=2, ZB-H1, M=4|2|simple_digits|digits|--momentum 0.9 --stages 2 --micro-batches 4 --schedule zb-h1"
  "P=2, ZB-V (2 chunks per stage), M=4|2|deep_residual|digits|--momentum 0.9 --stages 2 --micro-batches 4 --schedule zb-v"
  "T=2|2|simple_digits|digits|--momentum 0.9 --tensor-parallel 2"
  "P=2 × T=2, M=2|4|simple_digits|digits|--momentum 0.9 --stages 2 --tensor-parallel 2 --micro-batches 2"
  "D=2, synchronized BatchNorm|2|batchnorm_train|small|--momentum 0.9 --sync-batchnorm"
  "D=2, LayerNorm+GELU, AdamW|2|layernorm_opset18|small|--optimizer adamw --lr 0.001"
  "D=2, ZeRO stage 1, AdamW|2|simple_digits|digits|--optimizer adamw --lr 0.001 --zero 1"
  "D=2, ZeRO stage 2 (gradient windows), AdamW|2|deep_residual|digits|--optimizer adamw --lr 0.001 --zero 2 --bucket-mb 0.004"
  "one process, bf16|1|simple_digits|digits|--momentum 0.9 --precision bf16|2e-2"
  "D=2, fp16, dynamic loss scale|2|simple_digits|digits|--momentum 0.9 --precision fp16|5e-3"
)

mkdir -p "$(dirname "$results")" || exit 2
{
  echo "mpirun: \`$(command -v mpirun || echo 'not found')\` ($(mpirun --version 2>/dev/null | head -1))"
  echo
  echo "| layout | processes | result | largest loss difference | largest weight difference | seconds |"
  echo "|---|---|---|---|---|---|"
} >"$results"
failed=0
log_dir=$(dirname "$results")
for entry in "${layouts[@]}"; do
  IFS='|' read -r name np model data flags bound <<<"$entry"
  if [ -n "$bound" ] && [ "${DEVICE_MULTIRANK_DEVICE:-cuda}" = cpu ]; then
    continue  # the CPU computes in fp32 only
  fi
  left=$(( budget - (SECONDS - start) ))
  if (( left < 20 )); then
    echo "| $name | $np | not run: out of time | | | |" >>"$results"
    continue
  fi
  t=$(( left < 60 ? left : 60 ))
  if [ "$data" = digits ]; then data_args=("${digits[@]}"); else data_args=("${small[@]}"); fi
  # shellcheck disable=SC2206  # flags are words
  flag_args=($flags)
  log="$log_dir/multirank_$(printf '%s' "$name" | tr -c 'A-Za-z0-9' '_').log"
  began=$SECONDS
  # $ld first, then what the caller had: the carried Open MPI's own libraries (libpmix, its
  # MCA components) are only on the caller's path, and replacing it loses them.
  LD_LIBRARY_PATH=$ld${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} timeout -k 5 "$t" mpirun -n "$np" --oversubscribe -x LD_LIBRARY_PATH -x PIPESHARD_STAGE_COMM \
    "$bin/train" "$root/models/$model.onnx" "${data_args[@]}" --batch-size 32 --device "${DEVICE_MULTIRANK_DEVICE:-cuda}" \
    --comm-timeout 30 --check-equivalence 4 "${flag_args[@]}" >"$log" 2>&1
  rc=$?
  took=$(( SECONDS - began ))
  line=$(grep -m1 '^check-equivalence:' "$log")
  loss=$(grep -oE 'largest loss difference [0-9.e+-]+' <<<"$line" | awk '{print $4}')
  weight=$(grep -oE 'largest weight difference [0-9.e+-]+' <<<"$line" | awk '{print $4}')
  if [ -n "$bound" ] && [ -n "$loss" ] && [ -n "$weight" ]; then
    if awk -v l="$loss" -v w="$weight" -v b="$bound" 'BEGIN { exit !(l <= b && w <= b) }'; then
      result="within $bound"
    else
      result="NOT within $bound"
      failed=1
    fi
  elif grep -q '^equivalent:' "$log" && (( rc == 0 )); then
    result="equivalent"
  elif grep -q 'NOT equivalent' "$log"; then
    result="NOT equivalent beyond 1e-5"
    failed=1
  else
    why=$(grep -m1 -E 'error|Error|ERROR|not completed|signal' "$log" | tr '|' '/' | head -c 200)
    result="failed (exit status $rc${why:+: $why})"
    failed=1
  fi
  echo "| $name | $np | $result | ${loss:-} | ${weight:-} | $took |" >>"$results"
  echo "device_multirank: $name ($np processes): $result ($took s)"
done
exit $failed
