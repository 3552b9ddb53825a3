"""GPU producers for the suite: CuPy, Numba and PyTorch arrays, a kernel that
keeps a stream busy and then writes, a JAX computation that is still running
when its array is exported, and CAI wrappers with chosen streams."""

from __future__ import annotations

import functools

import cupy as cp
import jax
import jax.numpy as jnp
from jax import lax

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
_spin = cp.RawKernel(SPIN_SRC, "spin_fill")
CLOCK_HZ = 1.98e9  # H200 boost clock; only sizes the delay, never a result


def spin_fill(arr, value, *, ms=1.0, stream=None):
    """Enqueues on `stream`: wait about `ms` on the GPU, then arr[:] = value."""
    n = arr.size
    stream = stream or cp.cuda.get_current_stream()
    with stream:
        _spin((min(1024, (n + 255) // 256),), (256,),
              (arr, cp.int64(n), cp.int64(int(ms * 1e-3 * CLOCK_HZ)), cp.float32(value)))


class WithStream:
    """Re-exports another array's CAI with a chosen v3 stream."""

    def __init__(self, base, stream):
        self.base = base
        self.cai = dict(base.__cuda_array_interface__, version=3, stream=stream)

    @property
    def __cuda_array_interface__(self):
        return self.cai


STREAMS = {
    "legacy": lambda: (cp.cuda.Stream.null, 1),
    "per_thread": lambda: (cp.cuda.Stream.ptds, 2),
    "user": lambda: ((s := cp.cuda.Stream(non_blocking=True)), s.ptr),
}


JAX_N = 1 << 22


@functools.partial(jax.jit, static_argnums=2)
def _jax_busy(k, seed, steps):
    v = lax.fori_loop(0, steps, lambda i, v: jnp.sqrt(v * v + 1.0) - 0.5, seed)
    return jnp.where(v > -1e30, k, 0.0).astype(jnp.float32)


@functools.cache
def _seed():
    return jnp.ones(JAX_N, jnp.float32)


def jax_fill(k, *, steps=300):
    """A JAX array of JAX_N values exactly `k`, written after `steps` passes
    over 16 MiB on XLA's compute stream (300: a few ms; 20000: a few hundred).
    The loop starts from an argument, not a constant, so XLA cannot fold it
    away: a producer that is done before its consumer reads proves nothing."""
    return _jax_busy(float(k), _seed(), steps)


@functools.cache
def _sharded_seed(sharding):
    return jax.device_put(jnp.ones(JAX_N, jnp.float32), sharding)


def jax_fill_sharded(k, sharding, *, steps=300):
    """jax_fill laid out by `sharding`: each device writes its block, all
    exactly `k`, after `steps` passes over it on that device."""
    return _jax_busy(float(k), _sharded_seed(sharding), steps)


@functools.partial(jax.jit, static_argnums=2)
def _jax_many(k, seed, kernels):
    v = seed
    for _ in range(kernels):  # sorts do not fuse: one launch (or more) each
        v = jnp.sort(v * 1.0001)
    return jnp.where(v > -1e30, k, 0.0).astype(jnp.float32)


def jax_fill_many_kernels(k, *, kernels=40):
    """Like jax_fill, but a chain of `kernels` separate kernel launches, so
    an ordering that captures only the launches enqueued so far reads early."""
    return _jax_many(float(k), _seed(), kernels)
