"""Room: the protocol-neutral import.  Both protocols' plans (a native
``ArrayView`` of the producer's memory) end here: a zero-copy view through
jaxlib's DLPack import, or one copy on the same device for a layout no view
can hold (``copy_import``), then the Array API's device and copy rules
(``place``, ``finish``).  Nothing here knows which protocol described the
array, or which library made it."""

from __future__ import annotations

import jax
import numpy as np

from . import _runtime as rt
from . import _strided
from . import _xla_ext as ext
from ._config import config
from ._vocab import GPU_ALIGNMENT, KDLCPU, KDLCUDAHOST
from .errors import CopyRequiredError, LayoutCopyRequiredError


def empty(shape, dtype, target):
    """A zero-size array of the producer's dtype on `target` (a device or a
    sharding): no memory to view, nothing to hold."""
    with rt.x64(True):  # the producer's dtype, as a view of it would have
        return rt.device_put(np.empty(shape, dtype), target)


def empty_at(shape, dtype, dl_type, device):
    """The zero-size import of memory of DLPack type `dl_type` on `device`,
    for both protocols: host memory on that CPU device, pinned host memory
    in the GPU's pinned_host memory, device and managed memory in its device
    memory."""
    if dl_type == KDLCPU:
        return empty(shape, dtype, device)
    kind = "pinned_host" if dl_type == KDLCUDAHOST else "device"
    return empty(shape, dtype, rt.memory_sharding(device, kind))


def import_view(cap, device, copy, dl_type, stream=None):
    """jaxlib's import of a capsule a view can hold, for every import path.
    `stream`: None where the producer's data is written, else the ready
    stream (_runtime.ready_stream) already made to wait for the producer:
    the array's definition event is recorded on it, so every reader waits.
    Its own refusals come back as jaxlib's runtime error: the two a
    producer's tensor can cause become the BufferError the protocols ask
    for (jaxlib views host memory only when 64-byte aligned, so copy=False
    on a less aligned host array is one of them)."""
    try:
        return rt.capsule_to_array(cap, device, stream, copy, dl_type)
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


def copy_import(owner, view, dtype, dl_type, ordinal, device, *, alignment, copy,
                range_start=0, stream=None):
    """One copy on the same device of an array no view can hold (strided, or
    a misaligned pointer), for every import path: the producer's memory
    (`view`, an ArrayView) is viewed as one zero-copy envelope that holds
    `owner` alive, and one XLA gather writes the compact result.  `dtype`:
    a NumPy dtype or type string (bfloat16 and float8 have no string).
    `range_start`: the allocation's start, where already known.  `stream`:
    import_view's (the gather reads the envelope only after the producer).
    BufferError when copy=False."""
    data, shape, strides, layout = view.data, view.shape, view.strides, view.layout
    # A misaligned compact GPU array with copy=False: stock JAX returns a
    # view that XLA's kernels may refuse ("Address of buffer ... must be a
    # multiple of 16") or misread; one aligned copy instead, unless
    # config.strict_copy asks for the refusal the Array API prescribes.
    if copy is False and (layout == "strided" or dl_type == KDLCPU or config.strict_copy):
        why = ("its strides are not a compact layout (jaxlib views only "
               "trivial (compact) striding)" if layout == "strided"
               else f"its pointer {data:#x} is not {alignment}-byte aligned")
        raise LayoutCopyRequiredError(
            f"Specified input which requires a copy since {why} (shape "
            f"{shape}, strides {strides} elements). However copy=False, and "
            "jax_overlay cannot import the array without a copy. Set copy=True "
            "or copy=None for one copy on the same device.")
    dtype = np.dtype(dtype)
    itemsize = view.itemsize
    range_size = 0
    if dl_type != KDLCPU:
        # The allocation the pointer lies in: no envelope may leave it.
        info = ext.pointer_info(data)
        range_start, range_size = info.range_start, info.range_size
    base, count, unit, offset = _strided.plan(
        data, view.low, view.span, itemsize, range_start, GPU_ALIGNMENT, range_size)
    # The envelope's element type: the array's own where whole elements fit,
    # else bytes (DLPack's code, bits, lanes; no string names bfloat16).
    cap = ext.raw_capsule(owner, base, [count], None,
                          view.dtype if unit == itemsize else "|u1", dl_type, ordinal)
    envelope = rt.capsule_to_array(cap, device, stream, None, dl_type)
    pinned = dl_type == KDLCUDAHOST
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
