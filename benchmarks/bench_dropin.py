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

writes DIR/dropin-ab.json and DIR/dropin-ab.txt.
"""

from __future__ import annotations

import os

import harness  # first: XLA's allocator setting, before jax loads

import cupy as cp
import jax
import jax.dlpack
import jax.numpy as jnp
import torch

import jax_overlay
from _internals import cycles, spin_fill

GPU = jax.devices("cuda")[0]
N_ITEMS = 1024
BUSY_MS = 0.2
SIDES = {"stock": jax_overlay.uninstall, "installed": jax_overlay.install}

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
        torch.cuda._sleep(cycles(BUSY_MS))
    else:
        spin_fill(_spin_target, 0.0, ms=BUSY_MS)


_spin_target = cp.empty(1, cp.float32)


def time_in_flight(fn, arg, lib, calls):
    """µs per call with the producer's stream busy: the work is enqueued
    outside the timer, each call is timed alone."""
    total = 0
    for _ in range(calls):
        _busy(lib)
        t0 = harness.clock()
        fn(arg)
        total += harness.clock() - t0
    cp.cuda.Device().synchronize()
    torch.cuda.synchronize()
    return total / calls / 1e3


def cases(src):
    """name -> (kind, fn, arg, lib): the cases, each timed on both sides."""
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
    """One timing of a case (µs per call); stock refuses some (PyTorch's
    read-only CAI): the harness records the failure."""
    try:
        if kind == "idle":
            return harness.per_call_us(fn, calls, arg)  # results dropped, as a caller would
        return time_in_flight(fn, arg, lib, max(calls // 4, 10))
    finally:
        _KEEP.clear()  # the held results, freed outside the timer


def arms(table, controls, calls):
    out = [harness.Arm(name, lambda f=f: harness.per_call_us(f, calls), control=True)
           for name, f in controls.items()]
    for name, case in table.items():
        for side, setup in SIDES.items():
            out.append(harness.Arm((name, side), lambda case=case: run_case(*case, calls), setup=setup,
                                   warm=lambda case=case: run_case(*case, 20)))
    return out


def main():
    args = harness.arguments(__doc__, out=".", rounds=15, calls=200).parse_args()
    src = {"cupy": cp.arange(N_ITEMS, dtype=cp.float32),
           "torch": torch.arange(N_ITEMS, dtype=torch.float32, device="cuda")}
    table = cases(src)
    controls = {"control torch.from_dlpack(cupy)": lambda: torch.from_dlpack(src["cupy"]),
                "control cupy.asarray(torch)": lambda: cp.asarray(src["torch"])}
    timed = arms(table, controls, args.calls)
    try:
        samples = harness.alternate(timed, args.rounds,
                                    lambda r: harness.paired(table, SIDES, r, controls),
                                    record_failures=True)
    finally:
        jax_overlay.uninstall()

    rows = []
    for name in table:
        ratio = harness.ratios(samples, (name, "installed"), (name, "stock"))
        rows.append({"case": name, "stock_us": harness.med(samples[(name, "stock")]),
                     "installed_us": harness.med(samples[(name, "installed")]),
                     "ratio": harness.med(ratio), "ratio_min": min(ratio, default=None),
                     "ratio_max": max(ratio, default=None)})
    ctl = {name: {"median_us": s["median"], "min_us": s["min"], "max_us": s["max"]}
           for name, s in harness.drift(timed, samples).items()}
    meta = harness.meta(device=str(GPU.device_kind), rounds=args.rounds, calls=args.calls,
                        items=N_ITEMS, busy_ms=BUSY_MS)
    text = "\n".join([
        f"# stock vs install(), same process, {args.rounds} alternating rounds; {meta['device']}, "
        f"jax {meta['jax']}, cupy {meta['cupy']}, torch {meta['torch']}; ratio: median over rounds "
        "of installed / stock within the round (min-max)",
        harness.table(["case", "stock us", "installed us", "ratio", "(min-max)"], [
            (r["case"], harness.cell(r["stock_us"], ".2f")[:40], harness.cell(r["installed_us"], ".2f")[:40],
             harness.cell(r["ratio"], ".2f") if r["ratio"] is not None else "n/a",
             f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f})" if r["ratio"] is not None else "")
            for r in rows]),
        *(f"{name}: median {c['median_us']:.2f} us, rounds {c['min_us']:.2f}-{c['max_us']:.2f}"
          for name, c in ctl.items())])
    print(text)
    harness.save(os.path.join(args.out, "dropin-ab.json"), {"meta": meta, "rows": rows, "controls": ctl})
    harness.save(os.path.join(args.out, "dropin-ab.txt"), text + "\n")


if __name__ == "__main__":
    main()
