#!/usr/bin/env bash
# The dedicated leak and thread runs: tests/cpu/test_leaks.py with ROUNDS
# round trips per path (default 100000) and tests/cpu/test_threads_stress.py
# with THREAD_ROUNDS rounds per thread (default 3000), in a child process (a
# crash is reported as one).  Prints each path's resident-memory growth and
# producer refcount / native tensor deltas.
#   tools/leaks.sh [PYTHON] [ROUNDS] [THREAD_ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${1:-${PYTHON:-python3}}
ROUNDS=${2:-100000}
THREAD_ROUNDS=${3:-3000}

JAX_OVERLAY_TESTING=1 "$PY" setup.py -q build_ext --inplace || exit 1
report=$(mktemp)
log=$(mktemp)
start=$SECONDS
JAX_OVERLAY_LEAK_ROUNDS=$ROUNDS JAX_OVERLAY_LEAK_REPORT=$report \
JAX_OVERLAY_THREAD_ROUNDS=$THREAD_ROUNDS \
  "$PY" -X faulthandler -m pytest -q -s -p no:cacheprovider --tb=native \
  tests/cpu/test_leaks.py tests/cpu/test_threads_stress.py >"$log" 2>&1
rc=$?

"$PY" - "$report" "$rc" "$((SECONDS - start))" <<'EOF'
import json, sys
path, rc, elapsed = sys.argv[1], int(sys.argv[2]), sys.argv[3]
print(f"leaks.sh: {elapsed} s")
print(f"  {'path':<18} {'rounds':>8} {'RSS growth':>12} {'refcount delta':>15} {'tensor delta':>13}")
for line in open(path):
    r = json.loads(line)
    print(f"  {r['path']:<18} {r['rounds']:>8} {r['rss_growth_bytes'] / 2**20:>9.2f} MiB"
          f" {r['producer_refcount_delta']:>15} {r['live_tensor_delta']:>13}")
print(f"leaks.sh: {'all passed' if rc == 0 else 'CRASH (signal)' if rc >= 128 else 'FAILED'}"
      f" (pytest exit {rc})")
EOF
grep -E "deleters ran on|passed|failed" "$log" | tail -n 3
[[ $rc -eq 0 ]] || tail -n 60 "$log"
rm -f "$report" "$log"
exit $(( rc == 0 ? 0 : (rc >= 128 ? 2 : 1) ))
