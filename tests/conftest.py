import os
import pathlib
import sys

import pytest

GPU_DIR = pathlib.Path(__file__).parent / "gpu"

# JAX would otherwise take 75% of the GPU up front, starving the CuPy, PyTorch
# and Numba producers the GPU suite runs beside it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def gpu_skip_reason():
    """None when a CUDA GPU is usable from JAX, else why not (the doctor's
    own test, which also decides whether its GPU rows run)."""
    from jax_overlay.doctor import gpu_skip_reason as reason
    return reason()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if GPU_DIR in pathlib.Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
            reason = gpu_skip_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def installed():
    """jax_overlay.install() for the test, uninstall() after."""
    import jax_overlay
    jax_overlay.install()
    yield
    jax_overlay.uninstall()


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
            f"installed right {t['stock unsafe, installed right']}; differences "
            f"{t['differences']}")
