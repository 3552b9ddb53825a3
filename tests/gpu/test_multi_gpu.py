"""Two GPUs: imports land on the GPU that owns the memory while another one
is current, ordered after that GPU's producer; sharded arrays export per
shard to PyTorch and CuPy on each shard's GPU, and assemble zero-copy from
per-device tensors.  Skipped with a reason on fewer than 2 GPUs."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_overlay  # noqa: E402

from producers import WithStream, jax_fill_sharded, spin_fill  # noqa: E402

try:
    GPUS = jax.devices("cuda")
except RuntimeError as e:  # no CUDA backend at all
    pytest.skip(f"no GPU: JAX has no CUDA backend ({e})", allow_module_level=True)
if min(len(GPUS), cp.cuda.runtime.getDeviceCount()) < 2:
    pytest.skip(f"needs 2 GPUs, found {len(GPUS)} (JAX) and "
                f"{cp.cuda.runtime.getDeviceCount()} (CuPy)", allow_module_level=True)

# JAX's device for each CUDA ordinal (as CuPy and PyTorch number them).
GPU = {d.local_hardware_id: d for d in GPUS}
TRIALS = 50


def ptr(x):
    return x.unsafe_buffer_pointer()


@pytest.fixture
def installed():
    jax_overlay.install()
    yield
    jax_overlay.uninstall()


def _torch():
    return pytest.importorskip("torch")


def mesh():
    return Mesh(np.array([GPU[0], GPU[1]]), ("x",))


IMPORTS = {
    "cai": jax_overlay.from_cuda_array_interface,
    "dlpack": jax_overlay.from_dlpack,
    "asarray": lambda a: jnp.asarray(a),       # routed by install()
    "device_put": lambda a: jax.device_put(a),  # routed by install()
}


# --- placement --------------------------------------------------------------

@pytest.mark.parametrize("path", list(IMPORTS))
def test_cupy_on_gpu1_lands_on_jax_gpu1_while_gpu0_is_current(path, installed):
    with cp.cuda.Device(1):
        a = cp.arange(12, dtype=cp.float32).reshape(3, 4)
        cp.cuda.Device(1).synchronize()
    with cp.cuda.Device(0):
        x = IMPORTS[path](a)
    assert x.devices() == {GPU[1]}
    assert ptr(x) == a.data.ptr
    np.testing.assert_array_equal(np.asarray(x), np.arange(12).reshape(3, 4))


@pytest.mark.parametrize("path", list(IMPORTS))
def test_torch_on_gpu1_lands_on_jax_gpu1_while_gpu0_is_current(path, installed):
    torch = _torch()
    t = torch.arange(12, dtype=torch.float32, device="cuda:1").reshape(3, 4)
    torch.cuda.synchronize(1)
    with torch.cuda.device(0):
        x = IMPORTS[path](t)
    assert x.devices() == {GPU[1]}
    assert ptr(x) == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(x), np.arange(12).reshape(3, 4))


def test_zero_size_arrays_of_gpu1_land_on_gpu1():
    with cp.cuda.Device(1):
        a = cp.arange(12, dtype=cp.float32)
        empty = a[4:4]
    with cp.cuda.Device(0):
        x = jax_overlay.from_dlpack(empty)  # DLPack names the device
        y = jax_overlay.from_cuda_array_interface(empty)
    assert x.shape == (0,) and x.devices() == {GPU[1]}
    # The CAI has only the pointer: a slice's points into GPU 1's memory; a
    # null one belongs to no device and lands on JAX's first GPU.
    assert y.shape == (0,) and y.devices() == {GPU[1] if empty.data.ptr else GPUS[0]}


@pytest.mark.parametrize("f", [jax_overlay.from_cuda_array_interface, jax_overlay.from_dlpack,
                               jnp.asarray], ids=["cai", "dlpack", "asarray"])
def test_device_elsewhere_copies_or_refuses(f, installed):
    with cp.cuda.Device(1):
        a = cp.arange(12, dtype=cp.float32)
        cp.cuda.Device(1).synchronize()
    x = f(a, device=GPU[0])
    assert x.devices() == {GPU[0]} and ptr(x) != a.data.ptr
    np.testing.assert_array_equal(np.asarray(x), np.arange(12))
    with pytest.raises(BufferError, match="needs a copy"):
        f(a, device=GPU[0], copy=False)
    assert ptr(f(a, device=GPU[1], copy=False)) == a.data.ptr


# --- stream ordering per device --------------------------------------------

@pytest.mark.parametrize("kind", ["legacy", "user"])
def test_cai_import_ordered_after_gpu1_producer_while_gpu0_is_current(kind):
    """The CAI names the stream (1 = GPU 1's legacy stream, or a handle of a
    GPU 1 stream): the import orders GPU 1's compute stream after it."""
    with cp.cuda.Device(1):
        stream = cp.cuda.Stream.null if kind == "legacy" else cp.cuda.Stream(non_blocking=True)
        handle = 1 if kind == "legacy" else stream.ptr
        a = cp.zeros(1 << 20, cp.float32)
        cp.cuda.Device(1).synchronize()
    stale = pending = 0
    for k in range(1, TRIALS + 1):
        with cp.cuda.Device(1):
            spin_fill(a, float(k), ms=1.0, stream=stream)
        with cp.cuda.Device(0):
            x = jax_overlay.from_cuda_array_interface(WithStream(a, handle))
        with cp.cuda.Device(1):
            pending += not stream.done
        stale += (float(jnp.min(x)), float(jnp.max(x))) != (k, k)
    with cp.cuda.Device(1):
        stream.synchronize()
    assert pending > TRIALS // 2, "the producer was not in flight: the test proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} reads on GPU 1 were stale"


def test_cupy_dlpack_import_ordered_after_gpu1_producer_while_gpu0_is_current():
    """CuPy's __dlpack__ orders the consumer stream after the current
    device's current stream: jax_overlay makes GPU 1 current for the call,
    so that is GPU 1's stream, where the producer runs."""
    with cp.cuda.Device(1):
        a = cp.zeros(1 << 20, cp.float32)
        cp.cuda.Device(1).synchronize()
    stale = pending = 0
    for k in range(1, TRIALS + 1):
        with cp.cuda.Device(1):
            spin_fill(a, float(k), ms=1.0, stream=cp.cuda.Stream.null)
        with cp.cuda.Device(0):
            x = jax_overlay.from_dlpack(a)
        with cp.cuda.Device(1):
            pending += not cp.cuda.Stream.null.done
        stale += (float(jnp.min(x)), float(jnp.max(x))) != (k, k)
    cp.cuda.Device(1).synchronize()
    assert pending > TRIALS // 2, "the producer was not in flight: the test proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} reads on GPU 1 were stale"


def test_torch_dlpack_import_ordered_after_gpu1_producer_while_gpu0_is_current():
    torch = _torch()
    t = torch.zeros(1 << 20, device="cuda:1")
    torch.cuda.synchronize(1)
    producer = torch.cuda.current_stream(1)
    stale = pending = 0
    for k in range(1, TRIALS + 1):
        with torch.cuda.device(1):
            torch.cuda._sleep(2_000_000)
            t.fill_(float(k))
        with torch.cuda.device(0):
            x = jax_overlay.from_dlpack(t)
        pending += not producer.query()
        stale += (float(jnp.min(x)), float(jnp.max(x))) != (k, k)
    torch.cuda.synchronize(1)
    assert pending > TRIALS // 2, "the producer was not in flight: the test proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} reads on GPU 1 were stale"


# --- to_shards: per-device export --------------------------------------------

def test_to_shards_gives_each_gpu_its_block():
    s = NamedSharding(mesh(), P("x"))
    x = jax.device_put(np.arange(16, dtype=np.float32), s)
    shards = jax_overlay.to_shards(x)
    assert [(sh.device, sh.index) for sh in shards] == [
        (GPU[0], (slice(0, 8),)), (GPU[1], (slice(8, 16),))]
    for sh in shards:
        assert sh.data.devices() == {sh.device}


@pytest.mark.parametrize("consumer", ["torch", "cupy_dlpack", "cupy_cai"])
def test_to_shards_export_per_gpu_zero_copy_and_ordered(consumer, installed):
    torch = _torch() if consumer == "torch" else None
    s = NamedSharding(mesh(), P("x"))
    jax_fill_sharded(0.0, s).block_until_ready()  # compiled before the trials
    stale = pending = 0
    for k in range(1, TRIALS + 1):
        x = jax_fill_sharded(k, s)  # still running on both GPUs when exported
        pending += not x.is_ready()
        for sh in jax_overlay.to_shards(x):
            ordinal = sh.device.local_hardware_id
            if torch is not None:
                # torch.from_dlpack passes the shard's own GPU's current stream.
                t = torch.from_dlpack(sh.data)
                assert t.device.index == ordinal and t.data_ptr() == ptr(sh.data)
                lo, hi = t.min().item(), t.max().item()
            else:
                with cp.cuda.Device(ordinal):
                    c = cp.from_dlpack(sh.data) if consumer == "cupy_dlpack" else cp.asarray(sh.data)
                    assert c.device.id == ordinal and c.data.ptr == ptr(sh.data)
                    lo, hi = float(c.min()), float(c.max())
            stale += (lo, hi) != (k, k)
    assert pending > TRIALS // 2, "the computation was not in flight: the test proves nothing"
    assert stale == 0, f"{stale} shard reads were stale"


# --- from_shards: per-device import ------------------------------------------

def test_from_shards_assembles_per_gpu_torch_tensors_zero_copy():
    torch = _torch()
    s = NamedSharding(mesh(), P("x"))
    ts = [torch.arange(8, dtype=torch.float32, device=f"cuda:{k}") + 8 * k for k in (0, 1)]
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    x = jax_overlay.from_shards(ts, s)
    assert x.shape == (16,) and x.sharding == s
    assert [ptr(a.data) for a in x.addressable_shards] == [t.data_ptr() for t in ts]
    np.testing.assert_array_equal(np.asarray(x), np.arange(16))
    assert float(jax.jit(jnp.sum)(x)) == sum(range(16))
    keyed = jax_overlay.from_shards({GPU[1]: ts[1], GPU[0]: ts[0]}, s)
    assert [ptr(a.data) for a in keyed.addressable_shards] == [t.data_ptr() for t in ts]


def test_from_shards_assembles_per_gpu_cupy_arrays_zero_copy():
    s = NamedSharding(mesh(), P(None, "x"))
    arrays = []
    for k in (0, 1):
        with cp.cuda.Device(k):
            arrays.append(cp.full((3, 4), float(k), cp.float32))
            cp.cuda.Device(k).synchronize()
    x = jax_overlay.from_shards(arrays, s)
    assert x.shape == (3, 8)
    assert [ptr(a.data) for a in x.addressable_shards] == [a.data.ptr for a in arrays]
    np.testing.assert_array_equal(np.asarray(x), np.repeat([0.0, 1.0], 4)[None].repeat(3, 0))


def test_from_shards_refuses_misplaced_tensors():
    torch = _torch()
    s = NamedSharding(mesh(), P("x"))
    ts = [torch.zeros(8, device=f"cuda:{k}") for k in (0, 1)]
    with pytest.raises(BufferError, match=r"arrays\[0\] is on cuda:1, but the sharding places it on cuda:0"):
        jax_overlay.from_shards(ts[::-1], s)
    with pytest.raises(BufferError, match=r"arrays\[0\] is host memory, .*jax.device_put it onto cuda:0"):
        jax_overlay.from_shards([np.zeros(8, np.float32), ts[1]], s)


def test_from_shards_ordered_after_each_gpus_producer():
    torch = _torch()
    s = NamedSharding(mesh(), P("x"))
    ts = [torch.zeros(1 << 20, device=f"cuda:{k}") for k in (0, 1)]
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    producers = [torch.cuda.current_stream(k) for k in (0, 1)]
    stale = pending = 0
    for k in range(1, TRIALS + 1):
        for d, t in enumerate(ts):
            with torch.cuda.device(d):
                torch.cuda._sleep(2_000_000)
                t.fill_(float(k + d))
        with torch.cuda.device(0):
            x = jax_overlay.from_shards(ts, s)
        pending += not all(p.query() for p in producers)
        for d, a in enumerate(x.addressable_shards):
            stale += (float(jnp.min(a.data)), float(jnp.max(a.data))) != (k + d, k + d)
    assert pending > TRIALS // 2, "the producers were not in flight: the test proves nothing"
    assert stale == 0, f"{stale} shard reads were stale"
