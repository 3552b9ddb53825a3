import gc

import pytest

import forge as T
from jax_overlay import _xla_ext as ext


@pytest.fixture
def balanced():
    """Every tensor the test creates is released exactly once by its end."""
    gc.collect()
    live = ext.live_tensors()
    yield
    # A buffer that a JAX computation still reads (the source of copy=True)
    # is released by XLA's worker thread once that computation is done,
    # which may be after the test returns: wait for it, bounded.
    T.settle(lambda: ext.live_tensors() <= live, "a tensor was leaked")
    assert ext.live_tensors() == live, "a tensor was freed twice"
