#!/usr/bin/env python3
"""Is the 57th-pending-import bound CUDA's or XLA's?  (issue 39)

jaxlib's import with a stream records the definition event there and queues
one host callback behind it (XLA's LocalDeviceState::AllocateAndRecordEvent:
an event record, then ThenExecuteCallback, a cuLaunchHostFunc on a callback
stream made to wait for it).  The same primitives with nothing of XLA's,
behind one long kernel: how many calls return before the kernel ends, for
  hostfunc      cuLaunchHostFunc on the busy stream itself
  hostfunc x4   on 4 streams that each wait for it (an event)
  event only    cuEventRecord + cuStreamWaitEvent on 4 waiting streams
and stock jax.dlpack.from_dlpack's imports as the reference.  GPU only.

    python benchmarks/probe_hostfunc_bound.py [--n 300]
"""
import argparse
import ctypes
import json
import sys
import time

import cupy as cp

sys.path.insert(0, ".")
from jax_overlay.doctor import spin_fill  # noqa: E402

HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_done = []


@HOSTFN
def _noop(_):
    _done.append(1)


def first_wait(calls, slow_s=0.2):
    """Index of the first call that took over slow_s (the host waited for
    the kernel), or None; and the longest call in ms."""
    first, longest = None, 0.0
    for i, call in enumerate(calls):
        t = time.perf_counter()
        call()
        dt = time.perf_counter() - t
        longest = max(longest, dt)
        if first is None and dt > slow_s:
            first = i
    return first, round(longest * 1e3, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--ms", type=float, default=3000.0)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    cu = ctypes.CDLL("libcuda.so.1")
    for f in ("cuLaunchHostFunc", "cuEventRecord", "cuStreamWaitEvent", "cuEventCreate"):
        getattr(cu, f).restype = ctypes.c_int
    busy = cp.cuda.Stream(non_blocking=True)
    waiters = [cp.cuda.Stream(non_blocking=True) for _ in range(4)]
    scratch = cp.zeros(1, cp.float32)
    cp.cuda.Device().synchronize()

    def check(rc, what):
        if rc:
            raise RuntimeError(f"{what}: CUresult {rc}")

    def event():
        e = ctypes.c_void_p()
        check(cu.cuEventCreate(ctypes.byref(e), 2), "cuEventCreate")  # disable timing
        return e

    def hostfunc(stream):
        return lambda: check(cu.cuLaunchHostFunc(ctypes.c_void_p(stream.ptr), _noop, None),
                             "cuLaunchHostFunc")

    def record_wait(i):
        def call():
            e = event()
            check(cu.cuEventRecord(e, ctypes.c_void_p(busy.ptr)), "cuEventRecord")
            w = waiters[i % 4]
            check(cu.cuStreamWaitEvent(ctypes.c_void_p(w.ptr), e, 0), "cuStreamWaitEvent")
        return call

    def hostfunc_behind(i):
        rw = record_wait(i)

        def call():
            rw()
            hostfunc(waiters[i % 4])()
        return call

    cases = {
        "hostfunc": [hostfunc(busy) for _ in range(a.n)],
        "hostfunc x4": [hostfunc_behind(i) for i in range(a.n)],
        "event only": [record_wait(i) for i in range(a.n)],
    }
    out = {}
    for name, calls in cases.items():
        spin_fill(scratch, 1.0, ms=a.ms, stream=busy)
        first, longest = first_wait(calls)
        out[name] = {"first_wait_index": first, "longest_ms": longest,
                     "kernel_still_running": not busy.done}
        cp.cuda.Device().synchronize()
        print(name, out[name], flush=True)
    import jax
    import jax.numpy as jnp
    arrays = [cp.zeros(256, cp.float32) for _ in range(64)]
    cp.cuda.Device().synchronize()
    float(jnp.sum(jax.dlpack.from_dlpack(arrays[0])))
    kept = []
    spin_fill(scratch, 1.0, ms=a.ms, stream=busy)
    with busy:
        first, longest = first_wait(
            [lambda i=i: kept.append(jax.dlpack.from_dlpack(arrays[i % 64])) for i in range(a.n)])
    out["stock jax.dlpack.from_dlpack"] = {"first_wait_index": first, "longest_ms": longest}
    print("stock jax.dlpack.from_dlpack", out["stock jax.dlpack.from_dlpack"], flush=True)
    cp.cuda.Device().synchronize()
    out["meta"] = {"gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                   "driver": cp.cuda.runtime.driverGetVersion(), "jax": jax.__version__,
                   "n": a.n, "kernel_ms": a.ms}
    if a.json:
        open(a.json, "w").write(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
