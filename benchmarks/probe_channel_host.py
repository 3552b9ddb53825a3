#!/usr/bin/env python3
"""The host's share of a channel step (issue 40's floor analysis): the
sender's jitted pack and the receiver's jitted unpack, dispatched and
waited for, by the number of leaves, on whatever backend JAX has.  A step
of jax_overlay.channel is these two plus one copy, two event calls and two
small socket messages, so they bound its time from below.  Leaves are
64 float32 each: the work on the device is negligible, and what is left is
jit's handling of n arguments (pack) and of n new arrays (unpack).

"control" is jax-free: n NumPy arrays made from one buffer (np.frombuffer
and a copy each), in every round, so host drift shows in it.  Alternating
rounds; medians.

    python benchmarks/probe_channel_host.py [--leaves 200,1000] [--rounds 7]
        [--calls 30] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_overlay import _pack


def per_call_us(fn, calls):
    jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / calls * 1e6


def arms(n):
    tree = [jnp.full((64,), i, jnp.float32) for i in range(n)]
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    spec, total = _pack.layout(leaves)
    pack = _pack.tree_packer(treedef, spec, total)
    unpack = _pack.tree_unpacker(treedef, spec)
    packed = pack(tree)
    got, _ = unpack(packed)
    for i in (0, n // 2, n - 1):  # the round trip is right before it is timed
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(tree[i]))
    raw = np.asarray(packed).tobytes()

    def control():
        return [np.frombuffer(raw, np.float32, 64, 256 * i).copy() for i in range(n)]
    return {"pack": lambda: pack(tree), "unpack": lambda: unpack(packed),
            "control (no jax)": control}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--leaves", default="200,1000")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--json")
    a = p.parse_args()
    dev = jax.devices()[0]
    where = getattr(dev, "device_kind", dev.platform)
    result = {"device": where, "jax": jax.__version__, "rounds": a.rounds, "calls": a.calls,
              "us": {}}
    print(f"# a channel step's host work, µs per call (dispatch to ready), median of {a.rounds} "
          f"alternating rounds of {a.calls} calls; {where}, jax {jax.__version__}")
    for n in (int(s) for s in a.leaves.split(",")):
        cases = arms(n)
        samples: dict = {k: [] for k in cases}
        for _ in range(a.rounds):
            for k, fn in cases.items():
                samples[k].append(per_call_us(fn, a.calls))
        med = {k: statistics.median(v) for k, v in samples.items()}
        result["us"][str(n)] = med
        print(f"{n:5d} leaves: " + "  ".join(f"{k} {v:8.1f}" for k, v in med.items())
              + f"  | per leaf: pack {med['pack'] / n:.2f}, unpack {med['unpack'] / n:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
