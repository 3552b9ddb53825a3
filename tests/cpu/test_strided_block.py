"""The strided copy's block route (jax_overlay/_strided.py): a sliced view
of a row-major parent is copied with a slice and reshapes instead of a
gather when the envelope reaches the parent's last row.  On the GPU the
driver tells how far the allocation goes (tests/gpu checks that route end to
end); here the envelope is the whole parent, read from host memory."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fuzzing as F  # noqa: E402
from fuzzing import fuzz_report, x64  # noqa: E402,F401  (module fixtures)
from jax_overlay import _strided  # noqa: E402


def test_block_plan_of_common_slices():
    # a[:, ::2] of a (4, 6) array: parent (4, 3, 2), keep (4, 3, 1).
    assert _strided.block_plan((4, 3), (6, 2), 0, 24) == (24, (4, 3, 2), (4, 3, 1))
    # a[::3] of 10 elements (4 of them), and a[1:3, 2:5] of a (4, 6) array.
    assert _strided.block_plan((4,), (3,), 0, 12) == (12, (4, 3), (4, 1))
    assert _strided.block_plan((2, 3), (6, 1), 8, 24) == (12, (2, 6, 1), (2, 3, 1))
    # Axes of extent 1 have no stride that matters.
    assert _strided.block_plan((1, 4, 1), (999, 2, -5), 0, 8) == (8, (4, 2), (4, 1))


@pytest.mark.parametrize("shape, strides, offset, available", [
    ((4,), (3,), 0, 11),        # the parent's last row reaches past the envelope
    ((4,), (-3,), 9, 12),       # negative
    ((4, 3), (0, 1), 0, 12),    # broadcast
    ((3, 4), (1, 3), 0, 12),    # transposed: strides increase
    ((4, 3), (5, 2), 0, 20),    # 5 is not a multiple of 2
    ((4, 3), (4, 2), 0, 16),    # rows overlap: 3 * 2 > 4
    ((1,), (7,), 0, 1),         # one element: nothing to slice
])
def test_block_plan_refuses(shape, strides, offset, available):
    assert _strided.block_plan(shape, strides, offset, available) is None


DTYPES = [np.dtype(t) for t in ("i1", "u2", "i4", "f2", "f4", "f8", "c8", "?")]


@st.composite
def sliced_views(draw):
    """A row-major parent of 1-3 dims and a view of it with positive steps."""
    dims = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(dims))
    index = []
    for n in shape:
        start = draw(st.integers(0, n - 1))
        stop = draw(st.integers(start + 1, n))
        index.append(slice(start, stop, draw(st.integers(1, 4))))
    return shape, tuple(index), draw(st.sampled_from(DTYPES))


@given(sliced_views())
@F.fuzz_settings(ci=300)
def test_copy_of_a_sliced_view_equals_numpy(x64, case):
    """Whichever route the copy takes, every element and every bit (NaN
    payloads of floats included) is the view's."""
    shape, index, dtype = case
    parent = np.frombuffer(np.random.default_rng(7).bytes(int(np.prod(shape)) * dtype.itemsize),
                           dtype).reshape(shape)
    if dtype.kind == "b":
        parent = parent.view(np.uint8).astype(bool)
    view = parent[index]
    offset = (view.__array_interface__["data"][0] - parent.__array_interface__["data"][0]) // dtype.itemsize
    strides = tuple(s // dtype.itemsize for s in view.strides)
    envelope = jnp.asarray(parent.reshape(-1))
    out = _strided.gather(envelope, view.shape, strides, offset, dtype, dtype.itemsize)
    assert out.shape == view.shape and out.dtype == dtype
    assert np.asarray(out).tobytes() == np.ascontiguousarray(view).tobytes()


def test_envelope_items_reach_the_parents_last_row_only_for_a_block():
    # a[:, ::2] of a (4, 6) float32 array: the span ends one element short.
    assert _strided.envelope_items((4, 3), (6, 2), 0, 4, 4, 23, 100) == 24
    # Not a block (strides 5, 2): the span is enough.
    assert _strided.envelope_items((4, 3), (5, 2), 0, 4, 4, 20, 100) == 20
    # The allocation ends first: no reach.
    assert _strided.envelope_items((4, 3), (6, 2), 0, 4, 4, 23, 23) == 23
    # Bytes (a pointer that is not element-aligned): the gather's business.
    assert _strided.envelope_items((4, 3), (24, 8), 0, 4, 1, 89, 400) == 89


def test_block_route_is_taken_and_keeps_float_bits():
    parent = np.arange(24, dtype=np.uint32).reshape(4, 6)
    parent[0, 0] = 0x7FC00001  # a NaN payload as float32
    envelope = jnp.asarray(parent.reshape(-1).view(np.float32))
    _strided._block_fn.cache_clear()
    out = _strided.gather(envelope, (4, 3), (6, 2), 0, np.float32, 4)
    assert _strided._block_fn.cache_info().currsize == 1
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), parent[:, ::2])
    # One element short of the parent's last row: a gather, same bits.
    out = _strided.gather(envelope[:23], (4, 3), (6, 2), 0, np.float32, 4)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), parent[:, ::2])
