"""_strided.graph_fence, the end of a replayed foreign call's CUDA graph
(its kernel call runs on a GPU only: tests/gpu/test_foreign_replay_gpu.py's
kept-results case).  Here: where there is no CUDA backend it is the input
itself, and its plumbing (custom_vmap, platform_dependent) keeps values
and shapes under jit and vmap when the CPU takes the default branch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_overlay import _runtime as rt
from jax_overlay import _strided


def test_no_cuda_backend_no_fence():
    x = jnp.arange(12.0).reshape(3, 4)
    assert _strided.graph_fence(x) is x


@pytest.fixture
def as_if_cuda(monkeypatch):
    """The fence built as on a CUDA machine; the CPU then runs its default
    branch."""
    cpu = jax.devices("cpu")[0]

    class Backend:
        def local_devices(self):
            return [cpu]
    monkeypatch.setattr(rt, "gpu_backend", lambda: Backend())
    monkeypatch.setattr(_strided, "kernel_status", lambda device: "")


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.bool_, np.complex64])
def test_fence_keeps_values_under_jit_and_vmap(as_if_cuda, dtype):
    x = jnp.asarray(np.arange(24).reshape(2, 3, 4) % 3, dtype)
    np.testing.assert_array_equal(jax.jit(_strided.graph_fence)(x), x)
    got = jax.jit(jax.vmap(jax.vmap(_strided.graph_fence)))(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    np.testing.assert_array_equal(got, x)


def test_empty_and_scalar(as_if_cuda):
    e = jnp.zeros((0, 3))
    assert _strided.graph_fence(e) is e
    s = jnp.float32(2.5)
    assert float(jax.jit(_strided.graph_fence)(s)) == 2.5
