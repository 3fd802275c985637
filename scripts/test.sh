#!/usr/bin/env bash
# The whole test suite: install, build, run every test through ctest, then replay the
# fuzz corpora and regressions under the sanitizers (scripts/fuzz_replay.sh, a few minutes),
# then run the whole ctest suite again under ASan + UBSan (scripts/sanitize.sh, its own
# build in build-asan/; its header gives the time).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
bash scripts/fuzz_replay.sh
bash scripts/sanitize.sh
