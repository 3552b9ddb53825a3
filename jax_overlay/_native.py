"""Room: the native module, checked before anything uses it.

``import jax_overlay`` imports this first.  It raises ImportError, saying
what happened and the command that fixes it, when

* the native module (``jax_overlay._xla_ext``) is missing, was built for
  another Python or cannot be loaded;
* it is stale: built from another version of jax_overlay, native ABI
  number or supported jaxlib range (jax_overlay/_version.py, compiled into
  the module by xla_ext/build_info.py);
* the running jaxlib is outside the range the module was built and
  validated for (``JAXLIB_RANGE``, from _version.py).  The module does not
  link jaxlib, but the Python side drives jaxlib's private DLPack and FFI
  entry points.  ``JAX_OVERLAY_ALLOW_ANY_JAXLIB=1`` turns this one into a
  warning, for trying a new jaxlib.

A jaxlib inside the range that differs from the one installed at build time
(``JAXLIB_AT_BUILD``) is fine: nothing of jaxlib is compiled in.

A source checkout with no build of its own takes the native module that
``pip install .`` of that same checkout installed (see installed_build):
the README's ``pip install ".[test]"`` then ``python -m jax_overlay doctor``
run in the checkout, where Python imports the checkout's package first.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import shlex
import sys
import urllib.parse
import warnings
from types import ModuleType

from . import _version

MODULE = f"{__package__}._xla_ext"
ALLOW_ANY_JAXLIB = "JAX_OVERLAY_ALLOW_ANY_JAXLIB"
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


def checkout() -> pathlib.Path | None:
    """The source checkout the package is imported from, or None when it
    is installed (site-packages has no setup.py beside it)."""
    root = _PACKAGE_DIR.parent
    if (root / "setup.py").is_file() and (root / "xla_ext" / "module.cc").is_file():
        return root
    return None


def fix(force: bool = False) -> str:
    """The command that (re)builds the native module for this Python."""
    python = shlex.quote(sys.executable)
    root = checkout()
    if root is None:
        return ("reinstall jax_overlay for this Python from its wheel or source checkout: "
                f"{python} -m pip install --force-reinstall --no-deps PATH_TO_WHEEL_OR_CHECKOUT")
    where = shlex.quote(str(root))
    return (f"this is a source checkout, so build it in place: cd {where} && {python} "
            f"setup.py build_ext --inplace{' --force' if force else ''} (or install the "
            f"package: {python} -m pip install {where})")


def _missing() -> ImportError:
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    # Python imports _xla_ext + one of its suffixes: any other is for another.
    others = sorted(p.name for p in _PACKAGE_DIR.glob("_xla_ext.*")
                    if p.suffix in (".so", ".pyd") and p.name not in {"_xla_ext" + s for s in suffixes})
    found = (f" (only {', '.join(others)}, built for another Python or platform)"
             if others else "")
    return ImportError(
        f"jax_overlay's native module {MODULE} is not built for this Python "
        f"({sys.version.split()[0]}): {_PACKAGE_DIR} has no _xla_ext{suffixes[0]}{found}.  "
        f"To fix it, {fix()}.", name=MODULE)


def _unloadable(e: ImportError) -> ImportError:
    return ImportError(
        f"jax_overlay's native module {MODULE} cannot be loaded ({e}): it was "
        f"probably built for another Python, platform or version of jax_overlay.  "
        f"To fix it, {fix(force=True)}.", name=MODULE, path=e.path)


def installed_build(root: pathlib.Path) -> pathlib.Path | None:
    """For the source checkout `root` with no build of its own: the native
    module that ``pip install .`` of this very checkout installed for this
    Python (pip's direct_url.json names the directory), as after the
    README's ``pip install ".[test]"`` and ``python -m jax_overlay doctor``
    in the checkout, which imports the checkout's package first.  None when
    there is none."""
    names = {"_xla_ext" + s for s in importlib.machinery.EXTENSION_SUFFIXES}
    for dist in importlib.metadata.distributions(name="jax_overlay"):
        try:
            url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
        except ValueError:
            continue
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme != "file" or not parsed.path:
            continue
        if pathlib.Path(urllib.parse.unquote(parsed.path)).resolve() != root.resolve():
            continue
        for f in dist.files or ():
            if f.name in names and f.parent.name == "jax_overlay":
                path = pathlib.Path(str(dist.locate_file(f))).resolve()
                if path.is_file() and path.parent != _PACKAGE_DIR:
                    return path
    return None


def _load_from(path: pathlib.Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE, path)
    assert spec is not None and spec.loader is not None
    ext = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = ext
    try:
        spec.loader.exec_module(ext)
    except BaseException:
        del sys.modules[MODULE]
        raise
    setattr(sys.modules[__package__], "_xla_ext", ext)
    return ext


def load() -> ModuleType:
    """The native module, or ImportError saying how to build it.  A
    checkout without a build of its own uses an installed one of the same
    version, which check_build() then verifies like any other."""
    try:
        ext = importlib.import_module(MODULE)
    except ModuleNotFoundError as e:
        if e.name != MODULE:
            raise
        root = checkout()
        installed = installed_build(root) if root is not None else None
        if installed is None:
            raise _missing() from None
        try:
            ext = _load_from(installed)
        except ImportError as e:
            raise _unloadable(e) from e
    except ImportError as e:
        raise _unloadable(e) from e
    return ext


def _describe(version: object, abi: object, jaxlib_range: object) -> str:
    lo, below = jaxlib_range if isinstance(jaxlib_range, tuple) else ("?", "?")
    return f"jax_overlay {version} (native ABI {abi}, jaxlib >= {lo}, < {below})"


def check_build(ext: ModuleType) -> None:
    """ImportError when `ext` was built from other sources than this
    package: another version, native ABI or supported jaxlib range."""
    built = (getattr(ext, "VERSION", None), getattr(ext, "ABI", None),
             getattr(ext, "JAXLIB_RANGE", None))
    here = (_version.__version__, _version.ABI, (_version.JAXLIB_MIN, _version.JAXLIB_BELOW))
    if built == here:
        return
    what = ("records no version: it was built from jax_overlay sources older than "
            "its version check" if built[0] is None
            else f"was built from {_describe(*built)}")
    raise ImportError(
        f"jax_overlay's native module {getattr(ext, '__file__', MODULE)} is stale: it {what}, but the "
        f"Python package is {_describe(*here)}.  To fix it, {fix(force=True)}.",
        name=MODULE, path=getattr(ext, "__file__", None))


def release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: "0.12.0.1" ->
    (0, 12, 0, 1), "0.13.0.dev20260101" -> (0, 13, 0)."""
    nums = []
    for part in version.split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        nums.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(nums)


def running_jaxlib() -> str | None:
    """The version of the jaxlib this process imports, or None without one
    (jax then fails to import with its own message)."""
    try:
        from jaxlib.version import __version__ as version
    except ImportError:
        return None
    return str(version)


def check_jaxlib(ext: ModuleType, jaxlib: str | None) -> None:
    """ImportError (a warning with JAX_OVERLAY_ALLOW_ANY_JAXLIB=1) when
    `jaxlib` is outside the range the native module `ext` was built for."""
    if jaxlib is None:
        return
    lo, below = ext.JAXLIB_RANGE
    if release(lo) <= release(jaxlib) < release(below):
        return
    at_build = ext.JAXLIB_AT_BUILD or "none"
    newer = ("" if release(jaxlib) < release(lo)
             else f", or a jax_overlay that supports jaxlib {jaxlib}")
    message = (
        f"jax_overlay {ext.VERSION} supports jaxlib >= {lo}, < {below} (the range its "
        f"native module {ext.__file__} was built and validated for; jaxlib installed at "
        f"build time: {at_build}), but this process runs jaxlib {jaxlib}.  Install a "
        f"jax in that range: {shlex.quote(sys.executable)} -m pip install "
        f"'jax>={lo},<{below}' (jax brings its own jaxlib){newer}.")
    if os.environ.get(ALLOW_ANY_JAXLIB, "") not in ("", "0"):
        warnings.warn(f"{message}  Imported anyway: {ALLOW_ANY_JAXLIB} is set.",
                      RuntimeWarning, stacklevel=2)
        return
    raise ImportError(
        f"{message}  To import it anyway, untested, set {ALLOW_ANY_JAXLIB}=1.",
        name=MODULE)


ext = load()
check_build(ext)
check_jaxlib(ext, running_jaxlib())
