"""foreign() and the library's own state: what fn reads or writes besides its
views (a module's weights, an optimizer's step, a running statistic, any
array it closes over) is ordered with the caller's stream, both ways.

Before each call the caller writes the state on its own current stream (the
legacy default stream, or a stream of its own) behind a 3 ms sleep, and fn
reads it on XLA's stream: a read that ran ahead sees the previous trial's
value.  After each call the caller copies the state fn wrote on XLA's
stream, behind an input still in flight: a copy that ran ahead sees the
previous trial's.  The controls take the fences away and read stale, so the
detector works."""

from __future__ import annotations

import time

import numpy as np
import pytest

cp = pytest.importorskip("cupy")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import _xla_ext as ext  # noqa: E402
from jax_overlay.peers import _base  # noqa: E402

from producers import cycles, jax_fill, numba_double, spin_fill  # noqa: E402

TRIALS = 100
N = 1 << 16
MS = 3.0  # how long the caller's write, or fn's input, stays in flight
SAME = lambda *xs: xs[0]  # noqa: E731


def _numba():
    """(numba.cuda, kernel dst = a + b, Numba's default stream handle, the
    CuPy stream object over that same stream)."""
    cuda, _ = numba_double()  # skips with the reason where Numba cannot compile
    from numba.core import config

    @cuda.jit
    def add(a, b, dst):
        i = cuda.grid(1)
        if i < dst.size:
            dst[i] = a[i] + b[i]
    per_thread = bool(getattr(config, "CUDA_PER_THREAD_DEFAULT_STREAM", 0))
    return cuda, add, (2 if per_thread else 1), (cp.cuda.Stream.ptds if per_thread
                                                else cp.cuda.Stream.null)


class _Caller:
    """The caller's side of one framework: its current stream (`within`, a
    context that makes it current), a 3 ms write of k into `state` there,
    whether it is idle, and a copy of `state` there, read on the host."""

    def __init__(self, framework, which):
        self.framework = framework
        if framework == "torch":
            torch = self.torch = pytest.importorskip("torch")
            self.state = torch.zeros(N, device="cuda")
            own = torch.cuda.Stream() if which == "own" else None
            self.within = (torch.cuda.stream(own) if own is not None
                           else torch.cuda.stream(torch.cuda.current_stream()))
            self.stream = own if own is not None else torch.cuda.current_stream()
        elif framework == "cupy":
            self.state = cp.zeros(N, np.float32)
            own = cp.cuda.Stream(non_blocking=True) if which == "own" else None
            self.stream = own if own is not None else cp.cuda.get_current_stream()
            self.within = self.stream
        else:  # Numba has no current stream: the caller's is its default one
            assert which == "default"
            self.cuda, self.add, self.handle, self.stream = _numba()
            self.state = cp.zeros(N, np.float32)
            self.view = self.cuda.as_cuda_array(self.state)
            self.zero = self.cuda.as_cuda_array(cp.zeros(N, np.float32))
            self.within = self.stream

    def write(self, k):
        if self.framework == "torch":
            self.torch.cuda._sleep(cycles(MS))
            self.state.fill_(k)
        else:  # on the current CuPy stream: the caller's (`within`)
            spin_fill(self.state, k, ms=MS, stream=cp.cuda.get_current_stream())

    def idle(self):
        if self.framework == "torch":
            return self.stream.query()
        if self.framework == "cupy":
            return self.stream.done
        return ext.stream_idle(0, self.handle)

    def copied(self):
        """(min, max) of a copy of `state` made on the caller's stream now."""
        snap = self.state.clone() if self.framework == "torch" else self.state.copy()
        return float(snap.min()), float(snap.max())

    def reader(self, busy):
        """fn: its input plus the state, on XLA's stream; counts in `busy`
        the calls that found the caller's write still in flight."""
        idle = self.idle
        if self.framework == "numba":
            add, state = self.add, self.view

            def fn(x, out):
                busy[0] += not idle()
                add[(N + 255) // 256, 256, jax_overlay.foreign_stream()](x, state, out)
            return jax_overlay.foreign(fn, framework="numba", result_shape_dtypes=SAME, out=True)
        state = self.state

        def fn(x):
            busy[0] += not idle()
            return x + state
        return jax_overlay.foreign(fn, framework=self.framework, result_shape_dtypes=SAME)

    def writer(self, ran):
        """fn: writes its input into the state on XLA's stream, returns it;
        counts its calls in `ran`."""
        if self.framework == "numba":
            add, state, zero = self.add, self.view, self.zero

            def fn(x, out):
                s = jax_overlay.foreign_stream()
                add[(N + 255) // 256, 256, s](x, zero, state)
                add[(N + 255) // 256, 256, s](x, zero, out)
                ran[0] += 1
            return jax_overlay.foreign(fn, framework="numba", result_shape_dtypes=SAME, out=True)
        state = self.state

        def fn(x):
            state[...] = x
            ran[0] += 1
            return x
        return jax_overlay.foreign(fn, framework=self.framework, result_shape_dtypes=SAME)


def _reads(framework, which):
    """(stale, pending): trials whose fn read the state before the caller's
    write of it, and calls whose fn ran while that write was in flight."""
    caller = _Caller(framework, which)
    busy = [0]
    f = caller.reader(busy)
    g = jax.jit(lambda x: (lambda y: jnp.stack([y.min(), y.max()]))(f(x)))
    x = jnp.zeros(N, jnp.float32)
    stale = 0
    with caller.within:
        np.asarray(g(x))
        busy[0] = 0
        for k in range(1, TRIALS + 1):
            caller.write(float(k))
            lo, hi = np.asarray(g(x))
            stale += (lo, hi) != (k, k)
    return stale, busy[0]


def _writes(framework, which):
    """(stale, pending): trials whose caller copied the state before fn
    wrote it, and calls that returned with fn's input still in flight."""
    caller = _Caller(framework, which)
    ran = [0]
    f = jax.jit(caller.writer(ran))
    stale = pending = 0
    with caller.within:
        f(jax_fill(0.0, n=N)).block_until_ready()
        ran[0] = 0
        for k in range(1, TRIALS + 1):
            y = f(jax_fill(float(k), steps=int(MS * 100), n=N))
            # The fence after fn is queued when XLA runs fn on the host.  A
            # client that dispatched on another thread could return before
            # that, and then no stream order could help a copy queued now:
            # wait (on the host, for the launch, not for the GPU) until fn
            # has run.  The fence follows fn on the thread that ran it,
            # microseconds later; where f runs the program on the calling
            # thread, f returns after both.
            deadline = time.monotonic() + 10.0
            while ran[0] < k and time.monotonic() < deadline:
                time.sleep(0)
            assert ran[0] == k, f"fn ran {ran[0]} times in {k} calls"
            pending += not y.is_ready()
            stale += caller.copied() != (k, k)
            y.block_until_ready()
    return stale, pending


CASES = [("torch", "default"), ("torch", "own"), ("cupy", "default"), ("cupy", "own"),
         ("numba", "default")]


@pytest.mark.parametrize("framework,which", CASES)
def test_fn_reads_the_state_the_caller_wrote_before_the_call(framework, which):
    stale, pending = _reads(framework, which)
    assert pending > TRIALS // 2, f"only {pending} of {TRIALS} writes were in flight: proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} {framework} reads of the caller's state were stale"


@pytest.mark.parametrize("framework,which", CASES)
def test_the_caller_reads_the_state_fn_wrote(framework, which):
    stale, pending = _writes(framework, which)
    assert pending > TRIALS // 2, f"only {pending} of {TRIALS} calls were in flight: proves nothing"
    assert stale == 0, f"{stale} of {TRIALS} of the caller's copies missed what {framework} wrote"


@pytest.mark.parametrize("direction", [_reads, _writes])
def test_control_without_the_fences_reads_stale(direction, monkeypatch):
    """The detector works: with join() fencing nothing (and so leave()
    nothing), the same trials go stale."""
    monkeypatch.setattr(_base.GpuAdapter, "join", lambda self, ordinal, xla, traced: None)
    stale, _ = direction("torch", "default")
    assert stale > 0
