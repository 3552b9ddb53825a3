"""How XLA's command buffers treat foreign(..., replay=True), each case in
its own process (XLA reads XLA_FLAGS when its backend starts):

  count     how often fn's Python runs over 50 calls: one input, two
            alternating inputs, a fresh input each call; values checked
  timing    1K gelu+sum: foreign, foreign(replay=True), JAX native

  python benchmarks/probe_replay.py [--flags "XLA flags" ...] [--json FILE]

The correctness cases (pools, host syncs, training, memory) are tests:
tests/gpu/test_foreign_replay_gpu.py."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

N = 50


def _setup():
    import jax
    import jax.numpy as jnp
    import numpy as np
    return jax, jnp, np


def case_count():
    """fn's Python runs over 50 calls: one input, two alternating, a fresh
    one each call; values checked on every call."""
    jax, jnp, np = _setup()
    import jax_overlay
    runs: list = []

    def fn(x):
        runs.append(1)
        return x * 2 + 1
    f = jax_overlay.foreign(fn, framework="torch", replay=True, result_shape_dtypes=lambda x: x)
    g = jax.jit(lambda x: jnp.sin(f(jnp.cos(x))) + 1.0)
    want = lambda x: np.sin(np.cos(np.asarray(x)) * 2 + 1) + 1.0  # noqa: E731
    out = {}
    x = jnp.arange(1024, dtype=jnp.float32)
    y = jnp.arange(1024, dtype=jnp.float32) * 0.5
    for name, inputs in (("same", [x] * N), ("alternating", [x, y] * (N // 2)),
                         ("fresh", None)):
        del runs[:]
        wrong = 0
        for i in range(N):
            a = inputs[i] if inputs is not None else x + i
            if not np.allclose(np.asarray(g(a)), want(a), rtol=1e-5, atol=1e-5):
                wrong += 1
        out[name] = {"calls": N, "python_runs": len(runs), "wrong": wrong}
    return out


def case_timing():
    jax, jnp, np = _setup()
    import torch

    from jax_overlay import foreign
    spec = jax.ShapeDtypeStruct((), np.float32)

    def fn(x):
        return torch.nn.functional.gelu(x).sum()
    plain = foreign(fn, framework="torch", result_shape_dtypes=spec)
    rep = foreign(fn, framework="torch", result_shape_dtypes=spec, replay=True)
    cases = {"foreign": jax.jit(plain), "replayed": jax.jit(rep),
             "jax": jax.jit(lambda x: jax.nn.gelu(x, approximate=False).sum())}
    x = jnp.linspace(-1, 1, 1024, dtype=jnp.float32)
    ref = float(cases["jax"](x))
    out = {k: [] for k in cases}
    for k, f in cases.items():
        v = float(f(x))
        assert abs(v - ref) < 1e-3 * max(1, abs(ref)), (k, v, ref)
    for _ in range(5):
        for k, f in cases.items():
            for _ in range(50):
                f(x).block_until_ready()
            t = time.perf_counter()
            for _ in range(500):
                f(x).block_until_ready()
            out[k].append((time.perf_counter() - t) / 500 * 1e6)
    return {k: {"median_us": sorted(v)[len(v) // 2], "rounds": [round(u, 1) for u in v]}
            for k, v in out.items()}


CASES = {n[5:]: f for n, f in dict(globals()).items() if n.startswith("case_")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case")
    ap.add_argument("--flags", action="append", default=None)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.case:
        print("RESULT " + json.dumps(CASES[a.case]()), flush=True)
        return
    results = []
    for flags in a.flags if a.flags is not None else ["--xla_gpu_graph_min_graph_size=1", ""]:
        for case in a.cases.split(","):
            env = dict(os.environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
            t = time.perf_counter()
            try:
                p = subprocess.run([sys.executable, __file__, "--case", case], env=env,
                                   capture_output=True, text=True, timeout=120)
                got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                res = (json.loads(got[-1][7:]) if got else
                       {"rc": p.returncode, "stderr": p.stderr[-1500:]})
            except subprocess.TimeoutExpired:
                res = {"timeout": 120}
            row = {"flags": flags, "case": case, "s": round(time.perf_counter() - t, 1),
                   "result": res}
            print(json.dumps(row), flush=True)
            results.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
