"""GPU producers for the suite: CuPy, Numba and PyTorch arrays, a kernel that
keeps a stream busy and then writes, a JAX computation that is still running
when its array is exported, and CAI wrappers with chosen streams."""

from __future__ import annotations

import functools

import cupy as cp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The kernel, the PyTorch sleep and the busy JAX computation live in the
# package, which the doctor ships; the suite and the benchmarks share them.
from jax_overlay.doctor import (  # noqa: F401 - re-exported
    CLOCK_HZ, JAX_N, SPIN_SRC, WithStream, cycles, jax_busy, jax_fill, seed, spin_fill, torch_sleep)


# How long an in-flight producer's kernel runs before it writes, in ms of
# GPU time (more under load): a half-millisecond producer was done before
# many reads began, and hid stale host reads on an idle GPU (issue 39).
INFLIGHT_MS = 2.0

READS = ("host", "computation", "export")

# How many imports of a busy producer may be pending with no host wait.
# jaxlib's import with a stream records the array's definition event there
# and queues one host callback behind it; past 56 pending ones the call
# waits for the producer, stock jax.dlpack.from_dlpack's too, with 1, 2 or 4
# ready streams alike (H200, jax 0.11.2:
# benchmarks/results/h200-2026-12-06-import-bound.txt).  The suite asks for
# no wait below that, with a margin, and for right values past it.
PENDING_IMPORTS = 48


def read(x, how):
    """(min, max) of JAX array `x` read `how`: straight to the host
    (np.asarray, PJRT's device-to-host stream), by a JAX computation (XLA's
    compute stream), or exported onward to CuPy by DLPack and reduced
    there."""
    if how == "host":
        h = np.asarray(x)
        return float(h.min()), float(h.max())
    if how == "computation":
        return float(jnp.min(x)), float(jnp.max(x))
    c = cp.from_dlpack(x)
    return float(c.min()), float(c.max())


def is_stale(x, k):
    """Whether trial `k`'s import `x` of a producer that wrote k everywhere
    reads anything else, read the k-th way of READS (trials rotate through
    the host, a computation and an export)."""
    return read(x, READS[k % len(READS)]) != (k, k)


STREAMS = {
    "legacy": lambda: (cp.cuda.Stream.null, 1),
    "per_thread": lambda: (cp.cuda.Stream.ptds, 2),
    "user": lambda: ((s := cp.cuda.Stream(non_blocking=True)), s.ptr),
}


@functools.cache
def _sharded_seed(sharding):
    return jax.device_put(jnp.ones(JAX_N, jnp.float32), sharding)


def jax_fill_sharded(k, sharding, *, steps=300):
    """jax_fill laid out by `sharding`: each device writes its block, all
    exactly `k`, after `steps` passes over it on that device."""
    return jax_busy(float(k), _sharded_seed(sharding), steps)


@functools.partial(jax.jit, static_argnums=2)
def _jax_many(k, start, kernels):
    v = start
    for _ in range(kernels):  # sorts do not fuse: one launch (or more) each
        v = jnp.sort(v * 1.0001)
    return jnp.where(v > -1e30, k, 0.0).astype(jnp.float32)


def jax_fill_many_kernels(k, *, kernels=40):
    """Like jax_fill, but a chain of `kernels` separate kernel launches, so
    an ordering that captures only the launches enqueued so far reads early."""
    return _jax_many(float(k), seed(), kernels)


def numba_double():
    """(numba.cuda, a compiled @cuda.jit kernel dst = 2 * src); skipped with
    the reason where this numba-cuda cannot compile kernels (under NumPy
    >= 2.5: tools/gpu_suite.sh reruns the Numba tests with a NumPy it
    supports)."""
    cuda = pytest.importorskip("numba.cuda")
    try:
        @cuda.jit
        def double(src, dst):
            i = cuda.grid(1)
            if i < src.size:
                dst[i] = src[i] * 2
        double[1, 32](cuda.to_device(np.ones(4, np.float32)), cuda.device_array(4, np.float32))
    except AttributeError as e:
        if "row_stack" in str(e):
            pytest.skip(f"this numba-cuda cannot compile kernels under NumPy {np.__version__}: {e} "
                        "(tools/gpu_suite.sh reruns these with a NumPy it supports)")
        raise
    return cuda, double
