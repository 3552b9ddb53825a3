"""A seeded, adversarial differential fuzz of the drop-in rule (docs/DROPIN.md).

`case(seed, index)` draws a random producer and a random entry point with
random keyword values (valid, edge and invalid mixed), from a generator
seeded by (seed, index) alone, so any case replays alone.  `run_case` runs
it on stock JAX (after `jax_overlay.uninstall()`, checked against JAX's own entry points
by tests/dropin.py's check_stock)
and then installed, and compares the two outcomes by the rule:

* stock succeeds: installed succeeds with the same Python type, dtype,
  shape, values (bit for bit, any NaN equal to any NaN), weak type, device
  set, memory kind, committedness and sharding; a DLPack capsule with the
  same name, version, flags, device, dtype, shape, strides and bytes;
* stock raises: installed succeeds (counted) or raises an instance of
  stock's class.

Both runs are also judged against the producer itself: a result that is not
the producer's values, or that aliases the producer where a copy was asked
for, is unsafe.  Installed must never be unsafe; a stock result that is, is
counted and listed (the one outcome installed may change), not failed.

Every outcome is reduced to plain data (a flat dict of fields) as soon as
its run ends: no JAX object, capsule or exception crosses from the stock run
into the installed one, and a result over memory its producer no longer
holds is read while that producer is still held.

Whitelists (counted apart, never silent), in `judge`:
  (a) LEGACY_JAXLIB_VERSIONED: on a jaxlib without native DLPack 1.x the
      overlay exports a versioned, read-only capsule where stock gives a
      legacy one for a max_version >= (1, 0) request;
  (b) "version minor": a DLPack minor version other than stock's is a
      difference of its own category, failing unless allow_version_minor;
  (c) "stock unsafe": stock's result aliases on a copy, or is not the
      producer's values.

GPU producers (CuPy, PyTorch, Numba) are families registered in FAMILIES by
tests/gpu/fuzz_gpu.py, drawn only when asked for by name (`case(seed, index,
family)`, `run_range(..., family=)`), from a stream of their own: without
them, the registry is empty and every CPU case is what it was.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import hashlib
import re
import time
import warnings
import zlib

import jax
import jax.dlpack
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax._src.lib import jaxlib_extension_version
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from numpy.lib.array_utils import byte_bounds

import dropin
import jax_overlay

# --- stock, captured before jax_overlay ever installs ------------------------


# One check of stock for both differentials (tests/dropin.py): every entry
# point install() replaces is JAX's own object after uninstall(), and none
# is after install().
STOCK = dropin.STOCK
assert_stock = dropin.check_stock
assert_installed = dropin.check_installed


# --- pools -------------------------------------------------------------------

FLOAT8 = tuple(np.dtype(getattr(ml_dtypes, n)) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu"))
INT4 = (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4))
DTYPES = tuple(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
    ml_dtypes.bfloat16)) + FLOAT8 + INT4
DTYPE_NAMES = {d.name: d for d in DTYPES}
FLOATS = {np.dtype(t) for t in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16)}
FLOATS |= set(FLOAT8)

SHAPES = ((), (0,), (1,), (5,), (3, 4), (0, 3), (2, 3, 4), (3, 1, 0), (2, 1, 3, 2))
# A leading dimension two devices divide.
SHARDABLE = ((2,), (4, 3), (2, 0), (2, 3, 2), (2, 1, 2, 2))
LAYOUTS = ("C", "F", "step", "neg", "broadcast", "misaligned", "byteswap", "readonly",
           "subclass", "masked")


def _devices():
    return jax.devices()


def _two():
    """The first two devices (one where only one exists: a 1-device run
    resolves the same case to its one device)."""
    return _devices()[:2]


def _sharding2(spec):
    return NamedSharding(Mesh(np.array(_two()), ("x",)), spec)


@dataclasses.dataclass(frozen=True)
class Pool:
    """The values of one keyword, by label (deterministic text for
    descriptions) -> thunk (devices exist only at run time): `valid` ones,
    and `edge` ones (odd, wrong, or right only elsewhere), drawn with
    probability EDGE so that most calls still get past argument checks."""
    valid: dict
    edge: dict = dataclasses.field(default_factory=dict)

    def draw(self, rng):
        side = self.edge if self.edge and rng.random() < EDGE else self.valid
        return _label(rng, side)

    def make(self, label):
        return (self.valid.get(label) or self.edge[label])()


EDGE = 0.3


def _consts_plain(*values):
    return {repr(v): v for v in values}


def _consts(*values):
    return {k: (lambda v=v: v) for k, v in _consts_plain(*values).items()}


DEVICE = Pool({"None": lambda: None,
               "devices()[0]": lambda: _devices()[0], "devices()[-1]": lambda: _devices()[-1],
               "SingleDeviceSharding(devices()[-1])": lambda: SingleDeviceSharding(_devices()[-1]),
               "NamedSharding(devices()[:2], P())": lambda: _sharding2(PartitionSpec())},
              {**_consts(0, False, "cpu"), "devices()": _devices, "object()": object})
COPY = Pool(_consts(None, True, False), _consts(0, 1, "no", np.True_))
STREAM = Pool(_consts(None), _consts(-1, 0, 1, 2, -2, True, 2**64, "x"))
MAX_VERSION = Pool(_consts(None, (1, 0), (1, 3), (0, 8), (2, 0)),
                   _consts((), (1,), [1, 0], (1.0, 0), "x", (3, 0)))
DL_DEVICE = Pool(_consts(None, (1, 0), (1, 1)), _consts((2, 0), (3, 0), (1,), (), "x", (1.0, 0)))
DTYPE = Pool({"None": lambda: None, "float32": lambda: np.float32, "int64": lambda: np.int64,
              "bool": lambda: np.bool_, "bfloat16": lambda: ml_dtypes.bfloat16},
             {"'U3'": lambda: "U3", "object()": object})
ORDER = Pool(_consts("K"), _consts("C", "F", "A", "x"))
NDMIN = Pool(_consts(0, 1, 2, 3))
MAY_ALIAS = Pool(_consts(None, True, False))

# entry -> {keyword: pool}; each keyword is passed with probability 1/2.
# device_put's device is its second positional argument ("device" here).
KEYWORDS = {
    "jax.dlpack.from_dlpack": {"device": DEVICE, "copy": COPY},
    "jnp.from_dlpack": {"device": DEVICE, "copy": COPY},
    "jnp.asarray": {"dtype": DTYPE, "copy": COPY, "device": DEVICE, "order": ORDER},
    "jnp.array": {"dtype": DTYPE, "copy": COPY, "ndmin": NDMIN, "order": ORDER, "device": DEVICE},
    "jax.device_put": {"device": DEVICE, "may_alias": MAY_ALIAS},
    "x.__dlpack__": {"stream": STREAM, "max_version": MAX_VERSION, "dl_device": DL_DEVICE,
                     "copy": COPY},
    "x.__dlpack_device__": {},
    "x.__cuda_array_interface__": {},
    "hasattr(x, '__cuda_array_interface__')": {},
    "np.from_dlpack": {"device": Pool(_consts("cpu")), "copy": COPY},
}
IMPORTS = ("jax.dlpack.from_dlpack", "jnp.from_dlpack", "jnp.asarray", "jnp.array",
           "jax.device_put")
EXPORTS = ("x.__dlpack__", "x.__dlpack__", "x.__dlpack_device__", "x.__cuda_array_interface__",
           "hasattr(x, '__cuda_array_interface__')", "np.from_dlpack", "np.from_dlpack")


# --- host data ---------------------------------------------------------------

def _values(dtype, n, rng):
    """n deterministic values of `dtype`, with NaN, infinities, -0.0 and
    subnormals among the floats."""
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind in "iu" or dtype in INT4:
        info = ml_dtypes.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max), n, endpoint=True,
                            dtype=np.int64 if info.min < 0 else np.uint64).astype(dtype)

    def reals():
        x = rng.standard_normal(n) * 4
        special = rng.random(n) < 0.15
        x[special] = rng.choice([np.nan, np.inf, -np.inf, -0.0, 1e-40, 6e4, 1e300],
                                int(special.sum()))
        return x
    with np.errstate(all="ignore"):
        if dtype.kind == "c":
            return (reals() + 1j * reals()).astype(dtype)
        return reals().astype(dtype)


def _empty(shape, dtype, offset=0):
    """An array `offset` bytes past a 256-byte boundary.  Whether jaxlib
    views host memory or copies it (and so whether stock's copy=True
    aliases, or its CPU export accepts a stream) depends on the alignment,
    so both runs, and every replay, must get the same one: NumPy's
    allocator does not promise it, nor does a zero-size slice keep its
    offset (ndarray(buffer=, offset=) does)."""
    n = int(np.prod(shape, dtype=np.int64))
    buf = np.zeros(n * dtype.itemsize + 512, np.uint8)
    return np.ndarray(shape, dtype, buffer=buf, offset=-buf.ctypes.data % 256 + offset)


class Sub(np.ndarray):
    """A NumPy subclass that adds nothing."""


def host(dtype, shape, layout, vseed):
    """A fresh NumPy producer: `shape` of `dtype` values from `vseed`, laid
    out as `layout` (layouts that need an axis fall back to C for rank 0)."""
    rng = np.random.default_rng(vseed)
    vals = _values(dtype, int(np.prod(shape, dtype=np.int64)), rng).reshape(shape)
    nd = len(shape)
    if layout == "F":
        a = _empty(shape[::-1], dtype).T
    elif layout == "step" and nd:
        a = _empty((shape[0] * 2,) + shape[1:], dtype)[::2]
    elif layout == "neg" and nd:
        a = _empty(shape, dtype)[(slice(None, None, -1),) * nd]
    elif layout == "broadcast" and nd:
        row = _empty((1,) + shape[1:], dtype)
        row[...] = vals[:1] if shape[0] else 0
        return np.broadcast_to(row, shape)  # stride 0, read-only
    elif layout == "misaligned":
        a = _empty(shape, dtype, offset=dtype.itemsize)
    elif layout == "byteswap" and dtype.kind in "iufc" and dtype.itemsize > 1:
        a = _empty(shape, dtype.newbyteorder())
    else:
        a = _empty(shape, dtype)
    a[...] = vals
    if layout == "readonly":
        a.flags.writeable = False
    elif layout == "subclass":
        a = a.view(Sub)
    elif layout == "masked":
        a = np.ma.masked_array(a, mask=rng.integers(0, 2, shape).astype(bool))
    return a


def _root_range(a):
    """The memory of `a`'s whole allocation (a view's base's)."""
    a = np.asarray(a)
    while isinstance(a.base, np.ndarray):
        a = a.base
    return byte_bounds(a)


def _jax_ranges(x):
    """Memory of each addressable shard of a JAX array; none once deleted."""
    try:
        return [(s.data.unsafe_buffer_pointer(),
                 s.data.unsafe_buffer_pointer() + max(s.data.nbytes, 1))
                for s in x.addressable_shards if s.data.size]
    except Exception:  # deleted or donated: nothing to alias
        return []


# --- producers ---------------------------------------------------------------

@dataclasses.dataclass
class Produced:
    obj: object            # what the entry point is given
    truth: object = None   # its values as NumPy, where known
    ranges: list = dataclasses.field(default_factory=list)  # its memory
    keep: object = None    # what must outlive the call
    # GPU families (tests/gpu/fuzz_gpu.py): a context the call runs in (the
    # producer's current stream and device), and `release(produced)`, which
    # drops the producer and reuses its memory before the result is read.
    around: object = None
    release: object = None


OWN = "own"  # a Proto's __dlpack_device__ is its inner array's


class Proto:
    """Only the DLPack protocol, over an inner array; `device` (unless OWN)
    is what __dlpack_device__ claims, right, wrong or junk."""

    def __init__(self, inner, device):
        self.inner, self.device = inner, device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return self.inner.__dlpack__(stream=stream, max_version=max_version,
                                     dl_device=dl_device, copy=copy)

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__() if self.device is OWN else self.device


class LegacyProto(Proto):
    """A producer from before DLPack 1.0: no keyword but stream."""

    def __dlpack__(self, stream=None):
        return self.inner.__dlpack__(stream=stream)


class CAI:
    """A __cuda_array_interface__ over host memory, as a GPU producer would
    describe device memory; `make(a)` builds the dict (or junk)."""

    def __init__(self, a, make):
        self.a, self.make = a, make

    @property
    def __cuda_array_interface__(self):
        return self.make(self.a)


class JaxArrayLike:
    def __init__(self, make):
        self.make = make

    def __jax_array__(self):
        return self.make()


class RaisingDLPack:
    def __dlpack__(self, **kw):
        raise RuntimeError("producer failed in __dlpack__")

    def __dlpack_device__(self):
        return (1, 0)


class RaisingDevice:
    def __dlpack__(self, **kw):
        return np.arange(3).__dlpack__(**kw)

    def __dlpack_device__(self):
        raise RuntimeError("producer failed in __dlpack_device__")


def _cai_dict(a, version=3, **extra):
    d = {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False),
         "version": version, "strides": None if a.flags.c_contiguous else a.strides}
    if version >= 3:
        d["stream"] = None
    d.update(extra)
    return d


CAI_VARIANTS = {
    "v2": lambda a: _cai_dict(a, 2),
    "v3": lambda a: _cai_dict(a),
    "v3 stream=1": lambda a: _cai_dict(a, stream=1),
    "v3 stream=2": lambda a: _cai_dict(a, stream=2),
    "explicit strides": lambda a: _cai_dict(a, strides=a.strides),
    "mask": lambda a: _cai_dict(a, mask=np.ones(a.shape, bool)),
    "read-only": lambda a: _cai_dict(a, data=(a.ctypes.data, True)),
    "junk {}": lambda a: {},
    "junk no data": lambda a: {k: v for k, v in _cai_dict(a).items() if k != "data"},
    "junk null data": lambda a: _cai_dict(a, data=(0, False)),
    "junk typestr": lambda a: _cai_dict(a, typestr="zz9"),
    "junk version": lambda a: _cai_dict(a, version=99),
    "junk str": lambda a: "not a dict",
}
PROTO_DEVICES = {OWN: OWN, **_consts_plain((1, 1), (3, 0), (2, 0), (13, 0), (99, 0), None, (1,),
                                           "cpu", (1.0, 0))}
JAX_PLACES = ("default", "devices()[0]", "devices()[-1]", "sharded2", "replicated2")
JAX_STATES = ("live", "live", "live", "deleted", "donated input", "donated output")
JUNK = ("None", "'abc'", "{'a': host}", "[host, host]", "[jax, jax]", "(1, 2.5)", "7", "2.5",
        "(1+2j)", "True", "2**70", "object()", "__dlpack__ raises", "__dlpack_device__ raises")
WEAK = {"3": 3, "2.5": 2.5, "True": True, "(1-2j)": 1 - 2j}

_donate = jax.jit(lambda a: a, donate_argnums=0)
# A fresh XLA buffer (jit does not forward an unchanged input), weak type kept.
_fresh = jax.jit(lambda a: a)


def _jax(host_array, place, state):
    """A JAX producer made with stock's own functions (the installed run's
    factory must not go through the overlay to make its producer).  On the
    CPU, JAX views aligned host memory rather than copying it, and stock's
    export then takes a stream= it otherwise refuses: so the memory JAX
    gets must be aligned the same way in every run, which it is not when
    JAX narrows 64-bit data into NumPy's memory itself."""
    canonical = jax.dtypes.canonicalize_dtype(host_array.dtype)
    if canonical != host_array.dtype:
        narrowed = _empty(host_array.shape, canonical)
        narrowed[...] = host_array
        host_array = narrowed
    put = STOCK[(jax, "device_put")]
    if place == "default":
        x = STOCK[(jnp, "asarray")](host_array)
    elif place == "sharded2":
        x = put(host_array, _sharding2(PartitionSpec("x")))
    elif place == "replicated2":
        x = put(host_array, _sharding2(PartitionSpec()))
    else:
        x = put(host_array, DEVICE.make(place))
    if state == "deleted":
        x.delete()
    elif state.startswith("donated"):
        y = _donate(x)
        if state == "donated output":
            x = y
    return x


def _jax_produced(x):
    live = not x.is_deleted()
    return Produced(x, np.asarray(x) if live else None, _jax_ranges(x) if live else [])


def _host_produced(a, obj=None):
    return Produced(a if obj is None else obj, np.asarray(a), [_root_range(a)], keep=a)


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    index: int
    family: str           # numpy, jax, weak, protocol, cai, capsule, jax_array, junk,
                          # or a registered one (FAMILIES)
    params: tuple         # ((name, value label), ...), all hashable and printable
    entry: str
    kwargs: tuple         # ((keyword, value label), ...)

    def describe(self):
        p = ", ".join(f"{k}={v}" for k, v in self.params)
        kw = "".join(f", {k}={v}" for k, v in self.kwargs)
        return f"{self.entry}[{self.family}({p}){kw}]"

    def produce(self):
        """A fresh producer (one per run)."""
        if self.family in FAMILIES:
            return FAMILIES[self.family].produce(self)
        p = dict(self.params)
        dtype = DTYPE_NAMES.get(p.get("dtype"))
        vseed = (self.seed, self.index, 1)
        f = self.family
        if f == "numpy":
            return _host_produced(host(dtype, p["shape"], p["layout"], vseed))
        if f == "jax":
            return _jax_produced(_jax(host(dtype, p["shape"], "C", vseed), p["place"], p["state"]))
        if f == "weak":
            return _jax_produced(_fresh(STOCK[(jnp, "asarray")](WEAK[p["value"]])))
        if f == "protocol":
            a = host(dtype, p["shape"], p["layout"], vseed)
            device = PROTO_DEVICES[p["device"]]
            kind = LegacyProto if p["signature"] == "legacy" else Proto
            if p["inner"] == "jax":
                x = _jax(a, "devices()[-1]", "live")
                return Produced(kind(x, device), np.asarray(x), _jax_ranges(x), keep=x)
            return _host_produced(a, kind(a, device))
        if f == "cai":
            a = host(dtype, p["shape"], p["layout"], vseed)
            return _host_produced(a, CAI(a, CAI_VARIANTS[p["variant"]]))
        if f == "capsule":
            a = host(dtype, p["shape"], "C", vseed)
            try:
                cap = a.__dlpack__(max_version=(1, 0)) if p["versioned"] else a.__dlpack__()
            except BufferError as e:
                raise Unavailable(f"NumPy {np.__version__} exports no {dtype} capsule: {e}") from e
            return Produced(cap, np.asarray(a), [_root_range(a)], keep=a)
        if f == "jax_array":
            a = host(dtype, p["shape"], "C", vseed)
            return Produced(JaxArrayLike(lambda: STOCK[(jnp, "asarray")](a)), np.asarray(a),
                            [_root_range(a)], keep=a)
        return _junk(p["value"], vseed)

    def call(self, x):
        """The entry point on `x`, looked up now (install() replaces them)."""
        kw = self.keywords()
        e = self.entry
        if e == "jax.dlpack.from_dlpack":
            return jax.dlpack.from_dlpack(x, **kw)
        if e == "jnp.from_dlpack":
            return jnp.from_dlpack(x, **kw)
        if e == "jnp.asarray":
            return jnp.asarray(x, **kw)
        if e == "jnp.array":
            return jnp.array(x, **kw)
        if e == "jax.device_put":
            return jax.device_put(x, *[kw.pop("device")] if "device" in kw else [], **kw)
        if e == "x.__dlpack__":
            return x.__dlpack__(**kw)
        if e == "x.__dlpack_device__":
            return x.__dlpack_device__()
        if e == "x.__cuda_array_interface__":
            return x.__cuda_array_interface__
        if e == "hasattr(x, '__cuda_array_interface__')":
            return hasattr(x, "__cuda_array_interface__")
        return np.from_dlpack(x, **kw)

    def keywords(self):
        """The keyword values, made afresh (devices, shardings, object())."""
        pools = FAMILIES[self.family].keywords if self.family in FAMILIES else KEYWORDS
        return {k: pools[self.entry][k].make(v) for k, v in self.kwargs}

    def asks_copy(self):
        kw = self.keywords()
        if self.entry == "jax.device_put":
            return kw.get("may_alias") is False
        copy = kw.get("copy", self.entry == "jnp.array")  # jnp.array copies by default
        # Only real booleans: how 1 or 'no' read is itself under test.
        return copy is True or (isinstance(copy, np.bool_) and bool(copy))


def _junk(value, vseed):
    a = host(np.dtype(np.float32), (3,), "C", vseed)
    made = {
        "None": lambda: None, "'abc'": lambda: "abc", "{'a': host}": lambda: {"a": a},
        "[host, host]": lambda: [a, a],
        "[jax, jax]": lambda: [STOCK[(jnp, "asarray")](a), STOCK[(jnp, "asarray")](a)],
        "(1, 2.5)": lambda: (1, 2.5), "7": lambda: 7, "2.5": lambda: 2.5,
        "(1+2j)": lambda: 1 + 2j, "True": lambda: True, "2**70": lambda: 2**70,
        "object()": object, "__dlpack__ raises": RaisingDLPack,
        "__dlpack_device__ raises": RaisingDevice,
    }[value]()
    return Produced(made, None, [_root_range(a)], keep=a)


def _label(rng, pool):
    keys = list(pool)
    return keys[rng.integers(len(keys))]


def _pick(rng, seq):
    return seq[rng.integers(len(seq))]


# name -> a registered producer family (tests/gpu/fuzz_gpu.py): draw(rng) ->
# params, produce(case) -> Produced, unavailable() -> None or why not,
# entries, keywords ({entry: {keyword: Pool}}) and counts (a Counter).  Empty
# unless that module is imported: the CPU fuzz never draws from it.
FAMILIES: dict = {}


def case(seed: int, index: int, family: str | None = None) -> Case:
    """The case `index` of `seed`: a function of the two alone (and of
    `family`, a registered family's name, for its cases)."""
    if family is not None:
        return _family_case(seed, index, family)
    rng = np.random.default_rng((seed, index))
    family = _pick(rng, ("numpy",) * 6 + ("jax",) * 6 + ("weak",) + ("protocol",) * 3
                   + ("cai",) * 2 + ("capsule", "jax_array") + ("junk",) * 2)
    dtype = _pick(rng, DTYPES).name
    shape = _pick(rng, SHAPES)
    layout = _pick(rng, LAYOUTS)
    if family == "numpy":
        params = (("dtype", dtype), ("shape", shape), ("layout", layout))
    elif family == "jax":
        place, state = _pick(rng, JAX_PLACES), _pick(rng, JAX_STATES)
        if place in ("sharded2", "replicated2"):
            shape = _pick(rng, SHARDABLE)
        params = (("dtype", dtype), ("shape", shape), ("place", place), ("state", state))
    elif family == "weak":
        params = (("value", _label(rng, WEAK)),)
    elif family == "protocol":
        inner = _pick(rng, ("numpy", "numpy", "jax"))
        params = (("dtype", dtype), ("shape", shape),
                  ("layout", layout if inner == "numpy" else "C"), ("inner", inner),
                  ("signature", _pick(rng, ("keywords", "keywords", "legacy"))),
                  ("device", _label(rng, PROTO_DEVICES) if rng.random() < 0.6 else OWN))
    elif family == "cai":
        params = (("dtype", dtype), ("shape", shape), ("layout", layout),
                  ("variant", _label(rng, CAI_VARIANTS)))
    elif family == "capsule":  # NumPy exports every dtype here but int4's
        dtype = _pick(rng, DTYPES[:-len(INT4)]).name
        params = (("dtype", dtype), ("shape", shape), ("versioned", bool(rng.integers(2))))
    elif family == "jax_array":
        params = (("dtype", dtype), ("shape", shape))
    else:
        params = (("value", _pick(rng, JUNK)),)
    entries = IMPORTS + EXPORTS if family in ("jax", "weak") else IMPORTS
    entry = _pick(rng, entries)
    kwargs = tuple((k, pool.draw(rng)) for k, pool in KEYWORDS[entry].items()
                   if rng.random() < 0.5)
    return Case(seed, index, family, params, entry, kwargs)


def _family_case(seed, index, family):
    """A registered family's case, from a stream of its own ((seed, index)
    and the family's name): the CPU cases are untouched, and one family's
    cases do not depend on which others run."""
    fam = FAMILIES[family]
    rng = np.random.default_rng((seed, index, zlib.crc32(family.encode())))
    params = fam.draw(rng)
    entry = _pick(rng, fam.entries)
    kwargs = tuple((k, pool.draw(rng)) for k, pool in fam.keywords[entry].items()
                   if rng.random() < 0.5)
    return Case(seed, index, family, params, entry, kwargs)


# --- DLPack capsules, read with ctypes (declared from the DLPack spec) ------

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                ("dl_tensor", DLTensor)]


READ_ONLY, SUBBYTE_PADDED = 1, 4  # DLPack 1.x flags (IS_COPIED, 2, is compared as a flag)
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api = ctypes.pythonapi
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
# A consumer renames what it took, so the capsule's destructor leaves the
# tensor alone; the capsule keeps the name's pointer: these live forever.
_USED = {b"dltensor": b"used_dltensor", b"dltensor_versioned": b"used_dltensor_versioned"}


def read_capsule(cap, ranges):
    """The fields of a DLPack capsule, consumed: renamed, its bytes copied
    out, its deleter called once.  `ranges`: the producer's memory, to tell
    whether the tensor aliases it."""
    name = _api.PyCapsule_GetName(cap)
    out = {"type": "PyCapsule", "capsule name": name and name.decode()}
    if name not in _USED:
        return out
    ptr = _api.PyCapsule_GetPointer(cap, name)
    versioned = name == b"dltensor_versioned"
    m = (DLManagedTensorVersioned if versioned else DLManagedTensor).from_address(ptr)
    flags = m.flags if versioned else 0
    if versioned:
        out.update({"version major": m.version.major, "version minor": m.version.minor,
                    "flags": flags})
    try:
        out.update(_tensor_fields(m.dl_tensor, flags, ranges))
    finally:
        _api.PyCapsule_SetName(cap, _USED[name])
        if m.deleter:
            _DELETER(m.deleter)(ptr)
    return out


def _tensor_fields(t, flags, ranges):
    nd = t.ndim
    out = {"capsule device": (t.device.device_type, t.device.device_id), "ndim": nd,
           "dl dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes)}
    if not 0 <= nd <= 32:
        return out
    shape = tuple(t.shape[i] for i in range(nd))
    out["shape"] = shape
    if min(shape, default=0) < 0 or np.prod(shape, dtype=np.float64) > 1e8:
        return out
    compact = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(nd))
    strides = tuple(t.strides[i] for i in range(nd)) if t.strides else compact
    n = int(np.prod(shape, dtype=np.int64))
    # Strides of extent-1 axes carry no meaning: compared as compact's.
    out["strides"] = tuple(c if d == 1 else s for s, c, d in zip(strides, compact, shape))
    bits = t.dtype.bits * t.dtype.lanes
    start = (t.data or 0) + t.byte_offset
    if n == 0:
        out["bytes"] = ""
        return out
    if not t.data:
        out["bytes"] = "NULL data"
        return out
    if bits % 8 and not flags & SUBBYTE_PADDED:  # packed: compact by definition
        raw = ctypes.string_at(start, (n * bits + 7) // 8)
    else:
        item = max(bits // 8, 1)
        lo = sum(min(0, (d - 1) * s) for d, s in zip(shape, strides)) * item
        hi = sum(max(0, (d - 1) * s) for d, s in zip(shape, strides)) * item + item
        buf = np.frombuffer(ctypes.string_at(start + lo, hi - lo), np.uint8)
        raw = np.ascontiguousarray(np.lib.stride_tricks.as_strided(
            buf[-lo:], shape + (item,), tuple(s * item for s in strides) + (1,))).tobytes()
    out["bytes"] = hashlib.sha1(raw).hexdigest()[:12]
    out["alias"] = _overlaps([(start, start + 1)], ranges)
    return out


# --- outcomes, as plain data -------------------------------------------------

def _overlaps(a, b):
    return any(lo < hi2 and lo2 < hi for lo, hi in a for lo2, hi2 in b)


def _canonical_bytes(h):
    """Bytes of `h` with every NaN's bits zeroed (NaN == NaN, whatever its
    payload: conversions need not keep one), the NaN mask appended."""
    h = np.ascontiguousarray(h)
    if h.dtype.kind == "c":
        parts = [np.ascontiguousarray(h.real), np.ascontiguousarray(h.imag)]
    elif h.dtype in FLOATS:
        parts = [h]
    else:
        return h.tobytes()
    out = []
    for p in parts:
        nan = np.isnan(p)
        bits = p.view(f"u{p.dtype.itemsize}").copy()
        bits[nan] = 0
        out += [bits.tobytes(), nan.tobytes()]
    return b"".join(out)


def _digest(h):
    return hashlib.sha1(_canonical_bytes(h)).hexdigest()[:12]


# 64-bit data narrowed (32-bit mode, or dtype=): judged for the GPU families,
# whose lazy views (PyTorch's negative and conjugate bits) stock misreads in
# any dtype.
NARROWING = {("float64", "float32"), ("complex128", "complex64"), ("int64", "int32"),
             ("uint64", "uint32")}


def _flushed(a):
    """`a` with its subnormal and zero floats as +0.0: the part of narrowing
    XLA does its own way (it may flush where NumPy does not)."""
    if a.dtype.kind not in "fc":
        return a
    out = np.array(a)
    for part in ((out.real, out.imag) if a.dtype.kind == "c" else (out,)):
        part[np.abs(part) < np.finfo(part.dtype).tiny] = 0.0
    return out


def _truth_fields(h, truth, narrowed=False):
    """Whether host values `h` of a result are the producer's, judged where
    the call keeps their dtype: a conversion is not NumPy's everywhere (XLA
    flushes subnormals when it narrows 64-bit data in 32-bit mode).  With
    `narrowed`, also where it narrows 64-bit data, subnormals aside."""
    if truth is None:
        return {}
    t = np.asarray(truth)
    strip = lambda s: tuple(s[next((i for i, d in enumerate(s) if d != 1), len(s)):])  # noqa: E731
    if strip(h.shape) != strip(t.shape):  # ndmin= adds leading ones
        # No entry point reshapes: another shape is not the producer's array
        # (stock's jnp.asarray(obj, dtype=bool) of an object it cannot read
        # is bool(obj), a scalar; seen on the H100 for DLPack-only objects).
        return {"truth": False}
    same = h.dtype == t.dtype.newbyteorder("=")
    if not (same or narrowed and (t.dtype.name, h.dtype.name) in NARROWING) or h.size != t.size:
        return {}
    want = t.astype(h.dtype).reshape(h.shape)
    if not same:
        want, h = _flushed(want), _flushed(h)
    return {"truth": _canonical_bytes(want) == _canonical_bytes(h)}


def _host_fields(h, truth, narrowed=False):
    return {"dtype": str(h.dtype), "shape": h.shape, "values": _digest(h),
            **_truth_fields(h, truth, narrowed)}


def _try(fields, key, get):
    """fields[key] = get(), or what it raised (a deleted array's devices)."""
    try:
        fields[key] = get()
    except Exception as e:
        fields[key] = f"raised {type(e).__name__}"


def summarize(r, case, produced, top=True):
    """A result as a flat dict of comparable fields."""
    copy = top and case.asks_copy()
    narrowed = case.family in FAMILIES
    if isinstance(r, jax.Array):
        f = {"type": type(r).__qualname__, "dtype": str(r.dtype), "shape": r.shape,
             "weak_type": r.weak_type, "committed": r.committed}
        _try(f, "devices", lambda: sorted(d.id for d in r.devices()))
        _try(f, "memory kind", lambda: r.sharding.memory_kind)
        _try(f, "sharding", lambda: (type(r.sharding).__name__, r.sharding.is_fully_replicated,
                                     r.sharding.shard_shape(r.shape)))
        try:
            f.update(_host_fields(np.asarray(r), produced.truth if top else None, narrowed))
        except Exception as e:  # a deleted array's
            f["values"] = f"raised {type(e).__name__}"
            if top and produced.truth is not None and not r.is_deleted():
                # Live but unreadable: not the producer's values (a GPU view
                # over memory its producer gave back, or one XLA refuses).
                f["truth"] = False
        if top and r.size:
            # On a copy, aliasing is unsafe; otherwise it is compared: where
            # stock made a new buffer, installed must too (judge).
            _try(f, "alias" if copy else "views producer",
                 lambda: _overlaps(_jax_ranges(r), produced.ranges))
        return f
    if isinstance(r, np.ndarray):
        f = {"type": type(r).__qualname__, "writeable": r.flags.writeable,
             **_host_fields(r, produced.truth if top else None, narrowed)}
        if top and r.size:
            f["alias" if copy else "views producer"] = _overlaps([byte_bounds(r)], produced.ranges)
        return f
    if type(r).__name__ == "PyCapsule":
        f = read_capsule(r, produced.ranges)
        if not copy:
            f.pop("alias", None)
        return f
    if isinstance(r, (list, tuple, dict)):  # device_put's pytrees, __dlpack_device__'s pair
        items = r.items() if isinstance(r, dict) else enumerate(r)
        f = {"type": type(r).__qualname__, "len": len(r)}
        for k, x in items:
            if k == "data" and isinstance(x, tuple) and len(x) == 2:
                # A CUDA Array Interface's pointer: an alias of the producer or not.
                f["[data]"] = (_overlaps([(x[0], x[0] + 1)], produced.ranges), x[1])
            else:
                f.update({f"[{k!r}].{n}": v
                          for n, v in summarize(x, case, produced, False).items()})
        return f
    return {"type": type(r).__qualname__, "value": _scrub(repr(r))}


def _scrub(text):
    """Text without what changes between runs (addresses)."""
    return re.sub(r"0x[0-9a-fA-F]+", "0x?", text)


@dataclasses.dataclass
class Outcome:
    error: type | None = None
    message: str = ""
    fields: dict = dataclasses.field(default_factory=dict)

    def describe(self):
        if self.error is not None:
            return f"raised {self.error.__module__}.{self.error.__qualname__}: {self.message}"
        return "returned " + ", ".join(f"{k}={v}" for k, v in self.fields.items())


class HarnessError(RuntimeError):
    """The harness itself failed (a producer could not be made)."""


class Unavailable(Exception):
    """This environment cannot make the case's producer (NumPy < 2.5 exports
    no ml_dtypes capsule; a GPU library without the dtype, or one GPU where
    the case needs two): the case is counted as not run, by `reason`, never
    judged."""

    def __init__(self, message, reason="producer unavailable here"):
        super().__init__(message)
        self.reason = reason


def run_side(c):
    """One run of the case: producer made afresh, entry point called, the
    outcome read while the producer is still held."""
    try:
        produced = c.produce()
    except Unavailable:
        raise
    except Exception as e:
        raise HarnessError(f"{c.describe()}: producer failed: {type(e).__name__}: {e}") from e
    try:
        with produced.around or contextlib.nullcontext():
            r = c.call(produced.obj)
    except Exception as e:  # every class is compared, none is expected
        msg = str(e).splitlines()[0] if str(e) else ""
        return Outcome(type(e), _scrub(msg)[:160])
    if produced.release is not None:  # the producer is gone before its result is read
        produced.release(produced)
    try:
        return Outcome(fields=summarize(r, c, produced))
    except Exception as e:  # what the product can make fail is caught per field
        raise HarnessError(f"{c.describe()}: cannot summarize {type(r).__qualname__}") from e


# --- judging -----------------------------------------------------------------

LEGACY_JAXLIB_VERSIONED = (
    "jaxlib < 499 has no native DLPack 1.x export: stock gives a legacy capsule for "
    "max_version >= (1, 0), the overlay a versioned read-only one")
_LEGACY_FIELDS = {"capsule name", "version major", "version minor", "flags", "writeable"}


def _category(key):
    """A field's name without its position in a pytree result."""
    return re.sub(r"^(\[[^]]*\]\.)+", "", key)


def _unsafe(fields):
    return [k for k, v in fields.items()
            if (_category(k) == "alias" and v is True) or (_category(k) == "truth" and v is False)]


def _legacy_versioned(c, s, o):
    """Whitelist (a), on an old jaxlib only: a versioned read-only capsule
    (or NumPy's read-only array of one) where stock's is legacy."""
    if jaxlib_extension_version >= 499 or not o.fields.get("flags", READ_ONLY) & READ_ONLY:
        return False
    if c.entry == "np.from_dlpack":  # NumPy asks for DLPack 1.x
        return True
    # Any request that compares as >= (1, 0), as stock compares it: (1.0, 0) too.
    return (c.entry == "x.__dlpack__" and s.fields.get("capsule name") == "dltensor"
            and dict(c.kwargs).get("max_version") in ("(1, 0)", "(1, 3)", "(2, 0)", "(3, 0)",
                                                      "(1.0, 0)"))


@dataclasses.dataclass
class Verdict:
    counts: list            # non-failing categories this case adds to
    category: str | None    # the difference's category, None if the rule holds
    detail: str = ""


def judge(c, s, o, allow_version_minor=False):
    """The rule, applied to stock outcome `s` and installed outcome `o`."""
    counts = []
    if s.error is not None:
        counts.append("stock raised")
        if o.error is None:
            counts.append("installed works where stock raised")
            bad = _unsafe(o.fields)
            return Verdict(counts, "installed unsafe" if bad else None, ", ".join(bad))
        if issubclass(o.error, s.error):
            return Verdict(counts, None)
        return Verdict(counts, "exception class", f"not an instance of {s.error.__qualname__}")
    stock_bad = _unsafe(s.fields)
    if stock_bad:
        counts.append("stock unsafe")
    if o.error is not None:
        if stock_bad:
            counts.append("stock unsafe, installed refused")
            return Verdict(counts, None)
        return Verdict(counts, "outcome", "stock returned, installed raised")
    # Installed may be unsafe only where stock is, the same way.
    ours_bad = _unsafe(o.fields)
    bad = [k for k in ours_bad if k not in stock_bad]
    if bad:
        return Verdict(counts, "installed unsafe", ", ".join(bad))
    if ours_bad:
        counts.append("stock unsafe, installed too")
    # What stock's unsafety changes is not compared (installed is judged
    # against the producer above instead).
    skip = set(stock_bad)
    skip |= {k[:-len("truth")] + "values" for k in stock_bad if _category(k) == "truth"}
    # A view where stock made a new buffer shares the producer's later
    # writes: a difference.  The other way (a copy where stock viewed) is not.
    skip |= {k for k in {**s.fields, **o.fields} if _category(k) == "views producer"}
    if s.fields.get("views producer") is False:
        counts.append("stock made a new buffer")
        if o.fields.get("views producer") is True:
            return Verdict(counts, "aliasing", "stock made a new buffer, installed views the producer")
    if _legacy_versioned(c, s, o):
        counts.append("allowed: " + LEGACY_JAXLIB_VERSIONED)
        skip |= {k for k in {**s.fields, **o.fields} if _category(k) in _LEGACY_FIELDS}
    diffs = []
    for k in dict.fromkeys([*s.fields, *o.fields]):
        if k in skip or s.fields.get(k, "absent") == o.fields.get(k, "absent"):
            continue
        cat = _category(k)
        if cat == "version minor" and allow_version_minor:
            counts.append("allowed: version minor")
            continue
        diffs.append((cat, f"{k}: stock {s.fields.get(k, 'absent')!r}, "
                           f"installed {o.fields.get(k, 'absent')!r}"))
    if diffs:
        return Verdict(counts, diffs[0][0], "; ".join(d for _, d in diffs))
    return Verdict(counts, None)


# --- running -----------------------------------------------------------------

def reproducer(c, x64):
    if c.family in FAMILIES:  # a GPU family's: the devices are the machine's
        return (f"python tools/fuzz_dropin.py --gpu {c.family} --seed {c.seed} "
                f"--case {c.index} --x64 {int(x64)}")
    return (f"python tools/fuzz_dropin.py --seed {c.seed} --case {c.index} "
            f"--devices {jax.device_count()} --x64 {int(x64)}")


@dataclasses.dataclass
class Result:
    case: Case
    x64: bool
    stock: Outcome
    installed: Outcome
    verdict: Verdict

    def describe(self):
        v = self.verdict
        verdict = "ok" if v.category is None else f"DIFFERENCE [{v.category}] {v.detail}"
        return (f"{self.case.describe()}\n  stock:     {self.stock.describe()}\n"
                f"  installed: {self.installed.describe()}\n  verdict:   {verdict}")


def set_x64(x64):
    if bool(jax.config.jax_enable_x64) != bool(x64):
        jax.config.update("jax_enable_x64", bool(x64))


def run_case(c, x64, allow_version_minor=False, mark=None):
    """Stock, then installed; leaves JAX installed (run_range restores).
    `mark(side)` is told which side is about to run: a crash is charged to
    the side it happened in (tools/fuzz_dropin.py)."""
    set_x64(x64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jax_overlay.uninstall()
        assert_stock()
        if mark:
            mark("stock")
        stock = run_side(c)
        jax_overlay.install()
        assert_installed()
        if mark:
            mark("installed")
        ours = run_side(c)
    return Result(c, bool(x64), stock, ours, judge(c, stock, ours, allow_version_minor))


def run_range(seed, start, count, x64, *, stop_after=None, allow_version_minor=False,
              record=False, progress=None, keep=100, family=None, until=None):
    """Runs cases [start, start + count) of `seed` (of a registered
    `family`'s stream, if given; none if its library is unavailable, counted
    with why), stopping early once time.time() passes `until`.  Returns
    plain figures: counts per category, the differences (each with its
    reproducer), up to `keep` stock-unsafe and allowed cases, and with
    `record` every case's description.  Leaves JAX stock."""
    out = {"cases": 0, "counts": collections.Counter(), "differences": [],
           "stock unsafe": [], "allowed": [], "records": [], "seconds": 0.0}
    t0 = time.perf_counter()
    if family is not None:
        why = FAMILIES[family].unavailable()
        if why:
            out["counts"][f"skipped: {family}: {why}"] += count
            return out
        FAMILIES[family].counts.clear()
    try:
        for i in range(start, start + count):
            if until is not None and time.time() >= until:
                break
            if progress:
                progress(i, "")
            c = case(seed, i, family)
            out["cases"] += 1
            try:
                r = run_case(c, x64, allow_version_minor,
                             mark=progress and (lambda side, i=i: progress(i, side)))
            except Unavailable as e:
                out["counts"]["not run: " + e.reason] += 1
                if record:  # records stay one per case index
                    out["records"].append(f"not run: {e}")
                continue
            except HarnessError as e:  # the harness's own bug: reported, the run goes on
                out["counts"]["difference: harness error"] += 1
                out["differences"].append({"reproducer": reproducer(c, x64),
                                           "case": c.describe(), "stock": "", "installed": "",
                                           "category": "harness error", "detail": str(e)})
                continue
            out["counts"].update(r.verdict.counts)
            entry = {"reproducer": reproducer(r.case, x64), "case": r.case.describe(),
                     "stock": r.stock.describe(), "installed": r.installed.describe(),
                     "category": r.verdict.category, "detail": r.verdict.detail}
            if record:
                out["records"].append(r.describe())
            if "stock unsafe" in r.verdict.counts and len(out["stock unsafe"]) < keep:
                out["stock unsafe"].append(entry)
            allowed = any(k.startswith("allowed") for k in r.verdict.counts)
            if allowed and len(out["allowed"]) < keep:
                out["allowed"].append(entry)
            if r.verdict.category is not None:
                out["counts"]["difference: " + r.verdict.category] += 1
                out["differences"].append(entry)
                if stop_after and len(out["differences"]) >= stop_after:
                    break
    finally:
        jax_overlay.uninstall()
        out["seconds"] = time.perf_counter() - t0
        if family is not None:  # what the family saw (producers still in flight at the call)
            out["counts"].update(FAMILIES[family].counts)
    return out
