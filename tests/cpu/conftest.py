import gc

import pytest

from jax_overlay import _xla_ext as ext


@pytest.fixture
def balanced():
    """Every tensor the test creates is released exactly once by its end."""
    gc.collect()
    live = ext.live_tensors()
    yield
    gc.collect()
    assert ext.live_tensors() == live, "a tensor was leaked or freed twice"
