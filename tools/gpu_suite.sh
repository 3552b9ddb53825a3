#!/usr/bin/env bash
# One call on a GPU machine: build the core from source, run the whole pytest
# suite (tests/gpu needs CuPy; PyTorch and Numba where installed), then the
# doctor (DOCTOR=0 skips it), then the named benchmarks.  Logs and JSON go to
# $OUT (default ./gpu-out).
#   bash tools/gpu_suite.sh [TESTS...] [-- BENCH.py ...]
# NUMBA_NUMPY_WHEEL=numpy-X.whl: numba-cuda 0.30 cannot compile kernels under
# NumPy >= 2.5 (np.row_stack is gone), so the Numba tests are run a second
# time, and the doctor, with that NumPy first on the path (installed with
# --target, no registry needed).  Fetch it where a registry is reachable:
#   pip download numpy==2.4.6 --no-deps --only-binary=:all: \
#     --platform manylinux_2_28_x86_64 --python-version 3.12 -d build/wheels
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
JAX_OVERLAY_TESTING=1 "$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
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
NUMBA_PATH=
if [ -n "${NUMBA_NUMPY_WHEEL:-}" ]; then
  NUMBA_PATH=$(mktemp -d)/numpy
  "$PY" -m pip install -q --no-deps --no-index --target "$NUMBA_PATH" "$NUMBA_NUMPY_WHEEL" || exit 1
  echo "== the Numba tests again, NumPy $(PYTHONPATH=$NUMBA_PATH "$PY" -c 'import numpy; print(numpy.__version__)')"
  PYTHONPATH=$NUMBA_PATH:$PYTHONPATH timeout "${TEST_TIMEOUT:-420}" "$PY" -m pytest -q -rs \
    -p no:cacheprovider -k numba "${tests[@]}" 2>&1 | tee "$OUT/pytest-numba.log" | tail -n 20
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "${DOCTOR:-1}" != 0 ]; then  # the README's main command, on this machine
  echo "== doctor"
  PYTHONPATH=${NUMBA_PATH:+$NUMBA_PATH:}$PYTHONPATH timeout "${DOCTOR_TIMEOUT:-300}" "$PY" -m jax_overlay doctor --plain --json-file "$OUT/doctor.json" \
    2>"$OUT/doctor.err" | tee "$OUT/doctor.txt"
  echo "doctor exit status ${PIPESTATUS[0]}"
fi
for b in "${benches[@]}"; do
  name=$(basename "$b" .py)
  echo "== $name"
  timeout "${BENCH_TIMEOUT:-150}" "$PY" "$b" --json "$OUT/$name.json" 2>"$OUT/$name.err" | tee "$OUT/$name.txt"
done
exit $rc
