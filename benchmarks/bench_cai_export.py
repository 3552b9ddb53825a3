"""Median cost of the CAI export: the property and `cupy.asarray(jax_array)`
end to end, stock JAX vs jax_overlay, in one process.

    python benchmarks/bench_cai_export.py [--json out.json]
"""

from __future__ import annotations

import harness  # first: XLA's allocator setting, before jax loads

import cupy as cp
import jax
import jax.numpy as jnp
from jax import lax

import jax_overlay
from _internals import _runtime as rt, _xla_ext as ext


def median_us(fn, make_arg):
    return round(harness.median_us(fn, make_arg), 2)


def main():
    args = harness.arguments(__doc__, json_file=True).parse_args()
    x = jnp.arange(1 << 20, dtype=jnp.float32)
    x.block_until_ready()
    res = {}
    prop = lambda a: a.__cuda_array_interface__  # noqa: E731
    res["stock property (ready)"] = median_us(prop, lambda: x)
    res["stock cupy.asarray(jax) (ready)"] = median_us(cp.asarray, lambda: x)
    jax_overlay.install()
    res["jax_overlay property (ready)"] = median_us(prop, lambda: x)
    res["jax_overlay cupy.asarray(jax) (ready)"] = median_us(cp.asarray, lambda: x)

    @jax.jit
    def very_slow(v):
        return lax.fori_loop(0, 200000, lambda i, v: jnp.sqrt(v * v + 1.0) - 0.5, v)

    very_slow(x).block_until_ready()
    y = very_slow(x)  # seconds of GPU work: every export below finds it pending
    res["jax_overlay property (computation in flight)"] = median_us(prop, lambda: y)
    res["array still pending after the in-flight exports"] = not y.is_ready()
    y.block_until_ready()
    jax_overlay.uninstall()
    ptr = x.unsafe_buffer_pointer()
    floors = {
        "floor: x.unsafe_buffer_pointer()": lambda a: a.unsafe_buffer_pointer(),
        "floor: memory_kind(ptr)": lambda a: ext.memory_kind(ptr),
        "floor: x.is_ready()": lambda a: a.is_ready(),
        "floor: x.dtype": lambda a: a.dtype,
        "floor: x.shape": lambda a: a.shape,
        "floor: layout -> strides": lambda a: rt.byte_strides(a, 4),
        "floor: x._pjrt_layout": lambda a: getattr(a, "_pjrt_layout", None),
    }
    for name, fn in floors.items():
        res[name] = median_us(fn, lambda: x)
    res["has _pjrt_layout"] = hasattr(x, "_pjrt_layout")
    meta = harness.meta(gpu=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                        statistic=f"median of {harness.ROUNDS} round means of {harness.REPEATS} calls, us")
    harness.finish(harness.listing(res, ("case", "us")), args.json, {"meta": meta, "results_us": res})


if __name__ == "__main__":
    main()
