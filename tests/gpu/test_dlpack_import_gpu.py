"""DLPack import on the GPU: PyTorch and CuPy producers, zero-copy, ordered
after in-flight producer work without host waits, every memory kind."""

import gc

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import _dlpack  # noqa: E402
from jax_overlay import _xla_ext as ext  # noqa: E402

from producers import INFLIGHT_MS, PENDING_IMPORTS, STREAMS, cycles, is_stale, spin_fill  # noqa: E402

TRIALS = 100


def ptr(x):
    return x.unsafe_buffer_pointer()


def test_cupy_zero_copy_and_values():
    a = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    x = jax_overlay.from_dlpack(a)
    assert ptr(x) == a.data.ptr
    np.testing.assert_array_equal(np.asarray(x), cp.asnumpy(a))


def test_torch_zero_copy_and_values():
    torch = pytest.importorskip("torch")
    t = torch.arange(20, dtype=torch.float32, device="cuda").reshape(4, 5)
    x = jax_overlay.from_dlpack(t)
    assert ptr(x) == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(x), t.cpu().numpy())


@pytest.mark.parametrize("kind", list(STREAMS))
def test_cupy_inflight_producer_no_stale_reads(kind):
    stream, _ = STREAMS[kind]()
    a = cp.zeros(1 << 20, cp.float32)
    stale = 0
    with stream:
        for k in range(1, TRIALS + 1):
            spin_fill(a, float(k), ms=INFLIGHT_MS, stream=stream)
            stale += is_stale(jax_overlay.from_dlpack(a), k)
    stream.synchronize()
    assert stale == 0


def test_torch_inflight_producer_no_stale_reads():
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    stale = 0
    with torch.cuda.stream(s):
        for k in range(1, TRIALS + 1):
            torch.cuda._sleep(cycles(INFLIGHT_MS))
            t.fill_(float(k))
            stale += is_stale(jax_overlay.from_dlpack(t), k)
    s.synchronize()
    assert stale == 0


def test_import_does_not_wait_for_the_producer():
    stream, _ = STREAMS["user"]()
    a = cp.zeros(1 << 16, cp.float32)
    inc = jax.jit(lambda v: v + 1)
    inc(jax_overlay.from_dlpack(a)).block_until_ready()
    with stream:
        spin_fill(a, 7.0, ms=300.0, stream=stream)
        y = inc(jax_overlay.from_dlpack(a))
        z = jax_overlay.from_cuda_array_interface(a)
    assert not stream.done, "the import or its use waited for the producer"
    assert float(jnp.min(y)) == 8.0 and np.asarray(z).min() == 7.0


def test_cupy_managed_memory():
    pool = cp.cuda.MemoryPool(cp.cuda.malloc_managed)
    with cp.cuda.using_allocator(pool.malloc):
        a = cp.arange(1000, dtype=cp.float32)
    assert ext.pointer_info(a.data.ptr).kind == "managed"
    x = jax_overlay.from_dlpack(a)
    assert ptr(x) == a.data.ptr and x.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(x + 1), np.arange(1000) + 1)


def test_torch_pinned_tensor_becomes_pinned_host_view():
    torch = pytest.importorskip("torch")
    t = torch.arange(16, dtype=torch.float32).pin_memory()
    x = jax_overlay.from_dlpack(t)
    assert x.sharding.memory_kind == "pinned_host"
    assert ptr(x) == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(x), np.arange(16))


def test_torch_strided_tensor_is_one_gpu_copy():
    torch = pytest.importorskip("torch")
    t = torch.arange(64 * 9, dtype=torch.float32, device="cuda").reshape(64, 9)[::2, 1::3]
    x = jax_overlay.from_dlpack(t)
    np.testing.assert_array_equal(np.asarray(x), t.cpu().numpy())
    with pytest.raises(BufferError, match="without a copy"):
        jax_overlay.from_dlpack(t, copy=False)


def test_producer_memory_kept_until_jax_frees_it():
    pool = cp.get_default_memory_pool()
    n = 1 << 22
    a = cp.full(n, 3.0, cp.float32)
    x = jax_overlay.from_dlpack(a)
    del a
    gc.collect()
    junk = cp.full(n, -1.0, cp.float32)
    assert junk.data.ptr != ptr(x)
    assert float(jnp.min(x)) == 3.0 and float(jnp.max(x)) == 3.0
    used = pool.used_bytes()
    del x
    for _ in range(500):  # PJRT frees the buffer, possibly on its own thread
        gc.collect()
        if pool.used_bytes() == used - n * 4:
            break
        jax.effects_barrier()
    assert pool.used_bytes() == used - n * 4, "the block must return once JAX frees it"


# CuPy's own __dlpack__ blocks here: measured on the H200 (CuPy 14.2), its
# 1022nd call with a consumer stream behind a busy stream waited on the host
# until the producer was done, with jax_overlay out of the picture
# (benchmarks/probe_dlpack.py, "inflight scan").  It syncs with a new event
# per call, created with timing enabled; PyTorch's __dlpack__ and the CAI
# path (events without timing) passed 3000 calls.  Not strict: CuPy blocks
# only while ~1021 of its syncs are pending at once, and under -n 4 with the
# GPU loaded (H200, 2026-12-06) fewer were, and it passed.
CUPY_BLOCKS = pytest.mark.xfail(
    strict=False, reason="CuPy's __dlpack__ blocks the host after ~1021 pending syncs")


@pytest.mark.parametrize("producer", [
    "cupy", pytest.param("cupy-capsule", marks=CUPY_BLOCKS), "torch", "torch-capsule"])
def test_many_imports_while_producer_busy_never_block(producer):
    """PENDING_IMPORTS imports behind a 1.5 s kernel on the producer's
    current stream: the kernel is still running when the last returns, so
    none waited for it; as many again past jaxlib's bound (which may wait)
    read the producer's values.  from_dlpack takes CuPy's and PyTorch's CUDA
    Array Interface (see _route.cai_route), which avoids CuPy's blocking
    __dlpack__; "-capsule" forces their __dlpack__."""
    imp = jax_overlay.from_dlpack
    if producer.endswith("-capsule"):
        def imp(a):
            return _dlpack.import_dlpack(a)[0]
    if producer.startswith("cupy"):
        s = cp.cuda.Stream(non_blocking=True)
        arrays = [cp.zeros(256, cp.float32) for _ in range(8)]
        cp.cuda.Device().synchronize()
        spin_fill(arrays[0], 7.0, ms=1500.0, stream=s)
        for a in arrays[1:]:
            spin_fill(a, 7.0, ms=0.0, stream=s)
        ctx, busy = s, lambda: not s.done
    else:
        torch = pytest.importorskip("torch")
        s = torch.cuda.Stream()
        arrays = [torch.zeros(256, device="cuda") for _ in range(8)]
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            torch.cuda._sleep(3_000_000_000)
            for t in arrays:
                t.fill_(7.0)
        ctx, busy = torch.cuda.stream(s), lambda: not s.query()
    kept = []
    with ctx:
        for i in range(PENDING_IMPORTS):
            kept.append(imp(arrays[i % 8]))
            if i % 16 == 15:
                del kept[:4]  # drop some while still in flight
        still_busy = busy()
        for i in range(PENDING_IMPORTS):
            kept.append(imp(arrays[i % 8]))
    assert still_busy, "the producer ended before the imports did: an import waited for it"
    assert all(float(jnp.min(x)) == 7.0 for x in kept[-16:])
    assert all(np.asarray(x).min() == 7.0 for x in kept[:16])
    s.synchronize()
