"""CAI import on the GPU: zero-copy, stream-ordered, lifetime-safe, for
CuPy, Numba and PyTorch producers."""

import gc
import threading
import time
import weakref

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import _xla_ext as ext  # noqa: E402
from jax_overlay.peers.cupy import PEER as _CUPY_PEER  # noqa: E402

from producers import (  # noqa: E402
    INFLIGHT_MS, PENDING_IMPORTS, STREAMS, WithStream, cycles, is_stale, spin_fill)

imp = jax_overlay.from_cuda_array_interface
TRIALS = 200


def ptr(x):
    return x.unsafe_buffer_pointer()


def wait_for(cond, timeout=5.0):
    """Buffers are freed by PJRT, possibly on its own threads: poll."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return cond()


# --- zero-copy -------------------------------------------------------------

def test_cupy_zero_copy():
    a = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    x = imp(a)
    assert ptr(x) == a.data.ptr
    assert x.devices() == {jax.devices("cuda")[a.device.id]}
    np.testing.assert_array_equal(np.asarray(x), cp.asnumpy(a))


@pytest.mark.parametrize("view", ["T", "F", "perm3"])
def test_cupy_compact_permutations_are_views(view):
    base = cp.arange(24, dtype=cp.float32).reshape(2, 3, 4)
    a = {"T": base[0].T, "F": cp.asfortranarray(base[0]),
         "perm3": base.transpose(2, 0, 1)}[view]
    x = imp(a)
    assert ptr(x) == a.data.ptr
    np.testing.assert_array_equal(np.asarray(x), cp.asnumpy(a))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: v * 2)(x)), cp.asnumpy(a) * 2)


def test_torch_zero_copy():
    torch = pytest.importorskip("torch")
    t = torch.arange(20, dtype=torch.float32, device="cuda").reshape(4, 5)
    torch.cuda.synchronize()
    x = imp(t)
    assert ptr(x) == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(x), t.cpu().numpy())
    tt = t.t()
    y = imp(tt)
    assert ptr(y) == tt.data_ptr()
    np.testing.assert_array_equal(np.asarray(y), tt.cpu().numpy())


def test_numba_zero_copy():
    cuda = pytest.importorskip("numba.cuda")
    d = cuda.to_device(np.arange(10, dtype=np.int32))
    cuda.synchronize()
    x = imp(d)
    assert ptr(x) == d.__cuda_array_interface__["data"][0]
    np.testing.assert_array_equal(np.asarray(x), np.arange(10))


DTYPES = ["bool", "int8", "uint8", "int16", "int32", "uint32", "int64",
          "float16", "float32", "float64", "complex64", "complex128"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(dtype):
    jax.config.update("jax_enable_x64", True)
    try:
        h = (np.arange(10) % 3).astype(dtype)
        if np.dtype(dtype).kind == "c":
            h = h + 1j * h[::-1]
        a = cp.asarray(h)
        x = imp(a)
        assert x.dtype == np.dtype(dtype)
        assert ptr(x) == a.data.ptr
        np.testing.assert_array_equal(np.asarray(x), h)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_0d_and_zero_size():
    a = cp.asarray(np.float32(3.5))
    x = imp(a)
    assert x.shape == () and float(x) == 3.5 and ptr(x) == a.data.ptr
    for shape in [(0,), (3, 0), (0, 0, 2)]:
        z = imp(cp.empty(shape, cp.float32))
        assert z.shape == shape and list(z.devices())[0].platform == "gpu"


# --- stream ordering --------------------------------------------------------

@pytest.mark.parametrize("kind", list(STREAMS))
def test_no_stale_read_with_inflight_producer(kind):
    stream, handle = STREAMS[kind]()
    a = cp.zeros(1 << 20, cp.float32)
    stale = 0
    for k in range(1, TRIALS + 1):
        spin_fill(a, float(k), ms=INFLIGHT_MS, stream=stream)
        x = imp(WithStream(a, handle))
        stale += is_stale(x, k)
    stream.synchronize()
    assert stale == 0, f"{stale} of {TRIALS} reads were stale on the {kind} stream"


def test_control_unordered_import_reads_stale():
    """The detector works: with the stream dropped (v2 semantics) the same
    race shows up, so the test above can fail."""
    stream, _ = STREAMS["user"]()
    a = cp.zeros(1 << 20, cp.float32)
    stale = 0
    for k in range(1, 21):
        spin_fill(a, float(k), ms=2.0, stream=stream)
        x = imp(WithStream(a, None))
        stale += is_stale(x, k)
        stream.synchronize()
    assert stale > 0


@pytest.mark.parametrize("kind", list(STREAMS))
def test_import_does_not_block_host(kind):
    stream, handle = STREAMS[kind]()
    a = cp.zeros(1 << 16, cp.float32)
    inc = jax.jit(lambda v: v + 1)
    inc(imp(a)).block_until_ready()  # compile outside the timed part
    spin_fill(a, 7.0, ms=200.0, stream=stream)
    t0 = time.perf_counter()
    x = imp(WithStream(a, handle))
    dt = time.perf_counter() - t0
    t0 = time.perf_counter()
    y = inc(x)  # JAX's own use must not wait either
    dt_use = time.perf_counter() - t0
    # The producer still runs: neither call can have waited for it.
    assert not stream.done, (
        f"the producer ended within {(dt + dt_use) * 1e3:.1f} ms: the import "
        "or its use waited on the host")
    assert float(jnp.min(y)) == 8.0


@pytest.mark.parametrize("kind", list(STREAMS))
def test_many_imports_while_producer_busy_never_block(kind):
    """PENDING_IMPORTS imports behind a 1.5 s kernel, some dropped while in
    flight: the kernel still runs when the last returns (none waited); then
    as many again past jaxlib's bound, which may wait, and every import
    reads the producer's values."""
    stream, handle = STREAMS[kind]()
    arrays = [cp.zeros(256, cp.float32) for _ in range(8)]
    cp.cuda.Device().synchronize()
    for a in arrays:
        spin_fill(a, 7.0, ms=1500.0 if a is arrays[0] else 0.0, stream=stream)
    kept = []
    t_all = time.perf_counter()
    for i in range(PENDING_IMPORTS):
        kept.append(imp(WithStream(arrays[i % 8], handle)))
        if i % 16 == 15:
            del kept[:4]  # drop some while still in flight
    total = time.perf_counter() - t_all
    still_busy = not stream.done
    for i in range(PENDING_IMPORTS):
        kept.append(imp(WithStream(arrays[i % 8], handle)))
    assert still_busy, f"the producer ended within {total * 1e3:.0f} ms: an import waited for it"
    assert all(float(jnp.min(x)) == 7.0 for x in kept[-16:])
    assert all(np.asarray(x).min() == 7.0 for x in kept[:16])
    stream.synchronize()


def test_cupy_exported_stream_is_honoured():
    s = cp.cuda.Stream(non_blocking=True)
    a = cp.zeros(1 << 20, cp.float32)
    stale = 0
    with s:
        for k in range(1, 51):
            spin_fill(a, float(k), ms=INFLIGHT_MS, stream=s)
            assert a.__cuda_array_interface__.get("stream") == s.ptr
            stale += is_stale(imp(a), k)
    assert stale == 0


def test_numba_inflight_producer_on_its_own_stream():
    """A Numba array bound to a Numba stream exports that stream; a kernel
    still running there must be waited for.  (The kernel is CuPy's, launched
    on Numba's stream: this image's numba-cuda cannot compile kernels under
    NumPy 2.5.)"""
    cuda = pytest.importorskip("numba.cuda")
    s = cuda.stream()
    d = cuda.device_array(1 << 20, np.float32, stream=s)
    handle = d.__cuda_array_interface__["stream"]
    assert isinstance(handle, int) and handle > 2, handle  # Numba exports its stream
    on_numba_stream = _CUPY_PEER.stream(handle)
    alias = cp.asarray(d)
    stale = 0
    for k in range(1, 101):
        spin_fill(alias, float(k), ms=INFLIGHT_MS, stream=on_numba_stream)
        stale += is_stale(imp(d), k)
    s.synchronize()
    assert stale == 0


def test_torch_user_stream_with_explicit_cai_stream():
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    stale = 0
    for k in range(1, 51):
        with torch.cuda.stream(s):
            torch.cuda._sleep(cycles(INFLIGHT_MS))
            t.fill_(float(k))
        stale += is_stale(imp(WithStream(t, s.cuda_stream)), k)
    s.synchronize()
    assert stale == 0


# --- lifetime ---------------------------------------------------------------

def test_pool_reuse_after_producer_dies():
    pool = cp.get_default_memory_pool()
    n = 1 << 22
    a = cp.full(n, 3.0, cp.float32)
    ref_ptr = a.data.ptr
    x = imp(a)
    del a
    gc.collect()
    # Were the block back in CuPy's pool, these would land on it.
    junk = [cp.full(n, -1.0, cp.float32) for _ in range(4)]
    assert all(j.data.ptr != ref_ptr for j in junk)
    cp.cuda.Device().synchronize()
    assert float(jnp.min(x)) == 3.0 and float(jnp.max(x)) == 3.0
    used = pool.used_bytes()
    del x
    assert wait_for(lambda: pool.used_bytes() == used - n * 4), \
        "the block must return once JAX frees it"
    del junk


def test_inflight_jax_computation_keeps_memory():
    """JAX's computation is still queued (behind the producer's kernel) when
    both the JAX array and the producer object are dropped: the memory must
    stay with JAX until the computation has read it."""
    n = 1 << 24

    @jax.jit
    def heavy(v):
        for _ in range(20):
            v = jnp.sqrt(v * v + 1.0) - 0.5
        return v

    s = cp.cuda.Stream(non_blocking=True)
    a = cp.zeros(n, cp.float32)
    # Compile for an imported (committed) array first: compiling while JAX's
    # stream waits on the producer would itself wait for the producer.
    heavy(imp(a)).block_until_ready()
    ref_ptr = a.data.ptr
    spin_fill(a, 2.0, ms=300.0, stream=s)
    x = imp(WithStream(a, s.ptr))
    y = heavy(x)  # queued behind the producer's kernel
    del x, a
    gc.collect()
    junk = cp.full(n, -7.0, cp.float32)  # would land on the block if freed early
    assert not s.done, "the producer finished too early for this test"
    assert junk.data.ptr != ref_ptr
    want = float(heavy(jnp.full((1,), 2.0, jnp.float32))[0])
    assert float(jnp.min(y)) == want and float(jnp.max(y)) == want


def test_producer_refcount_returns_to_baseline():
    a = cp.arange(100, dtype=cp.float32)
    ref = weakref.ref(a)
    xs = [imp(a) for _ in range(50)]
    del a
    gc.collect()
    assert ref() is not None
    del xs
    gc.collect()
    assert ref() is None


def test_threads_import_compute_delete():
    errors = []
    live = ext.live_tensors()

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            s = cp.cuda.Stream(non_blocking=True)
            for _ in range(100):
                n = int(rng.choice([1, 257, 4096]))  # few shapes: few compiles
                with s:
                    a = cp.arange(n, dtype=cp.float32)
                x = imp(WithStream(a, s.ptr))
                del a
                if float(jnp.sum(x)) != n * (n - 1) / 2:
                    errors.append(("wrong sum", n))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert wait_for(lambda: ext.live_tensors() == live), ext.live_tensors() - live


# --- copies -----------------------------------------------------------------

STRIDED = {
    "sliced": lambda a: a[:, ::2],
    "negative": lambda a: a[::-1, ::-1],
    "broadcast": lambda a: cp.broadcast_to(a[0], (5, a.shape[1])),
    "window": lambda a: a[1:5, 3:7],
    "misaligned": lambda a: a.reshape(-1)[1:],
}


@pytest.mark.parametrize("name", STRIDED)
@pytest.mark.parametrize("dtype", ["float32", "float16", "complex64", "int8", "bool"])
def test_strided_copies_on_gpu(name, dtype, monkeypatch):
    base = cp.asarray((np.arange(64 * 9) % 7).astype(dtype).reshape(64, 9))
    v = STRIDED[name](base)
    x = imp(v)
    np.testing.assert_array_equal(np.asarray(x), cp.asnumpy(v))
    assert list(x.devices())[0].platform == "gpu"
    if not (v.flags.c_contiguous and v.data.ptr % 16 == 0):
        assert ptr(x) != v.data.ptr
        if name == "misaligned":
            # Stock JAX views it even so, and XLA's kernels may refuse that
            # view at use: one aligned copy, unless strict_copy refuses.
            y = imp(v, copy=False)
            assert ptr(y) != v.data.ptr
            np.testing.assert_array_equal(np.asarray(y), cp.asnumpy(v))
            monkeypatch.setattr(jax_overlay.config, "strict_copy", True)
        with pytest.raises(BufferError, match="without a copy"):
            imp(v, copy=False)


def test_strided_copy_ordered_after_inflight_producer():
    s = cp.cuda.Stream(non_blocking=True)
    a = cp.zeros((512, 1024), cp.float32)
    stale = 0
    for k in range(1, 51):
        spin_fill(a, float(k), ms=INFLIGHT_MS, stream=s)
        stale += is_stale(imp(WithStream(a[::2, ::-3], s.ptr)), k)
    assert stale == 0


# --- memory kinds -----------------------------------------------------------

def test_pinned_numba_mapped_array():
    cuda = pytest.importorskip("numba.cuda")
    m = cuda.mapped_array(16, np.float32)
    m[:] = np.arange(16)
    x = imp(m)
    assert x.sharding.memory_kind == "pinned_host"
    assert ptr(x) == m.__cuda_array_interface__["data"][0]
    np.testing.assert_array_equal(np.asarray(x), np.arange(16))
    on_device = jax.sharding.SingleDeviceSharding(jax.devices("cuda")[0], memory_kind="device")
    y = jax.device_put(x, on_device)
    np.testing.assert_array_equal(np.asarray(y * 2), np.arange(16) * 2)


def test_managed_memory_cupy_pool():
    pool = cp.cuda.MemoryPool(cp.cuda.malloc_managed)
    with cp.cuda.using_allocator(pool.malloc):
        a = cp.arange(1000, dtype=cp.float32)
    assert ext.pointer_info(a.data.ptr).kind == "managed"
    x = imp(a)
    assert x.sharding.memory_kind == "device"
    assert ptr(x) == a.data.ptr
    np.testing.assert_array_equal(np.asarray(x + 1), np.arange(1000) + 1)


# --- copy / device ----------------------------------------------------------

def test_copy_true_and_device():
    a = cp.arange(8, dtype=cp.float32)
    x = imp(a, copy=True)
    assert ptr(x) != a.data.ptr
    x.block_until_ready()
    a[:] = -1
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(np.asarray(x), np.arange(8))
    dev = jax.devices("cuda")[0]
    y = imp(a, device=dev, copy=False)
    assert ptr(y) == a.data.ptr
    cpu = jax.devices("cpu")[0]
    z = imp(a, device=cpu)
    assert z.devices() == {cpu}
    with pytest.raises(BufferError, match="copy"):
        imp(a, device=cpu, copy=False)


# --- install ----------------------------------------------------------------

def test_installed_asarray_is_zero_copy_and_ordered():
    jax_overlay.install()
    try:
        s = cp.cuda.Stream(non_blocking=True)
        a = cp.zeros(1 << 20, cp.float32)
        stale = 0
        with s:
            for k in range(1, 51):
                spin_fill(a, float(k), ms=INFLIGHT_MS, stream=s)
                x = jnp.asarray(a)
                assert ptr(x) == a.data.ptr
                stale += is_stale(x, k)
        assert stale == 0
        y = jnp.array(a)
        assert ptr(y) != a.data.ptr
    finally:
        jax_overlay.uninstall()
