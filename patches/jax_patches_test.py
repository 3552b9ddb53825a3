"""Bazel entry point of tools/check_jax_patches.py (see patches/BUILD.bazel).

  jax_patches_test.py --wheel    the --wheel check of $JAX_PATCHES_PYTHON's jax
                                 (default: this interpreter's); passes, saying
                                 so, if that jax is not BASE's wheel
  jax_patches_test.py --source   the --jax-src check of the checkout $JAX_SRC
"""

import os
import pathlib
import subprocess
import sys


def main(argv):
    srcdir = os.environ.get("TEST_SRCDIR")
    root = (pathlib.Path(srcdir) / os.environ["TEST_WORKSPACE"] if srcdir
            else pathlib.Path(__file__).absolute().parent.parent)
    checker = [sys.executable, str(root / "tools" / "check_jax_patches.py")]
    if argv == ["--wheel"]:
        python = os.environ.get("JAX_PATCHES_PYTHON") or sys.executable
        cmd = checker + ["--wheel", "--python", python, "--skip-if-mismatch"]
    elif argv == ["--source"]:
        src = os.environ.get("JAX_SRC")
        if not src:
            print("set JAX_SRC to a jax checkout or bare clone: "
                  "bazel test --test_env=JAX_SRC=/path/to/jax "
                  "//patches:jax_patches_source_test", file=sys.stderr)
            return 2
        cmd = checker + ["--jax-src", src]
    else:
        print(__doc__, file=sys.stderr)
        return 2
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
