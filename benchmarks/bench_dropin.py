"""Stock JAX against jax_overlay.install(), same process, alternating rounds.

Each round times every case once stock (uninstall()) and once installed
(install()), in alternating order, plus jax-free control calls
(torch.from_dlpack of a CuPy array, cupy.asarray of a PyTorch tensor) that
show how much the host drifts between rounds.  Reported per case: the median
over rounds of installed/stock (each round's ratio taken within the round),
and the median µs of each side, for the floor analysis only.

Imports: jnp.asarray, jnp.array, jax.device_put, jax.dlpack.from_dlpack and
jnp.from_dlpack of a CuPy array and of a PyTorch tensor (4 KiB float32),
idle (producer stream empty) and in flight (a 0.2 ms kernel enqueued on the
producer's current stream just before each call, outside the timer: stock's
DLPack import waits for it on the host, ours never does).  Exports: CuPy
and PyTorch reading a ready JAX array through __cuda_array_interface__ and
__dlpack__, and Numba through __cuda_array_interface__.  "split" rows take
jnp.array apart: jnp.asarray with its result held (against the dropped one,
the price of freeing an import) and JAX's copy of a view the side imported
once and holds.

    python benchmarks/bench_dropin.py [--rounds 15] [--calls 200] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy as cp  # noqa: E402
import jax  # noqa: E402
import jax.dlpack  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import jax_overlay  # noqa: E402
from jax_overlay import _producers  # noqa: E402

GPU = jax.devices("cuda")[0]
N_ITEMS = 1024
BUSY_MS = 0.2

ENTRIES = {
    "jnp.asarray": lambda a: jnp.asarray(a),
    "jnp.array": lambda a: jnp.array(a),
    "jax.device_put": lambda a: jax.device_put(a, GPU),
    "jax.dlpack.from_dlpack": lambda a: jax.dlpack.from_dlpack(a),
    "jnp.from_dlpack": lambda a: jnp.from_dlpack(a),
}


# Where jnp.array's time goes (its copy is JAX's on both sides), split into
# parts a side pays: an import whose result is held (no free inside the
# timer) against the dropped one above, and JAX's copy of a view that side
# imported once and holds.
_KEEP: list = []
_HELD_VIEWS: dict = {}


def _import_held(a):
    _KEEP.append(jnp.asarray(a))  # freed after the timing (run_case)


def _copy_of_held_view(a):
    key = (jax_overlay.installed(), id(a))
    view = _HELD_VIEWS.get(key)
    if view is None:  # this side's own import, made once
        view = _HELD_VIEWS[key] = jnp.asarray(a).block_until_ready()
    return jnp.array(view)


SPLITS = {"jnp.asarray, result held": _import_held,
          "jnp.array of a held import (JAX's copy)": _copy_of_held_view}


def _busy(lib):
    """Enqueues BUSY_MS of GPU work on the producer's current stream."""
    if lib == "torch":
        torch.cuda._sleep(_producers.cycles(BUSY_MS))
    else:
        _producers.spin_fill(_spin_target, 0.0, ms=BUSY_MS)


_spin_target = cp.empty(1, cp.float32)


def _sources():
    return {"cupy": cp.arange(N_ITEMS, dtype=cp.float32),
            "torch": torch.arange(N_ITEMS, dtype=torch.float32, device="cuda")}


def time_idle(fn, arg, calls):
    """µs per call of fn(arg), `calls` calls back to back; results dropped
    inside the loop, as a caller would."""
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn(arg)
    return (time.perf_counter_ns() - t0) / calls / 1e3


def time_in_flight(fn, arg, lib, calls):
    """µs per call with the producer's stream busy: the work is enqueued
    outside the timer, each call is timed alone."""
    total = 0
    for _ in range(calls):
        _busy(lib)
        t0 = time.perf_counter_ns()
        fn(arg)
        total += time.perf_counter_ns() - t0
    cp.cuda.Device().synchronize()
    torch.cuda.synchronize()
    return total / calls / 1e3


def cases(src):
    x = jnp.arange(N_ITEMS, dtype=jnp.float32, device=GPU).block_until_ready()
    out = {}
    for lib, a in src.items():
        for name, fn in ENTRIES.items():
            out[f"import {lib} {name} idle"] = ("idle", fn, a, lib)
            out[f"import {lib} {name} in flight"] = ("flight", fn, a, lib)
        for name, fn in SPLITS.items():
            out[f"split {lib} {name}"] = ("idle", fn, a, lib)
    out["export cupy.asarray (CAI)"] = ("idle", cp.asarray, x, None)
    out["export cupy.from_dlpack"] = ("idle", cp.from_dlpack, x, None)
    out["export torch.from_dlpack"] = ("idle", torch.from_dlpack, x, None)
    out["export torch.as_tensor (CAI)"] = ("idle", lambda v: torch.as_tensor(v, device="cuda"), x, None)
    try:  # Numba reads the CAI (its device arrays have no DLPack import here)
        from numba import cuda
        out["export numba.cuda.as_cuda_array (CAI)"] = ("idle", cuda.as_cuda_array, x, None)
    except ImportError:
        pass
    return out


def run_case(kind, fn, arg, lib, calls):
    try:
        if kind == "idle":
            return time_idle(fn, arg, calls)
        return time_in_flight(fn, arg, lib, max(calls // 4, 10))
    except Exception as e:  # stock refuses some (PyTorch's read-only CAI)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    finally:
        _KEEP.clear()  # the held results, freed outside the timer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    src = _sources()
    table = cases(src)
    controls = {"control torch.from_dlpack(cupy)": lambda: torch.from_dlpack(src["cupy"]),
                "control cupy.asarray(torch)": lambda: cp.asarray(src["torch"])}
    samples = {name: {"stock": [], "installed": [], "ratio": []} for name in table}
    control = {name: [] for name in controls}
    for name, (kind, fn, arg, lib) in table.items():  # warm both sides
        for side in (jax_overlay.uninstall, jax_overlay.install):
            side()
            run_case(kind, fn, arg, lib, 20)
    for r in range(args.rounds):
        for name, f in controls.items():
            control[name].append(time_idle(lambda _: f(), None, args.calls))
        for name, (kind, fn, arg, lib) in table.items():
            # Alternate which side goes first, so neither always runs warm.
            order = ("stock", "installed") if r % 2 == 0 else ("installed", "stock")
            got = {}
            for side in order:
                (jax_overlay.uninstall if side == "stock" else jax_overlay.install)()
                got[side] = run_case(kind, fn, arg, lib, args.calls)
            for side in order:
                samples[name][side].append(got[side])
            if all(isinstance(v, float) for v in got.values()):
                samples[name]["ratio"].append(got["installed"] / got["stock"])
    jax_overlay.uninstall()

    rows = []
    for name, s in samples.items():
        def med(xs):
            nums = [v for v in xs if isinstance(v, float)]
            return statistics.median(nums) if nums else next(iter(xs), None)
        rows.append({"case": name, "stock_us": med(s["stock"]), "installed_us": med(s["installed"]),
                     "ratio": statistics.median(s["ratio"]) if s["ratio"] else None,
                     "ratio_min": min(s["ratio"]) if s["ratio"] else None,
                     "ratio_max": max(s["ratio"]) if s["ratio"] else None})
    ctl = {name: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v)}
           for name, v in control.items()}
    meta = {"device": str(GPU.device_kind), "jax": jax.__version__, "cupy": cp.__version__,
            "torch": torch.__version__, "python": platform.python_version(),
            "rounds": args.rounds, "calls": args.calls, "items": N_ITEMS, "busy_ms": BUSY_MS}
    lines = [f"# stock vs install(), same process, {args.rounds} alternating rounds; "
             f"{meta['device']}, jax {meta['jax']}, cupy {meta['cupy']}, torch {meta['torch']}",
             f"{'case':<52} {'stock us':>10} {'installed us':>13} {'ratio':>7}  (min-max)"]
    for row in rows:
        def fmt(v):
            return f"{v:10.2f}" if isinstance(v, float) else f"{str(v)[:40]:>10}"
        ratio = (f"{row['ratio']:7.2f}  ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
                 if row["ratio"] is not None else "    n/a")
        lines.append(f"{row['case']:<52} {fmt(row['stock_us'])} {fmt(row['installed_us']):>13} {ratio}")
    for name, c in ctl.items():
        lines.append(f"{name:<52} median {c['median_us']:.2f} us, rounds {c['min_us']:.2f}-{c['max_us']:.2f}")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dropin-ab.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "controls": ctl}, f, indent=1)
    with open(os.path.join(args.out, "dropin-ab.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
