"""The drop-in rule on the CPU, differentially (tests/dropin.py): every entry
point x NumPy and other host producers x dtype x layout x copy x device, on
stock JAX and installed in one process, in 32- and 64-bit mode; then the
exports of JAX arrays, read by NumPy and called directly."""

from __future__ import annotations

import ctypes
import enum

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dropin as D
import jax_overlay
from multidevice import check, on, params
from jax_overlay import _runtime as rt
import forge as T
from jax_overlay import _xla_ext as ext


def _producers(dtype):
    """name -> factory of a fresh host producer of `dtype`."""
    out = {}
    for name in D.LAYOUTS:
        def make(name=name):
            return D.layout(D.values((8, 16), dtype), name)
        out[name] = make

    def read_only():
        a = D.values((8, 16), dtype)
        a.flags.writeable = False
        return a
    out["read_only"] = read_only
    # A producer that predates the keywords of 2023: TypeError on max_version.
    out["legacy_dlpack"] = lambda: _Legacy(D.values((8, 16), dtype))
    # Host memory behind a CUDA Array Interface: no GPU can hold it.
    out["cai_on_host"] = lambda: T.HostCAI(D.values((8, 16), dtype))
    # A NumPy array that also exports a CAI, as Numba's mapped and managed
    # arrays do: stock's jnp.asarray reads the CAI, the rest NumPy's memory.
    out["ndarray_with_cai"] = lambda: D.values((8, 16), dtype).view(NDArrayCAI)
    return out


class NDArrayCAI(np.ndarray):
    """A NumPy array with a CUDA Array Interface over its own memory (v3, no
    stream): Numba's MappedNDArray and ManagedNDArray have this shape."""

    stream = None

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "strides": None,
                "data": (self.ctypes.data, False), "version": 3, "stream": self.stream}


class NDArrayCAIStream(NDArrayCAI):
    """The same, bound to a stream, as a Numba mapped array made with
    stream=: a CAI with a stream still leaves from_dlpack on NumPy's."""

    stream = 1


def _truth(obj):
    """The host values a producer holds."""
    return np.asarray(getattr(obj, "a", getattr(obj, "array", obj)))


class _Legacy:
    def __init__(self, a):
        self.a = a

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def _coords():
    cpu = jax.devices("cpu")[0]
    return [(copy, dname, dev) for copy in D.COPIES for dname, dev in (
        ("None", None), ("cpu0", cpu),
        ("cpu0-sharding", jax.sharding.SingleDeviceSharding(cpu)))]


def _check(diffs, counts):
    assert counts["stock ok"] > 0
    assert not diffs, f"{len(diffs)} differences:\n" + "\n".join(diffs[:40])


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("dtype", D.DTYPES, ids=str)
def test_imports_match_stock(dtype, x64):
    cases = D.import_cases(D.IMPORTS, _producers(dtype), _coords(), _truth)
    with rt.x64(x64):
        _check(*D.differential(cases))


@on(2)
def case_imports_onto_another_cpu_match_stock(n):
    """Host producers (kDLCPU 0) imported onto CPU device 1: stock JAX places
    them on device 0 and copies, or refuses copy=False with ValueError."""
    cpu1 = jax.devices("cpu")[1]
    coords = [(copy, name, dev) for copy in D.COPIES for name, dev in (
        ("cpu1", cpu1), ("cpu1-sharding", jax.sharding.SingleDeviceSharding(cpu1)))]
    for dtype in map(np.dtype, (np.float32, np.int64, np.bool_, np.complex128)):
        diffs, counts = D.differential(
            D.import_cases(D.IMPORTS, _producers(dtype), coords, _truth))
        assert counts["stock ok"] > 0
        assert not diffs, f"{len(diffs)} differences:\n" + "\n".join(diffs[:40])


@pytest.mark.parametrize("n,case", params(globals()))
def test_multidevice(n, case):
    check(__file__, n, case)


# --- exports ---------------------------------------------------------------

_DLPACK_CALLS = {
    "default": {}, "v0.8": {"max_version": (0, 8)}, "v1.0": {"max_version": (1, 0)},
    "v9.0": {"max_version": (9, 0)}, "v0.4": {"max_version": (0, 4)},
    "copy=True": {"copy": True}, "copy=False": {"copy": False},
    "cpu": {"dl_device": (1, 0)}, "cpu,copy=False": {"dl_device": (1, 0), "copy": False},
    "cuda": {"dl_device": (2, 0)}, "cuda,copy=False": {"dl_device": (2, 0), "copy": False},
    "type99": {"dl_device": (99, 0)}, "stream=None": {"stream": None},
    "stream=-1": {"stream": -1}, "stream=1": {"stream": 1},
}


def _consume(capsule):
    """What a host consumer reads from the capsule: its shape, type code,
    device and bytes (NumPy itself cannot read bfloat16 or float8)."""
    info = ext.capsule_info(capsule)
    assert info["layout"] == "row_major", info
    nbytes = info["numel"] * info["itemsize"]
    data = bytes((ctypes.c_uint8 * nbytes).from_address(info["data"])) if nbytes else b""
    return info["shape"], info["dtype"], info["device"], data


def _export_cases(dtype):
    def jax_array():
        return jnp.asarray(D.values((8, 16), dtype))
    for name, kw in _DLPACK_CALLS.items():
        yield (f"__dlpack__({name})", lambda kw=kw: _consume(jax_array().__dlpack__(**kw)),
               None)
    for copy in D.COPIES:
        yield (f"np.from_dlpack(copy={copy})",
               lambda copy=copy: np.from_dlpack(jax_array(), copy=copy).copy(), None)
    yield "__dlpack_device__", lambda: jax_array().__dlpack_device__(), None
    yield "__cuda_array_interface__", lambda: jax_array().__cuda_array_interface__, None
    yield ("hasattr(__cuda_array_interface__)",
           lambda: hasattr(jax_array(), "__cuda_array_interface__"), None)
    yield "np.asarray", lambda: np.asarray(jax_array()), None


@pytest.mark.parametrize("dtype", D.DTYPES, ids=str)
def test_exports_match_stock(dtype):
    with rt.x64(True):
        _check(*D.differential(_export_cases(dtype)))


def _odd_export_calls():
    """__dlpack__ called with what stock accepts loosely or refuses: streams
    of every kind, max_version tuples of other lengths and numbers,
    dl_device as floats, strings, lists, unknown types and ids, copy as any
    truth value, and their combinations."""
    streams = [0, -1, 1, 2, "x", 1.5, True, 2**70]
    versions = [(1, 0), (0, 8), (1,), (1, 0, 0), "1.0", (1.0, 0), (-1, 0), (2**70, 0), [1, 0],
                (True, 0)]
    devices = [None, (1, 0), (1, 1), (1.0, 0), "cpu", (2, 0), (3, 0), (10, 0), (99, 0), (1, -1),
               [1, 0], (np.int64(1), 0), (0, 0), ()]
    copies = [None, True, False, 0, 1, "yes", np.bool_(True)]

    def x():
        return jnp.asarray(D.values((4, 4), np.dtype(np.float32)))
    for kw in ([{"stream": v} for v in streams] + [{"max_version": v} for v in versions]
               + [{"dl_device": d, "copy": c} for d in devices for c in copies]):
        yield (f"__dlpack__({kw})", lambda kw=kw: _consume(x().__dlpack__(**kw)), None)
    yield "__dlpack__(None)", lambda: _consume(x().__dlpack__(None)), None
    yield "__dlpack__(foo=1)", lambda: _consume(x().__dlpack__(foo=1)), None


def test_odd_export_arguments_match_stock():
    diffs, counts = D.differential(_odd_export_calls())
    assert counts["stock ok"] > 40 and counts["stock raised"] > 40
    assert not diffs, f"{len(diffs)} differences:\n" + "\n".join(diffs[:40])


_CPU0 = jax.devices("cpu")[0]


@pytest.mark.parametrize("call,via_cai", [
    # jnp.array's NumPy fast paths, a host copy on stock too.
    ("jnp.asarray(x)", False), ("jnp.array(x)", False),
    ("jnp.asarray(x, dtype=x.dtype)", False), ("jnp.array(x, copy=False)", False),
    # Stock reaches its CAI branch.
    ("jnp.asarray(x, device=cpu0)", True), ("jnp.array(x, device=cpu0)", True),
    ("jnp.asarray(x, dtype=jnp.int32)", True), ("jnp.array(x, dtype=x.dtype)", True),
    ("jnp.array(x, ndmin=3)", True),
    # Read as the NumPy array it is.
    ("jax.device_put(x)", False), ("jax.dlpack.from_dlpack(x)", False),
    ("jnp.from_dlpack(x)", False), ("jax.dlpack.from_dlpack(xs)", False),
    ("jnp.from_dlpack(xs)", False), ("jnp.asarray(xs, device=cpu0)", True)])
def test_numpy_arrays_with_a_cai_take_the_route_stock_takes(monkeypatch, call, via_cai):
    """A NumPy array that is also CUDA memory (Numba's mapped and managed
    arrays): where stock jnp.asarray/jnp.array read its CAI, so does the
    overlay, holding the producer (stock's view does not: its reads of a
    dead producer's pages fail once Numba frees them); where stock reads
    it as the NumPy array it is (jnp.array's fast paths, device_put,
    from_dlpack), so does the overlay."""
    from jax_overlay import _cai, _view, peers
    owners = []

    def import_cai(owner, cai, copy=None):
        # A CPU stand-in for the GPU import: records what it would hold.
        owners.append(owner)
        return jax.device_put(np.asarray(owner), _CPU0), False

    monkeypatch.setattr(_cai, "import_cai", import_cai)
    x = np.arange(12, dtype=np.float32).reshape(3, 4).view(NDArrayCAI)
    xs = x.view(NDArrayCAIStream)
    jax_overlay.install()
    try:
        got = eval(call, {"x": x, "xs": xs, "jnp": jnp, "jax": jax, "cpu0": _CPU0})
    finally:
        jax_overlay.uninstall()
    np.testing.assert_array_equal(np.asarray(got).reshape(x.shape), np.asarray(x))
    assert [o is (xs if "xs" in call else x) for o in owners] == ([True] if via_cai else [])


def test_the_comparison_can_fail():
    """The harness itself: a changed dtype, a changed value and a foreign
    exception class are each reported."""
    x = jnp.arange(4.0)
    assert D.compare(D.Outcome(x), D.Outcome(x.astype(jnp.int32)))
    assert D.wrong(x, np.arange(4.0) + 1) and D.wrong(x, np.arange(4)) and D.wrong(x, np.arange(5.0))
    assert D.wrong(x, np.arange(4.0)) is None
    assert D.compare(D.Outcome(x), D.Outcome(x + 1))
    assert D.compare(D.Outcome(x), D.Outcome(error=ValueError("x")))
    assert D.compare(D.Outcome(error=ValueError("x")), D.Outcome(error=BufferError("x")))
    assert D.compare(D.Outcome(error=ValueError("x")), D.Outcome(x)) is None
    # Pytrees, element by element.
    assert D.compare(D.Outcome((x, {"a": x})), D.Outcome((x, {"a": x + 1})))
    assert D.compare(D.Outcome([x]), D.Outcome([x, x]))
    assert D.compare(D.Outcome((x, {"a": x})), D.Outcome((x, {"a": x}))) is None

    class Both(BufferError, ValueError):
        pass
    assert D.compare(D.Outcome(error=ValueError("x")), D.Outcome(error=Both("x"))) is None


# --- third-party host producers ----------------------------------------------

def _arrow():
    pa = pytest.importorskip("pyarrow")
    f32 = np.dtype(np.float32)
    return {
        "pyarrow_float32": (lambda: pa.array(D.values((16,), f32)), True),
        "pyarrow_int64": (lambda: pa.array(D.values((16,), np.dtype(np.int64))), True),
        "pyarrow_slice": (lambda: pa.array(D.values((16,), f32))[3:], True),
        # DLPack refuses these (nulls, bit-packed booleans, timestamps);
        # JAX's own path reads the first two through NumPy.
        "pyarrow_nulls": (lambda: pa.array([1.0, None, 3.0]), False),
        "pyarrow_bool": (lambda: pa.array([True, False, True]), False),
        "pyarrow_timestamp": (lambda: pa.array(np.arange(3).astype("datetime64[s]")), False),
        "pyarrow_chunked": (lambda: pa.chunked_array([[1.0, 2.0], [3.0]]), False),
    }


def _array_api_strict():
    xp = pytest.importorskip("array_api_strict")
    out = {}
    for dtype in map(np.dtype, (np.float32, np.float64, np.int64, np.bool_)):
        for layout in ("aligned", "unaligned", "transposed", "empty"):
            out[f"array_api_strict_{dtype}_{layout}"] = (
                lambda dtype=dtype, layout=layout: xp.asarray(
                    D.layout(D.values((8, 16), dtype), layout)), True)
    return out


def _values_of(obj):
    if hasattr(obj, "to_numpy"):  # pyarrow, where it holds plain values
        return obj.to_numpy()
    return np.asarray(obj._array)  # array_api_strict wraps a NumPy array


# JAX's own asarray compares the reference array's dtype with NumPy's, and
# array_api_strict warns about it, stock and installed alike.
@pytest.mark.filterwarnings("ignore:You are comparing a array_api_strict dtype")
# pyarrow deprecates the unversioned __dlpack__() call that stock's from_dlpack
# makes (installed asks for DLPack 1.x).
@pytest.mark.filterwarnings("ignore:Exporting an unversioned DLPack capsule")
@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("library", ["pyarrow", "array_api_strict"])
def test_third_party_host_producers_match_stock(library, x64):
    """Real producers of __dlpack__ on the host: pyarrow's arrays (with
    nulls, bit-packed booleans and types DLPack refuses) and the Array API's
    reference array.  The data is D.values', aligned the same in both runs
    (jaxlib views host memory only when 64-byte aligned)."""
    table = _arrow() if library == "pyarrow" else _array_api_strict()
    cases = []
    for name, (make, plain) in table.items():
        cases += D.import_cases(D.IMPORTS, {name: make}, _coords(),
                                (lambda o: _values_of(o)) if plain else None)
    with rt.x64(x64):
        _check(*D.differential(cases))


# --- the calls JAX code makes every day ----------------------------------------

class _JaxArrayLike:
    """An object JAX converts through __jax_array__."""

    def __jax_array__(self):
        return jnp.arange(3)


def _everyday():
    """(label, thunk) for inputs install() must leave to JAX: tracers under
    jit, vmap and grad, __jax_array__ objects, the buffer protocol, Python
    scalars and strings, masked arrays, pytrees for device_put."""
    import array

    x = jnp.arange(4.0)
    cpu = jax.devices("cpu")[0]
    calls = {
        "jit(asarray)": lambda: jax.jit(lambda v: jnp.asarray(v) * 2)(x),
        "jit(array)": lambda: jax.jit(lambda v: jnp.array(v) * 2)(x),
        "jit(array, copy=False)": lambda: jax.jit(lambda v: jnp.array(v, copy=False))(x),
        "jit(asarray, dtype)": lambda: jax.jit(lambda v: jnp.asarray(v, jnp.int32))(x),
        "jit(device_put)": lambda: jax.jit(lambda v: jax.device_put(v) * 2)(x),
        "jit(asarray of a list of tracers)": lambda: jax.jit(
            lambda v: jnp.asarray([v[0], v[1]]))(x),
        "jit(from_dlpack of a tracer)": lambda: jax.jit(jax.dlpack.from_dlpack)(x),
        "jit(jnp.from_dlpack of a tracer)": lambda: jax.jit(jnp.from_dlpack)(x),
        "vmap(asarray)": lambda: jax.vmap(lambda v: jnp.asarray(v) + 1)(x),
        "vmap(array, ndmin)": lambda: jax.vmap(lambda v: jnp.array(v, ndmin=2))(x),
        "grad(asarray)": lambda: jax.grad(lambda v: jnp.asarray(v).sum())(x),
        "grad(array, dtype)": lambda: jax.grad(lambda v: jnp.array(v, jnp.float32).sum())(x),
        "grad(device_put)": lambda: jax.grad(lambda v: jax.device_put(v).sum())(x),
        "asarray(__jax_array__)": lambda: jnp.asarray(_JaxArrayLike()),
        "array(__jax_array__)": lambda: jnp.array(_JaxArrayLike()),
        "device_put(__jax_array__)": lambda: jax.device_put(_JaxArrayLike()),
        "asarray(memoryview)": lambda: jnp.asarray(memoryview(np.arange(3.0))),
        "asarray(array.array)": lambda: jnp.asarray(array.array("f", [1, 2])),
        "asarray(bytes)": lambda: jnp.asarray(b"abc"),
        "asarray(str)": lambda: jnp.asarray("a"),
        "asarray(object array)": lambda: jnp.asarray(np.array([object()])),
        "asarray(masked)": lambda: jnp.asarray(np.ma.masked_array([1.0, 2.0], mask=[0, 1])),
        "array(masked, copy=False)": lambda: jnp.array(
            np.ma.masked_array([1.0, 2.0], mask=[0, 1]), copy=False),
        "asarray(np.float64)": lambda: jnp.asarray(np.float64(2)),
        "asarray(ShapeDtypeStruct)": lambda: jnp.asarray(jax.ShapeDtypeStruct((2,), jnp.float32)),
        "asarray(nested lists)": lambda: jnp.asarray([[1, 2], [3, 4.5]]),
        "asarray(list of arrays)": lambda: jnp.asarray([x, x]),
        "array(list of arrays, device)": lambda: jnp.array([x, x], device=cpu),
        "device_put(tuple)": lambda: jax.device_put((np.ones(2), 3.0)),
        "device_put(dict, cpu)": lambda: jax.device_put({"a": np.ones(2), "b": [1, x]}, cpu),
        "device_put(None)": lambda: jax.device_put(None),
        "device_put(list, donate)": lambda: jax.device_put([np.ones(2)], donate=True),
        "from_dlpack(list)": lambda: jax.dlpack.from_dlpack([1, 2]),
        "from_dlpack(jax array)": lambda: jax.dlpack.from_dlpack(x),
        "jnp.from_dlpack(jax array, cpu)": lambda: jnp.from_dlpack(x, device=cpu),
    }
    for label, call in calls.items():
        yield label, call, None


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
def test_everyday_calls_match_stock(x64):
    with rt.x64(x64):
        diffs, counts = D.differential(_everyday())
    assert counts["stock ok"] >= 20 and counts["stock raised"] >= 5
    assert not diffs, "\n".join(diffs)


# --- producers JAX cannot hold -------------------------------------------------

class _Unholdable:
    """A DLPack producer of host bytes that claims device type `dl_type` and
    DLPack dtype `dtype` (code, bits, lanes): what JAX has no way to hold."""

    def __init__(self, buf, dl_type, dtype, n):
        self.buf, self.dl_type, self.dtype, self.n = buf, dl_type, dtype, n

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return ext.raw_capsule(self.buf, self.buf.ctypes.data, [self.n], None, self.dtype,
                               self.dl_type, 0)

    def __dlpack_device__(self):
        return (self.dl_type, 0)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="claims GPU device types over host memory: CPU-only processes")
def test_producers_jax_cannot_hold_fail_as_on_stock():
    """Device types stock maps to a platform with no backend here (CUDA,
    ROCm, oneAPI: its RuntimeError) or does not map (OpenCL, Vulkan, CUDA
    managed, 99: its TypeError; kDLCUDAHost on jax 0.10), DLPack dtypes
    jaxlib refuses (complex32, int4, two lanes, float128, 16-bit booleans,
    unknown codes: its runtime error), and raw capsules (stock takes
    producers only): each refusal is an instance of stock's class."""
    buf = D.values((64,), np.dtype(np.uint8))
    producers = {f"device type {t}": (lambda t=t: _Unholdable(buf, t, (1, 8, 1), 16))
                 for t in (2, 3, 4, 7, 10, 11, 13, 14, 99)}
    for name, dtype in {"complex32": (5, 32, 1), "int4": (0, 4, 1), "uint8x2": (1, 8, 2),
                        "float128": (2, 128, 1), "float8 code": (2, 8, 1),
                        "bool16": (6, 16, 1), "code 99": (99, 8, 1)}.items():
        producers[name] = lambda dtype=dtype: _Unholdable(buf, 1, dtype, 8)
    producers["capsule of complex32"] = lambda: _Unholdable(buf, 1, (5, 32, 1), 8).__dlpack__()
    producers["consumed capsule"] = lambda: _consumed(D.values((4,), np.dtype(np.float32)))
    diffs, counts = D.differential(D.import_cases(D.IMPORTS, producers, _coords()))
    assert counts["stock raised"] > 400
    assert not diffs, f"{len(diffs)} differences:\n" + "\n".join(diffs[:40])


def _consumed(a):
    cap = a.__dlpack__()
    np.from_dlpack(_Capsule(cap))
    return cap


class _Capsule:
    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, **kw):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="claims a GPU device type over host memory: CPU-only processes")
def test_stock_decides_for_objects_it_reads_generically(installed):
    """jnp.asarray of a DLPack-only GPU producer the import refuses (no
    CUDA here): stock's own error, with the overlay's reason as a note."""
    p = _Unholdable(D.values((64,), np.dtype(np.uint8)), 2, (1, 8, 1), 16)
    with pytest.raises(TypeError, match="not a valid JAX array type") as e:
        jnp.asarray(p)
    assert any("jax_overlay could not import it either" in n and "CUDA" in n
               for n in getattr(e.value, "__notes__", []))


class _Malformed:
    """A producer of host float32 data whose __dlpack_device__ returns
    `device` and whose __dlpack__ does `capsule` ("good", "raises",
    "refuses", "none", "int", "consumed")."""

    def __init__(self, device=(1, 0), capsule="good"):
        self.a = D.values((8,), np.dtype(np.float32))
        self.device, self.capsule = device, capsule

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        kind = self.capsule
        if kind == "raises":
            raise RuntimeError("the producer broke")
        if kind == "refuses":
            raise BufferError("the producer refuses")
        if kind in ("none", "int"):
            return None if kind == "none" else 5
        cap = self.a.__dlpack__()
        if kind == "consumed":
            np.from_dlpack(_Capsule(cap))
        return cap

    def __dlpack_device__(self):
        if self.device == "raises":
            raise RuntimeError("the device broke")
        return self.device


class _IntEnumCPU(enum.IntEnum):
    CPU = 1


def test_malformed_producers_fail_or_work_as_on_stock():
    """__dlpack_device__ returning three items, a string, None, floats,
    NumPy ints, an IntEnum, a list, a negative or unseen id, or raising;
    __dlpack__ raising, refusing, returning None or an int, or a consumed
    capsule: stock's outcome, or an instance of its class."""
    producers = {f"device {d!r}": (lambda d=d: _Malformed(device=d)) for d in (
        (1, 0, 0), "cpu", None, (1.0, 0), (1.5, 0), (np.int64(1), np.int64(0)),
        (_IntEnumCPU.CPU, 0), [1, 0], "raises", (1, -1), (1, 1))}
    producers.update({f"capsule {c}": (lambda c=c: _Malformed(capsule=c)) for c in (
        "raises", "refuses", "none", "int", "consumed")})
    for x64 in (False, True):
        with rt.x64(x64):
            diffs, counts = D.differential(D.import_cases(D.IMPORTS, producers, _coords()))
        assert counts["stock ok"] > 50 and counts["stock raised"] > 200
        assert not diffs, f"{len(diffs)} differences:\n" + "\n".join(diffs[:40])


class _OddCAI:
    """An object whose __cuda_array_interface__ is `cai`, or raises it."""

    def __init__(self, cai):
        self._cai = cai

    @property
    def __cuda_array_interface__(self):
        if isinstance(self._cai, Exception):
            raise self._cai
        return self._cai


def test_malformed_cuda_array_interfaces_fail_as_on_stock():
    """CAIs with fields missing, of the wrong type or out of range, not a
    dict, or a property raising: stock's class at each entry point (stock's
    jax.device_put never reads a CAI: its TypeError)."""
    buf = D.values((64,), np.dtype(np.float32))
    good = {"shape": (8,), "typestr": "<f4", "data": (buf.ctypes.data, False), "version": 3,
            "strides": None}
    variants = {
        "no shape": {k: v for k, v in good.items() if k != "shape"},
        "shape str": dict(good, shape="8"), "typestr <x4": dict(good, typestr="<x4"),
        "typestr int": dict(good, typestr=4), "data None": dict(good, data=None),
        "data int": dict(good, data=5), "data of 3": dict(good, data=(1, 2, 3)),
        "version str": dict(good, version="3"), "strides of 2": dict(good, strides=(1, 2)),
        "strides str": dict(good, strides="x"), "stream 0": dict(good, stream=0),
        "stream str": dict(good, stream="s"), "null pointer": dict(good, data=(0, False)),
        "negative shape": dict(good, shape=(-1,)), "read-only str": dict(good, data=(1, "no")),
        "a list": [1, 2], "None": None, "raises KeyError": KeyError("k"),
        "raises AttributeError": AttributeError("no"), "raises RuntimeError": RuntimeError("no"),
        "good (host memory: no GPU)": good}
    producers = {name: (lambda v=v: _OddCAI(v)) for name, v in variants.items()}
    diffs, counts = D.differential(D.import_cases(D.IMPORTS, producers, _coords()))
    assert counts["stock raised"] > 800
    assert not diffs, f"{len(diffs)} differences:\n" + "\n".join(diffs[:40])


@pytest.mark.parametrize("broken", ["uninstall", "install"])
def test_differential_refuses_a_stock_run_that_is_not_stock(monkeypatch, broken):
    """With uninstall() a no-op the "stock" run is installed, and with
    install() a no-op the installed run is stock: each would compare a route
    with itself and pass.  differential() must raise instead."""
    was = jax_overlay.installed()
    # A case both routes agree on: only the entry-point check can fail it.
    cases = D.import_cases({"jnp_asarray": D.jnp_asarray},
                           {"aligned": lambda: D.values((8, 16), np.dtype(np.float32))},
                           [(None, "None", None)], _truth)
    monkeypatch.setattr(jax_overlay, broken, lambda: None)
    if broken == "uninstall":
        jax_overlay.install()  # the no-op uninstall() leaves it installed
    try:
        with pytest.raises(AssertionError, match=f"after {broken}\\(\\)"):
            D.differential(cases)
    finally:
        monkeypatch.undo()
        (jax_overlay.install if was else jax_overlay.uninstall)()
    if was:
        D.check_installed()
    else:
        D.check_stock()
