"""Where the 57th pending import of a busy producer blocks the host (issue
39; benchmarks/results/h200-2026-12-06-hostread.txt: index 56, stock too).
Every thread's stack while an import blocks (gdb, else eu-stack, else each
thread's /proc wchan and syscall), for stock jax.dlpack.from_dlpack and the
overlay's CAI import; then the first blocking index with 1, 2 and 4 of
PJRT's ready streams handed to jaxlib's import.  GPU only.

    python benchmarks/probe_import_bound.py
"""
import os, shutil, subprocess, sys, threading, time
import cupy as cp
import jax, jax.numpy as jnp
import jax_overlay
sys.path.insert(0, "tests/gpu")
from jax_overlay.doctor import spin_fill
pid = os.getpid()
import ctypes
ctypes.CDLL(None).prctl(0x59616d61, ctypes.c_ulong(-1 & 0xffffffffffffffff), 0, 0, 0)  # PR_SET_PTRACER_ANY: gdb, our child, may attach
def dump(tag):
    out = [f"== {tag}"]
    gdb = shutil.which("gdb"); eu = shutil.which("eu-stack")
    if gdb:
        r = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt 25"], capture_output=True, text=True, timeout=60)
        out.append(r.stdout[-20000:] + r.stderr[-2000:])
    elif eu:
        r = subprocess.run([eu, "-p", str(pid)], capture_output=True, text=True, timeout=60)
        out.append(r.stdout[-20000:])
    else:
        for tid in sorted(os.listdir(f"/proc/{pid}/task")):
            try:
                w = open(f"/proc/{pid}/task/{tid}/wchan").read()
                sc = open(f"/proc/{pid}/task/{tid}/syscall").read().split()[:3]
                nm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            except OSError as e:
                w, sc, nm = str(e), [], "?"
            out.append(f"{tid} {nm} wchan={w} syscall={sc}")
    print("\n".join(out), flush=True)
s = cp.cuda.Stream(non_blocking=True)
arrays = [cp.zeros(256, cp.float32) for _ in range(100)]
cp.cuda.Device().synchronize()
x0 = jax_overlay.from_dlpack(arrays[0]); float(jnp.sum(x0))
print("tools:", shutil.which("gdb"), shutil.which("eu-stack"), shutil.which("py-spy"), flush=True)
for name, fn in (("stock", jax.dlpack.from_dlpack), ("overlay cai", jax_overlay.from_cuda_array_interface)):
    spin_fill(cp.empty(1, cp.float32), 0.0, ms=4000.0, stream=s)
    kept, where = [], {}
    state = {"i": 0, "t": time.perf_counter()}
    stop = threading.Event()
    def watch():
        while not stop.is_set():
            if time.perf_counter() - state["t"] > 0.3:
                dump(f"{name}: import {state['i']} has taken 300 ms")
                return
            time.sleep(0.02)
    th = threading.Thread(target=watch); th.start()
    with s:
        for i, a in enumerate(arrays):
            state["i"], state["t"] = i, time.perf_counter()
            kept.append(fn(a))
    stop.set(); th.join()
    s.synchronize()
    print(name, "done", flush=True)

# One ready stream for every import (jaxlib takes any of its ready streams):
# where does the first import block?  (4 streams, round robin: index 56.)
from jax_overlay import _runtime as rt, _xla_ext as ext
dev = jax.devices("cuda")[0]
for nstreams in (1, 2, 4):
    streams = [rt.ready_stream(dev) for _ in range(4)][:nstreams]
    spin_fill(cp.empty(1, cp.float32), 0.0, ms=3000.0, stream=s)
    for st in streams:
        ext.order_after(0, s.ptr, st)
    kept, first = [], None
    for i, a in enumerate(arrays):
        t0 = time.perf_counter()
        kept.append(rt.capsule_to_array(a.__dlpack__(), dev, streams[i % nstreams], None, 2))
        if first is None and time.perf_counter() - t0 > 0.2:
            first = i
    s.synchronize()
    print(f"{nstreams} ready stream(s): first import over 200 ms at index {first}", flush=True)
