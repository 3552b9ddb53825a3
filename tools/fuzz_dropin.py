#!/usr/bin/env python3
"""Long runs of the drop-in differential fuzz (tests/fuzz_dropin.py).

    python tools/fuzz_dropin.py --seed 7 --cases 100000 --devices 2 --x64 both --jobs 2
    python tools/fuzz_dropin.py --seed 7 --case 12345 --devices 2 --x64 1   # replay one
    python tools/fuzz_dropin.py --gpu --cases 30000 --jobs 6 --budget 480 --json OUT
    python tools/fuzz_dropin.py --gpu torch --seed 7 --case 12345 --x64 1   # replay one
    python tools/fuzz_dropin.py --sum RUN.json RUN2.json   # committed runs added up

JAX fixes its device count when its backend starts, so this process never
imports JAX: every case runs in a worker subprocess started with
JAX_PLATFORMS=cpu and XLA_FLAGS=--xla_force_host_platform_device_count=N.
--gpu runs the GPU producer families instead (tests/gpu/fuzz_gpu.py: cupy,
torch, numba, or those named), each from its own case stream, on the
machine's GPUs; it exits 2 at once where JAX has no usable GPU.  --budget
stops starting cases that many seconds in (the figures say how many ran).
A worker that dies (a segfault) is itself a finding, reported with the
reproducer of the case it was running.  Exits 1 when anything differs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
GPU_FAMILIES = ("cupy", "torch", "numba")


def _env(devices, gpu=False):
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    if gpu:  # JAX's default backend, the GPU; XLA takes memory as it needs it, beside
        # the producers' libraries and the other workers on the same GPU
        return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p),
                    XLA_PYTHON_CLIENT_PREALLOCATE="false",
                    TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   os.environ.get("XLA_FLAGS", ""))
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
                PYTHONPATH=os.pathsep.join(p for p in path if p),
                # XLA's C++ warnings (odd CAI versions) would bury the report.
                TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))


def _gpu_unusable():
    """None where JAX has a usable GPU in the workers' environment, else why
    not (the doctor's own test, asked in a subprocess: this one has no JAX)."""
    probe = "from jax_overlay.doctor import gpu_skip_reason as r; print(r() or '')"
    try:
        out = subprocess.run([sys.executable, "-c", probe], env=_env(1, gpu=True), cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "the GPU probe did not answer in 300 s"
    if out.returncode:
        return (out.stderr.strip().splitlines() or [f"the GPU probe exited {out.returncode}"])[-1]
    return out.stdout.strip() or None


def _reproducer(args, family, x64, index):
    """fuzz_dropin.reproducer's line, made here without JAX."""
    if family:
        return (f"python tools/fuzz_dropin.py --gpu {family} --seed {args.seed} --case {index} "
                f"--x64 {x64}")
    return (f"python tools/fuzz_dropin.py --seed {args.seed} --case {index} "
            f"--devices {args.devices} --x64 {x64}")


# --- worker (a subprocess: imports JAX) ----------------------------------------

def _worker(args):
    sys.path.insert(0, str(ROOT / "tests"))  # before tools/: this file has the same name
    import jax
    import jaxlib
    import ml_dtypes
    import numpy as np
    import fuzz_dropin as F

    if args.family:
        sys.path.insert(0, str(ROOT / "tests" / "gpu"))
        import fuzz_gpu  # registers the GPU families
    elif jax.device_count() != args.devices:
        sys.exit(f"fuzz_dropin worker: {jax.device_count()} devices, asked for {args.devices}")
    with open(args.progress, "w") as progress:
        def mark(i, side):  # the case, and its side, a crash interrupted
            progress.seek(0)
            progress.write(f"{i:>20} {side:<9}\n")
            progress.flush()
        out = F.run_range(args.seed, args.start, args.cases, args.x64, stop_after=args.stop_after,
                          allow_version_minor=args.allow_version_minor, record=args.verbose,
                          progress=mark, family=args.family, until=args.until)
    for i, text in enumerate(out["records"]):  # a replay: the whole description
        c = F.case(args.seed, args.start + i, args.family)
        print(f"{F.reproducer(c, args.x64)}\n{text}", flush=True)
    out["ranges"] = [[args.family, int(args.x64), args.start, out["cases"]]]
    out["versions"] = {"python": platform.python_version(), "jax": jax.__version__,
                       "jaxlib": jaxlib.__version__, "numpy": np.__version__,
                       "ml_dtypes": ml_dtypes.__version__,
                       "jaxlib_extension_version": F.jaxlib_extension_version}
    if args.family:
        out["versions"].update(fuzz_gpu.versions(), devices=[str(d) for d in jax.devices()])
    pathlib.Path(args.worker).write_text(json.dumps(out))


# --- parent ----------------------------------------------------------------------

def _spawn(args, tmp, name, family, x64, start, count, verbose=False):
    """A worker for cases [start, start + count) (of `family`'s stream, if
    one); `verbose` prints each."""
    out, progress, log = (pathlib.Path(tmp) / f"{name}.{k}" for k in ("json", "progress", "log"))
    cmd = [sys.executable, __file__, "--worker", str(out), "--progress", str(progress),
           "--seed", str(args.seed), "--start", str(start), "--cases", str(count),
           "--devices", str(args.devices), "--x64", str(x64)]
    if family:
        cmd += ["--family", family]
    if args.until:
        cmd += ["--until", repr(args.until)]
    if verbose:
        cmd.append("--verbose")
    if args.stop_after:
        cmd += ["--stop-after", str(args.stop_after)]
    if args.allow_version_minor:
        cmd.append("--allow-version-minor")
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env=_env(args.devices, bool(family)), cwd=ROOT, stderr=err,
                                stdout=None if verbose else subprocess.DEVNULL)
    return proc, out, progress, log, (args, tmp, name, family, x64, start, count, verbose)


def _collect(task):
    """The worker's figures.  A worker that died (a signal: a crash; else
    the harness's own failure) reports the case it was running as the
    finding, and the rest of its range (before it and after it) runs again
    in fresh workers."""
    proc, out, progress, log, spec = task
    rc = proc.wait()
    if out.exists():
        return json.loads(out.read_text())
    args, tmp, name, family, x64, start, count, verbose = spec
    text = progress.read_text().split() if progress.exists() else []
    at = int(text[0]) if text else start
    side = text[1] if len(text) > 1 else ""
    category = "crash" if rc < 0 else "worker error"
    detail = (f"killed by signal {-rc}" if rc < 0 else
              (log.read_text().strip().splitlines() or [""])[-1])
    where = _reproducer(args, family, x64, at)
    entry = {"reproducer": where, "case": f"worker exit status {rc}", "stock": "",
             "installed": "", "category": category, "detail": f"{detail} in the {side or '?'} run"}
    if category == "crash" and side == "stock":
        # Stock JAX itself crashed (jaxlib 0.10.1 executing a donated
        # buffer, after earlier cases): stock's unsafe outcome, listed, not
        # a difference; the installed run of that case did not happen.
        parts = [{"cases": 1, "seconds": 0.0,
                  "counts": {"stock unsafe": 1, "stock unsafe: crashed": 1},
                  "differences": [], "stock unsafe": [entry]}]
    else:
        parts = [{"cases": int(category == "crash"), "seconds": 0.0,
                  "counts": {f"difference: {category}": 1}, "differences": [entry]}]
    if category == "crash":
        for lo, n in ((start, at - start), (at + 1, start + count - at - 1)):
            if n > 0:
                parts.append(_collect(_spawn(args, tmp, f"{name}.{lo}", family, x64, lo, n,
                                             verbose)))
    return _merge(parts)


def _merge(parts):
    total = {"cases": 0, "counts": collections.Counter(), "differences": [], "stock unsafe": [],
             "allowed": [], "records": [], "ranges": [], "seconds": 0.0}
    for p in parts:
        total["cases"] += p["cases"]
        total["counts"].update(p["counts"])
        total["seconds"] += p["seconds"]
        for k in ("differences", "stock unsafe", "allowed", "records", "ranges"):
            total[k] += p.get(k, [])
        total["versions"] = p.get("versions") or total.get("versions")
    return total


def summary(t):
    c = t["counts"]
    allowed = sum(v for k, v in c.items() if k.startswith("allowed"))
    return (f"fuzz_dropin: {t['cases']} cases, {len(t['differences'])} differences (stock raised "
            f"{c['stock raised']}, installed works where stock raised "
            f"{c['installed works where stock raised']}, stock unsafe {c['stock unsafe']}, "
            f"allowed {allowed})")


def sum_runs(paths):
    """The figures of several committed runs (--json files) added up, once
    their case ranges are checked not to overlap: a long GPU run made of
    calls in several sessions, each its own seed or start.  A ValueError
    names the files whose ranges overlap."""
    parts, seen = [], {}
    for path in paths:
        run = json.loads(pathlib.Path(path).read_text())
        run.setdefault("records", [])
        for family, x64, start, count in run.get("ranges", []):
            key = (run.get("seed"), family, x64)
            for other, (s0, n0) in seen.get(key, []):
                if start < s0 + n0 and s0 < start + count:
                    raise ValueError(f"{path} and {other} both ran cases {max(start, s0)}.. of "
                                     f"seed {key[0]}, family {family}, x64 {x64}: sum runs "
                                     "of distinct seeds or starts")
            seen.setdefault(key, []).append((path, (start, count)))
        run["counts"] = collections.Counter(run.get("counts", {}))
        parts.append(run)
    return _merge(parts)


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--sum"]:  # python tools/fuzz_dropin.py --sum RUN.json...
        total = sum_runs(argv[1:])
        print(summary(total) + f" over {len(argv) - 1} runs")
        return 1 if total["differences"] else 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--cases", type=int, default=1000, help="cases per x64 mode")
    ap.add_argument("--devices", type=int, choices=(1, 2), default=1)
    ap.add_argument("--x64", choices=("0", "1", "both"), default="both")
    ap.add_argument("--case", type=int, help="replay this one case, verbosely")
    ap.add_argument("--jobs", type=int, default=1, help="parallel worker processes")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--stop-after", type=int, help="stop after this many differences")
    ap.add_argument("--allow-version-minor", action="store_true",
                    help="count a DLPack minor version other than stock's, do not fail it")
    ap.add_argument("--gpu", nargs="?", const=",".join(GPU_FAMILIES), metavar="FAMILIES",
                    help=f"the GPU producer families instead (comma-separated; default all: "
                         f"{','.join(GPU_FAMILIES)}); --cases is per family and x64 mode")
    ap.add_argument("--budget", type=float,
                    help="start no case after this many seconds (GPU runs: one call's limit)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--family", help=argparse.SUPPRESS)
    ap.add_argument("--until", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--progress", help=argparse.SUPPRESS)
    ap.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.x64 = bool(int(args.x64))
        return _worker(args)

    t0 = time.perf_counter()
    args.until = time.time() + args.budget if args.budget else None
    modes = (0, 1) if args.x64 == "both" else (int(args.x64),)
    families = [None]
    if args.gpu is not None:
        families = args.gpu.split(",")
        unknown = set(families) - set(GPU_FAMILIES)
        if unknown:
            ap.error(f"--gpu: unknown families {sorted(unknown)}; known: {','.join(GPU_FAMILIES)}")
        why = _gpu_unusable()
        if why:
            print(f"fuzz_dropin --gpu: no GPU is usable here, nothing was run: {why}",
                  file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory() as tmp:
        if args.case is not None:
            work = [(f, x64, args.case, 1) for f in families for x64 in modes]
        elif args.gpu is None:
            per = -(-args.cases // args.jobs)
            work = [(None, x64, s, min(per, args.start + args.cases - s)) for x64 in modes
                    for s in range(args.start, args.start + args.cases, per)]
        else:  # about one worker per job, every family and mode among the first ones
            per = -(-args.cases // max(1, args.jobs // (len(families) * len(modes))))
            work = [(f, x64, s, min(per, args.start + args.cases - s))
                    for s in range(args.start, args.start + args.cases, per)
                    for f in families for x64 in modes]
        parts, running = [], []
        for n, (family, x64, start, count) in enumerate(work):
            if len(running) == args.jobs:
                parts.append(_collect(running.pop(0)))
            running.append(_spawn(args, tmp, n, family, x64, start, count, args.case is not None))
            if args.case is not None:  # replays print in order
                parts.append(_collect(running.pop()))
        parts += [_collect(t) for t in running]
    total = _merge(parts)
    if args.stop_after:
        total["differences"] = total["differences"][:args.stop_after]
    total.update(seed=args.seed, start=args.start, devices=args.devices, x64=args.x64,
                 gpu=args.gpu, budget=args.budget, wall_seconds=round(time.perf_counter() - t0, 2),
                 seconds_per_case=round(total["seconds"] / max(total["cases"], 1), 5))
    if args.case is None:
        for d in total["differences"][:50]:
            print(f"{d['reproducer']}\n  {d['case']}\n  stock:     {d['stock']}\n"
                  f"  installed: {d['installed']}\n  [{d['category']}] {d['detail']}")
        if len(total["differences"]) > 50:
            print(f"... and {len(total['differences']) - 50} more (--json has them all)")
    for k, v in sorted(total["counts"].items()):  # what did not run, and why; GPU states
        if k.startswith(("not run", "skipped", "in flight")):
            print(f"  {v:>8} {k}")
    not_run = sum(v for k, v in total["counts"].items() if k.startswith("not run"))
    if not_run:  # "cases" counts them: these ran stock and installed
        print(f"  {total['cases'] - not_run:>8} cases judged")
    cats = collections.Counter(d["category"] for d in total["differences"])
    if cats:
        print("differences by category: " + ", ".join(f"{k} {v}" for k, v in cats.most_common()))
    print(summary(total) + f" in {total['wall_seconds']} s "
          f"({1000 * total['seconds_per_case']:.2f} ms per case in a worker)")
    if args.json:
        total.pop("records")
        pathlib.Path(args.json).write_text(json.dumps(total, indent=1, default=str))
    return 1 if total["differences"] else 0


if __name__ == "__main__":
    sys.exit(main())
