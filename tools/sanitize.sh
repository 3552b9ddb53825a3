#!/usr/bin/env bash
# The CPU suite against an ASan + UBSan build of the native core, and the
# C++ tests under the same sanitizers (bazel --config=asan).
#   tools/sanitize.sh [PYTHON] [-- EXTRA PYTEST ARGS]
# The extension is built in a temporary copy of the tree, so the in-place
# build of tools/test.sh is left alone.  Python itself is not instrumented:
# the ASan runtime is preloaded into it (LD_PRELOAD), and PYTHONMALLOC=malloc
# routes Python objects through ASan's allocator too, so a use-after-free of
# a producer or a capsule is caught as well as one in the core.
# JAX_OVERLAY_SKIP_BAZEL=1 skips the C++ tests; JAX_OVERLAY_FUZZ_EXAMPLES
# scales the fuzz properties as in tools/fuzz.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

PY=${1:-${PYTHON:-python3}}
shift $(( $# < 1 ? $# : 1 ))
[[ ${1:-} == -- ]] && shift

asan=$(gcc -print-file-name=libasan.so)
[[ -e $asan ]] || { echo "sanitize.sh: no libasan.so from gcc" >&2; exit 1; }
# libstdc++ is preloaded too: ASan resolves the real __cxa_throw when it
# starts, and Python does not link libstdc++, so without it the first C++
# exception (jaxlib throws some on import) fails ASan's interceptor check.
stdcxx=$(gcc -print-file-name=libstdc++.so.6)
# Leak checking stays off in the Python process: CPython, jaxlib and XLA
# keep interned objects and static registries alive until exit on purpose,
# so LeakSanitizer would report thousands of leaks that are not leaks.  The
# suite checks our own leaks precisely (tensor counters, producer refcounts,
# forged deleters), and the C++ tests below run with leak checking on.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1}
# tools/ubsan.supp: one report from pybind11's header on a thread that
# CPython ends during interpreter exit (the file says why it is not ours).
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1:suppressions=$root/tools/ubsan.supp}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$work"
cd "$work"
echo "sanitize.sh: building the ASan/UBSan extension in $work"
JAX_OVERLAY_SANITIZE=1 JAX_OVERLAY_TESTING=1 "$PY" setup.py -q build_ext --inplace >build.log 2>&1 || {
  cat build.log; exit 1; }

# --capture=sys: a sanitizer writes its report to file descriptor 2 and
# ends the process, so pytest's default fd capture would swallow it.
start=$SECONDS
LD_PRELOAD="$asan $stdcxx" PYTHONMALLOC=malloc "$PY" -X faulthandler -m pytest -q -p no:cacheprovider \
  --capture=sys tests/cpu "$@" 2>&1 | tee pytest.log | tail -n 5
rc=${PIPESTATUS[0]}
pat="ERROR: (Address|Leak)Sanitizer|AddressSanitizer: CHECK failed|runtime error:"
reports=$(grep -cE "$pat" pytest.log)
echo "sanitize.sh: CPU suite under ASan+UBSan: exit $rc, $((SECONDS - start)) s, $reports sanitizer reports"
if [[ $reports -ne 0 ]]; then
  grep -A30 -E "$pat" pytest.log | head -n 120
elif [[ $rc -ne 0 ]]; then
  grep -v '^  File' pytest.log | tail -n 60
fi

brc=0
if [[ ${JAX_OVERLAY_SKIP_BAZEL:-0} != 1 ]]; then
  cd "$root"
  # Leak checking on: these binaries are ours end to end, and the two that
  # embed an interpreter finalize it (Py_FinalizeEx) before they exit.
  PYTHON_BIN_PATH=$PY bazel test --config=offline --config=asan --jobs=2 --nocache_test_results --color=no \
    --curses=no //tests/cc/... >"$work/bazel.log" 2>&1
  brc=$?
  grep -E "^//|^Executed" "$work/bazel.log"
  [[ $brc -eq 0 ]] || grep -v '^INFO: From ' "$work/bazel.log" | tail -n 60
  echo "sanitize.sh: C++ tests under ASan+UBSan+LSan: exit $brc"
fi
[[ $rc -eq 0 && $reports -eq 0 && $brc -eq 0 ]]
