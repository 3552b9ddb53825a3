"""What dropping an import costs, stock against install(), same process,
alternating rounds: the floor of jnp.array's miss (docs/DROPIN.md, "Speed").

jnp.array(producer) imports, copies, and drops the import while the copy
is in flight.  Per call, each timed apart (CuPy and PyTorch producers,
4 KiB float32):
  import         v = jnp.asarray(a), then v.block_until_ready() (untimed)
  copy dispatch  y = jnp.array(v)
  copy of a fresh import  the same, right after the import, not waited for
  drop, in flight  del v, the copy maybe still running
  drop, ready    del v after y.block_until_ready(): nothing left to wait for
If "drop, in flight" exceeds "drop, ready", the release waits for the copy
on the calling thread.

    python benchmarks/probe_release.py [--rounds 15] [--calls 200] [--json FILE]
"""

from __future__ import annotations

import statistics

import harness  # first: XLA's allocator setting, before jax loads

import cupy as cp
import jax
import jax.numpy as jnp
import torch

import jax_overlay

N_ITEMS = 1024
PARTS = ("import", "copy dispatch", "copy of a fresh import", "drop, in flight", "drop, ready")
SIDES = {"stock": jax_overlay.uninstall, "installed": jax_overlay.install}


def one_side(a, calls):
    """Median µs per part over `calls` calls on the side installed now."""
    got = {k: [] for k in PARTS}
    clock = harness.clock
    for i in range(calls):
        ready = i % 2 == 1  # alternate the two drops within the side
        t0 = clock()
        v = jnp.asarray(a)
        t1 = clock()
        v.block_until_ready()
        t2 = clock()
        y = jnp.array(v)
        t3 = clock()
        if ready:
            y.block_until_ready()
        t4 = clock()
        del v
        t5 = clock()
        y.block_until_ready()
        del y
        w = jnp.asarray(a)  # copied at once, as jnp.array(a) does
        t6 = clock()
        y = jnp.array(w)
        t7 = clock()
        del w
        y.block_until_ready()
        got["copy of a fresh import"].append(t7 - t6)
        got["import"].append(t1 - t0)
        got["copy dispatch"].append(t3 - t2)
        got["drop, ready" if ready else "drop, in flight"].append(t5 - t4)
    return {k: statistics.median(v) / 1e3 for k, v in got.items()}


def main():
    args = harness.arguments(__doc__, json_file=True, rounds=15, calls=200).parse_args()
    src = {"cupy": cp.arange(N_ITEMS, dtype=cp.float32),
           "torch": torch.arange(N_ITEMS, dtype=torch.float32, device="cuda")}
    arms = [harness.Arm((lib, side), lambda a=a: one_side(a, args.calls), setup=setup,
                        warm=lambda a=a: one_side(a, 20))
            for lib, a in src.items() for side, setup in SIDES.items()]
    try:
        samples = harness.alternate(arms, args.rounds, lambda r: harness.paired(src, SIDES, r))
    finally:
        jax_overlay.uninstall()
    report, rows = {}, []
    for lib in src:
        for k in PARTS:
            s, i = (statistics.median(got[k] for got in samples[(lib, side)]) for side in SIDES)
            report[f"{lib} {k}"] = {"stock_us": s, "installed_us": i}
            rows.append((lib, k, f"{s:.2f}", f"{i:.2f}"))
    meta = harness.meta(rounds=args.rounds, calls=args.calls, items=N_ITEMS)
    print(f"# {meta['device']}, jax {jax.__version__}, cupy {cp.__version__}, torch {torch.__version__}; "
          f"{args.rounds} alternating rounds of {args.calls} calls; µs, median of the rounds' medians")
    print(harness.table(["producer", "part", "stock", "installed"], rows))
    harness.save(args.json, dict(report, meta=meta))


if __name__ == "__main__":
    main()
