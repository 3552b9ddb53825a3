#!/usr/bin/env python3
"""Where a packed re-sync's milliseconds go (issue 40's floor analysis):
the trainer's share(tree, pack=True) and the receiver's open_shared, each
step of both timed by wrapping the functions they call.  The same 200-array
tree (256 MiB) every step, as probe_resync.py sends it.  GPU only.

    python benchmarks/probe_resync_parts.py [--rounds 15] [--json FILE]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

PARTS: dict = collections.defaultdict(list)


def timed(owner, name, label=None):
    """owner.name wrapped: each call's seconds appended to PARTS[label]."""
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            PARTS[label or name].append(time.perf_counter() - t)
    setattr(owner, name, wrapper)


def instrument():
    from jax_overlay import _ipc, _pack, _view
    from jax_overlay import _runtime as rt
    from jax_overlay import _xla_ext as ext
    for owner, names in ((_ipc, ("_checked_leaves", "_allocations", "_publish", "_request",
                                 "_ordinal_of", "_open_jax")),
                         (ext, ("export_fd", "record_ipc_event", "map_fd", "wait_ipc_event",
                                "raw_capsule")),
                         (rt, ("order_stream_after", "ready_stream")),
                         (_view, ("import_view",))):
        for n in names:
            timed(owner, n)
    packer, unpacker = _pack.packer, _pack.unpacker

    def packer_timed(*a):
        f = packer(*a)
        return lambda leaves: _clock("pack call (jit dispatch)", f, leaves)

    def unpacker_timed(*a):
        f = unpacker(*a)
        return lambda buf: _clock("unpack call (jit dispatch)", f, buf)
    _pack.packer, _pack.unpacker = packer_timed, unpacker_timed


def _clock(label, f, *a, **k):
    t = time.perf_counter()
    try:
        return f(*a, **k)
    finally:
        PARTS[label].append(time.perf_counter() - t)


def receiver(conn):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    import jax_overlay
    instrument()
    read = jax.jit(lambda leaves: jnp.sum(jnp.stack([x[:8] for x in leaves])))
    while True:
        h = conn.recv()
        if h is None:
            conn.send({k: v for k, v in PARTS.items()})
            return
        t0 = time.perf_counter()
        tree = _clock("open_shared", jax_overlay.open_shared, h)
        _clock("read (jit + sync)", lambda: float(read(tree)))
        PARTS["receiver total"].append(time.perf_counter() - t0)
        del tree
        conn.send(True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--arrays", type=int, default=200)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import multiprocessing as mp

    import jax
    import jax.numpy as jnp

    import jax_overlay
    instrument()
    n = a.mib * (1 << 20) // 4 // a.arrays
    params = [jnp.full((n,), float(i), jnp.float32) for i in range(a.arrays)]
    jax.block_until_ready(params)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    p = ctx.Process(target=receiver, args=(child,), daemon=True)
    p.start()
    keep = None
    for r in range(a.rounds + 2):
        if r == 2:
            PARTS.clear()  # the first two: compiles and first mappings
        t0 = time.perf_counter()
        h = _clock("share(tree, pack=True)", jax_overlay.share, params, pack=True)
        conn.send(h)
        conn.recv()
        PARTS["round trip"].append(time.perf_counter() - t0)
        keep = h  # released at the next step's, as a trainer would
    del keep
    conn.send(None)
    theirs = conn.recv()
    p.join(30)
    med = lambda v: round(statistics.median(v) * 1e6, 1)  # noqa: E731
    out = {"meta": {"gpu": os.popen("nvidia-smi --query-gpu=name --format=csv,noheader").read().strip(),
                    "jax": jax.__version__, "arrays": a.arrays, "mib": a.mib, "rounds": a.rounds},
           "trainer_us": {k: med(v) for k, v in PARTS.items()},
           "receiver_us": {k: med(v[2:]) for k, v in theirs.items() if len(v) > 2},
           "receiver_calls_per_round": {k: len(v) / (a.rounds + 2) for k, v in theirs.items()}}
    print(json.dumps(out, indent=1))
    if a.json:
        open(a.json, "w").write(json.dumps(out, indent=1))


if __name__ == "__main__":
    sys.exit(main())
