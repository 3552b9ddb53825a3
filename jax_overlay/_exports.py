"""The one export path: a JAX array's buffer described for foreign
consumers, ordered after its pending computation on the GPU without the host
waiting."""

from __future__ import annotations

import datetime
import functools
import numbers
import operator
import weakref
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from . import _runtime as rt
from . import _xla_ext as ext
from ._config import config
from ._errors import CopyRequiredError, JaxRuntimeError, like_stock

if TYPE_CHECKING:
    from typing_extensions import CapsuleType
else:
    # types.CapsuleType exists from Python 3.13 on; datetime's C API is a capsule.
    CapsuleType = type(datetime.datetime_CAPI)

# Tests set this to describe CPU arrays too (host memory), so CI can check
# the dict builder on real JAX buffers.
_allow_host = False

_LEGACY_STREAM = 1
_NOT_CUDA = 0
_layout_strides: dict[tuple, tuple | None] = {}
_row_major_layouts: dict[int, object] = {}


def _strides(x, itemsize):
    """Byte strides for the array's layout, or None when it is row-major.
    The common case is one comparison with a cached row-major layout."""
    layout = getattr(x, "_pjrt_layout", None)
    ndim = len(x.shape)
    if layout is not None:
        known = _row_major_layouts.get(ndim)
        if known is not None and known == layout:
            return None
    if layout is None:  # older jaxlib: go through the public Format
        minor_to_major = list(reversed(x.format.layout.major_to_minor))
    else:
        text = str(layout).strip("{}").split(":")[0]
        minor_to_major = [int(d) for d in text.split(",")] if text else []
    if minor_to_major == list(reversed(range(ndim))):
        if layout is not None:
            _row_major_layouts[ndim] = layout
        return None
    key = (tuple(minor_to_major), x.shape, itemsize)
    out = _layout_strides.get(key)
    if out is None:
        strides = [0] * ndim
        acc = itemsize
        for d in minor_to_major:
            strides[d] = acc
            acc *= x.shape[d]
        out = _layout_strides[key] = tuple(strides)
    return out


# NumPy's own types only: ml_dtypes' float8 types also call themselves 'f'.
_CAI_DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
    np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64,
    np.complex128))


def _typestr(dtype):
    if dtype not in _CAI_DTYPES:
        # Stock JAX's words ("not supported for BF16") where it has them.
        name = "BF16" if dtype.name == "bfloat16" else str(dtype)
        raise AttributeError(
            f"__cuda_array_interface__ is not supported for {name} buffers: "
            f"the CUDA Array Interface has no type string for {dtype}; use "
            "DLPack (__dlpack__ / jax.dlpack) instead")
    return dtype.str


# Where the whole-array protocols send a sharded array.
_PER_SHARD = ("jax_overlay.to_shards(x) gives each addressable shard's device, "
              "index and data, a single-device array (x.addressable_shards[i].data): "
              "shard.data")


def check_live(x):
    """TypeError for anything but a concrete jax.Array, BufferError for a
    deleted or donated one: what every export checks first."""
    if not isinstance(x, rt.ArrayImpl):
        raise TypeError(f"expected a jax.Array, got {type(x).__module__}.{type(x).__qualname__}")
    if x.is_deleted():
        raise BufferError(
            "the JAX array was deleted or donated: its buffer is gone, so there "
            "is nothing to export")


def _check(x):
    """The precise error for an array the fast path turned away."""
    check_live(x)
    devices = x.sharding.device_set
    if len(devices) != 1:
        raise AttributeError(
            f"__cuda_array_interface__ is only supported for unsharded arrays. "
            f"It describes one buffer, but this array is sharded over "
            f"{len(devices)} devices; export each shard instead: "
            f"{_PER_SHARD}.__cuda_array_interface__")
    device = next(iter(devices))
    if device.platform != "gpu" and not (_allow_host and device.platform == "cpu"):
        raise AttributeError(
            f"__cuda_array_interface__ is only defined for NVidia GPU buffers. "
            f"This array is on {device}")


def _cuda_ordinal(ptr):
    """The CUDA device owning `ptr`, or None for host memory: the platform
    check, by asking the driver about the pointer (cheaper than walking the
    array's sharding); no driver means no GPU arrays."""
    global _no_driver
    if _no_driver:
        return None
    try:
        kind, ordinal = ext.pointer_info(ptr)[:2]
    except BufferError:
        _no_driver = not ext.driver_loaded()  # remembered: the driver never appears later
        return None
    return None if kind == "not_cuda" else ordinal


_no_driver = False


def _order(x, stream):
    """Makes `stream` wait, on the GPU, for the array's pending computation,
    through PJRT's own definition event (jaxlib's DLPack export with a
    stream), and returns jaxlib's capsule, which holds PJRT's external
    reference to the buffer.

    The definition event covers the whole computation, however many kernels
    it enqueues; an event recorded on XLA's compute stream right after
    dispatch could cover only those already enqueued (JAX enqueues on its
    own thread: the stream turned busy 10-20 us after dispatch returned, on
    the H200).  The host waits only until JAX has enqueued the computation,
    never for the GPU: jaxlib 0.11.2 returned 55-87 us after the dispatch of
    a 137 ms computation that was still running afterwards
    (benchmarks/probe_dlpack.py)."""
    return rt.order_stream_after(x, stream)


def cuda_array_interface(x: jax.Array, *, stream: int | None = None,
                         read_only: bool | None = None) -> dict[str, Any]:
    """The CUDA Array Interface (version 3) of a single-device JAX array.

    ``stream``: the consumer's stream (1 legacy, 2 per-thread, or a handle);
    it is made to wait, on the GPU, for the array's pending computation and
    is exported.  Default: if the array is ready, ``stream: None``; else the
    legacy default stream is made to wait and exported as 1, so consumers on
    the default stream (PyTorch's and CuPy's by default) are ordered even if
    they ignore the key.  The host never waits.  ``config.cai_sync = False``
    exports ``stream: None`` without ordering.

    ``read_only``: the exported flag (default ``config.cai_read_only``).
    Strides are given for any non-row-major layout JAX holds.
    """
    facts = None
    if type(x) is rt.ArrayImpl:
        entry = _ready_facts.get(id(x))
        # The weak reference proves the entry is this array's, not that of a
        # dead one whose id was reused; a deleted or donated buffer is gone.
        if entry is not None and entry[0]() is x and not x.is_deleted():
            facts = entry[1]
    ready = cacheable = facts is not None
    if facts is None:
        facts, cacheable = _facts(x)
    ptr, typestr, shape, strides = facts
    ro = config.cai_read_only if read_only is None else bool(read_only)
    out_stream = None
    if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool) or stream <= 0):
        raise ValueError(
            f"stream={stream!r}: pass 1 (legacy), 2 (per-thread) or a CUDA "
            "stream handle; 0 is ambiguous and not allowed")
    if not ready:
        ready = x.is_ready()  # type: ignore[attr-defined]  # an ArrayImpl: _facts checked
        if ready and cacheable:
            _remember(x, facts)
    if config.cai_sync and (stream is not None or not ready):
        out_stream = _LEGACY_STREAM if stream is None else stream
        _order(x, out_stream)  # the dict cannot hold the reference: dropped
    return {
        "shape": shape,
        "typestr": typestr,
        "data": (ptr, ro),
        "version": 3,
        "strides": strides,
        "stream": out_stream,
        "descr": [("", typestr)],
    }


def _facts(x):
    """((pointer, typestr, shape, strides), whether they may be kept) of an
    exportable array, with every check of the export (TypeError, BufferError,
    AttributeError).  Only a GPU array's are kept: a host array is exported
    only while tests allow it."""
    if type(x) is not rt.ArrayImpl:
        _check(x)
    try:
        # Also the sharding and deletion check: it raises for both.
        ptr = x.unsafe_buffer_pointer()
    except Exception:
        _check(x)
        raise
    on_gpu = _cuda_ordinal(ptr) is not None
    if not on_gpu:
        _check(x)  # a CPU array: AttributeError, so hasattr() is False
    dtype = x.dtype
    facts = ptr, _typestr(dtype), x.shape, _strides(x, dtype.itemsize)
    return facts, on_gpu and type(x) is rt.ArrayImpl


# What the CAI of a *ready* array says never changes while the array lives
# (its buffer, dtype, shape and layout are fixed, and it stays ready), and
# consumers read the property again and again (CuPy twice per conversion):
# those facts are kept per array, keyed by id(x).  The weak reference's
# callback drops the entry when the array dies, before its id can be reused.
_ready_facts: dict[int, tuple] = {}


def _remember(x, facts, table: dict[int, tuple] = _ready_facts) -> None:
    key = id(x)
    try:
        ref = weakref.ref(x, lambda _: table.pop(key, None))
    except TypeError:  # an ArrayImpl without weak references: no cache
        return
    table[key] = (ref, facts)


def _cai_property(self):
    return cuda_array_interface(self)


cai_property = property(
    _cai_property,
    doc="CUDA Array Interface v3 (jax_overlay): zero-copy, stream-ordered.")


# DLPack export ------------------------------------------------------------

_KDLCPU, _KDLCUDA, _KDLCUDAHOST = 1, 2, 3
_DL_KIND_CODES = {"b": 6, "i": 0, "u": 1, "f": 2, "c": 5}
_DL_NAMED_CODES = {"bfloat16": 4, "float8_e3m4": 7, "float8_e4m3": 8,
                   "float8_e4m3b11fnuz": 9, "float8_e4m3fn": 10,
                   "float8_e4m3fnuz": 11, "float8_e5m2": 12,
                   "float8_e5m2fnuz": 13, "float8_e8m0fnu": 14}


def _dl_dtype(dtype):
    if dtype in _CAI_DTYPES:
        return (_DL_KIND_CODES[dtype.kind], dtype.itemsize * 8, 1)
    code = _DL_NAMED_CODES.get(dtype.name)
    if code is None:
        raise BufferError(f"DLPack has no type code for {dtype}")
    return (code, dtype.itemsize * 8, 1)


def int_pair(value):
    """`value` as a tuple of two ints (IntEnums and NumPy ints included), or
    None if it is not a tuple or list of two integers: DLPack's devices and
    versions."""
    if type(value) is tuple and len(value) == 2:
        a, b = value
        if type(a) is int and type(b) is int:
            return value  # the common case, without a conversion
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return None
    try:
        return operator.index(value[0]), operator.index(value[1])
    except TypeError:
        return None


def device_pair(value):
    """A DLPack device as stock JAX reads one, for both directions: int_pair,
    or any pair of numbers with integral values (stock unpacks the pair and
    looks the type up by equality, so (1.0, 0) is the CPU), as ints; else
    None (bad_device's error)."""
    pair = int_pair(value)
    if pair is not None:
        return pair
    try:
        a, b = value
        pair = int(a), int(b)
    except (TypeError, ValueError, OverflowError):
        return None
    return pair if pair == (a, b) and not isinstance(a, (str, bytes)) else None


def bad_device(what):
    """The error for a device device_pair cannot read, `what` saying where
    it came from: a TypeError, and the ValueError stock's unpacking raises."""
    return like_stock(TypeError(
        f"{what}; the DLPack protocol asks for a tuple (device_type: int, "
        "device_id: int)"), ValueError)


def _dl_check(x):
    """The CAI export's checks, with the DLPack protocol's BufferError."""
    try:
        _check(x)
    except AttributeError as e:
        if "only defined for NVidia GPU buffers" not in str(e):
            raise BufferError(str(e).replace("__cuda_array_interface__", "__dlpack__")) from None


def _dl_enum(code):
    """JAX's DLDeviceType member where this jax has it (it is an IntEnum)."""
    try:
        from jax._src.dlpack import DLDeviceType
        return DLDeviceType(code)
    except (ImportError, ValueError):
        return code


_DL_CPU = (_dl_enum(_KDLCPU), 0)
_DL_CUDA, _DL_CUDAHOST = _dl_enum(_KDLCUDA), _dl_enum(_KDLCUDAHOST)


@functools.cache
def _cuda_gpus():
    """Whether this process's "gpu" platform is CUDA (not ROCm)."""
    try:
        rt.gpu_backend()
    except BufferError:
        return False
    return True


def ours(x) -> bool:
    """Whether jax_overlay exports `x` (CPU and CUDA arrays); other
    platforms keep JAX's own protocol methods."""
    platform = x.platform()
    return platform == "cpu" or (platform == "gpu" and _cuda_gpus())


def dlpack_device(x):
    """``__dlpack_device__``: where the array's memory is.  A ``pinned_host``
    array is kDLCUDAHost (jax < 0.10.2 said kDLCUDA), device memory kDLCUDA,
    a CPU array kDLCPU."""
    sharding = x.sharding
    device: Any
    if type(sharding) is jax.sharding.SingleDeviceSharding:
        device = sharding._device
    else:
        devices = sharding.device_set
        if len(devices) != 1:
            raise BufferError(
                f"__dlpack__ describes one buffer, but this array is sharded "
                f"over {len(devices)} devices; export each shard instead: "
                f"{_PER_SHARD}.__dlpack__")
        device, = devices
    if device.platform == "cpu":
        return _DL_CPU
    return (_DL_CUDAHOST if sharding.memory_kind == "pinned_host" else _DL_CUDA,
            device.local_hardware_id)


def _versioned(max_version):
    """Whether a consumer allowing `max_version` gets a versioned capsule;
    TypeError for anything but None or a (major, minor) pair, or another
    tuple of numbers, which stock JAX compares as tuples."""
    if max_version is None:
        return False
    pair = int_pair(max_version)
    if pair is not None:
        return pair >= (1, 0)
    if (type(max_version) is tuple and max_version
            and all(isinstance(v, numbers.Real) for v in max_version)):
        return max_version >= (1, 0)
    raise TypeError(f"max_version={max_version!r}: pass None or a tuple "
                    "(major: int, minor: int)")


def to_dlpack(x: jax.Array, *, stream: int | None = None,
              max_version: tuple[int, int] | None = None,
              dl_device: tuple[int, int] | None = None,
              copy: bool | None = None) -> CapsuleType:
    """A DLPack capsule of a single-device JAX array, per the Array API's
    ``__dlpack__``.

    * ``max_version`` >= (1, 0): a versioned capsule with READ_ONLY (JAX arrays
      are immutable) and IS_COPIED when a copy was made; else a legacy one.
    * ``stream`` for GPU arrays: None = the legacy default stream, -1 = no
      ordering, 1 / 2 / a handle = that stream, which waits on the GPU for the
      array's pending computation; the host never waits for the GPU (only,
      for microseconds, until JAX has enqueued the computation).  CPU
      consumers of a pending array (a CPU array, or ``dl_device=(kDLCPU, 0)``
      on a pinned one) can only be served by waiting for it.
    * ``dl_device=(kDLCPU, 0)`` on a ``pinned_host`` array is a zero-copy CPU
      view; another device copies there (BufferError with ``copy=False``).
    * The capsule holds the array and jaxlib's external reference, which
      makes XLA refuse to donate the buffer while a consumer holds it; only
      a pending array exported with ``stream=-1`` has none (getting one would
      mean waiting for it), so do not donate it while that export lives.
    """
    if dl_device is None and not copy and type(x) is rt.ArrayImpl and (
            stream is None or type(stream) is int and (stream > 0 or stream == -1)):
        entry = _dl_ready_facts.get(id(x))
        # As for the CAI: the weak reference proves the entry is this
        # array's; a deleted or donated buffer is gone.
        if entry is not None and entry[0]() is x and not x.is_deleted():
            ptr, shape, strides, dl_dtype, dl_type, dl_id = entry[1]
            if dl_type != _KDLCPU or stream is None or stream == -1:
                versioned = _versioned(max_version)
                # Lifetime as below: the array holds its buffer, jaxlib's
                # external reference blocks donation while a consumer holds it.
                return ext.raw_capsule((x, rt.external_reference(x)), ptr, shape, strides,
                                       dl_dtype, dl_type, dl_id, versioned,
                                       ext.FLAG_READ_ONLY if versioned else 0)
    if type(x) is not rt.ArrayImpl or x.is_deleted():
        _dl_check(x)  # the precise error; sharded arrays fail in dlpack_device
    if copy is not None and type(copy) is not bool:
        copy = bool(copy)  # stock JAX reads copy= by its truth
    versioned = _versioned(max_version)
    want = None
    if dl_device:  # stock: an empty or falsy dl_device is none
        want = device_pair(dl_device)
        if want is None:
            raise bad_device(f"dl_device={dl_device!r}")
        if not want[0]:
            want = None  # stock: device type 0 names no device
    dl_dtype = _dl_dtype(x.dtype)  # before any copy or reference is made
    src_type, src_id = dlpack_device(x)
    src_type, src_id = int(src_type), int(src_id)
    target = (src_type, src_id)
    copied = False
    if want is not None and want != target:
        if src_type == _KDLCUDAHOST and want == (_KDLCPU, 0):
            target = want  # the same pinned memory, read by the host
        else:
            # The device first, as stock JAX does: an unknown one is its
            # error whatever copy= says.
            if want[0] == _KDLCPU:
                try:
                    dest = rt.host_backend().device_from_local_hardware_id(want[1])
                except Exception as e:  # jaxlib's runtime error, stock's too
                    raise like_stock(BufferError(
                        f"dl_device={want}: this process has no CPU device {want[1]} ({e})"),
                        type(e) if isinstance(e, RuntimeError) else RuntimeError) from None
            elif want[0] == _KDLCUDA:
                try:
                    dest = rt.gpu_device(want[1])
                except BufferError as e:
                    raise like_stock(type(e)(f"dl_device={want}: {e}"), RuntimeError) from None
            else:
                # Stock looks a type it maps up as a backend (RuntimeError
                # where this process has none), and refuses the others
                # with BufferError.
                raise like_stock(BufferError(
                    f"dl_device={want}: jax_overlay exports to kDLCPU or kDLCUDA"),
                    RuntimeError if want[0] in rt.stock_dlpack_platforms() else BufferError)
            if copy is False:
                raise CopyRequiredError(
                    f"Specified dl_device={want} which requires a copy since the "
                    f"source device is {target}, however copy=False (another "
                    "device needs a copy). Set copy=True or copy=None to "
                    "perform the requested operation.")
            x, copied, target = rt.device_put(x, dest), True, want
    if copy and not copied:
        x, copied = rt.device_put(x, x.sharding, may_alias=False), True
    if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)
                               or stream == 0 or stream < -1):
        # jaxlib takes an int64 stream (TypeError otherwise) and refuses
        # what it cannot wait on with its runtime error.
        stock = (JaxRuntimeError if isinstance(stream, int) and -2**63 <= stream < 2**63
                 else TypeError)
        raise like_stock(BufferError(
            f"stream={stream!r}: pass None (legacy default stream), -1 (no "
            "ordering), 1, 2 or a CUDA stream handle"), stock)
    ready = x.is_ready()  # type: ignore[attr-defined]  # an ArrayImpl: checked above
    if target[0] == _KDLCPU:
        if stream not in (None, -1):
            # Stock jaxlib: UNIMPLEMENTED, a JaxRuntimeError (a TypeError
            # for a stream beyond int64).
            raise like_stock(BufferError(
                f"stream={stream!r} for host memory: CPU consumers pass None"),
                JaxRuntimeError if stream < 2**63 else TypeError)
        if not ready:
            x.block_until_ready()  # a host reader has no stream to wait on
            ready = True
    # PJRT's external reference makes XLA refuse to donate the buffer while
    # a consumer holds it; jaxlib's capsule carries it and drops it from its
    # destructor (it is never consumed), so it lives exactly as long as ours.
    if ready:
        reference = rt.external_reference(x)
    elif stream != -1:
        reference = _order(x, _LEGACY_STREAM if stream is None else stream)
    else:
        reference = None  # unordered and pending: only a host wait could get one
    dtype = x.dtype
    strides = _strides(x, dtype.itemsize)
    if strides is not None:
        strides = [s // dtype.itemsize for s in strides]
    # Lifetime: the array keeps its buffer alive, the reference blocks donation.
    owner = x if reference is None else (x, reference)
    flags = ext.FLAG_READ_ONLY | (ext.FLAG_IS_COPIED if copied else 0)
    ptr, shape = x.unsafe_buffer_pointer(), list(x.shape)
    if ready and not copied and type(x) is rt.ArrayImpl:
        # What a ready array's capsule says never changes while it lives.
        _remember(x, (ptr, shape, strides, dl_dtype, target[0], target[1]), _dl_ready_facts)
    return ext.raw_capsule(owner, ptr, shape, strides, dl_dtype, target[0], target[1],
                           versioned, flags if versioned else 0)


# The DLPack export's facts of ready arrays, as _ready_facts for the CAI.
_dl_ready_facts: dict[int, tuple] = {}
