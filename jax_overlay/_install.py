"""install()/uninstall(): wire the import path into JAX's public API with
JAX's own signatures.  Only objects JAX itself would have handed to its
CUDA Array Interface reader change route; every other input reaches JAX's
original function untouched."""

from __future__ import annotations

import functools
import threading

import jax.numpy as jnp

from . import _exports
from . import _imports
from . import _runtime as rt

_lock = threading.Lock()
_saved: dict[tuple[object, str], object] = {}


def _foreign(obj, copy):
    """(view, copied) for an object JAX would read through its CUDA Array
    Interface branch (not a JAX array, no __jax_array__), else None."""
    if type(obj) is rt.ArrayImpl or hasattr(obj, "__jax_array__"):
        return None
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        return None
    return _imports.import_cai(obj, cai, copy=copy)


def _asarray(orig):
    @functools.wraps(orig)
    def asarray(a, dtype=None, order=None, *, copy=None, device=None, **kwargs):
        hit = _foreign(a, copy)
        if hit is None:
            return orig(a, dtype, order, copy=copy, device=device, **kwargs)
        view, copied = hit
        canonical = rt.canonical(view.dtype)
        if (dtype is None and order is None and device is None and not kwargs
                and not copy and canonical == view.dtype):
            return view  # exactly what JAX returns for a JAX array here
        # 64-bit data in 32-bit mode converts, as JAX does for host arrays.
        return orig(view, canonical if dtype is None else dtype, order,
                    copy=None if copied else copy, device=device, **kwargs)
    return asarray


def _array(orig):
    @functools.wraps(orig)
    def array(object, dtype=None, *, copy=True, order="K", ndmin=0,
              device=None, **kwargs):
        hit = _foreign(object, copy)
        if hit is None:
            return orig(object, dtype, copy=copy, order=order, ndmin=ndmin,
                        device=device, **kwargs)
        view, copied = hit
        if dtype is None:
            dtype = rt.canonical(view.dtype)  # as JAX does for host arrays
        # A GPU-side copy already made a fresh buffer: JAX need not copy again.
        return orig(view, dtype, copy=False if copied else copy, order=order,
                    ndmin=ndmin, device=device, **kwargs)
    return array


def _targets():
    return [(jnp, "asarray", _asarray), (jnp, "array", _array),
            (rt.ArrayImpl, "__cuda_array_interface__", lambda orig: _exports.cai_property)]


def install() -> None:
    """Routes JAX's public entry points through jax_overlay.  Idempotent."""
    with _lock:
        for owner, name, make in _targets():
            if (owner, name) in _saved:
                continue
            # The class dict, not getattr: a property must be saved as the
            # property object, not evaluated.
            orig = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            _saved[(owner, name)] = orig
            setattr(owner, name, make(orig))


def uninstall() -> None:
    """Restores exactly the objects JAX had before install().  Idempotent."""
    with _lock:
        for (owner, name), orig in reversed(list(_saved.items())):
            setattr(owner, name, orig)
        _saved.clear()


def installed() -> bool:
    return bool(_saved)
