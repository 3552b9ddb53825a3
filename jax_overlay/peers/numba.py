"""Room: Numba's CUDA arrays (peer ``"numba"``, numba-cuda).  Its device
arrays are recognised by one rule (Numba's ``DeviceNDArrayBase`` in the
type's MRO, found by name).
Its mapped and managed arrays are NumPy arrays too: the ``numpy`` peer
describes them.  Numba has no current stream: the foreign() adapter
fences kernels launched on Numba's default stream with events, and its
kernels take ``jax_overlay.foreign_stream()``."""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from .. import _xla_ext as ext
from ._registry import register
from ._base import ForeignEndpoint, GpuAdapter, Peer, relaxed_capture

_LEGACY, _PER_THREAD = 1, 2  # the CUDA driver's stream handles


class Numba(Peer, ForeignEndpoint):
    name, title, distribution, runs_on = "numba", "Numba (numba-cuda)", "numba", "gpu"

    def owns(self, t: type) -> bool:
        return any(c.__name__ == "DeviceNDArrayBase" and "numba" in c.__module__
                   for c in t.__mro__)

    # cai_reader: the generic rule.  Numba's arrays have no __dlpack__, so
    # their CAI (v3, with Numba's default stream) is the route.

    def stream(self, handle, ordinal):
        """Numba's external stream over `handle`, made in the device's
        context (the adapter's enter() makes it current)."""
        from numba import cuda
        return cuda.external_stream(handle)

    def adapter(self):
        return Foreign(self)


class Foreign(GpuAdapter):
    """foreign(framework="numba"): device arrays over XLA's memory, owned by
    the token (``owner=``); kernels on Numba's default stream ordered
    after XLA's work before the call and before XLA's work after it."""

    array_type = "a Numba device array"

    def __init__(self, peer):
        super().__init__(peer)
        from numba import cuda
        self.cuda = cuda
        self.array = cuda.devicearray.DeviceNDArray
        # Kernels launched without a stream go to Numba's default stream.
        from numba.core import config
        self.default = _PER_THREAD if getattr(config, "CUDA_PER_THREAD_DEFAULT_STREAM", 0) else _LEGACY

    def caller(self, ordinal):
        return self.default  # Numba has no current stream: the caller's work goes here

    def enter(self, ctx, ordinal, traced=False):
        xla = ctx.stream
        gpu = self.cuda.gpus[ordinal]
        gpu.__enter__()
        try:
            stream = self.stream(xla, ordinal)
            # Both ways, since fn's kernels go to either stream: kernels
            # on foreign_stream() after the caller's on the default stream
            # (join), and fn's on the default stream after XLA's work
            # before the call; XLA's work after the call runs after them
            # (exit()).  Not while XLA's stream is captured: no fence can
            # join a capture, and a kernel on the default stream is an
            # error there (kernels take foreign_stream()).
            caller = self.join(ordinal, xla, traced)
            if caller is not None:
                ext.order_after(ordinal, xla, caller)
        except BaseException:
            gpu.__exit__(None, None, None)
            raise
        return stream, (gpu, ordinal, xla, caller)

    def exit(self, state):
        gpu, ordinal, xla, caller = state
        try:
            # Also when fn raised: a kernel it launched may still write
            # into XLA's buffers, which XLA must not reuse before it ends;
            # and the caller's next kernels read what fn's wrote (leave).
            if caller is not None:
                ext.order_after(ordinal, caller, xla)
            self.leave(ordinal, xla, caller)
        finally:
            gpu.__exit__(None, None, None)

    def capture(self, memory):
        """Numba has no pool to route to: what this thread allocates while
        XLA traces fn (cuMemAlloc, in relaxed capture mode) is kept in
        `memory`, never freed, and frees fall due after the trace."""
        return _keeping(self.cuda.current_context(), memory)

    def empty(self, shape, dtype):
        return self.cuda.device_array(shape, dtype)

    def over(self, ptr, shape, dtype, size, ordinal, writeable, token):
        desc = {"shape": shape, "typestr": dtype.str, "data": (ptr, not writeable),
                "strides": None, "version": 2}
        return self.cuda.from_cuda_array_interface(desc, owner=token, sync=False)

    def facts(self, got):
        if not self.cuda.is_cuda_array(got) or isinstance(got, np.ndarray):
            return None, None
        return tuple(got.shape), np.dtype(got.dtype)

    def copy_into(self, view, got, stream):
        if not view.size:
            return
        if not hasattr(got, "shape"):  # a Python scalar for a 0-d output
            got = np.asarray(got, view.dtype)
        elif not isinstance(got, self.cuda.devicearray.DeviceNDArray):
            got = self.cuda.as_cuda_array(got, sync=False)
        view.copy_to_device(got, stream=stream)


_patching = threading.Lock()


@contextlib.contextmanager
def _keeping(context, kept):
    """Numba's memory manager for `context`, its memalloc wrapped for the
    block: this thread's allocations appended to `kept`.  Other threads'
    pass through.  One capture patches at a time."""
    mm = context.memory_manager
    thread = threading.get_ident()
    with _patching:
        own, theirs = mm.memalloc, mm.__dict__.get("memalloc")

        def memalloc(size):
            mem = own(size)
            if threading.get_ident() == thread:
                kept.append(mem)  # the trace's: freeing it would let a replay write freed memory
            return mem
        mm.memalloc = memalloc
        try:
            # No cuMemFree while captured: Numba's pending frees wait.
            with mm.defer_cleanup(), relaxed_capture():
                yield
        finally:
            if theirs is None:
                del mm.memalloc  # the class's own again
            else:
                mm.memalloc = theirs


PEER = register(Numba())
