"""Where a foreign call's time goes: jax_overlay.foreign against the bare
jax.experimental.buffer_callback doing the same work on jaxlib's own
Buffers, the same jit without any callback, and jax.pure_callback, in one
jit each, same process, alternating rounds, end to end (dispatch to ready).
foreign - bare callback is jax_overlay's own share (pytrees, views, tokens,
the stream context, checks); bare callback - plain jit is the mechanism's
floor.

  --backend cpu        framework "numpy" on the CPU backend
  --backend cpu-torch  framework "torch" on the CPU backend (CPU tensors)
  --backend gpu        framework "torch" on the GPU (needs PyTorch with CUDA)

    python benchmarks/probe_foreign.py [--backend cpu] [--rounds 15] [--calls 300] [--n 1024]
        [--profile CALLS [--top 30]] [--json FILE]

"empty buffer_callback" is XLA calling into Python that does nothing: with
"jit, no callback" it splits a call's floor into dispatch and mechanism.
The allocator settings (XLA_PYTHON_CLIENT_*) are printed with the table:
run once per setting, each its own process.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.buffer_callback import buffer_callback  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import _foreign  # noqa: E402

# Time spent inside the Python callback, per case: what the mechanism costs
# around it is the end-to-end time less this.
_INSIDE: dict = {}
_PROFILE: list = []  # a cProfile.Profile while profiling, else empty


def _timed(name, cb):
    def timed(*a):
        prof = _PROFILE[0] if _PROFILE else None
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        try:
            cb(*a)
        finally:
            _INSIDE.setdefault(name, []).append(time.perf_counter() - t0)
            if prof is not None:
                prof.disable()
    return timed


def _named(name, make):
    """_foreign._make_callback, its callback timed under `name`."""
    def make_timed(*a, **k):
        return _timed(name, make(*a, **k))
    return make_timed


def _nothing(ctx, out, a):
    pass


def _cpu_cases(x, spec):
    def bare(ctx, out, a):
        np.copyto(np.asarray(out), np.asarray(a) * 2)

    def into(a, out):
        np.multiply(a, 2, out=out)  # returns out: with out=True fn returns None
    return ("numpy", bare, lambda a: a * 2, into), f"jax {jax.__version__}, CPU backend"


def _torch_cases(gpu):
    """PyTorch's cases: on the GPU (XLA's stream made PyTorch's) or on the
    CPU backend (CPU tensors, no stream)."""
    import torch
    import torch.utils.dlpack
    streams = {}

    def work(out, a):
        # XLA's capsules taken as they are (nothing holds them).
        o = torch.utils.dlpack.from_dlpack(out.__dlpack__())
        o.copy_(torch.utils.dlpack.from_dlpack(a.__dlpack__()) * 2)

    def bare(ctx, out, a):
        # As lean as a hand-written callback gets: a cached stream wrapper,
        # torch.Stream's own C++ `with` (torch.cuda.stream() costs tens of
        # µs more).
        if not gpu:
            return work(out, a)
        s = streams.get(ctx.stream)
        if s is None:
            s = streams[ctx.stream] = torch.cuda.ExternalStream(ctx.stream)
        with s:
            work(out, a)

    def into(a, out):
        torch.mul(a, 2, out=out)
    env = (f"{torch.cuda.get_device_name()}, jax {jax.__version__}, torch {torch.__version__}"
           if gpu else f"jax {jax.__version__}, torch {torch.__version__}, CPU backend")
    return ("torch", bare, lambda a: a * 2, into), env


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=("cpu", "cpu-torch", "gpu"), default="cpu")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--profile", type=int, default=0, metavar="CALLS",
                   help="then profile the foreign callback over CALLS calls")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json", default="", help="also write the table here")
    args = p.parse_args()
    x = jnp.linspace(-1, 1, args.n, dtype=jnp.float32)
    if args.backend != "gpu":
        x = jax.device_put(x, jax.devices("cpu")[0])
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    (framework, bare, fn, into), env = (_cpu_cases(x, spec) if args.backend == "cpu"
                                        else _torch_cases(args.backend == "gpu"))
    make = _foreign._make_callback
    cases = {
        "jit, no callback": jax.jit(lambda v: v * 2),
        # The mechanism alone: XLA calls into Python, which does nothing
        # (the output is left as XLA allocated it: timing only).
        "empty buffer_callback": jax.jit(buffer_callback(_timed("empty buffer_callback", _nothing),
                                                         spec)),
        "bare buffer_callback": jax.jit(buffer_callback(_timed("bare buffer_callback", bare), spec)),
        f"foreign {framework}": jax.jit(jax_overlay.foreign(
            fn, framework=framework, result_shape_dtypes=spec)),
        f"foreign {framework} out=True": jax.jit(jax_overlay.foreign(
            into, framework=framework, result_shape_dtypes=spec, out=True)),
        "pure_callback": jax.jit(lambda v: jax.pure_callback(lambda h: np.asarray(h) * 2, spec, v)),
    }
    try:  # the foreign callbacks are made on the first call: time them
        for k, f in cases.items():
            _foreign._make_callback = _named(k, make)
            y = f(x)
            if k != "empty buffer_callback":
                np.testing.assert_allclose(np.asarray(y), np.asarray(x) * 2)
    finally:
        _foreign._make_callback = make
    _INSIDE.clear()
    per = {k: [] for k in cases}
    names = list(cases)
    for r in range(args.rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            f = cases[k]
            t0 = time.perf_counter()
            for _ in range(args.calls):
                f(x).block_until_ready()
            per[k].append((time.perf_counter() - t0) / args.calls * 1e6)
    base = per["bare buffer_callback"]
    alloc = {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE",
                                           "XLA_PYTHON_CLIENT_ALLOCATOR",
                                           "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    print(f"# {args.n} float32, {env}, {args.rounds} alternating rounds of {args.calls} calls "
          "(dispatch to ready); 'in Python' is the median time inside the callback; "
          f"allocator settings {alloc}")
    print(f"{'case':30s} {'us':>8s} {'x bare callback':>16s} {'in Python us':>13s}")
    report = {}
    for k, ts in per.items():
        ratio = statistics.median(a / b for a, b in zip(ts, base))
        inside = f"{statistics.median(_INSIDE[k]) * 1e6:13.1f}" if k in _INSIDE else f"{'-':>13s}"
        print(f"{k:30s} {statistics.median(ts):8.1f} {ratio:16.2f} {inside}")
        report[k] = {"us": statistics.median(ts), "x_bare": ratio,
                     "in_python_us": statistics.median(_INSIDE[k]) * 1e6 if k in _INSIDE else None}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"elements": args.n, "env": env, "allocator": alloc, "rounds": args.rounds,
                       "calls": args.calls, "cases": report}, f, indent=1)
    if args.profile:
        # Where the foreign callback's own time goes (cProfile inflates it;
        # the shares are what matter).
        f = cases[f"foreign {framework}"]
        prof = cProfile.Profile()
        _PROFILE.append(prof)
        for _ in range(args.profile):
            f(x).block_until_ready()
        _PROFILE.clear()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
        print(f"# cProfile of {args.profile} calls of foreign {framework}, inside the callback")
        print(buf.getvalue())


if __name__ == "__main__":
    main()
