"""Room: the import's entry points and its choice of protocol.  An object
from another library is imported by its cheapest safe route: its CUDA
Array Interface where that gives the same array as its ``__dlpack__``
(the peer's rule, else the generic one), else DLPack, else its CAI.  The
public ``from_dlpack`` and ``from_cuda_array_interface`` start here; the
protocols (``_cai``, ``_dlpack``) and the neutral import (``_view``) do
the rest, each called once, downwards."""

from __future__ import annotations

from typing import Any

import jax

from . import _cai
from . import _dlpack
from . import _view
from . import _vocab
from . import peers
from .errors import like_stock

_GPU_TYPES = frozenset({_vocab.KDLCUDA, _vocab.KDLCUDAHOST, _vocab.KDLCUDAMANAGED})

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


def _reader(t):
    reader = _cai_readers.get(t, 0)
    if reader == 0:
        peer = peers.peer_of(t)
        reader = peers.GENERIC if peer is None else peer.cai_reader(t)
        if reader is peers.GENERIC:
            both = hasattr(t, "__cuda_array_interface__") and hasattr(t, "__dlpack__")
            reader = _cai_v3 if both else _DLPACK
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
    arr, fresh = _cai.import_cai(owner, cai, copy=copy)
    return arr, fresh or copied


def _import(x, copy, host_device=None):
    """(array, copied) of a DLPack producer by its cheapest safe route (see
    cai_route): its CAI where that gives the same array, else DLPack."""
    route = cai_route(x, copy)
    if route is not None:
        return _import_route(route, copy)
    return _dlpack.import_dlpack(x, copy=copy, host_device=host_device, resolve=peers.resolve)


def import_peer(obj, copy, host_device=None, cai_first=False):
    """(array, copied) for another library's array by its cheapest safe route: its
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
            dl_type, dl_id = _dlpack.device_of(obj)
        except Exception:
            if host_device is not None:
                raise
            # Stock's jnp.asarray, jnp.array and jax.device_put never ask for
            # __dlpack_device__: where it raises (PyTorch's, for a negative
            # view of bool) the object is theirs, as on stock, unless a CAI
            # says otherwise.
            dl_type = dl_id = None
        if dl_type in _GPU_TYPES or host_device is not None:
            return _dlpack.import_dlpack(obj, copy=copy, advertised=(dl_type, dl_id),
                                         host_device=host_device, resolve=peers.resolve)
        if dl_type == _vocab.KDLCPU and not cai_first:
            return None  # the caller's host path; with cai_first, its CAI if it has one
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        return None
    return _cai.import_cai(obj, cai, copy=copy)


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
    * GPU producers order a PJRT ready stream after their pending work, and
      the array is defined behind it: every reader waits, the host never
      does.
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
    return placed_from_dlpack(x, device, copy, host_view=True)


def placed_from_dlpack(x, device, copy, *, host_view):
    """from_dlpack, for the explicit function (`host_view`: host memory is
    viewed on the CPU device `device` names) and for the installed
    jax.dlpack.from_dlpack and jnp.from_dlpack, which place host memory as
    stock does (on the producer's CPU device, then a copy to `device`: a new
    buffer where stock makes one)."""
    try:
        if device is None:  # the common call, without the checks below
            arr, copied = _import(x, copy)
            return _view.finish(arr, copied, copy=copy)
        if isinstance(device, jax.sharding.Sharding) and len(device.device_set) != 1:
            raise ValueError(
                f"device={device} spans {len(device.device_set)} devices; from_dlpack "
                "imports one buffer: pass one device, then jax.device_put the result "
                "onto the sharding")
        arr, copied = _import(x, copy, _cpu_target(device) if host_view else None)
        return _view.finish(arr, copied, device=device, copy=copy)
    except (BufferError, ValueError, TypeError, RuntimeError) as e:
        stock = _dlpack.refused_by_stock_as(x)
        if stock is None or isinstance(e, stock):
            raise
        raise like_stock(e, stock) from e.__cause__


def from_cuda_array_interface(obj: Any, *,
                              device: jax.Device | jax.sharding.Sharding | None = None,
                              copy: bool | None = None) -> jax.Array:
    """A :class:`jax.Array` over the memory of any object with
    ``__cuda_array_interface__`` (versions 0 to 3).

    * Zero-copy whenever the layout is compact (C order, F order, any
      transposition) and the pointer 16-byte aligned: the result shares the
      producer's memory and keeps the producer alive until JAX frees the
      buffer, including after in-flight computations that read it.
    * Placed on the GPU that owns the pointer; pinned host memory becomes a
      ``pinned_host`` array, managed memory a device array.
    * A v3 ``stream`` (1 legacy, 2 per-thread, or a handle) is honoured on the
      GPU, without blocking the host: the array is ordered after the work
      already enqueued there.  No stream (v2, or None): after the legacy
      default stream, where a synchronous copy's DMA may still be landing.
    * Non-compact strides (sliced, negative, broadcast) or a misaligned
      pointer: one GPU-side copy, or BufferError with ``copy=False``.
    * ``device=``: another device or memory kind copies there (BufferError
      with ``copy=False``); ``copy=True`` always returns a fresh buffer.
    * Like ``jax.dlpack.from_dlpack``, 64-bit data is converted to 32 bits
      unless ``jax_enable_x64`` is set (a copy, even with ``copy=False``, as
      stock JAX does; ``config.strict_copy`` refuses it instead).
    * Refusals of ``copy=False`` raise :class:`CopyRequiredError`, both the
      protocols' ``BufferError`` and stock JAX's ``ValueError``.
    """
    obj, resolved = peers.resolve(obj, copy)
    if resolved:
        # The resolved copy is this call's, enqueued on the library's current
        # stream, which the library's CAI may not name (PyTorch's is version
        # 2): imported by the route that orders after it.
        arr, copied = _import(obj, copy)
    else:
        arr, copied = _cai.import_cai(obj, copy=copy)
    return _view.finish(arr, copied or resolved, device=device, copy=copy)
