"""jax_overlay.foreign against jax.pure_callback and torch2jax, same process,
alternating rounds.

The foreign op is PyTorch's gelu.  Per round, each case is timed once, in
rotating order, as end-to-end calls (dispatch to ready, one at a time):
  torch alone   gelu on a PyTorch tensor, then synchronize (jax-free: the
                control, and the floor every other case is measured against)
  foreign       jit(jax_overlay.foreign(gelu, framework="torch"))
  foreign out=True  the same op written into XLA's output (aten's gelu.out)
  foreign in place  the same, the output aliased to the input
                (input_output_aliases) and the input donated: XLA allocates
                nothing (each call's output is the next call's input)
  torch in place gelu.out over its own input, then synchronize (jax-free)
  pure_callback jit(jax.pure_callback(gelu via host copies))
  torch2jax     wrap_torch2jax.torch2jax(gelu), where it installs
  jax           jit(jax.nn.gelu), JAX's own op, for scale
Sizes: 1K float32 (per-call overhead) and 256 MiB float32 (end to end).
Reported: median over rounds of each case's µs, and per round the overhead
(case - torch alone) and the ratios, medians over rounds.

    python benchmarks/bench_foreign.py [--rounds 15] [--out DIR] [--tag -prealloc]
        [--device cpu]

writes DIR/foreign-ab{TAG}.txt and .json.  --device cpu: the same cases on
JAX's CPU backend with PyTorch's CPU tensors: no stream hand-off and no
device copy, so the callback mechanism's own cost, apart from the GPU
path's.  XLA_PYTHON_CLIENT_PREALLOCATE
defaults to false here (PyTorch shares the GPU); set it to true for XLA's
preallocated pool.  The settings are in the report's first line.
"""

from __future__ import annotations

import os
import platform

import harness  # first: XLA's allocator setting, before jax loads

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_overlay

SIZES = {"1K": (1024, 300), "256MiB": (64 << 20, 10)}  # elements, calls per timing
CONTROL = "torch alone"


def gelu(x):
    return torch.nn.functional.gelu(x)


def gelu_into(x, out):
    torch._C._nn.gelu(x, out=out)  # aten's gelu.out: the op, written into `out`


def cases(n, device):
    spec = jax.ShapeDtypeStruct((n,), jnp.float32)
    x = jax.device_put(jnp.linspace(-3, 3, n, dtype=jnp.float32), jax.devices(device)[0])
    t = torch.linspace(-3, 3, n, device="cuda" if device == "gpu" else "cpu")
    synchronize = torch.cuda.synchronize if t.is_cuda else (lambda: None)
    foreign = jax.jit(jax_overlay.foreign(gelu, framework="torch", result_shape_dtypes=spec))
    # The same gelu written straight into XLA's output buffer: no copy.
    into = jax.jit(jax_overlay.foreign(gelu_into, framework="torch", result_shape_dtypes=spec,
                                       out=True))

    def host_gelu(h):
        return gelu(torch.from_numpy(np.asarray(h)).to(t.device)).cpu().numpy()
    aliased = jax.jit(jax_overlay.foreign(gelu_into, framework="torch", result_shape_dtypes=spec,
                                          out=True, input_output_aliases={0: 0}),
                      donate_argnums=0)
    chain = [x + 0]  # a buffer of its own to donate, then each call's output
    t2 = t.clone()

    def in_place():
        chain[0] = aliased(chain[0])
        chain[0].block_until_ready()

    def torch_in_place():
        gelu_into(t2, t2)
        synchronize()
    pure = jax.jit(lambda v: jax.pure_callback(host_gelu, spec, v))
    own = jax.jit(lambda v: jax.nn.gelu(v, approximate=False))  # the same (erf) gelu

    def torch_alone():
        gelu(t)
        synchronize()
    out = {CONTROL: torch_alone,
           "foreign": lambda: foreign(x).block_until_ready(),
           "pure_callback": lambda: pure(x).block_until_ready(),
           "jax": lambda: own(x).block_until_ready()}
    try:
        import wrap_torch2jax
        t2j = wrap_torch2jax.torch2jax(gelu, t, depth=0)
        t2j(x).block_until_ready()
        out["torch2jax"] = lambda: t2j(x).block_until_ready()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["torch2jax"] = f"{type(e).__name__}: {e}"[:200]
    # The same values: foreign against torch alone.
    np.testing.assert_allclose(np.asarray(foreign(x)), gelu(t).cpu().numpy(), rtol=1e-6, atol=1e-6)
    try:
        np.testing.assert_allclose(np.asarray(into(x)), gelu(t).cpu().numpy(), rtol=1e-6, atol=1e-6)
        out["foreign out=True"] = lambda: into(x).block_until_ready()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["foreign out=True"] = f"{type(e).__name__}: {e}"[:200]
    try:  # its first call: gelu of x, in place
        in_place()
        np.testing.assert_allclose(np.asarray(chain[0]), gelu(t).cpu().numpy(), rtol=1e-6, atol=1e-6)
        out["foreign in place"] = in_place
        out["torch in place"] = torch_in_place
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["foreign in place"] = f"{type(e).__name__}: {e}"[:200]
    return out


def one_size(n, calls, rounds, device):
    made = cases(n, device)
    runnable = {k: v for k, v in made.items() if callable(v)}
    samples = harness.alternate(  # each warmed up first (compile, allocate); rotating order
        [harness.Arm(k, lambda fn=fn: harness.per_call_us(fn, calls), warm=fn, control=k == CONTROL)
         for k, fn in runnable.items()], rounds)
    base = samples[CONTROL]
    res = {"elements": n, "calls_per_timing": calls, "us": {}, "overhead_us": {},
           "ratio_to_torch_alone": {}, "unavailable": {k: v for k, v in made.items() if not callable(v)}}
    for k, ts in samples.items():
        res["us"][k] = harness.med(ts)
        res["overhead_us"][k] = harness.med(harness.differences(samples, k, CONTROL))
        res["ratio_to_torch_alone"][k] = harness.med(harness.ratios(samples, k, CONTROL))
    res["overhead_foreign_over_pure_callback"] = harness.med(harness.per_round(
        lambda f, p, b: (f - b) / (p - b), samples["foreign"], samples["pure_callback"], base))
    res["control_torch_alone_us_range"] = [min(base), max(base)]
    if "torch2jax" in samples:
        res["foreign_over_torch2jax"] = harness.med(harness.ratios(samples, "foreign", "torch2jax"))
    return res


def main():
    p = harness.arguments(__doc__, out=".", rounds=15)
    p.add_argument("--tag", default="", help="appended to the output files' names")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                   help="cpu: JAX's CPU backend and PyTorch's CPU tensors")
    args = p.parse_args()
    results = {}
    alloc = " ".join(f"{k}={v}" for k, v in harness.allocator().items())
    where = (torch.cuda.get_device_name() if args.device == "gpu"
             else f"CPU backend, {os.cpu_count()} cores")
    env = (f"{where}, jax {jax.__version__}, torch {torch.__version__}, "
           f"Python {platform.python_version()}, {alloc}")
    lines = [f"# jax_overlay.foreign vs pure_callback / torch2jax, same process, "
             f"{args.rounds} alternating rounds; {env}"]
    for size, (n, calls) in SIZES.items():
        res = results[size] = one_size(n, calls, args.rounds, args.device)
        lo, hi = res["control_torch_alone_us_range"]
        lines += [f"\n## {size} float32 ({n} elements), µs per call, median of {args.rounds} rounds",
                  harness.table(["case", "us", "overhead us", "x torch alone"], [
                      (k, f"{res['us'][k]:.1f}", f"{res['overhead_us'][k]:.1f}",
                       f"{res['ratio_to_torch_alone'][k]:.3f}") for k in res["us"]])]
        lines += [f"{k}: unavailable: {why}" for k, why in res["unavailable"].items()]
        lines.append(f"foreign overhead / pure_callback overhead: "
                     f"{res['overhead_foreign_over_pure_callback']:.3f}; control (torch alone) "
                     f"{lo:.1f}-{hi:.1f} µs across rounds")
        if "foreign_over_torch2jax" in res:
            lines.append(f"foreign / torch2jax: {res['foreign_over_torch2jax']:.3f} "
                         "(median of per-round ratios)")
    text = "\n".join(lines)
    print(text)
    harness.save(os.path.join(args.out, f"foreign-ab{args.tag}.json"),
                 {"env": env, "rounds": args.rounds, "results": results, "meta": harness.meta()})
    harness.save(os.path.join(args.out, f"foreign-ab{args.tag}.txt"), text + "\n")


if __name__ == "__main__":
    main()
