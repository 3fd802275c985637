#!/usr/bin/env bash
# The whole test suite: install, build, run every test through ctest, then replay the
# fuzz corpora and regressions under the sanitizers (scripts/fuzz_replay.sh, a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
bash scripts/fuzz_replay.sh
