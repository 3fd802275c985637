#!/usr/bin/env bash
# Formats every tracked C++ and CUDA file with clang-format-14 and the root .clang-format
# (scripts/install-deps.sh installs it). With --check it changes nothing and lists the
# files that are not formatted, exiting 1 when there are any.
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = "--check" ]; then
  unformatted=0
  for f in $files; do
    if ! clang-format-14 "$f" | cmp -s - "$f"; then
      echo "$f"
      unformatted=1
    fi
  done
  exit $unformatted
fi
echo "$files" | xargs clang-format-14 -i
