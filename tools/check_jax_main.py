#!/usr/bin/env python3
"""Checks the jax patch series rebased onto jax main (standard library only).

  check_jax_main.py JAX [--patches DIR] [--pin FILE] [--keep]
                    [--interop-tests --python PY]

JAX is a jax git checkout or bare clone that has the commit patches/jax/MAIN
names.  In a temporary repository that borrows JAX's objects (JAX is not
written to), checks out that commit and applies patches/jax/main/*.patch in
order with `git am --3way`.  For each patch it reports whether it applies
(cleanly, or only by 3-way merge), the Python files it touches and whether
they byte-compile, and the C++/build files it touches (which need a jaxlib
build to check).  Exits 1 if a patch does not apply or a file does not
compile, 2 on a usage or setup error.

With --interop-tests, it then runs jax's tests/array_interoperability_test.py
of MAIN and of the patched tree, each with that tree's own jax Python package
(PYTHONPATH) over PY's installed stock jaxlib, whose extension version must
be below the series' gates (jaxlib 0.11.0 for MAIN: 477), so the tests of
the C++ patches skip and those that need only Python run.  It prints both
summaries and every test that passes on MAIN but not patched (exit 1 if any).

Files of the MAIN commit whose content the clone lacks (partial or
size-limited mirrors) are left out of the temporary index in a scratch
commit, as tools/check_jax_patches.py does; the check fails if a patch
touches one of them.
"""

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent
PATCH_DIR = ROOT / "patches" / "jax" / "main"
PIN = ROOT / "patches" / "jax" / "MAIN"

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "check_jax_main", "GIT_AUTHOR_EMAIL": "check@invalid",
    "GIT_COMMITTER_NAME": "check_jax_main",
    "GIT_COMMITTER_EMAIL": "check@invalid",
}
CXX_SUFFIXES = (".cc", ".h", ".cpp", ".hpp", "BUILD", ".bzl", ".bazel")
TEST_FILE = "tests/array_interoperability_test.py"


class CheckError(Exception):
    pass


def run(cmd, *, cwd=None, env=None, input=None):
    return subprocess.run(list(map(str, cmd)), cwd=cwd, env=env, input=input,
                          text=True, capture_output=True)


def must(cmd, **kwargs):
    r = run(cmd, **kwargs)
    if r.returncode != 0:
        raise CheckError(f"{' '.join(map(str, cmd))} failed:\n{r.stderr}{r.stdout}")
    return r.stdout


def read_pin(path):
    pin = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition(" ")
            pin[key] = value.strip()
    if not re.fullmatch(r"[0-9a-f]{40}", pin.get("commit", "")):
        raise CheckError(f"{path}: no `commit <40 hex digits>` line")
    return pin


class Patch:

    def __init__(self, path):
        self.path = path
        self.number = path.name[:4]
        text = path.read_text()
        m = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.*(?:\n .*)*)", text, re.M)
        self.subject = " ".join(m.group(1).split()) if m else path.name
        self.files = re.findall(r"^diff --git a/\S+ b/(\S+)$", text, re.M)
        self.python = [f for f in self.files if f.endswith((".py", ".pyi"))]
        self.cxx = [f for f in self.files
                    if f.endswith(CXX_SUFFIXES) or os.path.basename(f) == "BUILD"]


def absent_blobs(repo, rev):
    entries = must(["git", "-C", repo, "ls-tree", "-r", "-z", "--full-tree", rev])
    blobs = []
    for entry in entries.split("\0"):
        if entry:
            meta, path = entry.split("\t", 1)
            _, kind, sha = meta.split()
            if kind == "blob":
                blobs.append((sha, path))
    out = must(["git", "-C", repo, "cat-file", "--batch-check"],
               input="".join(f"{sha}\n" for sha, _ in blobs))
    missing = {line.split()[0] for line in out.splitlines()
               if line.endswith(" missing")}
    return [path for sha, path in blobs if sha in missing]


def compile_error(path):
    try:
        compile(pathlib.Path(path).read_text(), str(path), "exec")
    except SyntaxError as e:
        return f"{e}"
    return None


def pytest_results(python, tree, run_dir):
    """{test id: passed/failed/skipped} of TEST_FILE of `tree`, run alone in
    `run_dir` with `tree`'s own jax Python package first on the path, over
    PY's installed (stock) jaxlib; and pytest's summary line."""
    run_dir.mkdir()
    test = tree / TEST_FILE
    shutil.copy(test, run_dir / test.name)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(tree))
    where = run([python, "-c", "import jax; print(jax.__file__)"], env=env,
                cwd=run_dir).stdout.strip()
    if not where.startswith(str(tree)):
        raise CheckError(f"{python} imported jax from {where or '?'}, not from {tree}")
    junit = run_dir / "junit.xml"
    r = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
             "--rootdir", run_dir, f"--junitxml={junit}", test.name],
            cwd=run_dir, env=env)
    summary = ((r.stdout + r.stderr).strip().splitlines() or ["(no output)"])[-1]
    results = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            status = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    status = "failed"
                elif child.tag == "skipped" and status == "passed":
                    status = "skipped"
            results[f"{case.get('classname')}::{case.get('name')}"] = status
    return results, summary


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jax", help="a jax git checkout or bare clone")
    parser.add_argument("--patches", type=pathlib.Path, default=PATCH_DIR)
    parser.add_argument("--pin", type=pathlib.Path, default=PIN)
    parser.add_argument("--interop-tests", action="store_true",
                        help="also run the unpatched and the patched "
                             f"{TEST_FILE}, each tree's jax over --python's stock jaxlib")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary directory")
    args = parser.parse_args(argv)
    try:
        return check(args)
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def check(args):
    pin = read_pin(args.pin)
    commit = pin["commit"]
    paths = sorted(args.patches.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    if not paths:
        raise CheckError(f"no NNNN-*.patch files in {args.patches}")
    patches = [Patch(p) for p in paths]
    git_dir = must(["git", "-C", args.jax, "rev-parse", "--path-format=absolute",
                    "--git-common-dir"]).strip()
    if run(["git", "--git-dir", git_dir, "cat-file", "-e",
            f"{commit}^{{commit}}"]).returncode != 0:
        raise CheckError(f"{args.jax} does not have the MAIN commit {commit}")
    print(f"jax main series: {len(patches)} patches from {args.patches}; "
          f"MAIN {commit[:12]}; source {git_dir}")

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="check-jax-main-"))
    env = dict(os.environ, **GIT_IDENTITY)
    try:
        wt = tmp / "jax"
        must(["git", "init", "-q", wt])
        (wt / ".git" / "objects" / "info" / "alternates").write_text(
            f"{git_dir}/objects\n")
        must(["git", "-C", wt, "update-ref", "HEAD", commit])
        must(["git", "-C", wt, "read-tree", "HEAD"])
        missing = absent_blobs(wt, "HEAD")
        if missing:
            clash = sorted({f for p in patches for f in p.files}.intersection(missing))
            if clash:
                raise CheckError(f"the patches touch files absent from the clone: {clash}")
            must(["git", "-C", wt, "rm", "-q", "--cached", "--pathspec-from-file=-",
                  "--pathspec-file-nul"], input="".join(f"{p}\0" for p in missing))
            must(["git", "-C", wt, "commit", "-q", "-m",
                  "check_jax_main: drop files absent from the source clone"], env=env)
            print(f"  {len(missing)} file(s) at MAIN absent from this clone, left "
                  f"out of the index (no patch touches them): {', '.join(missing[:5])}")
        must(["git", "-C", wt, "checkout", "-q", "-f"])
        # MAIN's own jax Python and test file, for the comparison run.
        unpatched = tmp / "unpatched"
        shutil.copytree(wt / "jax", unpatched / "jax")
        (unpatched / "tests").mkdir()
        shutil.copy(wt / TEST_FILE, unpatched / TEST_FILE)

        failed = None
        for p in patches:
            print(f"{p.number} {p.subject}")
            if failed is not None:
                print(f"    applies: not attempted (the series stopped at {failed})")
                continue
            clean = run(["git", "-C", wt, "apply", "--check", p.path]).returncode == 0
            am = run(["git", "-C", wt, "am", "--3way", p.path], env=env)
            if am.returncode != 0:
                run(["git", "-C", wt, "am", "--abort"], env=env)
                failed = p.number
                why = [line for line in (am.stdout + am.stderr).splitlines()
                       if re.search(r"CONFLICT|^error|^Patch failed|does not apply",
                                    line)]
                print("    applies: NO\n" + "".join(f"      {l}\n" for l in why[-8:]))
                continue
            print(f"    applies: yes ({'cleanly' if clean else 'by 3-way merge only'})")
            results = []
            for f in p.python:
                err = compile_error(wt / f)
                results.append(f"{f} ({'ok' if err is None else 'ERROR: ' + err})")
                if err is not None:
                    failed = failed or p.number
            print(f"    Python files compiled: {', '.join(results) or 'none'}")
            print(f"    C++/build files touched (not built here): "
                  f"{', '.join(p.cxx) or 'none'}")
            other = [f for f in p.files if f not in p.python and f not in p.cxx]
            if other:
                print(f"    other files: {', '.join(other)}")
        if failed is not None:
            print(f"FAILED at patch {failed}")
            return 1
        print(f"all {len(patches)} patches apply to MAIN in order, and the Python "
              f"files they touch compile")

        if args.interop_tests:
            ver = run([args.python, "-c", "import jaxlib; from jaxlib import xla_client; "
                       "print(jaxlib.__version__, xla_client._version)"])
            print(f"{TEST_FILE} on the CPU, each tree's own jax Python over the stock "
                  f"jaxlib of {args.python} (jaxlib, extension version: "
                  f"{ver.stdout.strip() or ver.stderr.strip()}):")
            base, base_sum = pytest_results(args.python, unpatched, tmp / "run-unpatched")
            new, new_sum = pytest_results(args.python, wt, tmp / "run-patched")
            print(f"    MAIN:    {base_sum}")
            print(f"    patched: {new_sum}")
            lost = sorted(t for t, st in base.items() if st == "passed" and new.get(t) != "passed")
            gained = sorted(t for t, st in new.items() if st == "passed" and base.get(t) != "passed")
            for t in lost:
                print(f"      passes on MAIN, not patched: {t} ({new.get(t, 'absent')})")
            for t in gained:
                print(f"      passes patched only: {t.split('::')[-1]}")
            if lost or not base:
                return 1
        return 0
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
