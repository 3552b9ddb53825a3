"""Room: the peers.  One module per array library (``numpy``, ``torch``,
``cupy``, ``numba``, ``cuda_core``), each registered once, in :data:`REGISTRY`.

A peer module holds everything that is true of one library and of no
other: the one rule that recognises its arrays (by type, without importing
the library), its quirks on the two protocols (a CAI route that orders as
its ``__dlpack__`` would, a lazy view to resolve first), its stream type
over a CUDA stream it does not own, and its adapter for
``jax_overlay.foreign``.  The import and export paths ask the registry,
never a library by name.  A well-behaved producer (a CUDA Array Interface
v3 with a stream, or ``__dlpack__``) needs no module at all.

The registry itself is ``_registry`` (it imports nothing, so a peer module
registers itself without importing this package).  Adding a library is one
module here, imported at the end of this file:
docs/ARCHITECTURE.md walks through one.
"""

from __future__ import annotations

from typing import Any

from .. import _xla_ext as ext
from .._vocab import KDLCUDA, KDLCUDAMANAGED
from ._base import GENERIC, Adapter, ForeignEndpoint, Peer, ShareEndpoint, where
from ._registry import REGISTRY, peer_of, register

def resolve(obj: Any, copy: bool | None) -> tuple[Any, bool]:
    """(obj, copied): `obj` with what its library leaves lazy resolved (a
    copy), where neither protocol would carry it; else `obj` itself.  Of a
    peer that does not order the consumer's stream, after a fence: the
    device's work done (the DLPack import calls this before it takes the
    capsule, so the fence covers every write enqueued before the import)."""
    peer = peer_of(type(obj))
    if peer is None:
        return obj, False
    if not peer.orders_consumer_stream:
        _fence(obj)
    return peer.resolve(obj, copy)


def _fence(obj: Any) -> None:
    kind, ordinal = obj.__dlpack_device__()
    if kind in (KDLCUDA, KDLCUDAMANAGED):
        ext.synchronize(int(ordinal))


def having(capability: type) -> dict[str, Any]:
    """{name: peer} of the peers with `capability` (ForeignEndpoint,
    ShareEndpoint), in registration order: how a feature finds its peers."""
    return {name: peer for name, peer in REGISTRY.items() if isinstance(peer, capability)}


def frameworks() -> tuple[str, ...]:
    """The names ``jax_overlay.foreign(framework=...)`` takes."""
    return tuple(having(ForeignEndpoint))


def share_frameworks() -> tuple[str, ...]:
    """The names ``open_shared(framework=...)`` takes: JAX's own, and the
    peers that open shares."""
    return ("jax",) + tuple(having(ShareEndpoint))


def share_peer(framework: str) -> Any:
    """The peer of ``open_shared(framework=...)`` (a ShareEndpoint)."""
    return having(ShareEndpoint)[framework]


def with_autograd() -> str:
    """The frameworks of ``foreign(vjp="autograd")``, for messages."""
    return " or ".join(repr(n) for n, p in having(ForeignEndpoint).items() if p.autograd)


def foreign_peer(framework: str) -> Any:
    """The peer of ``foreign(framework=...)`` (a ForeignEndpoint); ValueError
    naming the choices."""
    peer = having(ForeignEndpoint).get(framework) if isinstance(framework, str) else None
    if peer is None:
        raise ValueError(f"framework={framework!r}: pass one of {', '.join(map(repr, frameworks()))}")
    return peer


from . import numpy, torch, cupy, numba, cuda_core  # noqa: E402  (each registers itself)

__all__ = ["GENERIC", "Adapter", "ForeignEndpoint", "Peer", "REGISTRY", "ShareEndpoint", "cuda_core", "cupy",
           "foreign_peer", "frameworks", "having", "numba", "numpy", "peer_of", "register",
           "resolve", "share_frameworks", "share_peer", "torch", "where", "with_autograd"]
