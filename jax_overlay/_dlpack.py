"""Room: DLPack, both ways.  Its vocabulary (device types, dtype codes,
versions, devices and versions as pairs), the export (``__dlpack__`` and
``__dlpack_device__`` of a JAX array: versioned capsules with READ_ONLY and
IS_COPIED, ordered after the array's pending computation on the GPU), and
the import of a producer's capsule, asking for DLPack 1.x, into the
protocol-neutral import (``_view``).  Arguments are read, and refused, in
the order and with the classes of the running jax's own DLPack."""

from __future__ import annotations

import datetime
import functools
import operator
from typing import TYPE_CHECKING

import jax
import ml_dtypes
import numpy as np

from . import _runtime as rt
from . import _view
from . import _xla_ext as ext
from ._vocab import KDLCPU, KDLCUDA, KDLCUDAHOST, KDLCUDAMANAGED, NUMPY_DTYPES, view_alignment
from .errors import CopyRequiredError, JaxRuntimeError, like_stock

if TYPE_CHECKING:
    from typing_extensions import CapsuleType
else:
    # types.CapsuleType exists from Python 3.13 on; datetime's C API is a capsule.
    CapsuleType = type(datetime.datetime_CAPI)

_NAMES = {KDLCPU: "kDLCPU", KDLCUDA: "kDLCUDA", KDLCUDAHOST: "kDLCUDAHost",
          KDLCUDAMANAGED: "kDLCUDAManaged"}
# Memory the host reads through its own pointer.
_HOST_TYPES = frozenset({KDLCPU, KDLCUDAHOST})
# The newest version asked for and written: the native core's.
MAX_VERSION = tuple(ext.DLPACK_VERSION)
_LEGACY_STREAM = 1

_DL_KIND_CODES = {"b": 6, "i": 0, "u": 1, "f": 2, "c": 5}
_DL_NAMED_CODES = {"bfloat16": 4, "float8_e3m4": 7, "float8_e4m3": 8,
                   "float8_e4m3b11fnuz": 9, "float8_e4m3fn": 10,
                   "float8_e4m3fnuz": 11, "float8_e5m2": 12,
                   "float8_e5m2fnuz": 13, "float8_e8m0fnu": 14}


def dtype_code(dtype):
    """DLPack's (code, bits, lanes) of a NumPy or ml_dtypes dtype, for both
    directions."""
    if dtype in NUMPY_DTYPES:
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



# Export -------------------------------------------------------------------

def _dl_check(x):
    """The precise error for an array the fast path turned away: TypeError
    for anything but a jax.Array, BufferError for a deleted or sharded
    one."""
    if isinstance(x, rt.ArrayImpl):
        rt.refuse_deleted(x, "the JAX array", "it has no __dlpack__")
    rt.check_live(x)
    rt.check_one_buffer(x, "__dlpack__", BufferError)


def _dl_enum(code):
    """JAX's DLDeviceType member where this jax has it (it is an IntEnum)."""
    try:
        from jax._src.dlpack import DLDeviceType
        return DLDeviceType(code)
    except (ImportError, ValueError):
        return code


_DL_CPU = (_dl_enum(KDLCPU), 0)
_DL_CUDA, _DL_CUDAHOST = _dl_enum(KDLCUDA), _dl_enum(KDLCUDAHOST)


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
    rt.check_one_buffer(x, "__dlpack__", BufferError)
    device, = sharding.device_set
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
    if int(dl_type) == KDLCPU:
        return KDLCPU, device.local_hardware_id
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
      keeps XLA from reusing the buffer while a consumer holds it: a
      donating computation copies instead (PJRT on the GPU refuses it; up to
      jaxlib 0.12.0 XLA:CPU leaves the array alive, from 0.12.1 it marks it
      donated, the buffer kept for the consumer).  Only a pending array
      exported with ``stream=-1`` has none (getting one would mean waiting
      for it), so do not donate it while that export lives.
    """
    cap = _remembered(x, stream, max_version, dl_device, copy)
    if cap is not None:
        return cap
    if type(x) is not rt.ArrayImpl or x.is_deleted():
        _dl_check(x)  # the precise error
    x, target, versioned, copied = _placed(x, dl_device, max_version, copy)
    _jaxlib_arguments(stream, max_version)
    dl_dtype = dtype_code(x.dtype)  # jaxlib's refusal: its runtime error
    ready, reference = _ordered(x, target, stream)
    dtype = x.dtype
    strides = rt.byte_strides(x, dtype.itemsize)
    if strides is not None:
        strides = [s // dtype.itemsize for s in strides]
    # Lifetime: the array keeps its buffer alive, the reference keeps XLA from
    # reusing it for a donation.
    owner = x if reference is None else (x, reference)
    flags = ext.FLAG_READ_ONLY | (ext.FLAG_IS_COPIED if copied else 0)
    ptr, shape = x.unsafe_buffer_pointer(), list(x.shape)
    if ready and not copied and type(x) is rt.ArrayImpl:
        # What a ready array's capsule says never changes while it lives.
        rt.remember(x, (ptr, shape, strides, dl_dtype, target[0], target[1]), _dl_ready_facts)
    return ext.raw_capsule(owner, ptr, shape, strides, dl_dtype, target[0], target[1],
                           versioned, flags if versioned else 0)


def _remembered(x, stream, max_version, dl_device, copy):
    """The capsule of a ready array exported before (its facts remembered),
    for a call that asks nothing the facts do not answer; else None.  Only
    the arguments the slow path checks after the facts are checked here."""
    if dl_device is not None or copy or type(x) is not rt.ArrayImpl or not (
            stream is None or type(stream) is int and (stream > 0 or stream == -1)):
        return None
    entry = _dl_ready_facts.get(id(x))
    # As for the CAI: the weak reference proves the entry is this array's;
    # a deleted or donated buffer is gone.
    if entry is None or entry[0]() is not x or x.is_deleted():
        return None
    ptr, shape, strides, dl_dtype, dl_type, dl_id = entry[1]
    versioned = _versioned(max_version)
    if rt.NATIVE_DLPACK_1 and max_version is not None:
        _jaxlib_arguments(stream, max_version)
    # Lifetime as to_dlpack's: the array holds its buffer, jaxlib's external
    # reference keeps XLA from reusing it while a consumer holds it.
    return ext.raw_capsule((x, rt.external_reference(x)), ptr, shape, strides,
                           dl_dtype, dl_type, dl_id, versioned,
                           ext.FLAG_READ_ONLY if versioned else 0)


def _placed(x, dl_device, max_version, copy):
    """(array, capsule device, versioned, copied): the array where the
    consumer asks for it, and a fresh buffer where copy=True, with stock's
    checks in stock's order: the array's one device, the destination, the
    version, the copy."""
    source = _device_of(x)  # BufferError for a sharded array, stock's first check
    dest = _dl_destination(dl_device)
    versioned = _versioned(max_version)
    target = _capsule_device(x, source)
    copied = False
    if dest is not None and target[0] == KDLCUDAHOST and dest.platform == "cpu":
        target = (KDLCPU, dest.local_hardware_id)  # the same pinned memory, read by the host
    elif dest is not None and dest != source:
        if copy is not None and not copy:
            raise CopyRequiredError(
                f"Specified dl_device={dl_device!r} which requires a copy since the "
                f"source device is {source!r}, however copy=False. Set copy=True or "
                "copy=None to perform the requested operation.")
        x, copied = rt.device_put(x, dest), True
        target = _capsule_device(x, dest)
    if copy and not copied:
        # A fresh buffer on the same device: device_put to where the array
        # already is would alias it.
        x, copied = rt.device_put(x, x.sharding, may_alias=False), True
    return x, target, versioned, copied


def _ordered(x, target, stream):
    """(ready, PJRT external reference or None): the consumer's `stream`
    made to wait for `x`'s pending computation on the GPU, or the host for
    a host reader, who has no stream to wait on."""
    ready = x.is_ready()
    if target[0] == KDLCPU:
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
    # PJRT's external reference keeps XLA from reusing the buffer for a
    # donation while a consumer holds it (XLA:CPU copies; from jaxlib 0.12.1
    # it marks the array donated all the same); jaxlib's capsule carries it
    # and drops it from its destructor (it is never consumed), so it lives
    # exactly as long as ours.
    if ready:
        return True, rt.external_reference(x)
    if stream != -1:
        # The consumer's stream waits, on the GPU, for the array's pending
        # computation (rt.order_stream_after); the capsule jaxlib returns
        # holds PJRT's external reference.
        return False, rt.order_stream_after(
            x, _LEGACY_STREAM if stream is None else operator.index(stream))
    return False, None  # unordered and pending: only a host wait could get one


# The DLPack export's facts of ready arrays, as _ready_facts for the CAI.
_dl_ready_facts: dict[int, tuple] = {}


# Import -------------------------------------------------------------------

def _holdable_dtypes():
    """DLPack (code, bits, lanes) -> the NumPy dtype of every type JAX holds,
    from the export's own table, so both directions agree on every code."""
    cands = list(NUMPY_DTYPES) + [
        np.dtype(getattr(ml_dtypes, name)) for name in _DL_NAMED_CODES
        if hasattr(ml_dtypes, name)]
    return {dtype_code(d): d for d in cands}


# Sub-byte types (int4, float4, ...) are not among them: DLPack packs them
# unless a flag says otherwise and jaxlib reads neither form; the export
# refuses them too.
_DTYPES = _holdable_dtypes()


def _dtype(code, bits, lanes):
    dtype = _DTYPES.get((code, bits, lanes))
    if dtype is None:
        why = ("JAX dtypes have one lane (no vector types)" if lanes != 1 else
               "sub-byte types are not imported" if 0 < bits < 8 else
               "JAX has no such dtype")
        # jaxlib's own import refuses these with its runtime error: that
        # class too, for stock's callers.
        raise like_stock(BufferError(
            f"the DLPack dtype (code {code}, bits {bits}, lanes {lanes}) cannot be "
            f"imported: {why}; JAX holds bool, (u)int8-64, float16-64, "
            "complex64/128, bfloat16 and float8 types: convert the tensor first"),
            JaxRuntimeError)
    return dtype


def device_of(x):
    """(device_type, device_id) from ``x.__dlpack_device__()``, which the
    protocol says is a pair of ints; anything else is an error naming what
    came back (unpacking it blindly gave 'not enough values'):
    bad_device."""
    dev = x.__dlpack_device__()
    pair = device_pair(dev)
    if pair is None:
        raise bad_device(
            f"{type(x).__module__}.{type(x).__qualname__}.__dlpack_device__() returned {dev!r}")
    return pair


def jax_device_of(x):
    """The JAX device stock JAX assigns to a producer's memory: stock_device
    of its ``__dlpack_device__()``."""
    return stock_device(*device_of(x))


def stock_device(dl_type, dl_id):
    """The device stock's from_dlpack looks a producer's memory up on, before
    it asks the producer for anything: that backend's device of that id
    (kDLCPU 1 is cpu:1, kDLCUDA and kDLCUDAHost that GPU), with stock's class
    where there is none (RuntimeError: no such backend; jaxlib's error: no
    such id).  None for a type stock does not map (kDLCUDAManaged;
    kDLCUDAHost on jax 0.10): its TypeError is raised last
    (refused_by_stock_as), the overlay imports them."""
    platform = _STOCK_PLATFORMS.get(dl_type)
    if platform is None:
        return None
    if dl_type == KDLCUDA or dl_type == KDLCUDAHOST:
        return rt.gpu_device(dl_id)
    device = rt.cpu_device(dl_id) if dl_type == KDLCPU else None
    if device is None:
        try:
            device = rt.backend(platform).device_from_local_hardware_id(dl_id)
        except Exception as e:  # jaxlib's runtime error, its TypeError, or "Unknown backend"
            raise like_stock(BufferError(
                f"the producer's memory is on {platform} device {dl_id!r} (__dlpack_device__), "
                f"which this process does not have ({e})"), type(e)) from None
    return device


_STOCK_PLATFORMS = rt.stock_dlpack_platforms()


def stock_class(dl_type):
    """The class stock from_dlpack raises for a producer of `dl_type` that it
    cannot take: TypeError for a type outside its table, else
    RuntimeError (no backend for it, or jaxlib's refusal)."""
    return TypeError if dl_type not in _STOCK_PLATFORMS else RuntimeError


def refused_by_stock_as(x):
    """The class stock from_dlpack raises for `x` whatever else it is asked,
    or None: TypeError for a raw capsule (stock takes producers only) and
    for a device type outside its table (kDLCUDAManaged; kDLCUDAHost on
    jax 0.10).  A refusal of such an input is an instance of it too."""
    if type(x) is CapsuleType:
        return TypeError
    try:
        dl_type = device_of(x)[0]
    except Exception:  # no __dlpack_device__, or one that raises: stock's own error
        return None
    return TypeError if dl_type not in _STOCK_PLATFORMS else None


def _check_type(dl_type):
    if dl_type not in _NAMES:
        raise like_stock(BufferError(
            f"DLPack device type {dl_type} is not one JAX can hold; jax_overlay "
            "imports kDLCPU (1), kDLCUDA (2), kDLCUDAHost (3) and "
            "kDLCUDAManaged (13): copy the array to one of those first"), stock_class(dl_type))


def _request(x, stream, copy):
    """Asks for a versioned capsule; producers that predate the 2023 Array
    API (no max_version/copy keywords) raise TypeError and get the legacy
    call, as the protocol says.  Only copy=False is passed on: a copy is
    made on JAX's side (CuPy's __dlpack__ refuses copy=True on the GPU)."""
    try:
        if copy is False:
            return x.__dlpack__(stream=stream, max_version=MAX_VERSION, copy=False)
        return x.__dlpack__(stream=stream, max_version=MAX_VERSION)
    except TypeError:
        return x.__dlpack__(stream=stream)


_gpu_targets: dict[int, tuple] = {}


def _gpu_target(dl_id):
    """(JAX device, whether the producer's device must be made current for
    its __dlpack__) of CUDA device `dl_id`, cached.  With one GPU it is
    current whenever any is."""
    target = _gpu_targets.get(dl_id)
    if target is None:
        target = _gpu_targets[dl_id] = (rt.gpu_device(dl_id), ext.device_count() > 1)
    return target


def _producer_stream(dl_type, dl_id):
    """The consumer stream handed to the producer, and then to jaxlib's
    import.  For GPU memory it is a ready stream (_runtime.ready_stream):
    the producer makes it wait for its pending work, and jaxlib records the
    array's definition event on it behind that wait, so every reader waits
    and the host never does (stock jax.dlpack.from_dlpack's route).  Pinned
    and CPU producers get None: PyTorch's pinned tensors go through its CPU
    __dlpack__, which rejects a stream."""
    if dl_type == KDLCUDA or dl_type == KDLCUDAMANAGED:
        return rt.ready_stream(_gpu_target(dl_id)[0])
    return None


def import_dlpack(x, *, copy=None, advertised=None, host_device=None, resolve=None):
    """(array, copied) for a ``__dlpack__`` producer or a raw capsule.
    `advertised`: the producer's ``__dlpack_device__()`` if already asked.
    `resolve`: (obj, copy) -> (obj, copied), what the producer's library
    leaves lazy resolved once its device is known (peers.resolve).
    `host_device`: the CPU device that views host memory (kDLCPU), which
    belongs to no device in particular; default the CPU device of the
    producer's id, as stock places it."""
    if type(x) is CapsuleType:
        cap, stream, resolved = x, None, False  # the protocol's raw capsule: its data is written
    else:
        if advertised is None:
            advertised = _advertised(x)
        cap, stream, resolved = _capsule_of(x, advertised, copy, resolve)
    # One native call: BufferError for a consumed capsule, a newer major
    # version or a tensor no consumer can read; a versioned capsule comes back
    # as a legacy one jaxlib reads.  READ_ONLY needs nothing: JAX never writes
    # to an imported buffer, short of donating it (see the README).
    try:
        plan = ext.plan_dlpack_import(cap)
    except BufferError as e:  # jaxlib's own reading of the capsule: its runtime error
        raise like_stock(e, JaxRuntimeError) from None
    cap, view = plan.capsule, plan.view
    copied = bool(plan.flags & ext.FLAG_IS_COPIED) or resolved
    # Before jaxlib sees it: a dtype it cannot read would come back as its
    # RuntimeError.  The refused capsule's destructor frees the tensor.
    dtype = _dtype(*view.dtype)
    # Producers may advertise a type their capsule does not carry (PyTorch's
    # pinned tensors say kDLCUDAHost and ship kDLCPU): the advertised one is
    # where the memory is.
    dl_type, dl_id = advertised or (plan.device_type, plan.device_id)
    if dl_type in _HOST_TYPES and plan.device_type in (KDLCUDA, KDLCUDAMANAGED):
        # Host memory advertised for a device pointer: read by the host as
        # advertised, it faults the process (a wrapper advertising (kDLCPU,
        # 0) over CuPy's device memory crashed the overlay's import on the
        # H100, 2026-12-05).  Refused; the capsule's deleter runs.
        ext.release_capsule(cap)
        raise like_stock(BufferError(
            f"the producer's __dlpack_device__() says {(int(dl_type), int(dl_id))} "
            f"({_NAMES.get(dl_type, dl_type)}), but its capsule holds "
            f"{_NAMES[plan.device_type]} memory {(plan.device_type, plan.device_id)}: one of "
            "them is wrong, and reading the memory as the other would fault; fix the "
            "producer's __dlpack_device__"), JaxRuntimeError)
    _check_type(dl_type)
    if view.numel == 0:
        ext.release_capsule(cap)
        return _empty(view.shape, dtype, dl_type, dl_id, host_device), copied
    if dl_type == KDLCUDA or dl_type == KDLCUDAMANAGED:
        # Device or managed memory: both are device memory to JAX.
        device, jax_type = _gpu_target(dl_id)[0], KDLCUDA
    elif dl_type == KDLCUDAHOST:
        device, jax_type = rt.gpu_device(dl_id), KDLCUDAHOST
    else:
        device, jax_type = host_device or rt.cpu_device(dl_id) or rt.host_device(), KDLCPU
    # On the host jaxlib copies unaligned memory itself, as stock does: no rule.
    alignment = 1 if jax_type == KDLCPU else view_alignment(jax_type)
    if view.layout != "strided" and view.data % alignment == 0:
        # On the host jaxlib copies unaligned memory itself unless told not to.
        jax_copy = False if copy is False and jax_type != KDLCUDA else None
        arr = _view.import_view(cap, device, jax_copy, jax_type, stream)
        pinned_copy = jax_type == KDLCUDAHOST and not rt.PINNED_VIEW
        return arr, copied or pinned_copy
    out = _view.copy_import(cap, view, dtype, jax_type, dl_id if dl_type != KDLCPU else 0,
                            device, alignment=alignment, copy=copy, stream=stream)
    return out, True


def _advertised(x):
    """The producer's ``__dlpack_device__()``; TypeError for an object that
    is no DLPack producer."""
    if getattr(x, "__dlpack_device__", None) is None or not hasattr(x, "__dlpack__"):
        raise TypeError(
            f"{type(x).__module__}.{type(x).__qualname__} has no __dlpack__ "
            "and __dlpack_device__; pass an array of a DLPack producer or a "
            "DLPack capsule")
    return device_of(x)


def _capsule_of(x, advertised, copy, resolve):
    """(capsule, the ready stream it is ordered on or None, resolved): the
    producer's capsule, asked for as the protocol says, with stock's checks
    first (the device type, then the device lookup)."""
    _check_type(advertised[0])
    # Stock looks the device up before it asks the producer: its error for
    # a device this process lacks comes first, not the producer's.
    stock_device(*advertised)
    resolved = False
    # A lazy view (PyTorch exports a negative view's memory unnegated):
    # resolved first, and the capsule then holds the resolved copy.
    if resolve is not None:
        x, resolved = resolve(x, copy)
    stream = _producer_stream(*advertised)
    if stream is None or not _gpu_target(advertised[1])[1]:
        return _request(x, stream, copy), stream, resolved
    # The producer's device is made current for the call: PyTorch's and
    # CuPy's __dlpack__ order the consumer stream after the *current
    # device's* current stream, so a caller with another device current
    # would get an order after the wrong device's work.
    return ext.call_on_device(advertised[1], _request, x, stream, copy), stream, resolved


def _empty(shape, dtype, dl_type, dl_id, host_device):
    device = (host_device or rt.cpu_device(dl_id) or rt.host_device() if dl_type == KDLCPU
              else rt.gpu_device(dl_id))
    return _view.empty_at(shape, dtype, dl_type, device)
