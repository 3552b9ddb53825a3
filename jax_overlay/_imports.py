"""The one import path: a foreign array becomes a DLPack capsule built by the
native core (which holds the producer alive until JAX really frees the
buffer), ordered after the producer's stream on the GPU, and handed to
jaxlib's DLPack import."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from . import _exports
from . import _runtime as rt
from . import _strided
from . import _xla_ext as ext
from ._config import config
from .errors import CopyRequiredError, JaxRuntimeError, LayoutCopyRequiredError, like_stock

_KDLCPU, _KDLCUDA, _KDLCUDAHOST = 1, 2, 3


def _cai_dict(obj):
    try:
        return obj.__cuda_array_interface__
    except AttributeError:
        raise TypeError(
            f"{type(obj).__module__}.{type(obj).__qualname__} has no "
            "__cuda_array_interface__; pass a GPU array from CuPy, Numba, "
            "PyTorch or another producer of the CUDA Array Interface") from None


# Per type: whether it is a PyTorch tensor type (Tensor, Parameter or a
# subclass), found by name so that PyTorch is never imported here.
_TORCH_TYPES: dict[type, bool] = {}


def resolve_lazy(obj, copy):
    """(obj, copied): a PyTorch tensor whose conj() or neg view is still
    lazy, a bit on the tensor over memory left as it was, resolved first by
    PyTorch (a copy on its current stream, which the import then holds and
    orders after).  Neither protocol carries the bit: the CAI omits it, and
    __dlpack__ refuses the conjugate bit but exports a negative view's
    memory as it is, so ``x.conj().imag`` read the values with the wrong
    sign (PyTorch 2.14: its own from_dlpack too).  copy=False cannot have
    the copy: LayoutCopyRequiredError, an instance of every class stock
    raises for such tensors (PyTorch's BufferError for the conjugate,
    jaxlib's runtime error for a strided view)."""
    t = type(obj)
    torch_type = _TORCH_TYPES.get(t)
    if torch_type is None:
        torch_type = _TORCH_TYPES[t] = any(
            c.__name__ == "Tensor" and c.__module__ == "torch" for c in t.__mro__)
    if not torch_type or not (obj.is_conj() or obj.is_neg()) or obj.numel() == 0:
        return obj, False  # a zero-size view has no values for the bit to change
    bit, test = ("conjugate", "is_conj") if obj.is_conj() else ("negative", "is_neg")
    if copy is False:
        raise LayoutCopyRequiredError(
            f"Specified input which requires a copy since the PyTorch tensor has "
            f"its lazy {bit} bit set ({test}() is True): its memory holds the "
            "values before that view, and neither __dlpack__ nor "
            "__cuda_array_interface__ carries the bit, so only a resolved copy "
            "reads right. However copy=False. Call tensor.resolve_conj()."
            "resolve_neg() first, or set copy=True or copy=None.")
    try:
        return obj.resolve_conj().resolve_neg(), True
    except RuntimeError as e:  # no negation in PyTorch for bool, uint16-64, float8
        raise like_stock(BufferError(
            f"the PyTorch tensor ({obj.dtype}) has its lazy {bit} bit set, and PyTorch "
            f"cannot resolve it ({type(e).__name__}: {e}); its memory alone does not "
            "hold its values, so it is not imported: convert it to a dtype PyTorch "
            "negates first"), JaxRuntimeError) from e


# Tests set this to run the whole path on host memory (kDLCPU, no driver).
_host_memory = False


def _order(view, ordinal, device):
    """Makes JAX's compute stream wait, on the GPU, for the work already
    enqueued on the producer's stream.  jaxlib's import (without a stream)
    then records the array's definition event on that same stream, behind
    the wait: the array is defined only once the producer is done, and no
    host thread ever waits for it."""
    ext.order_after(ordinal, view.stream, rt.compute_stream(device))


def _empty(view, host):
    kind, dev = "device", None
    if host:
        dev = rt.host_device()
    elif view.data:
        # A zero-size slice still points into its allocation: the GPU that
        # owns it, not the current or the first one.
        mem, ordinal = ext.pointer_info(view.data)[:2]
        if mem != "not_cuda":
            dev = rt.gpu_device(ordinal)
            kind = "pinned_host" if mem == "pinned_host" else "device"
    if dev is None:
        # A null pointer (CuPy's and PyTorch's zero-size arrays) belongs to
        # no device: JAX's first GPU; device= places it elsewhere.
        dev = rt.gpu_backend().local_devices()[0]
    host_array = np.empty(view.shape, np.dtype(view.typestr))
    with rt.x64(True):  # the producer's dtype, as a view of it would have
        return rt.device_put(host_array, rt.memory_sharding(dev, kind))


def import_cai(obj, cai=None, *, copy=None, host=None):
    """(array, copied): a JAX view of `obj`'s memory, or one copy on the same
    device when the layout or alignment rules out a view (copy=False then
    raises BufferError)."""
    host = _host_memory if host is None else host
    cap, view, dl_type, ordinal, range_start, alignment, busy = ext.plan_cai_import(
        _cai_dict(obj) if cai is None else cai, obj, host)
    if cap is None and view.numel == 0:
        return _empty(view, host), False
    device = rt.host_device() if host else rt.gpu_device(ordinal)
    if busy:
        _order(view, ordinal, device)
    if cap is not None:
        arr = import_view(cap, device, False if copy is False else None, dl_type)
        return arr, dl_type == _KDLCUDAHOST and not rt.PINNED_VIEW

    return copy_import(obj, view.data, view.shape, view.strides, view.typestr,
                       view.itemsize, view.low, view.span, view.layout, alignment,
                       dl_type, ordinal, device, range_start, copy), True


def import_view(cap, device, copy, dl_type):
    """jaxlib's import of a capsule a view can hold, for every import path.
    Its own refusals come back as jaxlib's runtime error: the two a
    producer's tensor can cause become the BufferError the protocols ask
    for (jaxlib views host memory only when 64-byte aligned, so copy=False
    on a less aligned host array is one of them)."""
    try:
        return rt.capsule_to_array(cap, device, None, copy, dl_type)
    except Exception as e:  # jaxlib's runtime error type
        if "aligned" in str(e):
            # Stock JAX's words and class (ValueError), and the protocol's.
            raise CopyRequiredError(
                "Specified input which requires a copy since the source data "
                f"buffer is not aligned as jaxlib needs ({e}). However "
                "copy=False, and jax_overlay cannot import the array without a "
                "copy. Set copy=True or copy=None to perform the requested "
                "operation.") from None
        if "DLPack" in str(e):  # e.g. a float8 code this jaxlib predates
            raise BufferError(f"this jaxlib cannot import the tensor: {e}") from None
        raise


def copy_import(owner, data, shape, strides, dtype, itemsize, low, span,
                layout, alignment, dl_type, ordinal, device, range_start, copy):
    """One copy on the same device of an array no view can hold (strided, or
    a misaligned pointer), for every import path: the producer's memory is
    viewed as one zero-copy envelope that holds `owner` alive, and one XLA
    gather writes the compact result.  `dtype`: a NumPy dtype or type
    string (bfloat16 and float8 have no string).  BufferError when
    copy=False."""
    # A misaligned compact GPU array with copy=False: stock JAX returns a
    # view that XLA's kernels may refuse ("Address of buffer ... must be a
    # multiple of 16") or misread; one aligned copy instead, unless
    # config.strict_copy asks for the refusal the Array API prescribes.
    if copy is False and (layout == "strided" or dl_type == _KDLCPU or config.strict_copy):
        why = ("its strides are not a compact layout (jaxlib views only "
               "trivial (compact) striding)" if layout == "strided"
               else f"its pointer {data:#x} is not {alignment}-byte aligned")
        raise LayoutCopyRequiredError(
            f"Specified input which requires a copy since {why} (shape "
            f"{shape}, strides {strides} elements). However copy=False, and "
            "jax_overlay cannot import the array without a copy. Set copy=True "
            "or copy=None for one copy on the same device.")
    dtype = np.dtype(dtype)
    range_size = 0
    if dl_type != _KDLCPU:
        # The allocation the pointer lies in: no envelope may leave it.
        range_start, range_size = ext.pointer_info(data)[4:6]
    base, count, unit, offset = _strided.plan(
        data, low, span, itemsize, range_start, _strided.GPU_ALIGNMENT, range_size)
    cap = ext.raw_capsule(owner, base, [count], None,
                          _exports._dl_dtype(dtype) if unit == itemsize else "|u1",
                          dl_type, ordinal)
    envelope = rt.capsule_to_array(cap, device, None, None, dl_type)
    pinned = dl_type == _KDLCUDAHOST
    if pinned:
        # XLA computes on device memory: move the envelope once, gather there,
        # and put the compact result back where the producer kept it.
        envelope = rt.device_put(envelope, rt.memory_sharding(device, "device"))
    out = _strided.gather(envelope, device, shape,
                          strides if strides is not None else _row_major(shape),
                          offset, dtype, unit)
    if pinned:
        out = rt.device_put(out, rt.memory_sharding(device, "pinned_host"))
    return out


def _row_major(shape):
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _same_place(arr, device):
    if isinstance(device, jax.sharding.Sharding):
        return arr.sharding == device or (
            arr.sharding.device_set == device.device_set
            and arr.sharding.memory_kind == device.memory_kind
            and device.is_fully_replicated)
    return arr.sharding.device_set == {device}


def place(arr, copied, device, copy):
    """(array, copied) on `device` (a device or a sharding, None for where
    it is): the array itself when it is there, else a copy there;
    BufferError with copy=False."""
    if device is None or _same_place(arr, device):
        return arr, copied
    if copy is False:
        raise CopyRequiredError(
            f"Specified device={device} which requires a copy since the "
            f"source array lives on {arr.sharding}, however copy=False (the "
            "other place needs a copy). Set copy=True or copy=None to perform "
            "the requested operation.")
    return rt.device_put(arr, device), True


def finish(arr, copied, *, device=None, copy=None):
    """Applies the Array API's device/copy rules and JAX's dtype
    canonicalisation to a fresh import."""
    dtype = arr.dtype
    if dtype.itemsize == 8 and dtype.kind != "c" or dtype.itemsize == 16:
        dtype = rt.canonical(dtype)  # only 64-bit types can be narrowed
    if dtype != arr.dtype:
        # Stock JAX converts whatever copy= says; config.strict_copy refuses.
        if copy is False and config.strict_copy:
            raise CopyRequiredError(
                f"the array is {arr.dtype} but JAX is in 32-bit mode, so a "
                f"conversion to {dtype} (a copy) is needed, and copy=False with "
                "jax_overlay.config.strict_copy on forbids it; enable "
                "jax_enable_x64, pass copy=None, or turn strict_copy off")
        arr, copied = arr.astype(dtype), True
    arr, copied = place(arr, copied, device, copy)
    if copy and not copied:
        return rt.device_put(arr, arr.sharding, may_alias=False)
    return arr


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
      already enqueued there.  No stream (v2, or None) means no ordering.
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
    obj, resolved = resolve_lazy(obj, copy)
    arr, copied = import_cai(obj, copy=copy)
    return finish(arr, copied or resolved, device=device, copy=copy)
