"""Imports land on the device that owns the memory, whatever device is the
default (JAX's "current" one): CPU device k plays CUDA device k
(multidevice.cpus_as_gpus), in a 2-device subprocess.  ``device=`` elsewhere
copies there, or raises BufferError with copy=False.  Host memory belongs to
every CPU device: ``device=`` a CPU device views it there."""

import jax
import jax.dlpack
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlay
from multidevice import (KDLCUDA, HostCAIOn, HostDLPack, aligned, check, cpus_as_gpus,
                         installed, on, params)


def ptr(x):
    return x.unsafe_buffer_pointer()


def cpus():
    return jax.devices("cpu")


@on(2)
def case_dlpack_lands_on_the_producers_gpu_not_the_default_device(n):
    cpu0, cpu1 = cpus()
    a = aligned((3, 4))
    with cpus_as_gpus() as gpus, jax.default_device(cpu0):
        p = HostDLPack(a, (KDLCUDA, 1))
        x = jax_overlay.from_dlpack(p)
        assert x.devices() == {cpu1} and ptr(x) == a.ctypes.data
        np.testing.assert_array_equal(np.asarray(x), a)
        # The producer ordered device 1's compute stream, with device 1 current.
        assert p.streams == [1001] and gpus.switches == [1]
        with installed():
            for f in (jnp.asarray, jax.device_put, jax.dlpack.from_dlpack, jnp.from_dlpack):
                y = f(p)
                assert y.devices() == {cpu1} and ptr(y) == a.ctypes.data, f
        assert gpus.switches == [1] * 5 and p.streams == [1001] * 5


@on(2)
def case_dlpack_device_elsewhere_copies_or_refuses(n):
    cpu0, cpu1 = cpus()
    a = aligned((3, 4))
    with cpus_as_gpus():
        p = HostDLPack(a, (KDLCUDA, 1))
        assert ptr(jax_overlay.from_dlpack(p, device=cpu1, copy=False)) == a.ctypes.data
        y = jax_overlay.from_dlpack(p, device=cpu0)
        assert y.devices() == {cpu0} and ptr(y) != a.ctypes.data
        np.testing.assert_array_equal(np.asarray(y), a)
        with pytest.raises(BufferError, match="device=.*needs a copy"):
            jax_overlay.from_dlpack(p, device=cpu0, copy=False)
        with installed():
            # Stock JAX cannot move a committed array with asarray/array.
            for f in (jnp.asarray, jnp.array):
                z = f(p, device=cpu0)
                assert z.devices() == {cpu0} and ptr(z) != a.ctypes.data, f
                np.testing.assert_array_equal(np.asarray(z), a)
                # Stock JAX's asarray/array move whatever copy= says ...
                z = f(p, device=cpu0, copy=False)
                assert z.devices() == {cpu0} and ptr(z) != a.ctypes.data, f
                # ... unless the Array API's reading is asked for.
                jax_overlay.config.strict_copy = True
                try:
                    with pytest.raises(BufferError, match="device=.*needs a copy"):
                        f(p, device=cpu0, copy=False)
                finally:
                    jax_overlay.config.strict_copy = False
            assert ptr(jnp.asarray(p, device=cpu1, copy=False)) == a.ctypes.data
            assert jax.device_put(p, cpu0).devices() == {cpu0}


@on(2)
def case_cai_lands_on_the_gpu_that_owns_the_pointer(n):
    cpu0, cpu1 = cpus()
    a = aligned((4, 6))
    with cpus_as_gpus(), jax.default_device(cpu0):
        x = jax_overlay.from_cuda_array_interface(HostCAIOn(a, 1))
        assert x.devices() == {cpu1} and ptr(x) == a.ctypes.data
        # A strided view: the one copy is made on the owner's device too.
        s = a[:, ::2]
        y = jax_overlay.from_cuda_array_interface(HostCAIOn(s, 1))
        assert y.devices() == {cpu1} and ptr(y) != a.ctypes.data
        np.testing.assert_array_equal(np.asarray(y), s)
        z = jax_overlay.from_cuda_array_interface(HostCAIOn(a, 1), device=cpu0)
        assert z.devices() == {cpu0} and ptr(z) != a.ctypes.data
        np.testing.assert_array_equal(np.asarray(z), a)
        with pytest.raises(BufferError, match="device=.*needs a copy"):
            jax_overlay.from_cuda_array_interface(HostCAIOn(a, 1), device=cpu0, copy=False)
        with installed():
            w = jnp.asarray(HostCAIOn(a, 1))
            assert w.devices() == {cpu1} and ptr(w) == a.ctypes.data


@on(2)
def case_zero_size_cai_lands_on_the_gpu_that_owns_the_pointer(n):
    cpu0, cpu1 = cpus()
    a = aligned((4, 3))
    empty = a[2:2]  # no elements, but a pointer into a's allocation
    with cpus_as_gpus() as gpus, jax.default_device(cpu0):
        gpus.owners[empty.ctypes.data] = 1
        x = jax_overlay.from_cuda_array_interface(HostCAIOn(empty, 1))
        assert x.shape == (0, 3) and x.devices() == {cpu1}


@on(2)
def case_host_memory_views_land_on_the_cpu_device_asked_for(n):
    cpu0, cpu1 = cpus()
    a = aligned((5,))
    x = jax_overlay.from_dlpack(a, device=cpu1, copy=False)
    assert x.devices() == {cpu1} and ptr(x) == a.ctypes.data
    y = jax_overlay.from_dlpack(HostDLPack(a), device=jax.sharding.SingleDeviceSharding(cpu1))
    assert y.devices() == {cpu1} and ptr(y) == a.ctypes.data
    assert jax_overlay.from_dlpack(a).devices() == {cpu0}
    assert jax_overlay.from_dlpack(a[:0], device=cpu1).devices() == {cpu1}


@pytest.mark.parametrize("n,case", params(globals()))
def test_multidevice(n, case):
    check(__file__, n, case)
