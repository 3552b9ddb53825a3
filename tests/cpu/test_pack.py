"""share(tree, pack=True)'s packing (jax_overlay/_pack.py), on the CPU: every
dtype's bytes land at an aligned offset of the one buffer, and unpack
gives the tree back exactly; refusals name the leaf.  The share itself
needs a GPU (tests/gpu/test_ipc_gpu.py)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_overlay
from jax_overlay import _pack

RNG = np.random.default_rng(40)


def _bytes(a):
    return np.asarray(a).reshape(-1).view(np.uint8)


def leaves():
    r = RNG
    out = [jnp.asarray(r.normal(size=(3, 5)).astype(np.float32)),
           jnp.asarray(r.integers(0, 2, 7).astype(bool)),
           jnp.asarray((r.normal(size=4) + 1j * r.normal(size=4)).astype(np.complex64)),
           jnp.zeros((0, 3), jnp.float32),
           jnp.asarray(r.normal(size=5)).astype(jnp.bfloat16),
           jnp.asarray(np.float32(3.5)),
           jnp.asarray(r.normal(size=3)).astype(jnp.float8_e4m3fn),
           jnp.arange(3, dtype=jnp.uint8),
           jnp.arange(12, dtype=jnp.int16).reshape(3, 4).T]  # a transposed (computed) leaf
    if jax.config.x64_enabled:
        out += [jnp.asarray((r.normal(size=(2, 2)) + 1j).astype(np.complex128)),
                jnp.arange(5, dtype=jnp.int64)]
    return out


def test_pack_and_unpack_are_exact():
    xs = leaves()
    spec, total = _pack.layout(xs)
    buf = _pack.packer(spec, total)(xs)
    assert buf.dtype == jnp.uint8 and buf.shape == (total,)
    host = np.asarray(buf)
    for (off, shape, name), x in zip(spec, xs):
        # In place, with its own dtype: what another framework's receiver views.
        assert off % _pack.ALIGN == 0 and shape == x.shape and name == x.dtype.name
        assert np.array_equal(host[off:off + x.nbytes], _bytes(x))
    for x, y in zip(xs, _pack.unpacker(spec)(buf)):
        assert (y.dtype, y.shape) == (x.dtype, x.shape)
        assert np.array_equal(_bytes(y), _bytes(x))


def test_empty_tree_packs_to_nothing():
    spec, total = _pack.layout([])
    assert (spec, total) == ((), 0)
    assert _pack.packer(spec, total)([]).shape == (0,)
    assert _pack.unpacker(spec)(jnp.zeros((0,), jnp.uint8)) == []


def test_sub_byte_types_are_refused_by_name():
    with pytest.raises(BufferError, match="leaf 1 is int4.*without pack=True"):
        _pack.layout([jnp.ones(2), jnp.zeros(4, jnp.int4)])


def test_share_pack_refusals_name_the_leaf():
    with pytest.raises(TypeError, match=r"\['b'\] is a numpy.ndarray"):
        jax_overlay.share({"a": jnp.ones(3), "b": np.ones(3)}, pack=True)
    with pytest.raises(BufferError, match=r"\['a'\] is on .*host memory"):
        jax_overlay.share({"a": jnp.ones(3)}, pack=True)
    y = jnp.ones(4)
    y.delete()
    with pytest.raises(BufferError, match="deleted"):
        jax_overlay.share([y], pack=True)
