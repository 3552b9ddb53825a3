"""Property-based fuzzing of the CUDA Array Interface import (hypothesis).

Dicts start as a correct description of random host memory (any CAI dtype,
C/F/permuted/strided/negative/broadcast layouts, misaligned pointers,
versions 0-3, streams) and then get up to three mutations: wrong types,
out-of-range values, missing or extra keys, huge shapes and strides that
overflow int64, pointers that wrap the address space, typestrs with stray
bytes.  An oracle written from the protocol (not from the parser) decides
what each dict means; see fuzzing.py for the outcome rules and the budget.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")
from hypothesis import assume, given  # noqa: E402
from hypothesis import strategies as st

import fuzzing as F  # noqa: E402
from fuzzing import fuzz_report, x64  # noqa: E402,F401  (module fixtures)
import forge as T
from jax_overlay import _xla_ext as ext

MISSING = object()
SIZES = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "c": (8, 16)}
CAI_DTYPES = [np.dtype(t) for t in ("?", "i1", "i2", "i4", "i8", "u1", "u2", "u4",
                                    "u8", "f2", "f4", "f8", "c8", "c16")]
TYPESTR = re.compile(r"([<>|=])([biufc])([0-9]+)")


def typestr_dtype(ts):
    """The NumPy dtype a CAI typestr names, if jax_overlay must accept it:
    the protocol's NumPy type strings, little-endian (or byte-order free),
    for the dtypes JAX holds."""
    if not isinstance(ts, str):
        return None
    try:
        ts.encode("utf-8")
    except UnicodeEncodeError:
        return None
    m = TYPESTR.fullmatch(ts)
    if not m:
        return None
    order, kind, size = m.group(1), m.group(2), int(m.group(3))
    if size not in SIZES[kind] or (order == ">" and size > 1):
        return None
    return np.dtype(np.bool_) if kind == "b" else np.dtype(f"<{kind}{size}")


def verdict(d):
    """(verdict, words, spec): "ok", "bad" or "either" for this dict, the
    words one of which an error must contain, and what a valid dict
    describes."""
    if not isinstance(d, dict):
        return "bad", {"dict"}, None

    def get(key):
        return dict.get(d, key, MISSING)

    bad = set()
    version = get("version")
    if not (F.is_int(version) and 0 <= version <= 3):
        bad.add("version")
    shape = get("shape")
    shape_ok = (isinstance(shape, (tuple, list)) and len(shape) <= 64
                and all(F.is_int(n) and 0 <= n <= F.INT64_MAX for n in shape))
    if not shape_ok:
        bad.add("shape")
    dtype = typestr_dtype(get("typestr"))
    if dtype is None:
        bad.add("typestr")
    data = get("data")
    if not (isinstance(data, (tuple, list)) and len(data) == 2 and F.is_int(data[0])
            and 0 <= data[0] < F.ADDRESS_END and type(data[1]) is bool):
        bad.add("data")
    strides = get("strides")
    strides = None if strides is MISSING else strides
    if strides is not None:
        if not (isinstance(strides, (tuple, list))
                and all(F.is_int(s) and F.fits_int64(s) for s in strides)):
            bad.add("strides")
        elif shape_ok and len(strides) != len(shape):
            bad.add("strides")
        elif dtype is not None and any(s % dtype.itemsize for s in strides):
            bad.add("strides")
    if get("mask") is not MISSING and get("mask") is not None:
        bad.add("mask")
    stream = None
    if F.is_int(version) and version >= 3:
        stream = get("stream")
        stream = None if stream is MISSING else stream
        if stream is not None and not (F.is_int(stream) and 0 < stream < F.ADDRESS_END):
            bad.add("stream")
    if bad & {"shape", "typestr", "data", "strides"}:
        return "bad", bad, None

    # Every problem below adds its words: a consumer may report any first.
    itemsize = dtype.itemsize
    numel, overflowed = F.count_elements(shape)
    if overflowed:
        # A zero makes it an empty array, which consumers may still refuse.
        return ("bad" if bad or numel else "either"), bad | {"shape", "overflow"}, None
    el_strides = None if strides is None else [s // itemsize for s in strides]
    env = F.envelope(shape, el_strides)
    if env is None:
        return "bad", bad | {"strides"}, None
    low, span = env
    if span * itemsize > F.INT64_MAX:
        bad.add("overflows int64")
    pointer = data[0]
    if numel and pointer == 0:
        bad.add("null pointer")
    elif numel and (pointer + low * itemsize < 0
                    or pointer + (low + span) * itemsize > F.ADDRESS_END):
        bad.add("address")
    if bad:
        # A huge empty shape may fail first, in NumPy ("array is too big").
        return "bad", bad | ({"too big"} if F.huge_empty(shape, itemsize) else set()), None
    spec = dict(pointer=pointer, shape=tuple(shape), dtype=dtype, strides=strides,
                el_strides=el_strides, numel=numel, low=low, span=span,
                stream=stream, read_only=data[1], version=version)
    if F.huge_empty(shape, itemsize):  # NumPy cannot even describe it
        return "either", {"too big", "shape"}, spec
    return "ok", set(), spec


# Generation ---------------------------------------------------------------

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4),
    st.binary(max_size=4), st.lists(st.integers(-3, 3), max_size=3),
    st.tuples(st.integers(-3, 3)), st.just(np.int64(3)), st.just(np.float32(1)),
    st.just({"a": 1}))
NEAR_TYPESTRS = ["<f4", "<f04", "=f4", "|f4", ">f4", ">i1", ">u1", "<b1", "|b2", "<f16",
                 "<f1", "<c4", "<c32", "<i3", "<u16", "<V8", "<M8", "|O8", "<U4",
                 "f4", "<f", "<f4 ", " <f4", "<f4\x00", "<f4\x00junk", "<f\x004",
                 "<\u0664", "<f\u0664", "<f4\ud800", "<F4", "<e2", "", "<f" + "0" * 40 + "4",
                 "<f99999999999999999999"]


def c_strides(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def draw_geometry(data):
    """(dtype, shape, element strides or None, misalignment in bytes)."""
    dtype = data.draw(st.sampled_from(CAI_DTYPES), label="dtype")
    ndim = data.draw(st.integers(0, 4), label="ndim")
    shape = [data.draw(st.integers(0, 5)) for _ in range(ndim)]
    layout = data.draw(st.sampled_from(["c", "c_explicit", "permuted", "strided"]),
                       label="layout")
    if layout == "c":
        el = None
    elif layout == "c_explicit":
        el = c_strides(shape)
    elif layout == "permuted":
        perm = data.draw(st.permutations(range(ndim)))
        inner = c_strides([shape[p] for p in perm])
        el = [0] * ndim
        for k, p in enumerate(perm):
            el[p] = inner[k]
    else:
        el = [data.draw(st.integers(-7, 7)) for _ in range(ndim)]
    misalign = data.draw(st.integers(0, dtype.itemsize - 1), label="misalign")
    return dtype, shape, el, misalign


def draw_cai(data, *, pointer=None):
    """(dict, buffer): a correct CAI dict over a fresh random buffer, or with
    `pointer` given, over that address (parse-only cases, no buffer)."""
    dtype, shape, el, misalign = draw_geometry(data)
    buf = None
    if pointer is None:
        low, span = F.envelope(shape, el)
        room = max(span, 1) * 16
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        buf = F.host_buffer(64 + -low * dtype.itemsize + misalign + room + 64, rng,
                            bool_bytes=dtype == np.bool_)
        pointer = buf.ctypes.data + 64 + misalign + -low * dtype.itemsize
    version = data.draw(st.sampled_from([3, 3, 3, 2, 1, 0]), label="version")
    d = {"shape": tuple(shape), "typestr": dtype.str,
         "data": (pointer, data.draw(st.booleans(), label="read_only")),
         "version": version,
         "strides": None if el is None else tuple(s * dtype.itemsize for s in el)}
    if data.draw(st.booleans(), label="has_stream"):
        d["stream"] = data.draw(st.sampled_from([None, 1, 2, 0x7F0000001000]))
    if data.draw(st.booleans(), label="has_descr"):
        d["descr"] = [("", dtype.str)]
    return d, buf


def _set(data, d, key, strategy):
    if data.draw(st.integers(0, 7), label=f"drop {key}?") == 0:
        d.pop(key, None)
    else:
        d[key] = data.draw(strategy, label=key)


def m_version(data, d):
    _set(data, d, "version", st.one_of(st.integers(-2, 6), st.booleans(),
                                       st.integers(min_value=2**62), JUNK))


def m_shape(data, d):
    shape = d.get("shape")
    shape = list(shape) if isinstance(shape, (tuple, list)) else []
    how = data.draw(st.sampled_from(
        ["junk", "entry", "many", "overflow", "bytes_overflow", "zero_huge", "list"]),
        label="shape mutation")
    if how == "junk":
        d["shape"] = data.draw(JUNK)
    elif how == "entry" and shape:
        i = data.draw(st.integers(0, len(shape) - 1))
        shape[i] = data.draw(st.one_of(st.integers(-3, -1), st.integers(2**63 - 2, 2**64 + 2),
                                       st.booleans(), JUNK))
        d["shape"] = tuple(shape)
    elif how == "many":
        d["shape"] = (1,) * data.draw(st.integers(63, 70))
    elif how == "overflow":  # the element count leaves int64
        d["shape"] = tuple(data.draw(st.integers(2**32, 2**63 - 1))
                           for _ in range(data.draw(st.integers(2, 3))))
    elif how == "bytes_overflow":  # the elements fit, their bytes do not
        d["shape"] = (data.draw(st.integers(2**61, 2**63 - 1)),)
        d["strides"] = None
    elif how == "zero_huge":
        dims = [data.draw(st.sampled_from([0, 1, 7, 2**31, 2**62, 2**63 - 1]))
                for _ in range(data.draw(st.integers(1, 4)))]
        d["shape"] = tuple(dims + [0]) if 0 not in dims else tuple(dims)
        d["strides"] = None
    elif how == "list":
        d["shape"] = shape


def m_typestr(data, d):
    _set(data, d, "typestr", st.one_of(
        st.sampled_from(NEAR_TYPESTRS),
        st.text(alphabet="<>|=biufcVMO0123456789\x00 ", max_size=6), JUNK))


def m_data(data, d):
    old = d.get("data")
    pointer, ro = old if isinstance(old, tuple) and len(old) == 2 else (16, False)
    how = data.draw(st.sampled_from(["junk", "length", "shift", "pointer", "read_only",
                                     "list"]), label="data mutation")
    if how == "junk":
        d["data"] = data.draw(JUNK)
    elif how == "length":
        d["data"] = (pointer, ro, False)[:data.draw(st.sampled_from([0, 1, 3]))]
    elif how == "shift" and F.is_int(pointer):  # inside the buffer's slack: misaligned
        d["data"] = (pointer + data.draw(st.integers(-32, 32)), ro)
    elif how == "pointer":
        d["data"] = (data.draw(st.one_of(
            st.sampled_from([0, -1, -(2**63), 2**64, 2**65, 8, 16]),
            st.integers(2**64 - 64, 2**64 - 1),  # elements would wrap past the top
            st.booleans(), st.floats(), st.text(max_size=3))), ro)
    elif how == "read_only":
        d["data"] = (pointer, data.draw(st.one_of(
            st.sampled_from([0, 1, None, "False", np.bool_(True)]), JUNK)))
    else:
        d["data"] = [pointer, ro]


def m_strides(data, d):
    strides = d.get("strides")
    how = data.draw(st.sampled_from(["none", "junk", "length", "entry", "huge"]),
                    label="strides mutation")
    if how == "none":
        d["strides"] = None
    elif how == "junk":
        d["strides"] = data.draw(JUNK)
    elif how == "length":
        n = len(d["shape"]) if isinstance(d.get("shape"), tuple) else 1
        d["strides"] = tuple(range(1, n + data.draw(st.sampled_from([-1, 1, 2])) + 1))
    elif how == "entry" and isinstance(strides, tuple) and strides:
        s = list(strides)
        i = data.draw(st.integers(0, len(s) - 1))
        s[i] = data.draw(st.one_of(st.integers(-3, 3).map(lambda k: s[i] + k),
                                   st.booleans(), st.floats(), st.integers(2**63 - 2, 2**64)))
        d["strides"] = tuple(s)
    elif how == "huge" and isinstance(d.get("shape"), tuple) and d["shape"]:
        d["strides"] = tuple(data.draw(st.sampled_from([2**62, -(2**62), 2**63 - 8, 8]))
                             for _ in d["shape"])


def m_mask(data, d):
    d["mask"] = data.draw(st.one_of(st.none(), JUNK, st.just(np.zeros(3, bool))))


def m_stream(data, d):
    _set(data, d, "stream", st.one_of(
        st.sampled_from([0, 1, 2, -1, -2, 2**64, 2**64 - 1, 2**63]), st.integers(),
        st.booleans(), JUNK))


def m_extra(data, d):
    d[data.draw(st.one_of(st.text(max_size=8), st.sampled_from(["descr", "Shape", "mask"])))] = (
        data.draw(JUNK))


MUTATIONS = [m_version, m_shape, m_typestr, m_data, m_strides, m_mask, m_stream, m_extra]


class Producer:
    """Hands out whatever dict it was given, and owns the buffer."""

    def __init__(self, cai, buf):
        self.cai, self.buf = cai, buf

    @property
    def __cuda_array_interface__(self):
        return self.cai


def draw_mutated(data, pointer=None):
    d, buf = draw_cai(data, pointer=pointer)
    for _ in range(data.draw(st.sampled_from([0, 0, 1, 1, 2, 3]), label="mutations")):
        data.draw(st.sampled_from(MUTATIONS), label="mutate")(data, d)
    how = data.draw(st.sampled_from(["dict"] * 12 + ["subclass", "items", "none"]),
                    label="container")
    if how == "subclass":
        d = type("CaiDict", (dict,), {})(d)
    elif how == "items":
        d = list(d.items())
    elif how == "none":
        d = None
    return d, buf


# Properties ---------------------------------------------------------------

@F.fuzz_settings(ci=400)
@given(data=st.data())
def test_parse_any_dict(data):
    """parse_cai on any dict over any address (nothing is dereferenced)."""
    pointer = data.draw(st.one_of(st.integers(1, 2**64 - 1), st.sampled_from([16, 2**64 - 16])),
                        label="pointer")
    d, _ = draw_mutated(data, pointer=pointer)
    v, words, spec = verdict(d)
    view = []

    def run():
        view.append(ext.parse_cai(d))
        return view[-1]

    def matches(view):
        s = spec
        strides = (None if s["shape"] else ()) if s["el_strides"] is None else tuple(
            s["el_strides"])
        return (view.shape == s["shape"] and view.itemsize == s["dtype"].itemsize
                and view.strides == strides and view.numel == s["numel"]
                and view.data == s["pointer"] and view.read_only == s["read_only"]
                and view.version == s["version"] and view.stream == s["stream"]
                and (not s["numel"] or (view.low, view.span) == (s["low"], s["span"])))

    outcome = F.check_outcome(run, v, words, check_array=matches)
    F.tally.add("cai_parse", outcome)


@F.fuzz_settings(ci=300)
@given(data=st.data())
def test_import_any_dict(data, x64):
    """The whole import (view or strided copy) on host memory: every dict
    ends in a clear error or in exactly the array it describes, and the
    producer and every native tensor are released after."""
    d, buf = draw_mutated(data)
    v, words, spec = verdict(d)
    ref = None
    if v != "bad" and spec is not None and spec["numel"]:
        ref = F.reference(buf, spec["pointer"], spec["shape"], spec["dtype"], spec["strides"])
        assume(ref is not None)  # describes memory outside the buffer: no consumer survives it
    copy = data.draw(st.sampled_from([None, None, True, False]), label="copy")
    if copy is False and v == "ok":
        v, words = "either", {"without a copy"}  # a view is impossible for some layouts
    producer = Producer(d, buf)
    refs, live = F.refcount(producer), ext.live_tensors()

    def right(arr):
        if arr.shape != spec["shape"] or arr.dtype != spec["dtype"]:
            return False
        if not spec["numel"]:
            return True
        ptr = arr.unsafe_buffer_pointer()
        if copy is False and ptr != spec["pointer"]:
            return False  # copy=False never copies
        if copy is True and ptr == spec["pointer"]:
            return False  # copy=True always does
        return F.same_data(arr, ref)

    outcome = F.check_outcome(lambda: T.import_host(producer, copy=copy), v, words,
                              check_array=right)
    del ref
    T.settle(lambda: ext.live_tensors() == live and F.refcount(producer) == refs,
             "a native tensor or a producer reference was leaked")
    F.tally.add("cai_import", outcome)
