#!/usr/bin/env python3
"""Where a weight re-sync's time goes (issue 40): the same parameter tree
(default 200 float32 arrays, 256 MiB) sent again every step from a trainer
to a rollout process on the same GPU, and read there.  GPU only.

    python benchmarks/probe_resync.py [--mib 256] [--arrays 200] [--rounds 15] [--json FILE]

Methods, alternating in every round, each timed at the trainer from its
call to the receiver's answer (the receiver read every array: one jitted
reduction over a slice of each, synchronized):
  share      jax_overlay.share(tree) each step, open_shared in the rollout
  pack       jax_overlay.share(tree, pack=True): packed into one buffer on
             the GPU by one jitted call, that buffer shared, and unpacked by
             one jitted call in the rollout (two device copies of the tree,
             no host-side step per array)
  torch.mp   PyTorch tensors, the same 200 sent again through a
             torch.multiprocessing queue (CUDA IPC, cached by the receiver)
  channel    jax_overlay.channel(tree), made and opened once: ch.send(tree)
             each step, rx.recv() in the rollout (one jitted pack, one
             device copy into the channel's slot, an event and a 12-byte
             message; one jitted unpack there)
and a jax-free control call per round (the host's drift).  The trainer's
host-side calls are timed apart: share(tree), share(tree, pack=True) and
ch.send(tree); and for the channel, the time from the trainer's call to
the rollout's arrays (recv() returned, before the read; both processes
read one clock, CLOCK_MONOTONIC).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def receiver(conn, torch_queue):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    import jax_overlay
    read = jax.jit(lambda leaves: jnp.sum(jnp.stack([x[:8] for x in leaves])))
    rx = None
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, payload = msg
        t0 = time.perf_counter()
        if kind == "open channel":
            rx = jax_overlay.open_channel(payload)
        elif kind == "channel":
            tree = rx.recv()
            arrays = time.perf_counter()
            float(read(tree))
            conn.send((time.perf_counter() - t0, arrays))
            continue
        elif kind in ("share", "pack"):
            float(read(jax_overlay.open_shared(payload)))
        else:
            import torch
            ts = torch_queue.get()
            float(torch.stack([t[:8] for t in ts]).sum())
        conn.send(time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--arrays", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import torch.multiprocessing as tmp

    import jax_overlay
    n = a.mib * (1 << 20) // 4 // a.arrays
    params = [jnp.full((n,), float(i), jnp.float32) for i in range(a.arrays)]
    tparams = [torch.full((n,), float(i), device="cuda") for i in range(a.arrays)]
    jax.block_until_ready(params)
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    conn, child = ctx.Pipe()
    p = ctx.Process(target=receiver, args=(child, q), daemon=True)
    p.start()
    parts: dict[str, list] = {"share(tree)": [], "share(tree, pack=True)": [], "ch.send(tree)": [],
                              "channel: call to arrays": []}
    keep = []
    ch = jax_overlay.channel(params)
    conn.send(("open channel", ch.name))
    conn.recv()

    def run(kind):
        t0 = time.perf_counter()
        if kind == "channel":
            ch.send(params)
            parts["ch.send(tree)"].append(time.perf_counter() - t0)
            conn.send((kind, None))
            _, arrays = conn.recv()
            parts["channel: call to arrays"].append(arrays - t0)
            return time.perf_counter() - t0
        if kind in ("share", "pack"):
            h = jax_overlay.share(params, pack=kind == "pack")
            parts["share(tree, pack=True)" if kind == "pack" else "share(tree)"].append(
                time.perf_counter() - t0)
            conn.send((kind, h))
        else:
            q.put(tparams)
            conn.send((kind, None))
            h = None
        conn.recv()
        total = time.perf_counter() - t0
        keep[:] = [h]  # released at the next step's, as a trainer would
        return total

    kinds = ("share", "pack", "torch.mp", "channel")
    for k in kinds:
        run(k)
        run(k)
    rows = {k: [] for k in kinds}
    control = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        np.ones(1 << 20).sum()
        control.append(time.perf_counter() - t0)
        for k in kinds:
            rows[k].append(run(k))
    conn.send(None)
    p.join(30)
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    ratios = {f"torch.mp/{k}": statistics.median(t / s for t, s in zip(rows["torch.mp"], rows[k]))
              for k in ("share", "pack", "channel")}
    part_med = {k: statistics.median(v[2:]) * 1e3 for k, v in parts.items()}
    import subprocess
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    out = {"meta": {"gpu": gpu, "jax": jax.__version__, "torch": torch.__version__,
                    "mib": a.mib, "arrays": a.arrays, "rounds": a.rounds},
           "median_ms": med, "ratios": ratios, "trainer_parts_ms": part_med,
           "control_ms": [c * 1e3 for c in control],
           "rounds_ms": {k: [t * 1e3 for t in v] for k, v in rows.items()}}
    print(json.dumps({k: out[k] for k in ("meta", "median_ms", "ratios", "trainer_parts_ms")}, indent=1))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
