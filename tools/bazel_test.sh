#!/usr/bin/env bash
# Builds and tests the project with Bazel, offline: the native extension, its
# C++ tests and a smoke subset of the CPU pytest suite against the
# Bazel-built extension (//tests:cpu_pytest; tools/test.sh runs all of
# tests/cpu once, with pytest, before this).
#   tools/bazel_test.sh [PYTHON] [EXTRA BAZEL TEST ARGS...]
# PYTHON (default: $PYTHON_BIN_PATH, else python3) must have pybind11, jax,
# numpy, ml_dtypes and pytest.  Installs Debian's bazel-bootstrap (Bazel
# 4.2.3) when no bazel is on PATH.  Exits with bazel's exit code.
set -uo pipefail

cd "$(dirname "$0")/.."

if [[ $# -gt 0 ]]; then
  PYTHON_BIN_PATH=$1
  shift
fi
export PYTHON_BIN_PATH=${PYTHON_BIN_PATH:-python3}

if ! command -v bazel >/dev/null; then
  echo "bazel_test.sh: installing bazel-bootstrap" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq bazel-bootstrap >/dev/null || {
    echo "bazel_test.sh: could not install bazel-bootstrap" >&2
    exit 1
  }
fi

echo "bazel_test.sh: bazel test --config=offline --jobs=2 //... $* (Python: $PYTHON_BIN_PATH)"
start=$SECONDS
log=$(mktemp)
# The full log is kept for failures; the summary (one line per test target,
# then the totals) is what is printed.
bazel test --config=offline --jobs=2 --color=no --curses=no "$@" //... >"$log" 2>&1
rc=$?
if [[ $rc -ne 0 ]]; then
  grep -v '^INFO: From ' "$log" | grep -v '^$'
else
  grep -E '^//|^Executed |^INFO: Elapsed' "$log"
fi
summary=$(grep -E '^//' "$log")
rm -f "$log"

# One closing line over every test case that ran: the C++ harness and pytest
# both end their logs with "N passed" and, when nonzero, "N failed".
passed=0 failed=0
while read -r target _; do
  f="bazel-testlogs/${target#//}"
  f="${f/://}/test.log"
  p=$(grep -oE '[0-9]+ passed' "$f" 2>/dev/null | tail -1 | cut -d' ' -f1)
  q=$(grep -oE '[0-9]+ failed' "$f" 2>/dev/null | tail -1 | cut -d' ' -f1)
  passed=$((passed + ${p:-0}))
  failed=$((failed + ${q:-0}))
done < <(grep -E '^//[^ ]+ +(\(cached\) )?(PASSED|FAILED)' <<<"$summary")
echo "bazel_test.sh: $((SECONDS - start))s, exit $rc"
echo "bazel: $passed passed, $failed failed"
# CI leaves nothing running behind it; a developer keeps the warm server.
if [[ -n ${CI:-} ]]; then
  bazel shutdown
fi
exit $rc
