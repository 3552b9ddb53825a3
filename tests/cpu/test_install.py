"""install()/uninstall(): JAX's public API changes route only for CAI
objects, keeps JAX's signatures and semantics, and is restored exactly."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dropin as D
import jax_overlay
from jax_overlay import _cai
from jax_overlay.errors import JaxRuntimeError
from jax_overlay import _runtime as rt
import forge as T


@pytest.fixture
def routed(monkeypatch):
    """install(), with host memory located so the routed path runs on CPU."""
    monkeypatch.setattr(_cai, "import_cai", functools.partial(_cai.import_cai, host=True))
    jax_overlay.install()
    yield
    jax_overlay.uninstall()


def host(shape=(3, 4), dtype=np.float32):
    a = T.aligned_empty(shape, dtype)
    a[...] = np.arange(a.size).reshape(shape)
    return a


def test_install_is_idempotent_and_uninstall_exact():
    orig = (jnp.asarray, jnp.array)
    sigs = [inspect.signature(f) for f in orig]
    jax_overlay.install()
    jax_overlay.install()
    assert jax_overlay.installed()
    assert jnp.asarray is not orig[0] and jnp.array is not orig[1]
    assert [inspect.signature(f) for f in (jnp.asarray, jnp.array)] == sigs
    assert jnp.asarray.__doc__ == orig[0].__doc__
    jax_overlay.uninstall()
    jax_overlay.uninstall()
    assert (jnp.asarray, jnp.array) == orig
    assert not jax_overlay.installed()


@pytest.mark.parametrize("value", [
    np.arange(6.0).reshape(2, 3), [1, 2, 3], 3.5, 7, True, (1.0, 2.0),
    np.float32(2), [[1, 2], [3, 4]]])
def test_other_inputs_unchanged(routed, value):
    jax_overlay.uninstall()
    want = [jnp.asarray(value), jnp.array(value), jnp.asarray(value, dtype=jnp.int8)]
    jax_overlay.install()
    got = [jnp.asarray(value), jnp.array(value), jnp.asarray(value, dtype=jnp.int8)]
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        assert w.weak_type == g.weak_type
        np.testing.assert_array_equal(np.asarray(w), np.asarray(g))


def test_jax_array_passes_through(routed):
    x = jnp.arange(4)
    assert jnp.asarray(x) is x


def test_asarray_is_zero_copy(routed):
    a = host()
    x = jnp.asarray(T.HostCAI(a))
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    np.testing.assert_array_equal(np.asarray(x), a)


def test_jax_semantics_on_cai_objects(routed):
    a = host()
    p = T.HostCAI(a)
    y = jnp.array(p)  # numpy semantics: copy=True by default
    assert y.unsafe_buffer_pointer() != a.ctypes.data
    z = jnp.asarray(p, copy=True)
    assert z.unsafe_buffer_pointer() != a.ctypes.data
    h = jnp.asarray(p, dtype=jnp.float16)
    assert h.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(h), a.astype(np.float16))
    n = jnp.array(p, ndmin=4)
    assert n.shape == (1, 1, 3, 4)
    d = jnp.asarray(p, device=jax.devices("cpu")[0])
    np.testing.assert_array_equal(np.asarray(d), a)


def test_strided_objects_through_asarray(routed):
    a = host((6, 8))
    v = a[::2, ::-3]
    x = jnp.asarray(T.HostCAI(v, strides=tuple(v.strides)))
    np.testing.assert_array_equal(np.asarray(x), v)
    with pytest.raises(BufferError, match="without a copy"):
        jnp.asarray(T.HostCAI(v, strides=tuple(v.strides)), copy=False)
    y = jnp.array(T.HostCAI(v, strides=tuple(v.strides)))
    np.testing.assert_array_equal(np.asarray(y), v)


def test_int64_in_32_bit_mode_follows_jax(routed):
    """Stock JAX's CAI import makes an int64 JAX array, and jnp.asarray and
    jnp.array keep a JAX array's dtype even in 32-bit mode: so do ours.
    jax.device_put narrows, as it does for NumPy."""
    a = host((4,), np.int64)
    with rt.x64(True):
        reference = jnp.arange(4, dtype=jnp.int64)
    assert jnp.asarray(reference).dtype == jnp.array(reference).dtype == jnp.int64
    for f in (jnp.asarray, jnp.array):
        x = f(T.HostCAI(a))
        assert x.dtype == jnp.int64
        np.testing.assert_array_equal(np.asarray(x), a)
        y = f(T.HostCAI(a), dtype=jnp.int32)
        assert y.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(y), a)
    assert jax.device_put(T.HostCAI(a)).dtype == jnp.int32
    # A zero-size import keeps its dtype too (it is made, not viewed).
    empty = host((0, 3), np.int64)
    assert jnp.asarray(T.HostCAI(empty)).dtype == jnp.int64


def test_64_bit_moved_to_another_platform_keeps_its_values(routed, monkeypatch):
    """jnp.asarray(x, device=) of 64-bit data in 32-bit mode to another
    platform goes through the host with its 64 bits (jax.device_put of such
    an array from the GPU gave wrong values on the H200); the target here
    stands in for another platform."""
    from jax_overlay import _install
    monkeypatch.setattr(_install, "_platform", lambda device: "elsewhere")
    cpu = jax.devices("cpu")[0]
    for dtype in (np.int64, np.float64, np.complex128, np.uint64):
        a = host((3, 5), dtype) * 3 + 1
        x = jnp.asarray(T.HostCAI(a), device=cpu)
        assert x.dtype == dtype and x.devices() == {cpu}
        np.testing.assert_array_equal(np.asarray(x), a)
        y = jnp.array(T.HostCAI(a), device=cpu)
        assert y.dtype == dtype
        np.testing.assert_array_equal(np.asarray(y), a)


def test_uninstall_restores_stock_route(routed):
    """After uninstall() every entry point is JAX's own object again
    (tests/dropin.py's STOCK, saved before any install()), and a call gets
    stock's outcome: a CAI over host memory, which the installed route reads
    (zero-copy in jnp.asarray), is refused by stock's jax.device_put, which
    reads no CAI (TypeError), and without a GPU by stock's jnp.asarray, which
    reads a CAI as CUDA memory (JaxRuntimeError)."""
    a = host()
    # The installed route first: the stock outcomes below must be a change.
    x = jnp.asarray(T.HostCAI(a))
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    np.testing.assert_array_equal(np.asarray(jax.device_put(T.HostCAI(a))), a)
    jax_overlay.uninstall()
    D.check_stock()
    with pytest.raises(TypeError, match="HostCAI"):
        jax.device_put(T.HostCAI(a))
    if jax.default_backend() == "cpu":  # with a GPU, stock reads it as a device pointer
        with pytest.raises(JaxRuntimeError, match="CUDA"):
            jnp.asarray(T.HostCAI(a))


def test_errors_reach_the_caller(routed):
    # Stock's class (its CAI import raises jaxlib's runtime error: here for
    # want of CUDA, on a GPU none, where the overlay's refusal takes it),
    # with the overlay's reason in the message or a note.
    with pytest.raises(JaxRuntimeError, match="mask"):
        jnp.asarray(T.HostCAI(host(), mask=T.HostCAI(np.ones(3, bool))))


CPU0 = jax.devices("cpu")[0]


@pytest.mark.usefixtures("routed")
@pytest.mark.parametrize("name", ["asarray", "array"])
def test_device_sharding_is_the_one_asked_for(name):
    """A peer array placed by device=<a sharding>: the result carries that
    very sharding, as stock's does (the H100 fuzz: a NamedSharding asked
    for came back as a SingleDeviceSharding over the same device)."""
    entry = getattr(jnp, name)  # installed: read at call time
    a = host()
    named = jax.sharding.NamedSharding(jax.make_mesh((1,), ("x",), devices=[CPU0]),
                                       jax.sharding.PartitionSpec())
    out = entry(T.HostCAI(a), device=named)
    assert out.sharding == named and type(out.sharding) is jax.sharding.NamedSharding
    np.testing.assert_array_equal(np.asarray(out), a)


@pytest.mark.usefixtures("routed")
@pytest.mark.parametrize("name", ["asarray", "array"])
def test_a_conversion_onto_pinned_host_memory(name):
    """dtype= with device= a pinned_host sharding: converted in device
    memory, then placed in pinned_host memory, as stock places it (the
    H100 fuzz: the overlay converted in pinned_host memory, which XLA failed
    to compile, or left the result in device memory)."""
    entry = getattr(jnp, name)  # installed: read at call time
    a = host(dtype=np.int16)
    pinned = jax.sharding.SingleDeviceSharding(CPU0, memory_kind="pinned_host")
    out = entry(T.HostCAI(a), dtype=jnp.int32, device=pinned)
    assert out.dtype == jnp.int32 and out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out), a.astype(np.int32))
    empty = entry(T.HostCAI(host((0, 3), np.int16)), dtype=jnp.bool_, device=pinned)
    assert empty.shape == (0, 3) and empty.sharding.memory_kind == "pinned_host"


@pytest.mark.usefixtures("routed")
def test_device_put_of_a_peer_array_with_a_bad_device_fails_as_stock():
    """jax.device_put refuses every peer array (TypeError); with a device=
    it cannot read either, the overlay's error is an instance of stock's
    class too (the H100 fuzz: ValueError where stock raised TypeError)."""
    p = T.HostCAI(host())
    jax_overlay.uninstall()
    with pytest.raises(Exception) as stock:
        jax.device_put(p, object())
    jax_overlay.install()
    with pytest.raises(type(stock.value)):
        jax.device_put(p, object())
