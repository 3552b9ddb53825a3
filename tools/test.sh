#!/usr/bin/env bash
# The test command: builds the native core in place and runs the pytest
# suites (tests/gpu is skipped, with a reason, where no GPU is usable), then
# the Bazel suites offline (C++ tests of the core, and tests/cpu against the
# Bazel-built extension).  JAX_OVERLAY_SKIP_BAZEL=1 runs pytest only.
#   bash tools/test.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PYTHON:-python3}}
"$PY" setup.py -q build_ext --inplace
"$PY" -m pytest -q -rs tests
if [ "${JAX_OVERLAY_SKIP_BAZEL:-0}" != 1 ]; then
  bash tools/bazel_test.sh "$PY"
fi
