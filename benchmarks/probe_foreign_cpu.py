"""Where a foreign call's time goes, on the CPU backend (framework "numpy"):
jax_overlay.foreign against the bare jax.experimental.buffer_callback doing
the same copy, jax.pure_callback, and JAX's own op, in one jit each, same
process, alternating rounds.  The difference foreign - bare callback is
jax_overlay's own share (pytrees, views, tokens, checks), which the GPU
frameworks share too; the bare callback's cost over JAX's own op is the
mechanism's floor.

    python benchmarks/probe_foreign_cpu.py [--rounds 15] [--calls 300] [--n 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

import jax_overlay


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--n", type=int, default=1024)
    args = p.parse_args()
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(jnp.linspace(-1, 1, args.n, dtype=jnp.float32), cpu)
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def bare_cb(ctx, out, a):
        np.copyto(np.asarray(out), np.asarray(a) * 2)

    def into(a, out):
        np.multiply(a, 2, out=out)  # returns out: with out=True fn returns None

    cases = {
        "jax op": jax.jit(lambda v: v * 2),
        "bare buffer_callback": jax.jit(buffer_callback(bare_cb, spec)),
        "foreign numpy": jax.jit(jax_overlay.foreign(lambda a: a * 2, framework="numpy",
                                                     result_shape_dtypes=spec)),
        "foreign numpy out=True": jax.jit(jax_overlay.foreign(
            into, framework="numpy",
            result_shape_dtypes=spec, out=True)),
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
    print(f"# {args.n} float32 on the CPU backend, jax {jax.__version__}, {args.rounds} "
          f"alternating rounds of {args.calls} calls (dispatch to ready)")
    print(f"{'case':26s} {'us':>8s} {'x bare callback':>16s}")
    for k, ts in per.items():
        ratio = statistics.median(a / b for a, b in zip(ts, base))
        print(f"{k:26s} {statistics.median(ts):8.1f} {ratio:16.2f}")


if __name__ == "__main__":
    main()
