#!/usr/bin/env bash
# The dedicated fuzz run: the hypothesis properties of tests/cpu/test_fuzz_*.py
# with EXAMPLES cases each (5 properties; default 25000, so 125,000 cases),
# fresh random cases every run, in a child process so that a crash is caught
# and reported as one (with the faulthandler's traceback) instead of ending
# this script.  Prints the cases run per property and their outcomes.
#   tools/fuzz.sh [PYTHON] [EXAMPLES] [-- EXTRA PYTEST ARGS, e.g. --hypothesis-seed=1]
# JAX_OVERLAY_FUZZ_SEED=N repeats a run (the seed is printed).  Failures are
# reported with native tracebacks: pytest's own would print the arguments of
# every frame, and an array over memory a bug freed could crash the report.
# Exit status: 0 when every case passed, 1 for a failing case, 2 for a crash.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${1:-${PYTHON:-python3}}
EXAMPLES=${2:-25000}
shift $(( $# < 2 ? $# : 2 ))
[[ ${1:-} == -- ]] && shift

JAX_OVERLAY_TESTING=1 "$PY" setup.py -q build_ext --inplace || exit 1
SEED=${JAX_OVERLAY_FUZZ_SEED:-$((RANDOM * 32768 + RANDOM))}
report=$(mktemp)
log=$(mktemp)
start=$SECONDS
JAX_OVERLAY_FUZZ_EXAMPLES=$EXAMPLES JAX_OVERLAY_FUZZ_REPORT=$report \
  "$PY" -X faulthandler -m pytest -q -p no:cacheprovider --tb=native \
  --hypothesis-seed="$SEED" tests/cpu/test_fuzz_cai.py tests/cpu/test_fuzz_dlpack.py "$@" \
  >"$log" 2>&1
rc=$?
elapsed=$((SECONDS - start))

"$PY" - "$report" "$rc" "$elapsed" "$EXAMPLES" "$SEED" <<'EOF'
import json, sys
path, rc, elapsed, examples, seed = sys.argv[1:6]
rc = int(rc)
rows = [json.loads(line) for line in open(path)]
total = sum(r["cases"] for r in rows)
print(f"fuzz.sh: {examples} cases per property, seed {seed}, {elapsed} s")
for r in rows:
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
    print(f"  {r['property']:<24} {r['cases']:>8} cases: {outcomes}")
verdict = ("all passed" if rc == 0 else
           "CRASH (signal)" if rc >= 128 or rc < 0 else "FAILED")
print(f"fuzz.sh: {total} cases, {verdict} (pytest exit {rc})")
EOF
if [[ $rc -ne 0 ]]; then
  tail -n 80 "$log"
fi
rm -f "$report" "$log"
if [[ $rc -eq 0 ]]; then exit 0; fi
if [[ $rc -ge 128 ]]; then exit 2; fi
exit 1
