"""install() routes DLPack both ways and jax.device_put: JAX's signatures,
JAX's semantics, exact restore.  GPU producers are played by host memory
whose device lookups are pointed at the CPU device."""

import functools
import collections
import gc
import inspect
import weakref

import jax
import jax.dlpack
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _dlpack as E
from jax_overlay import _dlpack
from jax_overlay import _runtime as rt
import forge as T
from jax_overlay import _xla_ext as ext
from multidevice import host_import

CPU = jax.devices("cpu")[0]
KDLCPU, KDLCUDA, KDLCUDAHOST, KDLCUDAMANAGED = 1, 2, 3, 13

pytestmark = pytest.mark.usefixtures("balanced")


def _public():
    return {
        "jnp.asarray": jnp.asarray, "jnp.array": jnp.array,
        "jnp.from_dlpack": jnp.from_dlpack, "jax.dlpack.from_dlpack": jax.dlpack.from_dlpack,
        "jax.device_put": jax.device_put,
        "__dlpack__": rt.ArrayImpl.__dict__["__dlpack__"],
        "__dlpack_device__": rt.ArrayImpl.__dict__["__dlpack_device__"],
        "__cuda_array_interface__": rt.ArrayImpl.__dict__["__cuda_array_interface__"],
    }


@pytest.fixture
def gpu_on_host(monkeypatch):
    """Device lookups for CUDA ordinals answer the CPU device, so the routed
    GPU path runs on host memory; the consumer stream is recorded."""
    monkeypatch.setattr(rt, "gpu_device", lambda ordinal: CPU)
    monkeypatch.setattr(rt, "ready_stream", lambda device: 12345)
    monkeypatch.setattr(rt, "capsule_to_array", host_import(rt.capsule_to_array))
    monkeypatch.setattr(_dlpack, "_gpu_targets", {})  # no cached real devices either way


def data(shape=(3, 4), dtype=np.float32):
    a = T.aligned_empty(shape, dtype)
    a[...] = (np.arange(a.size) % 11).reshape(shape)
    return a


class Foreign:
    """A GPU-array stand-in: DLPack and (optionally) a CAI over host memory;
    records which protocol the consumer used."""

    def __init__(self, array, device=(KDLCUDA, 0), cai=True):
        self.array, self.device, self.used = array, device, []
        self._holder = T.HostCAI(array)
        self._cai = cai

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.used.append(("dlpack", stream, max_version))
        # copy=True is the producer's to honour, as the protocol says.
        holder = T.HostCAI(data(self.array.shape, self.array.dtype)) if copy else self._holder
        if copy:
            holder.array[...] = self.array
        return T.host_capsule(holder, versioned=max_version is not None)

    def __dlpack_device__(self):
        return self.device

    def __getattr__(self, name):
        if name == "__cuda_array_interface__" and self._cai:
            self.used.append(("cai",))
            return self._holder.__cuda_array_interface__
        raise AttributeError(name)


class CAIOnly:
    def __init__(self, array):
        self._holder = T.HostCAI(array)
        self.array = array

    @property
    def __cuda_array_interface__(self):
        return self._holder.__cuda_array_interface__


def test_install_replaces_every_entry_point_and_restores_them_exactly():
    before = _public()
    sigs = {k: inspect.signature(v) for k, v in before.items()
            if callable(v) and not isinstance(v, property)}
    jax_overlay.install()
    try:
        during = _public()
        for k in before:
            assert during[k] is not before[k], k
        for k, sig in sigs.items():
            assert inspect.signature(during[k]) == sig, k
            assert during[k].__doc__ == before[k].__doc__, k
    finally:
        jax_overlay.uninstall()
    assert _public() == before


def test_read_only_numpy_through_jax_dlpack(installed):
    a = data()
    a.flags.writeable = False
    for f in (jax.dlpack.from_dlpack, jnp.from_dlpack):
        x = f(a)
        assert x.unsafe_buffer_pointer() == a.ctypes.data
        np.testing.assert_array_equal(np.asarray(x), a)
    x = jax.dlpack.from_dlpack(a, CPU, True)  # JAX's positional device, copy
    assert x.unsafe_buffer_pointer() != a.ctypes.data
    np.testing.assert_array_equal(np.asarray(x), a)


def test_export_protocol_versions_and_read_only(installed):
    x = jax.device_put(jnp.arange(6.0).reshape(2, 3), CPU)
    assert x.__dlpack_device__() == (KDLCPU, 0)
    info = ext.capsule_info(x.__dlpack__(max_version=(1, 1)))
    assert info["versioned"] and info["flags"] & ext.FLAG_READ_ONLY
    assert not ext.capsule_info(x.__dlpack__())["versioned"]
    a = np.from_dlpack(x)  # NumPy 2 asks for (1, 0): a read-only view
    assert a.ctypes.data == x.unsafe_buffer_pointer() and not a.flags.writeable
    np.testing.assert_array_equal(a, np.asarray(x))
    b = np.from_dlpack(x, copy=True)
    assert b.ctypes.data != x.unsafe_buffer_pointer()


def test_gpu_dlpack_object_is_preferred_over_its_cai(installed, gpu_on_host):
    a = data()
    obj = Foreign(a)
    x = jnp.asarray(obj)
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    assert obj.used == [("dlpack", 12345, (1, 1))]
    np.testing.assert_array_equal(np.asarray(x), a)


def test_cai_is_used_when_there_is_no_dlpack(installed, monkeypatch):
    from jax_overlay import _cai
    monkeypatch.setattr(_cai, "import_cai", functools.partial(_cai.import_cai, host=True))
    a = data()
    x = jnp.asarray(CAIOnly(a))
    assert x.unsafe_buffer_pointer() == a.ctypes.data


def test_host_dlpack_objects_keep_jax_semantics(installed):
    a = data()
    obj = Foreign(a, device=(KDLCPU, 0), cai=False)
    jax_overlay.uninstall()
    want = jnp.asarray(np.asarray(a))
    jax_overlay.install()
    got = jnp.asarray(a)  # NumPy: JAX's own copy onto the default device
    assert got.sharding == want.sharding and got.committed == want.committed
    with pytest.raises(TypeError):
        jnp.asarray(obj)  # JAX itself does not read CPU DLPack in asarray
    assert obj.used == []


@pytest.mark.parametrize("dl_type", [KDLCUDA, KDLCUDAMANAGED])
def test_jnp_array_and_asarray_semantics_on_dlpack_objects(installed, gpu_on_host, dl_type):
    a = data()
    x = jnp.asarray(Foreign(a, (dl_type, 0)), dtype=jnp.int32)
    assert x.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(x), a.astype(np.int32))
    y = jnp.array(Foreign(a, (dl_type, 0)))
    assert y.unsafe_buffer_pointer() != a.ctypes.data  # jnp.array copies
    np.testing.assert_array_equal(np.asarray(y), a)
    z = jnp.asarray(Foreign(a, (dl_type, 0)), copy=False)
    assert z.unsafe_buffer_pointer() == a.ctypes.data


def test_device_put_of_foreign_arrays_is_zero_copy_then_jax_placement(installed, gpu_on_host):
    a, b = data(), data((5,), np.int32)
    x = jax.device_put(Foreign(a), CPU)
    assert x.unsafe_buffer_pointer() == a.ctypes.data and x.committed
    tree = jax.device_put({"a": Foreign(a), "b": [Foreign(b), np.ones(2)]}, CPU)
    assert tree["a"].unsafe_buffer_pointer() == a.ctypes.data
    assert tree["b"][0].unsafe_buffer_pointer() == b.ctypes.data
    np.testing.assert_array_equal(np.asarray(tree["b"][1]), np.ones(2))
    fresh = jax.device_put(Foreign(a), CPU, may_alias=False)
    assert fresh.unsafe_buffer_pointer() != a.ctypes.data
    np.testing.assert_array_equal(np.asarray(fresh), a)
    # A registered pytree node (not a list, tuple or dict) is walked too.
    pair = jax.device_put(collections.namedtuple("Pair", "u v")(Foreign(a), Foreign(b)), CPU)
    assert pair.u.unsafe_buffer_pointer() == a.ctypes.data
    assert pair.v.unsafe_buffer_pointer() == b.ctypes.data


def test_device_put_keeps_jax_semantics_for_its_own_inputs(installed):
    x = jnp.ones(3)
    assert jax.device_put(x) is x or jax.device_put(x).unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(jax.device_put([1, 2])), [1, 2])
    np.testing.assert_array_equal(np.asarray(jax.device_put(np.arange(3), CPU)), np.arange(3))
    with pytest.raises(TypeError):
        jax.device_put(object())


def test_device_put_narrows_64_bit_as_for_numpy(installed, gpu_on_host):
    if jax.config.jax_enable_x64:
        pytest.skip("x64 mode keeps 64-bit types")
    a = data((4,), np.float64)
    x = jax.device_put(Foreign(a), CPU)
    assert x.dtype == jax.device_put(a).dtype == np.float32


def test_foreign_producer_lives_until_jax_frees_the_view(installed, gpu_on_host):
    a = data()
    obj = Foreign(a)
    ref = weakref.ref(obj._holder)
    x = jnp.asarray(obj)
    del obj
    gc.collect()
    assert ref() is not None, "the view must keep its producer alive"
    del x
    gc.collect()
    assert ref() is None


def _expect_pinned_view():
    import jaxlib
    return tuple(int(p) for p in jaxlib.__version__.split(".")[:3]) >= (0, 10, 2)


def test_pinned_host_import_view_or_copy_by_jaxlib_version(gpu_on_host):
    """kDLCUDAHost: a pinned_host view from jaxlib 0.10.2 on; before, one
    copy into pinned_host memory (BufferError with copy=False).  Runs for
    real on whatever jax the suite runs under."""
    assert rt.PINNED_VIEW == _expect_pinned_view()
    a = data()
    x = jax_overlay.from_dlpack(Foreign(a, (KDLCUDAHOST, 0)))
    assert x.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(x), a)
    assert (x.unsafe_buffer_pointer() == a.ctypes.data) == rt.PINNED_VIEW
    if rt.PINNED_VIEW:
        jax_overlay.from_dlpack(Foreign(a, (KDLCUDAHOST, 0)), copy=False)
    else:
        with pytest.raises(BufferError, match="0.10.2"):
            jax_overlay.from_dlpack(Foreign(a, (KDLCUDAHOST, 0)), copy=False)


def test_pinned_host_copy_route_of_older_jaxlib(gpu_on_host, monkeypatch):
    """The jaxlib < 0.10.2 route, run on this jaxlib: copied, released."""
    monkeypatch.setattr(rt, "capsule_to_array", rt._capsule_to_array_before_0_10_2)
    monkeypatch.setattr(rt, "PINNED_VIEW", False)
    a = data()
    obj = Foreign(a, (KDLCUDAHOST, 0))
    ref = weakref.ref(obj._holder)
    x = jax_overlay.from_dlpack(obj)
    assert x.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(x), a)
    del obj
    x.block_until_ready()
    # XLA's thread drops the copy's source just after the copy is ready.
    T.settle(lambda: ref() is None, "the copy must not hold the producer")
    with pytest.raises(BufferError, match="cannot view pinned host memory"):
        jax_overlay.from_dlpack(Foreign(a, (KDLCUDAHOST, 0)), copy=False)


def test_pinned_array_device_and_cpu_view_export(monkeypatch):
    """__dlpack_device__ says kDLCUDAHost for pinned_host arrays, and
    dl_device=(kDLCPU, 0) serves the same memory to the host."""
    x = jax.device_put(jnp.arange(5.0), CPU)
    monkeypatch.setattr(E, "dlpack_device", lambda arr: (KDLCUDAHOST, 0))
    cap = E.to_dlpack(x, dl_device=(KDLCPU, 0), max_version=(1, 0), copy=False)
    info = ext.capsule_info(cap)
    assert info["device"] == (KDLCPU, 0) and info["data"] == x.unsafe_buffer_pointer()
    assert not info["flags"] & ext.FLAG_IS_COPIED
    a = np.from_dlpack(T.DLPackHolder(cap))
    np.testing.assert_array_equal(a, np.arange(5.0))
    # A host reader has no stream to be ordered on: any is served.
    assert ext.capsule_info(E.to_dlpack(x, dl_device=(KDLCPU, 0), stream=1))["device"] == (KDLCPU, 0)


def test_dlpack_device_of_a_pinned_host_array_on_cpu_is_cpu():
    pinned = jax.device_put(jnp.ones(2), jax.sharding.SingleDeviceSharding(CPU, memory_kind="pinned_host"))
    assert E.dlpack_device(pinned) == (KDLCPU, 0)
