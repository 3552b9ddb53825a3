"""The jax patch series (patches/jax) and its checker, tools/check_jax_patches.py.

test_python_hunks_on_installed_jax runs the checker's --wheel mode: it needs
the installed jax to be the release BASE's `wheel` line names (CI makes a
venv with it), and is skipped, saying why, on any other.  The other tests check
the checker itself on a small git repository made here.
"""

import importlib.metadata
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
CHECKER = ROOT / "tools" / "check_jax_patches.py"

spec = importlib.util.spec_from_file_location("check_jax_patches", CHECKER)
checker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(checker)

BASE = checker.read_base(checker.PATCH_DIR)


def _installed_jax():
    try:
        return importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        return None


# The release nearest BASE's commit, whose wheel the Python hunks are checked
# against.
WHEEL = BASE.get("wheel", BASE["version"])


@pytest.mark.skipif(
    _installed_jax() != WHEEL,
    reason=f"the installed jax is {_installed_jax()}, the patch series' Python "
           f"hunks are checked against the jax {WHEEL} wheel (CI: "
           "tools/check_jax_patches.py --wheel in a venv with it)")
def test_python_hunks_on_installed_jax():
    r = subprocess.run([sys.executable, str(CHECKER), "--wheel"],
                       capture_output=True, text=True)
    print(r.stdout, r.stderr)
    assert r.returncode == 0
    assert "pass their checks" in r.stdout


def test_every_patch_is_checked_by_name():
    """Each patch with Python hunks has checks named after it, and every
    check names a patch of the series."""
    numbers = {p.number for p in checker.load_patches(checker.PATCH_DIR)
               if p.jax_files}
    names = set()
    text = checker.CHECKS.read_text()
    for line in text.splitlines():
        if line.startswith("def test_"):
            names.add(line[len("def test_"):][:4])
    assert names == numbers


# The checker on a repository made here -------------------------------------


def git(repo, *args, input=None):
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
         "-c", "init.defaultBranch=main", *args],
        check=True, capture_output=True, text=True, input=input).stdout


@pytest.fixture
def series(tmp_path):
    """A source repository with BASE, and a series of two patches."""
    src = tmp_path / "src"
    src.mkdir()
    git(src, "init", "-q")
    (src / "jax").mkdir()
    (src / "jax" / "a.py").write_text("x = 1\n")
    (src / "big.bin").write_bytes(b"\0" * 100)
    git(src, "add", ".")
    git(src, "commit", "-q", "-m", "base")
    base = git(src, "rev-parse", "HEAD").strip()
    (src / "jax" / "a.py").write_text("x = 2\n")
    git(src, "commit", "-q", "-am", "first")
    (src / "jax" / "b.py").write_text("y = 3\n")
    git(src, "add", ".")
    git(src, "commit", "-q", "-m", "second")
    patches = tmp_path / "patches"
    git(src, "format-patch", "-q", "-o", str(patches), f"{base}..HEAD")
    git(src, "reset", "-q", "--hard", base)
    (patches / "BASE").write_text(f"commit {base}\nversion 0.0.1\n")
    return src, patches


def check(src, patches, capsys):
    rc = checker.check_source(str(src), patches, keep=False)
    return rc, capsys.readouterr().out


def test_checker_applies_the_series(series, capsys):
    rc, out = check(*series, capsys)
    assert rc == 0, out
    assert out.count("applies: yes (cleanly)") == 2
    assert "files: jax/b.py" in out


@pytest.mark.parametrize("number, old, new, expected", [
    # A context line BASE does not have: the series stops there.
    ("0001", "-x = 1", "-x = 7",
     ["applies: NO", "not attempted (the series stopped at 0001)"]),
    ("0002", "+y = 3", "+y = = 3", ["do not compile"]),
])
def test_checker_reports_a_broken_patch(series, capsys, number, old, new,
                                        expected):
    src, patches = series
    patch = sorted(patches.glob(f"{number}-*.patch"))[0]
    patch.write_text(patch.read_text().replace(old, new))
    rc, out = check(src, patches, capsys)
    assert rc == 1
    for text in expected:
        assert text in out


def test_checker_works_around_content_absent_from_the_clone(series, capsys):
    # Clones that lack large files (partial clones, size-limited mirrors)
    # cannot commit BASE's index as is.
    src, patches = series
    sha = git(src, "rev-parse", "HEAD:big.bin").strip()
    (src / ".git" / "objects" / sha[:2] / sha[2:]).unlink()
    rc, out = check(src, patches, capsys)
    assert rc == 0, out
    assert "absent from this clone" in out and "big.bin" in out


def test_checker_refuses_a_source_without_base(series, capsys):
    src, patches = series
    (patches / "BASE").write_text(f"commit {'1' * 40}\nversion 0.0.1\n")
    with pytest.raises(checker.CheckError, match="does not have BASE"):
        checker.check_source(str(src), patches, keep=False)
