import inspect
import os
import pathlib
import re
import sys
import sysconfig

import pytest

GPU_DIR = pathlib.Path(__file__).parent / "gpu"

# JAX would otherwise take 75% of the GPU up front, starving the CuPy, PyTorch
# and Numba producers the GPU suite runs beside it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# The tests' own helpers (forge.py, dropin.py) live here, outside the wheel:
# subprocesses the tests start import them too.
_HERE = str(pathlib.Path(__file__).parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _HERE])


# .ci/run sets it where the suites run against the installed wheel: the run
# stops at once unless `import jax_overlay` finds it in site-packages.
INSTALLED = "JAX_OVERLAY_TEST_INSTALLED"


def _jax_overlay_location():
    """(package directory, native module) of the jax_overlay this run
    imports; its ImportError says how to build it."""
    import jax_overlay
    from jax_overlay import _xla_ext
    return pathlib.Path(jax_overlay.__file__).resolve().parent, _xla_ext.__file__


def pytest_report_header(config):
    try:
        where, native = _jax_overlay_location()
    except Exception as e:  # the tests that need it report it themselves
        return f"jax_overlay: not importable: {type(e).__name__}: {e}"
    return f"jax_overlay: {where} (native module {native})"


def pytest_configure(config):
    if os.environ.get(INSTALLED, "") in ("", "0"):
        return
    where, _ = _jax_overlay_location()
    site = {pathlib.Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    if where.parent not in site:
        raise pytest.UsageError(
            f"{INSTALLED} is set, but jax_overlay is imported from {where}, not from "
            f"this Python's site-packages ({', '.join(map(str, sorted(site)))})")


def gpu_skip_reason():
    """None when a CUDA GPU is usable from JAX, else why not (the doctor's
    own test, which also decides whether its GPU rows run)."""
    from jax_overlay.doctor import gpu_skip_reason as reason
    return reason()


def _calls_hooks(item):
    """Whether the test, a function of its module that it calls, or a script
    of its module that it runs, calls a hook (or whether it asks for the
    `balanced` fixture, which counts live tensors)."""
    if "balanced" in getattr(item, "fixturenames", ()):
        return True
    fn = getattr(item, "function", None)
    try:
        source = inspect.getsource(fn)
    except (TypeError, OSError):
        return False
    from forge import HOOK_CALL
    if HOOK_CALL.search(source):
        return True
    # The module's own functions it calls, and its scripts (strings) it runs.
    module = inspect.getmodule(fn)
    for name in set(re.findall(r"\b(\w+)\b", source)):
        helper = getattr(module, name, None)
        if isinstance(helper, str):
            text = helper
        elif inspect.isfunction(helper) and helper.__module__ == module.__name__:
            try:
                text = inspect.getsource(helper)
            except OSError:
                continue
        else:
            continue
        if HOOK_CALL.search(text):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    hooks = None
    for item in items:
        if GPU_DIR in pathlib.Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
            reason = gpu_skip_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
        if hooks is None:
            import forge
            hooks = forge.has_hooks()
        if not hooks and _calls_hooks(item):
            import forge
            item.add_marker(pytest.mark.skip(reason=forge.NO_HOOKS))


@pytest.fixture
def installed():
    """jax_overlay.install() for the test, uninstall() after."""
    import jax_overlay
    jax_overlay.install()
    yield
    jax_overlay.uninstall()


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its differential totals to the controller."""
    dropin = sys.modules.get("dropin")
    out = getattr(session.config, "workeroutput", None)
    if out is not None and dropin is not None:
        out["dropin_totals"] = dict(dropin.TOTALS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller adds up its workers' differential totals."""
    totals = getattr(node, "workeroutput", {}).get("dropin_totals")
    if totals:
        import dropin
        dropin.TOTALS.update(totals)


def pytest_terminal_summary(terminalreporter):
    """The drop-in differential's totals (tests/dropin.py), when it ran."""
    dropin = sys.modules.get("dropin")
    if dropin is not None and dropin.TOTALS:
        t = dropin.TOTALS
        cases = t["stock ok"] + t["stock raised"]
        terminalreporter.write_line(
            f"drop-in differential: {cases} cases run stock and installed; stock ok "
            f"{t['stock ok']}, stock raised {t['stock raised']}, installed works where "
            f"stock raised {t['installed works where stock raised']}, stock unsafe and "
            f"installed right {t['stock unsafe, installed right']}, stock unsafe and "
            f"installed refused {t['stock unsafe, installed refused']}; differences "
            f"{t['differences']}")
