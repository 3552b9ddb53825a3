import functools
import os
import pathlib

import pytest

GPU_DIR = pathlib.Path(__file__).parent / "gpu"

# JAX would otherwise take 75% of the GPU up front, starving the CuPy, PyTorch
# and Numba producers the GPU suite runs beside it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@functools.cache
def gpu_skip_reason():
    """None when a CUDA GPU is usable from JAX, else why not."""
    try:
        from jax_overlay import _xla_ext
        _xla_ext.load_driver()
    except BufferError as e:
        return f"no GPU: {e}"
    try:
        import jax
        jax.devices("cuda")
    except Exception as e:  # noqa: BLE001 - any failure means no GPU backend
        return f"no GPU: JAX has no CUDA backend ({e})"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if GPU_DIR in pathlib.Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
            reason = gpu_skip_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
