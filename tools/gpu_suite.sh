#!/usr/bin/env bash
# One call on a GPU machine: build the core from source, run the whole pytest
# suite (tests/gpu needs CuPy; PyTorch and Numba where installed), then the
# doctor (DOCTOR=0 skips it), then the named benchmarks.  Logs and JSON go to
# $OUT (default ./gpu-out).
#   bash tools/gpu_suite.sh [TESTS...] [-- BENCH.py ...]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # benchmarks import the in-place build
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
tests=() benches=()
while [ $# -gt 0 ]; do
  [ "$1" = -- ] && { shift; benches=("$@"); break; }
  tests+=("$1"); shift
done
[ ${#tests[@]} -gt 0 ] || tests=(tests)
"$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" - <<'PYEOF'
import importlib, platform
print("python", platform.python_version())
for m in ("jax", "jaxlib", "cupy", "torch", "numba", "numpy", "ml_dtypes"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:  # noqa: BLE001
        print(m, "missing:", type(e).__name__)
PYEOF
} | tee "$OUT/versions.txt"
rc=0
timeout "${TEST_TIMEOUT:-420}" "$PY" -m pytest -q -rs -p no:cacheprovider --durations=12 \
  "${tests[@]}" 2>&1 | tee "$OUT/pytest.log" | tail -n 60
rc=${PIPESTATUS[0]}
if [ "${DOCTOR:-1}" != 0 ]; then  # the README's main command, on this machine
  echo "== doctor"
  timeout "${DOCTOR_TIMEOUT:-300}" "$PY" -m jax_overlay doctor --plain --json-file "$OUT/doctor.json" \
    2>"$OUT/doctor.err" | tee "$OUT/doctor.txt"
  echo "doctor exit status ${PIPESTATUS[0]}"
fi
for b in "${benches[@]}"; do
  name=$(basename "$b" .py)
  echo "== $name"
  timeout "${BENCH_TIMEOUT:-150}" "$PY" "$b" --json "$OUT/$name.json" 2>"$OUT/$name.err" | tee "$OUT/$name.txt"
done
exit $rc
