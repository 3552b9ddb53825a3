#!/usr/bin/env bash
# The installed wheel, not the source tree: builds a wheel (pip wheel, an
# isolated build), installs it with its test extra into a fresh virtual
# environment outside the checkout, then runs `python -m jax_overlay doctor`
# and the CPU suite (tests/cpu) against it.  The suite runs from a scratch
# copy of the tests that has no jax_overlay/ beside it, with
# JAX_OVERLAY_TEST_INSTALLED=1: tests/conftest.py stops the run unless
# jax_overlay is imported from that environment's site-packages.
#   tools/wheel_test.sh [PYTHON] [PYTEST ARGS...]
# PYTHON (default python3) builds the wheel and makes the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
shift $(($# > 0 ? 1 : 0))

start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PY" -m pip wheel -q --no-deps -w "$work/dist" .
wheels=("$work"/dist/jax_overlay-*.whl)
[[ ${#wheels[@]} -eq 1 && -f ${wheels[0]} ]] || { echo "wheel_test.sh: no wheel built" >&2; exit 1; }
wheel=${wheels[0]}
echo "wheel_test.sh: built $(basename "$wheel")"

"$PY" -m venv "$work/venv"
vpy=$work/venv/bin/python
"$vpy" -m pip install -q --upgrade pip
"$vpy" -m pip install -q "$wheel[test]"

# The tests and the files they read (pyproject's pytest options, the
# benchmark and tool scripts some of them run, headers they compile), but
# not the package: only the installed one can be imported.
stage=$work/stage
mkdir "$stage"
cp pyproject.toml README.md "$stage"/
cp -r tests benchmarks tools xla_ext "$stage"/
find "$stage" -name __pycache__ -prune -exec rm -rf {} +
[[ ! -e $stage/jax_overlay ]]

site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
where=$(cd / && "$vpy" -c 'import jax_overlay; print(jax_overlay.__file__)')
if [[ $where != "$site"/jax_overlay/__init__.py ]]; then
  echo "wheel_test.sh: jax_overlay is imported from $where, not from $site" >&2
  exit 1
fi
echo "wheel_test.sh: jax_overlay from $where"
# No test code in the wheel: no test hooks in its native module, no test
# helpers beside the package.
(cd / && "$vpy" -c 'import sys, jax_overlay._xla_ext as m; sys.exit(m.TESTING)') ||
  { echo "wheel_test.sh: the wheel's native module has the test hooks" >&2; exit 1; }
"$PY" - "$wheel" <<'EOF' || { echo "wheel_test.sh: the wheel holds test code (above)" >&2; exit 1; }
import re, sys, zipfile
bad = [n for n in zipfile.ZipFile(sys.argv[1]).namelist()
       if re.search(r"(^|/)(tests?|forge|dropin|_testing)(/|\.py$)", n)]
print("\n".join(bad))
sys.exit(bool(bad))
EOF
echo "wheel_test.sh: no test hooks or helpers in the wheel"

(cd / && "$vpy" -m jax_overlay doctor)
(cd "$stage" && JAX_OVERLAY_TEST_INSTALLED=1 "$vpy" -m pytest -q -rs -p no:cacheprovider tests/cpu "$@")
echo "wheel_test.sh: $((SECONDS - start))s"
