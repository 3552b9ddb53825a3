"""Room: install()/uninstall(), which wire the import and export paths into JAX's public
API with JAX's own signatures.

Imports: ``jax.dlpack.from_dlpack`` and ``jnp.from_dlpack`` become
:func:`jax_overlay.from_dlpack`.  ``jnp.asarray``, ``jnp.array`` and
``jax.device_put`` take GPU arrays of other libraries zero-copy, by the cheaper of the
two protocols that gives the same array (``_route.cai_route``), then apply
JAX's own semantics to the view.  The drop-in rule (docs/DROPIN.md): what
works on stock JAX gives the same dtype, shape, values, device and memory
kind; what fails on stock works or raises an instance of stock's class.
Every other input reaches JAX's original function untouched: host arrays
(NumPy, CPU tensors) keep JAX's copy onto the default device, as JAX
deliberately does not take CPU DLPack in asarray (data-apis/array-api#301).

Exports: ``jax.Array.__dlpack__``, ``__dlpack_device__`` and
``__cuda_array_interface__`` become jax_overlay's for CPU and CUDA arrays.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.dlpack
import jax.numpy as jnp
import numpy as np

from . import _cai
from . import _dlpack
from . import _route
from . import _runtime as rt
from . import _view
from . import _vocab
from . import _xla_ext as ext
from ._config import config
from .errors import CopyRequiredError, JaxRuntimeError, like_stock

_lock = threading.Lock()
_saved: dict[tuple[object, str], object] = {}

# Inputs JAX reads itself, checked by exact type before any attribute lookup:
# the common calls (NumPy arrays, scalars, lists) pay one set lookup.
_JAX_NATIVE = frozenset({rt.ArrayImpl, np.ndarray, int, float, complex, bool,
                         list, tuple, type(None)})


class _Refused:
    """The overlay's import refused an object, or its producer failed, at
    jnp.asarray or jnp.array: stock's own outcome decides (_stock_after)."""
    __slots__ = ("error", "obj")

    def __init__(self, error, obj):
        self.error = error
        self.obj = obj


def _stock_after(refused, call):
    """Stock's outcome for an input the overlay refused.  Stock checks its
    own arguments (order=, dtype=, device=) before it reads a CAI, and its
    failure is the one to raise: ours where it is an instance of stock's
    class too (it says more), else stock's, with ours as a note.  Where
    stock succeeds, an object stock reads as any other (no CAI) keeps
    stock's result; a CAI the overlay refused stays refused (stock's view
    is what the refusal guards against: a mask, a dead producer), as an
    instance of jaxlib's runtime error, stock's class for a CAI it cannot
    read."""
    try:
        out = call()
    except Exception as e:
        if isinstance(refused.error, type(e)):
            raise refused.error from None
        e.add_note(f"jax_overlay could not import it either: {refused.error}")
        raise
    if not _has_cai(refused.obj):
        return out
    error = refused.error
    raise like_stock(error, JaxRuntimeError) from (
        error.__cause__ if isinstance(error, (BufferError, TypeError, ValueError)) else error)


def _has_cai(obj):
    """Whether stock's jnp.array reads a CAI of `obj` (its hasattr: a
    property that raises anything but AttributeError is read, and raises)."""
    try:
        return hasattr(obj, "__cuda_array_interface__")
    except Exception:
        return True


def _peer_array(obj, copy, stock_error, cai_first=True):
    """(view, copied) for another library's array in CUDA memory (device, pinned or
    managed), else None, by the cheapest safe route the object offers
    (_route.import_peer).  A refusal is raised as an instance of
    `stock_error` too: the class stock JAX raises at this entry point for
    such an array that it cannot take.  `cai_first`: stock reads any CAI first
    (jnp.asarray, jnp.array), so a NumPy array that is also CUDA memory
    (Numba's mapped and managed arrays) is imported through its CAI; else
    (jax.device_put) stock reads it as the NumPy array it also is.  There,
    an object the import refuses (or whose producer fails) gives _Refused:
    stock's own outcome decides what is raised (_stock_after)."""
    t = type(obj)
    if t in _JAX_NATIVE or isinstance(obj, np.generic) or hasattr(obj, "__jax_array__"):
        return None
    try:
        # No host device: host arrays keep JAX's own path (see the module doc).
        hit = _route.import_peer(obj, copy, cai_first=cai_first)
    except Exception as e:
        if cai_first:
            return _Refused(e, obj)  # stock's outcome decides (_stock_after)
        # A refusal, or the producer's failure inside jax.device_put, which
        # never asks a producer anything: stock's class too.
        refusal = isinstance(e, (BufferError, TypeError, ValueError))
        raise like_stock(e, stock_error) from (e.__cause__ if refusal else e)
    if hit is not None and hit[0].sharding.memory_kind == "pinned_host":
        view, copied = hit
        if not copied and hasattr(obj, "__cuda_array_interface__"):
            # Stock JAX imports a CAI of pinned memory (Numba's mapped
            # arrays) as a device array over the same pages: so do we, from
            # the zero-copy view only (a copy may still be in flight on a
            # transfer stream that a raw alias would not wait for).
            alias = _device_alias(view)
            if alias is not None:
                return alias, False
        # Pinned host memory without a CAI (PyTorch's pin_memory()
        # tensors): stock JAX reads it as a host array (NumPy's rules:
        # 64-bit data narrows in 32-bit mode) into device memory.  The same
        # result, but read in order after the producer's work.
        moved = rt.device_put(view, rt.memory_sharding(next(iter(view.devices())), "device"))
        canonical = rt.canonical(moved.dtype)
        return (moved if canonical == moved.dtype else moved.astype(canonical)), True
    return hit


def _reads_cai(a, dtype, copy, device, ndmin=0, out_sharding=None, refuse=False):
    """Whether stock jnp.array reads the CAI of `a`, a NumPy array that is
    also CUDA memory (Numba's mapped and managed arrays), rather than its
    NumPy memory.  Stock's fast paths take it as host data, a copy, when
    nothing converts it or when it asks for no copy and no new dtype, and
    jnp.asarray(copy=False) refuses it off the CPU (`refuse`): those keep
    stock's own path.  Every other call reaches stock's CAI branch, a view
    that does not hold the producer; the overlay's view holds it."""
    if refuse and _platform(device) != "cpu":
        return False  # stock's ValueError: copy=False of buffer-protocol data
    if (dtype is None and device is None and out_sharding is None and ndmin == 0
            and not isinstance(a, np.ma.MaskedArray)):
        return False
    if not copy and device is None and ndmin <= a.ndim:
        try:
            same = dtype is None or rt.canonical(np.dtype(dtype)) == a.dtype
        except TypeError:
            return False  # stock names the bad dtype
        if same:
            return False
    return True


def _device_alias(view):
    """A device-memory array over the pinned pages of `view`, zero-copy:
    under unified addressing the host pointer of pinned memory is its
    device pointer.  The capsule holds `view`, and `view` the producer, as
    long as JAX holds the alias.  None where a device view is not allowed
    (jaxlib needs 16-byte aligned device pointers)."""
    ptr = view.unsafe_buffer_pointer()
    if ptr % _vocab.GPU_ALIGNMENT:
        return None
    device = next(iter(view.devices()))
    stream = None
    if not view.is_ready():
        # The alias is defined after the pinned array, for every reader.
        stream = rt.ready_stream(device)
        try:
            rt.order_stream_after(view, stream)  # the wait is enqueued; the capsule may go
        except Exception:  # noqa: BLE001 - a jaxlib that exports no pinned array to a stream
            view.block_until_ready()
    cap = ext.raw_capsule(view, ptr, list(view.shape), None,
                          _dlpack.dtype_code(view.dtype), _vocab.KDLCUDA,
                          device.local_hardware_id)
    return _view.import_view(cap, device, None, _vocab.KDLCUDA, stream)


def _platform(device):
    """The platform `device=` (a device, a sharding, a platform name, or
    None: JAX's default device) names."""
    if device is None:
        device = jax.config.jax_default_device
        if device is None:
            return jax.default_backend()
    if isinstance(device, str):
        return device
    if isinstance(device, jax.sharding.Sharding):
        device = next(iter(device.device_set))
    return device.platform


def _move(view, copied, device, copy):
    """(array, copied): a fresh import placed on `device` before JAX's
    asarray/array sees it.  Every import is committed to the device that
    owns its memory, and JAX's asarray/array cannot move a committed array
    (jax 0.12 raises "incompatible devices"; jax 0.11 too when it must also
    convert the dtype), so the import's own rule places it.  Stock JAX's
    asarray/array move an array whatever copy= says: so does this, unless
    config.strict_copy asks for the Array API's refusal."""
    if (view.dtype != rt.canonical(view.dtype) and not (copy is False and config.strict_copy)
            and _platform(device) != next(iter(view.devices())).platform):
        # 64-bit data in 32-bit mode to another platform (GPU -> CPU): stock
        # JAX raises ValueError ("incompatible devices"), and jax.device_put
        # of such an array gave wrong values on the H200 (jax 0.11.2).  It
        # goes through the host instead, a copy that keeps its 64 bits.
        host = np.asarray(view)
        with rt.x64(True):
            return rt.device_put(host, device), True
    return _view.place(view, copied, device,
                          None if copy is False and not config.strict_copy else copy)


def _placeable(device, kwargs):
    """Whether jnp.asarray's and jnp.array's `device=` is one the overlay
    places imports on (None, a device, a sharding; not beside out_sharding=).
    Stock refuses anything else before it reads its input (ValueError), so
    such a call is left to stock whole."""
    if device is None:
        return True
    return (isinstance(device, (jax.Device, jax.sharding.Sharding))
            and kwargs.get("out_sharding") is None)


def _constructor(a, copy, device, kwargs, reads_cai, call, finish, converts=False):
    """The one flow of jnp.asarray and jnp.array.  `call(x, device)` is
    JAX's own function with the caller's other arguments; `finish(view,
    copied)` hands it a peer array's import, already placed.  `reads_cai()`
    says, for a NumPy subclass only, whether stock reads its CAI
    (_reads_cai); NumPy arrays themselves go to JAX before it is asked.
    `converts`: the caller asked for a dtype, which JAX converts in device
    memory only."""
    if type(a) in _JAX_NATIVE or not _placeable(device, kwargs):
        return call(a, device)
    # Stock's CAI import raises jaxlib's runtime error for what it refuses.
    hit = _peer_array(a, copy, JaxRuntimeError,
                      not isinstance(a, np.ndarray) or reads_cai())
    if hit is None:
        return call(a, device)
    if type(hit) is _Refused:
        return _stock_after(hit, lambda: call(a, device))
    view, copied = hit
    if device is None:
        return finish(view, copied)
    target = device
    if (converts and isinstance(device, jax.sharding.Sharding)
            and device.memory_kind not in (None, "device")
            and hasattr(device, "with_memory_kind")):
        # XLA converts dtypes in device memory only (a conversion of a
        # pinned_host array failed to compile on the H100: "E1200:
        # CompileTimeHostOffloadOutputLocationMismatch"): converted there,
        # then moved where asked.
        target = device.with_memory_kind("device")
    # Placed first: JAX's asarray/array cannot move a committed array.
    view, copied = _move(view, copied, target, copy)
    out = finish(view, copied)
    if isinstance(device, jax.sharding.Sharding) and out.sharding != device:
        # Stock's result has the very sharding asked for (its type, its
        # memory kind): where only the type differs, JAX relabels it.
        out = rt.device_put(out, device)
    return out


def _asarray(orig):
    @functools.wraps(orig)
    def asarray(a, dtype=None, order=None, *, copy=None, device=None, **kwargs):
        if type(a) in _JAX_NATIVE:  # the common calls, without the closures below
            return orig(a, dtype, order, copy=copy, device=device, **kwargs)

        def finish(view, copied):
            if dtype is None and order is None and not kwargs and not copy:
                return view  # exactly what JAX returns for a JAX array here
            # The import's dtype as it is: stock JAX's CAI import keeps 64-bit
            # data 64-bit in 32-bit mode too, and so does JAX for a JAX array.
            return orig(view, dtype, order, copy=None if copied else copy, **kwargs)
        return _constructor(
            a, copy, device, kwargs,
            lambda: _reads_cai(a, dtype, bool(copy), device, out_sharding=kwargs.get("out_sharding"),
                               refuse=copy is False),
            lambda x, d: orig(x, dtype, order, copy=copy, device=d, **kwargs), finish,
            dtype is not None)
    return asarray


def _array(orig):
    @functools.wraps(orig)
    def array(object, dtype=None, *, copy=True, order="K", ndmin=0,
              device=None, **kwargs):
        if type(object) in _JAX_NATIVE or order not in (None, "K"):
            # JAX's own types, and an order stock refuses first (its
            # NotImplementedError before anything reads the object).
            return orig(object, dtype, copy=copy, order=order, ndmin=ndmin, device=device, **kwargs)

        def finish(view, copied):
            # dtype=None keeps the import's dtype, as stock JAX does (see
            # asarray).  A GPU-side copy already made a fresh buffer: JAX
            # need not copy again.
            return orig(view, dtype, copy=False if copied else copy, order=order,
                        ndmin=ndmin, **kwargs)
        return _constructor(
            object, copy, device, kwargs,
            lambda: _reads_cai(object, dtype, copy, device, ndmin, kwargs.get("out_sharding")),
            lambda x, d: orig(x, dtype, copy=copy, order=order, ndmin=ndmin, device=d, **kwargs),
            finish, dtype is not None)
    return array


def _leaf(x):
    # Stock device_put refuses every array of another library with TypeError.
    hit = _peer_array(x, None, TypeError, cai_first=False)
    if hit is None:
        return x
    view, copied = hit
    # 64-bit data in 32-bit mode narrows, as device_put does for NumPy.
    return _view.finish(view, copied)


def _own_copy(leaf):
    return np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf


def _device_put(orig):
    @functools.wraps(orig)
    def device_put(x, *args, **kwargs):
        if kwargs.get("may_alias") is False:
            # Stock JAX aliases 64-byte aligned NumPy memory on the CPU even
            # with may_alias=False, so later writes to the NumPy array show
            # through the "immutable" JAX array: such leaves go to JAX as
            # copies nobody else holds.
            x = jax.tree_util.tree_map(_own_copy, x)
        t = type(x)
        if t in _JAX_NATIVE and t is not list and t is not tuple:
            return orig(x, *args, **kwargs)
        # Pytrees of peer arrays too: each leaf becomes a zero-copy view,
        # then JAX places the tree (an alias where it already is).  A lone
        # peer array skips the tree walk.
        if t is not list and t is not tuple and t is not dict:
            view = _leaf(x)
            if view is not x:
                return _as_stock_fails(orig, x, view, args, kwargs)
        views = jax.tree_util.tree_map(_leaf, x)
        return _as_stock_fails(orig, x, views, args, kwargs)
    return device_put


def _as_stock_fails(orig, x, views, args, kwargs):
    """orig(views, ...); where that fails for another reason (a bad device=),
    the error is also an instance of the class stock raises for `x`, whose
    peer arrays it refuses before it reads anything else (InvalidInput
    Exception or TypeError: jax.device_put takes no peer array)."""
    try:
        return orig(views, *args, **kwargs)
    except Exception as e:
        if views is x:
            raise
        try:
            orig(x, *args, **kwargs)  # stock, on the caller's own leaves
        except Exception as stock:
            if isinstance(e, type(stock)):
                raise
            raise like_stock(e, type(stock)) from e
        raise


def _ours_to_read(device, copy):
    """(whether the overlay's import takes these arguments, `device` as stock
    reads it).  A falsy `device` is none, as stock's checks read it.
    Arguments outside the protocol (a `device` that is neither a device nor
    a sharding of one device, a `copy` that is not None or a bool) are
    stock's to refuse: its from_dlpack raises for them, each at its own
    point and with its own class (a sharding over several devices at once,
    jaxlib's TypeError for copy=0 or 'no'), so it is left to do so."""
    if copy is not None and type(copy) is not bool:
        return False, device
    if device is None or isinstance(device, jax.Device):
        return True, device
    if isinstance(device, jax.sharding.Sharding):
        return len(device.device_set) == 1, device
    try:
        falsy = not device
    except Exception:  # no truth value (an array): stock's own error
        return False, device
    return falsy, None if falsy else device


def _stock_device(x, device, copy):
    """`device` as stock JAX's from_dlpack reads it: a sharding of one device
    is that device (its memory kind is not applied), and with copy=False a
    device other than the producer's is refused before the producer is
    asked for anything (stock's ValueError)."""
    if isinstance(device, jax.sharding.Sharding):
        device, = device.device_set
    if device is not None and copy is False and hasattr(x, "__dlpack_device__"):
        source = _dlpack.jax_device_of(x)
        if source is not None and source != device:
            raise CopyRequiredError(
                f"Specified device={device} which requires a copy since the source "
                f"device is {source!r}, however copy=False. Set copy=True or "
                "copy=None to perform the requested operation.")
    return device


def _from_dlpack(orig):
    @functools.wraps(orig)
    def from_dlpack(external_array, device=None, copy=None):
        ours, device = _ours_to_read(device, copy)
        if not ours:
            return orig(external_array, device, copy)
        device = _stock_device(external_array, device, copy)
        return _route.placed_from_dlpack(external_array, device, copy, host_view=False)
    return from_dlpack


def _jnp_from_dlpack(orig):
    @functools.wraps(orig)
    def from_dlpack(x, /, *, device=None, copy=None):
        ours, device = _ours_to_read(device, copy)
        if not ours:
            return orig(x, device=device, copy=copy)
        device = _stock_device(x, device, copy)
        return _route.placed_from_dlpack(x, device, copy, host_view=False)
    return from_dlpack


def _method(ours, stock):
    """Our export for CPU and CUDA arrays; JAX's own for any other platform."""
    @functools.wraps(stock)
    def method(self, *args, **kwargs):
        if _dlpack.ours(self):
            return ours(self, *args, **kwargs)
        return stock(self, *args, **kwargs)
    return method


def _targets():
    return [
        (jnp, "asarray", _asarray),
        (jnp, "array", _array),
        (jnp, "from_dlpack", _jnp_from_dlpack),
        (jax.dlpack, "from_dlpack", _from_dlpack),
        (jax, "device_put", _device_put),
        (rt.ArrayImpl, "__cuda_array_interface__", lambda orig: _cai.cai_property),
        (rt.ArrayImpl, "delete", _cai.delete_keeping_exports),
        (rt.ArrayImpl, "__dlpack__", lambda orig: _method(_dlpack.to_dlpack, orig)),
        (rt.ArrayImpl, "__dlpack_device__", lambda orig: _method(_dlpack.dlpack_device, orig)),
    ]


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
