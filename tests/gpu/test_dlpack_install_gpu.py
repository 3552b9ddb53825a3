"""install() on the GPU: jax.dlpack.from_dlpack, jnp.from_dlpack,
jnp.asarray and jax.device_put take PyTorch and CuPy arrays zero-copy,
preferring DLPack, ordered after in-flight producer work."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import jax  # noqa: E402
import jax.dlpack  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402

from producers import INFLIGHT_MS, cycles, is_stale, spin_fill  # noqa: E402

GPU = jax.devices("cuda")[0]
TRIALS = 100


@pytest.fixture(autouse=True)
def installed():
    jax_overlay.install()
    yield
    jax_overlay.uninstall()


def ptr(x):
    return x.unsafe_buffer_pointer()


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("entry", ["jax.dlpack", "jnp"])
def test_from_dlpack_entry_points_are_zero_copy(entry):
    torch = _torch()
    f = jax.dlpack.from_dlpack if entry == "jax.dlpack" else jnp.from_dlpack
    a = cp.arange(12, dtype=cp.float32)
    t = torch.arange(12, dtype=torch.float32, device="cuda")
    xa, xt = f(a), f(t)
    assert ptr(xa) == a.data.ptr and ptr(xt) == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(xa), np.arange(12))
    np.testing.assert_array_equal(np.asarray(xt), np.arange(12))


def test_device_put_of_torch_and_cupy_is_zero_copy():
    torch = _torch()
    t = torch.arange(20, dtype=torch.float32, device="cuda").reshape(4, 5)
    a = cp.arange(6, dtype=cp.int32)
    x = jax.device_put(t, GPU)
    assert ptr(x) == t.data_ptr() and x.committed
    np.testing.assert_array_equal(np.asarray(x), t.cpu().numpy())
    tree = jax.device_put({"t": t, "a": a})
    assert ptr(tree["t"]) == t.data_ptr() and ptr(tree["a"]) == a.data.ptr
    fresh = jax.device_put(t, GPU, may_alias=False)
    assert ptr(fresh) != t.data_ptr()
    np.testing.assert_array_equal(np.asarray(fresh), t.cpu().numpy())


class Both:
    """A CuPy array seen through both protocols; records which one is read."""

    def __init__(self, a):
        self.a, self.used = a, []

    def __dlpack__(self, **kw):
        self.used.append("dlpack")
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()

    @property
    def __cuda_array_interface__(self):
        self.used.append("cai")
        return self.a.__cuda_array_interface__


def test_asarray_prefers_a_v3_cai_with_a_stream():
    """Both protocols, and a CAI v3 with a stream (CuPy's): the CAI is the
    cheaper route to the same array, ordered the same way."""
    a = cp.arange(10, dtype=cp.float32)
    b = Both(a)
    x = jnp.asarray(b)
    assert b.used == ["cai"] and ptr(x) == a.data.ptr


class BothNoStream(Both):
    """As CuPy exports with CUPY_CUDA_ARRAY_INTERFACE_SYNC=0."""

    @property
    def __cuda_array_interface__(self):
        self.used.append("cai")
        return dict(self.a.__cuda_array_interface__, stream=None)


def test_asarray_takes_dlpack_when_the_cai_has_no_stream():
    """A CAI without a stream would not order the import as __dlpack__
    does: DLPack is taken."""
    a = cp.arange(10, dtype=cp.float32)
    b = BothNoStream(a)
    x = jnp.asarray(b)
    assert b.used == ["cai", "dlpack"] and ptr(x) == a.data.ptr


def test_asarray_of_torch_inflight_on_a_user_stream():
    torch = _torch()
    s = torch.cuda.Stream()
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    stale = 0
    with torch.cuda.stream(s):
        for k in range(1, TRIALS + 1):
            torch.cuda._sleep(cycles(INFLIGHT_MS))
            t.fill_(float(k))
            stale += is_stale(jnp.asarray(t), k)
    s.synchronize()
    assert stale == 0, f"{stale} of {TRIALS} reads were stale"


def test_device_put_of_cupy_inflight_on_a_user_stream():
    s = cp.cuda.Stream(non_blocking=True)
    a = cp.zeros(1 << 20, cp.float32)
    stale = 0
    with s:
        for k in range(1, TRIALS + 1):
            spin_fill(a, float(k), ms=INFLIGHT_MS, stream=s)
            stale += is_stale(jax.device_put(a, GPU), k)
    s.synchronize()
    assert stale == 0, f"{stale} of {TRIALS} reads were stale"


def test_cupy_managed_through_jax_dlpack():
    pool = cp.cuda.MemoryPool(cp.cuda.malloc_managed)
    with cp.cuda.using_allocator(pool.malloc):
        a = cp.arange(100, dtype=cp.float32)
    x = jax.dlpack.from_dlpack(a)
    assert ptr(x) == a.data.ptr and x.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(x * 2), np.arange(100) * 2)


def test_read_only_numpy_through_jax_dlpack():
    a = np.arange(5.0)
    a.flags.writeable = False
    x = jax.dlpack.from_dlpack(a)
    np.testing.assert_array_equal(np.asarray(x), a)
