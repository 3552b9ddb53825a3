"""Runs pytest suites against the Bazel-built extension.

Bazel's runfiles keep jax_overlay/*.py and xla_ext/_xla_ext.so apart, so
this lays them out as the package Python imports (jax_overlay/_xla_ext.so)
in the test's scratch directory, with the test files beside it, and runs
pytest there in a fresh interpreter whose only extra path is that
directory: neither the source tree nor a setup.py build can shadow the
extension under test.  Usage: bazel_pytest.py SUITE_DIR... [-- PYTEST_ARGS]
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile


def runfiles_root():
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir:
        return pathlib.Path(srcdir) / os.environ["TEST_WORKSPACE"]
    return pathlib.Path.cwd()


def stage(src, suites):
    dest = pathlib.Path(os.environ.get("TEST_TMPDIR") or tempfile.mkdtemp())
    dest = dest / "stage"
    shutil.rmtree(dest, ignore_errors=True)
    pkg = dest / "jax_overlay"
    pkg.mkdir(parents=True)
    for pattern in ("*.py", "*.pyi", "py.typed"):  # the subpackages too
        for f in (src / "jax_overlay").rglob(pattern):
            target = pkg / f.relative_to(src / "jax_overlay")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, target)
    shutil.copy(src / "xla_ext" / "_xla_ext.so", pkg / "_xla_ext.so")
    shutil.copy(src / "pyproject.toml", dest)  # pytest's markers and options
    (dest / "tests").mkdir()
    # conftest.py and the suites' helpers (dropin.py, forge.py), which stay
    # out of the wheel.
    for f in (src / "tests").glob("*.py"):
        shutil.copy(f, dest / "tests")
    for suite in suites:
        shutil.copytree(src / suite, dest / suite)
    if (src / "benchmarks").is_dir():  # the GPU suite runs the stress script
        shutil.copytree(src / "benchmarks", dest / "benchmarks")
    # The CPU suite compiles our FFI declarations against jaxlib's headers.
    for rel in ("tests/cc/ffi_abi_check.cc", "xla_ext/xla_ffi_abi.h"):
        if (src / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / rel, dest / rel)
    return dest


def main(argv):
    suites, pytest_args = argv, []
    if "--" in argv:
        i = argv.index("--")
        suites, pytest_args = argv[:i], argv[i + 1:]
    root = stage(runfiles_root(), suites)
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("PYTHONSAFEPATH", None)

    # Fail loudly if anything but the staged extension would be imported.
    where = subprocess.run(
        [sys.executable, "-c",
         "import jax_overlay._xla_ext as e; print(e.__file__)"],
        cwd=root, env=env, capture_output=True, text=True)
    expected = str(root / "jax_overlay" / "_xla_ext.so")
    if where.returncode != 0 or where.stdout.strip() != expected:
        sys.stderr.write("the Bazel-built extension is not the one imported:\n"
                         f"{where.stdout}{where.stderr}")
        return 1
    print(f"testing {expected} with {sys.executable}", flush=True)

    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra",
           *suites, *pytest_args]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        cmd.append(f"--junitxml={xml}")
    return subprocess.call(cmd, cwd=root, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
