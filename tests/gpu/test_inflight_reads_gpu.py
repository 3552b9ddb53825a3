"""An import taken while its producer's kernel still runs, read at once by
every route a user has: the host (np.asarray, jax.device_get, pickling),
a computation, jax.device_put to the CPU and to pinned host memory, and an
export onward to CuPy (DLPack) and PyTorch (CAI).  Every import entry
point, every producer stream kind, CuPy and PyTorch producers; the GPU is
loaded by another process (conftest.py).

Issue 39: jax_overlay's imports were read stale by the host on an idle GPU
(59-60 of 60) and by computations under load (1 of 60), where stock
jax.dlpack.from_dlpack was right.  Its control below shows the detector
sees stale reads when ordering is missing."""

import contextlib
import pickle

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402

from producers import STREAMS, WithStream, cycles, spin_fill  # noqa: E402

TRIALS = 12
MS = 10.0  # GPU time before the producer writes; tens of ms under load
CPU = jax.devices("cpu")[0]


def _pinned(x):
    return x.sharding.with_memory_kind("pinned_host")


READS = {
    "np.asarray": np.asarray,
    "jax.device_get": jax.device_get,
    "pickle": lambda x: np.asarray(pickle.loads(pickle.dumps(x))),
    "computation": lambda x: np.array([jnp.min(x), jnp.max(x)]),
    "device_put cpu": lambda x: np.asarray(jax.device_put(x, CPU)),
    "device_put pinned_host": lambda x: np.asarray(jax.device_put(x, _pinned(x))),
    "export dlpack cupy": lambda x: cp.from_dlpack(x).get(),
    "export cai cupy": lambda x: cp.asarray(_cai_of(x)).get(),
}


def _cai_of(x):
    class Holder:  # jax_overlay's CAI v3 export, with its stream
        __cuda_array_interface__ = jax_overlay.cuda_array_interface(x)
        keep = x
    return Holder()


def _route(name):
    """(import function, whether install() is active for it)."""
    return {
        "from_dlpack": (jax_overlay.from_dlpack, False),
        "from_cuda_array_interface": (jax_overlay.from_cuda_array_interface, False),
        # Looked up at each call: install() replaces these names, and a
        # reference taken before it is stock's function.
        "installed jnp.asarray": (lambda a: jnp.asarray(a), True),
        "installed jax.dlpack.from_dlpack": (lambda a: jax.dlpack.from_dlpack(a), True),
        "installed jax.device_put": (lambda a: jax.device_put(a), True),
    }[name]


def _stale(imp, producer, trials, read, *, installed=False, within=None):
    """Stale reads of `trials` imports of `producer` (a callable that
    enqueues "wait, then write k" and returns the object to import), with
    install() active if `installed`, inside the context `within` (the
    producer library's current stream) if given."""
    if installed:
        jax_overlay.install()
    stale = 0
    try:
        with within if within is not None else contextlib.nullcontext():
            for k in range(1, trials + 1):
                obj = producer(float(k))
                h = np.asarray(read(imp(obj)))
                stale += not (h.min() == h.max() == k)
    finally:
        if installed:
            jax_overlay.uninstall()
    return stale


ROUTES = ["from_dlpack", "from_cuda_array_interface", "installed jnp.asarray",
          "installed jax.dlpack.from_dlpack", "installed jax.device_put"]


@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("kind", list(STREAMS))
@pytest.mark.parametrize("route", ROUTES)
def test_cupy_producer_in_flight(route, kind, read):
    stream, _ = STREAMS[kind]()
    a = cp.zeros(1 << 20, cp.float32)
    imp, installed = _route(route)

    def producer(k):
        spin_fill(a, k, ms=MS, stream=stream)
        return a

    # Within the stream: CuPy's CAI and __dlpack__ name the current stream.
    stale = _stale(imp, producer, TRIALS, READS[read], installed=installed, within=stream)
    stream.synchronize()
    assert stale == 0, f"{stale} of {TRIALS} reads stale ({route}, {kind} stream, {read})"


@pytest.mark.parametrize("read", ["np.asarray", "computation", "export dlpack cupy"])
@pytest.mark.parametrize("route", ROUTES)
def test_torch_producer_in_flight(route, read):
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    imp, installed = _route(route)
    if route == "from_cuda_array_interface":
        imp = lambda t: jax_overlay.from_cuda_array_interface(  # noqa: E731
            WithStream(t, s.cuda_stream))  # PyTorch exports CAI v2, no stream

    def producer(k):
        with torch.cuda.stream(s):
            torch.cuda._sleep(cycles(MS))
            t.fill_(k)
        return t

    # Within the stream: PyTorch's __dlpack__ orders after its current stream.
    stale = _stale(imp, producer, TRIALS, READS[read], installed=installed,
                   within=torch.cuda.stream(s))
    s.synchronize()
    assert stale == 0, f"{stale} of {TRIALS} reads stale ({route}, {read})"


# XLA computes on device memory only (a pinned_host operand is a compile
# error, stock's too): a pinned import is computed on once moved there.
PINNED_READS = {
    "np.asarray": np.asarray,
    "computation on device": lambda x: np.array(
        [jnp.min(y := jax.device_put(x, x.sharding.with_memory_kind("device"))), jnp.max(y)]),
}


@pytest.mark.parametrize("read", list(PINNED_READS))
def test_pinned_host_producer_in_flight(read):
    """Pinned host memory written by a kernel still running: the import is
    a pinned_host array, defined after the producer too."""
    n = 1 << 18
    host = cp.cuda.alloc_pinned_memory(n * 4)
    ptr = host.ptr
    mem = cp.cuda.UnownedMemory(ptr, n * 4, host)
    view = cp.ndarray((n,), cp.float32, cp.cuda.MemoryPointer(mem, 0))
    s = cp.cuda.Stream(non_blocking=True)

    class Pinned:
        __cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (ptr, False),
                                    "version": 3, "strides": None, "stream": s.ptr}
        keep = host

    def producer(k):
        spin_fill(view, k, ms=MS, stream=s)
        return Pinned()

    stale = _stale(jax_overlay.from_cuda_array_interface, producer, TRIALS, PINNED_READS[read])
    s.synchronize()
    assert stale == 0, f"{stale} of {TRIALS} reads stale ({read})"


def test_control_unordered_import_is_read_stale_by_the_host():
    """The detector works under the same load: a CAI v2 import (no stream,
    nothing to order) of the same producer is read stale by the host."""
    stream, _ = STREAMS["user"]()
    a = cp.zeros(1 << 20, cp.float32)

    def producer(k):
        spin_fill(a, k, ms=MS, stream=stream)
        return WithStream(a, None)

    stale = _stale(jax_overlay.from_cuda_array_interface, producer, TRIALS, np.asarray)
    stream.synchronize()
    assert stale > 0, "no stale read without ordering: the test above could not fail"

