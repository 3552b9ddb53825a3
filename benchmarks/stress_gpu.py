"""GPU stress of every interchange path: randomized, seeded trials of import
and export with work still in flight and memory pools reused, counting stale
reads and corruption.  Run on a GPU machine (CuPy; PyTorch and numba-cuda
where installed) after `python setup.py build_ext --inplace`:

    python benchmarks/stress_gpu.py [--trials 10000] [--seed 0] [--json out.json]

Each trial draws a dtype, a size, a layout, a producer (CuPy, PyTorch or
Numba memory), a stream (legacy, per-thread or the producer's own) and a
duration for the work in flight (0 to 2 ms of GPU time), then:

* import paths (from_cuda_array_interface, installed jnp.asarray on a CAI
  object, from_dlpack / installed jnp.asarray / jax.dlpack.from_dlpack on
  the producer itself): the producer's buffer is filled with Z, its stream is
  kept busy, then filled with V, and JAX imports it while that may still
  run.  The producer object is dropped at once and a new buffer of the same
  size is allocated from the same pool on the same stream and filled with W:
  if JAX did not keep the producer alive, that block is the one it views.
  JAX then checks on the GPU that every element is V (Z seen: a stale read;
  W seen: the pool reused memory JAX still used; anything else: corruption).
* export paths (CAI to CuPy and PyTorch, DLPack to PyTorch and CuPy): a
  jitted computation queued behind a spin kernel on XLA's compute stream
  (so it is still pending for the trial's duration) produces V; the consumer takes
  it on its stream, the JAX array is dropped at once and a new JAX array
  of the same size is filled with W (XLA's allocator would hand out the
  same block if the export had not held it); the consumer checks on its
  stream that every element is V.

Checks stay on the GPU: one host transfer per batch of trials.  Controls
with ordering switched off show the detector sees stale reads when they
happen.  Work on each stream is enqueued with CuPy kernels on that stream's
handle, so every producer library's memory and streams are exercised with
the same kernels (numba-cuda cannot compile kernels under NumPy 2.5).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:  # loaded by its path too (tests/): its helpers sit beside it
    sys.path.append(HERE)

import harness  # noqa: E402 - first: XLA's allocator setting, before jax loads

# What a trial can draw.  Values are small integers, exact in every dtype
# (int8 and bfloat16 included), and never equal across roles.
SIZES = [1, 7, 256, 4099, 65536, 1 << 20, 3 << 20]
DTYPES = ["float32", "float16", "bfloat16", "int32", "int8", "uint8", "float64", "int64"]
LAYOUTS = ["contiguous"] * 17 + ["strided", "strided", "transposed"]
DURATIONS_MS = [0.0] * 5 + [0.02] * 5 + [0.1] * 5 + [0.5] * 4 + [2.0]
Z, V_RANGE, W_RANGE = 0, (1, 60), (61, 120)  # stale / fresh / reused values
OK, STALE, REUSED, OTHER = 0, 1, 2, 3
OUTCOMES = {OK: "ok", STALE: "stale", REUSED: "reused", OTHER: "other"}

IMPORT_PATHS = ["cai_import", "cai_asarray", "dlpack_import"]
EXPORT_PATHS = ["cai_export_cupy", "cai_export_torch", "dlpack_export_torch",
                "dlpack_export_cupy"]
PATHS = IMPORT_PATHS + EXPORT_PATHS


# --- pure planning and reporting (no GPU; exercised on the CPU too) --------

def producers_for(path, have):
    """Producers (import) or consumers (export) a path can use, given the
    libraries present (`have`: a set of 'cupy', 'torch', 'numba',
    'numba_dlpack')."""
    if path in ("cai_import", "cai_asarray"):
        want = ["cupy", "torch", "numba"]
    elif path == "dlpack_import":
        want = ["cupy", "torch"] + (["numba"] if "numba_dlpack" in have else [])
    elif path.endswith("_torch"):
        want = ["torch"]
    else:
        want = ["cupy"]
    return [p for p in want if p in have]


def streams_for(lib):
    """PyTorch has no per-thread default stream of its own."""
    return ["legacy", "user"] if lib == "torch" else ["legacy", "per_thread", "user"]


def dtypes_for(lib, path):
    """CuPy and Numba have no bfloat16, and the CAI cannot name it (PyTorch
    writes typestr '<V2', which the import rightly refuses): bfloat16 is
    drawn for PyTorch on the DLPack paths only."""
    if lib == "torch" and path.startswith("dlpack"):
        return DTYPES
    return [d for d in DTYPES if d != "bfloat16"]


def plan(path, trials, seed, have):
    """The trials of one path: a list of dicts, the same for the same seed."""
    rng = random.Random(f"{seed}:{path}")
    libs = producers_for(path, have)
    if not libs:
        return []
    out = []
    for i in range(trials):
        lib = rng.choice(libs)
        out.append({
            "lib": lib,
            "stream": rng.choice(streams_for(lib)),
            "dtype": rng.choice(dtypes_for(lib, path)),
            "size": rng.choice(SIZES),
            "layout": rng.choice(LAYOUTS),
            "ms": rng.choice(DURATIONS_MS),
            "v": rng.randint(*V_RANGE),
            "w": rng.randint(*W_RANGE),
            # the installed import APIs take turns on the DLPack path
            "api": rng.choice(["from_dlpack", "asarray", "jax.dlpack"]),
        })
    return out


def summarize(path, trials, codes, busy, seconds):
    """Counts for one path: outcomes overall, by producer and by stream, and
    how many trials had work in flight at the moment of the interchange."""
    assert len(trials) == len(codes) == len(busy)
    total = collections.Counter(OUTCOMES[int(c)] for c in codes)
    by = collections.defaultdict(collections.Counter)
    for t, c in zip(trials, codes):
        by[f"{t['lib']}/{t['stream']}"][OUTCOMES[int(c)]] += 1
    bad = [dict(t, outcome=OUTCOMES[int(c)], in_flight=bool(b), index=i)
           for i, (t, c, b) in enumerate(zip(trials, codes, busy)) if int(c) != OK]
    return {
        "trials": len(trials),
        **{name: total.get(name, 0) for name in OUTCOMES.values()},
        "in_flight": int(sum(busy)),
        "seconds": round(seconds, 2),
        "by_producer_stream": {k: dict(v) for k, v in sorted(by.items())},
        "bad_trials": bad[:100],  # what each failing trial drew, to replay it
    }


def table(report):
    return harness.table(["path", "trials", "in flight", "stale", "reused", "other", "s"], [
        (name, r["trials"], r["in_flight"], r["stale"], r["reused"], r["other"], r["seconds"])
        for name, r in list(report["paths"].items()) + list(report["controls"].items())])


# --- the GPU side ----------------------------------------------------------

class Gpu:
    """Libraries, streams and kernels for the trials."""

    def __init__(self):
        import cupy as cp
        import jax
        import jax.numpy as jnp
        import ml_dtypes
        import numpy as np

        sys.path.insert(0, ROOT)
        import jax_overlay
        from _internals import _runtime, cupy_stream, spin_fill

        self.x64 = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", True)  # int64/float64 stay 64-bit
        self.cp, self.jax, self.jnp, self.np = cp, jax, jnp, np
        self.ml_dtypes, self.jax_overlay, self.spin_fill = ml_dtypes, jax_overlay, spin_fill
        self.rt = _runtime
        self.cupy_stream = cupy_stream
        self.have = {"cupy"}
        try:
            import torch
            self.torch = torch
            self.have.add("torch")
        except ImportError:
            self.torch = None
        try:
            from numba import cuda as numba_cuda
            numba_cuda.current_context()
            self.numba = numba_cuda
            self.have.add("numba")
            probe = numba_cuda.device_array(1, np.float32)
            if hasattr(probe, "__dlpack__"):
                self.have.add("numba_dlpack")
        except Exception:  # noqa: BLE001 - absent or unusable: not drawn
            self.numba = None
        self._streams = {}
        self._dummy = {}
        self._check = jax.jit(self._jax_code)
        self._make = jax.jit(self._fill_value, static_argnames=("size", "dtype"))
        self.device = jax.devices()[0]
        self._hold = cp.empty(1, cp.float32)

    # streams: (handle for the CAI, CuPy stream on that handle, library's own)
    def stream(self, lib, kind):
        key = (lib, kind)
        if key not in self._streams:
            cp = self.cp
            own = None
            if kind == "legacy":
                handle, cps = 1, cp.cuda.Stream.null
            elif kind == "per_thread":
                handle, cps = 2, cp.cuda.Stream.ptds
            elif lib == "torch":
                own = self.torch.cuda.Stream()
                handle = own.cuda_stream
                cps = self.cupy_stream(cp, handle)
            elif lib == "numba":
                own = self.numba.stream()
                handle = own.handle.value if hasattr(own.handle, "value") else int(own.handle)
                cps = self.cupy_stream(cp, handle)
            else:
                own = cps = cp.cuda.Stream(non_blocking=True)
                handle = cps.ptr
            if own is None and lib == "torch":
                own = self.torch.cuda.default_stream()
            self._streams[key] = (handle, cps, own)
            self._dummy[key] = cp.empty(1, cp.float32)
        return self._streams[key]

    def np_dtype(self, name):
        return self.np.dtype(getattr(self.ml_dtypes, name) if name == "bfloat16" else name)

    def bits(self, value, dtype):
        """`value` in `dtype`, as the same-width unsigned int CuPy can fill."""
        np = self.np
        return int(np.array(value, dtype).view(np.dtype(f"u{dtype.itemsize}")))

    def fill(self, ptr, n, dtype, value, cps, owner):
        """Enqueues buffer[:n] = value on `cps`, through a raw alias (a CAI
        alias would make CuPy synchronize with the producer's stream)."""
        cp = self.cp
        mem = cp.cuda.UnownedMemory(ptr, n * dtype.itemsize, owner)
        alias = cp.ndarray((n,), cp.dtype(f"u{dtype.itemsize}"), cp.cuda.MemoryPointer(mem, 0))
        with cps:
            alias.fill(self.bits(value, dtype))

    def alloc(self, lib, n, dtype, kind):
        """(object, data pointer) of a fresh buffer from the library's pool,
        associated with the trial's stream where the library has that notion."""
        handle, cps, own = self.stream(lib, kind)
        if lib == "cupy":
            with cps:
                a = self.cp.empty(n, dtype=dtype)
            return a, a.data.ptr
        if lib == "torch":
            torch = self.torch
            tdt = getattr(torch, dtype.name)
            with torch.cuda.stream(own):
                t = torch.empty(n, dtype=tdt, device="cuda")
            return t, t.data_ptr()
        d = self.numba.device_array(n, dtype=dtype)
        return d, d.__cuda_array_interface__["data"][0]

    def view(self, lib, base, layout, n):
        if layout == "strided":
            return base[::2]
        if layout == "transposed" and n >= 8:
            rows = n // 4
            v = base[: rows * 4].reshape(rows, 4)
            if lib == "torch":
                return v.t()
            if lib == "numba":
                # Numba's .T launches a copy kernel; this is the view.
                from numba.cuda.cudadrv.devicearray import DeviceNDArray
                return DeviceNDArray((4, rows), v.strides[::-1], v.dtype, gpu_data=v.gpu_data)
            return v.T
        return base

    def spin(self, lib, kind, ms):
        if ms > 0:
            _, cps, _ = self.stream(lib, kind)
            self.spin_fill(self._dummy[(lib, kind)], 0.0, ms=ms, stream=cps)

    # JAX's check of an imported array: one int8 code per trial, on the GPU.
    @staticmethod
    def _jax_code(x, v, z, w):
        import jax.numpy as jnp
        x = x.reshape(-1)
        return jnp.where(jnp.all(x == v), OK, jnp.where(
            jnp.any(x == z), STALE, jnp.where(jnp.any(x == w), REUSED, OTHER))).astype(jnp.int8)

    # The exported array: V everywhere, computed by XLA.
    @staticmethod
    def _fill_value(v, *, size, dtype):
        import jax.numpy as jnp
        return jnp.full((size,), v, dtype)

    def hold_compute_stream(self, ms):
        """Keeps XLA's compute stream busy for about `ms`: work dispatched
        next stays pending that long.  (A long loop inside the computation
        sometimes ran within the dispatch call; a spin kernel ahead of it on
        the same stream cannot.)"""
        if ms > 0:
            held = self.cupy_stream(self.cp, self.rt.compute_stream(self.device))
            self.spin_fill(self._hold, 0.0, ms=ms, stream=held)

    # --- one batch of trials per path ------------------------------------

    def import_trials(self, path, trials, ordered=True):
        """Codes and in-flight flags of import trials (`ordered=False`: the
        control, the CAI stream dropped)."""
        from _cai import WithStream
        jax, jnp, overlay = self.jax, self.jnp, self.jax_overlay
        codes, busy, keep = [], [], []
        for t in trials:
            dtype = self.np_dtype(t["dtype"])
            n = t["size"] * (2 if t["layout"] == "strided" else 1)
            handle, cps, own = self.stream(t["lib"], t["stream"])
            base, ptr = self.alloc(t["lib"], n, dtype, t["stream"])
            self.fill(ptr, n, dtype, Z, cps, base)
            self.spin(t["lib"], t["stream"], t["ms"])
            self.fill(ptr, n, dtype, t["v"], cps, base)
            obj = self.view(t["lib"], base, t["layout"], n)
            cai = None
            busy.append(not cps.done)
            if path == "dlpack_import":
                x = self._dlpack_import(t, obj, cps, own)
            else:
                cai = WithStream(obj, handle if ordered else None)
                x = (overlay.from_cuda_array_interface(cai) if path == "cai_import"
                     else jnp.asarray(cai))
            # The producer goes now: only JAX's hold keeps its block.  A new
            # buffer of the same size on the same stream would get it back.
            del obj, base, cai
            reuse, rptr = self.alloc(t["lib"], n, dtype, t["stream"])
            self.fill(rptr, n, dtype, t["w"], cps, reuse)
            codes.append(self._check(x, t["v"], Z, t["w"]))
            del x
            keep.append(reuse)
        out = self.np.asarray(jax.device_get(jnp.stack(codes)))
        cps_all = {self.stream(t["lib"], t["stream"])[1] for t in trials}
        for s in cps_all:
            s.synchronize()
        del keep
        return list(out), busy

    def _dlpack_import(self, t, obj, cps, own):
        """The producer's current stream is where its work is: __dlpack__
        orders the consumer after it."""
        overlay, jnp = self.jax_overlay, self.jnp
        call = {"from_dlpack": overlay.from_dlpack, "asarray": jnp.asarray,
                "jax.dlpack": self.jax.dlpack.from_dlpack}[t["api"]]
        if t["lib"] == "torch":
            with self.torch.cuda.stream(own):
                return call(obj)
        with cps:
            return call(obj)

    def export_trials(self, path, trials, ordered=True):
        """Codes and in-flight flags of export trials (`ordered=False`: the
        control, config.cai_sync off)."""
        cp, overlay = self.cp, self.jax_overlay
        codes, busy, keep = [], [], []
        saved = overlay.config.cai_sync
        overlay.config.cai_sync = ordered
        try:
            for t in trials:
                dtype = self.np_dtype(t["dtype"])
                n = t["size"]
                self.hold_compute_stream(t["ms"])
                x = self._make(t["v"], size=n, dtype=dtype)
                if t["layout"] == "transposed" and n % 4 == 0 and n >= 8:
                    x = x.reshape(n // 4, 4)  # a 2-D export (JAX arrays are row-major)
                busy.append(not x.is_ready())
                view, consumer_stream = self._consume(path, t, x)
                del x  # only the consumer's hold keeps the buffer now
                reuse = self._make(t["w"], size=n, dtype=dtype)  # same executable
                codes.append(self._consumer_code(path, view, t, consumer_stream))
                keep.append((view, reuse))
            # Each code was computed on its consumer's stream; the stack below
            # runs on the default stream, which a non-blocking stream does not
            # order: without this wait the last trials of a batch were read
            # before their codes existed (seen as "stale" on user streams only).
            self.cp.cuda.Device().synchronize()
            if path.endswith("_cupy"):
                out = cp.stack(codes).get()
            else:
                out = self.torch.stack(codes).cpu().numpy()
            self.cp.cuda.Device().synchronize()
        finally:
            overlay.config.cai_sync = saved
        del keep
        return list(out), busy

    def _consume(self, path, t, x):
        """(consumer's view of x, the stream it reads on)."""
        cp, overlay = self.cp, self.jax_overlay
        if path.endswith("_cupy"):
            _, cps, _ = self.stream("cupy", t["stream"])
            with cps:
                c = cp.asarray(x) if path.startswith("cai") else cp.from_dlpack(x)
            return c, cps
        torch = self.torch
        _, _, own = self.stream("torch", t["stream"])
        with torch.cuda.stream(own):
            if path.startswith("dlpack"):
                return torch.from_dlpack(x), own
            if t["stream"] == "legacy":
                # PyTorch ignores the CAI stream and reads on its current
                # stream: the default (legacy) one is what the export orders.
                return torch.as_tensor(x, device="cuda"), own
            # On its own stream it needs the stream named in the export.
            return torch.as_tensor(_Cai(x, overlay.cuda_array_interface(
                x, stream=own.cuda_stream)), device="cuda"), own

    def _consumer_code(self, path, view, t, stream):
        v, w = t["v"], t["w"]
        if path.endswith("_cupy"):
            cp = self.cp
            with stream:
                flat = view.reshape(-1)
                return cp.where((flat == v).all(), OK, cp.where(
                    (flat == w).any(), REUSED, STALE)).astype(cp.int8)
        torch = self.torch
        with torch.cuda.stream(stream):
            flat = view.reshape(-1)
            return torch.where((flat == v).all(), OK, torch.where(
                (flat == w).any(), REUSED, STALE)).to(torch.int8)


class _Cai:
    """A CAI dict with a chosen stream, holding the exported JAX array."""

    def __init__(self, x, cai):
        self.x, self.__cuda_array_interface__ = x, cai


def run(trials=10_000, seed=0, batch=200, paths=None, controls=200, log=print, save=None,
        deadline=None):
    """The report; `save(report)` is called after every batch, so a run cut
    short keeps what it finished.  `deadline` (a time.perf_counter() value):
    no batch starts after it; a path cut short reports the trials it ran."""
    gpu = Gpu()
    gpu.jax_overlay.install()
    report = {"seed": seed, "batch": batch, "paths": {}, "controls": {}, "errors": {},
              "have": sorted(gpu.have)}
    try:
        for path in paths or PATHS:
            todo = plan(path, trials, seed, gpu.have)
            if not todo:
                log(f"{path}: skipped (no producer library for it)")
                continue
            try:
                def partial(r, path=path):
                    report["paths"][path] = r
                    if save:
                        save(report)
                report["paths"][path] = _run_path(gpu, path, todo, batch, True,
                                                  on_batch=partial, deadline=deadline)
            except Exception:  # noqa: BLE001 - reported, fails the run, others still run
                report["errors"][path] = traceback.format_exc()
                log(f"{path}: ERROR\n{report['errors'][path]}")
                continue
            log(f"{path}: {json.dumps({k: v for k, v in report['paths'][path].items() if k not in ('by_producer_stream', 'bad_trials')})}")
            if save:
                save(report)
        # Controls: ordering off, so the same checks must see stale reads.
        for name, path in [("control_cai_import_unordered", "cai_import"),
                           ("control_cai_export_sync_off", "cai_export_cupy")]:
            if controls and (paths is None or path in paths):
                todo = [dict(t, ms=1.0, layout="contiguous", size=1 << 20, stream="user")
                        for t in plan(path, controls, seed + 1, gpu.have)]
                report["controls"][name] = _run_path(gpu, path, todo, batch, False)
                r = report["controls"][name]
                log(f"{name}: {r['trials'] - r['ok']} of {r['trials']} reads not V "
                    "(must be > 0: the detector works)")
                if save:
                    save(report)
    finally:
        gpu.jax_overlay.uninstall()
        gpu.jax.config.update("jax_enable_x64", gpu.x64)
    return report


def _run_path(gpu, path, todo, batch, ordered, on_batch=None, deadline=None):
    t0 = time.perf_counter()
    codes, busy = [], []
    for i in range(0, len(todo), batch):
        if deadline is not None and time.perf_counter() > deadline:
            todo = todo[:i]
            break
        chunk = todo[i:i + batch]
        if path in IMPORT_PATHS:
            c, b = gpu.import_trials(path, chunk, ordered)
        else:
            c, b = gpu.export_trials(path, chunk, ordered)
        codes += c
        busy += b
        if on_batch is not None:
            on_batch(summarize(path, todo[:len(codes)], codes, busy, time.perf_counter() - t0))
    return summarize(path, todo, codes, busy, time.perf_counter() - t0)


def versions():
    return harness.meta(imports=("jax", "jaxlib", "cupy", "torch", "numba", "numba_cuda"),
                        machine=platform.node())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10_000, help="trials per path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=200, help="trials per host transfer")
    p.add_argument("--controls", type=int, default=200, help="trials per control")
    p.add_argument("--paths", help=f"comma-separated subset of {','.join(PATHS)}")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--seconds", type=float,
                   help="start no batch after this many seconds; a path cut short "
                        "reports the trials it ran")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    meta = {"versions": versions(), "trials_per_path": args.trials}

    def save(partial):
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**partial, **meta, "complete": False}, f, indent=1)
    report = run(args.trials, args.seed, args.batch,
                 args.paths.split(",") if args.paths else None, args.controls,
                 log=lambda *a: print(*a, file=sys.stderr, flush=True), save=save,
                 deadline=None if args.seconds is None else t0 + args.seconds)
    report.update(meta, complete=True)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    bad = sum(r["stale"] + r["reused"] + r["other"] for r in report["paths"].values())
    report["failures"] = bad
    print(table(report))
    print(f"{sum(r['trials'] for r in report['paths'].values())} trials, {bad} stale or "
          f"corrupt reads, {report['seconds']} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    controls_ok = all(r["trials"] > r["ok"] for r in report["controls"].values())
    for path in report["errors"]:
        print(f"{path}: did not complete (error above)")
    return 0 if bad == 0 and controls_ok and not report["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
