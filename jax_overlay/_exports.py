"""The one export path: a JAX array's buffer described for foreign
consumers, ordered after its pending computation on the GPU without the host
waiting."""

from __future__ import annotations

import datetime
import functools
import operator
import weakref
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from . import _runtime as rt
from . import _xla_ext as ext
from ._config import config
from .errors import CopyRequiredError, JaxRuntimeError, like_stock

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
    if isinstance(x, rt.ArrayImpl) and x.is_deleted():
        # An AttributeError too: hasattr(x, "__cuda_array_interface__") says
        # False for a deleted or donated array, as on stock, and never raises.
        raise like_stock(BufferError(
            "the JAX array was deleted or donated: its buffer is gone, so it has "
            "no __cuda_array_interface__"), AttributeError)
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
        # jaxlib refuses it with its runtime error ("no DLPack equivalent").
        raise like_stock(BufferError(
            f"DLPack has no type code for {dtype}: convert the array (astype) to a "
            "type DLPack describes first"), JaxRuntimeError)
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
    """Whether jax_overlay exports `x`: CUDA arrays, and CPU arrays where the
    running jaxlib has no DLPack 1.x of its own (its CPU export is right
    from jaxlib 0.12 on: versioned capsules, READ_ONLY, IS_COPIED).  Other
    platforms, and deleted or donated arrays (nothing to export: stock's
    own error is the one to keep), keep JAX's own protocol methods."""
    if x.is_deleted():
        return False
    platform = x.platform()
    if platform == "cpu":
        return not rt.NATIVE_DLPACK_1
    return platform == "gpu" and _cuda_gpus()


def _device_of(x):
    """The one device of `x`, BufferError for a sharded array."""
    sharding = x.sharding
    if type(sharding) is jax.sharding.SingleDeviceSharding:
        return sharding._device
    devices = sharding.device_set
    if len(devices) != 1:
        raise BufferError(
            f"__dlpack__ describes one buffer, but this array is sharded "
            f"over {len(devices)} devices; export each shard instead: "
            f"{_PER_SHARD}.__dlpack__")
    device, = devices
    return device


def dlpack_device(x):
    """``__dlpack_device__``: where the array's memory is.  A ``pinned_host``
    array is kDLCUDAHost (jax < 0.10.2 said kDLCUDA), device memory kDLCUDA,
    a CPU array kDLCPU: (kDLCPU, 0) for every CPU device, as stock says
    (host memory belongs to no CPU device in particular); the capsule
    itself names the device's id, as stock's does (_capsule_device)."""
    device = _device_of(x)
    if device.platform == "cpu":
        return _DL_CPU
    return (_DL_CUDAHOST if x.sharding.memory_kind == "pinned_host" else _DL_CUDA,
            device.local_hardware_id)


def _capsule_device(x, device):
    """(device type, id) that the capsule of `x`, on `device`, carries:
    dlpack_device's, with a CPU device's own id, as jaxlib's capsule says
    (cpu:1 is (kDLCPU, 1))."""
    dl_type, dl_id = dlpack_device(x)
    if int(dl_type) == _KDLCPU:
        return _KDLCPU, device.local_hardware_id
    return int(dl_type), int(dl_id)


def _dl_destination(dl_device):
    """The JAX device `dl_device` names, read as stock's to_dlpack reads it
    (a falsy pair or device type names none; the pair is unpacked, its type
    looked up in stock's table, its id in that backend), with stock's
    classes and our words: ValueError/TypeError for what does not unpack,
    BufferError for a type stock does not map, its RuntimeError for a
    backend or id this process does not have."""
    if not dl_device:
        return None
    try:
        dl_type, dl_id = dl_device
    except (TypeError, ValueError) as e:  # stock's class, and a TypeError: a wrong type
        raise like_stock(TypeError(f"dl_device={dl_device!r}: the DLPack protocol asks for a "
                                   "tuple (device_type: int, device_id: int)"), type(e)) from None
    if not dl_type:
        return None
    try:
        platform = rt.stock_dlpack_platforms()[dl_type]
    except (KeyError, TypeError):  # TypeError: unhashable, stock's too
        raise BufferError(
            f"dl_device={dl_device!r}: device type {dl_type!r} is not one JAX exports to; "
            "pass (1, id) for the host or (2, id) for a CUDA device") from None
    try:
        return rt.backend(platform).device_from_local_hardware_id(dl_id)
    except Exception as e:  # jaxlib's runtime error, or its argument TypeError
        raise like_stock(BufferError(
            f"dl_device={dl_device!r}: this process has no {platform} device {dl_id!r} ({e})"),
            type(e)) from None


def _versioned(max_version):
    """Whether a consumer allowing `max_version` gets a versioned capsule,
    read as stock's to_dlpack of the running jax reads it: compared with
    tuples (TypeError, or ValueError, for what does not compare), BufferError
    below stock's oldest version.  Where jaxlib takes max_version itself,
    its (int, int) check comes later, with the other arguments jaxlib reads
    (_jaxlib_arguments)."""
    if max_version is None:
        return False
    stock = rt.stock_dlpack()
    try:
        known = (max_version >= tuple(stock.DLPACK_VERSION)
                 or max_version >= tuple(stock.MIN_DLPACK_VERSION))
        versioned = bool(known and max_version >= (1, 0))
    except (TypeError, ValueError) as e:
        raise type(e)(f"max_version={max_version!r}: pass None or a tuple "
                      "(major: int, minor: int)") from None
    if not known:
        raise BufferError(f"max_version={max_version!r}: JAX exports no DLPack "
                          f"version below {tuple(stock.MIN_DLPACK_VERSION)}")
    return versioned


def _index(v):
    try:
        operator.index(v)
    except TypeError:
        return False
    return True


def _jaxlib_arguments(stream, max_version):
    """The refusal of arguments stock's jaxlib call cannot take, as an
    instance of its TypeError: a stream that is not an int64, and (DLPack
    1.x native jaxlib) a max_version that is not two ints."""
    bad = []
    if stream is not None and not (_index(stream) and -2**63 <= operator.index(stream) < 2**63):
        bad.append(f"stream={stream!r} (pass None, -1, 1, 2 or a CUDA stream handle)")
    if rt.NATIVE_DLPACK_1 and max_version is not None and not (
            not isinstance(max_version, (str, bytes)) and _len(max_version) == 2
            and all(_index(v) for v in max_version)):
        bad.append(f"max_version={max_version!r} (pass a tuple (major: int, minor: int))")
    if bad:
        raise like_stock(BufferError("__dlpack__: " + "; ".join(bad)), TypeError)


def _len(v):
    try:
        return len(v)
    except TypeError:
        return -1


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
    * Arguments are read, and refused, in the order and with the classes of
      stock JAX's ``__dlpack__``: ``dl_device``, ``max_version``, the copy,
      then what jaxlib itself checks (the stream).
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
            versioned = _versioned(max_version)
            if rt.NATIVE_DLPACK_1 and max_version is not None:
                _jaxlib_arguments(stream, max_version)
            # Lifetime as below: the array holds its buffer, jaxlib's
            # external reference blocks donation while a consumer holds it.
            return ext.raw_capsule((x, rt.external_reference(x)), ptr, shape, strides,
                                   dl_dtype, dl_type, dl_id, versioned,
                                   ext.FLAG_READ_ONLY if versioned else 0)
    if type(x) is not rt.ArrayImpl or x.is_deleted():
        _dl_check(x)  # the precise error
    source = _device_of(x)  # BufferError for a sharded array, stock's first check
    # Stock's order: the destination, the version, the copy, then jaxlib's
    # own checks of what it is passed.
    dest = _dl_destination(dl_device)
    versioned = _versioned(max_version)
    target = _capsule_device(x, source)
    copied = False
    if dest is not None and target[0] == _KDLCUDAHOST and dest.platform == "cpu":
        target = (_KDLCPU, dest.local_hardware_id)  # the same pinned memory, read by the host
    elif dest is not None and dest != source:
        if copy is not None and not copy:
            raise CopyRequiredError(
                f"Specified dl_device={dl_device!r} which requires a copy since the "
                f"source device is {source!r}, however copy=False. Set copy=True or "
                "copy=None to perform the requested operation.")
        else:
            x, copied = rt.device_put(x, dest), True
            target = _capsule_device(x, dest)
    if copy and not copied:
        # A fresh buffer on the same device: device_put to where the array
        # already is would alias it.
        x, copied = rt.device_put(x, x.sharding, may_alias=False), True
    _jaxlib_arguments(stream, max_version)
    dl_dtype = _dl_dtype(x.dtype)  # jaxlib's refusal: its runtime error
    ready = x.is_ready()  # type: ignore[attr-defined]  # an ArrayImpl: checked above
    if target[0] == _KDLCPU:
        # Any stream is served: a host reader has none to wait on, so the
        # host waits for the array instead.  (Stock jaxlib serves one for a
        # view of host memory and refuses it, UNIMPLEMENTED, for a buffer
        # of its own: the overlay serves both.)
        if not ready:
            x.block_until_ready()  # a host reader has no stream to wait on
            ready = True
    elif stream is not None and (stream == 0 or stream < -1):
        # jaxlib refuses what it cannot wait on with its runtime error.
        raise like_stock(BufferError(
            f"stream={stream!r}: pass None (legacy default stream), -1 (no "
            "ordering), 1, 2 or a CUDA stream handle"), JaxRuntimeError)
    # PJRT's external reference makes XLA refuse to donate the buffer while
    # a consumer holds it; jaxlib's capsule carries it and drops it from its
    # destructor (it is never consumed), so it lives exactly as long as ours.
    if ready:
        reference = rt.external_reference(x)
    elif stream != -1:
        reference = _order(x, _LEGACY_STREAM if stream is None else operator.index(stream))
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
