#!/usr/bin/env bash
# The test command: builds the native core in place and runs the pytest
# suites (tests/gpu is skipped, with a reason, where no GPU is usable).
#   bash tools/test.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PYTHON:-python3}}
"$PY" setup.py -q build_ext --inplace
"$PY" -m pytest -q -rs tests
