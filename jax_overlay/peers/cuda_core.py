"""Room: cuda.core (peer ``"cuda_core"``, NVIDIA's cuda-core).  Its
``StridedMemoryView`` and ``Buffer`` are recognised by one rule (those
names, in a ``cuda.core`` module of the type's MRO).  Its quirk: their
``__dlpack__`` ignores the consumer's stream, because a view's data was
ordered when it was made, on the ``stream_ptr`` its maker passed (or not
at all, with -1), which the view does not tell.  So the peer says it does
not order the consumer's stream, and an import fences: it waits for the
device's work on the host (DLPack has no other way to learn when the data
is written).  It offers no ``foreign()`` adapter and no share endpoint."""

from __future__ import annotations

from ._registry import register
from ._base import Peer

_TYPES = frozenset({"StridedMemoryView", "Buffer"})


class CudaCore(Peer):
    name, title, distribution = "cuda_core", "cuda.core", "cuda-core"
    orders_consumer_stream = False

    def owns(self, t: type) -> bool:
        return any(c.__name__ in _TYPES and c.__module__.startswith("cuda.core")
                   for c in t.__mro__)

    def cai_reader(self, t: type):
        return None  # DLPack always: the import's fence is on that route


PEER = register(CudaCore())
