"""Median latency of CAI imports into JAX: stock JAX vs jax_overlay, idle and
in-flight producers, in one process.  Run on a GPU machine:

    python benchmarks/bench_cai_import.py [--json out.json]
"""

from __future__ import annotations

import sys

import harness  # first: XLA's allocator setting, before jax loads

import cupy as cp
import jax
import jax.numpy as jnp

import jax_overlay
from _cai import WithStream
from _internals import _runtime as rt, _xla_ext as ext, spin_fill


def main():
    args = harness.arguments(__doc__, json_file=True).parse_args()
    dev = jax.devices("cuda")[0]
    a = cp.arange(1 << 20, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    busy = cp.cuda.Stream(non_blocking=True)
    res = {}

    def run(name, fn, make_arg, inflight=False):
        harness.warm(fn, make_arg)  # caches and jit
        keep = []
        if inflight:
            spin_fill(cp.empty(1, cp.float32), 0.0, ms=1000.0, stream=busy)
        res[name] = round(harness.median_us(fn, make_arg, keep=keep), 2)
        print(f"  rounds of {name}: {harness.ROUND_MEANS[-1]}", file=sys.stderr)
        if inflight:
            res[name + " (producer still busy after)"] = not busy.done
            t0 = harness.clock()
            del keep[-1]
            res[name + ": deleting one result while busy, ms"] = harness.since_ms(t0)
            busy.synchronize()
        keep.clear()

    legacy = lambda: a                                # noqa: E731 - cupy exports stream 1 (legacy)
    idle_user = lambda: WithStream(a, busy.ptr)       # noqa: E731 - user stream, idle
    inflight_user = idle_user                         # same, with a kernel running

    run("stock jnp.asarray(cupy) idle", jnp.asarray, legacy)
    try:
        jnp.asarray(idle_user())
        res["stock jnp.asarray(user stream)"] = "works"
    except Exception as e:  # noqa: BLE001
        res["stock jnp.asarray(user stream)"] = f"fails: {type(e).__name__}"

    jax_overlay.install()
    run("jax_overlay jnp.asarray(cupy) idle", jnp.asarray, legacy)
    run("jax_overlay jnp.asarray(user stream) idle", jnp.asarray, idle_user)
    run("jax_overlay jnp.asarray(user stream) in flight", jnp.asarray, inflight_user,
        inflight=True)
    jax_overlay.uninstall()
    run("from_cuda_array_interface idle", jax_overlay.from_cuda_array_interface, legacy)
    run("from_cuda_array_interface in flight", jax_overlay.from_cuda_array_interface,
        inflight_user, inflight=True)

    # Floors: what the pieces cost on their own.
    cai = a.__cuda_array_interface__
    run("floor: a.__cuda_array_interface__ (CuPy)", lambda o: o.__cuda_array_interface__, legacy)
    run("floor: parse_cai", ext.parse_cai, lambda: cai)
    run("floor: pointer_info", ext.pointer_info, lambda: a.data.ptr)
    run("floor: stream_idle(legacy)", lambda s: ext.stream_idle(0, s), lambda: 1)
    run("floor: stream_idle(user)", lambda s: ext.stream_idle(0, s), lambda: busy.ptr)
    view = ext.parse_cai(cai)
    run("floor: capsule_from_cai", lambda v: ext.capsule_from_cai(v, a, 2, 0), lambda: view)
    run("floor: jaxlib dlpack import (no stream)",
        lambda c: rt.capsule_to_array(c, dev, None, None, 2),
        lambda: ext.capsule_from_cai(view, a, 2, 0))
    ready = int(dev.get_stream_for_external_ready_events())
    run("floor: jaxlib dlpack import (with PJRT stream event)",
        lambda c: rt.capsule_to_array(c, dev, ready, None, 2),
        lambda: ext.capsule_from_cai(view, a, 2, 0))
    stream = rt.compute_stream(dev)
    run("floor: order_after (busy producer)",
        lambda s: ext.order_after(0, s, stream), lambda: busy.ptr, inflight=True)

    torch = None
    try:
        import torch
    except Exception:  # noqa: BLE001
        pass
    if torch is not None:
        run("peer: torch.as_tensor(cupy, device='cuda')",
            lambda o: torch.as_tensor(o, device="cuda"), legacy)
        run("peer: torch.from_dlpack(cupy)", torch.from_dlpack, legacy)
        t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        run("peer: cupy.asarray(torch)", cp.asarray, lambda: t)
        run("stock jnp.asarray(torch)", jnp.asarray, lambda: t)
        jax_overlay.install()
        run("jax_overlay jnp.asarray(torch)", jnp.asarray, lambda: t)
        jax_overlay.uninstall()

    meta = harness.meta(gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                        driver=cp.cuda.runtime.driverGetVersion(), repeats=harness.REPEATS,
                        rounds=harness.ROUNDS, statistic="median of round means, us")
    harness.finish(harness.listing(res, ("case", "us")), args.json, {"meta": meta, "results_us": res})


if __name__ == "__main__":
    main()
