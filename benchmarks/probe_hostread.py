"""An import taken while its producer's kernel still runs, read at once:
stale or not, by route, read, producer stream and GPU load; what the import
call itself costs meanwhile; and where many pending imports make the host
wait.  Answers issue 39's table, idle and with another process loading
the GPU (tests/gpu/load.py).

    python benchmarks/probe_hostread.py [--trials 60] [--ms 2] [--load both]
        [--routes a,b] [--queue 300] [--json FILE]

Routes: stock `jax.dlpack.from_dlpack` (not installed); `before`, the
ordering jax_overlay had until issue 39 (XLA's compute stream made to wait
for the producer with an event, then jaxlib's import with no stream), on
the CAI plan; jax_overlay's `from_dlpack` and `from_cuda_array_interface`
(a ready stream made to wait, handed to jaxlib's import); and
`jax.dlpack.from_dlpack` after `install()`.  Reads: `np.asarray` (host),
`jnp.min`/`jnp.max` (a computation), `jax.device_put` to the CPU.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import harness  # first: XLA's allocator setting, before jax loads

import cupy as cp
import jax
import jax.numpy as jnp
import numpy as np

import jax_overlay
from _internals import _runtime as rt, _xla_ext as ext, spin_fill

LOAD = os.path.join(harness.ROOT, "tests", "gpu", "load.py")
STREAMS = {
    "legacy": lambda: (cp.cuda.Stream.null, 1),
    "per_thread": lambda: (cp.cuda.Stream.ptds, 2),
    "user": lambda: ((s := cp.cuda.Stream(non_blocking=True)), s.ptr),
}


def before_import(a):
    """The ordering before issue 39's fix: XLA's compute stream waits for
    the producer, and jaxlib imports with no stream."""
    dev = rt.gpu_device(a.device.id)
    plan = ext.plan_cai_import(a.__cuda_array_interface__, a, False)
    if plan.busy:
        ext.order_after(plan.ordinal, plan.view.stream, rt.compute_stream(dev))
    return rt.capsule_to_array(plan.capsule, dev, None, None, 2)


def installed_from_dlpack(a):
    return jax.dlpack.from_dlpack(a)


ROUTES = {
    "stock from_dlpack": None,  # jax.dlpack.from_dlpack, not installed
    "before (cai)": before_import,
    "overlay from_dlpack": jax_overlay.from_dlpack,
    "overlay from_cai": jax_overlay.from_cuda_array_interface,
    "installed from_dlpack": "installed",
}
CPU = jax.devices("cpu")[0]
READS = {
    "host": lambda x: np.asarray(x),
    "computation": lambda x: np.array([float(jnp.min(x)), float(jnp.max(x))]),
    "device_put cpu": lambda x: np.asarray(jax.device_put(x, CPU)),
}


def trial_set(route, read, kind, trials, ms):
    stream, _ = STREAMS[kind]()
    a = cp.zeros(1 << 20, cp.float32)
    fn = ROUTES[route]
    installed = fn == "installed"
    if installed:
        jax_overlay.install()
        fn = installed_from_dlpack
    elif fn is None:
        fn = jax.dlpack.from_dlpack
    stale, times = 0, []
    try:
        with stream:
            for k in range(1, trials + 1):
                spin_fill(a, float(k), ms=ms, stream=stream)
                t0 = harness.clock()
                x = fn(a)
                times.append((harness.clock() - t0) / 1e3)
                h = READS[read](x)
                stale += not (h.min() == h.max() == k)
                del x
    finally:
        if installed:
            jax_overlay.uninstall()
        stream.synchronize()
    return {"stale": stale, "trials": trials,
            "import us median": round(statistics.median(times), 1),
            "import us max": round(max(times), 1)}


def queue(route, count, ms):
    """`count` imports behind one long kernel on a user stream: the first
    call that took over 2 ms, what a jit dispatch on the last one cost, and
    whether the producer was still busy after both."""
    s = cp.cuda.Stream(non_blocking=True)
    arrays = [cp.zeros(256, cp.float32) for _ in range(count)]
    cp.cuda.Device().synchronize()
    fn = ROUTES[route] or jax.dlpack.from_dlpack
    installed = fn == "installed"
    if installed:
        fn = installed_from_dlpack
        jax_overlay.install()
    double = jax.jit(lambda v: v * 2)
    double(jax_overlay.from_dlpack(arrays[0])).block_until_ready()  # compiled before
    kept, first_slow, times = [], None, []
    with s:
        spin_fill(cp.empty(1, cp.float32), 0.0, ms=ms, stream=s)
        for a in arrays:
            spin_fill(a, 1.0, ms=0.0, stream=s)
        for i, a in enumerate(arrays):
            t0 = harness.clock()
            kept.append(fn(a))
            t = (harness.clock() - t0) / 1e3
            times.append(t)
            if first_slow is None and t > 2000:
                first_slow = [i, round(t / 1e3, 1)]
        t0 = harness.clock()
        y = double(kept[-1])
        dispatch = round((harness.clock() - t0) / 1e3, 1)
        busy_after = not s.done
        wrong = sum(int(np.asarray(x).min() != 1.0) for x in kept) + int(np.asarray(y).min() != 2.0)
    if installed:
        jax_overlay.uninstall()
    s.synchronize()
    return {"first call over 2 ms (index, ms)": first_slow, "producer busy after all": busy_after,
            "import us median": round(statistics.median(times), 1),
            "jit dispatch on the last, us": dispatch, "wrong after": wrong}


def table(results):
    """Markdown: stale reads of `trials` by route (rows) and load x read
    (columns), the three streams summed; the import call's median µs."""
    loads = list(dict.fromkeys(r["load"] for r in results))
    reads = list(dict.fromkeys(r["read"] for r in results if r["read"] != "queue"))
    routes = list(dict.fromkeys(r["route"] for r in results))
    cols = [(ld, rd) for ld in loads for rd in reads]
    lines = ["| route | " + " | ".join(f"{ld}: {rd}" for ld, rd in cols)
             + " | " + " | ".join(f"{ld}: import µs" for ld in loads) + " |",
             "|---" * (1 + len(cols) + len(loads)) + "|"]
    for route in routes:
        cells = []
        for ld, rd in cols:
            rs = [r for r in results if (r["route"], r["load"], r["read"]) == (route, ld, rd)]
            cells.append(f"{sum(r['stale'] for r in rs)} / {sum(r['trials'] for r in rs)}" if rs else "")
        for ld in loads:
            rs = [r["import us median"] for r in results
                  if (r["route"], r["load"]) == (route, ld) and r["read"] != "queue"]
            cells.append(f"{statistics.median(rs):.1f}" if rs else "")
        lines.append(f"| {route} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    p = harness.arguments(__doc__, json_file=True)
    p.add_argument("--trials", type=int, default=60)
    p.add_argument("--ms", type=float, default=2.0)
    p.add_argument("--load", choices=["idle", "loaded", "both"], default="both")
    p.add_argument("--routes", default=",".join(ROUTES))
    p.add_argument("--reads", default=",".join(READS))
    p.add_argument("--queue", type=int, default=300)
    p.add_argument("--table", default="", help="only print the table of this JSON")
    args = p.parse_args()
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)["results"]))
        return
    dev = jax.devices("cuda")[0]
    out = {"device": dev.device_kind, "client": type(dev.client).__name__,
           "platform_version": dev.client.platform_version, "results": []}
    print(json.dumps({k: out[k] for k in ("device", "client", "platform_version")}))
    loads = ["idle", "loaded"] if args.load == "both" else [args.load]
    try:
        for load in loads:
            run_load(load, args, out["results"])
    except KeyboardInterrupt:  # a time limit: what ran is reported
        out["interrupted"] = True
    print(table(out["results"]))
    harness.save(args.json, dict(out, meta=harness.meta()))


def run_load(load, args, results):
    proc = None
    if load == "loaded":
        proc = subprocess.Popen([sys.executable, LOAD], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
    try:
        for route in args.routes.split(","):
            for read in args.reads.split(","):
                for kind in STREAMS:
                    r = trial_set(route, read, kind, args.trials, args.ms)
                    r.update(load=load, route=route, read=read, stream=kind)
                    results.append(r)
                    print(json.dumps(r), flush=True)
            if args.queue:
                r = queue(route, args.queue, 500.0)
                r.update(load=load, route=route, read="queue")
                results.append(r)
                print(json.dumps(r), flush=True)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()

if __name__ == "__main__":
    main()
