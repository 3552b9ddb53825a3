"""DLPack import on the CPU: versioned and legacy capsules, flags, version
negotiation, strides, lifetimes and errors."""

import ctypes
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_overlay
from jax_overlay import _dlpack as D
import forge as T
from jax_overlay import _xla_ext as ext


def aligned(shape, dtype=np.float32):
    a = T.aligned_empty(shape, dtype)
    a[...] = (np.arange(a.size) % 7).reshape(shape).astype(dtype)
    return a


pytestmark = pytest.mark.usefixtures("balanced")


class Producer:
    """Hands out our own capsules; records what the consumer asked for."""

    def __init__(self, array, *, versioned=True, legacy_only=False, device=(1, 0)):
        self.array, self.versioned, self.legacy_only = array, versioned, legacy_only
        self.device, self.asked = device, []

    def __dlpack__(self, *, stream=None, **kw):
        if self.legacy_only and kw:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        self.asked.append(dict(stream=stream, **kw))
        self.owner = weakref.ref(owner := T.HostCAI(self.array))
        return T.host_capsule(owner, versioned=self.versioned)

    def __dlpack_device__(self):
        return self.device


def test_read_only_numpy_is_a_view():
    a = aligned((3, 4))
    a.flags.writeable = False
    x = jax_overlay.from_dlpack(a)
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    np.testing.assert_array_equal(np.asarray(x), a)


def test_asks_for_version_1_and_stream_none_on_cpu():
    p = Producer(aligned((4,)))
    jax_overlay.from_dlpack(p)
    assert p.asked == [{"stream": None, "max_version": D.MAX_VERSION}]
    x = jax_overlay.from_dlpack(p, copy=True)  # JAX copies: the producer is not asked to
    assert "copy" not in p.asked[-1] and x.unsafe_buffer_pointer() != p.array.ctypes.data
    jax_overlay.from_dlpack(p, copy=False)
    assert p.asked[-1]["copy"] is False


@pytest.mark.parametrize("versioned", [True, False])
def test_our_capsules_both_kinds(versioned):
    a = aligned((2, 5))
    x = jax_overlay.from_dlpack(Producer(a, versioned=versioned))
    assert x.unsafe_buffer_pointer() == a.ctypes.data
    np.testing.assert_array_equal(np.asarray(x), a)


def test_legacy_producer_fallback():
    p = Producer(aligned((3,)), versioned=False, legacy_only=True)
    x = jax_overlay.from_dlpack(p)
    np.testing.assert_array_equal(np.asarray(x), p.array)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.uint16, np.int32,
                                   np.float16, np.float32, np.complex64])
def test_dtypes_from_numpy(dtype):
    a = aligned((6,), dtype)
    x = jax_overlay.from_dlpack(a)
    assert x.dtype == a.dtype
    np.testing.assert_array_equal(np.asarray(x), a)


def test_bfloat16_from_a_jax_producer():
    src = jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), jax.devices("cpu")[0])
    x = jax_overlay.from_dlpack(src)
    assert x.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x), np.asarray(src))


def test_x64_follows_jax():
    a = aligned((4,), np.int64)
    assert jax_overlay.from_dlpack(a).dtype == jnp.int32
    jax.config.update("jax_enable_x64", True)
    try:
        x = jax_overlay.from_dlpack(a)
        assert x.dtype == jnp.int64 and x.unsafe_buffer_pointer() == a.ctypes.data
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("view", [lambda a: a[::2], lambda a: a[::-1, 1:],
                                  lambda a: a[:, ::-3], lambda a: a.T[1:]])
def test_strided_numpy_is_one_copy(view):
    v = view(aligned((6, 7)))
    x = jax_overlay.from_dlpack(v)
    np.testing.assert_array_equal(np.asarray(x), v)
    with pytest.raises(BufferError, match="without a copy"):
        jax_overlay.from_dlpack(view(aligned((6, 7))), copy=False)


def test_zero_size_and_0d():
    z = jax_overlay.from_dlpack(np.empty((0, 3), np.float32))
    assert z.shape == (0, 3)
    s = jax_overlay.from_dlpack(np.array(2.5, np.float32))
    assert s.shape == () and float(s) == 2.5


def test_raw_capsule_and_reuse():
    a = aligned((5,))
    cap = a.__dlpack__()
    x = jax_overlay.from_dlpack(cap)
    np.testing.assert_array_equal(np.asarray(x), a)
    with pytest.raises(BufferError, match="already consumed"):
        jax_overlay.from_dlpack(cap)


def test_not_a_producer():
    with pytest.raises(TypeError, match="has no __dlpack__"):
        jax_overlay.from_dlpack([1, 2, 3])


@pytest.mark.parametrize("dl_type", [4, 7, 10, 14])
def test_unsupported_device_type(dl_type):
    with pytest.raises(BufferError, match=f"device type {dl_type}"):
        jax_overlay.from_dlpack(Producer(aligned((2,)), device=(dl_type, 0)))


def test_newer_major_version_is_released_and_refused():
    a = aligned((3,))
    p = T.HostCAI(a)
    ref = weakref.ref(p)
    cap = T.host_capsule(p, versioned=True)
    del p
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    ctypes.c_uint32.from_address(get(cap, b"dltensor_versioned")).value = 2
    with pytest.raises(BufferError, match="DLPack 2.1"):
        jax_overlay.from_dlpack(cap)
    gc.collect()
    assert ref() is None, "a refused tensor must still be freed"


@pytest.mark.parametrize("versioned", [True, False])
def test_tensor_owner_lives_until_jax_frees_the_buffer(versioned):
    a = aligned((16,))
    p = Producer(a, versioned=versioned)
    x = jax_overlay.from_dlpack(p)
    owner = p.owner
    del p
    gc.collect()
    assert owner() is not None, "the capsule's owner must live while JAX holds the view"
    y = x * 2
    del x
    y.block_until_ready()
    # XLA's thread drops its hold on x just after y is ready.
    T.settle(lambda: owner() is None, "and go when JAX frees the buffer")
    np.testing.assert_array_equal(np.asarray(y), a * 2)


def test_strided_copy_releases_the_tensor():
    p = Producer(aligned((8, 8))[::2, ::3])
    x = jax_overlay.from_dlpack(p)
    x.block_until_ready()
    # XLA's thread drops the copy's source just after the copy is ready.
    T.settle(lambda: p.owner() is None, "the copy's source was not released")
    np.testing.assert_array_equal(np.asarray(x), p.array)


def test_copy_and_device_rules():
    a = aligned((8,))
    x = jax_overlay.from_dlpack(a, copy=True)
    assert x.unsafe_buffer_pointer() != a.ctypes.data
    np.testing.assert_array_equal(np.asarray(x), a)
    y = jax_overlay.from_dlpack(a, device=jax.devices("cpu")[0], copy=False)
    assert y.unsafe_buffer_pointer() == a.ctypes.data


def test_unaligned_cpu_memory_with_copy_false():
    raw = T.aligned_empty((80,), np.uint8)
    v = raw[4:68].view(np.float32)  # 4-byte aligned only
    v[...] = np.arange(16)
    x = jax_overlay.from_dlpack(v)  # jaxlib copies unaligned host memory itself
    np.testing.assert_array_equal(np.asarray(x), np.arange(16))


def _patch_byte_offset(cap, value):
    """Sets byte_offset of our own legacy capsule's tensor (offset 40)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    ctypes.c_uint64.from_address(get(cap, b"dltensor") + 40).value = value


@pytest.mark.parametrize("case", ["null", "offset_wraps", "past_top", "bytes_overflow"])
def test_tensors_no_consumer_can_read_are_refused(case):
    """Found by fuzzing: these were imported (a null pointer as garbage data)
    or reached jaxlib, which raised RuntimeError."""
    a = aligned((6,))
    data, shape, dtype = a.ctypes.data, [6], "<f4"
    if case == "null":
        data = 0
    elif case == "past_top":
        data = 2**64 - 16
    elif case == "bytes_overflow":
        shape, dtype = [2**61], "<f8"
    cap = ext.raw_capsule(a, data, shape, None, dtype, 1, 0)
    if case == "offset_wraps":
        _patch_byte_offset(cap, 2**64 - 8)
    words = {"null": "null data pointer", "offset_wraps": "byte_offset",
             "past_top": "past the top", "bytes_overflow": "overflows int64"}[case]
    with pytest.raises(BufferError, match=words):
        jax_overlay.from_dlpack(cap)


@pytest.mark.parametrize("dtype,why", [
    ((0, 4, 1), "sub-byte"), ((1, 2, 1), "sub-byte"), ((17, 4, 1), "sub-byte"),
    ((2, 32, 2), "one lane"), ((3, 64, 1), "no such dtype"),
    ((2, 12, 1), "no such dtype"), ((99, 8, 1), "no such dtype")])
def test_dtypes_jax_cannot_hold_are_buffer_errors(dtype, why):
    """Found by fuzzing: these reached jaxlib, which raised its own
    RuntimeError (JaxRuntimeError: UNIMPLEMENTED ...)."""
    a = aligned((8,))
    owner = T.HostCAI(a)
    ref = weakref.ref(owner)
    cap = ext.raw_capsule(owner, a.ctypes.data, [4], None, dtype, 1, 0)
    del owner
    code, bits, lanes = dtype
    with pytest.raises(BufferError, match=f"code {code}, bits {bits}, lanes {lanes}.*{why}"):
        jax_overlay.from_dlpack(cap)
    del cap
    gc.collect()
    assert ref() is None, "the refused tensor must be freed"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_zero_size_of_non_numpy_dtypes(dtype):
    """Found by fuzzing: 'a zero-size array of this dtype cannot be imported'."""
    src = jax.device_put(jnp.zeros((0, 3), dtype), jax.devices("cpu")[0])
    x = jax_overlay.from_dlpack(src)
    assert x.shape == (0, 3) and x.dtype == dtype


@pytest.mark.parametrize("device", [None, (1,), (1, 0, 0), "10", (1.5, 0), (1, "0")])
def test_malformed_dlpack_device_is_a_clear_type_error(device):
    """Found by fuzzing: these gave 'not enough values to unpack' or
    "'NoneType' object is not iterable", or (1.5, 0) was read as (1, 0)."""
    p = Producer(aligned((3,)), device=device)
    with pytest.raises(TypeError, match=r"__dlpack_device__\(\) returned .*\(device_type: int"):
        jax_overlay.from_dlpack(p)
    assert p.asked == [], "no capsule may be asked for"


def test_dlpack_device_accepts_int_enums():
    """PyTorch and JAX answer with an IntEnum, others with NumPy ints."""
    import enum

    class DLDeviceType(enum.IntEnum):
        kDLCPU = 1

    p = Producer(aligned((3,)), device=(DLDeviceType.kDLCPU, np.int64(0)))
    np.testing.assert_array_equal(np.asarray(jax_overlay.from_dlpack(p)), p.array)


@pytest.mark.parametrize("dtype,code", [(jnp.bfloat16, (4, 16, 1)),
                                        (jnp.float8_e4m3fn, (10, 8, 1))])
@pytest.mark.parametrize("view", ["strided", "negative", "misaligned"])
def test_strided_bfloat16_and_float8_are_one_copy(dtype, code, view):
    """Found by fuzzing: 'a strided or misaligned array of this dtype cannot
    be copied on import' for dtypes without a NumPy type string."""
    raw = T.aligned_empty((64,), np.uint8)
    base = raw[:48].view(dtype)
    base[...] = np.arange(base.size).astype(dtype)
    if view == "strided":
        v, ptr, strides = base[::3], base.ctypes.data, [3]
    elif view == "negative":
        v, ptr, strides = base[::-2], base[-1:].ctypes.data, [-2]
    else:  # an odd address: bfloat16 elements straddle it, so bytes are gathered
        v = raw[1:17].view(dtype)
        ptr, strides = v.ctypes.data, None
    cap = ext.raw_capsule(raw, ptr, list(v.shape), strides, code, 1, 0)
    x = jax_overlay.from_dlpack(cap)
    assert x.dtype == dtype and x.shape == v.shape
    assert np.asarray(x).tobytes() == np.ascontiguousarray(v).tobytes()


@pytest.mark.parametrize("dtype,code", [
    (jnp.float8_e5m2, (12, 8, 1)), (jnp.float8_e4m3fn, (10, 8, 1)),
    (jnp.bfloat16, (4, 16, 1)), (np.float16, (2, 16, 1)), (np.float32, (2, 32, 1))])
def test_strided_copy_keeps_every_bit(dtype, code):
    """Found by fuzzing: the copy of a strided float8_e5m2 tensor rewrote NaN
    payloads (0x7d, 0xfe, ... became 0x7f): XLA's CPU gather went through a
    wider float.  Every bit pattern, NaNs included, must survive the copy."""
    k = np.dtype(dtype).itemsize
    n = 256 if k == 1 else 1024
    rng = np.random.default_rng(0)
    patterns = np.arange(256, dtype=np.uint8) if k == 1 else rng.integers(
        0, 256, n * k, dtype=np.uint8)
    raw = T.aligned_empty((2 * n * k,), np.uint8)
    raw[...] = 0
    both = raw.view(np.dtype(f"u{k}")).reshape(n, 2)
    both[:, 0] = patterns.view(np.dtype(f"u{k}"))  # every other element
    cap = ext.raw_capsule(raw, raw.ctypes.data, [n], [2], code, 1, 0)
    x = jax_overlay.from_dlpack(cap)
    assert np.asarray(x).tobytes() == patterns.tobytes()


class Lying:
    """A producer whose __dlpack_device__ says host memory while its capsule
    says CUDA memory (the GPU fuzz's wrapper over a CuPy array, which
    crashed the import on the H100)."""

    def __init__(self, array, capsule_device):
        self.array, self.capsule_device = array, capsule_device

    def __dlpack__(self, *, stream=None, **kw):
        cap, self.key = T.forge_capsule(data=self.array.ctypes.data, device=self.capsule_device,
                                        shape=self.array.shape, keep=self.array)
        return cap

    def __dlpack_device__(self):
        return (1, 0)


@pytest.mark.parametrize("capsule_device", [(2, 0), (13, 0)], ids=["kDLCUDA", "kDLCUDAManaged"])
def test_host_advertised_over_device_memory_is_refused_not_read(capsule_device):
    a = aligned((4, 4))
    producer = Lying(a, capsule_device)
    with pytest.raises(BufferError, match=r"says \(1, 0\) \(kDLCPU\), but its capsule holds "
                                          r"kDLCUDA\w* memory") as e:
        jax_overlay.from_dlpack(producer)
    assert isinstance(e.value, jax.errors.JaxRuntimeError)
    T.settle(lambda: T.forged_deletes.get(producer.key) == 1, "the refused capsule was not released")
