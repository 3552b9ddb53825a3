"""The drop-in rule, checked differentially: each case runs on stock JAX and
with ``jax_overlay.install()`` in the same process, and the two outcomes are
compared by the rule of the README:

* a call that succeeds on stock succeeds installed with the same type, dtype,
  shape, values (bit for bit), device set and memory kind;
* a call that fails on stock either works installed, or raises an instance of
  stock's exception class.

A case is (entry point, producer factory, keyword arguments).  The factory is
called afresh for each run, so a consumed capsule or a donated buffer of one
run never reaches the other.  The CPU suite (tests/cpu/test_dropin.py) and
the GPU suite (tests/gpu/test_dropin_gpu.py) build their tables from these
pieces."""

from __future__ import annotations

import collections
import dataclasses
import itertools

import jax
import jax.dlpack
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_overlay

# 64-bit, bool, bfloat16 and float8 among them: the types whose handling
# differs most between paths.
DTYPES = tuple(np.dtype(t) for t in (
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
    np.int64, np.uint64, np.float16, np.float32, np.float64, np.complex64,
    np.complex128, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn))


def _random(n, dtype, rng):
    if dtype == np.bool_:
        return rng.integers(0, 2, n) == 1
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    return (rng.standard_normal(n) * 8).astype(dtype)


def values(shape, dtype, seed=0):
    """Deterministic data of every dtype, the same for both runs, in host
    memory aligned to 64 bytes (what jaxlib views without a copy): both runs
    must see the same alignment, which NumPy's allocator does not promise."""
    n = int(np.prod(shape))
    nbytes = n * dtype.itemsize
    buf = np.empty(nbytes + 64, np.uint8)
    start = -buf.ctypes.data % 64
    out = buf[start:start + nbytes].view(dtype).reshape(shape)
    out[...] = _random(n, dtype, np.random.default_rng(seed)).reshape(shape)
    return out


def layout(base, name):
    """A view of `base` (at least 2-D, 8 x 16 items) with the named layout."""
    if name == "aligned":
        return base
    if name == "unaligned":     # one item on: the data pointer loses its alignment
        return base.reshape(-1)[1:]
    if name == "strided":       # every other column
        return base[:, ::2]
    if name == "reversed":      # negative strides
        return base[::-1]
    if name == "transposed":    # a compact permutation (F order)
        return base.T
    if name == "0d":
        return base.reshape(-1)[3]
    if name == "empty":
        return base[:0]
    raise ValueError(name)


LAYOUTS = ("aligned", "unaligned", "strided", "reversed", "transposed", "0d", "empty")


# --- entry points: (producer, copy, device) -> result -----------------------
# Each looks its function up at call time: install() replaces them.

def _kw(copy, device):
    kw = {}
    if copy is not None:
        kw["copy"] = copy
    if device is not None:
        kw["device"] = device
    return kw


def jax_dlpack_from_dlpack(x, copy, device):
    return jax.dlpack.from_dlpack(x, **_kw(copy, device))


def jnp_from_dlpack(x, copy, device):
    return jnp.from_dlpack(x, **_kw(copy, device))


def jnp_asarray(x, copy, device):
    return jnp.asarray(x, **_kw(copy, device))


def jnp_array(x, copy, device):
    return jnp.array(x, **_kw(copy, device))


def device_put(x, copy, device):
    may_alias = None if copy is None else not copy
    return jax.device_put(x, device, may_alias=may_alias)


IMPORTS = {f.__name__: f for f in (jax_dlpack_from_dlpack, jnp_from_dlpack,
                                   jnp_asarray, jnp_array, device_put)}


# --- the entry points install() replaces ------------------------------------
# The class-dict entries are read from the class dict: a property must be
# compared as the property object, not evaluated.

_ARRAY = type(jnp.zeros(1))
ENTRY_POINTS = ((jnp, "asarray"), (jnp, "array"), (jnp, "from_dlpack"),
                (jax.dlpack, "from_dlpack"), (jax, "device_put"),
                (_ARRAY, "__dlpack__"), (_ARRAY, "__dlpack_device__"),
                (_ARRAY, "__cuda_array_interface__"))


def _name(owner, name):
    return f"{getattr(owner, '__name__', owner)}.{name}"


def current_entry_points():
    """{(owner, name): the object JAX serves there now}."""
    return {(owner, name): owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            for owner, name in ENTRY_POINTS}


def _stock_entry_points():
    """JAX's own objects.  A test may have called install() before this
    module is imported: then they are the ones install() saved, not what
    JAX serves now."""
    from jax_overlay import _install
    saved = dict(_install._saved)
    if not saved:
        return current_entry_points()
    missing = [_name(*key) for key in ENTRY_POINTS if key not in saved]
    if missing:
        raise AssertionError(f"install() saved no original of {', '.join(missing)}")
    return {key: saved[key] for key in ENTRY_POINTS}


STOCK = _stock_entry_points()


def check_stock():
    """Raises unless every entry point is JAX's own object: a "stock" run
    that is not stock compares installed with installed and proves nothing."""
    now = current_entry_points()
    off = [_name(*key) for key in ENTRY_POINTS if now[key] is not STOCK[key]]
    if off:
        raise AssertionError(f"after uninstall(), not JAX's own: {', '.join(off)}")


def check_installed():
    """Raises unless install() replaced every entry point."""
    now = current_entry_points()
    off = [_name(*key) for key in ENTRY_POINTS if now[key] is STOCK[key]]
    if off:
        raise AssertionError(f"after install(), still JAX's own: {', '.join(off)}")


# --- outcomes ---------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    result: object = None
    error: BaseException | None = None

    def describe(self):
        if self.error is not None:
            first = str(self.error).splitlines()[0] if str(self.error) else ""
            return f"raised {type(self.error).__module__}.{type(self.error).__qualname__}: {first[:200]}"
        return f"returned {summary(self.result)}"


def summary(r):
    if isinstance(r, jax.Array):
        return (f"jax.Array {r.dtype}{list(r.shape)} on {sorted(map(str, r.devices()))} "
                f"({r.sharding.memory_kind})")
    if isinstance(r, np.ndarray):
        return f"numpy {r.dtype}{list(r.shape)}"
    return f"{type(r).__qualname__} {r!r:.80}"


def run(fn):
    try:
        return Outcome(result=fn())
    except Exception as e:  # every class is compared, none is expected
        return Outcome(error=e)


def _host_bytes(a):
    """The array's values as host bytes, for a bit-exact comparison."""
    h = np.asarray(a)
    return h.dtype, h.shape, np.ascontiguousarray(h).tobytes()


def same_result(a, b):
    """None if `b` (installed) is what `a` (stock) is by the rule, else why not."""
    if type(a) is not type(b):
        return f"type {type(a).__qualname__} != {type(b).__qualname__}"
    if isinstance(a, jax.Array):
        if a.dtype != b.dtype:
            return f"dtype {a.dtype} != {b.dtype}"
        if a.shape != b.shape:
            return f"shape {a.shape} != {b.shape}"
        if a.devices() != b.devices():
            return f"devices {a.devices()} != {b.devices()}"
        if a.sharding.memory_kind != b.sharding.memory_kind:
            return f"memory kind {a.sharding.memory_kind} != {b.sharding.memory_kind}"
        if a.weak_type != b.weak_type:
            return f"weak_type {a.weak_type} != {b.weak_type}"
        if _host_bytes(a) != _host_bytes(b):
            return "values differ"
        return None
    if isinstance(a, np.ndarray):
        if _host_bytes(a) != _host_bytes(b):
            return "values differ"
        return None
    if isinstance(a, (tuple, list)):  # pytrees (device_put's), pairs of ints
        if len(a) != len(b):
            return f"length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            why = same_result(x, y)
            if why is not None:
                return f"[{i}]: {why}"
        return None
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"keys {sorted(a)} != {sorted(b)}"
        for k in a:
            why = same_result(a[k], b[k])
            if why is not None:
                return f"[{k!r}]: {why}"
        return None
    if isinstance(a, (int, float, str, type(None))):
        return None if a == b else f"{a!r} != {b!r}"
    return None  # capsules and the like are compared through their consumers


def _pointer(obj):
    """Where `obj`'s data starts, where it says without being consumed
    (JAX arrays, NumPy, the CUDA Array Interface, PyTorch), else None."""
    try:
        if isinstance(obj, jax.Array):
            return obj.unsafe_buffer_pointer()
        for attr in ("__array_interface__", "__cuda_array_interface__"):
            d = getattr(obj, attr, None)
            if isinstance(d, dict):
                return d["data"][0]
        if callable(getattr(obj, "data_ptr", None)):
            return obj.data_ptr()
    except Exception:  # sharded, deleted, or not telling: unknown
        return None
    return None


def aliases(result, made):
    """Whether a JAX array `result` is a view of the input `made` (same data
    pointer), or None where that cannot be told (no array, zero size, an
    input that does not say where its data is)."""
    if not isinstance(result, jax.Array) or made is None or result.size == 0:
        return None
    a, b = _pointer(result), _pointer(made)
    return None if not a or not b else a == b


class MadeInput:
    """A case's thunk that keeps the input it made (`made`), so the
    differential can tell a new buffer from a view of the input."""

    def __init__(self, entry, make, copy, device):
        self.entry, self.make, self.copy, self.device = entry, make, copy, device
        self.made = None

    def __call__(self):
        self.made = self.make()
        return self.entry(self.made, self.copy, self.device)


def compare(stock, ours):
    """None if the installed outcome obeys the rule, else the difference."""
    if stock.error is None:
        if ours.error is not None:
            return f"stock {stock.describe()}, installed {ours.describe()}"
        why = same_result(stock.result, ours.result)
        return None if why is None else f"stock {stock.describe()}, installed {ours.describe()}: {why}"
    if ours.error is None or isinstance(ours.error, type(stock.error)):
        return None
    return (f"stock {stock.describe()}, installed {ours.describe()}: "
            f"not an instance of {type(stock.error).__qualname__}")


def wrong(result, truth):
    """Why a JAX array read from a producer is not its true values (the
    producer's data as JAX converts it), or None.  Only arrays are judged."""
    if truth is None or not isinstance(result, jax.Array):
        return None
    want = np.asarray(truth)
    # Its own dtype, or JAX's 32-bit narrowing of it: stock JAX gives either,
    # by entry point (jnp.asarray of a 64-bit JAX array keeps 64 bits).
    if result.dtype not in (want.dtype, jax.dtypes.canonicalize_dtype(want.dtype)):
        return f"dtype {result.dtype} for {want.dtype} data"
    if result.shape != want.shape:
        return f"shape {result.shape} for {want.shape} data"
    try:
        got = _host_bytes(result)
    except Exception as e:  # a view XLA cannot read (stock's misaligned GPU views)
        return f"unreadable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    if got != _host_bytes(want.astype(result.dtype)):
        return "values are not the producer's"
    return None


def differential(cases):
    """Runs each (label, thunk, truth) stock then installed; returns the
    differences, each a line naming the case, and counts.  `truth()` gives
    the producer's values (or None): what installed returns must be them,
    and a stock result that is not them (a stale or misread array) is
    unsafe, the one outcome installed may change.  Leaves JAX as it found
    it.  Raises AssertionError where uninstall() leaves an entry point that
    is not JAX's own (STOCK) or install() leaves one that is.  counts["stock
    raised"] is how many cases stock refused."""
    was = jax_overlay.installed()
    diffs = []
    counts = {"stock ok": 0, "stock raised": 0, "installed works where stock raised": 0,
              "stock unsafe, installed right": 0, "stock unsafe, installed refused": 0}
    try:
        for label, thunk, truth in cases:
            want = truth() if truth is not None else None
            jax_overlay.uninstall()
            check_stock()
            stock = run(thunk)
            # Stock is judged before installed runs: a stock result over
            # memory its producer no longer holds fails when read, possibly
            # asynchronously, and that failure is stock's, never the next
            # read's.
            unsafe = None if stock.error is not None else wrong(stock.result, want)
            stock_view = aliases(stock.result, getattr(thunk, "made", None))
            jax_overlay.install()
            check_installed()
            ours = run(thunk)
            ours_view = aliases(ours.result, getattr(thunk, "made", None))
            if hasattr(thunk, "made"):
                thunk.made = None
            counts["stock ok" if stock.error is None else "stock raised"] += 1
            if stock.error is not None and ours.error is None:
                counts["installed works where stock raised"] += 1
            why = None if ours.error is not None else wrong(ours.result, want)
            if why is not None:
                why = f"installed {ours.describe()}: {why}"
            elif unsafe is not None:
                # Installed reads the right values, or refuses as the
                # protocols refuse (BufferError: copy=False where only a
                # copy reads right).
                if ours.error is None:
                    counts["stock unsafe, installed right"] += 1
                elif isinstance(ours.error, BufferError):
                    counts["stock unsafe, installed refused"] += 1
                else:
                    why = f"stock {stock.describe()} (unsafe: {unsafe}), installed {ours.describe()}"
            else:
                why = compare(stock, ours)
                if why is None and stock_view is False and ours_view:
                    # Stock made a new buffer: installed must not hand back
                    # the input's (a later donation or deletion of one
                    # would take the other).
                    why = (f"stock returned a new buffer, installed {ours.describe()} "
                           "is a view of the input")
            if why is not None:
                diffs.append(f"{label}: {why}")
            del stock, ours
    finally:
        (jax_overlay.install if was else jax_overlay.uninstall)()
    TOTALS.update(counts)
    TOTALS["differences"] += len(diffs)
    return diffs, counts


def import_cases(entries, producers, coords, truth=None):
    """(label, thunk, truth) for every entry x producer x (copy, device)
    coordinate.  `producers`: {name: factory}; `coords`: [(copy,
    device_name, device)]; `truth(producer)`: its values on the host."""
    for (ename, entry), (pname, make), (copy, dname, device) in itertools.product(
            entries.items(), producers.items(), coords):
        yield (f"{ename}({pname}, copy={copy}, device={dname})",
               MadeInput(entry, make, copy, device),
               None if truth is None else lambda make=make: truth(make()))


COPIES = (None, True, False)

# Every differential run of the session, summed (tests/conftest.py prints it).
TOTALS: collections.Counter = collections.Counter()
