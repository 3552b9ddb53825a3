#!/usr/bin/env python3
"""The host's share of a channel step (issue 40's floor analysis): the
sender's jitted pack and the receiver's jitted unpack, dispatched and
waited for, by the number of leaves, on whatever backend JAX has.  A step
of jax_overlay.channel is these two plus one copy, two event calls and two
small socket messages, so they bound its time from below.  Leaves are
64 float32 each: the work on the device is negligible, and what is left is
jit's handling of n arguments (pack) and of n new arrays (unpack).

Beside them, jit's own floor for the same counts: a jitted call taking n
arrays and returning one ("jit n args"), and one taking one array and
returning n new ones ("jit n outs"), and a plain jnp.concatenate of the
leaves ("jit concat": the least a pack into one buffer runs); pack and
unpack at those are at JAX's floor, and only fewer arrays would go lower.

"control" is jax-free: n NumPy arrays made from one buffer (np.frombuffer
and a copy each), in every round, so host drift shows in it.  Alternating
rounds; medians.

    python benchmarks/probe_channel_host.py [--leaves 200,1000] [--rounds 7]
        [--calls 30] [--json FILE]
"""
from __future__ import annotations

import harness  # first: XLA's allocator setting, before jax loads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_overlay import _pack  # noqa: E402


def arms(n, calls):
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
    n_args = jax.jit(lambda xs: xs[0][:1])
    concat = jax.jit(jnp.concatenate)
    n_outs = jax.jit(lambda b: [jnp.broadcast_to(b[:4].view(jnp.float32), (64,)) for _ in range(n)])

    def control():
        return [np.frombuffer(raw, np.float32, 64, 256 * i).copy() for i in range(n)]
    cases = {"pack": lambda: jax.block_until_ready(pack(tree)),
             "unpack": lambda: jax.block_until_ready(unpack(packed)),
             "jit n args": lambda: jax.block_until_ready(n_args(tree)),
             "jit concat": lambda: jax.block_until_ready(concat(tree)),
             "jit n outs": lambda: jax.block_until_ready(n_outs(packed)),
             "control (no jax)": control}
    return [harness.Arm(k, lambda f=f: harness.per_call_us(f, calls), warm=f,
                        control=k.startswith("control")) for k, f in cases.items()]


def main():
    p = harness.arguments(__doc__, json_file=True, rounds=7, calls=30)
    p.add_argument("--leaves", default="200,1000")
    a = p.parse_args()
    meta = harness.meta()
    result = {"meta": meta, "us": {}}
    print(f"# a channel step's host work, µs per call (dispatch to ready), median of {a.rounds} "
          f"alternating rounds of {a.calls} calls; {meta.get('device')}, jax {jax.__version__}")
    for n in (int(s) for s in a.leaves.split(",")):
        med = {k: harness.med(v) for k, v in harness.alternate(arms(n, a.calls), a.rounds).items()}
        result["us"][str(n)] = med
        print(f"{n:5d} leaves: " + "  ".join(f"{k} {v:8.1f}" for k, v in med.items())
              + f"  | per leaf: pack {med['pack'] / n:.2f}, unpack {med['unpack'] / n:.2f}"
              + f"  | pack over jit n args {med['pack'] / med['jit n args']:.2f}x, "
              f"over jit concat {med['pack'] / med['jit concat']:.2f}x; "
              f"unpack over jit n outs {med['unpack'] / med['jit n outs']:.2f}x")
    harness.save(a.json, result)


if __name__ == "__main__":
    main()
