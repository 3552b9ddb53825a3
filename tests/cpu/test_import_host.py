"""The import path end to end on host memory: the same code that serves GPU
pointers, with a host locator (views, copies, dtypes, copy/device rules)."""

import gc
import weakref

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (jax needs it; keeps the import explicit)
import numpy as np
import pytest

import jax_overlay
import forge as T
from jax_overlay import _xla_ext as ext

DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
          np.uint32, np.uint64, np.float16, np.float32, np.float64,
          np.complex64, np.complex128]


def filled(shape, dtype):
    a = T.aligned_empty(shape, dtype)
    rng = np.random.default_rng(0)
    vals = rng.integers(0, 100, a.shape)
    if np.dtype(dtype).kind == "c":
        a[...] = vals + 1j * rng.integers(0, 100, a.shape)
    else:
        a[...] = (vals % 2 if dtype == np.bool_ else vals).astype(dtype)
    return a


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_copy_every_dtype(dtype):
    jax.config.update("jax_enable_x64", True)
    try:
        a = filled((3, 4), dtype)
        x = T.import_host(T.HostCAI(a))
        assert x.dtype == a.dtype
        assert x.unsafe_buffer_pointer() == a.ctypes.data
        np.testing.assert_array_equal(np.asarray(x), a)
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.float64, np.complex128])
def test_x64_off_converts_like_jax(dtype, monkeypatch):
    a = filled((5,), dtype)
    x = T.import_host(T.HostCAI(a))
    assert x.dtype == jax.dtypes.canonicalize_dtype(dtype)
    np.testing.assert_array_equal(np.asarray(x), a.astype(x.dtype))
    # copy=False converts too, as stock JAX's from_dlpack does ...
    y = T.import_host(T.HostCAI(a), copy=False)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    # ... unless the strict reading of copy=False is asked for.
    monkeypatch.setattr(jax_overlay.config, "strict_copy", True)
    with pytest.raises(BufferError, match="jax_enable_x64") as e:
        T.import_host(T.HostCAI(a), copy=False)
    assert isinstance(e.value, ValueError)  # stock JAX's class for copy=False


def test_fortran_and_transposed_are_views():
    base = filled((4, 6), np.float32)
    fortran = T.aligned_empty((6, 4), np.float32).T  # XLA's CPU views need alignment
    fortran[...] = base
    for v in (base.T, fortran, base.reshape(2, 2, 6).transpose(2, 0, 1)):
        x = T.import_host(T.HostCAI(v))
        assert x.unsafe_buffer_pointer() == v.ctypes.data
        np.testing.assert_array_equal(np.asarray(x), v)
        np.testing.assert_array_equal(np.asarray(x * 2), v * 2)


STRIDED = {
    "sliced": lambda a: a[:, ::2],
    "negative": lambda a: a[::-1],
    "both_negative": lambda a: a[::-2, ::-3],
    "broadcast": lambda a: np.broadcast_to(a[0], (5, 6)),
    "column": lambda a: a[:, 2],
    "inner_window": lambda a: a[1:3, 1:5],
    "scalar_broadcast": lambda a: np.broadcast_to(a[1, 1], (2, 3)),
    "offset_misaligned": lambda a: a.reshape(-1)[1:],
}


@pytest.mark.parametrize("name", STRIDED)
@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.float16, np.float32,
                                   np.int64, np.complex64, np.complex128])
def test_non_compact_is_one_copy(name, dtype):
    jax.config.update("jax_enable_x64", True)
    try:
        base = filled((4, 6), dtype)
        v = STRIDED[name](base)
        x = T.import_host(T.HostCAI(v, strides=tuple(v.strides)))
        np.testing.assert_array_equal(np.asarray(x), v)
        assert x.shape == v.shape and x.dtype == v.dtype
        if v.flags.c_contiguous and v.ctypes.data % 16 == 0:
            return  # an element offset that is still aligned: a real view
        with pytest.raises(BufferError, match="without a copy"):
            T.import_host(T.HostCAI(v, strides=tuple(v.strides)), copy=False)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_misaligned_element_pointer_uses_bytes():
    raw = T.aligned_empty((64,), np.uint8)
    v = raw[1:33].view(np.float32)  # pointer not a multiple of 4
    v[...] = np.arange(8, dtype=np.float32)
    x = T.import_host(T.HostCAI(v))
    np.testing.assert_array_equal(np.asarray(x), np.arange(8, dtype=np.float32))
    raw2 = T.aligned_empty((128,), np.uint8)
    c = raw2[3:67].view(np.complex64)
    c[...] = np.arange(8) + 2j
    np.testing.assert_array_equal(np.asarray(T.import_host(T.HostCAI(c))), c)


@pytest.mark.parametrize("seed", range(40))
def test_random_strided_views(seed):
    rng = np.random.default_rng(seed)
    base = filled((6, 7, 5), np.float32)
    sl = tuple(slice(int(rng.integers(0, 2)), None, int(rng.choice([-2, -1, 1, 2, 3])))
               for _ in range(3))
    v = base[sl].transpose(rng.permutation(3))
    x = T.import_host(T.HostCAI(v, strides=tuple(v.strides)))
    np.testing.assert_array_equal(np.asarray(x), v)


def test_strided_copy_keeps_producer_until_done_then_releases():
    base = filled((64, 64), np.float32)
    p = T.HostCAI(base[::2, ::3], strides=tuple(base[::2, ::3].strides))
    ref = weakref.ref(p)
    x = T.import_host(p)
    del p
    x.block_until_ready()
    # XLA's thread drops the copy's source just after the copy is ready.
    T.settle(lambda: ref() is None, "the envelope must not outlive the copy")
    np.testing.assert_array_equal(np.asarray(x), base[::2, ::3])


def test_0d_and_zero_size():
    a = T.aligned_empty((), np.float32)
    a[...] = 7
    x = T.import_host(T.HostCAI(a, strides=()))
    assert x.shape == () and float(x) == 7


def test_copy_true_gives_fresh_buffer():
    a = filled((8,), np.float32)
    x = T.import_host(T.HostCAI(a), copy=True)
    assert x.unsafe_buffer_pointer() != a.ctypes.data
    x.block_until_ready()  # host memory has no stream: the copy may be pending
    a[0] = -1
    assert float(x[0]) != -1


def test_device_argument():
    a = filled((8,), np.float32)
    cpu = jax.devices("cpu")[0]
    x = T.import_host(T.HostCAI(a), device=cpu, copy=False)
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    x = T.import_host(T.HostCAI(a), device=jax.sharding.SingleDeviceSharding(cpu))
    assert x.unsafe_buffer_pointer() == a.ctypes.data


def test_versions_without_stream():
    a = filled((3,), np.int32)
    for version in (0, 1, 2):
        x = T.import_host(T.HostCAI(a, version=version))
        np.testing.assert_array_equal(np.asarray(x), a)


def test_mask_rejected_before_anything_else():
    a = filled((3,), np.int32)
    with pytest.raises(BufferError, match="mask"):
        T.import_host(T.HostCAI(a, mask=T.HostCAI(np.ones(3, bool))))


def test_no_cai_is_type_error():
    import jax_overlay
    with pytest.raises(TypeError, match="has no __cuda_array_interface__.*host arrays: "
                                        "jax_overlay.from_dlpack"):
        jax_overlay.from_cuda_array_interface(np.zeros(3))
    with pytest.raises(AttributeError, match="host memory has no CUDA Array Interface; hand it "
                                             "over by DLPack"):
        jax_overlay.cuda_array_interface(jnp.zeros(3))


def test_gpu_path_without_driver_is_clear():
    import jax_overlay
    try:
        ext.load_driver()
        pytest.skip("a CUDA driver is present: this checks the driverless path")
    except BufferError:
        pass
    a = filled((3,), np.float32)
    with pytest.raises(BufferError, match="libcuda.so.1"):
        jax_overlay.from_cuda_array_interface(T.HostCAI(a))
    # A malformed dict gets its real error, not a driver error.
    with pytest.raises(TypeError, match="typestr"):
        jax_overlay.from_cuda_array_interface(T.HostCAI(a, typestr="<M8"))


def test_envelope_plan():
    from jax_overlay import _strided
    # Aligned down to 16, in whole elements.
    assert _strided.plan(0x1004, 0, 4, 4, 0, 16) == (0x1000, 5, 4, 1)
    # Negative strides: the envelope starts at the lowest element.
    assert _strided.plan(0x1010, -3, 4, 4, 0, 16) == (0x1000, 5, 4, 4)
    # A pointer that is not element-aligned falls back to bytes.
    assert _strided.plan(0x1001, 0, 2, 4, 0, 16) == (0x1000, 9, 1, 1)
    with pytest.raises(BufferError, match="allocation"):
        _strided.plan(0x1004, 0, 4, 4, 0x1002, 16)


def test_copy_false_on_host_memory_jaxlib_will_not_view():
    """Found by fuzzing: jaxlib views host memory only when 64-byte aligned;
    a 16-byte aligned array with copy=False raised jaxlib's own
    JaxRuntimeError instead of BufferError."""
    raw = T.aligned_empty((160,), np.uint8, alignment=64)
    v = raw[16:144].view(np.float32)  # 16-byte but not 64-byte aligned
    v[...] = np.arange(32)
    with pytest.raises(BufferError, match="without a copy"):
        T.import_host(T.HostCAI(v), copy=False)
    np.testing.assert_array_equal(np.asarray(T.import_host(T.HostCAI(v))), np.arange(32))
