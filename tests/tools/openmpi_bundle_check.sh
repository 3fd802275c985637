#!/usr/bin/env bash
# Packs tools/openmpi_bundle.sh into a scratch folder, hides the system's Open MPI in a
# private mount namespace (its folders under tmpfs, its launcher and libraries under
# /dev/null), and trains under the bundle's mpirun there: what the GPU machine, which has
# no Open MPI, will do, by hand and as tools/device_multirank.sh does. Exit 77 (skipped)
# where mount namespaces are not allowed.
#   openmpi_bundle_check.sh SOURCE_DIR TRAIN SCRATCH
set -euo pipefail
src=$1 train=$2 scratch=$3
if [ "${1:-}" = --inside ]; then
  shift
  bundle=$1 train=$2 src=$3
  mount --make-rprivate /
  arch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
  for d in /usr/lib/$arch/openmpi /usr/lib/$arch/pmix2 /usr/share/openmpi /etc/openmpi /usr/share/pmix; do
    [ -d "$d" ] && mount -t tmpfs none "$d"
  done
  for f in /usr/bin/orterun /usr/bin/orted $(readlink -f /usr/lib/$arch/libmpi.so.40 /usr/lib/$arch/libopen-rte.so.40 \
      /usr/lib/$arch/libopen-pal.so.40 2>/dev/null | sort -u); do
    [ -e "$f" ] && mount --bind /dev/null "$f"
  done
  if command -v mpirun >/dev/null && mpirun --version >/dev/null 2>&1; then
    echo "openmpi_bundle_check: the system's mpirun still runs: the hiding failed" >&2
    exit 1
  fi
  . "$bundle/openmpi-env.sh"
  echo "openmpi_bundle_check: mpirun is $(command -v mpirun)"
  mpirun -n 4 --oversubscribe "$train" "$src/models/simple_digits.onnx" --data "$src/data/digits_features.npy" \
    --labels "$src/data/digits_labels.npy" --stages 2 --tensor-parallel 2 --check-equivalence 3
  # The device check's several-process layouts as it starts them there: under the bundle,
  # with our own libraries' folder as device_multirank.sh's LD_LIBRARY_PATH argument (on
  # the CPU backend here).
  DEVICE_MULTIRANK_DEVICE=cpu bash "$src/tools/device_multirank.sh" "$(dirname "$train")" \
    "$(dirname "$bundle")/multirank/results.md" 90 "$(dirname "$train")"
  echo "openmpi_bundle_check: device_multirank.sh: every layout equivalent"
  exit
fi
if ! unshare -m true 2>/dev/null; then
  echo "openmpi_bundle_check: skipped: this machine allows no private mount namespace (unshare -m needs root)"
  exit 77
fi
rm -rf "$scratch"
bash "$src/tools/openmpi_bundle.sh" "$scratch/openmpi"
unshare -m bash "$0" --inside "$scratch/openmpi" "$train" "$src"
