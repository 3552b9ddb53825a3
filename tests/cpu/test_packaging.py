"""Packaging: the version in one place (jax_overlay/_version.py), the
import-time checks of the native module (missing, unloadable, stale, a
jaxlib outside the supported range: jax_overlay/_native.py), the type stub
against the built module, the public API's annotations and the files a
wheel must carry.  Runs against whatever jax_overlay is imported: the
source tree, the Bazel-staged package or an installed wheel (.ci/run)."""

import ast
import importlib.machinery
import importlib.metadata
import inspect
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import types
import typing

import pytest

import jax_overlay
from jax_overlay import _native
from jax_overlay import _version
from jax_overlay import _xla_ext as ext
from forge import HOOKS, has_hooks

PACKAGE = pathlib.Path(jax_overlay.__file__).resolve().parent
PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
STUB = PACKAGE / "_xla_ext.pyi"
RANGE = f"jaxlib >= {_version.JAXLIB_MIN}, < {_version.JAXLIB_BELOW}"


def _pyproject():
    if not PYPROJECT.is_file():
        pytest.skip(f"no pyproject.toml at {PYPROJECT}")
    return tomllib.loads(PYPROJECT.read_text())


# The version -------------------------------------------------------------

def test_one_version_everywhere():
    assert jax_overlay.__version__ == _version.__version__
    assert ext.VERSION == _version.__version__
    assert ext.ABI == _version.ABI
    assert ext.JAXLIB_RANGE == (_version.JAXLIB_MIN, _version.JAXLIB_BELOW)
    assert isinstance(ext.JAXLIB_AT_BUILD, str)
    # No other file of the package spells a version out.
    for f in PACKAGE.glob("*.py"):
        if f.name != "_version.py":
            assert not re.search(r"^__version__\s*=", f.read_text(), re.M), f


def test_pyproject_reads_the_version_from_version_py():
    project = _pyproject()
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "jax_overlay._version.__version__"}


def test_pyproject_jax_requirement_is_the_supported_range():
    deps = _pyproject()["project"]["dependencies"]
    (jax,) = [d for d in deps if re.match(r"jax\s*[<>=!~]", d)]
    bounds = dict(re.fullmatch(r"\s*(>=|<)\s*([\w.]+)\s*", c).groups()
                  for c in jax[len("jax"):].split(","))
    assert bounds == {">=": _version.JAXLIB_MIN, "<": _version.JAXLIB_BELOW}, jax


def test_test_extra_installs_every_test_dependency():
    extra = _pyproject()["project"]["optional-dependencies"]["test"]
    names = {re.match(r"[\w-]+", d).group().lower().replace("_", "-") for d in extra}
    assert {"pytest", "hypothesis", "ml-dtypes", "pybind11", "setuptools", "absl-py",
            "mypy", "pyarrow", "array-api-strict", "rich", "matplotlib"} <= names


def _installed_distribution():
    """(distribution, its files) of the installed jax_overlay (an
    installer's RECORD, not a build's egg-info) that holds the imported
    package, or (None, ())."""
    for dist in importlib.metadata.distributions(name="jax_overlay"):
        if dist.read_text("RECORD") is None:
            continue
        files = {pathlib.Path(dist.locate_file(f)).resolve() for f in dist.files or []}
        if PACKAGE / "__init__.py" in files:
            return dist, files
    return None, ()


def test_installed_metadata_has_the_version():
    """Where jax_overlay is an installed distribution (the wheel run of
    .ci/run), its metadata carries _version.py's version."""
    dist, files = _installed_distribution()
    if dist is None:
        pytest.skip(f"jax_overlay is imported from {PACKAGE}, not from an installed distribution")
    assert dist.version == jax_overlay.__version__
    # What the wheel must carry beside the code.
    for name in ("py.typed", "_xla_ext.pyi", pathlib.Path(ext.__file__).name):
        assert PACKAGE / name in files, name


def test_typing_files_are_beside_the_package():
    assert (PACKAGE / "py.typed").is_file()
    assert STUB.is_file()


# The import-time checks ------------------------------------------------------

def _stage(tmp_path, *, native=None, checkout=False, version=None):
    """A copy of the package in tmp_path, with `native` (a path) as its
    native module, and _version.py's assignments replaced by `version`."""
    pkg = tmp_path / "jax_overlay"
    pkg.mkdir()
    for f in PACKAGE.rglob("*"):
        if f.suffix in (".py", ".pyi") or f.name == "py.typed":
            dest = pkg / f.relative_to(PACKAGE)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, dest)
    if native is not None:
        shutil.copy(native, pkg / f"_xla_ext{importlib.machinery.EXTENSION_SUFFIXES[0]}")
    if checkout:
        (tmp_path / "setup.py").write_text("")
        (tmp_path / "xla_ext").mkdir()
        (tmp_path / "xla_ext" / "module.cc").write_text("")
    text = (pkg / "_version.py").read_text()
    for name, value in (version or {}).items():
        text, n = re.subn(rf"^{name} = .*$", f"{name} = {value!r}", text, flags=re.M)
        assert n == 1, name
    (pkg / "_version.py").write_text(text)
    return pkg


def _import(cwd, code="import jax_overlay"):
    """(exit status, stderr) of `code` in a fresh Python that imports the
    package staged in `cwd` (first on its path)."""
    env = dict(os.environ, PYTHONPATH=str(cwd), JAX_PLATFORMS="cpu")
    env.pop("PYTHONSAFEPATH", None)
    env.pop("JAX_OVERLAY_ALLOW_ANY_JAXLIB", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stderr


def _import_error(cwd, code="import jax_overlay"):
    """The ImportError line that the import ended with."""
    rc, err = _import(cwd, code)
    assert rc != 0, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), err[-3000:]
    assert "circular import" not in err
    return last[len("ImportError: "):]


def test_missing_native_module_installed_layout(tmp_path):
    pkg = _stage(tmp_path)
    msg = _import_error(tmp_path)
    assert msg.startswith("jax_overlay's native module jax_overlay._xla_ext is not built "
                          "for this Python"), msg
    assert f"{pkg} has no _xla_ext{importlib.machinery.EXTENSION_SUFFIXES[0]}.  " in msg, msg
    assert f"{sys.executable} -m pip install --force-reinstall --no-deps" in msg


def test_missing_native_module_in_a_checkout_names_the_build_command(tmp_path):
    _stage(tmp_path, checkout=True)
    msg = _import_error(tmp_path)
    assert "is not built for this Python" in msg
    assert f"cd {tmp_path} && {sys.executable} setup.py build_ext --inplace " in msg, msg
    assert f"{sys.executable} -m pip install {tmp_path}" in msg


def test_native_module_for_another_python_is_named(tmp_path):
    pkg = _stage(tmp_path, checkout=True)
    other = "_xla_ext.cpython-39-x86_64-linux-gnu.so"
    (pkg / other).write_bytes(b"")
    msg = _import_error(tmp_path)
    assert f"(only {other}, built for another Python or platform)" in msg, msg


def test_unloadable_native_module(tmp_path):
    garbage = tmp_path / "garbage.so"
    garbage.write_bytes(b"not a shared object")
    (tmp_path / "stage").mkdir()
    _stage(tmp_path / "stage", native=garbage, checkout=True)
    msg = _import_error(tmp_path / "stage")
    assert msg.startswith("jax_overlay's native module jax_overlay._xla_ext cannot be loaded ("), msg
    assert "setup.py build_ext --inplace --force" in msg


@pytest.mark.parametrize("field, value, says", [
    ("__version__", "9.9.9", "but the Python package is jax_overlay 9.9.9 (native ABI {abi}, {range})"),
    ("ABI", 999, "but the Python package is jax_overlay {version} (native ABI 999, {range})"),
    ("JAXLIB_BELOW", "0.99", "but the Python package is jax_overlay {version} (native ABI {abi}, "
                             "jaxlib >= {lo}, < 0.99)"),
])
def test_stale_native_module(tmp_path, field, value, says):
    """The real native module, beside a package whose _version.py says
    otherwise: what a build left behind by a version bump looks like."""
    pkg = _stage(tmp_path, native=ext.__file__, checkout=True, version={field: value})
    msg = _import_error(tmp_path)
    so = pkg / pathlib.Path(f"_xla_ext{importlib.machinery.EXTENSION_SUFFIXES[0]}")
    built = (f"jax_overlay {ext.VERSION} (native ABI {ext.ABI}, jaxlib >= {ext.JAXLIB_RANGE[0]}, "
             f"< {ext.JAXLIB_RANGE[1]})")
    assert msg.startswith(f"jax_overlay's native module {so} is stale: it was built from {built}, "), msg
    assert says.format(version=_version.__version__, abi=_version.ABI, range=RANGE,
                       lo=_version.JAXLIB_MIN) in msg, msg
    assert f"cd {tmp_path} && {sys.executable} setup.py build_ext --inplace --force" in msg


def test_native_module_without_a_version_is_stale():
    old = types.ModuleType("jax_overlay._xla_ext")
    old.__file__ = "/somewhere/_xla_ext.so"
    with pytest.raises(ImportError, match="is stale: it records no version") as e:
        _native.check_build(old)
    assert e.value.name == "jax_overlay._xla_ext"


def test_this_native_module_passes():
    _native.check_build(ext)
    _native.check_jaxlib(ext, _native.running_jaxlib())


@pytest.mark.parametrize("version, release", [
    ("0.12.0.1", (0, 12, 0, 1)), ("0.10", (0, 10)), ("0.13.0.dev20260101", (0, 13, 0)),
    ("0.11.0rc1", (0, 11, 0)), ("1.0.0+cuda", (1, 0, 0)),
])
def test_release_numbers(version, release):
    assert _native.release(version) == release


@pytest.mark.parametrize("jaxlib", [
    "0.10.0", "0.10.1", "0.11.2", "0.12.0", "0.12.0.1", "0.12.0.9", "0.12.1"])
def test_supported_jaxlib_imports(jaxlib):
    _native.check_jaxlib(ext, jaxlib)


@pytest.mark.parametrize("jaxlib", ["0.9.2", "0.4.38", "0.12.2", "0.13.0", "0.13.0.dev20260101", "1.0.0"])
def test_unsupported_jaxlib_is_refused_naming_both(monkeypatch, jaxlib):
    monkeypatch.delenv(_native.ALLOW_ANY_JAXLIB, raising=False)
    with pytest.raises(ImportError) as e:
        _native.check_jaxlib(ext, jaxlib)
    msg = str(e.value)
    at_build = ext.JAXLIB_AT_BUILD or "none"
    assert msg.startswith(f"jax_overlay {ext.VERSION} supports {RANGE} (the range its native "
                          f"module {ext.__file__} was built and validated for; jaxlib "
                          f"installed at build time: {at_build}), but this process runs "
                          f"jaxlib {jaxlib}."), msg
    assert f"-m pip install 'jax>={_version.JAXLIB_MIN},<{_version.JAXLIB_BELOW}'" in msg
    newer = _native.release(jaxlib) >= _native.release(_version.JAXLIB_BELOW)
    assert (f"or a jax_overlay that supports jaxlib {jaxlib}." in msg) == newer, msg
    assert "JAX_OVERLAY_ALLOW_ANY_JAXLIB=1" in msg


def test_unsupported_jaxlib_warns_when_allowed(monkeypatch):
    monkeypatch.setenv(_native.ALLOW_ANY_JAXLIB, "1")
    with pytest.warns(RuntimeWarning, match=r"runs jaxlib 0\.13\.0\..*Imported anyway"):
        _native.check_jaxlib(ext, "0.13.0")


def test_unsupported_jaxlib_is_refused_at_import():
    """The whole import, in a fresh Python whose jaxlib claims a release
    outside the range: refused before jax itself is imported."""
    code = ("import jaxlib.version; jaxlib.version.__version__ = '0.13.0'\n"
            "import jax_overlay")
    msg = _import_error(PACKAGE.parent, code)
    assert msg.startswith(f"jax_overlay {ext.VERSION} supports {RANGE} "), msg
    assert "this process runs jaxlib 0.13.0." in msg


# The type stub ---------------------------------------------------------------

def _stub():
    return ast.parse(STUB.read_text(), str(STUB))


def _is_alias(node):
    return isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) == "TypeAlias"


def _stub_names(tree):
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and not _is_alias(node):
            out[node.target.id] = node
    return out


def _depths(text):
    """(index, character, bracket depth before it) for each character."""
    depth = 0
    for i, c in enumerate(text):
        yield i, c, depth
        depth += (c in "([{") - (c in ")]}")


def _split_top(text):
    """`text` split at the commas outside brackets."""
    cuts = [i for i, c, d in _depths(text) if c == "," and d == 0]
    parts = [text[a + 1:b] for a, b in zip([-1] + cuts, cuts + [len(text)])]
    return [p.strip() for p in parts if p.strip()]


def _outside_brackets(text, char):
    return any(c == char and d == 0 for _, c, d in _depths(text))


def _pybind_params(fn):
    """[(name, kind, has default)] from the signature pybind11 writes as
    the first line of a function's __doc__: "name(a: T, b: T = 0, *args) -> R"."""
    first = fn.__doc__.splitlines()[0]
    assert first.startswith(fn.__name__ + "("), first
    start = len(fn.__name__)
    end = next(i for i, c, d in _depths(first) if i > start and c == ")" and d == 1)
    out = []
    for p in _split_top(first[start + 1:end]):
        kind = "var" if p.startswith("*") and not p.startswith("**") else "kwvar" if p.startswith("**") else "arg"
        name = re.match(r"\**(\w+)", p).group(1)
        out.append((name, kind, _outside_brackets(p, "=")))
    return out


def _stub_params(node):
    a = node.args
    plain = a.posonlyargs + a.args
    defaults = [False] * (len(plain) - len(a.defaults)) + [True] * len(a.defaults)
    out = [(p.arg, "arg", d) for p, d in zip(plain, defaults)]
    if a.vararg:
        out.append((a.vararg.arg, "var", False))
    out += [(p.arg, "arg", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append((a.kwarg.arg, "kwvar", False))
    return out


def test_stub_names_match_the_module():
    stub = set(_stub_names(_stub()))
    if not ext.TESTING:
        stub -= HOOKS  # a module built without its test hooks: a wheel's
    module = {n for n in dir(ext) if not (n.startswith("__") and n.endswith("__"))}
    assert stub == module, (f"only in the stub: {sorted(stub - module)}; "
                            f"only in the module: {sorted(module - stub)}")


def test_stub_functions_have_pybind11s_parameters():
    checked = 0
    for name, node in _stub_names(_stub()).items():
        if isinstance(node, ast.FunctionDef) and (ext.TESTING or name not in HOOKS):
            fn = getattr(ext, name)
            assert callable(fn) and not isinstance(fn, type), name
            assert _stub_params(node) == _pybind_params(fn), (name, fn.__doc__.splitlines()[0])
            assert node.returns is not None, name
            checked += 1
    assert checked >= (30 if ext.TESTING else 15)  # the stub was read, not skipped


def test_the_test_hooks_are_all_or_none():
    """A TESTING build binds every hook the tests know; any other (a wheel)
    binds none, and says so."""
    present = {n for n in HOOKS if hasattr(ext, n)}
    assert present == (set(HOOKS) if ext.TESTING else set()), sorted(present)
    assert has_hooks() is ext.TESTING


def test_stub_classes_match():
    for name, node in _stub_names(_stub()).items():
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(ext, name)
        assert isinstance(cls, type), name
        runtime = {n for n in vars(cls) if not n.startswith("_")}
        members = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
        assert set(members) == runtime, name
        for member, fn in members.items():
            is_property = any(ast.unparse(d) == "property" for d in fn.decorator_list)
            assert is_property == isinstance(vars(cls)[member], property), (name, member)


def test_stub_constants_have_their_types():
    for name, node in _stub_names(_stub()).items():
        if isinstance(node, ast.AnnAssign):
            declared = ast.unparse(node.annotation).split("[")[0]
            assert type(getattr(ext, name)).__name__ == declared, name


# The public API's annotations ---------------------------------------------

@pytest.mark.parametrize("name", [
    n for n in jax_overlay.__all__ if inspect.isfunction(getattr(jax_overlay, n))])
def test_public_function_is_fully_annotated(name):
    fn = getattr(jax_overlay, name)
    sig = inspect.signature(fn)
    missing = [p for p, v in sig.parameters.items() if v.annotation is inspect.Parameter.empty]
    assert not missing, f"{name}: parameters without annotations: {missing}"
    assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return annotation"
    typing.get_type_hints(fn)  # every annotation resolves


def test_public_config_is_annotated():
    hints = typing.get_type_hints(type(jax_overlay.config))
    assert set(vars(jax_overlay.config)) <= set(hints)
    for attr, value in vars(jax_overlay.config).items():
        assert isinstance(value, hints[attr]), attr


def _fake_install(site, native, checkout_root):
    """jax_overlay as `pip install CHECKOUT` leaves it in `site`: the native
    module, and a dist-info whose RECORD lists it and whose direct_url.json
    names the checkout."""
    name = f"_xla_ext{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    (site / "jax_overlay").mkdir(parents=True)
    shutil.copy(native, site / "jax_overlay" / name)
    info = site / f"jax_overlay-{jax_overlay.__version__}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: jax_overlay\nVersion: {jax_overlay.__version__}\n")
    (info / "RECORD").write_text(f"jax_overlay/{name},,\n")
    (info / "direct_url.json").write_text(json.dumps(
        {"url": checkout_root.resolve().as_uri(), "dir_info": {}}))
    return site / "jax_overlay" / name


def _run_in(cwd, path, code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, path)), JAX_PLATFORMS="cpu")
    env.pop("PYTHONSAFEPATH", None)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("same_checkout", [True, False])
def test_a_checkout_without_a_build_uses_its_own_installed_one(tmp_path, same_checkout):
    """`pip install .` then `python -m jax_overlay doctor` in the checkout:
    the checkout's package is imported first, with no build of its own; it
    takes the native module pip installed from this checkout, and only
    that (another checkout's install still gets the build command)."""
    root = tmp_path / "checkout"
    root.mkdir()
    _stage(root, checkout=True)
    other = tmp_path / "elsewhere"
    other.mkdir()
    installed = _fake_install(tmp_path / "site", ext.__file__, root if same_checkout else other)
    r = _run_in(root, [root, tmp_path / "site"],
                "import jax_overlay, jax_overlay._xla_ext as m, jax_overlay._dlpack as e\n"
                "print(m.__file__); print(e.ext is m); print(jax_overlay.__file__)")
    if same_checkout:
        assert r.returncode == 0, r.stderr[-3000:]
        native, same, package = r.stdout.split()
        assert pathlib.Path(native).resolve() == installed.resolve()
        assert same == "True"
        assert pathlib.Path(package).resolve() == (root / "jax_overlay" / "__init__.py").resolve()
    else:
        assert r.returncode != 0
        assert "is not built for this Python" in r.stderr and "build_ext --inplace" in r.stderr
