"""Room: the CUDA Array Interface, both ways.  Export: a JAX array's
``__cuda_array_interface__`` (version 3), ordered after its pending
computation on the GPU without the host waiting.  Import: a producer's
CAI dict planned by the native core (validated, located, a zero-copy
capsule that holds the producer) and handed to the protocol-neutral
import (``_view``)."""

from __future__ import annotations

from typing import Any

import jax

from . import _runtime as rt
from . import _view
from . import _vocab
from . import _xla_ext as ext
from ._config import config
from .errors import like_stock

_LEGACY_STREAM = 1


def _typestr(dtype):
    if dtype not in _vocab.NUMPY_DTYPES:
        # Stock JAX's words ("not supported for BF16") where it has them.
        name = "BF16" if dtype.name == "bfloat16" else str(dtype)
        raise AttributeError(
            f"__cuda_array_interface__ is not supported for {name} buffers: "
            f"the CUDA Array Interface has no type string for {dtype}; use "
            "DLPack (__dlpack__ / jax.dlpack) instead")
    return dtype.str


def _check(x, host=False):
    """The precise error for an array the fast path turned away."""
    if isinstance(x, rt.ArrayImpl):
        # An AttributeError too: hasattr(x, "__cuda_array_interface__") says
        # False for a deleted or donated array, as on stock, and never raises.
        rt.refuse_deleted(x, "the JAX array", "it has no __cuda_array_interface__",
                          lambda msg: like_stock(BufferError(msg), AttributeError))
    rt.check_live(x)
    rt.check_one_buffer(x, "__cuda_array_interface__", AttributeError)
    device = next(iter(x.sharding.device_set))
    if device.platform != "gpu" and not (host and device.platform == "cpu"):
        raise AttributeError(
            f"__cuda_array_interface__ is only defined for NVidia GPU buffers. "
            f"This array is on {device}: host memory has no CUDA Array Interface; "
            "hand it over by DLPack (x.__dlpack__(), or the consumer's from_dlpack) "
            "or as NumPy (np.asarray(x))")


def _cuda_ordinal(ptr):
    """The CUDA device owning `ptr`, or None for host memory: the platform
    check, by asking the driver about the pointer (cheaper than walking the
    array's sharding); no driver means no GPU arrays."""
    global _no_driver
    if _no_driver:
        return None
    try:
        info = ext.pointer_info(ptr)
    except BufferError:
        _no_driver = not ext.driver_loaded()  # remembered: the driver never appears later
        return None
    return None if info.kind == "not_cuda" else info.ordinal


_no_driver = False


def _consumer_waits(x, stream):
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
    return _describe(x, stream, read_only, False)


def _describe(x: jax.Array, stream: int | None, read_only: bool | None,
              host: bool) -> dict[str, Any]:
    """cuda_array_interface; `host` describes CPU arrays too (host memory:
    the tests check the dict builder on real JAX buffers where CI has no
    GPU)."""
    facts = None
    if type(x) is rt.ArrayImpl:
        entry = _ready_facts.get(id(x))
        # The weak reference proves the entry is this array's, not that of a
        # dead one whose id was reused; a deleted or donated buffer is gone.
        if entry is not None and entry[0]() is x and not x.is_deleted():
            facts = entry[1]
    ready = cacheable = facts is not None
    if facts is None:
        facts, cacheable = _facts(x, host)
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
            rt.remember(x, facts, _ready_facts)
        elif type(x) is rt.ArrayImpl:
            rt.remember(x, None, _exported)  # for delete_keeping_exports
    if config.cai_sync and (stream is not None or not ready):
        out_stream = _LEGACY_STREAM if stream is None else stream
        _consumer_waits(x, out_stream)  # the dict cannot hold the reference: dropped
    return {
        "shape": shape,
        "typestr": typestr,
        "data": (ptr, ro),
        "version": 3,
        "strides": strides,
        "stream": out_stream,
        "descr": [("", typestr)],
    }


def _facts(x, host):
    """((pointer, typestr, shape, strides), whether they may be kept) of an
    exportable array, with every check of the export (TypeError, BufferError,
    AttributeError).  Only a GPU array's are kept: a host array is exported
    only while tests allow it."""
    if type(x) is not rt.ArrayImpl:
        _check(x, host)
    try:
        # Also the sharding and deletion check: it raises for both.
        ptr = x.unsafe_buffer_pointer()
    except Exception:
        _check(x, host)
        raise
    on_gpu = _cuda_ordinal(ptr) is not None
    if not on_gpu:
        _check(x, host)  # a CPU array: AttributeError, so hasattr() is False
    dtype = x.dtype
    facts = ptr, _typestr(dtype), x.shape, rt.byte_strides(x, dtype.itemsize)
    return facts, on_gpu and type(x) is rt.ArrayImpl


# What the CAI of a *ready* array says never changes while the array lives
# (its buffer, dtype, shape and layout are fixed, and it stays ready), and
# consumers read the property again and again (CuPy twice per conversion):
# those facts are kept per array, keyed by id(x).  The weak reference's
# callback drops the entry when the array dies, before its id can be reused.
_ready_facts: dict[int, tuple] = {}


# Arrays whose CAI was handed out and that _ready_facts does not know (still
# pending when exported, or host arrays described for tests), by id: a
# consumer may hold them (delete_keeping_exports).
_exported: dict[int, tuple] = {}
# PJRT external references that keep deleted arrays' buffers for their
# consumers, by id(x): dropped by the weak reference's callback when x dies.
_kept_for_consumers: dict[int, tuple] = {}


def _known_export(x) -> bool:
    for table in (_ready_facts, _exported):
        entry = table.get(id(x))
        if entry is not None and entry[0]() is x:
            return True
    return False


def delete_keeping_exports(stock_delete):
    """``jax.Array.delete`` (install()ed): as stock, except that the buffer
    of an array whose CAI was handed out is freed when the array object
    dies, not at delete().  The CUDA Array Interface carries no owner: its
    consumers (CuPy's UnownedMemory, Numba's owner, PyTorch's deleter)
    keep the *object* x alive, and nothing else, so stock's delete() frees
    memory a consumer still reads and XLA reuses it (H200, 2026-12-06).
    The reference is taken at delete(), never at export: held from the
    export on, it would make PJRT refuse a donation that stock performs."""
    def delete(self):
        if type(self) is rt.ArrayImpl and _known_export(self) and not self.is_deleted():
            # Through the shard (rt._holder): jaxlib aborts on a delete of
            # an array whose own external reference is held.  A pending
            # array's reference is taken with an event wait on a side stream,
            # never a host wait.
            if self.is_ready():  # type: ignore[attr-defined]  # an ArrayImpl
                ref = rt.external_reference(self)
            else:
                device = next(iter(self.sharding.device_set))
                ref = rt.order_stream_after(self, rt.ready_stream(device))
            rt.remember(self, ref, _kept_for_consumers)
        return stock_delete(self)
    delete.__doc__ = stock_delete.__doc__
    return delete


def _cai_property(self):
    return _describe(self, None, None, False)


cai_property = property(
    _cai_property,
    doc="CUDA Array Interface v3 (jax_overlay): zero-copy, stream-ordered.")




# Import -------------------------------------------------------------------

def cai_dict(obj):
    try:
        return obj.__cuda_array_interface__
    except AttributeError:
        host = (" (host arrays: jax_overlay.from_dlpack or jnp.asarray import them)"
                if hasattr(obj, "__array_interface__") or hasattr(obj, "__dlpack__") else "")
        raise TypeError(
            f"{type(obj).__module__}.{type(obj).__qualname__} has no "
            "__cuda_array_interface__; pass a GPU array from CuPy, Numba, "
            f"PyTorch or another producer of the CUDA Array Interface{host}") from None


def _ordered_stream(plan, device):
    """The stream jaxlib's import is handed: None for a producer whose
    stream is idle (its data is written), else a ready stream made to wait,
    on the GPU, for the work already enqueued on the producer's stream
    (_runtime.ready_stream): the array is defined only once the producer is
    done, for every reader, and no host thread waits for it.  A CAI with no
    stream follows the legacy default stream (plan_cai_import says why)."""
    if not plan.busy:
        return None
    stream = rt.ready_stream(device)
    ext.order_after(plan.ordinal, plan.order_after, stream)
    return stream


def _empty(view, host):
    if host:
        return _view.empty_at(view.shape, view.typestr, _vocab.KDLCPU, rt.host_device())
    dl_type, dev = _vocab.KDLCUDA, None
    if view.data:
        # A zero-size slice still points into its allocation: the GPU that
        # owns it, not the current or the first one.
        info = ext.pointer_info(view.data)
        if info.kind != "not_cuda":
            dev = rt.gpu_device(info.ordinal)
            if info.kind == "pinned_host":
                dl_type = _vocab.KDLCUDAHOST
    if dev is None:
        # A null pointer (CuPy's and PyTorch's zero-size arrays) belongs to
        # no device: JAX's first GPU; device= places it elsewhere.
        dev = rt.gpu_backend().local_devices()[0]
    return _view.empty_at(view.shape, view.typestr, dl_type, dev)


def import_cai(obj, cai=None, *, copy=None, host=False):
    """(array, copied): a JAX view of `obj`'s memory, or one copy on the same
    device when the layout or alignment rules out a view (copy=False then
    raises BufferError).  `cai`: the dict, where already read.  `host`:
    the pointer is host memory, without asking the driver (tests run the
    whole path on NumPy buffers)."""
    plan = ext.plan_cai_import(cai_dict(obj) if cai is None else cai, obj, host)
    view, dl_type = plan.view, plan.device_type
    if plan.capsule is None and view.numel == 0:
        return _empty(view, host), False
    device = rt.host_device() if host else rt.gpu_device(plan.ordinal)
    stream = _ordered_stream(plan, device)
    if plan.capsule is not None:
        arr = _view.import_view(plan.capsule, device, False if copy is False else None, dl_type,
                                stream)
        return arr, dl_type == _vocab.KDLCUDAHOST and not rt.PINNED_VIEW
    return _view.copy_import(obj, view, view.typestr, dl_type, plan.ordinal, device,
                             alignment=plan.alignment, copy=copy,
                             range_start=plan.range_start, stream=stream), True
