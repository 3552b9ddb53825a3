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

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy as cp  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import jax_overlay  # noqa: E402

N_ITEMS = 1024
PARTS = ("import", "copy dispatch", "copy of a fresh import", "drop, in flight", "drop, ready")


def one_side(a, calls):
    """Median µs per part over `calls` calls on the side installed now."""
    got = {k: [] for k in PARTS}
    clock = time.perf_counter_ns
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
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--json", default="")
    args = p.parse_args()
    src = {"cupy": cp.arange(N_ITEMS, dtype=cp.float32),
           "torch": torch.arange(N_ITEMS, dtype=torch.float32, device="cuda")}
    per = {(lib, side, k): [] for lib in src for side in ("stock", "installed") for k in PARTS}
    for side in (jax_overlay.uninstall, jax_overlay.install):  # warm both
        side()
        for a in src.values():
            one_side(a, 20)
    for r in range(args.rounds):
        order = ("stock", "installed") if r % 2 == 0 else ("installed", "stock")
        for lib, a in src.items():
            for side in order:
                (jax_overlay.uninstall if side == "stock" else jax_overlay.install)()
                for k, us in one_side(a, args.calls).items():
                    per[(lib, side, k)].append(us)
    jax_overlay.uninstall()
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, cupy {cp.__version__}, "
          f"torch {torch.__version__}; {args.rounds} alternating rounds of {args.calls} calls; "
          "µs, median of the rounds' medians")
    print(f"{'producer':8s} {'part':24s} {'stock':>8s} {'installed':>10s}")
    report = {}
    for lib in src:
        for k in PARTS:
            s, i = (statistics.median(per[(lib, side, k)]) for side in ("stock", "installed"))
            report[f"{lib} {k}"] = {"stock_us": s, "installed_us": i}
            print(f"{lib:8s} {k:24s} {s:8.2f} {i:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
