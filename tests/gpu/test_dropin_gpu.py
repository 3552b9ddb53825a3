"""The drop-in rule on the GPU, differentially (tests/dropin.py): every entry
point x CuPy, PyTorch and Numba producers x dtype x layout x copy x device,
on stock JAX and installed in one process, each result also checked against
the producer's own values; the exports read by CuPy, PyTorch and Numba; and the
routes install() takes (CAI where it gives the same array, DLPack else),
with in-flight producers on PyTorch's and CuPy's current streams."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dropin as D  # noqa: E402
import jax_overlay  # noqa: E402
from jax_overlay import _dlpack  # noqa: E402
from jax_overlay import _cai, _view, peers  # noqa: E402
from jax_overlay import _runtime as rt  # noqa: E402

from producers import INFLIGHT_MS, cycles, spin_fill  # noqa: E402

GPU = jax.devices("cuda")[0]
CPU = jax.devices("cpu")[0]
COORDS = [(copy, name, dev) for copy in D.COPIES for name, dev in (
    ("None", None), ("gpu0", GPU), ("cpu0", CPU),
    ("pinned", jax.sharding.SingleDeviceSharding(GPU, memory_kind="pinned_host")))]
CUPY_DTYPES = [d for d in D.DTYPES if d.name not in ("bfloat16", "float8_e4m3fn")]
CUPY_LAYOUTS = ("aligned", "unaligned", "strided", "reversed", "transposed", "0d", "empty")


def _cupy(dtype, layout):
    def make():
        host = D.values((8, 16), dtype)
        return D.layout(cp.asarray(host), layout)
    return make


def _check(diffs, counts):
    assert counts["stock ok"] > 0
    assert not diffs, f"{len(diffs)} differences:\n" + "\n".join(diffs[:40])


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("dtype", CUPY_DTYPES, ids=str)
def test_cupy_imports_match_stock(dtype, x64):
    producers = {layout: _cupy(dtype, layout) for layout in CUPY_LAYOUTS}
    cases = D.import_cases(D.IMPORTS, producers, COORDS, cp.asnumpy)
    with rt.x64(x64):
        _check(*D.differential(cases))
    cp.cuda.Device().synchronize()


def _torch():
    return pytest.importorskip("torch")


TORCH_DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "int64", "float16",
                "bfloat16", "float32", "float64", "complex64", "complex128")


def _torch_truth(t):
    torch = _torch()
    t = t.detach().resolve_conj().resolve_neg().cpu()  # the lazy bits applied
    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy()


def _torch_producers(name):
    torch = _torch()
    dtype = getattr(torch, name)
    np_dtype = np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)

    def base():
        host = D.values((8, 16), np_dtype)
        if name == "bfloat16":
            return torch.from_numpy(host.view(np.int16)).view(dtype).cuda()
        return torch.from_numpy(host).cuda()
    out = {
        "aligned": base, "strided": lambda: base()[:, ::2],
        "unaligned": lambda: base().reshape(-1)[1:], "transposed": lambda: base().T,
        "0d": lambda: base().reshape(-1)[3], "empty": lambda: base()[:0],
        "pinned": lambda: base().cpu().pin_memory(), "cpu": lambda: base().cpu(),
    }
    if dtype.is_floating_point:
        out["requires_grad"] = lambda: base().requires_grad_(True)
    if dtype.is_complex:
        out["conj_view"] = lambda: base().conj()
        # A negative view, the usual way: neither the CAI (stock
        # jnp.asarray's route) nor __dlpack__ carries its sign.
        out["conj_imag"] = lambda: base().conj().imag
    try:
        torch._neg_view(base()).resolve_neg()
    except RuntimeError:  # no negation on the GPU for this dtype: see below
        pass
    else:
        out["neg_view"] = lambda: torch._neg_view(base())
        out["neg_view_strided"] = lambda: torch._neg_view(base())[:, ::2]
    return out


@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_torch_imports_match_stock(name):
    cases = D.import_cases(D.IMPORTS, _torch_producers(name), COORDS, _torch_truth)
    _check(*D.differential(cases))
    _torch().cuda.synchronize()


@pytest.mark.parametrize("entry", ["jnp.asarray", "jnp.array", "jax.dlpack.from_dlpack",
                                   "jnp.from_dlpack", "device_put"])
def test_torch_negative_views_it_cannot_negate_are_refused(installed, entry):
    """A negative view of bool: PyTorch has no negation for it, so its
    values exist nowhere (stock reads the memory as it is); installed
    refuses it, as an instance of both classes stock raises at these entry
    points for a tensor it cannot read."""
    torch = _torch()
    t = torch._neg_view(torch.ones(3, dtype=torch.bool, device="cuda"))
    with pytest.raises(BufferError, match="cannot resolve") as e:
        ENTRIES[entry](t)
    assert isinstance(e.value, jax.errors.JaxRuntimeError if entry != "device_put" else TypeError)


@pytest.mark.parametrize("view", ["conj()", "conj().imag", "_neg_view"])
def test_torch_lazy_views_read_right_through_the_cai(view):
    """jax_overlay.from_cuda_array_interface of a conjugate or negative
    view: PyTorch's CAI describes the memory without the bit, so the
    tensor is resolved first (a copy); copy=False refuses."""
    torch = _torch()
    z = torch.complex(torch.arange(1.0, 9.0), torch.arange(2.0, 10.0)).cuda()
    t = eval(f"z.{view}" if view != "_neg_view" else "torch._neg_view(z.real)",
             {"z": z, "torch": torch})
    got = jax_overlay.from_cuda_array_interface(t)
    np.testing.assert_array_equal(np.asarray(got), _torch_truth(t))
    with pytest.raises(BufferError, match="lazy"):
        jax_overlay.from_cuda_array_interface(t, copy=False)


NUMBA_LAYOUTS = ("aligned", "unaligned", "strided", "transposed", "empty", "mapped", "managed")


def _numba_producers(dtype):
    """{layout: (factory, the producer's values on the host)}: Numba device
    arrays and their views, and mapped (pinned) and managed arrays, which
    export the CUDA Array Interface only.  The values come from the host
    data in the same layout, not through Numba's own copies."""
    cuda = pytest.importorskip("numba.cuda")
    host = D.values((8, 16), dtype)
    def transposed(a):
        if isinstance(a, np.ndarray):
            return a.T
        # A view with swapped strides over the same device memory; Numba's
        # own .T is a copy, made by a kernel.
        desc = dict(a.__cuda_array_interface__, shape=a.shape[::-1], strides=a.strides[::-1])
        return cuda.from_cuda_array_interface(desc, owner=a, sync=False)
    views = {"aligned": lambda a: a, "unaligned": lambda a: a.reshape(-1)[1:],
             "strided": lambda a: a[:, ::2], "transposed": transposed,
             "empty": lambda a: a[:0]}

    def filled(alloc):
        def make():
            m = alloc(host.shape, dtype)
            m[...] = host  # written by the host: no producer stream
            return m
        return make
    out = {name: ((lambda view=view: view(cuda.to_device(host))), view(host))
           for name, view in views.items()}
    out["mapped"] = (filled(cuda.mapped_array), host)
    out["managed"] = (filled(cuda.managed_array), host)
    return out


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("dtype", CUPY_DTYPES, ids=str)
def test_numba_imports_match_stock(dtype, x64):
    cases = []
    for layout, (make, values) in _numba_producers(dtype).items():
        cases += D.import_cases(D.IMPORTS, {layout: make}, COORDS,
                                lambda _, values=values: np.asarray(values))
    cuda = pytest.importorskip("numba.cuda")
    # Numba frees dead arrays in batches (CUDA_DEALLOCS_COUNT, 10).  On the
    # H200 the read after a batch of mapped or managed frees failed
    # (CUDA_ERROR_INVALID_VALUE) for stock JAX's views, which do not hold
    # the producer, and for jnp.array's host copies of them too
    # (benchmarks/probe_numba_frees.py): the batches wait until the cases
    # are judged, so that one case's frees are not charged to another
    # case's read.  test_numba_host_arrays_read_through_their_cai_are_held
    # frees them on purpose.
    with rt.x64(x64), cuda.defer_cleanup():
        _check(*D.differential(cases))


@pytest.mark.parametrize("entry", [
    "jnp.asarray(m, device=GPU)", "jnp.asarray(m, dtype=m.dtype, device=GPU)",
    "jnp.array(m, copy=False, device=GPU)"])
@pytest.mark.parametrize("kind", ["mapped_array", "managed_array"])
def test_numba_host_arrays_read_through_their_cai_are_held(kind, entry):
    """Numba's mapped and managed arrays are NumPy arrays whose __dlpack__
    is NumPy's (host memory).  Where stock jnp.asarray/jnp.array read their
    CAI instead (device= given), stock's view does not hold the producer;
    installed, the view holds it: alive after the caller drops it, and
    read right after Numba has freed a few batches of dead arrays."""
    import gc
    import weakref
    cuda = pytest.importorskip("numba.cuda")
    alloc = getattr(cuda, kind)
    vals = np.arange(4096, dtype=np.float32).reshape(64, 64)
    jax_overlay.install()
    try:
        m = alloc(vals.shape, vals.dtype)
        m[...] = vals
        x = eval(entry, {"jnp": jnp, "m": m, "GPU": GPU})
        assert x.unsafe_buffer_pointer() == m.__cuda_array_interface__["data"][0]
        held = weakref.ref(m)
        del m
        gc.collect()
        assert held() is not None, "the import does not hold the producer"
        for k in range(40):  # four batches of Numba's frees (CUDA_DEALLOCS_COUNT 10)
            alloc(vals.shape, vals.dtype)[...] = -k  # dies at once: a pending free
        gc.collect()
        np.testing.assert_array_equal(np.asarray(x), vals)
        assert x.sharding.memory_kind == "device"
    finally:
        jax_overlay.uninstall()


def _export_cases(dtype):
    torch = _torch()

    def x():
        return jnp.asarray(D.values((8, 16), dtype), device=GPU)
    yield "cupy.asarray (CAI)", lambda: cp.asnumpy(cp.asarray(x())), None
    yield "cupy.from_dlpack", lambda: cp.asnumpy(cp.from_dlpack(x())), None
    yield "torch.as_tensor (CAI)", lambda: _torch_truth(torch.as_tensor(x(), device="cuda")), None
    yield "torch.from_dlpack", lambda: _torch_truth(torch.from_dlpack(x())), None
    try:
        from numba import cuda
    except ImportError:
        pass
    else:
        yield "numba.cuda.as_cuda_array (CAI)", lambda: cuda.as_cuda_array(x()).copy_to_host(), None
    yield "__dlpack_device__", lambda: x().__dlpack_device__(), None
    yield "hasattr(CAI)", lambda: hasattr(x(), "__cuda_array_interface__"), None
    yield "CAI shape/typestr", lambda: (lambda c: (c["shape"], c["typestr"]))(
        x().__cuda_array_interface__), None


@pytest.mark.parametrize("dtype", D.DTYPES, ids=str)
def test_exports_match_stock(dtype):
    with rt.x64(True):
        _check(*D.differential(_export_cases(dtype)))


# --- routes ----------------------------------------------------------------

@pytest.fixture
def no_dlpack(monkeypatch):
    """Fails any DLPack import: the CAI route must be taken."""
    def refuse(*a, **k):
        raise AssertionError("took the DLPack route")
    monkeypatch.setattr(_dlpack, "import_dlpack", refuse)


ENTRIES = {"jnp.asarray": lambda a: jnp.asarray(a), "jnp.array": lambda a: jnp.array(a),
           "device_put": lambda a: jax.device_put(a),
           "jax.dlpack.from_dlpack": lambda a: jax.dlpack.from_dlpack(a),
           "jnp.from_dlpack": lambda a: jnp.from_dlpack(a)}


@pytest.mark.parametrize("entry", ENTRIES)
def test_cupy_and_torch_take_the_cai_route(entry, installed, no_dlpack):
    torch = _torch()
    f = ENTRIES[entry]
    a = cp.arange(24, dtype=cp.float32).reshape(4, 6)
    t = torch.arange(24, dtype=torch.float32, device="cuda").reshape(4, 6)
    for src, want in ((a, cp.asnumpy(a)), (a[::-1], cp.asnumpy(a[::-1])),
                      (t, t.cpu().numpy()), (t.T, t.T.cpu().numpy())):
        np.testing.assert_array_equal(np.asarray(f(src)), want)
    # Zero-copy where the layout allows it.
    assert jnp.asarray(a).unsafe_buffer_pointer() == a.data.ptr
    assert jnp.asarray(t).unsafe_buffer_pointer() == t.data_ptr()


def test_reversed_cupy_view_whose_capsule_is_wrong():
    """CuPy's __dlpack__ of a reversed view carries a wrong stride: the CAI
    route reads it right; the capsule itself is refused, never read."""
    a = cp.arange(10, dtype=cp.float32)
    v = a[::-1]
    jax_overlay.install()
    try:
        np.testing.assert_array_equal(np.asarray(jnp.asarray(v)), cp.asnumpy(v))
        np.testing.assert_array_equal(np.asarray(jax.dlpack.from_dlpack(v)), cp.asnumpy(v))
    finally:
        jax_overlay.uninstall()
    try:
        x = _dlpack.import_dlpack(v)[0]
    except BufferError:
        return  # refused: the capsule's strides leave the allocation
    np.testing.assert_array_equal(np.asarray(x), cp.asnumpy(v))  # a fixed CuPy


@pytest.mark.parametrize("grad", [False, True])
def test_torch_routes_by_what_its_cai_can_say(grad, installed):
    torch = _torch()
    seen = []
    real = _cai.import_cai

    def spy(*a, **k):
        seen.append("cai")
        return real(*a, **k)
    t = torch.arange(6.0, device="cuda").requires_grad_(grad)
    b = torch.arange(6.0, device="cuda").to(torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_cai, "import_cai", spy)
        if grad:  # torch refuses both protocols: its own RuntimeError, as stock
            with pytest.raises(RuntimeError):
                jnp.asarray(t)
        else:
            np.testing.assert_array_equal(np.asarray(jnp.asarray(t)), np.arange(6.0))
            assert seen == ["cai"]
        x = jnp.asarray(b)  # bfloat16: PyTorch's CAI says '<f2'; DLPack
        assert x.dtype == jnp.bfloat16 and seen == ([] if grad else ["cai"])
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.arange(6.0))


TRIALS = 200


@pytest.mark.parametrize("entry", ["jnp.asarray", "jax.dlpack.from_dlpack"])
def test_torch_in_flight_on_its_current_user_stream(entry, installed):
    """The CAI route orders after PyTorch's current stream, as its
    __dlpack__ does: a tensor still being written there is read final."""
    torch = _torch()
    f = ENTRIES[entry]
    s = torch.cuda.Stream()
    stale = 0
    for k in range(TRIALS):
        with torch.cuda.stream(s):
            t = torch.zeros(1 << 20, device="cuda")
            torch.cuda._sleep(cycles(INFLIGHT_MS))
            t.fill_(k + 1)
            x = f(t)
        stale += int(float(np.asarray(x[-1])) != k + 1)
    assert stale == 0


@pytest.mark.parametrize("entry", ["jnp.asarray", "jax.dlpack.from_dlpack"])
def test_cupy_in_flight_on_its_current_user_stream(entry, installed):
    f = ENTRIES[entry]
    s = cp.cuda.Stream(non_blocking=True)
    stale = 0
    for k in range(TRIALS):
        with s:
            a = cp.empty(1 << 20, cp.float32)
            spin_fill(a, float(k + 1), ms=INFLIGHT_MS, stream=s)
            x = f(a)
        stale += int(float(np.asarray(x[-1])) != k + 1)
    assert stale == 0


class PinnedCAI:
    """A CAI over pinned host memory, as Numba's mapped arrays export it."""

    def __init__(self, values):
        self.mem = cp.cuda.alloc_pinned_memory(values.nbytes)
        self.host = np.frombuffer(self.mem, values.dtype, values.size).reshape(values.shape)
        self.host[...] = values
        self.__cuda_array_interface__ = {
            "shape": values.shape, "typestr": values.dtype.str, "strides": None,
            "data": (self.host.ctypes.data, False), "version": 3, "stream": None}


@pytest.mark.parametrize("entry", ["jnp.asarray", "jnp.array"])
def test_pinned_cai_imports_as_stock_does(entry):
    """Stock JAX's CAI import of pinned memory is a device array over the
    same pages (zero-copy for asarray); installed, the same, and it holds
    the producer alive."""
    import gc
    import weakref
    vals = np.arange(4096, dtype=np.float32)
    f = ENTRIES[entry]  # looked up at call time: install() replaces them
    seen = {}
    for mode in ("stock", "installed"):
        if mode == "installed":
            jax_overlay.install()
        try:
            src = PinnedCAI(vals)
            x = f(src)
            seen[mode] = (x.dtype, x.shape, x.sharding.memory_kind, x.devices(),
                          x.unsafe_buffer_pointer() == src.host.ctypes.data)
            if mode == "installed":
                assert seen[mode] == seen["stock"]
                held = weakref.ref(src)
                del src
                gc.collect()
                if entry == "jnp.asarray":  # a view: it must hold the producer
                    assert held() is not None, "the import does not hold the producer"
                churn = [PinnedCAI(-vals) for _ in range(8)]  # noqa: F841 - would reuse freed pages
                np.testing.assert_array_equal(np.asarray(x), vals)
        finally:
            jax_overlay.uninstall()
    assert seen["installed"] == seen["stock"]
    assert seen["stock"][-1] == (entry == "jnp.asarray")
