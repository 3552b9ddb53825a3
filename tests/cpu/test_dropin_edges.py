"""The drop-in rule at its edges: what an independent differential fuzz found
(issue 29), each case pinned.  The correctness bugs first (a copy that was
not a copy, every CPU device called 0, hasattr raising), then the calls
where stock's exception class or outcome was not kept.  Two-device cases
run in a subprocess (multidevice.py)."""

from __future__ import annotations

import jax
import jax.dlpack
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dropin
import jax_overlay
from jax_overlay import _runtime as rt
import forge as T
from jax_overlay import _xla_ext as ext
from multidevice import HostDLPack, aligned, check, installed, on, params

KDLCPU = 1


def _on(n):
    return jax.device_put(np.arange(4.0, dtype=np.float32), jax.devices()[n])


def _exports():
    """The export as called explicitly, and through jax.Array's methods
    with install() active (stock's own on a jaxlib with DLPack 1.x)."""
    yield "jax_overlay.to_dlpack", jax_overlay.to_dlpack
    yield "x.__dlpack__", lambda x, **kw: x.__dlpack__(**kw)


# --- 1. copy=True copies -------------------------------------------------------

@on(2)
def case_copy_true_to_the_arrays_own_device_copies(n):
    x = _on(1)
    with installed():
        for name, export in _exports():
            for mv in (None, (1, 0)):
                info = ext.capsule_info(export(x, dl_device=(KDLCPU, 1), copy=True, max_version=mv))
                assert info["data"] != x.unsafe_buffer_pointer(), f"{name}(max_version={mv}) aliases"
                assert info["device"] == (KDLCPU, 1)
                if mv is not None:
                    assert info["flags"] & ext.FLAG_IS_COPIED
            info = ext.capsule_info(export(x, copy=True, max_version=(1, 0)))
            assert info["data"] != x.unsafe_buffer_pointer() and info["flags"] & ext.FLAG_IS_COPIED


@on(2)
def case_imports_of_a_jax_array_on_another_device_alias_only_where_stock_does(n):
    """The differential compares aliasing: wherever stock makes a new
    buffer of a JAX array on cpu:1 (copy=True, a dtype, another device),
    installed must too."""
    cpu = jax.devices("cpu")
    entries = {"jnp.asarray": lambda x, copy, d: jnp.asarray(x, copy=copy, device=d),
               "jnp.array": lambda x, copy, d: jnp.array(x, copy=copy, device=d),
               "jax.device_put": lambda x, copy, d: jax.device_put(x, d, may_alias=None if copy is None else not copy),
               "jnp.from_dlpack": lambda x, copy, d: jnp.from_dlpack(x, copy=copy, device=d),
               "jax.dlpack.from_dlpack": lambda x, copy, d: jax.dlpack.from_dlpack(x, copy=copy, device=d)}
    cases = [(f"{name}(cpu1 array, copy={copy}, device={d})",
              dropin.MadeInput(entry, lambda: _on(1), copy, d), None)
             for name, entry in entries.items() for copy in (None, True, False)
             for d in (None, cpu[1], cpu[0])]
    diffs, counts = dropin.differential(cases)
    assert not diffs, "\n".join(diffs)
    assert counts["stock ok"] > 10, counts


def test_stock_argument_checks_come_first():
    """jnp.array's order= check is stock's first: installed, a strided NumPy
    subclass with a bad ndmin and order='C' still raises stock's
    NotImplementedError, not a TypeError of the overlay's own checks."""
    class Sub(np.ndarray):
        pass
    x = np.arange(12.0).reshape(3, 4)[:, ::2].view(Sub)
    cases = [("jnp.array(order='C', ndmin='x')",
              lambda: jnp.array(x, copy=False, ndmin="x", order="C")),
             ("jnp.array(order='F')", lambda: jnp.array(x, order="F"))]
    diffs, counts = dropin.differential((label, thunk, None) for label, thunk in cases)
    assert not diffs, "\n".join(diffs)
    assert counts["stock raised"] == 2, counts


# --- 2. CPU device ids ----------------------------------------------------------

@on(2)
def case_capsules_name_the_cpu_device_they_are_on(n):
    x = _on(1)
    with installed():
        for name, export in _exports():
            for mv in (None, (1, 0)):
                assert ext.capsule_info(export(x, max_version=mv))["device"] == (KDLCPU, 1), name
            view = ext.capsule_info(export(x, dl_device=(KDLCPU, 1), copy=False))
            assert view["data"] == x.unsafe_buffer_pointer(), f"{name}: (1, 1) is x's own device"
            with pytest.raises(ValueError, match="copy=False"):
                export(x, dl_device=(KDLCPU, 0), copy=False)
        # What a consumer asks the array first: (kDLCPU, 0), as stock says.
        assert tuple(map(int, x.__dlpack_device__())) == (KDLCPU, 0)


@on(2)
def case_host_producers_land_on_the_cpu_device_they_name(n):
    with installed():
        for entry in (jax.dlpack.from_dlpack, jnp.from_dlpack, jax_overlay.from_dlpack):
            out = entry(HostDLPack(aligned((4,)), device=(KDLCPU, 1)))
            assert out.devices() == {jax.devices()[1]}
            np.testing.assert_array_equal(out, np.arange(4.0))


@on(2)
def case_edges_on_two_devices_match_stock(n):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec("x"))

    def sharded():
        return jax.device_put(np.arange(4.0, dtype=np.float32), sharding)

    cases = [
        ("x.__dlpack__(dl_device=(1, 1), copy=False)",
         lambda: np.from_dlpack(T.DLPackHolder(_on(1).__dlpack__(dl_device=(1, 1), copy=False)))),
        ("x.__dlpack__(dl_device=(1, 0), copy=False)",
         lambda: _on(1).__dlpack__(dl_device=(1, 0), copy=False)),
        ("from_dlpack((1, 1) producer)",
         lambda: jax.dlpack.from_dlpack(HostDLPack(aligned((4,)), device=(KDLCPU, 1)))),
        ("jnp.from_dlpack(sharded, device=<2 devices>, copy=False)",
         lambda: jnp.from_dlpack(sharded(), device=sharding, copy=False)),
        ("jax.dlpack.from_dlpack(sharded, device=<2 devices>)",
         lambda: jax.dlpack.from_dlpack(sharded(), device=sharding)),
    ]
    diffs, _ = dropin.differential((label, thunk, None) for label, thunk in cases)
    assert not diffs, "\n".join(diffs)


# --- 3. hasattr never raises ----------------------------------------------------

@pytest.mark.parametrize("how", ["deleted", "donated"])
def test_hasattr_cai_of_a_dead_array_is_false(how):
    x = jnp.arange(8.0) + 1
    if how == "deleted":
        x.delete()
    else:
        jax.jit(lambda v: v * 2, donate_argnums=0)(x)
    assert x.is_deleted()
    with installed():
        assert hasattr(x, "__cuda_array_interface__") is False
        with pytest.raises(AttributeError, match="deleted or donated"):
            x.__cuda_array_interface__  # noqa: B018


# --- exception classes and outcomes, one device ---------------------------------

class _HostCAI:
    """A CAI over host memory: stock reads it as a device pointer."""

    def __init__(self, a):
        self.a = a

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.a.shape, "typestr": self.a.dtype.str, "version": 3,
                "data": (self.a.ctypes.data, False), "strides": None, "stream": None}


class _Advertises:
    """A NumPy-backed producer advertising any device."""

    def __init__(self, a, device):
        self.a, self.device = a, device

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.device


def _dead():
    x = jnp.arange(4.0) + 1
    x.delete()
    return x


def _edge_cases():
    a = np.arange(6.0)
    x = lambda: jnp.arange(4.0, dtype=jnp.float32)  # noqa: E731
    yield "from_dlpack(device=0)", lambda: jax.dlpack.from_dlpack(a, device=0)
    yield "jnp.from_dlpack(device=0)", lambda: jnp.from_dlpack(a, device=0)
    yield "from_dlpack(device=False)", lambda: jax.dlpack.from_dlpack(a, device=False)
    yield "from_dlpack(device=jax.devices())", lambda: jax.dlpack.from_dlpack(
        a, device=jax.devices())
    yield "from_dlpack(np strided, device='cpu')", lambda: jax.dlpack.from_dlpack(
        np.arange(8.0)[::2], device="cpu")
    for copy in (0, 1, "no", np.bool_(True)):
        yield f"from_dlpack(copy={copy!r})", lambda copy=copy: jax.dlpack.from_dlpack(a, copy=copy)
        yield f"x.__dlpack__(copy={copy!r})", lambda copy=copy: x().__dlpack__(copy=copy)
    for mv in ((), [1, 0], (1,), (1.0, 0), "x", (0, 4), (1, 0, 0)):
        yield f"x.__dlpack__(max_version={mv!r})", lambda mv=mv: x().__dlpack__(max_version=mv)
    for stream in (1, 2, 0, -2, True, -1, 2**64, "x"):
        yield f"x.__dlpack__(stream={stream!r})", lambda s=stream: x().__dlpack__(stream=s)
        yield f"from_dlpack(x).__dlpack__(stream={stream!r})", (
            # Host memory jaxlib views (64-byte aligned): stock's own import
            # and the overlay's are both views, in both runs.
            lambda s=stream: jax.dlpack.from_dlpack(dropin.values((8,), np.dtype(np.float32))
                                                    ).__dlpack__(stream=s))
    yield "x.__dlpack__(max_version='x', dl_device=(2, 0))", (
        lambda: x().__dlpack__(max_version="x", dl_device=(2, 0)))
    yield "x.__dlpack__(stream=1, max_version=(1,))", (
        lambda: x().__dlpack__(stream=1, max_version=(1,)))
    yield "dead.__dlpack_device__()", lambda: _dead().__dlpack_device__()
    yield "dead.__dlpack__()", lambda: _dead().__dlpack__()
    yield "dead.__dlpack__(dl_device=(1,))", lambda: _dead().__dlpack__(dl_device=(1,))
    yield "from_dlpack(dead)", lambda: jax.dlpack.from_dlpack(_dead())
    yield "jnp.from_dlpack(dead)", lambda: jnp.from_dlpack(_dead())
    yield "hasattr(dead, CAI)", lambda: hasattr(_dead(), "__cuda_array_interface__")
    for t in (ml_dtypes.int4, ml_dtypes.uint4):
        y = lambda t=t: jnp.arange(4, dtype=t)  # noqa: E731
        yield f"{t.__name__}.__dlpack__()", lambda y=y: y().__dlpack__()
        yield f"np.from_dlpack({t.__name__})", lambda y=y: np.from_dlpack(y())
        yield f"jnp.from_dlpack({t.__name__})", lambda y=y: jnp.from_dlpack(y())
    yield "asarray(host CAI, dtype='U3')", lambda: jnp.asarray(_HostCAI(a), dtype="U3")
    yield "asarray(host CAI, order='C')", lambda: jnp.asarray(_HostCAI(a), order="C")
    yield "array(host CAI, order='F')", lambda: jnp.array(_HostCAI(a), order="F")
    yield "from_dlpack(byte-swapped, copy=0)", lambda: jax.dlpack.from_dlpack(
        np.arange(3.0, dtype=">f8"), copy=0)
    for device in ((3, 0), (2, 0), (13, 0), (1, 5)):
        yield f"from_dlpack(advertises {device})", (
            lambda d=device: jax.dlpack.from_dlpack(_Advertises(np.arange(3.0), d)))


@pytest.mark.parametrize("x64", [False, True])
def test_edges_match_stock(x64):
    with jax.enable_x64(x64):
        diffs, counts = dropin.differential(list(
            (label, thunk, None) for label, thunk in _edge_cases()))
    assert not diffs, "\n".join(diffs)
    assert counts["stock raised"] > 20  # the table is of edges: most fail on stock


@pytest.mark.parametrize("n,case", params(globals()))
def test_multidevice(n, case):
    check(__file__, n, case)


def test_native_dlpack_is_read_from_the_running_jaxlib():
    """The overlay steps aside for stock's CPU export exactly where the
    running jaxlib exports DLPack 1.x itself."""
    from jax._src import dlpack as stock
    assert rt.NATIVE_DLPACK_1 == (tuple(stock.DLPACK_VERSION) >= (1, 0))
    x = jnp.arange(3.0)
    with installed():
        ours = jax_overlay._dlpack.ours(x)
    assert ours is not rt.NATIVE_DLPACK_1


# --- found by tests/fuzz_dropin.py ------------------------------------------------

class _Refusing(_Advertises):
    """A producer whose __dlpack__ refuses, advertising a device."""

    def __dlpack__(self, **kw):
        raise BufferError("this producer refuses every export")


def _subclass(a):
    return a.view(type("Sub", (np.ndarray,), {}))


def _fuzz_found():
    # Stock looks the producer's device up before asking it for anything.
    for device in ((1, 1), (2, 0), (10, 0)):
        yield f"from_dlpack(refusing producer on {device})", (
            lambda d=device: jax.dlpack.from_dlpack(_Refusing(np.arange(3.0), d)))
        yield f"from_dlpack(misaligned producer on {device}, copy=False)", (
            lambda d=device: jax.dlpack.from_dlpack(
                _Advertises(np.arange(9, dtype=np.int32)[1:], d), copy=False))
    # A device stock refuses before it reads its input.
    for device in (0, False, object(), ["cpu"]):
        for entry in (jnp.asarray, jnp.array):
            yield f"{entry.__name__}(ndarray subclass, copy=False, device={device!r})", (
                lambda e=entry, d=device: e(_subclass(np.arange(3.0)), copy=False, device=d))
            yield f"{entry.__name__}(masked, device={device!r})", (
                lambda e=entry, d=device: e(np.ma.masked_array(np.arange(3.0)), device=d))


def test_fuzz_findings_match_stock():
    diffs, counts = dropin.differential(list(
        (label, thunk, None) for label, thunk in _fuzz_found()))
    assert not diffs, "\n".join(diffs)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32, np.complex64,
                                   ml_dtypes.float8_e4m3fn])
@pytest.mark.parametrize("layout", ["broadcast rows", "broadcast columns", "step", "reversed"])
def test_strided_imports_keep_subnormals(dtype, layout):
    """A strided import is a copy of bits: XLA:CPU turned the gather of a
    broadcast bfloat16 into a broadcast that flushed subnormals (1e-40 read
    0), so the bits move behind an optimization barrier."""
    dtype = np.dtype(dtype)
    bits = np.array([1, 0x3C, 3, 0x1F], np.dtype(f"u{dtype.itemsize}"))
    base = bits.view(dtype)  # the smallest subnormals of each type, and others
    a = {"broadcast rows": lambda: np.broadcast_to(base, (3, base.size)),
         "broadcast columns": lambda: np.broadcast_to(base[:, None], (base.size, 3)),
         "step": lambda: base[::2], "reversed": lambda: base[::-1]}[layout]()
    try:
        a.__dlpack__(max_version=(1, 0))  # what from_dlpack asks for (broadcasts are read-only)
    except BufferError as e:  # NumPy < 2.5 exports no ml_dtypes capsule
        pytest.skip(f"NumPy {np.__version__} exports no {dtype} capsule ({e})")
    out = jax_overlay.from_dlpack(a)
    assert np.asarray(out).tobytes() == np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("tree", [False, True])
def test_device_put_may_alias_false_does_not_alias_numpy(tree):
    """Stock JAX aliases 64-byte aligned NumPy memory on the CPU with
    may_alias=False: a later write to the NumPy array changed the JAX
    array.  Installed, the JAX array keeps the values it was made with."""
    a = dropin.values((16,), np.dtype(np.float32))  # 64-byte aligned: what jaxlib aliases
    want = a.copy()
    with installed():
        out = jax.device_put({"a": a} if tree else a, jax.devices()[0], may_alias=False)
    x = out["a"] if tree else out
    assert x.unsafe_buffer_pointer() != a.ctypes.data
    a[:] = -1
    np.testing.assert_array_equal(np.asarray(x), want)
