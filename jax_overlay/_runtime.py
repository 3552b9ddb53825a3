"""Room: what the import and export paths need from JAX (devices, their
streams, layouts, the one jaxlib entry point that turns a DLPack capsule
into an array), and what the running jaxlib does natively."""

from __future__ import annotations

import functools
import weakref

import jax
from jax._src import dtypes as _dtypes
from jax._src import xla_bridge as _xb
from jax._src.lib import _jax

from jax._src import lib as _jax_lib
from jax._src.lib import version as _jaxlib_version

from ._vocab import KDLCUDAHOST

ArrayImpl = type(jax.numpy.zeros(()))
# JAX's own device_put, whatever install() later puts in its place.
device_put = jax.device_put

# What the running jaxlib does natively, in one table: each capability with
# the jaxlib extension version that brought it (jax's own gates read the
# same number).  Where stock is already right and safe, the overlay steps
# aside.  Extension versions measured: jaxlib 0.10.1 452, 0.10.2 467, 0.11.2
# 495, 0.12.0.1 505.
NATIVE_SINCE = {
    # dlpack_managed_tensor_to_buffer takes dl_device_type, and with it views
    # of pinned host memory (kDLCUDAHost -> the pinned_host memory space):
    # jaxlib 0.10.2.
    "pinned_view": 467,
    # DLPack 1.x both ways (versioned capsules, READ_ONLY, IS_COPIED,
    # read-only NumPy import): jaxlib 0.12, where jax's DLPACK_VERSION is
    # jaxlib's own.
    "dlpack_1": 499,
}
EXTENSION_VERSION: int = getattr(_jax_lib, "jaxlib_extension_version", 0)
NATIVE = {name: EXTENSION_VERSION >= since for name, since in NATIVE_SINCE.items()}
PINNED_VIEW = NATIVE["pinned_view"]


def _capsule_to_array_before_0_10_2(cap, device, stream, copy, dl_type):
    """jaxlib < 0.10.2 reads no device type and has no pinned_host view:
    pinned memory is viewed by the CPU client, then copied into a
    pinned_host buffer of `device` (BufferError with copy=False)."""
    if dl_type != KDLCUDAHOST:
        return _jax.dlpack_managed_tensor_to_buffer(cap, device, stream, copy)
    if copy is False:
        raise BufferError(
            f"jaxlib {'.'.join(map(str, _jaxlib_version))} cannot view pinned "
            "host memory (kDLCUDAHost), so the import needs a copy; pass "
            "copy=None or copy=True, or upgrade to jax >= 0.10.2 for a "
            "zero-copy pinned_host array")
    # The host view holds the producer until the copy below has read it:
    # PJRT keeps a usage hold on the source buffer for the transfer.
    host = _jax.dlpack_managed_tensor_to_buffer(cap, host_device(), None, None)
    return device_put(host, memory_sharding(device, "pinned_host"))


# jaxlib's DLPack import: (capsule, device, stream, copy, dl_device_type).
# Every import path in this package ends here.
capsule_to_array = (_jax.dlpack_managed_tensor_to_buffer if PINNED_VIEW
                    else _capsule_to_array_before_0_10_2)


@functools.cache
def gpu_backend():
    try:
        return _xb.get_backend("cuda")
    except RuntimeError as e:
        from .errors import NoCudaError
        raise NoCudaError(
            "JAX has no CUDA backend in this process, so it cannot hold GPU "
            "memory; install jax with its CUDA plugin (pip install "
            f"'jax[cuda13]') or keep the array on the host ({e})") from None


_devices: dict[int, object] = {}
_compute_streams: dict[object, int] = {}


def gpu_device(ordinal: int):
    """The JAX device of CUDA device `ordinal` (as libcuda numbers it)."""
    dev = _devices.get(ordinal)
    if dev is None:
        backend = gpu_backend()  # NoCudaError where there is no CUDA backend
        try:
            dev = backend.device_from_local_hardware_id(ordinal)
        except Exception as e:  # jaxlib raises its own runtime error type
            from .errors import like_stock
            # Stock JAX's import asks the same lookup: its class, too.
            raise like_stock(BufferError(
                f"the memory belongs to CUDA device {ordinal}, which JAX does "
                f"not see in this process ({e}); check CUDA_VISIBLE_DEVICES"),
                type(e) if isinstance(e, RuntimeError) else RuntimeError) from None
        _devices[ordinal] = dev
    return dev


def backend(platform: str):
    """JAX's backend of `platform`; its RuntimeError where there is none."""
    return _xb.get_backend(platform)


@functools.cache
def stock_dlpack_platforms() -> dict[int, str]:
    """Stock from_dlpack's and to_dlpack's table: DLPack device type -> JAX
    platform.  A type it lacks is its TypeError (import) or BufferError
    (export); a platform this process has no backend for, its RuntimeError
    ("Unknown backend").  Read from the installed jax (jax 0.10 maps
    kDLCPU, kDLCUDA and kDLROCM; 0.12 also kDLCUDAHost and others)."""
    table = getattr(stock_dlpack(), "_DL_DEVICE_TO_PLATFORM", None) or {1: "cpu", 2: "cuda", 10: "rocm"}
    return {int(k): v for k, v in table.items()}


def stock_dlpack():
    """Stock JAX's DLPack module (its tables and versions), read where the
    overlay's export must ask what the running jax does."""
    from jax._src import dlpack as stock
    return stock


# Where the running jaxlib has DLPack 1.x itself (NATIVE), stock's CPU
# export is right and the overlay steps aside for it (_dlpack.ours).
NATIVE_DLPACK_1 = NATIVE["dlpack_1"]


@functools.cache
def host_device():
    return jax.devices("cpu")[0]


def cpu_device(dl_id):
    """The CPU device a kDLCPU producer's id names, as stock's from_dlpack
    looks it up (host memory of (kDLCPU, 1) lands on cpu:1), or None where
    this process has no such device: stock's lookup fails there, and host
    memory is readable from any CPU device, so the callers view it on the
    first one (host_device) rather than fail."""
    dev = _cpu_devices.get(dl_id) if type(dl_id) is int else None
    if dev is None:
        try:
            dev = _xb.get_backend("cpu").device_from_local_hardware_id(dl_id)
        except Exception:  # jaxlib's runtime error, or its TypeError for a non-int id
            return None
        if type(dl_id) is int:
            _cpu_devices[dl_id] = dev
    return dev


_cpu_devices: dict[int, object] = {}


def compute_stream(device) -> int:
    """XLA's compute stream on `device`, read once through buffer_callback's
    execution context: the stream foreign code runs on, and the one the
    producers of the tests and the doctor hold busy.  Imports are not
    ordered on it (ready_stream says why)."""
    s = _compute_streams.get(device)
    if s is None:
        import numpy as np
        try:
            from jax.experimental.buffer_callback import buffer_callback
        except ImportError:
            raise BufferError(
                f"this jax ({jax.__version__}) has no jax.experimental.buffer_callback, "
                "which jax_overlay needs to order imports after a busy producer "
                "stream; upgrade jax, or pass arrays whose stream is idle") from None

        seen = []

        def grab(ctx, out, x):
            seen.append(int(ctx.stream))

        probe = jax.jit(buffer_callback(
            grab, jax.ShapeDtypeStruct((1,), np.int8), has_side_effect=True))
        probe(jax.device_put(np.zeros(1, np.int8), device)).block_until_ready()
        if not seen or not seen[0]:
            raise BufferError(f"could not read XLA's compute stream on {device}")
        s = _compute_streams[device] = seen[0]
    return s


def ready_stream(device) -> int:
    """The stream an import of a producer still writing is ordered on: one
    of PJRT's external-ready streams (jaxlib hands them out round-robin), as
    stock jax.dlpack.from_dlpack does.  The caller makes it wait for the
    producer with an event and hands it to jaxlib's import (capsule_to_array),
    which records the array's definition event on it behind that wait.
    Every reader waits for that event: computations, np.asarray (PJRT's
    device-to-host streams), copies to other memories, exports.

    Making XLA's compute stream wait and importing with no stream, as
    jax_overlay did before, orders computations only: XLA gives a
    stream-less view no definition event (its CreateViewOfDeviceBuffer
    since mid-2026, as read from its source), so a host read ran on a
    device-to-host stream at once, before the producer's kernel wrote
    (issue 39's stale host reads; benchmarks/probe_hostread.py measures
    both orderings)."""
    return int(device.get_stream_for_external_ready_events())


def order_stream_after(x, stream: int):
    """Makes `stream` wait for the definition of `x` through jaxlib's DLPack
    export (an event wait; the host waits only until the definition event
    exists, i.e. until JAX has enqueued the computation).  Returns jaxlib's
    capsule, unconsumed: it holds a PJRT external reference until freed."""
    return _jax.buffer_to_dlpack_managed_tensor(_holder(x), stream=stream)


def external_reference(x):
    """jaxlib's DLPack capsule of a ready array, kept unconsumed: it holds a
    PJRT external reference (XLA does not reuse the buffer for a donation
    while it lives: PJRT on the GPU refuses, XLA:CPU copies, and from jaxlib
    0.12.1 marks the array donated all the same) and releases it from its
    destructor.  Only for ready arrays: on jaxlib 0.11.2 it waits
    on the host for pending ones."""
    return _jax.buffer_to_dlpack_managed_tensor(_holder(x))


def _holder(x):
    """The array a capsule's PJRT external reference is taken through: its
    single-device shard, a second jax.Array over the same buffer, as stock
    jax's __dlpack__ does.  Taken through `x` itself, a later `x.delete()`
    (the user's, while a consumer still holds the view) aborts the process
    in jaxlib (a CHECK on the reference's hold, 0.12.0 and 0.12.1); taken
    through the shard, x.delete() leaves the buffer to the reference, and it
    is freed when the capsule is (tests/cpu/test_dlpack_export.py)."""
    return x.addressable_data(0)


try:
    x64 = jax.enable_x64  # a context manager: x64(True) for 64-bit traces
except AttributeError:  # jax < 0.8 (not in the stubs of the jax mypy checks with)
    from jax.experimental import enable_x64 as _on  # type: ignore[attr-defined]

    def x64(on=True):  # type: ignore[misc]
        from jax.experimental import disable_x64  # type: ignore[attr-defined]
        return _on() if on else disable_x64()


def canonical(dtype):
    return _dtypes.canonicalize_dtype(dtype)


def addressable_devices(sharding) -> tuple:
    """The sharding's addressable devices in its own order: that of
    ``addressable_devices_indices_map`` and of a jax.Array's
    ``addressable_shards`` (public only through a shape, which from_shards
    may have to infer after placing its arrays)."""
    return tuple(sharding._addressable_device_assignment)


def memory_sharding(device, kind: str):
    return jax.sharding.SingleDeviceSharding(device, memory_kind=kind)


# Exports ----------------------------------------------------------------

# Where the whole-array protocols send a sharded array.
PER_SHARD = ("jax_overlay.to_shards(x) gives each addressable shard's device, "
             "index and data, a single-device array (x.addressable_shards[i].data): "
             "shard.data")


def refuse_sharded(x, who: str, error, fix: str) -> None:
    """The one refusal of an array spread over several devices, for every
    path that takes one buffer: `error` (a class, or a function of the
    message) saying "`who` is sharded over N devices; `fix`"."""
    devices = x.sharding.device_set
    if len(devices) != 1:
        raise error(f"{who} is sharded over {len(devices)} devices; {fix}")


def refuse_deleted(x, who: str, then: str, error=BufferError) -> None:
    """The one refusal of an array whose buffer is gone (deleted, or
    donated to a computation): `error` (a class, or a function of the
    message) saying so, with `then`, what follows for the caller."""
    if x.is_deleted():
        raise error(f"{who} was deleted or donated: its buffer is gone, so {then}")


def check_one_buffer(x, protocol: str, error) -> None:
    """`error` naming `protocol` where `x` is sharded: the whole-array
    protocols describe one buffer, and to_shards gives each shard's."""
    refuse_sharded(x, f"{protocol} is only supported for unsharded arrays. It describes "
                      "one buffer, but this array", error,
                   f"export each shard instead: {PER_SHARD}.{protocol}")


def check_live(x):
    """TypeError for anything but a concrete jax.Array, BufferError for a
    deleted or donated one: what every export checks first."""
    if not isinstance(x, ArrayImpl):
        raise TypeError(f"expected a jax.Array, got {type(x).__module__}.{type(x).__qualname__}")
    refuse_deleted(x, "the JAX array", "there is nothing to export")


_layout_strides: dict[tuple, tuple | None] = {}
_row_major_layouts: dict[int, object] = {}


def byte_strides(x, itemsize):
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


def remember(x, facts, table: dict[int, tuple]) -> None:
    """Keeps `facts` of the live array `x` in `table`, keyed by id(x); the
    weak reference's callback drops the entry when the array dies, before
    its id can be reused."""
    key = id(x)
    try:
        ref = weakref.ref(x, lambda _: table.pop(key, None))
    except TypeError:  # an ArrayImpl without weak references: no cache
        return
    table[key] = (ref, facts)
