"""What each step of a DLPack conversion costs on the GPU, and which steps
wait on the host for a pending JAX array.  Run on a GPU machine:

    python benchmarks/probe_dlpack.py [--json out.json]
"""

from __future__ import annotations

import harness  # first: XLA's allocator setting, before jax loads

import cupy as cp
import jax
import jax.numpy as jnp
import torch
from jax import lax

import jax_overlay
from _internals import (JAX_N as N, _cai as C, _dlpack as D, _dlpack as E, _runtime as rt, _xla_ext as ext,
                        cupy_stream, jax_fill, spin_fill)


def very_slow(k):
    return jax_fill(k, steps=20000)


@jax.jit
def constant_seeded(k):
    """The suite's old producer: its loop starts from a constant."""
    v = lax.fori_loop(0, 20000, lambda i, v: jnp.sqrt(v * v + 1.0) - 0.5,
                      jnp.full(N, 1.0, jnp.float32))
    return jnp.where(v > -1e30, k, 0.0).astype(jnp.float32)


def ms_to_ready(fn, k):
    fn(k).block_until_ready()
    t0 = harness.clock()
    fn(k + 1.0).block_until_ready()
    return harness.since_ms(t0)


def us(fn, arg):
    return round(harness.median_us(fn, arg, repeats=300, rounds=5), 2)


def main():
    args = harness.arguments(__doc__, json_file=True).parse_args()
    res = {}
    dev = jax.devices("cuda")[0]
    compute = rt.compute_stream(dev)
    a = cp.arange(1 << 20, dtype=cp.float32)
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()

    # How long the producers run, dispatch to ready.
    res["ms: jax_fill(steps=300)"] = ms_to_ready(jax_fill, 0.0)
    res["ms: jax_fill(steps=20000)"] = ms_to_ready(very_slow, 0.0)
    res["ms: constant-seeded 20000 steps"] = ms_to_ready(constant_seeded, 0.0)
    # Which steps wait for a pending array?
    steps = {
        "dispatch only": lambda x: None,
        "compute stream idle right after dispatch": lambda x: ext.stream_idle(0, compute),
        "unsafe_buffer_pointer": lambda x: x.unsafe_buffer_pointer(),
        "_pjrt_layout": lambda x: x._pjrt_layout,
        "to_dlpack(stream=-1)": lambda x: E.to_dlpack(x, stream=-1),
        "to_dlpack(stream=1)": lambda x: E.to_dlpack(x, stream=1),
        "cai property (installed)": lambda x: C.cuda_array_interface(x),
        "jaxlib export stream=1": lambda x: rt.order_stream_after(x, 1),
        "torch.from_dlpack installed": lambda x: torch.from_dlpack(x),
        "cupy.from_dlpack installed": lambda x: cp.from_dlpack(x),
    }
    jax_overlay.install()
    for name, fn in steps.items():
        x = very_slow(1.0)
        t0 = harness.clock()
        out = fn(x)
        dt = harness.since_ms(t0)
        res[f"wait: {name}"] = {"ms": dt, "ready after": x.is_ready(),
                                "result": out if isinstance(out, bool) else None}
        x.block_until_ready()
    jax_overlay.uninstall()
    # How long after dispatch does the compute stream become busy?
    lags = []
    for _ in range(5):
        x = very_slow(2.0)
        t0 = harness.clock()
        while ext.stream_idle(0, compute) and harness.clock() - t0 < 1_000_000_000:
            pass
        lags.append(round((harness.clock() - t0) / 1e3, 1))
        x.block_until_ready()
    res["us from dispatch return until compute stream busy"] = lags

    # Stale-read detector: a raw view read on a non-blocking stream.
    s = cp.cuda.Stream(non_blocking=True)
    stale = 0
    for k in range(1, 11):
        x = very_slow(float(k))
        mem = cp.cuda.UnownedMemory(x.unsafe_buffer_pointer(), N * 4, x)
        with s:
            c = cp.ndarray((N,), cp.float32, cp.cuda.MemoryPointer(mem, 0))
            stale += float(c.min()) != k
        x.block_until_ready()
    res["raw unordered reads stale (of 10)"] = stale

    # Does any call block the host while the producer is busy, and after how
    # many calls?  3000 calls behind a 1.5 s kernel on the producer's stream.
    cs = cp.cuda.Stream(non_blocking=True)
    ts = torch.cuda.Stream()
    small_a = cp.zeros(256, cp.float32)
    small_t = torch.zeros(256, device="cuda")
    torch.cuda.synchronize()

    def busy_cupy():
        spin_fill(cp.empty(1, cp.float32), 0.0, ms=1500.0, stream=cs)
        return cs, lambda: cs.done

    def busy_torch():
        with torch.cuda.stream(ts):
            torch.cuda._sleep(3_000_000_000)
        return ts, lambda: not ts.query()

    compute_ext = cupy_stream(cp, compute)

    def cupy_style_sync(timing):
        """What CuPy's __dlpack__ does per call: a new event on its current
        stream, and a wait for it on the consumer's stream."""
        ev = cp.cuda.Event(disable_timing=not timing)
        ev.record(cs)
        compute_ext.wait_event(ev)
        return ev

    scans = [
        ("cupy-style sync, events with timing", busy_cupy, cs, lambda: cupy_style_sync(True)),
        ("cupy-style sync, events without timing", busy_cupy, cs, lambda: cupy_style_sync(False)),
        ("cupy __dlpack__(stream=compute)", busy_cupy, cs,
         lambda: small_a.__dlpack__(stream=compute, max_version=(1, 1))),
        ("jax_overlay.from_dlpack(cupy)", busy_cupy, cs, lambda: jax_overlay.from_dlpack(small_a)),
        ("jax_overlay.from_cuda_array_interface(cupy)", busy_cupy, cs,
         lambda: jax_overlay.from_cuda_array_interface(small_a)),
        ("torch __dlpack__(stream=compute)", busy_torch, None,
         lambda: small_t.__dlpack__(stream=compute, max_version=(1, 1))),
        ("jax_overlay.from_dlpack(torch)", busy_torch, None, lambda: jax_overlay.from_dlpack(small_t)),
    ]
    for name, make_busy, cstream, call in scans:
        keep, slow_calls = [], []
        stream, _ = make_busy()
        ctx = cstream if cstream is not None else torch.cuda.stream(ts)
        t_all = harness.clock()
        with ctx:
            for i in range(3000):
                t0 = harness.clock()
                keep.append(call())
                dt = harness.clock() - t0
                if dt > 5_000_000:
                    slow_calls.append((i, round(dt / 1e6, 1)))
        total = (harness.clock() - t_all) / 1e9
        busy_after = (not stream.done) if stream is cs else (not stream.query())
        stream.synchronize()
        res[f"inflight scan: {name}"] = {
            "total ms": round(total * 1e3, 1), "producer busy after": busy_after,
            "calls over 5 ms": slow_calls[:5]}
        del keep

    # Costs of the import steps, idle producers.
    ptd = torch._C._cuda_getCurrentRawStream(0) if hasattr(torch._C, "_cuda_getCurrentRawStream") else None
    res["torch current raw stream"] = ptd
    for name, fn, arg in [
        ("cupy __dlpack__(stream=compute, v1.1)", lambda o: o.__dlpack__(stream=compute, max_version=(1, 1)), lambda: a),
        ("cupy __dlpack__(stream=1, v1.1)", lambda o: o.__dlpack__(stream=1, max_version=(1, 1)), lambda: a),
        ("cupy __dlpack__(stream=-1, v1.1)", lambda o: o.__dlpack__(stream=-1, max_version=(1, 1)), lambda: a),
        ("cupy get_current_stream().ptr", lambda o: cp.cuda.get_current_stream().ptr, lambda: a),
        ("cupy __dlpack_device__", lambda o: o.__dlpack_device__(), lambda: a),
        ("torch __dlpack__(stream=compute, v1.1)", lambda o: o.__dlpack__(stream=compute, max_version=(1, 1)), lambda: t),
        ("torch __dlpack__(stream=1, v1.1)", lambda o: o.__dlpack__(stream=1, max_version=(1, 1)), lambda: t),
        ("torch __dlpack__(stream=-1, v1.1)", lambda o: o.__dlpack__(stream=-1, max_version=(1, 1)), lambda: t),
        ("torch __dlpack_device__", lambda o: o.__dlpack_device__(), lambda: t),
        ("torch _cuda_getCurrentRawStream", lambda o: torch._C._cuda_getCurrentRawStream(0), lambda: t),
        ("torch current_stream().cuda_stream", lambda o: torch.cuda.current_stream().cuda_stream, lambda: t),
        ("torch __cuda_array_interface__", lambda o: o.__cuda_array_interface__, lambda: t),
        ("cupy __cuda_array_interface__", lambda o: o.__cuda_array_interface__, lambda: a),
        ("capsule_info", ext.capsule_info, lambda: a.__dlpack__(stream=-1, max_version=(1, 1))),
        ("versioned_to_legacy", ext.versioned_to_legacy, lambda: a.__dlpack__(stream=-1, max_version=(1, 1))),
        ("jaxlib import of legacy capsule", lambda c: rt.capsule_to_array(c, dev, None, None, 2),
         lambda: a.__dlpack__(stream=-1)),
        ("_dlpack._request(cupy, compute)", lambda o: D._request(o, compute, None), lambda: a),
        ("plan_dlpack_import(cupy v1 capsule)", ext.plan_dlpack_import,
         lambda: a.__dlpack__(stream=-1, max_version=(1, 1))),
        ("_dlpack.import_dlpack(cupy)", D.import_dlpack, lambda: a),
        ("jax_overlay.from_dlpack(cupy)", jax_overlay.from_dlpack, lambda: a),
        ("jax_overlay.from_dlpack(torch)", jax_overlay.from_dlpack, lambda: t),
        ("jax_overlay.from_cuda_array_interface(cupy)", jax_overlay.from_cuda_array_interface, lambda: a),
        ("jax_overlay.from_cuda_array_interface(torch)", jax_overlay.from_cuda_array_interface, lambda: t),
        ("stock jax.device_put(jax view, dev)", lambda v: jax.device_put(v, dev), lambda: jax_overlay.from_dlpack(a)),
        ("stock jax.device_put(jax view)", lambda v: jax.device_put(v), lambda: jax_overlay.from_dlpack(a)),
    ]:
        try:
            res[f"us: {name}"] = us(fn, arg)
        except Exception as e:  # noqa: BLE001
            res[f"us: {name}"] = f"fails: {type(e).__name__}: {str(e)[:160]}"
    print(harness.listing(res))
    harness.save(args.json, dict(res, meta=harness.meta()))


if __name__ == "__main__":
    main()
