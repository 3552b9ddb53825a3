"""Room: the peers' registry: every peer by name, and the peer of a type.
A leaf (it imports nothing of ours): each peer module registers itself
here without importing the package that imports it."""

from __future__ import annotations

from typing import Any, TypeVar

REGISTRY: dict[str, Any] = {}

_P = TypeVar("_P")


def register(peer: _P) -> _P:
    """Adds `peer` under its name; one peer per name."""
    name = peer.name  # type: ignore[attr-defined]
    if name in REGISTRY:
        raise ValueError(f"a peer named {name!r} is registered already")
    REGISTRY[name] = peer
    _BY_TYPE.clear()
    return peer


# Per type: its peer, or None (a producer no module describes).  The common
# types are looked up once.
_BY_TYPE: dict[type, Any] = {}


def peer_of(t: type) -> Any:
    """The peer whose rule recognises type `t`, or None."""
    try:
        return _BY_TYPE[t]
    except KeyError:
        pass
    found = None
    for peer in REGISTRY.values():
        if peer.owns(t):
            found = peer
            break
    _BY_TYPE[t] = found
    return found
