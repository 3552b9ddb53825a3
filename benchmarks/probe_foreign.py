"""Where a foreign call's time goes: jax_overlay.foreign against the bare
jax.experimental.buffer_callback doing the same work on jaxlib's own
Buffers, the same jit without any callback, and jax.pure_callback, in one
jit each, same process, alternating rounds, end to end (dispatch to ready).
foreign - bare callback is jax_overlay's own share (pytrees, views, tokens,
the stream context, checks); bare callback - plain jit is the mechanism's
floor.

  --backend cpu  framework "numpy" on the CPU backend
  --backend gpu  framework "torch" on the GPU (needs PyTorch with CUDA)

    python benchmarks/probe_foreign.py [--backend cpu] [--rounds 15] [--calls 300] [--n 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.buffer_callback import buffer_callback  # noqa: E402

import jax_overlay  # noqa: E402


def _cpu_cases(x, spec):
    def bare(ctx, out, a):
        np.copyto(np.asarray(out), np.asarray(a) * 2)

    def into(a, out):
        np.multiply(a, 2, out=out)  # returns out: with out=True fn returns None
    return ("numpy", bare, lambda a: a * 2, into), f"jax {jax.__version__}, CPU backend"


def _gpu_cases(x, spec):
    import torch
    import torch.utils.dlpack
    streams = {}

    def bare(ctx, out, a):
        s = streams.get(ctx.stream)
        if s is None:
            s = streams[ctx.stream] = torch.cuda.ExternalStream(ctx.stream)
        with torch.cuda.stream(s):
            o = torch.utils.dlpack.from_dlpack(out.__dlpack__())
            o.copy_(torch.utils.dlpack.from_dlpack(a.__dlpack__()) * 2)

    def into(a, out):
        torch.mul(a, 2, out=out)
    return (("torch", bare, lambda a: a * 2, into),
            f"{torch.cuda.get_device_name()}, jax {jax.__version__}, torch {torch.__version__}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--n", type=int, default=1024)
    args = p.parse_args()
    x = jnp.linspace(-1, 1, args.n, dtype=jnp.float32)
    if args.backend == "cpu":
        x = jax.device_put(x, jax.devices("cpu")[0])
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    (framework, bare, fn, into), env = (_cpu_cases if args.backend == "cpu" else _gpu_cases)(x, spec)
    cases = {
        "jit, no callback": jax.jit(lambda v: v * 2),
        "bare buffer_callback": jax.jit(buffer_callback(bare, spec)),
        f"foreign {framework}": jax.jit(jax_overlay.foreign(
            fn, framework=framework, result_shape_dtypes=spec)),
        f"foreign {framework} out=True": jax.jit(jax_overlay.foreign(
            into, framework=framework, result_shape_dtypes=spec, out=True)),
        "pure_callback": jax.jit(lambda v: jax.pure_callback(lambda h: np.asarray(h) * 2, spec, v)),
    }
    for f in cases.values():
        np.testing.assert_allclose(np.asarray(f(x)), np.asarray(x) * 2)
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
    print(f"# {args.n} float32, {env}, {args.rounds} alternating rounds of {args.calls} calls "
          "(dispatch to ready)")
    print(f"{'case':26s} {'us':>8s} {'x bare callback':>16s}")
    for k, ts in per.items():
        ratio = statistics.median(a / b for a, b in zip(ts, base))
        print(f"{k:26s} {statistics.median(ts):8.1f} {ratio:16.2f}")


if __name__ == "__main__":
    main()
