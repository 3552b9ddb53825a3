"""Where one synchronised copy's time goes, by size: stock JAX's own device
copy (a jitted x * 2, same bytes read and written as memcpy) against
jax_overlay's strided import, each split into the call (until it returns)
and the wait (block_until_ready), next to memcpy by CUDA events; then the
strided import's steps one by one, and the copy=True import's beside
stock JAX's own (small arrays: the host's cost per call).

    python benchmarks/probe_call_cost.py [--repeats 15] [--json F]
"""

from __future__ import annotations

import statistics

import harness  # first: XLA's allocator setting, before jax loads

import cupy as cp
import jax
import jax.numpy as jnp

import jax_overlay
from _internals import _runtime as rt, _strided, _vocab, _xla_ext as ext

SIZES = [16 << 10, 4 << 20, 64 << 20, 256 << 20, 1 << 30]


def split(fn, repeats):
    """Median (call, wait, total) seconds of fn() then block_until_ready,
    the device idle before each."""
    fn().block_until_ready()
    calls, waits, totals = [], [], []
    for _ in range(repeats):
        cp.cuda.runtime.deviceSynchronize()
        t0 = harness.clock()
        r = fn()
        t1 = harness.clock()
        r.block_until_ready()
        t2 = harness.clock()
        del r
        calls.append((t1 - t0) / 1e9)
        waits.append((t2 - t1) / 1e9)
        totals.append((t2 - t0) / 1e9)
    return [statistics.median(v) for v in (calls, waits, totals)]


def each(fn, calls=2000):
    """Median over 5 rounds of the mean host time of fn() (us), after 50
    untimed calls; the device drained after each round."""
    for _ in range(50):
        fn()
    return harness.median_per_call_us(fn, calls, 5, after_round=cp.cuda.runtime.deviceSynchronize)


def parts():
    """The strided import's steps, each on its own (small array: the host
    cost of a step does not depend on the size)."""
    v = cp.ones((16, 256), cp.float32)[:, ::2]
    cai = v.__cuda_array_interface__
    plan = ext.plan_cai_import(cai, v, False)
    view, ordinal, range_start, dl_type = plan.view, plan.ordinal, plan.range_start, plan.device_type
    device = rt.gpu_device(ordinal)
    base, count, unit, offset = _strided.plan(view.data, view.low, view.span, view.itemsize,
                                              range_start, _vocab.GPU_ALIGNMENT)

    def capsule():
        return ext.raw_capsule(v, base, [count], None, "<f4", dl_type, ordinal)
    envelope = rt.capsule_to_array(capsule(), device, None, None, dl_type)
    plan = _strided.kernel_plan(v.shape, [s // 4 for s in cai["strides"]], offset, 4, unit)
    fn = _strided._kernel_fn(v.shape, v.dtype, plan)
    x = jnp.ones(v.shape, jnp.float32)
    w = cp.ones(v.shape, cp.float32)  # compact: the copy=True rows
    double = jax.jit(lambda y: y * 2)
    ready = double(x).block_until_ready()
    rows = {
        "whole import": lambda: jax_overlay.from_cuda_array_interface(v),
        "plan_cai_import": lambda: ext.plan_cai_import(cai, v, False),
        "order_after (a ready stream)": lambda: ext.order_after(ordinal, view.stream or 1,
                                                                rt.ready_stream(device)),
        "raw_capsule": capsule,
        "capsule + jaxlib import": lambda: rt.capsule_to_array(capsule(), device, None, None,
                                                               dl_type),
        "gather() on a ready envelope": lambda: _strided.gather(
            envelope, device, v.shape, (256, 2), offset, v.dtype, unit),
        "kernel jit call alone": lambda: fn(envelope),
        "stock jit y * 2, same size": lambda: double(x),
        "block_until_ready, ready array": ready.block_until_ready,
        "copy=True import (DLPack)": lambda: jax_overlay.from_dlpack(w, copy=True),
        "stock jax.dlpack.from_dlpack(a, copy=True)": lambda: jax.dlpack.from_dlpack(w, copy=True),
        "zero-copy import (DLPack)": lambda: jax_overlay.from_dlpack(w),
        "device_put copy of a fresh import": lambda: jax.device_put(
            jax_overlay.from_dlpack(w), ready.sharding, may_alias=False),
        "device_put copy of a held array": lambda: jax.device_put(ready, ready.sharding,
                                                                  may_alias=False),
    }
    out = {}
    for k, f in rows.items():
        try:
            out[k] = each(f)
        except Exception as err:  # noqa: BLE001
            out[k] = None
            print(f"  {k}: {type(err).__name__}: {err}"[:200])
    return out


def main():
    args = harness.arguments(__doc__, json_file=True, repeats=15).parse_args()
    env = harness.allocator()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {env}")
    double = jax.jit(lambda x: x * 2)
    rows = {"env": env, "sizes": {}, "parts_us": parts()}
    for k, us in rows["parts_us"].items():
        print(f"  {k:<44} {us and round(us, 2)} us")
    for size in SIZES:
        n = size // 4
        src, dst = cp.ones(n, cp.float32), cp.empty(n, cp.float32)
        stream = cp.cuda.Stream(non_blocking=True)
        memcpy_ev = harness.event_seconds(lambda s: cp.cuda.runtime.memcpyAsync(
            dst.data.ptr, src.data.ptr, size, cp.cuda.runtime.memcpyDeviceToDevice, s.ptr),
            stream, args.repeats)
        x = jnp.ones(n, jnp.float32)
        strided = cp.ones((n // 1024, 2048) if n >= 1024 else (1, 2 * n), cp.float32)[:, ::2]
        got = {
            "memcpy (events)": [0, 0, memcpy_ev],
            "stock jit x * 2": split(lambda: double(x), args.repeats),
            "strided import (kernel)": split(
                lambda: jax_overlay.from_cuda_array_interface(strided), args.repeats),
        }
        jax_overlay.config.strided_kernel = False
        got["strided import (gather)"] = split(
            lambda: jax_overlay.from_cuda_array_interface(strided), args.repeats)
        jax_overlay.config.strided_kernel = True
        rows["sizes"][size] = got
        print(f"{size:>11} B  " + "; ".join(
            f"{k}: call {c * 1e6:.1f} + wait {w * 1e6:.1f} = {t * 1e6:.1f} us"
            for k, (c, w, t) in got.items()))
        del src, dst, x, strided
        cp.get_default_memory_pool().free_all_blocks()
    rows["meta"] = harness.meta()
    harness.save(args.json, rows)


if __name__ == "__main__":
    main()
