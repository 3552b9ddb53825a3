"""DLPack export on the GPU, installed: PyTorch and CuPy read JAX arrays
zero-copy, ordered after the producing computation on their own stream while
it is still running; versioned read-only capsules; pinned_host arrays reach
the host through the CPU view."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import _xla_ext as ext  # noqa: E402

from producers import jax_fill, jax_fill_many_kernels  # noqa: E402

TRIALS = 50
GPU = jax.devices("cuda")[0]


@pytest.fixture(autouse=True)
def installed():
    jax_overlay.install()
    jax_fill(0.0).block_until_ready()
    yield
    jax_overlay.uninstall()


def trials(read, produce=jax_fill):
    stale, pending = 0, 0
    for k in range(1, TRIALS + 1):
        x = produce(k)
        pending += not x.is_ready()
        lo, hi = read(x)
        stale += (lo, hi) != (k, k)
    return stale, pending


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("stream", ["default", "user"])
def test_torch_reads_inflight_arrays_correctly(stream):
    torch = _torch()
    s = torch.cuda.Stream() if stream == "user" else torch.cuda.current_stream()

    def read(x):
        with torch.cuda.stream(s):
            t = torch.from_dlpack(x)
            assert t.data_ptr() == x.unsafe_buffer_pointer()
            lo, hi = t.min().item(), t.max().item()
        return lo, hi
    stale, pending = trials(read)
    assert pending > TRIALS // 2, "the producer was not in flight: the test proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} PyTorch reads were stale"


@pytest.mark.parametrize("stream", ["legacy", "user"])
def test_cupy_reads_inflight_arrays_correctly(stream):
    s = cp.cuda.Stream.null if stream == "legacy" else cp.cuda.Stream(non_blocking=True)

    def read(x):
        with s:
            c = cp.from_dlpack(x)
            assert c.data.ptr == x.unsafe_buffer_pointer()
            return float(c.min()), float(c.max())
    stale, pending = trials(read)
    assert pending > TRIALS // 2, "the producer was not in flight: the test proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} CuPy reads were stale"


def test_control_stream_minus_one_reads_stale():
    """The detector works: with stream=-1 (no ordering) a user stream reads
    before the computation is done."""
    s = cp.cuda.Stream(non_blocking=True)

    def read(x):
        with s:
            c = cp.from_dlpack(_NoOrder(x))
            return float(c.min()), float(c.max())
    stale, _ = trials(read)
    assert stale > 0, "unordered reads were never stale: the in-flight tests prove nothing"


class _NoOrder:
    def __init__(self, x):
        self.x = x

    def __dlpack__(self, *, stream=None, **kw):
        return self.x.__dlpack__(stream=-1, **kw)

    def __dlpack_device__(self):
        return self.x.__dlpack_device__()


def test_export_does_not_wait_for_the_computation():
    torch = _torch()
    waited = 0
    for k in range(1, 21):
        x = jax_fill(k)
        t = torch.from_dlpack(x)
        waited += x.is_ready()
        assert t.max().item() == k
    assert waited < 10, f"{waited} of 20 exports returned only once the array was ready"


def test_versioned_capsule_is_read_only_and_consumers_take_it():
    torch = _torch()
    x = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4) + 0
    cap = x.__dlpack__(max_version=(1, 1), stream=-1)
    info = ext.capsule_info(cap)
    assert info["versioned"] and info["flags"] & ext.FLAG_READ_ONLY
    assert info["device"] == (2, GPU.local_hardware_id)
    t = torch.from_dlpack(x)
    c = cp.from_dlpack(x)
    assert t.data_ptr() == c.data.ptr == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(t.cpu().numpy(), np.asarray(x))
    np.testing.assert_array_equal(cp.asnumpy(c), np.asarray(x))


def test_non_row_major_layout_reaches_torch_with_strides():
    torch = _torch()
    x = jnp.asarray(np.arange(24, dtype=np.float32).reshape(4, 6))
    t = torch.from_dlpack(x)
    np.testing.assert_array_equal(t.cpu().numpy(), np.asarray(x))


def test_torch_pinned_round_trip_through_pinned_host_and_the_cpu_view():
    torch = _torch()
    t = torch.arange(32, dtype=torch.float32).pin_memory()
    x = jax.dlpack.from_dlpack(t)
    assert x.sharding.memory_kind == "pinned_host"
    assert x.unsafe_buffer_pointer() == t.data_ptr()
    assert tuple(int(v) for v in x.__dlpack_device__()) == (3, GPU.local_hardware_id)
    a = np.from_dlpack(x, device="cpu")
    assert a.ctypes.data == t.data_ptr() and not a.flags.writeable
    back = torch.from_dlpack(x.__dlpack__(dl_device=(1, 0)))
    assert back.device.type == "cpu" and back.data_ptr() == t.data_ptr()
    np.testing.assert_array_equal(back.numpy(), np.arange(32))


def test_jax_pinned_host_array_reaches_numpy_and_torch():
    torch = _torch()
    x = jax.device_put(np.arange(10, dtype=np.float32),
                       jax.sharding.SingleDeviceSharding(GPU, memory_kind="pinned_host"))
    x.block_until_ready()
    a = np.from_dlpack(x, device="cpu")
    assert a.ctypes.data == x.unsafe_buffer_pointer()
    t = torch.from_dlpack(x.__dlpack__(dl_device=(1, 0), max_version=(1, 0)))
    assert t.data_ptr() == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(t.numpy(), np.arange(10))


def test_device_copy_to_host_with_dl_device():
    x = jnp.arange(8.0, dtype=jnp.float32) + 1
    a = np.from_dlpack(x, device="cpu", copy=True)
    np.testing.assert_array_equal(a, np.arange(8.0) + 1)
    # Stock's words and class (ValueError), and the protocol's BufferError.
    with pytest.raises(BufferError, match=r"dl_device=\(1, 0\) which requires a copy") as e:
        x.__dlpack__(dl_device=(1, 0), copy=False)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("consumer", ["torch", "cupy"])
def test_multi_kernel_computation_is_read_whole(consumer):
    """The export is ordered after the computation's definition event, not
    after whatever part of it was enqueued when the export ran."""
    jax_fill_many_kernels(0.0).block_until_ready()
    if consumer == "torch":
        torch = _torch()
        s = torch.cuda.Stream()

        def read(x):
            with torch.cuda.stream(s):
                t = torch.from_dlpack(x)
                return t.min().item(), t.max().item()
    else:
        s = cp.cuda.Stream(non_blocking=True)

        def read(x):
            with s:
                c = cp.from_dlpack(x)
                return float(c.min()), float(c.max())
    stale, pending = trials(read, jax_fill_many_kernels)
    assert pending > TRIALS // 2, "the producer was not in flight: the test proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} reads were stale"


def test_pending_export_blocks_donation_while_held():
    torch = _torch()
    x = jax_fill(4.0, steps=20000)
    t = torch.from_dlpack(x)
    pending = not x.is_ready()
    try:
        jax.jit(lambda v: v + 1, donate_argnums=0)(x)
    except jax.errors.JaxRuntimeError as e:  # PJRT on the GPU refuses outright
        assert "external reference" in str(e), e
    assert not x.is_deleted(), "a buffer a consumer holds must not be donated"
    assert pending, "the array was ready before the export: the test proves nothing"
    assert t.min().item() == 4.0


def test_pinned_jax_array_in_flight_reaches_torch_as_a_cpu_view():
    """The supported way from a pinned_host JAX array to PyTorch, which
    refuses kDLCUDAHost: ask for a kDLCPU capsule of the same memory.  The
    host reads it, so the export waits for a copy into it still running;
    the capsule holds the JAX array, so the tensor outlives it."""
    torch = _torch()
    pinned = jax.sharding.SingleDeviceSharding(GPU, memory_kind="pinned_host")
    n = 1 << 16
    stale = pending = 0
    for k in range(1, TRIALS + 1):
        x = jax.device_put(jax_fill(float(k), n=n), pinned)
        pending += not x.is_ready()
        t = torch.from_dlpack(x.__dlpack__(dl_device=(1, 0)))
        assert t.device.type == "cpu" and t.data_ptr() == x.unsafe_buffer_pointer()
        stale += not bool((t == k).all())
    assert pending > TRIALS // 2, "the copy into pinned memory was done before the export"
    assert stale == 0, f"{stale} of {TRIALS} PyTorch CPU views read before the copy finished"
    jax_overlay.uninstall()  # the explicit function, no install() needed
    x = jax.device_put(jnp.arange(n, dtype=jnp.float32), pinned)
    t = torch.from_dlpack(jax_overlay.to_dlpack(x, dl_device=(1, 0)))
    ptr = x.unsafe_buffer_pointer()
    del x
    churn = [jax.device_put(jnp.full(n, -1.0), pinned) for _ in range(20)]
    jax.block_until_ready(churn)
    assert t.data_ptr() == ptr
    np.testing.assert_array_equal(t.numpy(), np.arange(n))


_DELETE_WHILE_HELD = """
import gc, sys, jax, jax.numpy as jnp, numpy as np, jax_overlay
route = sys.argv[1]
jax_overlay.install()
x = jnp.arange(1 << 20, dtype=jnp.float32) + 0
x.block_until_ready()
ptr = x.unsafe_buffer_pointer()
if route == "torch":
    import torch
    view = torch.from_dlpack(x)
    read = lambda: view.cpu().numpy()
elif route == "cupy":
    import cupy as cp
    view = cp.asarray(x)  # the CAI export
    read = lambda: view.get()
else:
    h = jax_overlay.share(x)
    view = None
    read = lambda: np.arange(1 << 20, dtype=np.float32)
x.delete()  # the user's, while a consumer still holds the export
churn = [jnp.full(1 << 20, -1.0).block_until_ready() for _ in range(16)]
assert ptr not in {c.unsafe_buffer_pointer() for c in churn}, "reused while held"
assert (read() == np.arange(1 << 20, dtype=np.float32)).all(), "the consumer's values changed"
print("ok")
"""


@pytest.mark.parametrize("route", ["torch", "cupy", "share"])
def test_delete_while_a_consumer_holds_the_export(route):
    """x.delete() while PyTorch, CuPy or a share holds x (install()ed
    exports): no abort (jaxlib's CHECK when the external reference was
    taken through x itself), the buffer kept for the consumer.  CuPy holds
    x only through the CUDA Array Interface, which carries no owner: the
    install()ed delete() keeps the buffer while the object x lives (stock
    frees it: reused while held, H200, 2026-12-06).  In a
    subprocess: the failure is an abort."""
    import os
    import subprocess
    import sys
    pytest.importorskip({"share": "jax", "torch": "torch", "cupy": "cupy"}[route])
    r = subprocess.run([sys.executable, "-c", _DELETE_WHILE_HELD, route], capture_output=True,
                       text=True, timeout=180,
                       env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stderr[-2000:])
