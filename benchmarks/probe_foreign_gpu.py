"""Where a GPU foreign call's time goes (framework "torch"): jax_overlay.foreign
against the bare jax.experimental.buffer_callback doing the same PyTorch op
on jaxlib's own Buffer capsules, the same jit without any callback, and
jax.pure_callback, same process, alternating rounds, end to end (dispatch
to ready).  foreign - bare callback is jax_overlay's own share (its views,
tokens, stream context and checks); bare callback - plain jit is the
mechanism's floor.  The CPU twin is benchmarks/probe_foreign_cpu.py.

    python benchmarks/probe_foreign_gpu.py [--rounds 15] [--calls 300] [--n 1024]
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
import torch  # noqa: E402
import torch.utils.dlpack  # noqa: E402
from jax.experimental.buffer_callback import buffer_callback  # noqa: E402

import jax_overlay  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--n", type=int, default=1024)
    args = p.parse_args()
    x = jnp.linspace(-1, 1, args.n, dtype=jnp.float32)
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    streams = {}

    def bare_cb(ctx, out, a):
        s = streams.get(ctx.stream)
        if s is None:
            s = streams[ctx.stream] = torch.cuda.ExternalStream(ctx.stream)
        with torch.cuda.stream(s):
            o = torch.utils.dlpack.from_dlpack(out.__dlpack__())
            o.copy_(torch.utils.dlpack.from_dlpack(a.__dlpack__()) * 2)

    def into(a, out):
        torch.mul(a, 2, out=out)

    cases = {
        "jit, no callback": jax.jit(lambda v: v * 2),
        "bare buffer_callback": jax.jit(buffer_callback(bare_cb, spec)),
        "foreign torch": jax.jit(jax_overlay.foreign(lambda a: a * 2, framework="torch",
                                                     result_shape_dtypes=spec)),
        "foreign torch out=True": jax.jit(jax_overlay.foreign(
            into, framework="torch", result_shape_dtypes=spec, out=True)),
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
    print(f"# {args.n} float32, {torch.cuda.get_device_name()}, jax {jax.__version__}, torch "
          f"{torch.__version__}, {args.rounds} alternating rounds of {args.calls} calls "
          "(dispatch to ready)")
    print(f"{'case':26s} {'us':>8s} {'x bare callback':>16s}")
    for k, ts in per.items():
        ratio = statistics.median(a / b for a, b in zip(ts, base))
        print(f"{k:26s} {statistics.median(ts):8.1f} {ratio:16.2f}")


if __name__ == "__main__":
    main()
