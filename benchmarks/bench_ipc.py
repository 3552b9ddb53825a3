#!/usr/bin/env python3
"""A parameter pytree from one process to another on the same GPU: share +
open_shared + a first read, against the host round trip (device_get,
pickle, device_put) and against one share per array.  GPU only.

    python benchmarks/bench_ipc.py [--mib 1024] [--arrays 200] [--rounds 5] [--read jit|eager] [--out DIR]

The exporter is this process; the receiver (JAX, then PyTorch) another.
Every round runs each method once, alternating, and the receiver times
from the moment the message arrives to the first read done (a reduction
over every array, synchronized); the exporter's own cost (share, or
device_get + pickle) is added.  The receiver also times a second open of
the same allocations (cached mappings) per array.  Ratios are medians of
per-round ratios.  Bytes copied: the receiver's GPU memory in use before
and after the open (a zero-copy open maps, it allocates nothing).

Then the weight re-sync rows (--resync, default 200,1000 arrays of 256 MiB in
all): benchmarks/probe_resync.py in its own processes, where a channel
(jax_overlay.channel), share, share(pack=True) and torch.multiprocessing
alternate in every round; its figures land in ipc.json under "resync".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import pickle
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def receiver(conn, framework, read="jit"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_overlay
    from ipc_worker import free_memory
    if framework == "torch":
        import torch

    # One read of every array: jitted once for JAX (--read jit), or JAX's
    # eager ops one array at a time (--read eager, 200 dispatches, as the
    # first committed run did).
    jit_read = jax.jit(lambda leaves: jnp.sum(jnp.stack([x[0] for x in leaves]))
                       + jnp.sum(leaves[0]))

    def first_read(tree):
        leaves = jax.tree_util.tree_leaves(tree)
        if framework == "jax" and read == "jit":
            return float(jit_read(leaves))
        if framework == "torch":
            s = sum(float(t.sum()) for t in leaves[:1]) + float(torch.stack([t[0] for t in leaves]).sum())
            torch.cuda.synchronize()
        else:
            s = float(jnp.sum(jnp.stack([x[0] for x in leaves]))) + float(jnp.sum(leaves[0]))
        return s

    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, payload = msg
        t0 = time.perf_counter()
        free_before = free_memory()
        if kind == "host":
            host = pickle.loads(payload)
            if framework == "torch":
                tree = [torch.from_numpy(a).cuda() for a in host]
            else:
                tree = jax.device_put(host)
            first_read(tree)
        elif kind == "share":
            tree = jax_overlay.open_shared(payload, framework=framework)
            first_read(tree)
        else:  # one share per array
            tree = [jax_overlay.open_shared(h, framework=framework)[0] for h in payload]
            first_read(tree)
        dt = time.perf_counter() - t0
        copied = max(0, free_before - free_memory())
        again = None
        if kind == "share":  # a second open of the same allocations: per array
            t1 = time.perf_counter()
            tree2 = jax_overlay.open_shared(payload, framework=framework)
            again = (time.perf_counter() - t1) / len(jax.tree_util.tree_leaves(tree2))
            del tree2
        del tree
        conn.send((dt, copied, again))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--arrays", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=".")
    ap.add_argument("--read", choices=("jit", "eager"), default="jit",
                    help="how the JAX receiver reads every array first")
    ap.add_argument("--resync", default="200,1000",
                    help="tree sizes (arrays) of the re-sync rows; '' skips them")
    a = ap.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_overlay
    n = a.mib * (1 << 20) // 4 // a.arrays
    params = [jnp.full((n,), float(i), jnp.float32) for i in range(a.arrays)]
    jax.block_until_ready(params)
    results = {}
    ctx = multiprocessing.get_context("spawn")
    for framework in ("jax", "torch"):
        try:
            if framework == "torch":
                import torch  # noqa: F401
        except ImportError:
            continue
        conn, child = ctx.Pipe()
        p = ctx.Process(target=receiver, args=(child, framework, a.read), daemon=True)
        p.start()

        def run(kind):
            t0 = time.perf_counter()
            if kind == "host":
                payload = pickle.dumps(jax.device_get(params), protocol=5)
                keep = None
            elif kind == "share":
                payload = keep = jax_overlay.share(params)
            else:
                payload = keep = [jax_overlay.share([x]) for x in params]
            t_exp = time.perf_counter() - t0
            conn.send((kind, payload))
            dt, copied, again = conn.recv()
            del keep
            return t_exp + dt, copied, again

        for kind in ("host", "share", "per_array"):  # warm-up
            run(kind)
        rows = {k: [] for k in ("host", "share", "per_array")}
        control = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            np.ones(1 << 20).sum()  # a jax-free control call: the host's drift
            control.append(time.perf_counter() - t0)
            for kind in rows:
                rows[kind].append(run(kind))
        conn.send(None)
        p.join(30)
        med = {k: statistics.median(r[0] for r in v) for k, v in rows.items()}
        ratio_host = statistics.median(h[0] / s[0] for h, s in zip(rows["host"], rows["share"]))
        ratio_per = statistics.median(h[0] / s[0] for h, s in zip(rows["per_array"], rows["share"]))
        again = statistics.median(r[2] for r in rows["share"])
        results[framework] = {
            "median_s": med, "host_over_share": ratio_host, "per_array_over_share": ratio_per,
            "bytes_copied_by_open": max(r[1] for r in rows["share"]),
            "second_open_us_per_array": again * 1e6, "control_s": control,
            "rounds": {k: [r[0] for r in v] for k, v in rows.items()}}
        print(f"{framework}: share+open+read {med['share'] * 1e3:.2f} ms, host round trip "
              f"{med['host'] * 1e3:.1f} ms ({ratio_host:.1f}x), one share per array "
              f"{med['per_array'] * 1e3:.2f} ms ({ratio_per:.1f}x), bytes copied "
              f"{results[framework]['bytes_copied_by_open']}, second open "
              f"{again * 1e6:.1f} us/array", flush=True)
    import subprocess
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    meta = {"gpu": gpu, "jax": jax.__version__, "python": platform.python_version(),
            "mib": a.mib, "arrays": a.arrays, "rounds": a.rounds, "read": a.read}
    import subprocess as sp
    resync = {}
    for n in filter(None, a.resync.split(",")):
        with __import__("tempfile").NamedTemporaryFile(suffix=".json") as f:
            r = sp.run([sys.executable, str(ROOT / "benchmarks" / "probe_resync.py"), "--arrays", n,
                        "--rounds", str(max(a.rounds, 7)), "--json", f.name])
            if r.returncode == 0:
                resync[n] = json.loads(pathlib.Path(f.name).read_text())
                print(f"re-sync, {n} arrays: " + ", ".join(
                    f"{k} {v:.2f} ms" for k, v in resync[n]["median_ms"].items()) + "; channel, "
                    f"call to arrays {resync[n]['trainer_parts_ms']['channel: call to arrays']:.3f} ms",
                    flush=True)
            else:
                resync[n] = {"error": f"probe_resync exited {r.returncode}"}
    out = pathlib.Path(a.out) / "ipc.json"
    out.write_text(json.dumps({"meta": meta, "results": results, "resync": resync}, indent=1))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
