"""Room: the doctor's producers.  Producers that are still busy when their array changes hands, for the
doctor, the GPU tests and the benchmarks: a CuPy kernel that keeps a stream
busy and then writes, PyTorch's sleep kernel, and a JAX computation that is
still running after dispatch; and the views an array changes hands through
(one protocol only: WithStream, CAIView, DLPackView).  CuPy and PyTorch are
imported on first use."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax

import numpy as np

from ..peers import cupy as _cupy_peer

SPIN_SRC = r"""
extern "C" __global__ void spin_fill(float* out, long long n, long long cycles, float value) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x) {
    out[i] = value;
  }
}
"""
CLOCK_HZ = 1.98e9  # H200 boost clock; only sizes the delay, never a result


@functools.cache
def _spin():
    import cupy as cp
    return cp.RawKernel(SPIN_SRC, "spin_fill")


def cycles(ms):
    """GPU clock cycles in about `ms` milliseconds."""
    return int(ms * 1e-3 * CLOCK_HZ)


def spin_fill(arr, value, *, ms=1.0, stream=None):
    """Enqueues on `stream` (a CuPy stream; default the current one), after
    the legacy stream's work: wait about `ms` on the GPU, then
    arr[:] = value.  `arr`: contiguous float32."""
    import cupy as cp
    n = arr.size
    stream = stream or cp.cuda.get_current_stream()
    if stream.ptr not in (0, 1):
        # After what the legacy stream still has to do to `arr` (CuPy
        # allocates and zeroes on it): a non-blocking stream does not wait
        # for it, and under load the zeroing landed after the write.
        done = cp.cuda.Event(disable_timing=True)
        done.record(cp.cuda.Stream.null)
        stream.wait_event(done)
    with stream:
        _spin()((min(1024, (n + 255) // 256),), (256,),
                (arr, cp.int64(n), cp.int64(cycles(ms)), cp.float32(value)))


def torch_sleep(ms, stream):
    """Enqueues about `ms` of GPU sleep on a PyTorch stream."""
    import torch
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles(ms))


JAX_N = 1 << 22


@functools.partial(jax.jit, static_argnums=2)
def jax_busy(k, start, steps):
    """`steps` passes over `start` (laid out as it is), then `k` everywhere."""
    v = lax.fori_loop(0, steps, lambda i, v: jnp.sqrt(v * v + 1.0) - 0.5, start)
    return jnp.where(v > -1e30, k, 0.0).astype(jnp.float32)


@functools.cache
def seed(n=JAX_N):
    """Ones on the default device: the input of the busy computations."""
    return jnp.ones(n, jnp.float32)


@jax.jit
def _fill(k, start):
    return jnp.where(start > -1e30, k, 0.0).astype(jnp.float32)


@functools.cache
def _hold_target():
    import cupy as cp
    return cp.empty(1, cp.float32)


def jax_fill(k, *, steps=300, n=JAX_N):
    """A JAX array of `n` values exactly `k` that stays pending for about
    `steps` / 100 ms (300: 3 ms; 20000: 200 ms) after dispatch: XLA's compute
    stream is first held by a spin kernel, then one fill kernel is
    dispatched behind it.  A loop of `steps` passes over the data did the
    same in most processes, but in some the whole loop ran within the
    dispatch call (seen on the H200 with jax 0.11.2: the array was ready
    0.1 ms after a 20000-step dispatch returned), and a producer that is
    done before its consumer reads proves nothing.  Without CuPy, the loop."""
    start = seed(n)
    try:
        importlib.import_module("cupy")  # the spin kernel's
    except ImportError:
        return jax_busy(float(k), start, steps)
    from .. import _runtime as rt
    device, = start.devices()
    held = _cupy_peer.PEER.stream(rt.compute_stream(device), -1)  # -1: the current device
    spin_fill(_hold_target(), 0.0, ms=steps / 100, stream=held)
    return _fill(float(k), start)


def aligned_empty(shape, dtype, alignment=256):
    """An empty NumPy array whose data starts `alignment`-byte aligned (JAX's
    CPU client views only aligned host memory)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    buf = np.empty(n + alignment, np.uint8)
    off = (-buf.ctypes.data) % alignment
    return buf[off:off + n].view(dtype).reshape(shape)


class WithStream:
    """Re-exports another array's CAI with a chosen v3 stream."""

    def __init__(self, base, stream):
        self.base = base
        self.cai = dict(base.__cuda_array_interface__, version=3, stream=stream)

    @property
    def __cuda_array_interface__(self):
        return self.cai


# --- protocol views ---------------------------------------------------------

class CAIView:
    """Only the CUDA Array Interface of `obj`, so a consumer that knows DLPack
    too cannot take it instead.  `probe`, if given, runs right after `obj`'s
    property first returns (exports: is the computation still running?)."""

    def __init__(self, obj, probe=None):
        self.obj, self.probe, self.after = obj, probe, None

    @property
    def __cuda_array_interface__(self):
        cai = self.obj.__cuda_array_interface__
        if self.probe is not None and self.after is None:
            self.after = self.probe()
        return cai


class DLPackView:
    """`obj`'s DLPack, offered as a legacy producer offers it (legacy=True:
    the pre-2023 ``__dlpack__(stream=None)``, so a consumer that passes
    ``max_version`` gets TypeError and must retry the legacy call) or passed
    through.  Records which capsule it handed out, whether `obj` itself
    raised, and runs `probe` like CAIView."""

    def __init__(self, obj, *, legacy=False, probe=None, record=True):
        self.obj, self.legacy, self.probe, self.record = obj, legacy, probe, record
        self.after = self.capsule = self.producer_error = None
        self.refused = False

    def __dlpack__(self, stream=None, **kwargs):
        if self.legacy and kwargs:
            self.refused = True
            raise TypeError(f"__dlpack__() got unexpected keyword arguments {sorted(kwargs)} "
                            "(a legacy DLPack producer)")
        try:
            cap = self.obj.__dlpack__(stream=stream, **kwargs)
        except Exception as e:
            self.producer_error = e
            raise
        if self.record:
            self.capsule = _capsule_kind(cap)
        if self.probe is not None and self.after is None:
            self.after = self.probe()
        return cap

    def __dlpack_device__(self):
        return self.obj.__dlpack_device__()


def _capsule_kind(cap):
    from .. import _xla_ext as ext
    try:
        return "versioned" if ext.capsule_info(cap)["versioned"] else "legacy"
    except Exception:  # noqa: BLE001 - a capsule we cannot read: say nothing
        return None
