#!/usr/bin/env bash
# The test command: builds the native core in place (with its test hooks)
# and runs the pytest
# suites once, in full (tests/gpu is skipped, with a reason, where no GPU is
# usable), then the Bazel suites offline: the C++ tests of the core in full
# and a smoke subset of tests/cpu against the Bazel-built extension
# (//tests:cpu_pytest in tests/BUILD.bazel).  Ends with where the time went,
# one line a step, failed or not.  JAX_OVERLAY_SKIP_BAZEL=1 runs pytest only.
#   bash tools/test.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PYTHON:-python3}}

declare -A took=([build]="not run" [pytest]="not run" [bazel]="not run")
step="" step_start=0
begin() { step=$1; step_start=$SECONDS; }
end() { took[$step]="$((SECONDS - step_start))s"; step=""; }
summary() {
  local rc=$?
  if [ -n "$step" ]; then took[$step]="$((SECONDS - step_start))s (failed)"; fi
  echo "test.sh: build  ${took[build]}"
  echo "test.sh: pytest ${took[pytest]}"
  echo "test.sh: bazel  ${took[bazel]}"
  echo "test.sh: total  ${SECONDS}s"
  exit "$rc"
}
trap summary EXIT
SECONDS=0

begin build
# With the native test hooks (lifetime counters, deleters driven from other
# threads, the strided kernel alone), which the suites call; a wheel has none.
JAX_OVERLAY_TESTING=1 "$PY" setup.py -q build_ext --inplace
end

begin pytest
# Both cores (pytest-xdist, in the test extra): the suite's processes are
# independent.  JAX_OVERLAY_TEST_JOBS=0 runs it in one process.
jobs=()
if [ "${JAX_OVERLAY_TEST_JOBS:-auto}" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
  jobs=(-n "${JAX_OVERLAY_TEST_JOBS:-auto}")
fi
echo "test.sh: pytest ${jobs[*]:-(one process)}: a dot per test as it ends; on 2 cores about" \
  "3 minutes (180 s measured; the drop-in fuzz slice's 60,000 cases hold one worker for" \
  "about a minute while the other goes on), 4.5 in one process"
"$PY" -m pytest -q -rs "${jobs[@]}" tests
end

if [ "${JAX_OVERLAY_SKIP_BAZEL:-0}" != 1 ]; then
  begin bazel
  bash tools/bazel_test.sh "$PY"
  end
else
  took[bazel]="skipped (JAX_OVERLAY_SKIP_BAZEL=1)"
fi
