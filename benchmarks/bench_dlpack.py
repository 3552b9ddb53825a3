"""Median latency of DLPack interchange: stock JAX vs jax_overlay vs the
peers' own conversions, idle and in-flight producers, in one process.  Run on
a GPU machine:

    python benchmarks/bench_dlpack.py [--json out.json]
"""

from __future__ import annotations

import sys

import harness  # first: XLA's allocator setting, before jax loads

import cupy as cp
import jax
import jax.dlpack
import jax.numpy as jnp
import torch

import jax_overlay
from _internals import spin_fill


def main():
    args = harness.arguments(__doc__, json_file=True).parse_args()
    n = 1 << 20
    a = cp.arange(n, dtype=cp.float32)
    t = torch.arange(n, dtype=torch.float32, device="cuda")
    x = jnp.arange(n, dtype=jnp.float32) + 0
    x.block_until_ready()
    cp.cuda.Device().synchronize()
    busy_cp = cp.cuda.Stream(non_blocking=True)
    busy_torch = torch.cuda.Stream()
    res = {}

    def run(name, fn, make_arg):
        harness.warm(fn, make_arg)
        keep = []
        try:
            res[name] = round(harness.median_us(fn, make_arg, keep=keep), 2)
        except Exception as e:  # noqa: BLE001 - a row that fails is a finding
            res[name] = f"fails: {type(e).__name__}: {str(e)[:120]}"
            print(f"  {name}: {res[name]}", file=sys.stderr)
            return
        print(f"  rounds of {name}: {harness.ROUND_MEANS[-1]}", file=sys.stderr)
        keep.clear()

    # Imports into JAX.
    run("stock jax.dlpack.from_dlpack(cupy)", jax.dlpack.from_dlpack, lambda: a)
    run("stock jax.dlpack.from_dlpack(torch)", jax.dlpack.from_dlpack, lambda: t)
    jax_overlay.install()
    run("jax_overlay jax.dlpack.from_dlpack(cupy) idle", jax.dlpack.from_dlpack, lambda: a)
    run("jax_overlay jax.dlpack.from_dlpack(torch) idle", jax.dlpack.from_dlpack, lambda: t)
    run("jax_overlay jnp.asarray(cupy) idle", jnp.asarray, lambda: a)
    run("jax_overlay jnp.asarray(torch) idle", jnp.asarray, lambda: t)
    run("jax_overlay jax.device_put(torch) idle", jax.device_put, lambda: t)
    jax_overlay.uninstall()
    run("jax_overlay.from_dlpack(cupy) idle", jax_overlay.from_dlpack, lambda: a)
    run("jax_overlay.from_dlpack(torch) idle", jax_overlay.from_dlpack, lambda: t)

    # In flight: before each round the producer's current stream gets a
    # 300 ms kernel, so every timed call finds it busy.  A round is 500
    # calls: CuPy's own __dlpack__ blocks the host after ~1021 pending syncs
    # (see probe_dlpack.py), which would time CuPy, not the import.
    def inflight(name, fn, make_arg, start, busy, sync):
        harness.warm(fn, make_arg)
        sync()
        busy_after = []

        def after():
            busy_after.append(busy())
            sync()
        res[name] = round(harness.median_us(fn, make_arg, before_round=start, after_round=after), 2)
        res[name + " (producer busy after every round)"] = all(busy_after)

    def cupy_busy():
        spin_fill(cp.empty(1, cp.float32), 0.0, ms=300.0, stream=busy_cp)

    def torch_busy():
        with torch.cuda.stream(busy_torch):
            torch.cuda._sleep(600_000_000)

    with busy_cp:
        inflight("jax_overlay.from_dlpack(cupy) in flight", jax_overlay.from_dlpack,
                 lambda: a, cupy_busy, lambda: not busy_cp.done, busy_cp.synchronize)
    with torch.cuda.stream(busy_torch):
        inflight("jax_overlay.from_dlpack(torch) in flight", jax_overlay.from_dlpack,
                 lambda: t, torch_busy, lambda: not busy_torch.query(),
                 busy_torch.synchronize)

    # Peers importing from each other.
    run("peer: torch.from_dlpack(cupy)", torch.from_dlpack, lambda: a)
    run("peer: cupy.from_dlpack(torch)", cp.from_dlpack, lambda: t)

    # Exports from JAX.
    run("stock torch.from_dlpack(jax)", torch.from_dlpack, lambda: x)
    run("stock cupy.from_dlpack(jax)", cp.from_dlpack, lambda: x)
    run("stock x.__dlpack__(max_version=(1,1))", lambda v: v.__dlpack__(max_version=(1, 1)), lambda: x)
    jax_overlay.install()
    run("jax_overlay torch.from_dlpack(jax)", torch.from_dlpack, lambda: x)
    run("jax_overlay cupy.from_dlpack(jax)", cp.from_dlpack, lambda: x)
    run("jax_overlay x.__dlpack__(max_version=(1,1))", lambda v: v.__dlpack__(max_version=(1, 1)), lambda: x)
    run("jax_overlay x.__dlpack_device__()", lambda v: v.__dlpack_device__(), lambda: x)
    jax_overlay.uninstall()
    run("stock x.__dlpack_device__()", lambda v: v.__dlpack_device__(), lambda: x)

    meta = harness.meta(gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                        driver=cp.cuda.runtime.driverGetVersion(), statistic="median of round means, us")
    harness.finish(harness.listing(res, ("case", "us")), args.json,
                   {"meta": meta, "results_us": res, "round_means": harness.ROUND_MEANS})


if __name__ == "__main__":
    main()
