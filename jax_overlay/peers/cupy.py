"""Room: CuPy (peer ``"cupy"``).  Its arrays are recognised by one rule
(``cupy.ndarray`` in the type's MRO, found by name).  Its quirks: its CUDA
Array Interface is version 3 with its current stream, the order its
``__dlpack__`` gives, and it is taken first (CuPy 14.2's ``__dlpack__`` of
a reversed view has a stride of 2**62 - 1); ``cupy.cuda.ExternalStream``;
the foreign() adapter over XLA's device buffers."""

from __future__ import annotations

import warnings

from .._vocab import KDLCUDA
from ._registry import register
from ._base import ForeignEndpoint, GpuAdapter, Peer, ShareEndpoint, relaxed_capture


class CuPy(Peer, ForeignEndpoint, ShareEndpoint):
    name, title, distribution, runs_on = "cupy", "CuPy", "cupy", "gpu"

    def owns(self, t: type) -> bool:
        return any(c.__name__ == "ndarray" and c.__module__.startswith("cupy")
                   for c in t.__mro__)

    # cai_reader: the generic rule (its own CAI v3, with its stream) is right.

    def stream(self, handle, ordinal=-1):
        """A ``cupy.cuda.ExternalStream`` over `handle`.

        CuPy 14 deprecates ``ExternalStream`` in favour of
        ``Stream.from_external``, but the ``Stream`` that returns destroys
        its handle when the object is collected, which would destroy a
        stream XLA still uses.  ExternalStream never destroys it; only its
        deprecation warning is silenced, once per handle the caller caches."""
        import cupy
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return cupy.cuda.ExternalStream(handle, ordinal)

    def adapter(self):
        return Foreign(self)

    def current_stream(self, ordinal):
        import cupy
        with cupy.cuda.Device(ordinal):
            return cupy.cuda.get_current_stream().ptr

    def wrap_capsule(self, capsule, ordinal):
        import cupy
        return cupy.from_dlpack(_Capsule(capsule, ordinal))


class _Capsule:
    """A DLPack producer of one capsule, for cupy.from_dlpack (which takes
    producers, not capsules): the capsule's memory is already ordered."""

    def __init__(self, capsule, ordinal):
        self.capsule, self.ordinal = capsule, ordinal

    def __dlpack__(self, stream=None, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (KDLCUDA, self.ordinal)


class Foreign(GpuAdapter):
    """foreign(framework="cupy"): views as ``cupy.ndarray`` over
    ``UnownedMemory`` whose owner is the token, on XLA's stream made
    current with the buffers' device."""

    array_type = "cupy.ndarray"

    def __init__(self, peer):
        super().__init__(peer)
        import cupy
        self.cupy = cupy
        self.array = cupy.ndarray

    def enter(self, ctx, ordinal, traced=False):
        xla = ctx.stream
        stream = self.stream(xla, ordinal)
        device = self.cupy.cuda.Device(ordinal)
        device.__enter__()
        try:
            caller = self.join(ordinal, xla, traced)  # read before XLA's is made current
            stream.__enter__()
        except BaseException:
            device.__exit__(None, None, None)
            raise
        return stream, (device, stream, ordinal, xla, caller)

    def exit(self, state):
        device, stream, ordinal, xla, caller = state
        try:
            try:
                stream.__exit__(None, None, None)
            finally:
                self.leave(ordinal, xla, caller)
        finally:
            device.__exit__(None, None, None)

    def capture(self, memory):
        """A memory pool of the traces', this thread's allocator while XLA
        traces fn; it grows in relaxed capture mode (CuPy's malloc does not
        relax it itself)."""
        if not memory:
            memory.append(self.cupy.cuda.MemoryPool())  # its blocks: the traces' temporaries
        pool = memory[0]

        def malloc(size):
            with relaxed_capture():
                return pool.malloc(size)
        return self.cupy.cuda.using_allocator(malloc)

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype)

    def over(self, ptr, shape, dtype, size, ordinal, writeable, token):
        cupy = self.cupy
        mem = cupy.cuda.UnownedMemory(ptr, size * dtype.itemsize, token, ordinal)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))

    def facts(self, got):
        if not isinstance(got, self.cupy.ndarray):
            return None, None
        return tuple(got.shape), got.dtype

    def copy_into(self, view, got, stream):
        if view.size:
            view[...] = got  # on the current stream: XLA's


PEER = register(CuPy())
