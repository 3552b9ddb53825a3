"""DLPack import: the same capsule path as the CAI import, for any producer
of ``__dlpack__`` (or a raw capsule), asking for DLPack 1.x."""

from __future__ import annotations

import datetime

import jax
import ml_dtypes
import numpy as np

from . import _exports
from . import _imports
from . import _runtime as rt
from . import _xla_ext as ext

KDLCPU, KDLCUDA, KDLCUDAHOST, KDLCUDAMANAGED = 1, 2, 3, 13
_NAMES = {KDLCPU: "kDLCPU", KDLCUDA: "kDLCUDA", KDLCUDAHOST: "kDLCUDAHost",
          KDLCUDAMANAGED: "kDLCUDAManaged"}
MAX_VERSION = tuple(ext.DLPACK_VERSION)
# types.CapsuleType exists from Python 3.13 on; datetime's C API is a capsule.
CapsuleType = type(datetime.datetime_CAPI)


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
        raise BufferError(
            f"the DLPack dtype (code {code}, bits {bits}, lanes {lanes}) cannot be "
            f"imported: {why}; JAX holds bool, (u)int8-64, float16-64, "
            "complex64/128, bfloat16 and float8 types: convert the tensor first")
    return dtype


def device_of(x):
    """(device_type, device_id) from ``x.__dlpack_device__()``, which the
    protocol says is a pair of ints; anything else is a TypeError naming
    what came back (unpacking it blindly gave 'not enough values')."""
    dev = x.__dlpack_device__()
    pair = _exports.int_pair(dev)
    if pair is None:
        raise TypeError(
            f"{type(x).__module__}.{type(x).__qualname__}.__dlpack_device__() returned "
            f"{dev!r}; the DLPack protocol asks for a tuple (device_type: int, "
            "device_id: int)")
    return pair


def _check_type(dl_type):
    if dl_type not in _NAMES:
        raise BufferError(
            f"DLPack device type {dl_type} is not one JAX can hold; jax_overlay "
            "imports kDLCPU (1), kDLCUDA (2), kDLCUDAHost (3) and "
            "kDLCUDAManaged (13): copy the array to one of those first")


def _request(x, stream, copy):
    """Asks for a versioned capsule; producers that predate the 2023 Array
    API (no max_version/copy keywords) raise TypeError and get the legacy
    call, as the protocol says.  Only copy=False is passed on: a copy is
    made on JAX's side (CuPy's __dlpack__ refuses copy=True on the GPU)."""
    kwargs = {"stream": stream, "max_version": MAX_VERSION}
    if copy is False:
        kwargs["copy"] = False
    try:
        return x.__dlpack__(**kwargs)
    except TypeError:
        return x.__dlpack__(stream=stream)


def _producer_stream(dl_type, dl_id):
    """The consumer stream handed to the producer.  For GPU memory it is
    XLA's compute stream: the producer makes it wait for its pending work,
    and jaxlib's import then records the array's definition event behind
    that wait, so the host never waits (see _runtime.compute_stream).
    Pinned and CPU producers get None: PyTorch's pinned tensors go through
    its CPU __dlpack__, which rejects a stream."""
    if dl_type in (KDLCUDA, KDLCUDAMANAGED):
        return rt.compute_stream(rt.gpu_device(dl_id))
    return None


def import_dlpack(x, *, copy=None, advertised=None):
    """(array, copied) for a ``__dlpack__`` producer or a raw capsule.
    `advertised`: the producer's ``__dlpack_device__()`` if already asked."""
    if isinstance(x, CapsuleType):
        cap = x
    else:
        if advertised is None:
            if not hasattr(x, "__dlpack__") or not hasattr(x, "__dlpack_device__"):
                raise TypeError(
                    f"{type(x).__module__}.{type(x).__qualname__} has no __dlpack__ "
                    "and __dlpack_device__; pass an array of a DLPack producer or a "
                    "DLPack capsule")
            advertised = device_of(x)
        dl_type, dl_id = advertised
        _check_type(dl_type)
        cap = _request(x, _producer_stream(dl_type, dl_id), copy)
    info = ext.capsule_info(cap)  # BufferError for a consumed capsule
    copied = False
    if info["versioned"]:
        major, minor = info["version"]
        if major > MAX_VERSION[0]:
            # The protocol: a consumer that cannot read the tensor frees it.
            ext.release_capsule(cap)
            raise BufferError(
                f"the producer returned a DLPack {major}.{minor} tensor; "
                f"jax_overlay reads up to {MAX_VERSION[0]}.x")
        copied = bool(info["flags"] & ext.FLAG_IS_COPIED)
        # READ_ONLY needs nothing: JAX never writes to an imported buffer,
        # short of donating it (see the README).
        cap = ext.versioned_to_legacy(cap)
    # Before jaxlib sees it: a dtype it cannot read would come back as its
    # RuntimeError.  The refused capsule's destructor frees the tensor.
    dtype = _dtype(*info["dtype"])
    # Producers may advertise a type their capsule does not carry (PyTorch's
    # pinned tensors say kDLCUDAHost and ship kDLCPU): the advertised one is
    # where the memory is.
    dl_type, dl_id = advertised or info["device"]
    _check_type(dl_type)
    if info["numel"] == 0:
        ext.release_capsule(cap)
        return _empty(info["shape"], dtype, dl_type, dl_id), copied
    if dl_type == KDLCPU:
        device, jax_type, alignment = rt.host_device(), KDLCPU, 1
    elif dl_type == KDLCUDAHOST:
        device, jax_type, alignment = rt.gpu_device(dl_id), KDLCUDAHOST, 1
    else:  # device or managed memory: both are device memory to JAX
        device, jax_type, alignment = rt.gpu_device(dl_id), KDLCUDA, 16
    if info["layout"] != "strided" and info["data"] % alignment == 0:
        # On the host jaxlib copies unaligned memory itself unless told not to.
        jax_copy = False if copy is False and dl_type in (KDLCPU, KDLCUDAHOST) else None
        arr = _imports.import_view(cap, device, jax_copy, jax_type)
        pinned_copy = jax_type == KDLCUDAHOST and not rt.PINNED_VIEW
        return arr, copied or pinned_copy
    out = _imports.copy_import(
        cap, info["data"], info["shape"], info["strides"], dtype,
        info["itemsize"], info["low"], info["span"], info["layout"], alignment,
        jax_type, dl_id if dl_type != KDLCPU else 0, device, 0, copy)
    return out, True


def _empty(shape, dtype, dl_type, dl_id):
    host = np.empty(shape, dtype)
    if dl_type == KDLCPU:
        return rt.device_put(host, rt.host_device())
    kind = "pinned_host" if dl_type == KDLCUDAHOST else "device"
    return rt.device_put(host, rt.memory_sharding(rt.gpu_device(dl_id), kind))


def from_dlpack(x, /, *, device=None, copy=None):
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
    * Strided or misaligned tensors: one copy on the same device
      (BufferError with ``copy=False``); ``device=`` and ``copy=True`` as in
      :func:`from_cuda_array_interface`.
    """
    if isinstance(device, jax.sharding.Sharding) and len(device.device_set) != 1:
        raise ValueError(
            f"device={device} spans {len(device.device_set)} devices; from_dlpack "
            "imports one buffer: pass one device, then jax.device_put the result "
            "onto the sharding")
    arr, copied = import_dlpack(x, copy=copy)
    return _imports.finish(arr, copied, device=device, copy=copy)
