"""CAI v3 export on the GPU: consumers reading a JAX array whose producing
computation is still running get the final data; the host never waits."""

import time

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import config  # noqa: E402

from producers import JAX_N as N, jax_fill, numba_double  # noqa: E402

TRIALS = 50


@pytest.fixture(autouse=True)
def installed():
    jax_overlay.install()
    jax_fill(0.0).block_until_ready()
    yield
    jax_overlay.uninstall()


def trials(read):
    stale, pending = 0, 0
    for k in range(1, TRIALS + 1):
        x = jax_fill(k)
        pending += not x.is_ready()
        lo, hi = read(x)
        stale += (lo, hi) != (k, k)
    return stale, pending


def test_cupy_reads_inflight_arrays_correctly():
    def read(x):
        c = cp.asarray(x)
        assert c.data.ptr == x.unsafe_buffer_pointer()
        return float(c.min()), float(c.max())
    stale, pending = trials(read)
    assert pending > TRIALS // 2, "the producer was not in flight: the test proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} CuPy reads were stale"


def test_control_sync_off_reads_stale(monkeypatch):
    """The detector works: without ordering, CuPy reads early."""
    monkeypatch.setattr(config, "cai_sync", False)
    stale, _ = trials(lambda x: (float(cp.asarray(x).min()), float(cp.asarray(x).max())))
    assert stale > 0


def test_export_returns_while_computation_runs():
    jax_fill(0.0, steps=20000).block_until_ready()  # compile outside the timed part
    x = jax_fill(3.0, steps=20000)
    assert not x.is_ready()
    t0 = time.perf_counter()
    d = x.__cuda_array_interface__
    dt = time.perf_counter() - t0
    # Still computing after the export returned: the export did not wait.
    assert not x.is_ready(), f"the array was ready {dt * 1e3:.2f} ms later: the export waited"
    assert d["stream"] == 1 and d["version"] == 3, (d, f"{dt * 1e3:.2f} ms")
    c = cp.asarray(x)
    assert float(c.min()) == 3.0 and float(c.max()) == 3.0


def test_torch_reads_inflight_arrays_correctly():
    torch = pytest.importorskip("torch")

    def read(x):
        t = torch.as_tensor(x, device="cuda")
        assert t.data_ptr() == x.unsafe_buffer_pointer()
        return float(t.min()), float(t.max())
    stale, pending = trials(read)
    assert pending > TRIALS // 2
    assert stale == 0, f"{stale} of {TRIALS} PyTorch reads were stale"


def test_torch_refuses_read_only_setting(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(config, "cai_read_only", True)
    x = jnp.arange(4.0)
    assert x.__cuda_array_interface__["data"][1] is True
    with pytest.raises(TypeError):
        torch.as_tensor(x, device="cuda")


def test_numba_as_cuda_array_reads_inflight_arrays_correctly():
    cuda = pytest.importorskip("numba.cuda")

    def read(x):
        d = cuda.as_cuda_array(x)
        assert d.__cuda_array_interface__["data"][0] == x.unsafe_buffer_pointer()
        h = d.copy_to_host()
        return float(h.min()), float(h.max())
    stale, pending = trials(read)
    assert pending > TRIALS // 2
    assert stale == 0


def test_numba_kernel_takes_jax_array():
    cuda, double = numba_double()
    x = jax_fill(5.0)
    out = cuda.device_array(N, np.float32)
    double[N // 256, 256](x, out)
    h = out.copy_to_host()
    assert h.min() == 10.0 and h.max() == 10.0


def test_numba_kernel_reads_inflight_jax_arrays():
    """A kernel launched on a JAX array whose computation is still running
    reads its final values: Numba orders its launch after the stream of
    the version-3 CAI export."""
    cuda, double = numba_double()
    out = cuda.device_array(N, np.float32)

    def read(x):
        double[N // 256, 256](x, out)
        h = out.copy_to_host()
        return float(h.min()) / 2, float(h.max()) / 2
    stale, pending = trials(read)
    assert pending > TRIALS // 2, "the producer was not in flight: the test proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} Numba kernels read stale data"


def test_layouts_and_pointers():
    base = cp.arange(24, dtype=cp.float32).reshape(4, 6)
    for v in (cp.asfortranarray(base), base.T):
        x = jax_overlay.from_cuda_array_interface(v)
        d = x.__cuda_array_interface__
        assert d["strides"] == v.strides and d["data"][0] == v.data.ptr
        back = cp.asarray(x)
        assert back.data.ptr == v.data.ptr
        np.testing.assert_array_equal(cp.asnumpy(back), cp.asnumpy(v))


def test_pinned_host_array_read_by_cupy_kernel():
    dev = jax.devices("cuda")[0]
    x = jax.device_put(np.arange(16, dtype=np.float32),
                       jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
    c = cp.asarray(x)
    assert c.data.ptr == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(cp.asnumpy(c * 2), np.arange(16) * 2)


def test_errors_on_gpu():
    with pytest.raises(AttributeError, match="DLPack"):
        jnp.zeros(3, jnp.bfloat16).__cuda_array_interface__
    x = jnp.zeros(3)
    x.delete()
    with pytest.raises(BufferError, match="deleted"):
        x.__cuda_array_interface__


def test_ready_array_facts_are_kept_then_dropped():
    """A ready array's CAI facts are kept per array (the property is read
    again and again); each read is a fresh dict, deletion is still seen, and
    the entry goes with the array."""
    from jax_overlay import _cai, _dlpack
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) + 0
    x.block_until_ready()
    first = x.__cuda_array_interface__
    assert id(x) in _cai._ready_facts
    again = x.__cuda_array_interface__
    assert again == first and again is not first and again["descr"] is not first["descr"]
    again["shape"] = (99,)
    assert x.__cuda_array_interface__["shape"] == (3, 4)
    assert x.__cuda_array_interface__["data"] == (x.unsafe_buffer_pointer(), False)
    assert jax_overlay.cuda_array_interface(x, read_only=True)["data"][1] is True
    assert cp.asarray(x).get().tolist() == np.arange(12).reshape(3, 4).tolist()
    key = id(x)
    x.delete()
    with pytest.raises(BufferError, match="deleted or donated"):
        x.__cuda_array_interface__
    del x
    assert key not in _cai._ready_facts


def test_pending_array_is_ordered_until_ready_then_kept():
    from jax_overlay import _cai, _dlpack
    jax_fill(0.0, steps=20000).block_until_ready()
    x = jax_fill(5.0, steps=20000)
    assert not x.is_ready()
    assert x.__cuda_array_interface__["stream"] == 1
    assert id(x) not in _cai._ready_facts  # pending: not kept
    # A stream the consumer names is ordered on every read, kept or not.
    assert jax_overlay.cuda_array_interface(x, stream=2)["stream"] == 2
    x.block_until_ready()
    assert x.__cuda_array_interface__["stream"] is None
    assert id(x) in _cai._ready_facts
    assert jax_overlay.cuda_array_interface(x, stream=2)["stream"] == 2
    assert float(cp.asarray(x).min()) == 5.0
