#!/usr/bin/env python3
"""Checks the jax patch series in patches/jax (standard library only).

  check_jax_patches.py --jax-src DIR
      DIR is a jax git checkout or bare clone.  In a temporary repository that
      borrows DIR's objects (DIR is not written to), checks out BASE and
      applies each patch in order with `git am --3way`; prints one line per
      patch (applies: yes/no, cleanly or by 3-way merge, files touched) and
      byte-compiles the Python files each patch touches.  Exits 1 if a patch
      does not apply.  With --jax-tests, then runs the patched
      tests/array_interoperability_test.py against the patched Python
      sources and --python's stock jaxlib of BASE's release (needs pytest and
      absl-py there): tests that need the patched jaxlib or a GPU skip.

  check_jax_patches.py --wheel [--python PY]
      Needs no jax source: PY's installed `jax` (default: this interpreter's)
      must be the release BASE's `wheel` line names.  Copies that package to a temporary
      directory, applies the hunks of each patch that touch `jax/` (the
      Python package; jaxlib's C++ and jax's tests are reported as not
      checkable here), byte-compiles and imports the patched modules from the
      copy in a fresh interpreter, and runs tests/jax_patches/
      patched_jax_checks.py against it with PY's stock jaxlib.  Reports per
      patch.  Exits 1 on any failure, 2 if PY's jax is not BASE's release
      (0 with --skip-if-mismatch, which says so).

      --baseline runs the same checks on the unpatched copy and exits 1 if a
      check that should fail there (any whose name lacks "still") passes: a
      check that cannot fail checks nothing.

patches/jax/BASE holds `commit <40 hex digits>` (the jax commit the series
applies to), `version <X.Y.Z>` (that commit's jax/version.py) and
`wheel <X.Y.Z>` (the release nearest it, whose wheel --wheel checks; without
it, `version`) lines.  --patches DIR checks another series laid out the same
way.
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

# Not resolved: under Bazel this file is a symlink in the runfiles tree, and
# the patches and checks beside it are the ones to use.
ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent
PATCH_DIR = ROOT / "patches" / "jax"
CHECKS = ROOT / "tests" / "jax_patches" / "patched_jax_checks.py"

# Who `git am` and the absent-files commit are committed as (the authors
# stay those of the patches).
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "check_jax_patches", "GIT_AUTHOR_EMAIL": "check@invalid",
    "GIT_COMMITTER_NAME": "check_jax_patches",
    "GIT_COMMITTER_EMAIL": "check@invalid",
}


class CheckError(Exception):
    pass


def run(cmd, *, cwd=None, env=None, input=None):
    return subprocess.run(cmd, cwd=cwd, env=env, input=input, text=True,
                          capture_output=True)


def must(cmd, **kwargs):
    r = run(cmd, **kwargs)
    if r.returncode != 0:
        raise CheckError(f"{' '.join(map(str, cmd))} failed:\n{r.stderr}{r.stdout}")
    return r.stdout


def read_base(patch_dir):
    base = {}
    for line in (patch_dir / "BASE").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, value = line.partition(" ")
            base[key] = value.strip()
    if not re.fullmatch(r"[0-9a-f]{40}", base.get("commit", "")):
        raise CheckError(f"{patch_dir / 'BASE'}: no `commit <40 hex digits>` line")
    if not re.fullmatch(r"\d+\.\d+\.\d+(\.\d+)?", base.get("version", "")):
        raise CheckError(f"{patch_dir / 'BASE'}: no `version X.Y.Z` line")
    return base


class Patch:
    def __init__(self, path):
        self.path = path
        self.number = path.name[:4]
        text = path.read_text()
        m = re.search(r"^Subject: (?:\[PATCH[^\]]*\] )?(.*(?:\n .*)*)", text, re.M)
        self.subject = " ".join(m.group(1).split()) if m else path.name
        # From the diff headers: `git apply --numstat` would list nothing for
        # a patch read from a subdirectory of some repository.
        self.files = re.findall(r"^diff --git a/\S+ b/(\S+)$", text, re.M)
        self.jax_files = [f for f in self.files if f.startswith("jax/")]
        self.other_files = [f for f in self.files if not f.startswith("jax/")]
        # The jaxlib_extension_version gates its Python adds (jax's tests aside).
        self.gates = sorted({int(g) for g in re.findall(
            r"^\+(?!\s*@unittest).*jaxlib_extension_version\s*>=\s*(\d+)", text, re.M)})

    def title(self):
        return f"{self.number} {self.subject}"


def load_patches(patch_dir):
    paths = sorted(patch_dir.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    if not paths:
        raise CheckError(f"no NNNN-*.patch files in {patch_dir}")
    return [Patch(p) for p in paths]


def compile_errors(paths, python=None):
    """Byte-compiles `paths` (with `python`, else in this interpreter);
    returns the errors."""
    if python is not None:
        r = run([python, "-m", "py_compile", *map(str, paths)])
        return [] if r.returncode == 0 else [r.stderr.strip()]
    errors = []
    for p in paths:
        try:
            compile(pathlib.Path(p).read_text(), str(p), "exec")
        except SyntaxError as e:
            errors.append(f"{p}: {e}")
    return errors


# --jax-src ------------------------------------------------------------------


def absent_blobs(repo, rev):
    """Paths of files at `rev` whose content this clone lacks (partial or
    size-limited clones)."""
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


def run_jax_tests(python, wt):
    """Runs the patched interoperability tests against the patched Python
    sources in `wt` with `python`'s installed jaxlib; returns success."""
    tests = wt / "tests" / "array_interoperability_test.py"
    env = dict(os.environ, PYTHONPATH=str(wt), JAX_PLATFORMS="cpu")
    env.pop("PYTHONSAFEPATH", None)
    # From a directory of its own: jax's conftest.py and pytest.ini want
    # plugins this check does not need.
    run_dir = wt.parent / "jax-tests"
    run_dir.mkdir()
    shutil.copy(tests, run_dir)
    r = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "-c", os.devnull, "--rootdir", str(run_dir), tests.name],
            cwd=run_dir, env=env)
    where = run([python, "-c", "import jax, jaxlib; print(jax.__file__); "
                 "print(jaxlib.__version__)"], env=env)
    lines = where.stdout.split()
    from_source = bool(lines) and pathlib.Path(lines[0]).is_relative_to(wt)
    jaxlib_version = lines[1] if len(lines) > 1 else "?"
    tail = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"jax's tests/array_interoperability_test.py (patched), on the CPU, "
          f"against the patched Python sources and the stock jaxlib "
          f"{jaxlib_version} of {python}: {tail}")
    if not from_source:
        print(f"  but jax was not imported from the patched sources: {where.stdout}{where.stderr}")
    if r.returncode != 0:
        print(r.stdout[-6000:] + r.stderr[-3000:])
    return r.returncode == 0 and from_source


def check_source(src, patch_dir, keep, jax_tests=False, python=None):
    base = read_base(patch_dir)
    patches = load_patches(patch_dir)
    commit = base["commit"]
    git_dir = must(["git", "-C", src, "rev-parse", "--path-format=absolute",
                    "--git-common-dir"]).strip()
    if run(["git", "--git-dir", git_dir, "cat-file", "-e",
            f"{commit}^{{commit}}"]).returncode != 0:
        raise CheckError(f"{src} does not have BASE {commit} (jax {base['version']})")
    print(f"jax patch series: {len(patches)} patches; BASE {commit[:12]} "
          f"(jax {base['version']}); source {src}")

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="check-jax-patches-"))
    env = dict(os.environ, **GIT_IDENTITY)
    try:
        wt = tmp / "jax"
        must(["git", "init", "-q", str(wt)])
        # Borrow the source's objects: nothing is written to it.
        (wt / ".git" / "objects" / "info" / "alternates").write_text(
            f"{git_dir}/objects\n")
        must(["git", "-C", wt, "update-ref", "HEAD", commit])
        must(["git", "-C", wt, "read-tree", "HEAD"])
        missing = absent_blobs(wt, "HEAD")
        if missing:
            # Git cannot write a tree (so `git am` cannot commit) while the
            # index names content the clone lacks.  The patches touch none of
            # these files.
            touched = {f for p in patches for f in p.files}
            clash = sorted(touched.intersection(missing))
            if clash:
                raise CheckError(f"the patches touch files absent from {src}: {clash}")
            must(["git", "-C", wt, "rm", "-q", "--cached",
                  "--pathspec-from-file=-", "--pathspec-file-nul"],
                 input="".join(f"{p}\0" for p in missing))
            must(["git", "-C", wt, "commit", "-q", "-m",
                  "check_jax_patches: drop files absent from the source clone"],
                 env=env)
            print(f"  {len(missing)} file(s) at BASE absent from this clone "
                  f"(left out of the index; no patch touches them): "
                  f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        must(["git", "-C", wt, "checkout", "-q", "-f"])

        failed = None
        for p in patches:
            if failed is not None:
                print(f"{p.title()}\n    applies: not attempted (the series "
                      f"stopped at {failed})")
                continue
            clean = run(["git", "-C", wt, "apply", "--check", str(p.path)]).returncode == 0
            am = run(["git", "-C", wt, "am", "--3way", str(p.path)], env=env)
            if am.returncode != 0:
                run(["git", "-C", wt, "am", "--abort"], env=env)
                failed = p.number
                # What failed where, without git's advice on resolving it.
                why = [line for line in (am.stdout + am.stderr).splitlines()
                       if re.search(r"CONFLICT|^error|^Patch failed|does not "
                                    r"apply", line)]
                print(f"{p.title()}\n    applies: NO\n"
                      + "".join(f"      {line}\n" for line in why[-8:]))
                continue
            how = "cleanly" if clean else "by 3-way merge only"
            errors = compile_errors([wt / f for f in p.files
                                     if f.endswith((".py", ".pyi"))])
            print(f"{p.title()}\n    applies: yes ({how}); files: {', '.join(p.files)}")
            if errors:
                failed = failed or p.number
                print("    Python files do not compile:\n      " + "\n      ".join(errors))
        if failed is not None:
            return 1
        print(f"all {len(patches)} patches apply to BASE in order "
              f"(and the Python files they touch compile)")
        if jax_tests and not run_jax_tests(python, wt):
            return 1
        return 0
    finally:
        if keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


# --wheel -------------------------------------------------------------------

_PROBE = r"""
import importlib.metadata, importlib.util, json, os, re
spec = importlib.util.find_spec("jax")
path = os.path.dirname(spec.origin) if spec and spec.origin else None
ext = None
lib = importlib.util.find_spec("jaxlib")
if lib and lib.origin:
    m = re.search(r"^_version *= *(\d+)",
                  open(os.path.join(os.path.dirname(lib.origin), "xla_client.py")).read(), re.M)
    ext = m and int(m.group(1))
print(json.dumps({"version": importlib.metadata.version("jax") if path else None,
                  "path": path, "extension": ext}))
"""


def installed_jax(python):
    import json
    return json.loads(must([python, "-c", _PROBE]))


def run_checks(python, copy, junit, gates):
    env = dict(os.environ, PYTHONPATH=str(copy), JAX_PATCHED_COPY=str(copy),
               JAX_PLATFORMS="cpu",
               JAX_PATCH_GATES=",".join(f"{n}={g}" for n, g in gates.items()))
    env.pop("PYTHONSAFEPATH", None)
    r = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"--junitxml={junit}", str(CHECKS)], cwd=ROOT, env=env)
    results = {}
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            name = case.get("name", "")
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "failed"
            elif case.find("skipped") is not None:
                outcome = "skipped"
            else:
                outcome = "passed"
            results[name] = outcome
    return r, results


def check_wheel(python, patch_dir, keep, baseline, skip_if_mismatch):
    base = read_base(patch_dir)
    patches = load_patches(patch_dir)
    info = installed_jax(python)
    # The release whose wheel the Python hunks are checked against: the one
    # nearest BASE's commit (`wheel X.Y.Z`; BASE's own `version` if none).
    release = base.get("wheel", base["version"])
    if info["version"] != release:
        why = (f"{python} has jax {info['version']}, but the patch series is "
               f"checked against jax {release}: install jax=={release} "
               f"and jaxlib=={release} to check it")
        if skip_if_mismatch:
            print(f"SKIPPED: {why}")
            return 0
        print(f"error: {why}", file=sys.stderr)
        return 2
    print(f"jax patch series: {len(patches)} patches; BASE jax {base['version']} "
          f"({base['commit'][:12]}); wheel {info['path']} (jax {release}, {python})"
          + ("; BASELINE: hunks not applied" if baseline else ""))
    gates = {p.number: p.gates[0] for p in patches if p.gates}
    lowest = min(gates.values(), default=None)
    collides = lowest is not None and (info.get("extension") or 0) >= lowest
    if collides:
        # A stock jaxlib whose extension version already reaches the
        # series' gates (upstream numbered past them) would turn on gated
        # Python that calls C++ it lacks.  The copy is checked as a stock
        # jaxlib below the gates runs it: the version jax reads is held
        # under the lowest gate, in the copy only.
        print(f"  stock jaxlib extension version {info['extension']} reaches the series' "
              f"gates ({', '.join(f'{n}: {g}' for n, g in gates.items())}): the copy "
              f"reads {lowest - 1}, as a stock jaxlib below the gates")

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="check-jax-wheel-"))
    # `git apply` must not find a repository around the copy.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp.parent))
    ok = True
    try:
        copy = tmp / "site"
        shutil.copytree(info["path"], copy / "jax",
                        ignore=shutil.ignore_patterns("__pycache__"))
        if collides:
            lib = copy / "jax" / "_src" / "lib" / "__init__.py"
            lib.write_text(lib.read_text() + (
                "\n# tools/check_jax_patches.py: held under the patch series' gates.\n"
                f"jaxlib_extension_version = min(jaxlib_extension_version, {lowest - 1})\n"))
        patched = []
        status = {}
        for p in patches:
            if not p.jax_files or baseline:
                continue
            r = run(["git", "apply", "-p1", "--include=jax/*", str(p.path)],
                    cwd=copy, env=env)
            if r.returncode != 0:
                ok = False
                status[p.number] = "do NOT apply:\n      " + r.stderr.strip().replace("\n", "\n      ")
                continue
            errors = compile_errors([copy / f for f in p.jax_files], python)
            if errors:
                ok = False
                status[p.number] = "applied; do NOT compile:\n      " + "\n      ".join(errors)
            else:
                status[p.number] = "applied, compiled"
                patched += p.jax_files

        modules = sorted({f[:-3].replace("/", ".") for f in patched
                          if f.endswith(".py")}) or ["jax"]
        probe = ("import importlib, jax, jax.numpy, jax.dlpack\n"
                 f"for m in {modules!r}: importlib.import_module(m)\n"
                 "print(jax.__file__)")
        r = run([python, "-c", probe],
                env=dict(os.environ, PYTHONPATH=str(copy), JAX_PLATFORMS="cpu"))
        imported = r.returncode == 0 and pathlib.Path(r.stdout.strip()).is_relative_to(copy)
        if not imported:
            ok = False
        print(f"  import of the {'patched' if not baseline else 'unpatched'} copy "
              f"({', '.join(modules)}): " + ("ok" if imported else
                                              "FAILED\n" + r.stderr + r.stdout))

        r, results = run_checks(python, copy, tmp / "junit.xml", gates)
        if not results:
            ok = False
            print("  the checks did not run:\n" + r.stdout[-3000:] + r.stderr[-3000:])
        by_patch = {}
        for name, outcome in results.items():
            m = re.match(r"test_(\d{4})_", name)
            by_patch.setdefault(m.group(1) if m else "????", []).append((name, outcome))

        cannot_fail = []
        for p in patches:
            print(p.title())
            if p.jax_files:
                what = "not applied (baseline)" if baseline else status.get(p.number)
                print(f"    Python hunks ({', '.join(p.jax_files)}): {what}")
            else:
                print("    Python hunks: none")
            tests = by_patch.get(p.number, [])
            counts = {o: sum(1 for _, x in tests if x == o)
                      for o in ("passed", "failed", "skipped")}
            summary = ", ".join(f"{n} {o}" for o, n in counts.items() if n) or "none"
            print(f"    checks ({CHECKS.name}): {summary}")
            for name, outcome in tests:
                if baseline:
                    if outcome == "passed" and "still" not in name:
                        cannot_fail.append(name)
                elif outcome != "passed":
                    ok = False
                    print(f"      {outcome}: {name}")
            if p.other_files:
                print("    not checkable without building jaxlib here (C++, "
                      f"build files, jax's own tests): {', '.join(p.other_files)}")
        if not baseline and not ok and results:
            print(r.stdout[-6000:])
        if baseline:
            failing = sum(o != "passed" for o in results.values())
            if not results:
                print("baseline: FAILED: the checks did not run")
                return 1
            if cannot_fail:
                print(f"baseline: FAILED: {len(cannot_fail)} check(s) pass "
                      f"without the patches, so they check nothing: "
                      f"{', '.join(cannot_fail)}")
                return 1
            print(f"baseline: {failing} of {len(results)} checks fail on the "
                  f"unpatched release; the {len(results) - failing} that pass "
                  f"guard behaviour the series keeps (named 'still')")
            return 0
        print("all Python hunks apply to the wheel, compile, import and pass "
              "their checks" if ok else "FAILED")
        return 0 if ok else 1
    finally:
        if keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--jax-src", metavar="DIR",
                      help="a jax git checkout or bare clone that has BASE")
    mode.add_argument("--wheel", action="store_true",
                      help="check the Python hunks against an installed jax")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter whose jax --wheel checks, and "
                             "that runs --jax-tests")
    parser.add_argument("--jax-tests", action="store_true",
                        help="--jax-src: also run the patched "
                             "array_interoperability_test.py on the CPU")
    parser.add_argument("--baseline", action="store_true",
                        help="--wheel: run the checks on the unpatched copy")
    parser.add_argument("--skip-if-mismatch", action="store_true",
                        help="--wheel: exit 0, saying so, if the installed jax "
                             "is not BASE's release")
    parser.add_argument("--patches", type=pathlib.Path, default=PATCH_DIR,
                        help=f"the series (default {PATCH_DIR})")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary directory")
    args = parser.parse_args(argv)
    # git runs in a temporary repository: the patches' paths must not be
    # relative to this directory.
    args.patches = args.patches.absolute()
    try:
        if args.jax_src:
            return check_source(args.jax_src, args.patches, args.keep,
                                args.jax_tests, args.python)
        return check_wheel(args.python, args.patches, args.keep, args.baseline,
                           args.skip_if_mismatch)
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
