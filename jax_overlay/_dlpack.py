"""DLPack import: the same capsule path as the CAI import, for any producer
of ``__dlpack__`` (or a raw capsule), asking for DLPack 1.x."""

from __future__ import annotations

import functools
from typing import Any

import jax
import ml_dtypes
import numpy as np

from . import _exports
from . import _imports
from . import _runtime as rt
from . import _xla_ext as ext
from .errors import JaxRuntimeError, like_stock

KDLCPU, KDLCUDA, KDLCUDAHOST, KDLCUDAMANAGED = 1, 2, 3, 13
_NAMES = {KDLCPU: "kDLCPU", KDLCUDA: "kDLCUDA", KDLCUDAHOST: "kDLCUDAHost",
          KDLCUDAMANAGED: "kDLCUDAManaged"}
MAX_VERSION = tuple(ext.DLPACK_VERSION)
CapsuleType = _exports.CapsuleType


def _holdable_dtypes():
    """DLPack (code, bits, lanes) -> the NumPy dtype of every type JAX holds,
    from the export's own table, so both directions agree on every code."""
    cands = list(_exports._CAI_DTYPES) + [
        np.dtype(getattr(ml_dtypes, name)) for name in _exports._DL_NAMED_CODES
        if hasattr(ml_dtypes, name)]
    return {_exports._dl_dtype(d): d for d in cands}


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
    _exports.bad_device."""
    dev = x.__dlpack_device__()
    pair = _exports.device_pair(dev)
    if pair is None:
        raise _exports.bad_device(
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
    (_refused_by_stock_as), the overlay imports them."""
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


def _refused_by_stock_as(x):
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
    """(JAX device, XLA's compute stream, whether the producer's device must
    be made current for its __dlpack__) of CUDA device `dl_id`, cached.  With
    one GPU it is current whenever any is."""
    target = _gpu_targets.get(dl_id)
    if target is None:
        device = rt.gpu_device(dl_id)
        target = _gpu_targets[dl_id] = (device, rt.compute_stream(device),
                                        ext.device_count() > 1)
    return target


def _producer_stream(dl_type, dl_id):
    """The consumer stream handed to the producer.  For GPU memory it is
    XLA's compute stream: the producer makes it wait for its pending work,
    and jaxlib's import then records the array's definition event behind
    that wait, so the host never waits (see _runtime.compute_stream).
    Pinned and CPU producers get None: PyTorch's pinned tensors go through
    its CPU __dlpack__, which rejects a stream."""
    if dl_type == KDLCUDA or dl_type == KDLCUDAMANAGED:
        return _gpu_target(dl_id)[1]
    return None


def import_dlpack(x, *, copy=None, advertised=None, host_device=None):
    """(array, copied) for a ``__dlpack__`` producer or a raw capsule.
    `advertised`: the producer's ``__dlpack_device__()`` if already asked.
    `host_device`: the CPU device that views host memory (kDLCPU), which
    belongs to no device in particular; default the CPU device of the
    producer's id, as stock places it."""
    resolved = False
    if type(x) is CapsuleType:
        cap = x
    else:
        if advertised is None:
            device = getattr(x, "__dlpack_device__", None)
            if device is None or not hasattr(x, "__dlpack__"):
                raise TypeError(
                    f"{type(x).__module__}.{type(x).__qualname__} has no __dlpack__ "
                    "and __dlpack_device__; pass an array of a DLPack producer or a "
                    "DLPack capsule")
            advertised = device_of(x)
        _check_type(advertised[0])
        # Stock looks the device up before it asks the producer: its error
        # for a device this process lacks comes first, not the producer's.
        stock_device(*advertised)
        # PyTorch exports a lazy negative view's memory unnegated: resolved
        # first, and the capsule then holds the resolved copy.
        x, resolved = _imports.resolve_lazy(x, copy)
        stream = _producer_stream(*advertised)
        if stream is None or not _gpu_target(advertised[1])[2]:
            cap = _request(x, stream, copy)
        else:
            # The producer's device is made current for the call: PyTorch's
            # and CuPy's __dlpack__ order the consumer stream after the
            # *current device's* current stream, so a caller with another
            # device current would get an order after the wrong device's work.
            cap = ext.call_on_device(advertised[1], _request, x, stream, copy)
    # One native call: BufferError for a consumed capsule, a newer major
    # version or a tensor no consumer can read; a versioned capsule comes back
    # as a legacy one jaxlib reads.  READ_ONLY needs nothing: JAX never writes
    # to an imported buffer, short of donating it (see the README).
    try:
        cap, view, cap_type, cap_id, flags = ext.plan_dlpack_import(cap)
    except BufferError as e:  # jaxlib's own reading of the capsule: its runtime error
        raise like_stock(e, JaxRuntimeError) from None
    copied = bool(flags & ext.FLAG_IS_COPIED) or resolved
    # Before jaxlib sees it: a dtype it cannot read would come back as its
    # RuntimeError.  The refused capsule's destructor frees the tensor.
    dtype = _dtype(*view.dtype)
    # Producers may advertise a type their capsule does not carry (PyTorch's
    # pinned tensors say kDLCUDAHost and ship kDLCPU): the advertised one is
    # where the memory is.
    dl_type, dl_id = advertised or (cap_type, cap_id)
    _check_type(dl_type)
    if view.numel == 0:
        ext.release_capsule(cap)
        return _empty(view.shape, dtype, dl_type, dl_id, host_device), copied
    if dl_type == KDLCUDA or dl_type == KDLCUDAMANAGED:
        # Device or managed memory: both are device memory to JAX.
        device, jax_type, alignment = _gpu_target(dl_id)[0], KDLCUDA, 16
    elif dl_type == KDLCUDAHOST:
        device, jax_type, alignment = rt.gpu_device(dl_id), KDLCUDAHOST, 1
    else:
        device, jax_type, alignment = host_device or rt.cpu_device(dl_id) or rt.host_device(), KDLCPU, 1
    if view.layout != "strided" and view.data % alignment == 0:
        # On the host jaxlib copies unaligned memory itself unless told not to.
        jax_copy = False if copy is False and jax_type != KDLCUDA else None
        arr = _imports.import_view(cap, device, jax_copy, jax_type)
        pinned_copy = jax_type == KDLCUDAHOST and not rt.PINNED_VIEW
        return arr, copied or pinned_copy
    out = _imports.copy_import(
        cap, view.data, view.shape, view.strides, dtype,
        view.itemsize, view.low, view.span, view.layout, alignment,
        jax_type, dl_id if dl_type != KDLCPU else 0, device, 0, copy)
    return out, True


def _empty(shape, dtype, dl_type, dl_id, host_device):
    host = np.empty(shape, dtype)
    if dl_type == KDLCPU:
        target = host_device or rt.cpu_device(dl_id) or rt.host_device()
    else:
        kind = "pinned_host" if dl_type == KDLCUDAHOST else "device"
        target = rt.memory_sharding(rt.gpu_device(dl_id), kind)
    with rt.x64(True):  # the producer's dtype, as a view of it would have
        return rt.device_put(host, target)


_GPU_TYPES = frozenset({KDLCUDA, KDLCUDAHOST, KDLCUDAMANAGED})

# The cheaper of the two routes, where both give the same array.  A
# producer that offers both protocols is imported through its CUDA Array
# Interface when the CAI describes the array exactly and orders it as its
# __dlpack__ would: the CAI import skips the producer's capsule (PyTorch's
# __dlpack__ alone took 16.6 us on the H200; the whole CAI import of a
# PyTorch tensor 9.3 us) and sidesteps capsules that contradict the CAI
# (CuPy 14.2's __dlpack__ of a reversed view has a stride of 2**62 - 1).
# Everything else (pinned or host memory, bfloat16, a CAI that raises,
# tensors requiring grad) takes DLPack.  A reader per producer type: it
# returns (owner, CAI dict, copied) to import, or None for DLPack.
_cai_readers: dict[type, object] = {}
_DLPACK = None


def _cai_v3(obj, copy):
    """A producer's own CAI when it is version 3 with a stream: the order
    its __dlpack__ would give (CuPy's: its current stream for both)."""
    try:
        cai = obj.__cuda_array_interface__
    except Exception:  # no CUDA memory, a dtype it cannot describe, ...
        return None
    if type(cai) is not dict or cai.get("version", 0) < 3 or cai.get("stream") is None:
        return None
    return obj, cai, False


@functools.cache
def _torch_facts():
    """(current raw stream of a device, the NumPy dtype of each PyTorch
    dtype its CAI describes exactly)."""
    import torch
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is None:  # a PyTorch without the raw accessor
        def get(index):
            return torch.cuda.current_stream(index).cuda_stream
    exact = {getattr(torch, name): np.dtype(name) for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "float16",
        "float32", "float64", "complex64", "complex128")}
    return get, exact


def _cai_torch(t, copy):
    """A PyTorch CUDA tensor's CAI, ordered as its __dlpack__ orders: after
    the current stream of the tensor's device.  PyTorch exports CAI version
    2 with no stream, so the stream is added here.  None (DLPack) for what
    the CAI would refuse or get wrong: tensors requiring grad, and any dtype
    whose type string is not exactly its own (bfloat16 is exported as
    '<f2').  A conjugate or negative view is resolved first
    (_imports.resolve_lazy), on either route."""
    if not t.is_cuda or t.requires_grad:
        return None
    stream_of, exact = _torch_facts()
    want = exact.get(t.dtype)
    if want is None:
        return None
    t, copied = _imports.resolve_lazy(t, copy)
    try:
        cai = t.__cuda_array_interface__
    except Exception:
        return None
    if cai.get("typestr") != want.str:
        return None
    stream = stream_of(t.get_device())
    cai["version"] = 3
    cai["stream"] = stream if stream else 1  # PyTorch's 0 is the legacy stream
    return t, cai, copied


def _reader(t):
    reader = _cai_readers.get(t, 0)
    if reader == 0:
        if t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter"):
            reader = _cai_torch
        elif issubclass(t, np.ndarray) and t.__dlpack_device__ is np.ndarray.__dlpack_device__:
            # A NumPy array that is also CUDA memory (Numba's mapped and
            # managed arrays): its __dlpack__ is NumPy's, host memory, so
            # from_dlpack gives a host array as stock's does; the entry
            # points that read the CAI first say so (import_foreign).
            reader = _DLPACK
        elif hasattr(t, "__cuda_array_interface__") and hasattr(t, "__dlpack__"):
            reader = _cai_v3
        else:
            reader = _DLPACK
        _cai_readers[t] = reader
    return reader


def cai_route(obj, copy=None):
    """(owner, CAI dict, copied) to import `obj` through, or None for
    DLPack (or for an object with one protocol only).  The owner is what
    the import holds alive: `obj`, or the copy the producer made of it
    (BufferError where copy=False forbids that copy)."""
    reader = _reader(type(obj))
    return None if reader is None else reader(obj, copy)


def _import_route(route, copy):
    owner, cai, copied = route
    arr, fresh = _imports.import_cai(owner, cai, copy=copy)
    return arr, fresh or copied


def _import(x, copy, host_device=None):
    """(array, copied) of a DLPack producer by its cheapest safe route (see
    cai_route): its CAI where that gives the same array, else DLPack."""
    route = cai_route(x, copy)
    if route is not None:
        return _import_route(route, copy)
    return import_dlpack(x, copy=copy, host_device=host_device)


def import_foreign(obj, copy, host_device=None, cai_first=False):
    """(array, copied) for a foreign array by its cheapest safe route: its
    CUDA Array Interface where cai_route() says so, else DLPack when the
    object has it, else its CAI; None when it has neither.

    Host memory (kDLCPU) is viewed on `host_device`; without one it gives
    None, and so does a DLPack device type jax_overlay cannot hold that has
    no CAI either: the caller's own path (JAX's, after install()) takes
    those.  With `host_device` such a type raises BufferError naming it.
    `cai_first`: the caller stands in for an entry point whose stock path
    reads a CAI before anything else (jnp.asarray, jnp.array), so a host
    producer that also has a CAI is imported through it, as stock does,
    but holding the producer."""
    route = cai_route(obj, copy)
    if route is not None:
        return _import_route(route, copy)
    dlpack_device = getattr(obj, "__dlpack_device__", None)
    if dlpack_device is not None and hasattr(obj, "__dlpack__"):
        try:
            dl_type, dl_id = device_of(obj)
        except Exception:
            if host_device is not None:
                raise
            # Stock's jnp.asarray, jnp.array and jax.device_put never ask for
            # __dlpack_device__: where it raises (PyTorch's, for a negative
            # view of bool) the object is theirs, as on stock, unless a CAI
            # says otherwise.
            dl_type = dl_id = None
        if dl_type in _GPU_TYPES or host_device is not None:
            return import_dlpack(obj, copy=copy, advertised=(dl_type, dl_id),
                                 host_device=host_device)
        if dl_type == KDLCPU and not cai_first:
            return None  # the caller's host path; with cai_first, its CAI if it has one
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        return None
    return _imports.import_cai(obj, cai, copy=copy)


def _cpu_target(device):
    """The CPU device `device=` names, if it names exactly one."""
    if isinstance(device, jax.sharding.Sharding):
        if len(device.device_set) != 1:
            return None
        device, = device.device_set
    return device if getattr(device, "platform", None) == "cpu" else None


def from_dlpack(x: Any, /, *, device: jax.Device | jax.sharding.Sharding | None = None,
                copy: bool | None = None) -> jax.Array:
    """A :class:`jax.Array` from any DLPack producer (``__dlpack__``) or a raw
    capsule, per the Array API's ``from_dlpack``.

    * Asks for DLPack 1.x (``max_version=(1, 1)``) and falls back to the
      legacy call for older producers; versioned capsules are converted
      natively, so this works on jaxlib versions that read legacy capsules
      only.  READ_ONLY tensors (read-only NumPy arrays) import zero-copy.
    * Device types kDLCPU, kDLCUDA, kDLCUDAHost (a ``pinned_host`` array) and
      kDLCUDAManaged (a device array); anything else raises BufferError.
    * GPU producers order JAX's compute stream after their pending work: the
      host never waits.
    * Placed on the device that owns the memory: the GPU of the
      producer's ``__dlpack_device__``, whatever device is current (the
      producer's ``__dlpack__`` is called with its own device current).
      Host memory (kDLCPU) belongs to every CPU device: ``device=`` a CPU
      device views it there (stock JAX copies it there), else it lands on
      the CPU device of the producer's id, as on stock.
    * Strided or misaligned tensors: one copy on the same device
      (BufferError with ``copy=False``); ``device=`` and ``copy=True`` as in
      :func:`from_cuda_array_interface`.
    """
    try:
        if device is None:  # the common call, without the checks below
            arr, copied = _import(x, copy)
            return _imports.finish(arr, copied, copy=copy)
        if isinstance(device, jax.sharding.Sharding) and len(device.device_set) != 1:
            raise ValueError(
                f"device={device} spans {len(device.device_set)} devices; from_dlpack "
                "imports one buffer: pass one device, then jax.device_put the result "
                "onto the sharding")
        arr, copied = _import(x, copy, _cpu_target(device))
        return _imports.finish(arr, copied, device=device, copy=copy)
    except (BufferError, ValueError, TypeError, RuntimeError) as e:
        stock = _refused_by_stock_as(x)
        if stock is None or isinstance(e, stock):
            raise
        raise like_stock(e, stock) from e.__cause__
