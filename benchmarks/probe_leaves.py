"""A foreign call's cost per input leaf: fn returns its first input and
does nothing else, so the time over a plain jit is the call's own work
(views, tokens, the stream context, the output copy), and its growth with
the number of inputs is what each further leaf costs.  Same process,
alternating rounds, end to end (dispatch to ready); "jit" is the same
program without a callback.

  --backend cpu-torch   framework "torch" on the CPU backend (CPU tensors)
  --backend cpu         framework "numpy" on the CPU backend
  --backend gpu         framework "torch" on the GPU

    python benchmarks/probe_leaves.py [--backend cpu-torch] [--rounds 7] [--calls 1000]
        [--out DIR]
writes DIR/foreign-leaves-BACKEND.txt and .json.
"""

from __future__ import annotations

import os

import harness  # first: XLA's allocator setting, before jax loads

import jax
import jax.numpy as jnp

import jax_overlay

LEAVES = (1, 2, 5, 8)


def main():
    p = harness.arguments(__doc__, out=".", rounds=7, calls=1000)
    p.add_argument("--backend", default="cpu-torch", choices=("cpu-torch", "cpu", "gpu"))
    args = p.parse_args()
    device = jax.devices("gpu" if args.backend == "gpu" else "cpu")[0]
    framework = "numpy" if args.backend == "cpu" else "torch"
    xs = [jax.device_put(jnp.full(1024, i, jnp.float32), device) for i in range(max(LEAVES))]
    f = jax_overlay.foreign(lambda *a: a[0], framework=framework,
                            result_shape_dtypes=lambda *a: a[0])
    arms = {}
    for n in LEAVES:
        g = jax.jit(lambda *a: f(*a) + 0.0)
        arms[f"foreign, {n} inputs"] = (lambda g=g, n=n: g(*xs[:n]).block_until_ready())
    plain = jax.jit(lambda *a: a[0] + 0.0)
    arms["jit"] = lambda: plain(xs[0]).block_until_ready()
    samples = harness.alternate(
        [harness.Arm(k, lambda fn=fn: harness.per_call_us(fn, args.calls), warm=fn)
         for k, fn in arms.items()], args.rounds)
    us = {k: harness.med(v) for k, v in samples.items()}
    over = {k: harness.med(harness.differences(samples, k, "jit")) for k in samples if k != "jit"}
    one = "foreign, 1 inputs"
    per_leaf = {k: (over[k] - over[one]) / (n - 1)
                for n, k in ((n, f"foreign, {n} inputs") for n in LEAVES) if n > 1}
    x_one = {k: harness.med(harness.ratios(samples, k, one)) for k in over}
    meta = harness.meta(imports=("torch",))
    text = "\n".join([
        f"# foreign call cost per input leaf, {args.backend}, µs per call, {args.rounds} "
        f"alternating rounds of {args.calls}; {meta.get('device')}, jax {jax.__version__}",
        harness.table(["case", "us", "over jit", "x 1 input", "per further leaf"], [
            (k, f"{us[k]:.1f}", f"{over.get(k, 0):.1f}" if k != "jit" else "",
             f"{x_one[k]:.3f}" if k in x_one else "",
             f"{per_leaf[k]:.2f}" if k in per_leaf else "") for k in us])])
    print(text)
    name = f"foreign-leaves-{args.backend}"
    harness.save(os.path.join(args.out, name + ".json"),
                 {"results": {"us": us, "over_jit": over, "per_further_leaf": per_leaf,
                              "x_one_input": x_one, "samples": samples}, "meta": meta})
    harness.save(os.path.join(args.out, name + ".txt"), text + "\n")


if __name__ == "__main__":
    main()
