"""The cuda.core peer on the GPU: a StridedMemoryView made with no ordering
(stream_ptr=-1) over a CuPy array whose kernel still runs, imported by
every entry point and read at once (host, computation, export): never
stale, because the import fences.  The control, stock
jax.dlpack.from_dlpack of the same view, shows the view itself does not
order the consumer's stream (its __dlpack__ ignores it).  And a Buffer's
bytes come through."""

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
pytest.importorskip("cuda.core")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import peers  # noqa: E402

from producers import INFLIGHT_MS, is_stale, spin_fill  # noqa: E402

try:
    from cuda.core.utils import StridedMemoryView
except ImportError:  # cuda.core before 0.4 keeps it in experimental
    from cuda.core.experimental.utils import StridedMemoryView

TRIALS = 30


def _view(a):
    return StridedMemoryView(a, stream_ptr=-1)  # no ordering: the view does not tell


def test_the_view_is_the_peers():
    a = cp.zeros(4, cp.float32)
    assert peers.peer_of(type(_view(a))).name == "cuda_core"


@pytest.mark.parametrize("route", ["from_dlpack", "installed jnp.asarray", "installed from_dlpack"])
def test_inflight_view_is_read_after_its_producer(route):
    s = cp.cuda.Stream(non_blocking=True)
    a = cp.zeros(1 << 20, cp.float32)
    stale = 0
    installed = route.startswith("installed")
    # Looked up at each call: install() replaces these names.
    fn = {"from_dlpack": jax_overlay.from_dlpack,
          "installed jnp.asarray": lambda v: jnp.asarray(v),
          "installed from_dlpack": lambda v: jax.dlpack.from_dlpack(v)}[route]
    if installed:
        jax_overlay.install()
    try:
        with s:
            for k in range(1, TRIALS + 1):
                spin_fill(a, float(k), ms=INFLIGHT_MS, stream=s)
                x = fn(_view(a))
                stale += is_stale(x, k)
                del x
    finally:
        if installed:
            jax_overlay.uninstall()
        s.synchronize()
    assert stale == 0, f"{stale} of {TRIALS} reads were stale"


def test_control_stock_reads_the_unordered_view_early():
    """The detector sees what the fence prevents: stock imports the view
    (passing its stream, which the view ignores) and reads it stale."""
    s = cp.cuda.Stream(non_blocking=True)
    a = cp.zeros(1 << 20, cp.float32)
    stale = 0
    with s:
        for k in range(1, TRIALS + 1):
            spin_fill(a, float(k), ms=INFLIGHT_MS * 5, stream=s)
            h = np.asarray(jax.dlpack.from_dlpack(_view(a)))
            stale += not (h.min() == h.max() == k)
    s.synchronize()
    assert stale > 0, "stock never read the unordered view early: the test proves nothing"


def test_a_buffer_imports_its_bytes():
    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    buf = dev.allocate(64, stream=stream)
    src = cp.arange(64, dtype=cp.uint8)
    cp.cuda.runtime.memcpy(int(buf.handle), src.data.ptr, 64, cp.cuda.runtime.memcpyDeviceToDevice)
    x = jax_overlay.from_dlpack(buf)
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8).reshape(-1), np.arange(64, dtype=np.uint8))
