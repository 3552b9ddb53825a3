"""Median latency of CAI imports into JAX: stock JAX vs jax_overlay, idle and
in-flight producers, in one process.  Run on a GPU machine:

    python benchmarks/bench_cai_import.py [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy as cp  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import _runtime as rt  # noqa: E402
from jax_overlay import _xla_ext as ext  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "gpu"))
from producers import WithStream, spin_fill  # noqa: E402

REPEATS, ROUNDS = 500, 7


def median_us(fn, make_arg, repeats=REPEATS, rounds=ROUNDS, keep=None,
              before_round=None, after_round=None):
    """Median over `rounds` of the mean per-call time of `repeats` calls.
    Results go to `keep`, so none dies inside the timed region (or, for
    in-flight runs, before the producer's kernel ends).  `before_round` and
    `after_round` run untimed around each round (start and drain a busy
    producer)."""
    per_round = []
    keep = [] if keep is None else keep
    for _ in range(rounds):
        if before_round:
            before_round()
        args = [make_arg() for _ in range(repeats)]
        # As timeit does: the cyclic collector stays off while timed (it runs
        # after the round), so a collection of this large process (over
        # 270,000 objects on the H200 run) does not land in whichever call
        # crosses its threshold.  Reference counting still frees as usual.
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            for a in args:
                keep.append(fn(a))
            per_round.append((time.perf_counter_ns() - t0) / repeats / 1e3)
        finally:
            gc.enable()
        if after_round:
            after_round()
    ROUND_MEANS.append([round(r, 2) for r in per_round])
    return statistics.median(per_round)


ROUND_MEANS = []


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()

    dev = jax.devices("cuda")[0]
    a = cp.arange(1 << 20, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    busy = cp.cuda.Stream(non_blocking=True)
    res = {}

    def run(name, fn, make_arg, inflight=False):
        for _ in range(50):
            fn(make_arg())  # warm caches and jit
        keep = []
        if inflight:
            spin_fill(cp.empty(1, cp.float32), 0.0, ms=1000.0, stream=busy)
        res[name] = round(median_us(fn, make_arg, keep=keep), 2)
        print(f"  rounds of {name}: {ROUND_MEANS[-1]}", file=sys.stderr)
        if inflight:
            res[name + " (producer still busy after)"] = not busy.done
            t0 = time.perf_counter()
            del keep[-1]
            res[name + ": deleting one result while busy, ms"] = round(
                (time.perf_counter() - t0) * 1e3, 3)
            busy.synchronize()
        keep.clear()

    legacy = lambda: a                                # cupy exports stream 1 (legacy)
    idle_user = lambda: WithStream(a, busy.ptr)       # user stream, idle
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

    meta = {
        "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "driver": cp.cuda.runtime.driverGetVersion(),
        "jax": jax.__version__, "cupy": cp.__version__,
        "torch": getattr(torch, "__version__", None), "python": platform.python_version(),
        "repeats": REPEATS, "rounds": ROUNDS, "statistic": "median of round means, us",
    }
    out = {"meta": meta, "results_us": res}
    w = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k:<{w}}  {v}")
    print(json.dumps(meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
